//! Charts drawn as self-contained SVG (no fonts or network needed to view them): the
//! primitives `report` and `demo` draw with (lines over an x axis, bars, thinning, moving
//! averages, time axes), the shared palette, and the plan's picture in [`plan`].

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

mod plan;

pub use plan::plan_report_svg;

/// A chart that could not be drawn.
#[derive(Debug, thiserror::Error)]
pub enum ChartError {
    /// The drawing library failed.
    #[error("failed to draw a chart: {0}")]
    Draw(String),
    /// The data cannot be placed on axes (values too large or not finite).
    #[error("{0}")]
    OutOfRange(String),
}

fn err<E: std::fmt::Debug>(e: E) -> ChartError {
    ChartError::Draw(format!("{e:?}"))
}

/// Distinct colours, reused cyclically: buckets take them in order; line series skip the red,
/// which marks worker exits.
const PALETTE: [RGBColor; 12] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(57, 59, 121),
    RGBColor(173, 73, 74),
];

/// The red of worker exits (and of nothing else on a line chart).
pub const EXIT_COLOR: RGBColor = PALETTE[3];

/// The colour of bucket `bucket`.
pub fn bucket_color(bucket: usize) -> RGBColor {
    PALETTE[bucket % PALETTE.len()]
}

/// The colour of the `i`-th line of a chart: the palette without the exit red.
pub fn series_color(i: usize) -> RGBColor {
    let others = PALETTE.len() - 1;
    let i = i % others;
    PALETTE[if i < 3 { i } else { i + 1 }]
}

const FONT: &str = "sans-serif";
/// Points drawn per series at most; longer series are averaged over runs of neighbours.
pub const MAX_POINTS: usize = 1500;

pub struct Series {
    pub name: String,
    pub color: RGBColor,
    pub points: Vec<(f64, f64)>,
    /// Drawn thin and light (raw values under a moving average).
    pub faint: bool,
}

pub struct Marker {
    pub x: f64,
    pub label: String,
}

pub struct Markers {
    pub list: Vec<Marker>,
    pub labelled: bool,
}

pub struct LineChart<'a> {
    pub title: &'a str,
    pub x_desc: String,
    pub y_desc: &'a str,
    pub size: (u32, u32),
    pub x_range: Option<(f64, f64)>,
    /// The y axis starts at 0 when every value is positive.
    pub y_from_zero: bool,
    /// The y axis reaches at least this value (100 for a percentage).
    pub y_at_least: Option<f64>,
    pub y_fmt: fn(f64) -> String,
    pub series: Vec<Series>,
    pub markers: Option<&'a Markers>,
}

