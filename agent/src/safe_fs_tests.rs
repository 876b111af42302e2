use std::io::{Read, Write};
use std::os::unix::fs::{symlink, PermissionsExt};

use super::*;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("motley-safe-fs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn file_names_the_format_makes_pass_and_nothing_else() {
    for ok in [
        "layer.00003.model.tp0-2.safetensors",
        "embed.optimizer.tp0-1.safetensors",
        "head.model.tp3-4.safetensors",
        "rank.00012.safetensors",
        "manifest.rank.00000.json",
        "manifest.json",
    ] {
        assert!(check_name(ok).is_ok(), "{ok}");
    }
    for bad in [
        "",
        "../layer.00003.model.tp0-2.safetensors",
        "../../../../etc/cron.d/x",
        "/etc/shadow",
        "shadow",
        "step-00000010/layer.00003.model.tp0-2.safetensors",
        "layer.3.model.tp0-2.safetensors",
        "layer.00003.weights.tp0-2.safetensors",
        "layer.00003.model.tp0-2.safetensors.tmp.77",
        "rank.1.safetensors",
        "rank.+0001.safetensors",
        "manifest.rank.00000.json.tmp.5",
        ".cloud.json",
        "agent.lock",
        "..",
    ] {
        let err = check_name(bad).unwrap_err().to_string();
        assert!(err.contains("not a checkpoint file name") && err.contains(&format!("{bad:?}")), "{bad}: {err}");
    }
}

