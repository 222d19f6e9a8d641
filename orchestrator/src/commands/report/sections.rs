//! The page's sections below the header: loss and accuracy, throughput, batches per bucket,
//! telemetry, restarts and warnings.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use plotters::prelude::*;

use super::{FULL, HALF, TrainField, esc, legend};
use crate::charts::{
    LineChart, Markers, Series, TimeAxis, bucket_color, draw_bars, draw_lines, moving_average,
    series_color, thin,
};
use crate::error::CliError;
use crate::format;
use crate::observe::history::{Incident, Key, Reading, Run, Telemetry};

pub(super) fn train_section(h: &mut String, run: &Run) -> Result<(), CliError> {
    if run.train.is_empty() {
        h.push_str(
            "<p class=\"note\">No train lines in metrics.jsonl (a synthetic-stage run trains \
             nothing): no loss or accuracy to show.</p>\n",
        );
        return Ok(());
    }
    let pick = |f: TrainField| -> Vec<(f64, f64)> {
        run.train
            .iter()
            .filter_map(|(&s, p)| f(p).map(|v| (s as f64, v)))
            .collect()
    };
    let loss = pick(|p| p.loss);
    let accuracy = pick(|p| p.accuracy);
    let first = *run.train.keys().next().unwrap_or(&0) as f64;
    let last = *run.train.keys().next_back().unwrap_or(&1) as f64;
    let x_range = Some((first.min(last - 1.0).max(0.0), last));
    let raw_and_mean = |points: &[(f64, f64)]| {
        vec![
            Series {
                name: "per step".into(),
                color: series_color(0),
                points: thin(points),
                faint: true,
            },
            Series {
                name: "moving average".into(),
                color: series_color(1),
                points: thin(&moving_average(points)),
                faint: false,
            },
        ]
    };
    let loss_chart = LineChart {
        title: "Training loss",
        x_desc: "optimiser step".into(),
        y_desc: "cross-entropy",
        size: HALF,
        x_range,
        y_from_zero: false,
        y_at_least: None,
        y_fmt: format::compact,
        series: raw_and_mean(&loss),
        markers: None,
    };
    let accuracy_chart = LineChart {
        title: "Draft accuracy",
        x_desc: "optimiser step".into(),
        y_desc: "fraction of draft tokens correct",
        size: HALF,
        x_range,
        y_from_zero: true,
        y_at_least: None,
        y_fmt: format::compact,
        series: raw_and_mean(&accuracy),
        markers: None,
    };
    h.push_str("<div class=\"row\">\n");
    h.push_str(&draw_lines(&loss_chart)?);
    h.push_str(&draw_lines(&accuracy_chart)?);
    h.push_str("</div>\n");
    legend(h, &loss_chart.series);
    if !run.served.is_empty() {
        // Served τ beside the training proxy on the same scale: tokens per verify step are the
        // accepted draft tokens plus the target's own, so the proxy plus one.
        let served: Vec<(f64, f64)> = run.served.iter().map(|(&s, &t)| (s as f64, t)).collect();
        let proxy: Vec<(f64, f64)> = pick(|p| p.acceptance)
            .into_iter()
            .map(|(s, a)| (s, a + 1.0))
            .collect();
        let chart = LineChart {
            title: "Served acceptance and the training proxy",
            x_desc: "optimiser step".into(),
            y_desc: "tokens per verify step",
            size: HALF,
            x_range,
            y_from_zero: true,
            y_at_least: Some(1.0),
            y_fmt: format::compact,
            series: vec![
                Series {
                    name: "training proxy + 1 (moving average)".into(),
                    color: series_color(1),
                    points: thin(&moving_average(&proxy)),
                    faint: true,
                },
                Series {
                    name: "served τ (speculative decoding, held-out prompts)".into(),
                    color: series_color(2),
                    points: served,
                    faint: false,
                },
            ],
            markers: None,
        };
        h.push_str("<div class=\"row\">\n");
        h.push_str(&draw_lines(&chart)?);
        h.push_str("</div>\n");
        legend(h, &chart.series);
    }
    Ok(())
}

