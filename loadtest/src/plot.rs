//! PNG line charts with plotters (bitmap backend, an embedded DejaVu Sans Mono font so nothing
//! is loaded from the system): admitted tokens per minute against the quota, and latency
//! percentiles.

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use crate::client::Record;

static FONT: &[u8] = include_bytes!("../assets/DejaVuSansMono.ttf");
static REGISTER: Once = Once::new();

/// One line of a chart.
#[derive(Debug)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    pub color: RGBColor,
}

pub const DIRECT: RGBColor = RGBColor(200, 60, 40);
pub const PROXY: RGBColor = RGBColor(30, 100, 200);
pub const QUOTA: RGBColor = RGBColor(60, 60, 60);

/// Draws `series` as lines into a 1000x520 PNG at `path`.
pub fn lines(
    path: &Path,
    title: &str,
    axes: (&str, &str),
    series: &[Series],
) -> anyhow::Result<()> {
    REGISTER.call_once(|| {
        let _ = register_font("sans-serif", FontStyle::Normal, FONT);
    });
    let pts = series.iter().flat_map(|s| s.points.iter());
    let x_max = pts.clone().map(|p| p.0).fold(1e-9, f64::max);
    let y_max = pts
        .map(|p| p.1)
        .filter(|y| y.is_finite())
        .fold(1e-9, f64::max)
        * 1.1;
    let root = BitMapBackend::new(path, (1000, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)?;
    chart
        .configure_mesh()
        .x_desc(axes.0)
        .y_desc(axes.1)
        .label_style(("sans-serif", 13))
        .y_label_formatter(&|y| compact(*y))
        .draw()?;
    for s in series {
        let color = s.color;
        chart
            .draw_series(LineSeries::new(
                s.points.iter().copied(),
                color.stroke_width(2),
            ))?
            .label(s.label.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    root.present()?;
    Ok(())
}

/// `1.2M`, `400k`, `12.5`: axis labels that fit.
fn compact(y: f64) -> String {
    match y.abs() {
        a if a >= 1e6 => format!("{:.1}M", y / 1e6),
        a if a >= 1e4 => format!("{:.0}k", y / 1e3),
        _ => format!("{y:.1}"),
    }
}

/// Charged tokens of completed calls over a sliding `window` (seconds), as tokens per minute,
/// sampled every second up to `until`.
pub fn tokens_per_minute(records: &[Record], window: f64, until: f64) -> Vec<(f64, f64)> {
    let mut done: Vec<(f64, u64)> = records
        .iter()
        .filter(|r| r.outcome == "ok")
        .map(|r| (r.end_ms / 1e3, r.charged))
        .collect();
    done.sort_by(|a, b| a.0.total_cmp(&b.0));
    let step = (until / 200.0).max(0.1);
    let mut out = Vec::new();
    let mut t = 0.0;
    while t <= until {
        let lo = (t - window).max(0.0);
        let sum: u64 = done
            .iter()
            .filter(|(e, _)| *e > lo && *e <= t)
            .map(|d| d.1)
            .sum();
        out.push((t, sum as f64 * 60.0 / window));
        t += step;
    }
    out
}

/// Latency percentile `q` of completed calls by start time, in `bins` bins up to `until`.
pub fn latency_over_time(records: &[Record], q: f64, bins: usize, until: f64) -> Vec<(f64, f64)> {
    let width = until / bins as f64;
    (0..bins)
        .filter_map(|i| {
            let (lo, hi) = (i as f64 * width * 1e3, (i + 1) as f64 * width * 1e3);
            let mut v: Vec<f64> = records
                .iter()
                .filter(|r| r.outcome == "ok" && r.start_ms >= lo && r.start_ms < hi)
                .map(|r| (r.end_ms - r.start_ms) / 1e3)
                .collect();
            if v.is_empty() {
                return None;
            }
            v.sort_by(f64::total_cmp);
            let k = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
            Some(((i as f64 + 0.5) * width, v[k]))
        })
        .collect()
}
