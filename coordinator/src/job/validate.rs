//! Names that reach files, logs, URLs and terminals: refused unless they look like a DNS name,
//! so a node called `../../etc`, one holding a newline or an escape sequence, or one of 5,000
//! characters never gets in.

/// Longest node name (a DNS name's limit).
pub const MAX_NODE_NAME: usize = 253;

/// A node name: DNS-label-like labels (letters, digits, '-', '_') separated by dots, each label
/// 1-63 characters starting and ending with a letter or digit, 253 characters in all. The
/// message says what is wrong and what is allowed.
pub fn node_name(name: &str) -> Result<(), String> {
    const ALLOWED: &str =
        "letters, digits, '-' and '_' in dot-separated labels of 1-63 characters that start and end with a letter or digit";
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    if name.len() > MAX_NODE_NAME {
        return Err(format!("is {} characters; at most {MAX_NODE_NAME}", name.len()));
    }
    for label in name.split('.') {
        let ok = (1..=63).contains(&label.len())
            && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            && label.starts_with(|c: char| c.is_ascii_alphanumeric())
            && label.ends_with(|c: char| c.is_ascii_alphanumeric());
        if !ok {
            return Err(format!("'{}' is not a node name: use {ALLOWED}", name.escape_default()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_are_dns_like() {
        for good in ["a100-0", "g0", "gpu01.rack3.example.com", "node_7", "A"] {
            assert!(node_name(good).is_ok(), "{good}");
        }
        let long = "a".repeat(5000);
        for bad in ["", "../../etc", "a/b", "a\nb", "a\u{1b}[31mb", "-a", "a-", "a..b", ".a", long.as_str(), "a b", "ñ"] {
            let e = node_name(bad).expect_err(bad);
            assert!(!e.contains('\n') && !e.contains('\u{1b}'), "the message itself is safe to print: {e}");
        }
    }
}
