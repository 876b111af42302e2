//! Training curves drawn as a picture (SVG): the points `motley_contract::curves` reads from
//! rank 0's lines, every generation on one step axis, each with its own line (a restored
//! generation re-running steps already seen draws over them), a thin vertical line labelled
//! `gen N` where each later generation starts. Two panels: loss (lines) with the eval loss
//! (markers), and tokens/s. A series of more than [`MAX_POINTS`] points is decimated to the
//! minimum and maximum of each bucket of steps (the shape, spikes included, stays).
//!
//! Pure, like the plan picture (`svg`): text in, text out, the same input always gives the
//! same bytes; every text from outside (the title, error notes) is XML-escaped. Lines are told
//! apart by dash pattern as well as colour.

use std::fmt::Write;

use motley_contract::curves::{Curves, GenerationCurves};

use crate::svg::{clip, escape};

/// Points drawn per series at most (more are decimated, keeping each bucket's min and max).
pub const MAX_POINTS: usize = 1000;

/// At most `max` points of a series sorted by x: the first and last, and the minimum and
/// maximum (by y) of each of `(max - 2) / 2` buckets, in x order.
pub fn decimate(xy: &[(f64, f64)], max: usize) -> Vec<(f64, f64)> {
    if xy.len() <= max || max < 4 {
        return xy.to_vec();
    }
    let inner = &xy[1..xy.len() - 1];
    let buckets = (max - 2) / 2;
    let mut out = Vec::with_capacity(max);
    out.push(xy[0]);
    for b in 0..buckets {
        let (lo, hi) = (b * inner.len() / buckets, (b + 1) * inner.len() / buckets);
        let chunk = &inner[lo..hi];
        if chunk.is_empty() {
            continue;
        }
        let (mut imin, mut imax) = (0, 0);
        for (i, p) in chunk.iter().enumerate() {
            if p.1 < chunk[imin].1 {
                imin = i;
            }
            if p.1 > chunk[imax].1 {
                imax = i;
            }
        }
        out.push(chunk[imin.min(imax)]);
        if imin != imax {
            out.push(chunk[imin.max(imax)]);
        }
    }
    out.push(xy[xy.len() - 1]);
    out
}

/// Round ticks covering `[lo, hi]`: (first, last, step), the step 1, 2 or 5 times a power of
/// ten, at least `min_step`.
fn nice(lo: f64, hi: f64, n: f64, min_step: f64) -> (f64, f64, f64) {
    let (mut lo, mut hi) = (lo, hi);
    if hi - lo <= f64::EPSILON * hi.abs().max(1.0) {
        let pad = (lo.abs() * 0.1).max(min_step.max(1e-9));
        lo -= pad;
        hi += pad;
    }
    let raw = (hi - lo) / n;
    let mag = 10f64.powi(raw.log10().floor() as i32);
    let norm = raw / mag;
    let step = (if norm <= 1.0 {
        1.0
    } else if norm <= 2.0 {
        2.0
    } else if norm <= 5.0 {
        5.0
    } else {
        10.0
    } * mag)
        .max(min_step);
    ((lo / step).floor() * step, (hi / step).ceil() * step, step)
}

/// A tick label: k/M/G above ten thousand, else as many decimals as the step needs.
fn label(v: f64, step: f64) -> String {
    let v = if v.abs() < step * 1e-6 { 0.0 } else { v };
    for (div, unit) in [(1e9, "G"), (1e6, "M"), (1e4, "k")] {
        if v.abs() >= div && step >= div / 1e3 {
            let d = if div == 1e4 { 1e3 } else { div };
            let decimals = (-(step / d).log10().floor()).clamp(0.0, 3.0) as usize;
            return format!("{:.*}{unit}", decimals, v / d);
        }
    }
    let decimals = (-step.log10().floor()).clamp(0.0, 6.0) as usize;
    format!("{v:.decimals$}")
}

