//! The cluster parser never panics: arbitrary text and mutated valid files get an error that
//! names the file, on one line, or parse.

use motley::inputs::parse_cluster;
use proptest::prelude::*;

const VALID: &str = include_str!("../../examples/lab.yaml");

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_text_never_panics(text in ".{0,400}") {
        if let Err(e) = parse_cluster(&text, "c.yaml") {
            let msg = e.to_string();
            prop_assert!(msg.starts_with("c.yaml"));
        }
    }

    #[test]
    fn mutated_valid_files_never_panic(cut in 0usize..VALID.len(), junk in "[ -~\n]{0,12}") {
        let mut text = VALID[..cut].to_string();
        text.push_str(&junk);
        text.push_str(&VALID[cut..]);
        match parse_cluster(&text, "c.yaml") {
            Ok(c) => prop_assert!(c.total_gpus() > 0),
            Err(e) => prop_assert!(e.to_string().starts_with("c.yaml")),
        }
    }
}

#[test]
fn the_example_parses_with_count_expansion() {
    let c = parse_cluster(VALID, "lab.yaml").unwrap();
    let names: Vec<&str> = c.nodes.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, vec!["a100-0", "a100-1", "h800", "v100-0", "v100-1"]);
    assert_eq!(c.total_gpus(), 40);
    // Nodes that differ only in name share a class: the search runs over classes.
    assert_eq!(c.classes.len(), 3);
}
