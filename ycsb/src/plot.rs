//! `rdkv-ycsb plot`: throughput over time and READ (or first measured) latency CDFs from one or
//! more JSON reports (`run --json`), or a comparison's ops/s as bars, a group per workload and a
//! bar per store (`compare --json`), as SVG or PNG, drawn with plotters.

use std::path::{Path, PathBuf};

use anyhow::Context;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use crate::compare::Store;
use crate::comparison::Comparison;
use crate::measurement::{OperationKind, Report};

/// A file `plot` draws.
#[derive(Debug)]
pub enum Input {
    /// A phase's report (`load --json`, `run --json`).
    Report(Box<Report>),
    /// A comparison (`compare --json`).
    Comparison(Comparison),
}

/// What a file that `plot` cannot draw should be instead.
const EXPECTED: &str = "plot draws a report written by `rdkv-ycsb run --json FILE` or a comparison written by `rdkv-ycsb compare --json FILE`";

/// Reads `path` and tells which of the two it is, by its keys: `comparison` and `workloads` for
/// a comparison, `phase` and `driver` for a report.
///
/// # Errors
/// An unreadable file, or one that is neither (one line that names the fix).
pub fn read(path: &Path) -> anyhow::Result<Input> {
    let shown = path.display();
    let bytes = std::fs::read(path).with_context(|| format!("read {shown}"))?;
    let value: serde_json::Value = serde_json::from_slice(&bytes)
        .with_context(|| format!("{shown} is not JSON; {EXPECTED}"))?;
    let has = |keys: [&str; 2]| keys.iter().all(|key| value.get(key).is_some());
    if has(["comparison", "workloads"]) {
        // From the bytes: a `Value` sorts the stores by name, and their order is the run's.
        let comparison = serde_json::from_slice(&bytes).with_context(|| {
            format!("{shown} is a comparison this rdkv-ycsb cannot read; rerun `rdkv-ycsb compare --json {shown}`")
        })?;
        Ok(Input::Comparison(comparison))
    } else if has(["phase", "driver"]) {
        let report = serde_json::from_value(value).with_context(|| {
            format!("{shown} is a report this rdkv-ycsb cannot read; rerun `rdkv-ycsb run --json {shown}`")
        })?;
        Ok(Input::Report(Box::new(report)))
    } else if value
        .get(0)
        .is_some_and(|row| row.get("workload").is_some())
    {
        anyhow::bail!(
            "{shown} is a comparison from an older rdkv-ycsb (keyed `rdkv`, `redis`, …): rerun `rdkv-ycsb compare --json {shown}` with this one to plot it"
        )
    } else {
        anyhow::bail!("{shown} is neither a report nor a comparison: {EXPECTED}")
    }
}

/// Draws the files at `paths` into `output` (`.svg` or `.png`): reports together, as
/// [`plot`] does, or one comparison, as [`plot_comparison`] does.
///
/// # Errors
/// A file [`read`] refuses, a comparison given with other files, or what the drawing refuses.
pub fn plot_files(paths: &[PathBuf], output: &Path) -> anyhow::Result<()> {
    let mut reports = Vec::new();
    for path in paths {
        match read(path)? {
            Input::Report(report) => reports.push(*report),
            Input::Comparison(comparison) => {
                anyhow::ensure!(
                    paths.len() == 1,
                    "{} is a comparison, which is plotted on its own: `rdkv-ycsb plot -o FILE.svg {}`",
                    path.display(),
                    path.display()
                );
                return plot_comparison(&comparison, output);
            }
        }
    }
    plot(&reports, output)
}

/// The image formats `plot` writes.
enum ImageFormat {
    /// `.svg`.
    Svg,
    /// `.png`.
    Png,
}