/// A number for people (the title, tooltips): 4 significant digits.
fn num(v: f64) -> String {
    if v.abs() >= 1e4 {
        label(v, v.abs() / 1e3)
    } else if v == 0.0 {
        "0".into()
    } else {
        let decimals = (3.0 - v.abs().log10().floor()).clamp(0.0, 8.0) as usize;
        format!("{v:.decimals$}")
    }
}

/// Line colours (Okabe-Ito, dark enough on white) and dash patterns, one pair per generation.
const LINES: [(&str, &str); 6] =
    [("#0072B2", ""), ("#D55E00", "6 3"), ("#009E73", "2 2"), ("#CC79A7", "8 3 2 3"), ("#000000", "4 4"), ("#E69F00", "1 3")];

const WIDTH: f64 = 1000.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 24.0;
const PANEL_H: f64 = 190.0;

/// A panel's y axis.
struct Axis {
    top: f64,
    lo: f64,
    hi: f64,
}

impl Axis {
    fn y(&self, v: f64) -> f64 {
        self.top + PANEL_H - (v - self.lo) / (self.hi - self.lo) * PANEL_H
    }
}

fn style(i: usize) -> (&'static str, String) {
    let (colour, dash) = LINES[i % LINES.len()];
    (colour, if dash.is_empty() { String::new() } else { format!(r#" stroke-dasharray="{dash}""#) })
}

/// The picture of a job's curves (see the module's documentation); `title` names the job.
pub fn curves_svg(c: &Curves, title: &str) -> String {
    let mut body = String::new();
    let inner = WIDTH - LEFT - RIGHT;
    let steps = || c.generations.iter().flat_map(|g| g.points.iter().map(|p| p.step).chain(g.evals.iter().map(|e| e.step)));
    let (first, last) = (steps().min(), steps().max());
    let mut head = clip(title, 80);
    let mut y = 22.0;

    let notes: Vec<String> = c
        .generations
        .iter()
        .flat_map(|g| {
            let mut n = vec![];
            if let Some(e) = &g.error {
                n.push(format!("gen {}: log not read: {}", g.generation, clip(e, 160)));
            }
            if g.non_finite > 0 {
                n.push(format!("gen {}: {} losses skipped (not finite: NaN or inf)", g.generation, g.non_finite));
            }
            if g.skipped_bytes > 0 {
                n.push(format!("gen {}: only the log's tail read ({} earlier bytes not shown)", g.generation, g.skipped_bytes));
            }
            n
        })
        .collect();

    match (first, last) {
        (Some(first), Some(last)) => {
            let _ = write!(head, " · steps {first}–{last}");
            if let Some(p) = c.generations.iter().rev().find_map(|g| g.points.last()) {
                let _ = write!(head, " · loss {}", num(p.loss));
            }
            let _ = writeln!(body, r#"<text x="8" y="{y:.1}" font-size="15" font-weight="bold">{}</text>"#, escape(&head));
            y += 12.0;
            // Legend: one line style per generation, and the eval marker.
            let mut x = LEFT;
            let drawn: Vec<(usize, &GenerationCurves)> =
                c.generations.iter().filter(|g| !g.points.is_empty() || !g.evals.is_empty()).enumerate().collect();
            for (i, g) in &drawn {
                let (colour, dash) = style(*i);
                let _ = writeln!(
                    body,
                    r#"<g class="legend" data-generation="{}"><line x1="{x:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{colour}" stroke-width="2"{dash}/><text x="{:.1}" y="{:.1}" font-size="12">gen {}</text></g>"#,
                    g.generation,
                    y + 7.0,
                    x + 24.0,
                    y + 7.0,
                    x + 28.0,
                    y + 11.0,
                    g.generation
                );
                x += 80.0;
            }
            let _ = writeln!(
                body,
                r##"<g class="legend"><circle cx="{:.1}" cy="{:.1}" r="3.5" fill="#FFF" stroke="#000" stroke-width="1.5"/><text x="{:.1}" y="{:.1}" font-size="12">eval loss</text></g>"##,
                x + 6.0,
                y + 7.0,
                x + 14.0,
                y + 11.0
            );
            y += 28.0;

            let (x0, x1, xstep) = nice(first as f64, last as f64, 10.0, 1.0);
            let sx = |s: f64| LEFT + (s - x0) / (x1 - x0) * inner;

            // Panel 1: loss and eval loss; panel 2: tokens/s.
            let losses = c.generations.iter().flat_map(|g| g.points.iter().map(|p| p.loss).chain(g.evals.iter().map(|e| e.eval_loss)));
            let (llo, lhi) = losses.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| (a.min(v), b.max(v)));
            let tps: Vec<f64> = c.generations.iter().flat_map(|g| g.points.iter().filter_map(|p| p.tokens_per_s)).collect();
            let (tlo, thi) = tps.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| (a.min(*v), b.max(*v)));
            let panels = [
                ("loss", "loss (lines) · eval loss (markers)", (llo <= lhi).then_some((llo, lhi))),
                ("tokens", "tokens/s", (!tps.is_empty()).then_some((tlo.min(0.0), thi))),
            ];
            let panels_top = y;
            for (class, name, range) in panels {
                let _ = writeln!(body, r#"<text x="{LEFT:.1}" y="{:.1}" font-size="13" font-weight="bold">{name}</text>"#, y + 4.0);
                y += 12.0;
                let _ = writeln!(
                    body,
                    r##"<rect class="panel" data-panel="{class}" x="{LEFT:.1}" y="{y:.1}" width="{inner:.1}" height="{PANEL_H:.1}" fill="#FFF" stroke="#000"/>"##
                );
                // Step ticks, on every panel.
                for k in 0..=((x1 - x0) / xstep).round() as usize {
                    let t = x0 + k as f64 * xstep;
                    let tx = sx(t);
                    let _ = writeln!(
                        body,
                        r##"<line class="xtick" x1="{tx:.1}" y1="{:.1}" x2="{tx:.1}" y2="{:.1}" stroke="#000"/><text x="{tx:.1}" y="{:.1}" font-size="10" text-anchor="middle">{}</text>"##,
                        y + PANEL_H,
                        y + PANEL_H + 4.0,
                        y + PANEL_H + 15.0,
                        label(t, xstep)
                    );
                }
                let Some((lo, hi)) = range else {
                    let _ = writeln!(
                        body,
                        r#"<text class="no-data" x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">no {name} reported (older runs print only step and loss)</text>"#,
                        LEFT + inner / 2.0,
                        y + PANEL_H / 2.0
                    );
                    y += PANEL_H + 34.0;
                    continue;
                };
                let (lo, hi, ystep) = nice(lo, hi, 5.0, 0.0);
                let axis = Axis { top: y, lo, hi };
                for k in 0..=((hi - lo) / ystep).round() as usize {
                    let v = lo + k as f64 * ystep;
                    let ty = axis.y(v);
                    let _ = writeln!(
                        body,
                        r##"<line class="ytick" x1="{:.1}" y1="{ty:.1}" x2="{:.1}" y2="{ty:.1}" stroke="#DDD"/><text x="{:.1}" y="{:.1}" font-size="10" text-anchor="end">{}</text>"##,
                        LEFT,
                        LEFT + inner,
                        LEFT - 4.0,
                        ty + 3.5,
                        label(v, ystep)
                    );
                }
                let _ = writeln!(
                    body,
                    r#"<text x="14" y="{:.1}" font-size="11" text-anchor="middle" transform="rotate(-90 14 {:.1})">{}</text>"#,
                    y + PANEL_H / 2.0,
                    y + PANEL_H / 2.0,
                    if class == "loss" { "loss" } else { name }
                );
                for (i, g) in &drawn {
                    let (colour, dash) = style(*i);
                    let xy: Vec<(f64, f64)> = if class == "loss" {
                        g.points.iter().map(|p| (p.step as f64, p.loss)).collect()
                    } else {
                        g.points.iter().filter_map(|p| Some((p.step as f64, p.tokens_per_s?))).collect()
                    };
                    let pts = decimate(&xy, MAX_POINTS);
                    if !pts.is_empty() {
                        let coords: Vec<String> = pts.iter().map(|(s, v)| format!("{:.1},{:.1}", sx(*s), axis.y(*v))).collect();
                        let _ = writeln!(
                            body,
                            r#"<polyline class="{class}" data-generation="{}" data-points="{}" points="{}" fill="none" stroke="{colour}" stroke-width="1.5"{dash}><title>gen {}: {} steps</title></polyline>"#,
                            g.generation,
                            xy.len(),
                            coords.join(" "),
                            g.generation,
                            xy.len()
                        );
                        if pts.len() == 1 {
                            let _ = writeln!(
                                body,
                                r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{colour}"/>"#,
                                sx(pts[0].0),
                                axis.y(pts[0].1)
                            );
                        }
                    }
                    if class == "loss" && !g.evals.is_empty() {
                        let xy: Vec<(f64, f64)> = g.evals.iter().map(|e| (e.step as f64, e.eval_loss)).collect();
                        let _ = writeln!(body, r#"<g class="evals" data-generation="{}" data-points="{}">"#, g.generation, xy.len());
                        for (s, v) in decimate(&xy, MAX_POINTS) {
                            let _ = writeln!(
                                body,
                                r##"<circle class="eval" cx="{:.1}" cy="{:.1}" r="3.5" fill="#FFF" stroke="{colour}" stroke-width="1.5"><title>gen {}, step {}: eval loss {}</title></circle>"##,
                                sx(s),
                                axis.y(v),
                                g.generation,
                                s as i64,
                                num(v)
                            );
                        }
                        body.push_str("</g>\n");
                    }
                }
                y += PANEL_H + 34.0;
            }
            let _ =
                writeln!(body, r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">step</text>"#, LEFT + inner / 2.0, y - 8.0);
            // Where each later generation starts: a thin line through both panels.
            for (_, g) in drawn.iter().skip(1) {
                let start = g.points.iter().map(|p| p.step).chain(g.evals.iter().map(|e| e.step)).min().unwrap_or(0);
                let bx = sx(start as f64);
                let _ = writeln!(
                    body,
                    r##"<g class="generation" data-generation="{}" data-step="{start}"><line x1="{bx:.1}" y1="{:.1}" x2="{bx:.1}" y2="{:.1}" stroke="#555" stroke-width="1" stroke-dasharray="3 2"/><text x="{:.1}" y="{:.1}" font-size="11" fill="#333">gen {}</text></g>"##,
                    g.generation,
                    panels_top + 12.0,
                    y - 34.0,
                    bx + 3.0,
                    panels_top + 24.0,
                    g.generation
                );
            }
        }
        _ => {
            let _ = writeln!(body, r#"<text x="8" y="{y:.1}" font-size="15" font-weight="bold">{}</text>"#, escape(&head));
            y += 30.0;
            let _ = writeln!(body, r#"<text class="empty" x="8" y="{y:.1}" font-size="13">no steps yet</text>"#);
            y += 16.0;
        }
    }

    for n in &notes {
        y += 16.0;
        let _ = writeln!(body, r#"<text class="note" x="8" y="{y:.1}" font-size="11">{}</text>"#, escape(n));
    }
    let height = (y + 12.0).ceil();
    let mut out = String::with_capacity(body.len() + 512);
    let _ = writeln!(
        out,
        r##"<svg xmlns="http://www.w3.org/2000/svg" class="motley-curves" width="{WIDTH:.0}" height="{height:.0}" viewBox="0 0 {WIDTH:.0} {height:.0}" role="img" aria-labelledby="curves-title" font-family="sans-serif">"##
    );
    let _ = writeln!(out, r#"<title id="curves-title">Training curves: {}</title>"#, escape(&head));
    let _ = writeln!(out, r##"<rect width="100%" height="100%" fill="#FFF"/>"##);
    out.push_str(&body);
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use motley_contract::curves::parse_generation;

    /// The contract's test log (`motley_contract::curves`'s tests read it too).
    const GEN1: &str = include_str!("../../contract/tests/data/rank0-generation1.txt");

    fn two_generations() -> Curves {
        // Generation 2 restored from step 4 and re-ran steps 4..6 of generation 1.
        let mut g1 = String::new();
        let mut g2 = String::new();
        for s in 1..=6 {
            g1 += &format!("{{\"step\": {s}, \"loss\": {}, \"tokens_per_s\": 5000}}\n", 10.0 - s as f64);
        }
        for s in 4..=10 {
            g2 += &format!("{{\"step\": {s}, \"loss\": {}, \"tokens_per_s\": 6000}}\n", 9.0 - s as f64 * 0.5);
        }
        g2 += "{\"step\": 10, \"eval_loss\": 4.2}\n";
        Curves { generations: vec![parse_generation(1, &g1), parse_generation(2, &g2)] }
    }

    #[test]
    fn generations_share_one_step_axis_with_a_boundary_line() {
        let svg = curves_svg(&two_generations(), "job");
        // Each generation its own loss and tokens/s line, with all its own points.
        assert!(svg.contains(r#"<polyline class="loss" data-generation="1" data-points="6""#), "{svg}");
        assert!(svg.contains(r#"<polyline class="loss" data-generation="2" data-points="7""#));
        assert!(svg.contains(r#"<polyline class="tokens" data-generation="2" data-points="7""#));
        assert_eq!(svg.matches(r#"class="eval""#).count(), 1);
        // One boundary, where generation 2 starts (step 4), labelled.
        assert_eq!(svg.matches(r#"<g class="generation""#).count(), 1);
        assert!(svg.contains(r#"<g class="generation" data-generation="2" data-step="4">"#) && svg.contains(">gen 2</text>"));
        // Step 4 is at the same x in both generations' lines: one axis.
        let x_of = |g: &str, nth: usize| -> String {
            let at = svg.find(&format!(r#"class="loss" data-generation="{g}""#)).unwrap();
            let pts = svg[at..].split("points=\"").nth(2).unwrap().split('"').next().unwrap();
            pts.split(' ').nth(nth).unwrap().split(',').next().unwrap().to_string()
        };
        assert_eq!(x_of("1", 3), x_of("2", 0));
        assert!(svg.contains("steps 1–10"));
    }

    #[test]
    fn axes_have_ticks_and_labels() {
        let svg = curves_svg(&two_generations(), "job");
        // Steps 1..10: ticks 1 apart from 1 to 10 under each of the two panels.
        assert_eq!(svg.matches(r#"class="xtick""#).count(), 2 * 10, "{svg}");
        assert!(svg.contains(">step</text>") && svg.contains(">tokens/s</text>"));
        assert!(svg.matches(r#"class="ytick""#).count() >= 6);
        // Thousands are written short.
        assert!(svg.contains(">6000</text>"), "{svg}");
        assert_eq!(label(12000.0, 2000.0), "12k");
        assert_eq!(label(1_500_000.0, 500_000.0), "1.5M");
        assert_eq!(label(0.25, 0.05), "0.25");
        assert_eq!(label(3.0, 1.0), "3");
        assert_eq!(nice(1.0, 10.0, 10.0, 1.0), (1.0, 10.0, 1.0));
        assert!(nice(2.0, 2.0, 5.0, 0.0).2 > 0.0, "a flat series still has an axis");
    }

    #[test]
    fn output_is_deterministic_and_text_is_escaped() {
        let mut c = two_generations();
        c.generations[1].error = Some("node <b>&'\"".into());
        let a = curves_svg(&c, "m<script>&");
        assert_eq!(a, curves_svg(&c, "m<script>&"));
        assert!(a.starts_with("<svg ") && a.ends_with("</svg>\n"));
        assert!(!a.contains("<script>") && !a.contains("<b>"), "{a}");
        assert!(a.contains("m&lt;script&gt;&amp;") && a.contains("node &lt;b&gt;&amp;&apos;&quot;"));
    }

    #[test]
    fn no_points_is_an_empty_chart_saying_so() {
        for c in [Curves::default(), Curves { generations: vec![parse_generation(1, "hello\n")] }] {
            let svg = curves_svg(&c, "job");
            assert!(svg.contains(">no steps yet</text>") && !svg.contains("<polyline"), "{svg}");
            assert!(svg.starts_with("<svg ") && svg.ends_with("</svg>\n"));
        }
        // An unread generation is said so.
        let c = Curves { generations: vec![GenerationCurves { generation: 1, error: Some("agent gone".into()), ..Default::default() }] };
        assert!(curves_svg(&c, "j").contains("gen 1: log not read: agent gone"));
    }

    #[test]
    fn non_finite_losses_are_skipped_and_counted() {
        let c = Curves { generations: vec![parse_generation(1, GEN1)] };
        let svg = curves_svg(&c, "job");
        assert!(svg.contains("gen 1: 2 losses skipped (not finite: NaN or inf)"), "{svg}");
        for bad in ["NaN,", ",NaN", "inf,", ",inf", "=\"NaN", "=\"inf"] {
            assert!(!svg.contains(bad), "{bad}: {svg}");
        }
        // Older runs: no tokens/s panel data, said so.
        let old = Curves { generations: vec![parse_generation(1, "{\"step\": 1, \"loss\": 2}\n{\"step\": 2, \"loss\": 1}\n")] };
        let svg = curves_svg(&old, "job");
        assert!(svg.contains("no tokens/s reported") && svg.contains(r#"data-points="2""#), "{svg}");
        // A single point still shows.
        let one = Curves { generations: vec![parse_generation(1, "{\"step\": 1, \"loss\": 2}\n")] };
        assert!(curves_svg(&one, "job").contains("<circle cx="));
    }

    #[test]
    fn thousands_of_steps_are_decimated_keeping_their_shape() {
        let n = 50_000;
        let mut log = String::new();
        for s in 0..n {
            // A slow decay with one spike and one dip.
            let loss = match s {
                31_337 => 50.0,
                40_001 => 0.01,
                _ => 5.0 - s as f64 * 1e-4,
            };
            log += &format!("{{\"step\": {s}, \"loss\": {loss}, \"tokens_per_s\": {}}}\n", 1000 + s % 7);
        }
        let g = parse_generation(1, &log);
        assert_eq!(g.points.len(), n);
        let xy: Vec<(f64, f64)> = g.points.iter().map(|p| (p.step as f64, p.loss)).collect();
        let d = decimate(&xy, MAX_POINTS);
        assert!(d.len() <= MAX_POINTS && d.len() > MAX_POINTS / 2, "{}", d.len());
        assert!(d.contains(&(31_337.0, 50.0)) && d.contains(&(40_001.0, 0.01)), "the spike and the dip stay");
        assert_eq!((d[0], d[d.len() - 1]), (xy[0], xy[n - 1]));
        assert!(d.windows(2).all(|w| w[0].0 < w[1].0), "in step order");
        let svg = curves_svg(&Curves { generations: vec![g] }, "big");
        assert!(svg.len() < 120_000, "{} bytes", svg.len());
        let polyline = svg.split(r#"class="loss""#).nth(1).unwrap();
        let pts = polyline.split("points=\"").nth(2).unwrap().split('"').next().unwrap();
        assert!(pts.split(' ').count() <= MAX_POINTS);
        assert!(polyline.starts_with(&format!(r#" data-generation="1" data-points="{n}""#)));
        // Small series are drawn whole.
        assert_eq!(decimate(&xy[..10], MAX_POINTS), xy[..10].to_vec());
    }
}