/// A line chart of its own, `c.size` pixels.
pub fn draw_lines(c: &LineChart<'_>) -> Result<String, ChartError> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, c.size).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        draw_lines_on(&root, c)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// Draws `c` on `root`, with its exit markers.
fn draw_lines_on<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    c: &LineChart<'_>,
) -> Result<(), ChartError> {
    let points = || c.series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1) = c.x_range.unwrap_or_else(|| {
        points().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
            (lo.min(p.0), hi.max(p.0))
        })
    });
    if !x0.is_finite() || !x1.is_finite() {
        (x0, x1) = (0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let (mut lo, mut hi) = points().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
        (lo.min(p.1), hi.max(p.1))
    });
    if !lo.is_finite() || !hi.is_finite() {
        (lo, hi) = (0.0, 1.0);
    }
    if c.y_from_zero && lo >= 0.0 {
        lo = 0.0;
    }
    if let Some(m) = c.y_at_least {
        hi = hi.max(m);
    }
    let pad = if hi > lo {
        0.06 * (hi - lo)
    } else {
        (0.1 * hi.abs()).max(1.0)
    };
    let y0 = if c.y_from_zero && lo >= 0.0 {
        0.0
    } else {
        lo - pad
    };
    let mut y1 = if c.y_at_least.is_some_and(|m| hi <= m) {
        hi
    } else {
        hi + pad
    };
    if !(y1 - y0).is_finite() || !(x1 - x0).is_finite() {
        return Err(ChartError::OutOfRange(format!(
            "{}: values out of range to draw ({y0:e}..{y1:e} over {x0:e}..{x1:e})",
            c.title
        )));
    }
    let markers = c.markers.map_or(&[][..], |m| &m.list[..]);
    let labelled = c.markers.is_some_and(|m| m.labelled) && !markers.is_empty();
    if labelled {
        // Headroom above the data for the exit labels.
        y1 += 0.14 * (y1 - y0);
    }

    {
        let mut chart = ChartBuilder::on(root)
            .caption(c.title, (FONT, 20))
            .margin(12)
            .x_label_area_size(42)
            .y_label_area_size(62)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(err)?;
        let y_fmt = c.y_fmt;
        chart
            .configure_mesh()
            .light_line_style(RGBColor(244, 244, 244))
            .bold_line_style(RGBColor(222, 222, 222))
            .x_labels(8)
            .y_labels(7)
            .x_label_formatter(&|v| crate::format::compact(*v))
            .y_label_formatter(&|v| y_fmt(*v))
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 15))
            .x_desc(c.x_desc.as_str())
            .y_desc(c.y_desc)
            .draw()
            .map_err(err)?;
        for s in &c.series {
            let style = if s.faint {
                s.color.mix(0.35).stroke_width(1)
            } else {
                s.color.stroke_width(2)
            };
            chart
                .draw_series(LineSeries::new(s.points.iter().copied(), style))
                .map_err(err)?;
        }
        for m in markers {
            chart
                .draw_series(DashedLineSeries::new(
                    vec![(m.x, y0), (m.x, y1)],
                    5,
                    4,
                    EXIT_COLOR.stroke_width(1),
                ))
                .map_err(err)?;
        }
        if labelled {
            let (xs, _) = chart.plotting_area().get_pixel_range();
            // Up to three rows of labels; a label goes to the first row with room for it.
            let mut row_end = [i32::MIN; 3];
            let style = TextStyle::from((FONT, 14).into_font()).color(&EXIT_COLOR);
            for m in markers {
                let (px, top) = chart.backend_coord(&(m.x, y1));
                let width = 7 * m.label.chars().count() as i32 + 2;
                let left = if px + 3 + width <= xs.end {
                    px + 3
                } else {
                    px - 3 - width
                };
                if let Some(row) = row_end.iter().position(|&end| end + 4 <= left) {
                    row_end[row] = left + width;
                    let y = top + 3 + 14 * row as i32;
                    // A light backing keeps the label readable over a neighbouring exit's line.
                    root.draw(&Rectangle::new(
                        [(left - 2, y - 1), (left + width - 2, y + 12)],
                        WHITE.mix(0.85).filled(),
                    ))
                    .map_err(err)?;
                    root.draw(&Text::new(m.label.clone(), (left, y), style.clone()))
                        .map_err(err)?;
                }
            }
        }
    }
    Ok(())
}

/// A bar chart: one bar per (label, value, colour), the value written above the bar.
pub fn draw_bars(
    title: &str,
    x_desc: &str,
    y_desc: &str,
    bars: &[(String, f64, RGBColor)],
    size: (u32, u32),
) -> Result<String, ChartError> {
    let top = bars.iter().map(|b| b.1).fold(1.0, f64::max) * 1.12;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, (FONT, 20))
            .margin(12)
            .x_label_area_size(42)
            .y_label_area_size(62)
            // Integer ranges are inclusive here: 0..k-1 makes k segments.
            .build_cartesian_2d(
                (0..bars.len().saturating_sub(1)).into_segmented(),
                0f64..top,
            )
            .map_err(err)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .light_line_style(RGBColor(244, 244, 244))
            .bold_line_style(RGBColor(222, 222, 222))
            .x_labels(bars.len().min(40))
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => bars.get(*i).map(|b| b.0.clone()).unwrap_or_default(),
                _ => String::new(),
            })
            // Counts: whole numbers only.
            .y_labels((top as usize + 1).clamp(2, 8))
            .y_label_formatter(&|v| {
                if v.fract() == 0.0 {
                    crate::format::compact(*v)
                } else {
                    String::new()
                }
            })
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 15))
            .x_desc(x_desc)
            .y_desc(y_desc)
            .draw()
            .map_err(err)?;
        chart
            .draw_series(bars.iter().enumerate().map(|(i, (_, v, color))| {
                let mut bar = Rectangle::new(
                    [
                        (SegmentValue::Exact(i), 0.0),
                        (SegmentValue::Exact(i + 1), *v),
                    ],
                    color.filled(),
                );
                bar.set_margin(0, 0, 6, 6);
                bar
            }))
            .map_err(err)?;
        if bars.len() <= 40 {
            let style =
                TextStyle::from((FONT, 14).into_font()).pos(Pos::new(HPos::Center, VPos::Bottom));
            chart
                .draw_series(bars.iter().enumerate().map(|(i, (_, v, _))| {
                    Text::new(
                        crate::format::grouped(*v),
                        (SegmentValue::CenterOf(i), *v + top * 0.01),
                        style.clone(),
                    )
                }))
                .map_err(err)?;
        }
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// Averages runs of neighbours so that a series has at most `MAX_POINTS` points.
pub fn thin(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    if points.len() <= MAX_POINTS {
        return points.to_vec();
    }
    let per = points.len().div_ceil(MAX_POINTS);
    points
        .chunks(per)
        .map(|c| {
            let n = c.len() as f64;
            (
                c.iter().map(|p| p.0).sum::<f64>() / n,
                c.iter().map(|p| p.1).sum::<f64>() / n,
            )
        })
        .collect()
}

