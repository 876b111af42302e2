//! Bearer tokens as every Motley service checks them (the coordinator's APIs, the agent's log
//! service): one reading of the header and one comparison, so the two cannot drift.

/// The credential of an `Authorization` header value: `Bearer TOKEN`, the scheme in any case
/// (RFC 9110 makes auth schemes case-insensitive).
pub fn bearer(header: &str) -> Option<&str> {
    let (scheme, token) = header.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Equal in time that depends on the lengths only, not on where the first difference is (a
/// token compared byte by byte with an early exit leaks its prefix to a patient caller).
pub fn same_secret(given: &str, expected: &str) -> bool {
    let (a, b) = (given.as_bytes(), expected.as_bytes());
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        diff |= usize::from(a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0));
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scheme_is_any_case_and_the_secret_compares_whole() {
        assert_eq!(bearer("Bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer  abc "), Some("abc"));
        assert_eq!(bearer("BEARER abc"), Some("abc"));
        assert_eq!(bearer("bEARER abc"), Some("abc"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("Bearerabc"), None);
        assert!(same_secret("abc", "abc"));
        for other in ["ab", "abcd", "abd", "", "ABC"] {
            assert!(!same_secret(other, "abc"), "{other}");
        }
    }
}
