//! The one rule for what the agent touches as root inside a directory a rank can write (its
//! launch directory, its checkpoint directories; docs/state.md): every path is opened relative
//! to a directory handle the agent opened itself, with `openat2(RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS)`, so a symbolic link, a `..` or an absolute path planted by a rank (or
//! swapped in between two calls) is refused instead of followed. The agent changes owner or
//! mode only of what it made itself (`mkdirat`, `O_CREAT | O_EXCL`), through the handle it made
//! it with (`fchown`, `fchmod`), never through a path. It reads what a rank wrote through such a
//! handle, a regular file only (a FIFO would hang the reader, a device is not a checkpoint).
//!
//! And the one check of a file name that comes from a manifest piece, a restore, a cloud marker
//! or a peer: `check_name`.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use motley_checkpoint::manifest::{piece_file_name, rank_file_name, unit_file_name, MANIFEST};
use motley_checkpoint::{Block, Part, UnitKey};
use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags, Stat};
use rustix::io::Errno;

use crate::error::{AgentError, Result};

/// Whether `name` is a file the checkpoint format puts in a step directory (a unit, a rank
/// file, a manifest piece, the merged manifest), spelled exactly as the format spells it: one
/// plain name, never `/`, `..`, a hidden or temporary file, or any other file of the node.
/// Every name from a manifest piece, a restore, a cloud marker or a peer's request passes here.
pub fn check_name(name: &str) -> Result<()> {
    let refuse = || Err(AgentError::FileName { name: name.into() });
    if name.len() > 255 || name.contains('/') || name.contains('\0') || name.contains("..") {
        return refuse();
    }
    if name == MANIFEST {
        return Ok(());
    }
    let number = |s: &str| if s.bytes().all(|b| b.is_ascii_digit()) { s.parse::<u32>().ok() } else { None };
    let canonical = if let Some(rank) = name.strip_prefix("manifest.rank.").and_then(|s| s.strip_suffix(".json")) {
        number(rank).map(piece_file_name)
    } else if let Some(rank) = name.strip_prefix("rank.").and_then(|s| s.strip_suffix(".safetensors")) {
        number(rank).map(rank_file_name)
    } else {
        unit_key(name).map(|k| unit_file_name(&k))
    };
    // Parsed and spelled again: only the format's own spelling (zero padding included) passes.
    if canonical.as_deref() == Some(name) {
        Ok(())
    } else {
        refuse()
    }
}

/// `layer.00003.model.tp0-2.safetensors` → its unit key.
fn unit_key(name: &str) -> Option<UnitKey> {
    let stem = name.strip_suffix(".safetensors")?;
    let (rest, tp) = stem.rsplit_once(".tp")?;
    let (block, part) = rest.rsplit_once('.')?;
    let (tp_rank, tp_size) = tp.split_once('-')?;
    let block = match block.strip_prefix("layer.") {
        Some(l) => Block::Layer(l.parse().ok()?),
        None => block.parse().ok()?,
    };
    Some(UnitKey { block, part: part.parse::<Part>().ok()?, tp_rank: tp_rank.parse().ok()?, tp_size: tp_size.parse().ok()? })
}

/// Every component a real directory or file beneath the handle: no link, no `..`, no `/`.
const RESOLVE: ResolveFlags = ResolveFlags::BENEATH.union(ResolveFlags::NO_SYMLINKS).union(ResolveFlags::NO_MAGICLINKS);

/// A directory opened without following a link at any step; what is under it is reached
/// through it, never by path again. `path` is for messages only.
#[derive(Debug)]
pub struct Dir {
    fd: OwnedFd,
    path: PathBuf,
}

/// How a file is written under a temporary name first (`Dir::write_renamed`, `write_once`).
#[derive(Debug, Clone, Copy)]
pub struct Temp {
    pub mode: u32,
    /// Given to this (uid, gid) before it takes its name: whoever reads it by name never finds
    /// it still the agent's.
    pub owner: Option<(u32, u32)>,
    /// Fsynced, file and directory: records, exit codes and markers must survive a power loss.
    pub durable: bool,
}