#[test]
fn links_and_escapes_are_refused_at_every_step() {
    let dir = scratch("links");
    let outside = dir.join("outside");
    std::fs::create_dir_all(outside.join("step")).unwrap();
    std::fs::write(outside.join("secret"), "s3cret").unwrap();
    let mine = dir.join("mine");
    std::fs::create_dir_all(mine.join("ckpt")).unwrap();
    symlink(&outside, mine.join("ckpt/step-link")).unwrap();
    symlink(outside.join("secret"), mine.join("log")).unwrap();
    symlink(&outside, mine.join("up")).unwrap();
    let root = Dir::open(&mine).unwrap();
    for rel in ["ckpt/step-link", "ckpt/step-link/step", "up", "../outside", "ckpt/../../outside"] {
        let err = root.dir(rel).unwrap_err();
        assert!(matches!(err, AgentError::Unsafe { .. }), "{rel}: {err}");
        assert!(err.to_string().contains("symbolic link"), "{err}");
    }
    assert!(matches!(root.dir("/etc").unwrap_err(), AgentError::Unsafe { .. }));
    assert!(matches!(root.open_file("log").unwrap_err(), AgentError::Unsafe { .. }));
    assert!(matches!(root.open_file("ckpt/step-link/secret").unwrap_err(), AgentError::Unsafe { .. }));
    // A new file is never one that was there, nor through a link.
    assert!(root.create_new("log", 0o600).is_err());
    let ckpt = root.dir("ckpt").unwrap();
    assert!(ckpt.create_dir("step-link", 0o700).is_err(), "a link where a directory is to be made");
    let mut f = ckpt.create_new("x", 0o600).unwrap();
    f.write_all(b"made").unwrap();
    assert!(ckpt.create_new("x", 0o600).is_err(), "exclusive");
    ckpt.rename("x", "step-link").unwrap();
    let mut text = String::new();
    ckpt.open_file("step-link").unwrap().read_to_string(&mut text).unwrap();
    assert_eq!(text, "made", "the link was replaced, not followed");
    assert_eq!(std::fs::read_to_string(outside.join("secret")).unwrap(), "s3cret");
    assert!(matches!(ckpt.rename("step-link", "../escaped").unwrap_err(), AgentError::Unsafe { .. }));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_fifo_is_refused_without_hanging_and_a_tree_is_removed_without_following_links() {
    let dir = scratch("fifo");
    let fifo = std::ffi::CString::new(dir.join("rank-0.log").as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let root = Dir::open(&dir).unwrap();
    assert!(matches!(root.open_file("rank-0.log").unwrap_err(), AgentError::NotAFile { .. }));

    let outside = dir.join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("keep"), "k").unwrap();
    std::fs::create_dir_all(dir.join("tree/a/b")).unwrap();
    std::fs::write(dir.join("tree/a/b/f"), "f").unwrap();
    symlink(&outside, dir.join("tree/a/link")).unwrap();
    root.remove_tree("tree").unwrap();
    assert!(!dir.join("tree").exists());
    assert_eq!(std::fs::read_to_string(outside.join("keep")).unwrap(), "k", "the link's target stays");
    root.remove_tree("tree").unwrap(); // absent: fine
    let names: Vec<String> = root.entries().unwrap().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["outside", "rank-0.log"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_private_directory_someone_else_made_or_can_write_is_refused() {
    let dir = scratch("private");
    let fresh = dir.join("fresh");
    private_dir(&fresh, 0o711).unwrap();
    assert_eq!(std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o7777, 0o711);
    private_dir(&fresh, 0o711).expect("the agent's own, again");

    let open = dir.join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let err = private_dir(&open, 0o711).unwrap_err().to_string();
    assert!(err.contains("lets others write it") && err.contains("--shm-dir") && err.contains("open"), "{err}");
    assert_eq!(std::fs::metadata(&open).unwrap().permissions().mode() & 0o777, 0o777, "not taken over");

    let link = dir.join("link");
    symlink(&fresh, &link).unwrap();
    let err = private_dir(&link, 0o711).unwrap_err().to_string();
    assert!(err.contains("not a directory"), "{err}");

    assert!(private_dir(&dir.join("no/such/parent"), 0o711).is_err(), "not recursive");
    if euid() == 0 {
        let theirs = dir.join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
        let err = private_dir(&theirs, 0o711).unwrap_err().to_string();
        assert!(err.contains("belongs to uid 65534"), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_file_is_read_whole_only_within_its_limit_and_written_whole() {
    let dir = scratch("limit");
    let root = Dir::open(&dir).unwrap();
    root.write_atomic("piece.json", &[b'x'; 100]).unwrap();
    assert_eq!(std::fs::metadata(dir.join("piece.json")).unwrap().permissions().mode() & 0o777, 0o600);
    assert_eq!(root.read("piece.json", 100).unwrap().len(), 100);
    let err = root.read("piece.json", 99).unwrap_err().to_string();
    assert!(err.contains("over the 99 bytes"), "{err}");
    // A link at the name is replaced, its target untouched.
    std::fs::write(dir.join("target"), "t").unwrap();
    std::fs::remove_file(dir.join("piece.json")).unwrap();
    symlink(dir.join("target"), dir.join("piece.json")).unwrap();
    root.write_atomic("piece.json", b"new").unwrap();
    assert_eq!(std::fs::read_to_string(dir.join("target")).unwrap(), "t");
    assert_eq!(root.read("piece.json", 10).unwrap(), b"new");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A tree nested `depth` directories deep under `dir/name`, a file, a FIFO, a link to `outside`
/// and a name that is not UTF-8 every hundred levels; made through handles (its paths are far
/// longer than PATH_MAX).
pub(crate) fn deep_tree(dir: &Path, name: &str, depth: usize, outside: &Path) {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let mut cur = rustix::fs::open(dir, flags, Mode::empty()).unwrap();
    for level in 0..depth {
        let sub = if level == 0 { name } else { "d" };
        rustix::fs::mkdirat(&cur, sub, Mode::from_raw_mode(0o755)).unwrap();
        cur = rustix::fs::openat(&cur, sub, flags, Mode::empty()).unwrap();
        if level % 100 == 0 {
            let wr = OFlags::WRONLY | OFlags::CREATE | OFlags::CLOEXEC;
            drop(rustix::fs::openat(&cur, "f", wr, Mode::from_raw_mode(0o644)).unwrap());
            drop(rustix::fs::openat(&cur, c"\xff\xfe", wr, Mode::empty()).unwrap());
            rustix::fs::mknodat(&cur, "fifo", FileType::Fifo, Mode::from_raw_mode(0o600), 0).unwrap();
            rustix::fs::symlinkat(outside, &cur, "link").unwrap();
            rustix::fs::mkdirat(&cur, "side", Mode::from_raw_mode(0o755)).unwrap();
        }
    }
}

#[test]
fn a_tree_thousands_of_levels_deep_is_removed_without_recursion_or_following_links() {
    let dir = scratch("deep");
    let outside = dir.join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("keep"), "k").unwrap();
    deep_tree(&dir, "tree", 6000, &outside);
    let root = Dir::open(&dir).unwrap();
    // On a thread with a small stack: one frame per level would overflow it.
    let handle = std::thread::Builder::new().stack_size(64 << 10).spawn(move || root.remove_tree("tree")).unwrap();
    handle.join().unwrap().unwrap();
    assert!(!dir.join("tree").exists());
    assert_eq!(std::fs::read_to_string(outside.join("keep")).unwrap(), "k", "the links' target stays");
    std::fs::remove_dir_all(&dir).unwrap();
}
