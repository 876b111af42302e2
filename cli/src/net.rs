//! `motley net show [--node N]`: the coordinator's live link matrix (docs/network.md), over
//! the REST API (`GET /api/v1/net`). A row per link agents measured: measured and declared
//! GB/s, their ratio, the round trip, samples and age; then the NICs' achieved rates. With
//! `-o json` the document as the API gives it, whose `bandwidth` section is a
//! `motley replan --bandwidth` file as it is.

use motley_contract::net::NetworkView;

use crate::inputs::{InputError, Output};
use crate::remote::{path_segment, typed, Client, Remote};

#[derive(clap::Subcommand)]
pub enum NetCommand {
    /// The links agents measured between nodes (measured and declared GB/s, their ratio,
    /// latency, samples, age) and the NICs' achieved rates. `-o json`: the whole document,
    /// history included; its `bandwidth` is a `motley replan --bandwidth` file.
    Show {
        /// Only this node's links and NICs.
        #[arg(long)]
        node: Option<String>,
        #[command(flatten)]
        remote: Remote,
    },
}

pub fn run(cmd: NetCommand) -> Result<String, InputError> {
    match cmd {
        NetCommand::Show { node, remote } => {
            let query = node.as_deref().map_or(String::new(), |n| format!("?node={}", path_segment(n)));
            let v = Client::new(&remote)?.call("GET", &format!("/net{query}"), None)?;
            let view: NetworkView = typed(&v, "link matrix")?;
            Ok(match remote.output {
                Output::Json => serde_json::to_string_pretty(&v).expect("JSON serialises"),
                Output::Table => tables(&view, now_ms()),
            })
        }
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// The links, then the NICs, as of `now` (ms since the Unix epoch).
pub fn tables(v: &NetworkView, now: i64) -> String {
    let links = if v.links.is_empty() {
        "no link measured yet (agents probe the links between the nodes of a running launch)".to_string()
    } else {
        let rows = v
            .links
            .iter()
            .map(|l| {
                let declared = l.declared_gb_per_s;
                vec![
                    l.a.clone(),
                    l.b.clone(),
                    l.nic_kind.clone(),
                    format!("{:.2}", l.gb_per_s),
                    declared.map_or("-".into(), |d| format!("{d:.2}")),
                    declared.filter(|d| *d > 0.0).map_or("-".into(), |d| format!("{:.2}", l.gb_per_s / d)),
                    format!("{:.3}", l.latency_ms),
                    l.samples.to_string(),
                    age(now, l.updated_unix_ms),
                ]
            })
            .collect();
        crate::table::simple(vec!["a", "b", "nic", "measured GB/s", "declared GB/s", "ratio", "latency ms", "samples", "age"], rows)
    };
    if v.nics.is_empty() {
        return links;
    }
    let rows = v
        .nics
        .iter()
        .map(|n| {
            vec![
                n.node.clone(),
                n.name.clone(),
                n.kind.clone(),
                format!("{:.3}", n.tx_gb_per_s),
                format!("{:.3}", n.rx_gb_per_s),
                age(now, n.at_unix_ms),
            ]
        })
        .collect();
    format!("{links}\n{}", crate::table::simple(vec!["node", "nic", "kind", "tx GB/s", "rx GB/s", "age"], rows))
}

/// How long ago, for people: `4s`, `3m`, `2h`.
fn age(now: i64, at: i64) -> String {
    let s = (now - at).max(0) / 1000;
    match s {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s => format!("{}h", s / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use motley_contract::net::{LinkPoint, LinkView, NicRateView};

    #[test]
    fn a_row_per_link_with_the_ratio_to_the_declared_rate_then_the_nics() {
        let link = |b: &str, declared: Option<f64>| LinkView {
            a: "n0".into(),
            b: b.into(),
            nic_kind: "eth".into(),
            gb_per_s: 1.0,
            latency_ms: 0.25,
            samples: 3,
            updated_unix_ms: 10_000,
            declared_gb_per_s: declared,
            history: vec![LinkPoint { at_unix_ms: 10_000, gb_per_s: 1.0, latency_ms: 0.25 }],
        };
        let nic = NicRateView {
            node: "n0".into(),
            name: "eth\u{1b}0".into(),
            kind: "eth".into(),
            tx_gb_per_s: 0.5,
            rx_gb_per_s: 0.25,
            at_unix_ms: 0,
        };
        let v = NetworkView { links: vec![link("n1", Some(4.0)), link("n2", None)], nics: vec![nic], ..Default::default() };
        let out = tables(&v, 15_000);
        let rows: Vec<Vec<&str>> =
            out.lines().filter(|l| l.starts_with('│')).map(|l| l.trim_matches('│').split('┆').map(str::trim).collect()).collect();
        assert_eq!(rows[1], ["n0", "n1", "eth", "1.00", "4.00", "0.25", "0.250", "3", "5s"], "{out}");
        assert_eq!(rows[2], ["n0", "n2", "eth", "1.00", "-", "-", "0.250", "3", "5s"], "{out}");
        assert_eq!(rows[4], ["n0", "eth\\x1b0", "eth", "0.500", "0.250", "15s"], "names escaped: {out}");
        assert!(tables(&NetworkView::default(), 0).starts_with("no link measured yet"));
        assert_eq!((age(0, 1000), age(300_000, 0), age(3 * 3_600_000, 0)), ("0s".into(), "5m".into(), "3h".into()));
    }
}
