//! The names this coordinator answers to, and the `Host` check that keeps DNS rebinding out.
//!
//! A web page on a name the attacker controls can re-point that name at the coordinator: the
//! browser then sends the page's requests to the coordinator as same-origin, `Origin` and `Host`
//! both the attacker's name, so an `Origin` check alone lets them through. The `Host` header,
//! though, still names the attacker's domain. Requests are answered only for the names this
//! coordinator serves: an IP literal (a browser that reached an address directly loaded its page
//! from it), `localhost`, the machine's host name, `--advertise-host`, and each `--public-url`'s
//! host (docs/state.md).

use std::net::IpAddr;

/// The host names (lower case, without ports) a coordinator answers requests for.
#[derive(Clone, Debug, Default)]
pub struct ServedHosts {
    names: Vec<String>,
}

impl ServedHosts {
    /// `names`: the host names operators and browsers reach this coordinator by (IP literals
    /// and `localhost` are always served, and need not be listed).
    pub fn new<S: AsRef<str>>(names: impl IntoIterator<Item = S>) -> ServedHosts {
        let mut names: Vec<String> = names.into_iter().map(|n| n.as_ref().trim().trim_end_matches('.').to_ascii_lowercase()).collect();
        names.retain(|n| !n.is_empty());
        names.sort();
        names.dedup();
        ServedHosts { names }
    }

    /// Whether a request's `Host` header (`name`, `name:port`, `[v6]:port`) is served.
    pub fn serves(&self, host: &str) -> bool {
        let Some(name) = host_name(host) else { return false };
        if name.parse::<IpAddr>().is_ok() || name == "localhost" || name.ends_with(".localhost") {
            return true;
        }
        self.names.contains(&name)
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }
}

/// The host part of a `Host` header, lower case, without a port or brackets; `None` when it is
/// empty or malformed.
fn host_name(host: &str) -> Option<String> {
    let host = host.trim();
    let name = if let Some(rest) = host.strip_prefix('[') {
        // [v6] or [v6]:port
        let (inside, after) = rest.split_once(']')?;
        if !(after.is_empty() || after.strip_prefix(':').is_some_and(|p| p.parse::<u16>().is_ok())) {
            return None;
        }
        inside
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if port.parse::<u16>().is_ok() && !name.contains(':') => name,
            Some(_) => return None,
            None => host,
        }
    };
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    let ok = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '_'));
    ok.then_some(name)
}

/// The name of a `--public-url` (`https://motley.example.com:7070/` -> `motley.example.com`),
/// or why it is not one.
pub fn url_host(url: &str) -> Result<String, String> {
    let example = "give a URL such as https://motley.example.com:7070";
    let uri: axum::http::Uri = url.parse().map_err(|e| format!("--public-url {url:?}: {e}; {example}"))?;
    match (uri.scheme(), uri.host()) {
        (Some(_), Some(host)) if !host.is_empty() => Ok(host.trim_start_matches('[').trim_end_matches(']').to_ascii_lowercase()),
        _ => Err(format!("--public-url {url:?} names no scheme and host; {example}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn served_names_literals_and_localhost_pass() {
        let hosts = ServedHosts::new(["Motley.Example.com", "gpu-head"]);
        for ok in [
            "motley.example.com",
            "MOTLEY.example.com:7070",
            "motley.example.com.:443",
            "gpu-head:7070",
            "127.0.0.1:7070",
            "10.1.2.3",
            "[::1]:7070",
            "[fe80::1]",
            "localhost:7070",
            "dash.localhost",
        ] {
            assert!(hosts.serves(ok), "{ok}");
        }
    }

    #[test]
    fn other_names_and_malformed_hosts_are_refused() {
        let hosts = ServedHosts::new(["motley.example.com"]);
        for bad in ["evil.example.net:7070", "motley.example.com.evil.net", "", "a b", "[::1", "host:port", "x:1:2", "localhost.evil.net"] {
            assert!(!hosts.serves(bad), "{bad}");
        }
    }

    #[test]
    fn public_urls_give_their_host() {
        assert_eq!(url_host("https://Motley.Example.com:7070/").unwrap(), "motley.example.com");
        assert_eq!(url_host("http://[::1]:7070").unwrap(), "::1");
        assert!(url_host("motley.example.com").unwrap_err().contains("--public-url"));
    }
}
