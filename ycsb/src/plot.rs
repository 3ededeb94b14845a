//! `rdkv-ycsb plot`: throughput over time and READ (or first measured) latency CDFs from one or
//! more JSON reports, as SVG or PNG, drawn with plotters.

use std::path::Path;

use plotters::prelude::*;

use crate::measurement::{OperationKind, Report};

/// Where a TrueType font for labels may be.
const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

fn register_font() -> anyhow::Result<()> {
    for candidate in FONT_CANDIDATES {
        if let Ok(bytes) = std::fs::read(candidate) {
            let leaked: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font("sans-serif", FontStyle::Normal, leaked).is_ok() {
                return Ok(());
            }
        }
    }
    anyhow::bail!(
        "no TrueType font for plot labels: install one with `apt-get install fonts-dejavu-core` (looked in {})",
        FONT_CANDIDATES.join(", ")
    )
}

/// Draws `reports` into `output` (`.svg` or `.png`).
///
/// # Errors
/// An unknown extension, no font, or a drawing failure.
pub fn plot(reports: &[Report], output: &Path) -> anyhow::Result<()> {
    anyhow::ensure!(!reports.is_empty(), "no reports to plot");
    register_font()?;
    match output.extension().and_then(|extension| extension.to_str()) {
        Some("svg") => draw(
            SVGBackend::new(output, (1200, 500)).into_drawing_area(),
            reports,
        ),
        Some("png") => draw(
            BitMapBackend::new(output, (1200, 500)).into_drawing_area(),
            reports,
        ),
        _ => anyhow::bail!("{}: the output must end in .svg or .png", output.display()),
    }
}

fn label(report: &Report) -> String {
    format!("{} {} ({})", report.driver, report.workload, report.phase)
}

fn draw<Backend: DrawingBackend>(
    root: DrawingArea<Backend, plotters::coord::Shift>,
    reports: &[Report],
) -> anyhow::Result<()>
where
    Backend::ErrorType: 'static,
{
    let failed = |error: DrawingAreaErrorKind<Backend::ErrorType>| {
        anyhow::anyhow!("draw the plot: {error:?}")
    };
    root.fill(&WHITE).map_err(failed)?;
    let (left, right) = root.split_horizontally(600);

    let max_time = reports
        .iter()
        .flat_map(|report| report.timeseries.iter().map(|(time, _)| *time))
        .fold(1.0f64, f64::max);
    let max_rate = reports
        .iter()
        .flat_map(|report| report.timeseries.iter().map(|(_, rate)| *rate))
        .fold(1.0f64, f64::max);
    let mut throughput = ChartBuilder::on(&left)
        .caption("Throughput over time", ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..max_time * 1.05, 0.0..max_rate * 1.1)
        .map_err(failed)?;
    throughput
        .configure_mesh()
        .x_desc("seconds")
        .y_desc("operations / s")
        .draw()
        .map_err(failed)?;

    let slowest = reports
        .iter()
        .filter_map(|report| read_or_first(report))
        .flat_map(|summary| summary.cdf.iter().map(|(latency, _)| *latency))
        .max()
        .unwrap_or(1)
        .max(2);
    let mut cdf = ChartBuilder::on(&right)
        .caption(
            "Latency CDF (READ, or the first operation)",
            ("sans-serif", 20),
        )
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(50)
        .build_cartesian_2d((1u64..slowest * 2).log_scale(), 0.0..1.0)
        .map_err(failed)?;
    cdf.configure_mesh()
        .x_desc("latency (µs)")
        .y_desc("fraction of operations")
        .draw()
        .map_err(failed)?;

    for (index, report) in reports.iter().enumerate() {
        let color = Palette99::pick(index).to_rgba();
        throughput
            .draw_series(LineSeries::new(
                report.timeseries.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(failed)?
            .label(label(report))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        if let Some(summary) = read_or_first(report) {
            cdf.draw_series(LineSeries::new(
                summary
                    .cdf
                    .iter()
                    .map(|(latency, quantile)| ((*latency).max(1), *quantile)),
                color.stroke_width(2),
            ))
            .map_err(failed)?
            .label(format!("{} {}", label(report), summary.kind.label()))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        }
    }
    throughput
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(failed)?;
    cdf.configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(failed)?;
    root.present().map_err(failed)?;
    Ok(())
}

fn read_or_first(report: &Report) -> Option<&crate::measurement::KindSummary> {
    report
        .kind(OperationKind::Read)
        .or_else(|| report.kinds.first())
}