/// The agent's effective uid: what it made is its own.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// The directory `path` whose top `depth` components lie in a directory a rank can write:
/// the part above them is the agent's own (the work directory, the memory tier's root) and is
/// opened by path, the rest beneath it without following a link. A step directory
/// (`ROOT/jobs/J/G/ckpt/step-S`) is 5 deep, a launch directory (`ROOT/jobs/J/G`) 3.
pub fn open_under(path: &Path, depth: usize) -> Result<Dir> {
    let parts: Vec<Component> = path.components().collect();
    let Some(split) = parts.len().checked_sub(depth).filter(|&n| n > 0) else {
        return Err(AgentError::Unsafe { path: path.to_path_buf() });
    };
    let root: PathBuf = parts[..split].iter().collect();
    let rel: PathBuf = parts[split..].iter().collect();
    Dir::open(&root)?.dir(rel)
}

/// The tree at `path` removed (`Dir::remove_tree`): its parent is a directory of the agent's
/// own (the memory tier's `jobs/JOB`), opened by path; the tree itself a rank's.
pub fn remove_tree_at(path: &Path) -> Result<()> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
        return Err(AgentError::Unsafe { path: path.to_path_buf() });
    };
    Dir::open(parent)?.remove_tree(name)
}

impl Dir {
    /// `path`, a directory of the agent's own (the work directory, the memory tier's root,
    /// both checked at start), its last component not a link.
    pub fn open(path: &Path) -> Result<Dir> {
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = rustix::fs::open(path, flags, Mode::empty()).map_err(|e| fail("opening", path, e))?;
        Ok(Dir { fd, path: path.to_path_buf() })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn at(&self, rel: &Path) -> PathBuf {
        self.path.join(rel)
    }

    fn open_beneath(&self, rel: &Path, flags: OFlags, mode: Mode) -> Result<OwnedFd> {
        if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
            return Err(AgentError::Unsafe { path: self.at(rel) });
        }
        rustix::fs::openat2(&self.fd, rel, flags | OFlags::CLOEXEC, mode, RESOLVE).map_err(|e| fail("opening", &self.at(rel), e))
    }

    /// The directory `rel` beneath this one, every step a real directory.
    pub fn dir(&self, rel: impl AsRef<Path>) -> Result<Dir> {
        let rel = rel.as_ref();
        let fd = self.open_beneath(rel, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty())?;
        Ok(Dir { fd, path: self.at(rel) })
    }

    /// `dir`, or `None` where it is absent.
    pub fn dir_if_any(&self, rel: impl AsRef<Path>) -> Result<Option<Dir>> {
        match self.dir(rel) {
            Err(AgentError::Io { err, .. }) if err.kind() == std::io::ErrorKind::NotFound => Ok(None),
            other => other.map(Some),
        }
    }

