//! The human-readable rendering of a plan, and the escaping every table cell of the CLI goes
//! through.

use std::borrow::Cow;
use std::fmt::Display;

use comfy_table::{presets::UTF8_FULL_CONDENSED, Cell, CellAlignment, Table};
use motley_solver::report::ReplicaDoc;
use motley_solver::PlanDocument;

/// `s` with its control characters written out (`\n`, `\t`, `\x1b`, `\u{9b}`) and everything
/// else, non-ASCII letters included, as it is. Names and messages come from files and from the
/// coordinator, i.e. from anyone who can register a node or submit a job: printed raw, an escape
/// sequence in one would be executed by the operator's terminal (retitle it, hide rows, fake
/// output), and a newline would split a row.
pub fn escape(s: &str) -> Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() && (c as u32) < 0x80 => out.push_str(&format!("\\x{:02x}", c as u32)),
            // C1 controls (U+0080..U+009F): U+009B alone starts an escape sequence on some terminals.
            c if c.is_control() => out.extend(c.escape_unicode()),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// A table cell whose text is escaped (see [`escape`]).
pub fn cell(x: impl Display) -> Cell {
    Cell::new(escape(&x.to_string()))
}

/// A row of plain text cells, escaped (see [`escape`]).
pub fn row<S: AsRef<str>>(cells: impl IntoIterator<Item = S>) -> Vec<Cell> {
    cells.into_iter().map(|c| cell(c.as_ref())).collect()
}

pub fn render(r: &PlanDocument, compare: bool) -> String {
    let mut out = String::new();
    let proof = if r.search.proven_optimal { "optimal in its space" } else { "best found" };
    let how = match &r.search.baseline {
        // A baseline's rule made it, not the search: say which, so it is never taken for Motley's.
        Some(b) => format!("the {b} baseline's plan, not Motley's (best of its rule)"),
        None => format!("search {} ({}, {} plans costed)", r.search.mode, proof, r.search.plans_costed),
    };
    out.push_str(&format!(
        "Plan for {} on {}: {} of {} GPUs, {} replica(s); {}\n",
        escape(&r.model),
        escape(&r.cluster),
        r.gpus_used,
        r.gpus_total,
        r.replicas.len(),
        how
    ));
    if r.emulated {
        out.push_str("emulated: GPUs of this plan are CPU shares (the nodes' emulate:), a test or demo cluster, not real GPUs\n");
    }
    out.push_str(&format!(
        "iteration {:.3} s | {:.0} tokens/s | {:.1}% of cluster peak FLOPS | global batch {} | micro-batch {} | seq {} | {}{}{}\n",
        r.iteration_time_s,
        r.tokens_per_s,
        r.peak_utilization * 100.0,
        r.global_batch,
        r.micro_batch,
        r.seq_len.map_or_else(|| "?".to_string(), |s| s.to_string()),
        r.precision.map_or("?", |p| p.name()),
        if r.recompute { " | recompute" } else { "" },
        if r.zero1 { " | zero1" } else { "" }
    ));
    // Planned at the model's own length while it takes longer ones (a Hugging Face model's
    // default): said, so 4096 is never mistaken for the model's maximum, nor the maximum chosen.
    if let (Some(spec), Some(seq)) = (&r.model_spec, r.seq_len) {
        if let Some(max) = spec.max_position_embeddings.filter(|&m| seq == spec.seq_len && m > seq) {
            out.push_str(&format!(
                "seq {seq}: the model's default training length ({}); --seq-len sets another\n",
                motley_solver::model::hf::default_seq_len_reason(max, spec.sliding_window)
            ));
        }
    }
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(vec!["replica", "samples", "stage", "layers", "gpu", "tp", "dp", "gpus", "memory GiB", "time s"]);
    // Identical consecutive replicas (same samples, GPU types, tp, dp and layers) share rows;
    // their GPUs differ, and `-o json` lists every one.
    let same = |a: &ReplicaDoc, b: &ReplicaDoc| {
        a.samples == b.samples
            && a.stages.len() == b.stages.len()
            && a.stages.iter().zip(&b.stages).all(|(x, y)| x.gpu == y.gpu && x.tp == y.tp && x.dp == y.dp && x.layers == y.layers)
    };
    let mut grouped = false;
    let mut ri = 0;
    while ri < r.replicas.len() {
        let rep = &r.replicas[ri];
        let mut end = ri + 1;
        while end < r.replicas.len() && same(rep, &r.replicas[end]) {
            end += 1;
        }
        let label = if end - ri > 1 {
            grouped = true;
            format!("{}-{} (x{})", ri, end - 1, end - ri)
        } else {
            ri.to_string()
        };
        for (si, s) in rep.stages.iter().enumerate() {
            let first = si == 0;
            t.add_row(vec![
                cell(if first { label.clone() } else { String::new() }),
                cell(if first { rep.samples_or_derived(r.micro_batch).to_string() } else { String::new() })
                    .set_alignment(CellAlignment::Right),
                cell(si),
                cell(format!("{}-{}", s.layers[0], s.layers[1])),
                cell(&s.gpu),
                cell(s.tp),
                cell(s.dp),
                cell(compact_gpus(&s.gpus)),
                cell(format!("{:.1} / {:.1}", s.memory_gib_per_gpu, s.memory_capacity_gib)).set_alignment(CellAlignment::Right),
                cell(if first { format!("{:.3}", rep.iteration_time_s) } else { String::new() }),
            ]);
        }
        ri = end;
    }
    out.push_str(&t.to_string());
    out.push('\n');
    if !r.idle_gpus.is_empty() {
        let list: Vec<String> = r.idle_gpus.iter().map(|(g, n)| format!("{n} x {}", escape(g))).collect();
        out.push_str(&format!("idle: {} (the search found no faster plan that uses them)\n", list.join(", ")));
    }
    if grouped {
        out.push_str("identical replicas share rows and show the first one's GPUs; -o json lists every GPU\n");
    }
    if r.split_hops > 0 {
        out.push_str(&format!(
            "note: {} pipeline hop(s) were priced inside one node but had to be placed across nodes; the iteration time is optimistic for them\n",
            r.split_hops
        ));
    }
    if compare {
        out.push_str("Baselines under the same cost model:\n");
        let this = if r.search.baseline.is_some() { "this plan" } else { "motley" };
        for (name, b) in &r.baselines {
            match (b.iteration_time_s, b.speedup) {
                (Some(bt), Some(sp)) => out.push_str(&format!(
                    "  {name:<9} {bt:.3} s/iteration ({} replicas x {} stages, tp {}, micro-batch {}); {this} is {sp:.2}x faster\n",
                    b.replicas.unwrap_or(0),
                    b.stages_per_replica.unwrap_or(0),
                    b.tp.unwrap_or(0),
                    b.micro_batch.unwrap_or(0)
                )),
                _ => out.push_str(&format!("  {name:<9} no plan of this baseline fits in memory\n")),
            }
        }
    }
    out
}

