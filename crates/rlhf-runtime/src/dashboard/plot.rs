//! The job page's plots: which metrics go together ([`PLOTS`]) and their SVG, drawn on the
//! head with the `plotters` crate (SVG backend, no fonts or bitmaps), so the page needs no
//! script library and works offline. Text in the SVG is escaped by plotters; the page shows
//! each plot as an image, never as markup.

use std::collections::BTreeMap;

use plotters::prelude::*;

/// One plot: a title and the metric names it draws; a name ending in `/` takes every metric
/// under that prefix (the phase timings).
pub struct PlotSpec {
    pub title: &'static str,
    pub metrics: &'static [&'static str],
}

/// The key metrics of a PPO run, under the names the driver logs (TRL's, plus ours).
pub const PLOTS: &[PlotSpec] = &[
    PlotSpec {
        title: "scores",
        metrics: &["objective/scores", "objective/rlhf_reward"],
    },
    PlotSpec {
        title: "KL",
        metrics: &["objective/kl", "policy/approxkl_avg"],
    },
    PlotSpec {
        title: "losses",
        metrics: &["loss/policy_avg", "loss/value_avg"],
    },
    PlotSpec {
        title: "clip fractions",
        metrics: &["policy/clipfrac_avg", "val/clipfrac_avg"],
    },
    PlotSpec {
        title: "response length",
        metrics: &["response_length/mean"],
    },
    PlotSpec {
        title: "entropy",
        metrics: &["objective/entropy", "policy/entropy_avg"],
    },
    PlotSpec {
        title: "throughput (tokens/s)",
        metrics: &["perf/throughput"],
    },
    PlotSpec {
        title: "time per phase (s)",
        metrics: &["timing_s/"],
    },
];

/// The size of a plot with `series` lines: taller when the legend has many entries, so it
/// does not cover the lines.
pub fn size(series: usize) -> (u32, u32) {
    (480, 260 + 16 * series.saturating_sub(6) as u32)
}

/// Points per series drawn at most; longer runs are thinned evenly (the last point kept).
pub const MAX_POINTS: usize = 1000;

/// The series of `spec` that `all` has, by name.
pub fn series_of<'a>(
    spec: &PlotSpec,
    all: &'a BTreeMap<String, Vec<(f64, f64)>>,
) -> Vec<(&'a str, &'a [(f64, f64)])> {
    let mut out = Vec::new();
    for m in spec.metrics {
        if m.ends_with('/') {
            out.extend(
                all.iter()
                    .filter(|(k, v)| k.starts_with(m) && !v.is_empty())
                    .map(|(k, v)| (k.as_str(), v.as_slice())),
            );
        } else if let Some((k, v)) = all.get_key_value(*m) {
            if !v.is_empty() {
                out.push((k.as_str(), v.as_slice()));
            }
        }
    }
    out
}

fn thin(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    if points.len() <= MAX_POINTS {
        return points.to_vec();
    }
    let stride = points.len().div_ceil(MAX_POINTS);
    let mut v: Vec<_> = points.iter().step_by(stride).copied().collect();
    if let Some(last) = points.last() {
        if v.last() != Some(last) {
            v.push(*last);
        }
    }
    v
}

fn range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() || !hi.is_finite() {
        return (0.0, 1.0);
    }
    if hi - lo < 1e-12 {
        // A flat line: give it room above and below.
        let pad = lo.abs().max(1.0) * 0.05;
        return (lo - pad, hi + pad);
    }
    let pad = (hi - lo) * 0.05;
    (lo - pad, hi + pad)
}

/// The SVG of one plot: step on x, one line per series, a legend. Non-finite values are
/// left out (the metrics file writes them as null).
pub fn svg(title: &str, series: &[(&str, &[(f64, f64)])], size: (u32, u32)) -> String {
    let thinned: Vec<(&str, Vec<(f64, f64)>)> = series
        .iter()
        .map(|(name, pts)| {
            let finite: Vec<_> = pts
                .iter()
                .copied()
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .collect();
            (*name, thin(&finite))
        })
        .collect();
    let (x0, x1) = range(thinned.iter().flat_map(|(_, p)| p.iter().map(|(x, _)| *x)));
    let (y0, mut y1) = range(thinned.iter().flat_map(|(_, p)| p.iter().map(|(_, y)| *y)));
    // Room at the top for the legend (about 14 px an entry), so it covers no line.
    let free = (14.0 * thinned.len() as f64 / f64::from(size.1.max(1))).min(0.6);
    if thinned.len() > 2 {
        y1 = y0 + (y1 - y0) / (1.0 - free);
    }
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, size).into_drawing_area();
        // Drawing into a String fails only on a bug in the ranges above; an empty plot is
        // better than a dashboard that errors.
        let _ = draw(&root, title, &thinned, (x0, x1), (y0, y1));
        let _ = root.present();
    }
    out
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

fn draw(
    root: &Area<'_>,
    title: &str,
    series: &[(&str, Vec<(f64, f64)>)],
    x: (f64, f64),
    y: (f64, f64),
) -> Result<(), Box<dyn std::error::Error>> {
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 16))
        .margin(8)
        .x_label_area_size(28)
        .y_label_area_size(56)
        .build_cartesian_2d(x.0..x.1, y.0..y.1)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .light_line_style(WHITE.mix(0.0))
        .draw()?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?
            .label(*name)
            .legend(move |(lx, ly)| PathElement::new(vec![(lx, ly), (lx + 16, ly)], color));
    }
    if !series.is_empty() {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK.mix(0.3))
            .position(SeriesLabelPosition::UpperLeft)
            .draw()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plots_pick_their_series_and_draw_every_point() {
        let mut all = BTreeMap::new();
        all.insert(
            "objective/scores".to_string(),
            vec![(1.0, 0.2), (2.0, 0.5), (3.0, f64::NAN), (4.0, 0.7)],
        );
        all.insert("timing_s/gen".to_string(), vec![(1.0, 0.1)]);
        all.insert("timing_s/step".to_string(), vec![(1.0, 0.3)]);
        all.insert("objective/kl".to_string(), vec![]);
        let scores = series_of(&PLOTS[0], &all);
        assert_eq!(scores.len(), 1, "rlhf_reward is absent");
        let timing = series_of(&PLOTS[7], &all);
        let names: Vec<_> = timing.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["timing_s/gen", "timing_s/step"]);
        assert!(
            series_of(&PLOTS[1], &all).is_empty(),
            "an empty series is no series"
        );
        let s = svg("scores", &scores, (480, 260));
        assert!(s.starts_with("<svg"), "{}", &s[..s.len().min(200)]);
        assert!(s.contains("objective/scores") && s.contains("step"));
        // One polyline with the three finite points.
        let line = s
            .lines()
            .find(|l| l.contains("<polyline") && l.contains("stroke-width=\"2\""))
            .expect("a line");
        let pts = line
            .split("points=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        assert_eq!(pts.split_whitespace().count(), 3, "{line}");
        // Empty and flat plots still render.
        assert!(svg("none", &[], (200, 100)).contains("<svg"));
        let flat = [(1.0, 2.0), (2.0, 2.0)];
        assert!(svg("flat", &[("x", &flat)], (200, 100)).contains("<polyline"));
    }

    #[test]
    fn long_series_are_thinned_with_the_last_point() {
        let pts: Vec<_> = (0..2500).map(|i| (i as f64, i as f64)).collect();
        let t = thin(&pts);
        assert!(t.len() <= MAX_POINTS + 1, "{}", t.len());
        assert_eq!(t.last(), pts.last());
        assert_eq!(t[0], pts[0]);
    }
}