    /// The regular file `rel` beneath this directory, for reading (never a FIFO, a device or a
    /// link; opened without blocking, so a FIFO cannot hang the agent before it is refused).
    pub fn open_file(&self, rel: impl AsRef<Path>) -> Result<File> {
        let rel = rel.as_ref();
        let fd = self.open_beneath(rel, OFlags::RDONLY | OFlags::NONBLOCK, Mode::empty())?;
        let st = rustix::fs::fstat(&fd).map_err(|e| fail("reading", &self.at(rel), e))?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            return Err(AgentError::NotAFile { path: self.at(rel) });
        }
        // Back to blocking reads: it is a regular file.
        rustix::fs::fcntl_setfl(&fd, OFlags::empty()).map_err(|e| fail("reading", &self.at(rel), e))?;
        Ok(File::from(fd))
    }

    /// A new directory `name` (mode `mode`, the agent's), or the one there if it is a real
    /// directory; and whether it was made now (only then may the agent give it away).
    pub fn create_dir(&self, name: &str, mode: u32) -> Result<(Dir, bool)> {
        plain(name, &self.path)?;
        match rustix::fs::mkdirat(&self.fd, name, Mode::from_raw_mode(mode)) {
            Ok(()) => Ok((self.dir(name)?, true)),
            Err(Errno::EXIST) => Ok((self.dir(name)?, false)),
            Err(e) => Err(fail("creating", &self.at(Path::new(name)), e)),
        }
    }

    /// The whole regular file `rel`, refused over `limit` bytes before it is read (a rank's file
    /// could fill the agent's memory).
    pub fn read(&self, rel: impl AsRef<Path>, limit: u64) -> Result<Vec<u8>> {
        let rel = rel.as_ref();
        let io = |err| AgentError::Io { what: "reading", path: self.at(rel), err };
        let f = self.open_file(rel)?;
        let mut bytes = vec![];
        std::io::Read::read_to_end(&mut std::io::Read::take(f, limit + 1), &mut bytes).map_err(io)?;
        if bytes.len() as u64 > limit {
            return Err(AgentError::TooLarge { path: self.at(rel), limit });
        }
        Ok(bytes)
    }

    /// `bytes` under `name`, whole or not at all: a new temporary file (mode 0600, the agent's),
    /// fsynced, renamed over `name`, the directory fsynced.
    pub fn write_atomic(&self, name: &str, bytes: &[u8]) -> Result<()> {
        self.write_renamed(name, bytes, &Temp { mode: 0o600, owner: None, durable: true })
    }

    /// `bytes` under `name`, whole or not at all, as `temp` says: a new temporary file renamed
    /// over `name` (a link there is replaced, not followed); the directory fsynced if durable.
    pub fn write_renamed(&self, name: &str, bytes: &[u8], temp: &Temp) -> Result<()> {
        let tmp = self.write_temp(name, bytes, temp)?;
        if let Err(e) = self.rename(&tmp, name) {
            let _ = self.remove_file(&tmp);
            return Err(e);
        }
        if temp.durable {
            self.sync()?;
        }
        Ok(())
    }

    /// `bytes` under `name` unless something is there (then nothing changes; `false`): a new
    /// temporary file, fsynced, linked to `name`, the directory fsynced.
    pub fn write_once(&self, name: &str, bytes: &[u8], temp: &Temp) -> Result<bool> {
        plain(name, &self.path)?;
        let tmp = self.write_temp(name, bytes, temp)?;
        let linked = rustix::fs::linkat(&self.fd, tmp.as_str(), &self.fd, name, AtFlags::empty());
        let _ = self.remove_file(&tmp);
        match linked {
            Ok(()) => self.sync().map(|()| true),
            Err(Errno::EXIST) => Ok(false),
            Err(e) => Err(fail("writing", &self.at(Path::new(name)), e)),
        }
    }

    /// The temporary file `.NAME.tmp-PID` made new (whatever had the name is unlinked first,
    /// and one that appears again is an error: a rank may plant a file of its own there, and
    /// what the agent writes must never land in it), `bytes` in it, its mode and owner set
    /// through its handle, fsynced if durable. Its name, to rename or link.
    fn write_temp(&self, name: &str, bytes: &[u8], temp: &Temp) -> Result<String> {
        plain(name, &self.path)?;
        let tmp = format!(".{name}.tmp-{}", std::process::id());
        self.remove_file(&tmp)?;
        let path = self.at(Path::new(name));
        let io = |err| AgentError::Io { what: "writing", path: path.clone(), err };
        let written = self.create_new(&tmp, temp.mode).and_then(|mut f| {
            // Set through the handle: the umask must not narrow it, nor anyone widen it.
            rustix::fs::fchmod(&f, Mode::from_raw_mode(temp.mode)).map_err(|e| fail("writing", &path, e))?;
            if let Some((uid, gid)) = temp.owner {
                chown_file(&f, uid, gid, &path)?;
            }
            std::io::Write::write_all(&mut f, bytes).map_err(io)?;
            if temp.durable {
                f.sync_all().map_err(io)?;
            }
            Ok(())
        });
        if let Err(e) = written {
            let _ = self.remove_file(&tmp);
            return Err(e);
        }
        Ok(tmp)
    }

    /// The regular file `name` opened for writing and emptied, made (mode `mode`) if absent:
    /// for a file the agent writes again under the same name (a log). Never through a link,
    /// never a FIFO (opened without blocking, then refused), never a file with another hard
    /// link (one planted could be a file of root's): such a name is refused before anything
    /// in it changes.
    pub fn create_or_empty(&self, name: &str, mode: u32) -> Result<File> {
        plain(name, &self.path)?;
        let path = self.at(Path::new(name));
        let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::NONBLOCK;
        let fd = self.open_beneath(Path::new(name), flags, Mode::from_raw_mode(mode))?;
        let st = rustix::fs::fstat(&fd).map_err(|e| fail("writing", &path, e))?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile || st.st_nlink != 1 {
            return Err(AgentError::Unsafe { path });
        }
        rustix::fs::ftruncate(&fd, 0).map_err(|e| fail("writing", &path, e))?;
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode)).map_err(|e| fail("writing", &path, e))?;
        rustix::fs::fcntl_setfl(&fd, OFlags::empty()).map_err(|e| fail("writing", &path, e))?;
        Ok(File::from(fd))
    }

    /// The file or directory `name` given to `uid`:`gid` through a handle opened without
    /// following a link or blocking on a FIFO; never a file with another hard link (a link to
    /// a file of root's could have taken the name's place).
    pub fn chown_entry(&self, name: &str, uid: u32, gid: u32) -> Result<()> {
        plain(name, &self.path)?;
        let path = self.at(Path::new(name));
        let fd = self.open_beneath(Path::new(name), OFlags::RDONLY | OFlags::NONBLOCK, Mode::empty())?;
        let st = rustix::fs::fstat(&fd).map_err(|e| fail("changing the owner of", &path, e))?;
        if FileType::from_raw_mode(st.st_mode) != FileType::Directory && st.st_nlink != 1 {
            return Err(AgentError::Unsafe { path });
        }
        chown_fd(&fd, uid, gid, &path)
    }

    /// A new file `name` (mode `mode`), made here and now: never one that was there, never
    /// through a link.
    pub fn create_new(&self, name: &str, mode: u32) -> Result<File> {
        plain(name, &self.path)?;
        let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL;
        Ok(File::from(self.open_beneath(Path::new(name), flags, Mode::from_raw_mode(mode))?))
    }

    /// `from` renamed to `to`, both in this directory (a link at `to` is replaced, not followed).
    pub fn rename(&self, from: &str, to: &str) -> Result<()> {
        plain(from, &self.path)?;
        plain(to, &self.path)?;
        rustix::fs::renameat(&self.fd, from, &self.fd, to).map_err(|e| fail("renaming into", &self.at(Path::new(to)), e))
    }

    /// The file (or link) `name` removed; absent is fine.
    pub fn remove_file(&self, name: &str) -> Result<()> {
        plain(name, &self.path)?;
        match rustix::fs::unlinkat(&self.fd, name, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => Ok(()),
            Err(e) => Err(fail("removing", &self.at(Path::new(name)), e)),
        }
    }

    /// The directory `name` and everything in it removed, every level through a handle (a
    /// link in it is removed, never followed); absent is fine. Any depth, without recursion
    /// and with three descriptors at most: a rank may nest directories thousands deep in its
    /// own (docs/state.md), and neither the agent's stack nor its descriptors may grow with it.
    /// Back up is through `..` of the directory just emptied, checked to be the directory the
    /// walk came down from (device and inode): a rank that moves a directory out of the tree
    /// while it is walked (into /tmp, say) stops the walk with `Unsafe` instead of leading it
    /// into another directory.
    pub fn remove_tree(&self, name: &str) -> Result<()> {
        plain(name, &self.path)?;
        match rustix::fs::unlinkat(&self.fd, name, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => return Ok(()),
            Err(Errno::ISDIR) | Err(Errno::PERM) => {}
            Err(e) => return Err(fail("removing", &self.at(Path::new(name)), e)),
        }
        let Some(top) = self.dir_if_any(name)? else { return Ok(()) };
        let id = |st: &Stat| (st.st_dev, st.st_ino);
        // The (device, inode) of each directory from this one down to the one the walk is in,
        // and the name of each below this one in its parent.
        let mut ids = vec![id(&self.own_stat()?), id(&top.own_stat()?)];
        let mut names = vec![CString::new(name).map_err(|_| AgentError::Unsafe { path: self.at(Path::new(name)) })?];
        let mut cur = top.fd;
        let shown = |names: &[CString]| names.iter().fold(self.path.clone(), |p, n| p.join(OsStr::from_bytes(n.as_bytes())));
        loop {
            // Empty `cur` of its files; the first directory found is walked into.
            if let Some(sub) = empty_files(&cur).map_err(|e| fail("removing", &shown(&names), e))? {
                let rel = Path::new(OsStr::from_bytes(sub.as_bytes()));
                let fd = rustix::fs::openat2(&cur, rel, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty(), RESOLVE);
                names.push(sub);
                match fd {
                    Ok(fd) => {
                        ids.push(id(&rustix::fs::fstat(&fd).map_err(|e| fail("removing", &shown(&names), e))?));
                        cur = fd;
                    }
                    // Gone since it was listed: look again.
                    Err(Errno::NOENT) => {
                        names.pop();
                    }
                    Err(e) => return Err(fail("removing", &shown(&names), e)),
                }
                continue;
            }
            // `cur` is empty: up to its parent, which must be the one the walk came from.
            let up = rustix::fs::openat(&cur, "..", OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty())
                .map_err(|e| fail("removing", &shown(&names), e))?;
            let st = rustix::fs::fstat(&up).map_err(|e| fail("removing", &shown(&names), e))?;
            ids.pop();
            if ids.last() != Some(&id(&st)) {
                return Err(AgentError::Unsafe { path: shown(&names) });
            }
            let gone = names.pop().expect("a name for each directory below the top");
            match rustix::fs::unlinkat(&up, gone.as_c_str(), AtFlags::REMOVEDIR) {
                Ok(()) | Err(Errno::NOENT) => {}
                Err(e) => return Err(fail("removing", &shown(&names).join(OsStr::from_bytes(gone.as_bytes())), e)),
            }
            if names.is_empty() {
                return Ok(());
            }
            cur = up;
        }
    }

    /// The empty directory `name` removed: `true`; `false` where it is absent or not empty.
    pub fn remove_dir(&self, name: &str) -> Result<bool> {
        plain(name, &self.path)?;
        match rustix::fs::unlinkat(&self.fd, name, AtFlags::REMOVEDIR) {
            Ok(()) => Ok(true),
            Err(Errno::NOENT) | Err(Errno::NOTEMPTY) | Err(Errno::EXIST) => Ok(false),
            Err(e) => Err(fail("removing", &self.at(Path::new(name)), e)),
        }
    }

    /// The names in this directory with their types (not followed), `.` and `..` left out,
    /// names that are not UTF-8 too (no checkpoint file is named so).
    pub fn entries(&self) -> Result<Vec<(String, FileType)>> {
        // A handle of its own: listing moves its offset.
        let fd = rustix::fs::openat(&self.fd, ".", OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| fail("listing", &self.path, e))?;
        let mut out = vec![];
        for e in rustix::fs::Dir::new(fd).map_err(|e| fail("listing", &self.path, e))? {
            let e = e.map_err(|e| fail("listing", &self.path, e))?;
            let name = OsStr::from_bytes(e.file_name().to_bytes());
            let Some(name) = name.to_str() else { continue };
            if name == "." || name == ".." {
                continue;
            }
            out.push((name.to_string(), e.file_type()));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// What `rel` is, not following a link (`None` where absent or unreadable).
    pub fn stat(&self, rel: &str) -> Option<Stat> {
        plain(rel, &self.path).ok()?;
        rustix::fs::statat(&self.fd, rel, AtFlags::SYMLINK_NOFOLLOW).ok()
    }

    /// This directory's own status.
    pub fn own_stat(&self) -> Result<Stat> {
        rustix::fs::fstat(&self.fd).map_err(|e| fail("reading", &self.path, e))
    }

    /// This directory given to `uid`:`gid` (only root can).
    pub fn chown(&self, uid: u32, gid: u32) -> Result<()> {
        chown_fd(&self.fd, uid, gid, &self.path)
    }

    /// This directory's mode set to `mode`.
    pub fn chmod(&self, mode: u32) -> Result<()> {
        rustix::fs::fchmod(&self.fd, Mode::from_raw_mode(mode)).map_err(|e| fail("setting the mode of", &self.path, e))
    }

    /// This directory's entries on disk (after a rename into it).
    pub fn sync(&self) -> Result<()> {
        rustix::fs::fsync(&self.fd).map_err(|e| fail("syncing", &self.path, e))
    }
}

/// A file the agent made, given to `uid`:`gid` through its handle.
pub fn chown_file(f: &File, uid: u32, gid: u32, path: &Path) -> Result<()> {
    chown_fd(f.as_fd(), uid, gid, path)
}

fn chown_fd(fd: impl AsFd, uid: u32, gid: u32, path: &Path) -> Result<()> {
    let (u, g) = (rustix::fs::Uid::from_raw(uid), rustix::fs::Gid::from_raw(gid));
    rustix::fs::fchown(fd, Some(u), Some(g)).map_err(|e| fail("changing the owner of", path, e))
}

/// Every file, link and other non-directory in `dir` unlinked; the name of the first
/// directory in it, if any (names that are not UTF-8 too: a rank may make any). Listed again
/// until a listing unlinks nothing: one that unlinks as it goes may pass over a name.
fn empty_files(dir: &OwnedFd) -> std::result::Result<Option<CString>, Errno> {
    loop {
        let mut unlinked = false;
        // A handle of its own: listing moves its offset.
        let fd = rustix::fs::openat(dir, ".", OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())?;
        for e in rustix::fs::Dir::new(fd)? {
            let e = e?;
            let name = e.file_name();
            if name.to_bytes() == b"." || name.to_bytes() == b".." {
                continue;
            }
            match rustix::fs::unlinkat(dir, name, AtFlags::empty()) {
                Ok(()) => unlinked = true,
                Err(Errno::NOENT) => {}
                Err(Errno::ISDIR) | Err(Errno::PERM) => return Ok(Some(name.to_owned())),
                Err(e) => return Err(e),
            }
        }
        if !unlinked {
            return Ok(None);
        }
    }
}

/// One name in a directory, not a path.
fn plain(name: &str, dir: &Path) -> Result<()> {
    let one = Path::new(name).components().count() == 1 && matches!(Path::new(name).components().next(), Some(Component::Normal(_)));
    if name.contains('/') || !one {
        return Err(AgentError::Unsafe { path: dir.join(name) });
    }
    Ok(())
}

/// A refused link or escape is said as such; anything else as the I/O error it is.
fn fail(what: &'static str, path: &Path, e: Errno) -> AgentError {
    match e {
        Errno::LOOP | Errno::XDEV => AgentError::Unsafe { path: path.to_path_buf() },
        e => AgentError::Io { what, path: path.to_path_buf(), err: e.into() },
    }
}

/// A directory only the agent may write (the memory tier's root, whose default name anyone can
/// guess): made now with `mode` (mkdir, not recursive: its parent must exist), or, if it is
/// there, a real directory (not a link) owned by the agent's uid that no group or other user
/// may write; then its mode is set to `mode` through its handle. Anything else is refused,
/// naming the directory and the fix: another user made it first, and could read and change
/// every checkpoint in it.
pub fn private_dir(path: &Path, mode: u32) -> Result<Dir> {
    match rustix::fs::mkdir(path, Mode::from_raw_mode(mode)) {
        Ok(()) | Err(Errno::EXIST) => {}
        Err(e) => return Err(fail("creating", path, e)),
    }
    let not_ours = |why: String| AgentError::NotPrivate { path: path.to_path_buf(), why };
    let dir = match Dir::open(path) {
        Ok(d) => d,
        Err(AgentError::Unsafe { .. }) | Err(AgentError::Io { err: _, .. })
            if std::fs::symlink_metadata(path).is_ok_and(|m| !m.file_type().is_dir()) =>
        {
            return Err(not_ours("it is not a directory (a symbolic link or a file)".into()));
        }
        Err(e) => return Err(e),
    };
    let st = dir.own_stat()?;
    if st.st_uid != euid() {
        return Err(not_ours(format!("it belongs to uid {}, not to the agent's uid {}", st.st_uid, euid())));
    }
    if st.st_mode & 0o022 != 0 {
        return Err(not_ours(format!("its mode {:o} lets others write it", st.st_mode & 0o7777)));
    }
    dir.chmod(mode)?;
    Ok(dir)
}

#[cfg(test)]
#[path = "safe_fs_tests.rs"]
mod tests;