/// `a100-0:0-3,a100-1:0-3`: node then GPU index ranges.
fn compact_gpus(gpus: &[motley_solver::placement::GpuId]) -> String {
    let mut parts: Vec<String> = vec![];
    let mut i = 0;
    while i < gpus.len() {
        let node = &gpus[i].node;
        let mut j = i;
        let mut ranges: Vec<(u32, u32)> = vec![];
        while j < gpus.len() && &gpus[j].node == node {
            let x = gpus[j].index;
            match ranges.last_mut() {
                Some(r) if r.1 + 1 == x => r.1 = x,
                _ => ranges.push((x, x)),
            }
            j += 1;
        }
        let rs: Vec<String> = ranges.iter().map(|&(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") }).collect();
        parts.push(format!("{node}:{}", rs.join(",")));
        i = j;
    }
    parts.join(" ")
}

/// `motley plan --explain`: every communication group with its link, NICs, NCCL settings and
/// the seconds it spends on the link per iteration.
pub fn render_network(groups: &[motley_contract::CommGroupDoc]) -> String {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(vec!["group", "where", "gpus", "transport", "nics", "GB/s", "s/iter", "NCCL settings"]);
    for g in groups {
        let kind = format!("{:?}", g.kind).to_lowercase();
        let place = match (g.replica, g.stage) {
            (Some(r), Some(s)) if kind == "pp" => format!("replica {r}: stage {s}->{} (layer {})", s + 1, g.layers[0]),
            (Some(r), Some(s)) => format!("replica {r} stage {s}"),
            _ => format!("layers {}-{}", g.layers[0], g.layers[1]),
        };
        let env: Vec<String> = g.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        t.add_row(vec![
            cell(kind),
            cell(place),
            cell(compact_gpus(&g.gpus)),
            cell(format!("{:?}", g.transport).to_lowercase()),
            cell(g.nics.join(",")),
            cell(format!("{:.1}", g.link_gb_per_s)).set_alignment(CellAlignment::Right),
            cell(format!("{:.4}", g.seconds_per_iteration)).set_alignment(CellAlignment::Right),
            cell(env.join(" ")),
        ]);
    }
    let mut out = format!("Communication groups ({}), in the order ranks create them:\n", groups.len());
    out.push_str(&t.to_string());
    out.push_str(
        "\nA rank sets each group's NCCL settings just before creating that group's communicator; the device lists \
         (NCCL_IB_HCA, NCCL_SOCKET_IFNAME) are read once per process, so start ranks with the union of their groups' lists.\n",
    );
    out
}

/// `motley replan`: the verdict, then what moves, then the new plan.
pub fn render_replan(r: &motley_solver::replan::ReplanReport, compare: bool) -> String {
    let mut out = format!(
        "{}: {}\ncurrent plan: {:.3} s/iteration as planned, {:.3} s on the measured network; new plan: {:.3} s ({:+.1}%)\n",
        if r.worth_switching { "SWITCH" } else { "KEEP" },
        r.reason,
        r.current_planned_s,
        r.current_now_s,
        r.new_iteration_time_s,
        r.gain * 100.0
    );
    out.push_str(&format!(
        "switching moves {} GPU(s), {:.2} GB in {:.2} s{}\n",
        r.gpus_moved,
        r.switch_bytes / 1e9,
        r.switch_seconds,
        r.payback_iterations.map_or(String::new(), |p| format!(", paid back after {p:.1} iterations"))
    ));
    let range = |x: Option<[u32; 2]>| x.map_or("idle".to_string(), |l| format!("{}-{}", l[0], l[1]));
    let mut moves: std::collections::BTreeMap<(String, String), Vec<motley_solver::placement::GpuId>> = Default::default();
    for m in &r.moves {
        moves.entry((range(m.from), range(m.to))).or_default().push(m.gpu.clone());
    }
    if !moves.is_empty() {
        let mut t = Table::new();
        t.load_preset(UTF8_FULL_CONDENSED);
        t.set_header(vec!["layers before", "layers after", "gpus"]);
        for ((from, to), gpus) in moves {
            t.add_row(vec![cell(from), cell(to), cell(compact_gpus(&gpus))]);
        }
        out.push_str(&t.to_string());
        out.push('\n');
    }
    out.push_str("New plan:\n");
    out.push_str(&render(&r.new_plan, compare));
    out
}

/// A plain table: a header and rows of cells (cells escaped by `row`).
pub fn simple(header: Vec<&str>, rows: Vec<Vec<String>>) -> String {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(header);
    for r in rows {
        t.add_row(row(r));
    }
    t.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_writes_out_control_characters_only() {
        assert_eq!(escape("a100-0 ▸ H800 ünïcode 漢字"), "a100-0 ▸ H800 ünïcode 漢字");
        assert!(matches!(escape("plain"), Cow::Borrowed(_)), "no copy when nothing is escaped");
        assert_eq!(escape("\u{1b}[2J\u{1b}]0;x\u{7}"), "\\x1b[2J\\x1b]0;x\\x07");
        assert_eq!(escape("a\nb\r\tc\u{0}\u{7f}"), "a\\nb\\r\\tc\\x00\\x7f");
        assert_eq!(escape("\u{9b}31m"), "\\u{9b}31m");
        // Escaping twice changes nothing: the output has no control characters left.
        assert_eq!(escape(&escape("x\u{1b}y")), "x\\x1by");
    }

    #[test]
    fn plan_tables_escape_names_from_the_cluster_file() {
        let spec: motley_solver::ClusterSpec =
            serde_norway::from_str("name: \"lab\\e[31m\"\nnodes: [{name: \"n\\e]0;x\\a\", gpu: A100-80G, gpus: 2}]\n").unwrap();
        let cluster = motley_solver::Cluster::from_spec(&spec).unwrap();
        let model = motley_solver::Model::new(motley_solver::model::model_by_name("bert-large").unwrap(), None).unwrap();
        let opts = motley_solver::PlanOptions { global_batch: 8, ..Default::default() };
        let profiles = motley_solver::ProfileSet::default();
        let req = motley_solver::PlanRequest {
            cluster: &cluster,
            model: &model,
            profiles: &profiles,
            opts: &opts,
            mode: motley_solver::SearchMode::Auto,
            exhaustive: false,
            seeds: vec![],
        };
        let report = motley_solver::plan(&req).unwrap();
        let out = format!("{}{}", render(&report, true), render_network(&report.comm_groups));
        assert!(!out.chars().any(|c| c.is_control() && c != '\n'), "{out:?}");
        assert!(out.contains("lab\\x1b[31m") && out.contains("n\\x1b]0;x\\x07:0"), "{out}");
        assert!(out.contains("| seq 512 | fp16\n"), "the precision priced, and no recompute or zero1: {out}");
        let sharded = motley_solver::PlanOptions { recompute: true, zero1: true, ..opts.clone() };
        let report = motley_solver::plan(&motley_solver::PlanRequest { opts: &sharded, ..req }).unwrap();
        assert!(render(&report, true).contains("| fp16 | recompute | zero1\n"));
    }
}