pub(super) fn throughput_section(
    h: &mut String,
    run: &Run,
    axis: &TimeAxis,
    markers: &Markers,
) -> Result<(), CliError> {
    if run.throughput.is_empty() {
        h.push_str(
            "<p class=\"note\">No batch lines in metrics.jsonl: no throughput to show.</p>\n",
        );
        return Ok(());
    }
    let mut lines = run.throughput.clone();
    lines.sort_by(|a, b| a.0.total_cmp(&b.0));
    let series = |i: usize, name: &str, f: fn(&Reading) -> Option<f64>| Series {
        name: name.into(),
        color: series_color(i),
        points: thin(
            &lines
                .iter()
                .filter_map(|l| f(l).map(|v| (axis.x(l.0 - run.first), v)))
                .collect::<Vec<_>>(),
        ),
        faint: false,
    };
    let chart = LineChart {
        title: "Throughput (tokens/s over the last 10 s)",
        x_desc: axis.desc(),
        y_desc: "tokens / s",
        size: FULL,
        x_range: Some((0.0, axis.x(run.duration()))),
        y_from_zero: true,
        y_at_least: None,
        y_fmt: format::compact,
        series: vec![
            series(0, "real tokens/s", |l| l.1),
            series(1, "padded tokens/s", |l| l.2),
        ],
        markers: Some(markers),
    };
    h.push_str(&draw_lines(&chart)?);
    legend(h, &chart.series);
    Ok(())
}

pub(super) fn bucket_section(h: &mut String, run: &Run) -> Result<(), CliError> {
    let mut counts: BTreeMap<&Key, usize> = BTreeMap::new();
    for b in run.batches.values().chain(&run.unstepped) {
        *counts.entry(&b.bucket).or_default() += 1;
    }
    if counts.is_empty() {
        h.push_str("<p class=\"note\">No batch lines in metrics.jsonl: no buckets to show.</p>\n");
        return Ok(());
    }
    let bars: Vec<(String, f64, RGBColor)> = counts
        .iter()
        .enumerate()
        .map(|(i, (k, &n))| {
            let color = bucket_color(usize::try_from(k.num).unwrap_or(i));
            (k.text.clone(), n as f64, color)
        })
        .collect();
    h.push_str(&draw_bars(
        "Batches per bucket",
        "bucket",
        "batches",
        &bars,
        (1200, 320),
    )?);
    let committed = run.batches.len() + run.unstepped.len();
    let replayed = run.batch_lines - committed;
    let mut note = format!("{committed} batches");
    if replayed > 0 {
        let _ = write!(
            note,
            "; {replayed} batch lines written again by replays after a restart are counted once"
        );
    }
    let _ = writeln!(h, "<p class=\"note\">{}.</p>", esc(&note));
    Ok(())
}

pub(super) fn telemetry_section(
    h: &mut String,
    run: &Run,
    axis: &TimeAxis,
    markers: &Markers,
) -> Result<(), CliError> {
    let x_range = Some((0.0, axis.x(run.duration())));
    let series = |map: &BTreeMap<Key, Telemetry>,
                  name: &dyn Fn(&Key, &Telemetry) -> String,
                  value: fn(&Reading) -> Option<f64>,
                  scale: f64| {
        map.iter()
            .enumerate()
            .map(|(i, (key, t))| {
                let mut points: Vec<(f64, f64)> = t
                    .points
                    .iter()
                    .filter_map(|p| {
                        value(p)
                            .filter(|v| v.is_finite())
                            .map(|v| (axis.x(p.0 - run.first), v / scale))
                    })
                    .collect();
                points.sort_by(|a, b| a.0.total_cmp(&b.0));
                Series {
                    name: name(key, t),
                    color: series_color(i),
                    points: thin(&points),
                    faint: false,
                }
            })
            .collect::<Vec<_>>()
    };
    let with_role = |prefix: &str, key: &Key, t: &Telemetry| match &t.role {
        Some(role) => format!("{prefix} {} ({role})", key.text),
        None => format!("{prefix} {}", key.text),
    };
    if !run.gpu.is_empty() {
        let name = |k: &Key, t: &Telemetry| with_role("GPU", k, t);
        let power = LineChart {
            title: "GPU power",
            x_desc: axis.desc(),
            y_desc: "W",
            size: HALF,
            x_range,
            y_from_zero: true,
            y_at_least: None,
            y_fmt: format::compact,
            series: series(&run.gpu, &name, |p| p.1, 1.0),
            markers: Some(markers),
        };
        let utilization = LineChart {
            title: "GPU utilization",
            x_desc: axis.desc(),
            y_desc: "%",
            size: HALF,
            x_range,
            y_from_zero: true,
            y_at_least: Some(100.0),
            y_fmt: format::compact,
            series: series(&run.gpu, &name, |p| p.2, 1.0),
            markers: Some(markers),
        };
        h.push_str("<div class=\"row\">\n");
        h.push_str(&draw_lines(&power)?);
        h.push_str(&draw_lines(&utilization)?);
        h.push_str("</div>\n");
        legend(h, &power.series);
        return Ok(());
    }
    if run.process.is_empty() {
        h.push_str(
            "<p class=\"note\">No GPU telemetry was available and no worker process readings \
             either (no gpu or process lines in metrics.jsonl).</p>\n",
        );
        return Ok(());
    }
    h.push_str(
        "<p class=\"note\">No GPU telemetry was available (no gpu lines: NVML or a GPU was \
         missing): the workers' CPU and memory instead.</p>\n",
    );
    let max_rss = run
        .process
        .values()
        .flat_map(|t| t.points.iter().filter_map(|p| p.2))
        .fold(0.0, f64::max);
    let (scale, unit) = if max_rss >= 2.0 * GIB {
        (GIB, "GiB")
    } else {
        (MIB, "MiB")
    };
    let name = |k: &Key, t: &Telemetry| with_role("worker", k, t);
    let cpu = LineChart {
        title: "Worker CPU",
        x_desc: axis.desc(),
        y_desc: "% of one core",
        size: HALF,
        x_range,
        y_from_zero: true,
        y_at_least: None,
        y_fmt: format::compact,
        series: series(&run.process, &name, |p| p.1, 1.0),
        markers: Some(markers),
    };
    let rss = LineChart {
        title: "Worker memory (RSS)",
        x_desc: axis.desc(),
        y_desc: unit,
        size: HALF,
        x_range,
        y_from_zero: true,
        y_at_least: None,
        y_fmt: format::compact,
        series: series(&run.process, &name, |p| p.2, scale),
        markers: Some(markers),
    };
    h.push_str("<div class=\"row\">\n");
    h.push_str(&draw_lines(&cpu)?);
    h.push_str(&draw_lines(&rss)?);
    h.push_str("</div>\n");
    legend(h, &cpu.series);
    Ok(())
}