/// Trailing moving average over a twentieth of the series.
pub fn moving_average(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let window = (points.len() / 20).max(1);
    let mut sum = 0.0;
    points
        .iter()
        .enumerate()
        .map(|(i, &(x, y))| {
            sum += y;
            if i >= window {
                sum -= points[i - window].1;
            }
            (x, sum / (i + 1).min(window) as f64)
        })
        .collect()
}

/// The unit of the time axes, picked from the run's length.
pub struct TimeAxis {
    pub seconds: f64,
    pub unit: &'static str,
}

impl TimeAxis {
    pub fn for_duration(d: f64) -> TimeAxis {
        let (seconds, unit) = if d <= 600.0 {
            (1.0, "s")
        } else if d <= 10.0 * 3600.0 {
            (60.0, "min")
        } else {
            (3600.0, "h")
        };
        TimeAxis { seconds, unit }
    }

    pub fn x(&self, since_start: f64) -> f64 {
        since_start / self.seconds
    }

    pub fn desc(&self) -> String {
        format!("time since the run's first metrics line ({})", self.unit)
    }
}

/// Loss and accuracy over optimiser steps, `points` = (step, loss, accuracy), side by side, each
/// with its raw values (faint) and a moving average.
pub fn training_curves_svg(points: &[(f64, f64, f64)], title: &str) -> Result<String, ChartError> {
    let curve = |caption: &'static str, y_desc: &'static str, pick: fn(&(f64, f64, f64)) -> f64| {
        let raw: Vec<(f64, f64)> = points
            .iter()
            .map(|p| (p.0, pick(p)))
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect();
        let raw = thin(&raw);
        let smooth = moving_average(&raw);
        LineChart {
            title: caption,
            x_desc: "optimiser step".into(),
            y_desc,
            size: (600, 400),
            x_range: None,
            y_from_zero: true,
            y_at_least: None,
            y_fmt: crate::format::compact,
            series: vec![
                Series {
                    name: "raw".into(),
                    color: series_color(0),
                    points: raw,
                    faint: true,
                },
                Series {
                    name: "moving average".into(),
                    color: series_color(0),
                    points: smooth,
                    faint: false,
                },
            ],
            markers: None,
        }
    };
    let loss = curve("Training loss", "loss", |p| p.1);
    let accuracy = LineChart {
        y_at_least: Some(1.0),
        ..curve(
            "Draft accuracy (block positions 1..)",
            "fraction correct",
            |p| p.2,
        )
    };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1200, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let root = root.titled(title, (FONT, 18)).map_err(err)?;
        let (left, right) = root.split_horizontally(600);
        draw_lines_on(&left, &loss)?;
        draw_lines_on(&right, &accuracy)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thin_and_average_keep_the_shape() {
        let points: Vec<(f64, f64)> = (0..10_000).map(|i| (i as f64, 1.0)).collect();
        let thinned = thin(&points);
        assert!(thinned.len() <= MAX_POINTS);
        assert!(thinned.iter().all(|p| (p.1 - 1.0).abs() < 1e-12));
        let avg = moving_average(&[(0.0, 0.0), (1.0, 2.0), (2.0, 4.0)]);
        assert_eq!(avg, vec![(0.0, 0.0), (1.0, 2.0), (2.0, 4.0)]);
    }

    #[test]
    fn line_series_never_take_the_exit_red() {
        let colors: Vec<RGBColor> = (0..30).map(series_color).collect();
        assert!(colors.iter().all(|&c| c != EXIT_COLOR));
        // The first lines keep the colours they always had.
        assert_eq!(colors[0], PALETTE[0]);
        assert_eq!(colors[3], PALETTE[4]);
        assert_eq!(colors[9], PALETTE[10]);
    }

    #[test]
    fn training_curves_draw_loss_and_accuracy() {
        let points: Vec<(f64, f64, f64)> = (0..50)
            .map(|i| (i as f64, 5.0 / (1.0 + i as f64), i as f64 / 50.0))
            .collect();
        let svg = training_curves_svg(&points, "run").unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("Training loss"));
        assert!(svg.contains("Draft accuracy") && svg.contains("optimiser step"));
    }
}
