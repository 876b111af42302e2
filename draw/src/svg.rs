//! A plan drawn as a picture (SVG), from the typed plan document: one row per replica with its
//! stages as blocks sized by layers and coloured by GPU type (a legend names the types), each
//! block labelled with its layer range and GPUs and showing its TP width; between stages the
//! pipeline hops, marked with their transport where they cross nodes. Below, a 1F1B timeline
//! of one iteration per replica from the cost model's per-stage forward/backward seconds and
//! hop seconds (`motley plan -o json` carries them): forward and backward passes, the bubbles
//! (idle time), and the exposed gradient sync and optimizer step (the replica's iteration time
//! beyond its pipeline).
//!
//! Pure: text in, text out, no I/O, no clock; the same document always gives the same bytes.
//! `motley plan|replan|job plan --svg FILE` and the coordinator's `GET /api/v1/jobs/{id}/plan.svg`
//! (the dashboard shows it) both call [`plan_svg_json`] / [`plan_svg_value`].
//!
//! Every name in the picture (node, GPU type, model) comes from users and is XML-escaped. The
//! palette is Okabe-Ito (distinguishable with the common colour-vision deficiencies), and
//! backward passes are hatched as well as coloured, so nothing is told by colour alone.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

use serde::Deserialize;
use serde_json::Value;

use motley_contract::plan::{GpuRef, GroupKind, PlanDocument, StageDoc};
pub use motley_contract::timeline::{one_f_one_b, sync_and_optimizer, Op};

/// The cost model's times in a plan document (the solver's report has them; a plan written by
/// hand or by an older solver may not): read beside [`PlanDocument`] from the same JSON.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct PlanTimes {
    #[serde(default)]
    pub iteration_time_s: Option<f64>,
    #[serde(default)]
    pub replicas: Vec<ReplicaTimes>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct ReplicaTimes {
    /// The replica's whole iteration (pipeline, exposed gradient sync, optimizer step).
    #[serde(default)]
    pub iteration_time_s: Option<f64>,
    /// Seconds of each pipeline hop per micro-batch.
    #[serde(default)]
    pub hops_s: Vec<f64>,
    #[serde(default)]
    pub stages: Vec<StageTimes>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct StageTimes {
    #[serde(default)]
    pub fwd_s: Option<f64>,
    #[serde(default)]
    pub bwd_s: Option<f64>,
}

/// The Okabe-Ito palette (without black), in the order GPU types get them (sorted by name),
/// each with the text colour readable on it.
pub const PALETTE: [(&str, &str); 7] = [
    ("#E69F00", "#000000"),
    ("#56B4E9", "#000000"),
    ("#009E73", "#FFFFFF"),
    ("#F0E442", "#000000"),
    ("#0072B2", "#FFFFFF"),
    ("#D55E00", "#FFFFFF"),
    ("#CC79A7", "#000000"),
];

/// Timeline colours (Okabe-Ito too): forward, backward (also hatched), exposed sync.
const FWD: &str = "#56B4E9";
const BWD: &str = "#0072B2";
const SYNC: &str = "#D55E00";
const IDLE: &str = "#EEEEEE";

const WIDTH: f64 = 1000.0;
const LEFT: f64 = 150.0;
const RIGHT: f64 = 20.0;
const ROW_H: f64 = 58.0;
const LANE_H: f64 = 18.0;
/// Timelines drawn at most (a note says how many more replicas there are).
const MAX_TIMELINES: usize = 8;

/// The picture of a plan document given as JSON text (`motley plan -o json`, the coordinator's
/// stored plan).
pub fn plan_svg_json(text: &str) -> Result<String, serde_json::Error> {
    plan_svg_value(&serde_json::from_str(text)?)
}

/// The picture of a plan document given as a JSON value.
pub fn plan_svg_value(v: &Value) -> Result<String, serde_json::Error> {
    let plan = PlanDocument::deserialize(v)?;
    // Times are a bonus: a document without them (or with odd ones) still draws its layout.
    let times = PlanTimes::deserialize(v).unwrap_or_default();
    Ok(plan_svg(&plan, &times))
}

/// Text for XML (content and attribute values).
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            // XML 1.0 has no other control characters.
            c if (c as u32) < 0x20 && !matches!(c, '\t' | '\n' | '\r') => out.push('\u{FFFD}'),
            c => out.push(c),
        }
    }
    out
}