const MIB: f64 = 1024.0 * 1024.0;
const GIB: f64 = 1024.0 * MIB;

pub(super) fn exits_section(
    h: &mut String,
    run: &Run,
    exits: &[Incident],
    normal: usize,
    markers: &Markers,
) {
    let stopped = if normal > 0 {
        format!(" {normal} workers exited normally when the run stopped (not listed).")
    } else {
        String::new()
    };
    if exits.is_empty() {
        let _ = writeln!(
            h,
            "<p class=\"note\">No worker exited during the run.{stopped}</p>"
        );
        return;
    }
    let timed = exits.iter().any(|e| e.time.is_some());
    if timed {
        let labels = if markers.labelled {
            " labelled #N wW (exit N, worker W)"
        } else {
            ""
        };
        let _ = writeln!(
            h,
            "<p class=\"note\">Dashed red lines on the time axes mark worker exits{labels}.\
             {stopped}</p>"
        );
    } else {
        h.push_str(
            "<p class=\"note\">The exits below come from journal.jsonl, which has no times: they \
             are not marked on the time axes.</p>\n",
        );
        if normal > 0 {
            let _ = writeln!(h, "<p class=\"note\">{}</p>", stopped.trim());
        }
    }
    h.push_str(
        "<table class=\"exits\">\n<tr><th>#</th><th>time</th><th>since start</th><th>worker</th><th>role</th><th>restarted</th><th>message</th></tr>\n",
    );
    for (i, e) in exits.iter().enumerate() {
        let (clock, since) = match e.time {
            Some(t) => (format::utc(t), format::duration(t - run.first)),
            None => ("-".into(), "-".into()),
        };
        let _ = writeln!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"msg\">{}</td></tr>",
            i + 1,
            esc(&clock),
            esc(&since),
            esc(&e.worker.text),
            esc(e.role.as_deref().unwrap_or("-")),
            if e.restarted { "yes" } else { "no" },
            esc(&e.message)
        );
    }
    h.push_str("</table>\n");
    let others: Vec<String> = run
        .events
        .iter()
        .filter(|(name, _)| name.as_str() != "worker_exit")
        .map(|(name, n)| format!("{n} {name}"))
        .collect();
    if !others.is_empty() {
        let _ = writeln!(
            h,
            "<p class=\"note\">Other events in metrics.jsonl: {}.</p>",
            esc(&others.join(", "))
        );
    }
}

pub(super) fn warnings_section(h: &mut String, run: &Run) {
    if run.warnings.is_empty() {
        return;
    }
    h.push_str("<h2>Warnings</h2>\n");
    let total = run.events.get("warning").copied().unwrap_or(0);
    if total > run.warnings.len() {
        let _ = writeln!(
            h,
            "<p class=\"note\">The first {} of {total} warnings.</p>",
            run.warnings.len()
        );
    }
    h.push_str(
        "<table class=\"exits\">\n<tr><th>time</th><th>since start</th><th>worker</th><th>message</th></tr>\n",
    );
    for w in &run.warnings {
        let t = w.time.unwrap_or(run.first);
        let worker = if w.worker.text == "?" {
            "-"
        } else {
            &w.worker.text
        };
        let _ = writeln!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td class=\"msg\">{}</td></tr>",
            esc(&format::utc(t)),
            esc(&format::duration(t - run.first)),
            esc(worker),
            esc(&w.message)
        );
    }
    h.push_str("</table>\n");
}
