//! The plan's picture (`plan --report`): bucket mix across the epoch, the first and last steps
//! one by one, batch and sample share per bucket, and padding efficiency per bucket.

use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use super::{ChartError, FONT, bucket_color, err};
use crate::planner::{EpochPlan, PlanStats};
/// Columns of the bucket-mix chart: enough to see structure, few enough to keep the file small.
const MIX_COLUMNS: usize = 400;
/// Steps shown cell by cell at the start and at the end of the epoch.
const DETAIL_STEPS: usize = 120;

/// One SVG page describing a plan: bucket mix across the epoch, the first and last steps one by
/// one, batch and sample share per bucket, and padding efficiency per bucket.
pub fn plan_report_svg(
    plan: &EpochPlan,
    stats: &PlanStats,
    source: &str,
) -> Result<String, ChartError> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1200, 980)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let title = format!(
            "dflash-orch plan: {} / {}, epoch {}, seed {}: {} samples ({}), {} batches, padding efficiency {:.1}%",
            stats.mode,
            stats.interleave,
            stats.epoch,
            stats.seed,
            stats.samples,
            source,
            stats.batches,
            stats.padding_efficiency * 100.0
        );
        let root = root.titled(&title, (FONT, 18)).map_err(err)?;
        let (top, rest) = root.split_vertically(330);
        let (middle, bottom) = rest.split_vertically(280);
        let seq: Vec<usize> = plan.batches.iter().map(|b| usize::from(b.bucket)).collect();
        let labels: Vec<String> = stats
            .buckets
            .iter()
            .enumerate()
            .map(|(i, b)| format!("{i}: ({}, {}]", b.lo, b.hi))
            .collect();

        let (mix_area, legend_area) = top.split_horizontally(1020);
        draw_mix(&mix_area, &seq, labels.len())?;
        draw_legend(&legend_area, &labels)?;

        let (first, last) = middle.split_horizontally(600);
        let shown = DETAIL_STEPS.min(seq.len());
        draw_steps(&first, &seq, 0, shown, labels.len(), "first")?;
        draw_steps(
            &last,
            &seq,
            seq.len() - shown,
            seq.len(),
            labels.len(),
            "last",
        )?;

        let (shares, efficiency) = bottom.split_horizontally(600);
        draw_shares(&shares, stats)?;
        draw_efficiency(&efficiency, stats)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

fn draw_mix(area: &Area<'_>, seq: &[usize], buckets: usize) -> Result<(), ChartError> {
    let n = seq.len().max(1);
    let mut chart = ChartBuilder::on(area)
        .caption(
            "Bucket mix across the epoch (share of batches, by position)",
            (FONT, 15),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(45)
        .build_cartesian_2d(0f64..n as f64, 0f64..1f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_mesh()
        .x_label_formatter(&|x| format!("{x:.0}"))
        .x_desc("step")
        .y_desc("share")
        .draw()
        .map_err(err)?;
    let columns = MIX_COLUMNS.min(n);
    let mut rects = Vec::new();
    let mut counts = vec![0usize; buckets];
    for c in 0..columns {
        let (s0, s1) = (c * n / columns, (c + 1) * n / columns);
        counts.fill(0);
        for &b in &seq[s0..s1.min(seq.len())] {
            counts[b] += 1;
        }
        let width = (s1 - s0).max(1) as f64;
        let mut y = 0.0;
        for (b, &k) in counts.iter().enumerate() {
            if k == 0 {
                continue;
            }
            let h = k as f64 / width;
            rects.push(Rectangle::new(
                [(s0 as f64, y), (s1 as f64, y + h)],
                bucket_color(b).filled(),
            ));
            y += h;
        }
    }
    chart.draw_series(rects).map_err(err)?;
    Ok(())
}

fn draw_legend(area: &Area<'_>, labels: &[String]) -> Result<(), ChartError> {
    area.draw(&Text::new("bucket (lo, hi]", (8, 40), (FONT, 14)))
        .map_err(err)?;
    for (i, label) in labels.iter().enumerate() {
        let y = 62 + 20 * i as i32;
        area.draw(&Rectangle::new(
            [(8, y), (22, y + 12)],
            bucket_color(i).filled(),
        ))
        .map_err(err)?;
        area.draw(&Text::new(label.as_str(), (28, y), (FONT, 13)))
            .map_err(err)?;
    }
    Ok(())
}

fn draw_steps(
    area: &Area<'_>,
    seq: &[usize],
    from: usize,
    to: usize,
    buckets: usize,
    which: &str,
) -> Result<(), ChartError> {
    let caption = format!("The {which} {} steps, one cell per batch", to - from);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 15))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(45)
        .build_cartesian_2d(
            from as f64..to.max(from + 1) as f64,
            -0.5f64..buckets as f64 - 0.5,
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .y_labels(buckets.min(16))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .x_desc("step")
        .y_desc("bucket")
        .draw()
        .map_err(err)?;
    chart
        .draw_series((from..to).map(|s| {
            let b = seq[s];
            Rectangle::new(
                [(s as f64, b as f64 - 0.4), (s as f64 + 0.9, b as f64 + 0.4)],
                bucket_color(b).filled(),
            )
        }))
        .map_err(err)?;
    Ok(())
}

/// Axes over the `k` buckets (one column each) from 0 to `top`, captioned.
fn bucket_chart<'a, 'b>(
    area: &'a Area<'b>,
    caption: String,
    k: usize,
    top: f64,
    y_desc: &str,
) -> Result<ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>, ChartError>
{
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 15))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(45)
        .build_cartesian_2d(-0.5f64..k as f64 - 0.5, 0f64..top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(k.min(16))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .x_desc("bucket")
        .y_desc(y_desc)
        .draw()
        .map_err(err)?;
    Ok(chart)
}

fn draw_shares(area: &Area<'_>, stats: &PlanStats) -> Result<(), ChartError> {
    let k = stats.buckets.len();
    let top = stats
        .buckets
        .iter()
        .map(|b| b.batch_share.max(b.sample_share))
        .fold(0.0, f64::max)
        .max(0.05)
        * 1.1;
    let mut chart = bucket_chart(
        area,
        "Share per bucket: batches (solid) vs samples (light)".into(),
        k,
        top,
        "share",
    )?;
    chart
        .draw_series(stats.buckets.iter().enumerate().flat_map(|(i, b)| {
            let x = i as f64;
            [
                Rectangle::new(
                    [(x - 0.4, 0.0), (x, b.batch_share)],
                    bucket_color(i).filled(),
                ),
                Rectangle::new(
                    [(x, 0.0), (x + 0.4, b.sample_share)],
                    bucket_color(i).mix(0.35).filled(),
                ),
            ]
        }))
        .map_err(err)?;
    Ok(())
}

fn draw_efficiency(area: &Area<'_>, stats: &PlanStats) -> Result<(), ChartError> {
    let k = stats.buckets.len();
    let mut chart = bucket_chart(
        area,
        format!(
            "Padding efficiency per bucket (all: {:.1}%)",
            stats.padding_efficiency * 100.0
        ),
        k,
        1.0,
        "real / padded tokens",
    )?;
    chart
        .draw_series(stats.buckets.iter().enumerate().map(|(i, b)| {
            let x = i as f64;
            Rectangle::new(
                [(x - 0.35, 0.0), (x + 0.35, b.padding_efficiency)],
                bucket_color(i).filled(),
            )
        }))
        .map_err(err)?;
    Ok(())
}