/// At most `n` characters, with an ellipsis when cut.
pub(crate) fn clip(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(n.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

/// A stage's GPUs compactly: `node[0,1] other[3]`, nodes in order of first appearance.
pub fn gpus_label(gpus: &[GpuRef]) -> String {
    let mut order: Vec<&str> = vec![];
    let mut by_node: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for g in gpus {
        if !by_node.contains_key(g.node.as_str()) {
            order.push(&g.node);
        }
        by_node.entry(&g.node).or_default().push(g.index);
    }
    order
        .iter()
        .map(|n| format!("{n}[{}]", by_node[n].iter().map(u32::to_string).collect::<Vec<_>>().join(",")))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Seconds for people: ms below 10 s.
fn secs(s: f64) -> String {
    if s < 10.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

/// Passes narrower than this (pixels) are drawn together with their narrow neighbours.
const MIN_PX: f64 = 2.0;

/// Narrow passes drawn as one shape: a stage's passes from `start` to `end`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Run {
    stage: usize,
    start: f64,
    end: f64,
    first: u32,
    last: u32,
    forward: usize,
    backward: usize,
}

/// The runs of passes shorter than `min` (seconds) on each stage, each joining its neighbours
/// that start within `gap` of its end: an iteration of thousands of micro-batches draws as a
/// few hundred shapes, not tens of thousands.
/// Also the passes drawn one by one (the wide ones and narrow ones with no narrow neighbour).
fn runs(ops: &[Op], stages: usize, min: f64, gap: f64) -> (Vec<Run>, Vec<Op>) {
    let mut out = vec![];
    let mut single: Vec<Op> = ops.iter().filter(|o| o.end - o.start >= min).copied().collect();
    for s in 0..stages {
        let mut mine: Vec<&Op> = ops.iter().filter(|o| o.stage == s && o.end - o.start < min).collect();
        mine.sort_by(|a, b| a.start.total_cmp(&b.start));
        let mut cur: Option<Run> = None;
        for o in mine {
            match &mut cur {
                Some(r) if o.start - r.end <= gap => {
                    r.end = o.end;
                    r.first = r.first.min(o.micro_batch);
                    r.last = r.last.max(o.micro_batch);
                    if o.backward {
                        r.backward += 1;
                    } else {
                        r.forward += 1;
                    }
                }
                _ => {
                    out.extend(cur.take());
                    single.push(*o);
                    let (forward, backward) = if o.backward { (0, 1) } else { (1, 0) };
                    cur = Some(Run { stage: s, start: o.start, end: o.end, first: o.micro_batch, last: o.micro_batch, forward, backward });
                }
            }
        }
        out.extend(cur);
    }
    // A run of one pass is that pass.
    let (runs, lone): (Vec<Run>, Vec<Run>) = out.into_iter().partition(|r| r.forward + r.backward > 1);
    let lone: BTreeSet<(usize, u64)> = lone.iter().map(|r| (r.stage, r.start.to_bits())).collect();
    single.retain(|o| o.end - o.start >= min || lone.contains(&(o.stage, o.start.to_bits())));
    (runs, single)
}

/// The transport of the hop after `stage` of `replica` and whether it crosses nodes.
fn hop_transport(plan: &PlanDocument, replica: usize, stage: usize) -> Option<(String, bool)> {
    let g =
        plan.comm_groups.iter().find(|g| g.kind == GroupKind::Pp && g.replica == Some(replica as u32) && g.stage == Some(stage as u32))?;
    let nodes: BTreeSet<&str> = g.gpus.iter().map(|x| x.node.as_str()).collect();
    Some((g.transport.name().to_string(), nodes.len() > 1))
}

/// Whether two stages share a node (a hop between them may stay inside it).
fn crosses_nodes(a: &StageDoc, b: &StageDoc) -> bool {
    let na: BTreeSet<&str> = a.gpus.iter().map(|g| g.node.as_str()).collect();
    !b.gpus.iter().all(|g| na.contains(g.node.as_str()))
}

/// The picture of a plan (see the module's documentation).
pub fn plan_svg(plan: &PlanDocument, times: &PlanTimes) -> String {
    let types: BTreeSet<&str> = plan.replicas.iter().flat_map(|r| r.stages.iter().map(|s| s.gpu.as_str())).collect();
    let colour: BTreeMap<&str, (&str, &str)> = types.iter().enumerate().map(|(i, t)| (*t, PALETTE[i % PALETTE.len()])).collect();
    let layers = plan.replicas.iter().flat_map(|r| r.stages.iter().map(|s| s.layers[1])).max().unwrap_or(0).max(1);
    let inner = WIDTH - LEFT - RIGHT;
    let mut body = String::new();
    let mut y = 16.0;

    // Title.
    let gpus: usize = plan.replicas.iter().flat_map(|r| r.stages.iter().map(|s| s.gpus.len())).sum();
    let mut title = format!(
        "{} · {} GPUs · {} replicas · global batch {} · micro-batch {}",
        clip(&plan.model, 60),
        gpus,
        plan.replicas.len(),
        plan.global_batch,
        plan.micro_batch
    );
    if let Some(t) = times.iteration_time_s {
        let _ = write!(title, " · {} per iteration", secs(t));
    }
    let _ = writeln!(body, r#"<text x="8" y="{:.1}" font-size="15" font-weight="bold">{}</text>"#, y + 4.0, escape(&title));
    y += 18.0;

    // Legend: one swatch per GPU type.
    let mut x = 8.0;
    for t in &types {
        let (fill, _) = colour[t];
        let label = clip(t, 24);
        let _ = writeln!(
            body,
            r##"<g class="legend" data-gpu="{}"><rect x="{x:.1}" y="{y:.1}" width="14" height="14" fill="{fill}" stroke="#000"/><text x="{:.1}" y="{:.1}" font-size="12">{}</text></g>"##,
            escape(t),
            x + 18.0,
            y + 11.5,
            escape(&label)
        );
        x += 30.0 + 7.0 * label.chars().count() as f64;
    }
    y += 26.0;

    // One row per replica.
    let scale = inner / layers as f64;
    for (ri, r) in plan.replicas.iter().enumerate() {
        let _ = writeln!(
            body,
            r#"<text x="8" y="{:.1}" font-size="12" font-weight="bold">replica {ri}</text><text x="8" y="{:.1}" font-size="11">{} samples</text><text x="8" y="{:.1}" font-size="11">{} micro-batches</text>"#,
            y + 14.0,
            y + 28.0,
            r.samples_or_derived(plan.micro_batch),
            y + 41.0,
            r.micro_batches
        );
        for (si, s) in r.stages.iter().enumerate() {
            let (fill, ink) = colour.get(s.gpu.as_str()).copied().unwrap_or(PALETTE[0]);
            let bx = LEFT + s.layers[0] as f64 * scale;
            let bw = ((s.layers[1].saturating_sub(s.layers[0])) as f64 * scale - 3.0).max(2.0);
            let bh = ROW_H - 14.0;
            let full = format!(
                "replica {ri} stage {si}: layers {}-{} on {} x {} (tp {}, dp {}): {}",
                s.layers[0],
                s.layers[1],
                s.gpus.len(),
                s.gpu,
                s.tp,
                s.dp,
                gpus_label(&s.gpus)
            );
            let _ = write!(
                body,
                r##"<g class="stage" data-replica="{ri}" data-stage="{si}" data-gpu="{}"><title>{}</title><rect x="{bx:.1}" y="{y:.1}" width="{bw:.1}" height="{bh:.1}" rx="3" fill="{fill}" stroke="#000"/>"##,
                escape(&s.gpu),
                escape(&full)
            );
            // TP width: the block split into tp lanes.
            for k in 1..s.tp.max(1) {
                let ly = y + bh * k as f64 / s.tp as f64;
                let _ = write!(
                    body,
                    r#"<line x1="{bx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{ink}" stroke-opacity="0.5" stroke-dasharray="2 2"/>"#,
                    bx + bw
                );
            }
            let chars = (bw / 6.5) as usize;
            if chars >= 3 {
                let lines =
                    [format!("L{}-{} {}", s.layers[0], s.layers[1], s.gpu), format!("tp {} × dp {}", s.tp, s.dp), gpus_label(&s.gpus)];
                for (k, line) in lines.iter().enumerate() {
                    let _ = write!(
                        body,
                        r#"<text x="{:.1}" y="{:.1}" font-size="11" fill="{ink}">{}</text>"#,
                        bx + 4.0,
                        y + 13.0 + 13.0 * k as f64,
                        escape(&clip(line, chars))
                    );
                }
            }
            body.push_str("</g>\n");
            // The hop to the next stage.
            if let Some(next) = r.stages.get(si + 1) {
                let (transport, cross) = hop_transport(plan, ri, si).unwrap_or_else(|| (String::new(), crosses_nodes(s, next)));
                if cross {
                    let hx = LEFT + s.layers[1] as f64 * scale - 1.5;
                    let label = if transport.is_empty() { "cross-node".to_string() } else { transport.clone() };
                    let dash = if transport == "socket" { r#" stroke-dasharray="4 3""# } else { "" };
                    let _ = writeln!(
                        body,
                        r##"<g class="hop" data-replica="{ri}" data-stage="{si}" data-transport="{}"><line x1="{hx:.1}" y1="{:.1}" x2="{hx:.1}" y2="{:.1}" stroke="#000" stroke-width="2"{dash}/><text x="{hx:.1}" y="{:.1}" font-size="10" text-anchor="middle">{}</text></g>"##,
                        escape(&transport),
                        y - 3.0,
                        y + bh + 3.0,
                        y + bh + 12.0,
                        escape(&label)
                    );
                }
            }
        }
        y += ROW_H;
    }

    // The 1F1B timelines.
    y += 16.0;
    let _ = writeln!(body, r#"<text x="8" y="{y:.1}" font-size="14" font-weight="bold">One iteration (1F1B, from the cost model)</text>"#);
    y += 10.0;
    // (replica, forward and backward seconds per stage, hop seconds, iteration seconds)
    type Timed = (usize, Vec<f64>, Vec<f64>, Vec<f64>, Option<f64>);
    let timed: Vec<Timed> = plan
        .replicas
        .iter()
        .enumerate()
        .filter_map(|(ri, r)| {
            let t = times.replicas.get(ri)?;
            if t.stages.len() != r.stages.len() || r.stages.is_empty() {
                return None;
            }
            let fwd: Option<Vec<f64>> = t.stages.iter().map(|s| s.fwd_s.filter(|x| x.is_finite() && *x >= 0.0)).collect();
            let bwd: Option<Vec<f64>> = t.stages.iter().map(|s| s.bwd_s.filter(|x| x.is_finite() && *x >= 0.0)).collect();
            Some((ri, fwd?, bwd?, t.hops_s.clone(), t.iteration_time_s))
        })
        .collect();
    if timed.is_empty() {
        let _ = writeln!(
            body,
            r#"<text class="no-timeline" x="8" y="{:.1}" font-size="12">This plan document carries no per-stage times (plans from motley plan do).</text>"#,
            y + 14.0
        );
        y += 24.0;
    } else {
        // One time scale for every replica: they run side by side.
        let schedules: Vec<Vec<Op>> = timed.iter().map(|(ri, f, b, h, _)| one_f_one_b(f, b, h, plan.replicas[*ri].micro_batches)).collect();
        let horizon = timed
            .iter()
            .zip(&schedules)
            .map(|((ri, f, b, h, it), ops)| {
                let end = ops.iter().map(|o| o.end).fold(0.0, f64::max);
                let tail = it.map(|t| sync_and_optimizer(f, b, h, plan.replicas[*ri].micro_batches, t)).unwrap_or(0.0);
                it.unwrap_or(0.0).max(end + tail)
            })
            .fold(0.0, f64::max)
            .max(1e-9);
        let ts = inner / horizon;
        let narrow = schedules.iter().take(MAX_TIMELINES).flatten().any(|o| (o.end - o.start) * ts < MIN_PX);
        // Timeline legend.
        let mut items = vec![
            (FWD, "", "forward"),
            (BWD, "url(#hatch)", "backward"),
            (IDLE, "", "bubble (idle)"),
            (SYNC, "", "exposed gradient sync + optimizer"),
        ];
        if narrow {
            items.push((FWD, "url(#mixed)", "passes too short to draw apart"));
        }
        let mut x = 8.0;
        y += 4.0;
        for (fill, pattern, label) in items {
            let _ = write!(body, r##"<rect x="{x:.1}" y="{y:.1}" width="14" height="14" fill="{fill}" stroke="#000"/>"##);
            if !pattern.is_empty() {
                let _ = write!(body, r#"<rect x="{x:.1}" y="{y:.1}" width="14" height="14" fill="{pattern}"/>"#);
            }
            let _ = writeln!(body, r#"<text x="{:.1}" y="{:.1}" font-size="12">{label}</text>"#, x + 18.0, y + 11.5);
            x += 36.0 + 7.0 * label.len() as f64;
        }
        y += 24.0;
        for ((ri, fwd, bwd, hops, it), ops) in timed.iter().zip(&schedules).take(MAX_TIMELINES) {
            let r = &plan.replicas[*ri];
            let end = ops.iter().map(|o| o.end).fold(0.0, f64::max);
            let busy: f64 = ops.iter().map(|o| o.end - o.start).sum();
            let bubble = if end > 0.0 { 1.0 - busy / (end * r.stages.len() as f64) } else { 0.0 };
            let exposed = it.map(|t| sync_and_optimizer(fwd, bwd, hops, r.micro_batches, t)).unwrap_or(0.0);
            // The cost model prices the steady state; drawn in 1F1B order, a short iteration's
            // warm-up and cool-down can differ from it: say so when the drawing is longer.
            let longer = match it {
                Some(t) if end + exposed > t * 1.01 => format!(" · drawn with hop latency: {}", secs(end + exposed)),
                _ => String::new(),
            };
            let _ = writeln!(
                body,
                r#"<text x="8" y="{:.1}" font-size="12"><tspan font-weight="bold">replica {ri}: {}</tspan> · bubbles {:.0}% · exposed gradient sync + optimizer {}{}</text>"#,
                y + 11.0,
                secs(it.unwrap_or(end)),
                bubble * 100.0,
                secs(exposed),
                escape(&longer)
            );
            y += 18.0;
            let _ = writeln!(body, r#"<g class="timeline" data-replica="{ri}">"#);
            for si in 0..r.stages.len() {
                let ly = y + si as f64 * (LANE_H + 10.0);
                let _ = writeln!(
                    body,
                    r#"<rect class="lane" x="{LEFT:.1}" y="{ly:.1}" width="{:.1}" height="{LANE_H:.1}" fill="{IDLE}"/><text x="{:.1}" y="{:.1}" font-size="10" text-anchor="end">stage {si}</text>"#,
                    end * ts,
                    LEFT - 4.0,
                    ly + 13.0
                );
                if exposed > 0.0 {
                    let _ = writeln!(
                        body,
                        r#"<rect class="sync" x="{:.1}" y="{ly:.1}" width="{:.1}" height="{LANE_H:.1}" fill="{SYNC}"><title>exposed gradient sync + optimizer: {}</title></rect>"#,
                        LEFT + end * ts,
                        (exposed * ts).max(0.5),
                        secs(exposed)
                    );
                }
                // The hop below this lane.
                if si + 1 < r.stages.len() {
                    let (transport, cross) =
                        hop_transport(plan, *ri, si).unwrap_or_else(|| (String::new(), crosses_nodes(&r.stages[si], &r.stages[si + 1])));
                    let h = hops.get(si).copied().unwrap_or(0.0);
                    let what = if cross {
                        format!("↓ {} {}", if transport.is_empty() { "cross-node" } else { &transport }, secs(h))
                    } else {
                        format!("↓ {}", secs(h))
                    };
                    let _ = writeln!(
                        body,
                        r#"<text class="hop-time" x="{:.1}" y="{:.1}" font-size="9" text-anchor="end"{}>{}</text>"#,
                        LEFT - 4.0,
                        ly + LANE_H + 8.0,
                        if cross { r#" font-weight="bold""# } else { "" },
                        escape(&what)
                    );
                }
            }
            let (merged, single) = runs(ops, r.stages.len(), MIN_PX / ts, 1.0 / ts);
            for run in merged {
                let ly = y + run.stage as f64 * (LANE_H + 10.0);
                let (ox, ow) = (LEFT + run.start * ts, ((run.end - run.start) * ts).max(0.5));
                let fill = match (run.forward, run.backward) {
                    (0, _) => "url(#hatch)",
                    (_, 0) => FWD,
                    _ => "url(#mixed)",
                };
                let _ = writeln!(
                    body,
                    r##"<rect class="run" x="{ox:.2}" y="{ly:.1}" width="{ow:.2}" height="{LANE_H:.1}" fill="{}"/><rect x="{ox:.2}" y="{ly:.1}" width="{ow:.2}" height="{LANE_H:.1}" fill="{fill}"><title>micro-batches {}-{}: {} forward and {} backward passes</title></rect>"##,
                    if run.forward == 0 { BWD } else { FWD },
                    run.first,
                    run.last,
                    run.forward,
                    run.backward
                );
            }
            for o in &single {
                let ly = y + o.stage as f64 * (LANE_H + 10.0);
                let (ox, ow) = (LEFT + o.start * ts, ((o.end - o.start) * ts).max(0.5));
                let (class, fill) = if o.backward { ("bwd", BWD) } else { ("fwd", FWD) };
                let _ = write!(
                    body,
                    r##"<rect class="{class}" x="{ox:.2}" y="{ly:.1}" width="{ow:.2}" height="{LANE_H:.1}" fill="{fill}" stroke="#FFF" stroke-width="0.5"/>"##
                );
                if o.backward {
                    let _ = write!(body, r#"<rect x="{ox:.2}" y="{ly:.1}" width="{ow:.2}" height="{LANE_H:.1}" fill="url(#hatch)"/>"#);
                }
                if ow >= 14.0 {
                    let _ = write!(
                        body,
                        r#"<text x="{:.2}" y="{:.1}" font-size="9" text-anchor="middle" fill="{}">{}</text>"#,
                        ox + ow / 2.0,
                        ly + 12.5,
                        if o.backward { "#FFF" } else { "#000" },
                        o.micro_batch
                    );
                }
                body.push('\n');
            }
            body.push_str("</g>\n");
            y += r.stages.len() as f64 * (LANE_H + 10.0) + 14.0;
        }
        if timed.len() > MAX_TIMELINES {
            let _ = writeln!(
                body,
                r#"<text x="8" y="{:.1}" font-size="12">… and {} more replicas</text>"#,
                y + 4.0,
                timed.len() - MAX_TIMELINES
            );
            y += 18.0;
        }
        // The time axis.
        let _ = writeln!(body, r##"<line x1="{LEFT:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#000"/>"##, LEFT + inner);
        for k in 0..=5 {
            let t = horizon * k as f64 / 5.0;
            let tx = LEFT + t * ts;
            let _ = writeln!(
                body,
                r##"<line x1="{tx:.1}" y1="{y:.1}" x2="{tx:.1}" y2="{:.1}" stroke="#000"/><text x="{tx:.1}" y="{:.1}" font-size="10" text-anchor="middle">{}</text>"##,
                y + 4.0,
                y + 15.0,
                secs(t)
            );
        }
        y += 24.0;
    }

    let height = y.ceil();
    let mut out = String::with_capacity(body.len() + 512);
    let _ = writeln!(
        out,
        r##"<svg xmlns="http://www.w3.org/2000/svg" class="motley-plan" width="{WIDTH:.0}" height="{height:.0}" viewBox="0 0 {WIDTH:.0} {height:.0}" role="img" aria-labelledby="plan-title" font-family="sans-serif">"##
    );
    let _ = writeln!(out, r#"<title id="plan-title">{}</title>"#, escape(&title));
    out.push_str(r##"<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="6" stroke="#FFF" stroke-width="1.5" stroke-opacity="0.6"/></pattern>"##);
    let _ = write!(
        out,
        r##"<pattern id="mixed" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(-45)"><rect width="3" height="6" fill="{BWD}"/></pattern></defs>"##
    );
    out.push('\n');
    let _ = writeln!(out, r##"<rect width="100%" height="100%" fill="#FFF"/>"##);
    out.push_str(&body);
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc() -> Value {
        serde_json::json!({
            "global_batch": 8, "micro_batch": 1, "seq_len": 16, "model": "m<&>\"'", "iteration_time_s": 0.5,
            "replicas": [
                {"samples": 4, "micro_batches": 4, "iteration_time_s": 0.5, "hops_s": [0.01],
                 "stages": [
                    {"layers": [0, 3], "gpu": "A100", "tp": 2, "dp": 1, "gpus": [{"node": "a<script>", "index": 0}, {"node": "a<script>", "index": 1}], "fwd_s": 0.02, "bwd_s": 0.04},
                    {"layers": [3, 4], "gpu": "V100", "tp": 1, "dp": 1, "gpus": [{"node": "b", "index": 0}], "fwd_s": 0.03, "bwd_s": 0.06}]},
                {"samples": 4, "micro_batches": 4, "iteration_time_s": 0.45, "hops_s": [],
                 "stages": [{"layers": [0, 4], "gpu": "A100", "tp": 1, "dp": 1, "gpus": [{"node": "c", "index": 3}], "fwd_s": 0.05, "bwd_s": 0.1}]}
            ],
            "comm_groups": [{"kind": "pp", "gpus": [{"node": "a<script>", "index": 0}, {"node": "a<script>", "index": 1}, {"node": "b", "index": 0}],
                "transport": "socket", "nccl_net": null, "replica": 0, "stage": 0, "layers": [3, 3]}]
        })
    }

    #[test]
    fn one_block_per_stage_and_a_legend_per_gpu_type() {
        let svg = plan_svg_value(&doc()).unwrap();
        assert_eq!(svg.matches(r#"<g class="stage""#).count(), 3, "{svg}");
        assert_eq!(svg.matches(r#"<g class="legend""#).count(), 2);
        assert!(svg.contains(r#"data-gpu="A100""#) && svg.contains(r#"data-gpu="V100""#));
        // A100 and V100 get the first two Okabe-Ito colours (sorted by name).
        assert!(svg.contains(PALETTE[0].0) && svg.contains(PALETTE[1].0));
        // The cross-node hop is marked with its transport.
        assert!(svg.contains(r#"<g class="hop" data-replica="0" data-stage="0" data-transport="socket">"#), "{svg}");
        // Labels: layer range, TP width and GPUs.
        assert!(svg.contains("L0-3 A100") && svg.contains("tp 2 × dp 1"));
        // Timelines: one per replica, 2 passes per micro-batch per stage.
        assert_eq!(svg.matches(r#"<g class="timeline""#).count(), 2);
        assert_eq!(svg.matches(r#"class="fwd""#).count(), 4 * 3);
        assert_eq!(svg.matches(r#"class="bwd""#).count(), 4 * 3);
    }

    #[test]
    fn user_text_is_escaped() {
        let svg = plan_svg_value(&doc()).unwrap();
        assert!(!svg.contains("<script>") && !svg.contains("m<&>"), "{svg}");
        assert!(svg.contains("a&lt;script&gt;[0,1]") && svg.contains("m&lt;&amp;&gt;&quot;&apos;"));
        assert_eq!(escape("a\u{1}b"), "a\u{FFFD}b");
    }

    #[test]
    fn output_is_deterministic() {
        let a = plan_svg_value(&doc()).unwrap();
        let b = plan_svg_json(&doc().to_string()).unwrap();
        assert_eq!(a, b);
        assert!(a.starts_with("<svg ") && a.ends_with("</svg>\n"));
    }

    #[test]
    fn a_plan_without_times_still_draws_its_layout() {
        let mut d = doc();
        for r in d["replicas"].as_array_mut().unwrap() {
            for s in r["stages"].as_array_mut().unwrap() {
                s.as_object_mut().unwrap().remove("fwd_s");
            }
        }
        let svg = plan_svg_value(&d).unwrap();
        assert_eq!(svg.matches(r#"<g class="stage""#).count(), 3);
        assert!(svg.contains("no-timeline") && !svg.contains(r#"class="timeline""#));
        assert!(plan_svg_json(r#"{"global_batch": 1}"#).unwrap_err().to_string().contains("micro_batch"));
    }

    #[test]
    fn thousands_of_micro_batches_draw_as_a_few_shapes() {
        let mut d = doc();
        d["replicas"][0]["micro_batches"] = 4096.into();
        let svg = plan_svg_value(&d).unwrap();
        assert!(svg.contains(r#"class="run""#) && svg.contains("passes too short to draw apart"));
        assert!(svg.len() < 200_000, "{} bytes", svg.len());
        // Every pass is drawn, alone or in a run: the runs' titles count them.
        let counted: usize =
            svg.split("forward and ").skip(1).map(|t| t.split(' ').next().unwrap().parse::<usize>().unwrap()).sum::<usize>()
                + svg.matches(r#"class="bwd""#).count();
        assert_eq!(counted, 4096 * 2 + 4, "backward passes of replica 0 (2 stages) and replica 1");
        // Small plans are drawn pass by pass.
        assert!(!plan_svg_value(&doc()).unwrap().contains(r#"class="run""#));
    }

    #[test]
    fn the_tail_is_the_cost_models_sync_and_optimizer() {
        // Latency 2 x (1 + 2) = 6, period 3, 4 micro-batches: the pipeline is 15.
        assert!((sync_and_optimizer(&[1.0, 1.0], &[2.0, 2.0], &[], 4, 17.0) - 2.0).abs() < 1e-12);
        // A 1-second hop: 7 + 3 x 3.5 overlapped (the round trip through both stages, 3 + 1 + 3,
        // shared by the two micro-batches in flight), or 7 + 3 x 4 blocking; 19.5 reads as
        // blocking.
        assert!((sync_and_optimizer(&[1.0, 1.0], &[2.0, 2.0], &[1.0], 4, 19.5) - 0.5).abs() < 1e-12);
        assert!((sync_and_optimizer(&[1.0, 1.0], &[2.0, 2.0], &[1.0], 4, 18.5) - 1.0).abs() < 1e-12);
        assert_eq!(sync_and_optimizer(&[1.0], &[2.0], &[], 4, 1.0), 0.0, "never negative");
    }

    #[test]
    fn one_f_one_b_keeps_dependencies_and_has_the_textbook_length() {
        // p stages of equal f, b and no hops: (m + p - 1) * (f + b).
        let (p, m) = (4usize, 8u32);
        let ops = one_f_one_b(&vec![1.0; p], &vec![2.0; p], &[], m);
        assert_eq!(ops.len(), 2 * p * m as usize);
        let end = ops.iter().map(|o| o.end).fold(0.0, f64::max);
        assert!((end - (m as f64 + p as f64 - 1.0) * 3.0).abs() < 1e-9, "{end}");
        // No stage runs two passes at once.
        for s in 0..p {
            let mut mine: Vec<&Op> = ops.iter().filter(|o| o.stage == s).collect();
            mine.sort_by(|a, b| a.start.total_cmp(&b.start));
            assert!(mine.windows(2).all(|w| w[0].end <= w[1].start + 1e-12));
        }
        // Hops (both directions) delay the next stage's forward by half.
        let ops = one_f_one_b(&[1.0, 1.0], &[1.0, 1.0], &[1.0], 1);
        let f1 = ops.iter().find(|o| o.stage == 1 && !o.backward).unwrap();
        assert_eq!(f1.start, 1.5);
        // Fewer micro-batches than stages still finishes.
        assert_eq!(one_f_one_b(&[1.0; 5], &[1.0; 5], &[], 2).len(), 20);
    }
}