/// The format `output`'s extension names.
fn image_format(output: &Path) -> anyhow::Result<ImageFormat> {
    match output.extension().and_then(|extension| extension.to_str()) {
        Some("svg") => Ok(ImageFormat::Svg),
        Some("png") => Ok(ImageFormat::Png),
        _ => anyhow::bail!("{}: the output must end in .svg or .png", output.display()),
    }
}

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
    let format = image_format(output)?;
    register_font()?;
    match format {
        ImageFormat::Svg => draw(
            SVGBackend::new(output, (1200, 500)).into_drawing_area(),
            reports,
        ),
        ImageFormat::Png => draw(
            BitMapBackend::new(output, (1200, 500)).into_drawing_area(),
            reports,
        ),
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

/// Draws `comparison` into `output` (`.svg` or `.png`): a group of bars per workload, a bar per
/// store at its median ops/s, with a whisker from the slowest round to the fastest when there
/// were several.
///
/// # Errors
/// An unknown extension, no font, a comparison without figures, or a drawing failure.
pub fn plot_comparison(comparison: &Comparison, output: &Path) -> anyhow::Result<()> {
    anyhow::ensure!(
        comparison.reports().next().is_some(),
        "the comparison has no figures to plot"
    );
    let format = image_format(output)?;
    register_font()?;
    match format {
        ImageFormat::Svg => draw_comparison(
            SVGBackend::new(output, (1100, 500)).into_drawing_area(),
            comparison,
        ),
        ImageFormat::Png => draw_comparison(
            BitMapBackend::new(output, (1100, 500)).into_drawing_area(),
            comparison,
        ),
    }
}

/// The stores of `comparison` that ran, in the order they ran.
fn compared_stores(comparison: &Comparison) -> Vec<Store> {
    let mut stores = Vec::new();
    for figures in comparison
        .workloads
        .iter()
        .flat_map(|workload| &workload.stores)
    {
        if !figures.rounds.is_empty() && !stores.contains(&figures.store) {
            stores.push(figures.store);
        }
    }
    stores
}

/// Operations per second on the axis: `250k` rather than `250000`.
fn operations_label(value: &f64) -> String {
    if *value >= 1000.0 {
        format!("{:.0}k", value / 1000.0)
    } else {
        format!("{value:.0}")
    }
}

fn draw_comparison<Backend: DrawingBackend>(
    root: DrawingArea<Backend, plotters::coord::Shift>,
    comparison: &Comparison,
) -> anyhow::Result<()>
where
    Backend::ErrorType: 'static,
{
    let failed = |error: DrawingAreaErrorKind<Backend::ErrorType>| {
        anyhow::anyhow!("draw the plot: {error:?}")
    };
    root.fill(&WHITE).map_err(failed)?;
    let (left, right) = root.split_horizontally(850);
    let stores = compared_stores(comparison);
    let groups = comparison.workloads.len();
    let highest = comparison
        .workloads
        .iter()
        .flat_map(|workload| &workload.stores)
        .map(|figures| figures.max_throughput())
        .fold(1.0f64, f64::max);
    let rounds = comparison.settings.rounds;
    let caption = if rounds > 1 {
        format!("ops/s per workload: median of {rounds} rounds, whiskers from min to max")
    } else {
        "ops/s per workload (one round)".to_string()
    };
    let mut chart = ChartBuilder::on(&left)
        .caption(caption, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.5..groups as f64 - 0.5, 0.0..highest * 1.1)
        .map_err(failed)?;
    let workload_at = |x: &f64| {
        let index = x.round();
        let on_a_group = (x - index).abs() < 1e-6 && index >= 0.0;
        on_a_group
            .then(|| comparison.workloads.get(index as usize))
            .flatten()
            .map_or_else(String::new, |workload| workload.workload.clone())
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        // Half steps, so that every group's centre is a label point (the others stay blank).
        .x_labels(groups * 2 + 1)
        .x_label_formatter(&workload_at)
        .y_label_formatter(&operations_label)
        .x_desc("workload")
        .y_desc("operations / s")
        .draw()
        .map_err(failed)?;
    for (index, store) in stores.iter().enumerate() {
        draw_store_bars(&mut chart, comparison, *store, index, stores.len()).map_err(failed)?;
    }
    draw_comparison_legend(&right, &stores, comparison).map_err(failed)?;
    root.present().map_err(failed)?;
    Ok(())
}

/// The bars of `store`, the `index`th of `stores` compared: one per workload it ran, at its
/// median, with a whisker from its slowest round to its fastest when it ran several.
fn draw_store_bars<Backend: DrawingBackend>(
    chart: &mut ChartContext<'_, Backend, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    comparison: &Comparison,
    store: Store,
    index: usize,
    stores: usize,
) -> Result<(), DrawingAreaErrorKind<Backend::ErrorType>> {
    let color = Palette99::pick(index).to_rgba();
    // A group spans 0.8 of a workload's unit, split evenly between the stores.
    let width = 0.8 / stores.max(1) as f64;
    // (bar's left edge, its figures), one per workload the store ran.
    let bars: Vec<_> = comparison
        .workloads
        .iter()
        .enumerate()
        .filter_map(|(group, workload)| {
            let left = group as f64 - 0.4 + index as f64 * width;
            workload.figures(store).map(|figures| (left, figures))
        })
        .collect();
    chart.draw_series(bars.iter().map(|(left, figures)| {
        Rectangle::new(
            [
                (*left, 0.0),
                (left + width * 0.9, figures.median_throughput()),
            ],
            color.filled(),
        )
    }))?;
    let whisker = |left: f64, low: f64, high: f64| {
        let (middle, cap) = (left + width * 0.45, width * 0.2);
        [
            vec![(middle, low), (middle, high)],
            vec![(middle - cap, low), (middle + cap, low)],
            vec![(middle - cap, high), (middle + cap, high)],
        ]
    };
    chart.draw_series(
        bars.iter()
            .filter(|(_, figures)| figures.rounds.len() > 1)
            .flat_map(|(left, figures)| {
                whisker(*left, figures.min_throughput(), figures.max_throughput())
            })
            .map(|points| PathElement::new(points, BLACK.stroke_width(1))),
    )?;
    Ok(())
}

/// The stores' colours and the comparison's settings, beside the bars.
fn draw_comparison_legend<Backend: DrawingBackend>(
    area: &DrawingArea<Backend, plotters::coord::Shift>,
    stores: &[Store],
    comparison: &Comparison,
) -> Result<(), DrawingAreaErrorKind<Backend::ErrorType>> {
    let line = |row: usize| 40 + 24 * row as i32;
    for (index, store) in stores.iter().enumerate() {
        let color = Palette99::pick(index).to_rgba();
        area.draw(&Rectangle::new(
            [(10, line(index) - 7), (26, line(index) + 7)],
            color.filled(),
        ))?;
        area.draw(&Text::new(
            store.name(),
            (34, line(index) - 8),
            ("sans-serif", 16),
        ))?;
    }
    let settings = &comparison.settings;
    let described = [
        format!(
            "{} records of {} bytes",
            settings.records, settings.record_size
        ),
        format!("{} tasks per store", settings.threads),
        format!("{} s per workload and round", settings.seconds),
        format!("{} round(s), stores in turn", settings.rounds),
    ];
    for (row, text) in described.iter().enumerate() {
        area.draw(&Text::new(
            text.as_str(),
            (10, line(stores.len() + 1 + row) - 8),
            ("sans-serif", 14),
        ))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comparison::tests::comparison;

    /// A fresh directory for one test's files.
    fn directory(name: &str) -> PathBuf {
        let directory =
            std::env::temp_dir().join(format!("rdkv-ycsb-plot-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&directory).expect("create the test directory");
        directory
    }

    #[test]
    fn a_comparison_file_is_drawn_as_bars() {
        let directory = directory("comparison");
        let compared = comparison(&[
            (Store::RdkvShm, &[100_000.0, 140_000.0]),
            (Store::RedisTcp, &[200_000.0, 210_000.0]),
        ]);
        let input = directory.join("compare.json");
        std::fs::write(&input, serde_json::to_vec(&compared).expect("JSON")).expect("write");
        let output = directory.join("compare.svg");
        plot_files(std::slice::from_ref(&input), &output).unwrap_or_else(|error| {
            panic!("{error} (plots need a TrueType font: apt-get install fonts-dejavu-core)")
        });
        let svg = std::fs::read_to_string(&output).expect("the SVG is written");
        assert!(svg.contains("<svg") && svg.contains("rdkv shm") && svg.contains("Redis TCP"));
        assert!(
            svg.contains("median of 2 rounds"),
            "the caption says what the bars are"
        );
        let at = |name: &str| svg.find(name).expect(name);
        assert!(at("rdkv shm") < at("Redis TCP"), "the legend in run order");
        let error = plot_files(&[input.clone(), input], &output).unwrap_err();
        assert!(error.to_string().contains("plotted on its own"), "{error}");
        let _ = std::fs::remove_dir_all(&directory);
    }

    #[test]
    fn a_file_that_is_neither_gets_one_line_naming_the_fix() {
        let directory = directory("neither");
        let cases = [
            (
                "other.json",
                r#"{"hello": 1}"#,
                "neither a report nor a comparison",
            ),
            ("text.json", "not json", "is not JSON"),
            (
                "old.json",
                r#"[{"workload": "C", "rdkv": null, "redis": null}]"#,
                "older rdkv-ycsb",
            ),
        ];
        for (name, text, expected) in cases {
            let path = directory.join(name);
            std::fs::write(&path, text).expect("write");
            let error = format!("{:#}", read(&path).unwrap_err());
            assert!(error.contains(expected), "{name}: {error}");
            assert!(
                error.contains("--json"),
                "{name}: names the command: {error}"
            );
            assert!(!error.contains('\n'), "{name}: one line: {error}");
        }
        let _ = std::fs::remove_dir_all(&directory);
    }
}
