//! Drawing a [`View`]: the header, the worker table, the charts, the per-worker sparklines and
//! the footer, all a pure function of the view.

use std::collections::{BTreeSet, VecDeque};

use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Cell, Paragraph, Row, Sparkline, SparklineBar, Table, TableState};
use serde_json::Value;

use super::view::View;
use crate::format;

impl View {
    /// Draws the whole screen.
    pub fn draw(&self, frame: &mut Frame) {
        let area = frame.area();
        let count = workers(self.status()).len();
        let rows = u16::try_from(count).unwrap_or(u16::MAX).saturating_add(3);
        let [header, table, charts, per_worker, footer] = Layout::vertical([
            Constraint::Length(4),
            Constraint::Length(rows.max(4)),
            Constraint::Length(8),
            Constraint::Fill(1),
            Constraint::Length(3),
        ])
        .areas(area);
        self.draw_header(frame, header);
        self.draw_table(frame, table);
        self.draw_charts(frame, charts);
        self.draw_per_worker(frame, per_worker);
        self.draw_footer(frame, footer);
    }

    fn status(&self) -> &Value {
        self.last.as_ref().unwrap_or(&Value::Null)
    }

    fn draw_header(&self, frame: &mut Frame, area: Rect) {
        let r = &self.status()["run"];
        let (state, state_style) = match (&self.lost, r["state"].as_str()) {
            (Some(_), _) => (
                "run not running".to_owned(),
                Style::new().fg(Color::Red).add_modifier(Modifier::BOLD),
            ),
            (None, Some(s)) => (s.to_owned(), Style::new().fg(Color::Green)),
            (None, None) => ("?".to_owned(), Style::new()),
        };
        let title = Line::from(vec![
            Span::raw(" dflash-orch top · "),
            Span::raw(self.run_dir.clone()),
            Span::raw(" · "),
            Span::styled(state, state_style),
            Span::raw(" "),
        ]);
        let epochs = r["epochs"].as_u64();
        let epoch = match (r["epoch"].as_u64(), epochs) {
            (Some(e), Some(n)) => format!("{}/{n}", (e + 1).min(n)),
            (Some(e), None) => format!("{}/-", e + 1),
            _ => "-".into(),
        };
        let mut facts = vec![
            format!("epoch {epoch}"),
            format!("committed steps {}", num(&r["committed_steps"])),
            format!("stage {}", r["stage"].as_str().unwrap_or("-")),
            format!(
                "up {}",
                r["uptime_s"].as_f64().map_or("-".into(), format::clock)
            ),
            format!(
                "average {}",
                r["tokens_per_s"]
                    .as_f64()
                    .map_or("-".into(), |t| format::rate(t, "tok/s"))
            ),
        ];
        if let Some(seen) = self.last_seen {
            facts.push(format!(
                "updated {:.0} s ago (every {} s)",
                seen.elapsed().as_secs_f64(),
                self.interval
            ));
        }
        let lines = vec![
            Line::from(r["progress"].as_str().unwrap_or("-").to_owned()),
            Line::from(facts.join(" · ")),
        ];
        frame.render_widget(
            Paragraph::new(lines).block(Block::bordered().title(title)),
            area,
        );
    }

    fn draw_table(&self, frame: &mut Frame, area: Rect) {
        let list = workers(self.status());
        let has = |key: &str| list.iter().any(|w| !w[key].is_null());
        // What fits: the columns by priority, shown in this order.
        let inner = usize::from(area.width.saturating_sub(2 + 2));
        let mut candidates: Vec<&Column> = COLUMNS
            .iter()
            .filter(|c| match c.name {
                "CPU%" => has("cpu_pct"),
                "RSS" => has("rss_bytes"),
                _ => true,
            })
            .collect();
        let wanted = candidates.len();
        let mut by_priority = candidates.clone();
        by_priority.sort_by_key(|c| c.priority);
        let mut used = 0;
        let mut shown = Vec::new();
        for c in by_priority {
            let need = usize::from(c.width) + usize::from(used > 0);
            if c.priority == 0 || used + need <= inner {
                used += need;
                shown.push(c.name);
            }
        }
        candidates.retain(|c| shown.contains(&c.name));
        let header = Row::new(candidates.iter().map(|c| Cell::from(c.name)))
            .style(Style::new().add_modifier(Modifier::BOLD));
        let rows = list.iter().map(|w| {
            let style = match w["state"].as_str() {
                Some("failed") => Style::new().fg(Color::Red),
                Some("restarting" | "starting") => Style::new().fg(Color::Yellow),
                Some("stopped") => Style::new().fg(Color::DarkGray),
                _ => Style::new(),
            };
            Row::new(candidates.iter().map(|c| Cell::from((c.cell)(w)))).style(style)
        });
        let hidden = wanted - candidates.len();
        let title = if hidden > 0 {
            format!(
                " workers ({}) · {hidden} columns hidden: widen the terminal ",
                list.len()
            )
        } else {
            format!(" workers ({}) ", list.len())
        };
        let widths = candidates.iter().map(|c| {
            if c.name == "LAST EXIT" {
                Constraint::Fill(1)
            } else {
                Constraint::Length(c.width)
            }
        });
        let table = Table::new(rows, widths)
            .header(header)
            .block(Block::bordered().title(title))
            .row_highlight_style(Style::new().add_modifier(Modifier::REVERSED))
            .highlight_symbol("> ");
        let mut state = TableState::default();
        if !list.is_empty() {
            state.select(Some(self.selected.min(list.len() - 1)));
        }
        frame.render_stateful_widget(table, area, &mut state);
    }

    fn draw_charts(&self, frame: &mut Frame, area: Rect) {
        let [left, middle, right] = Layout::horizontal([Constraint::Ratio(1, 3); 3]).areas(area);
        let list = workers(self.status());
        let selected = list.get(self.selected);
        let series = selected
            .and_then(|w| w["id"].as_u64())
            .and_then(|id| self.history.get(&id));
        let who = selected.map_or("no worker".into(), |w| {
            format!(
                "worker {} ({})",
                num(&w["id"]),
                w["role"].as_str().unwrap_or("?")
            )
        });
        let gpu = series.is_some_and(|s| s.power.iter().chain(&s.util).any(Option::is_some));
        let empty = VecDeque::new();
        if gpu {
            let s = series.expect("checked above");
            spark(
                frame,
                left,
                format!(" {who} · GPU power{} ", now(&s.power, " W")),
                &s.power,
                None,
                Color::Yellow,
            );
            spark(
                frame,
                middle,
                format!(" GPU utilization{} ", now(&s.util, "%")),
                &s.util,
                Some(100),
                Color::Green,
            );
        } else {
            let cpu = series.map_or(&empty, |s| &s.cpu);
            let title = if cpu.iter().any(Option::is_some) {
                format!(" {who} · CPU{} ", now(cpu, "%"))
            } else {
                format!(" {who} · no GPU or CPU samples ")
            };
            let both = Rect {
                width: left.width + middle.width,
                ..left
            };
            let peak = cpu.iter().flatten().copied().max().unwrap_or(0).max(100);
            spark(frame, both, title, cpu, Some(peak), Color::Green);
        }
        let tps = self.throughput.back().copied().flatten();
        spark(
            frame,
            right,
            format!(
                " run throughput{} ",
                tps.map_or(String::new(), |t| format!(
                    ": {}",
                    format::rate(t as f64, "tok/s")
                ))
            ),
            &self.throughput,
            None,
            Color::Cyan,
        );
    }

    /// One line per worker: its GPU utilization, else its CPU, else the batches it finished per
    /// refresh.
    fn draw_per_worker(&self, frame: &mut Frame, area: Rect) {
        let block = Block::bordered().title(
            " per worker: GPU utilization % (gpu), CPU % (cpu) or batches per refresh (batches) ",
        );
        let inner = block.inner(area);
        frame.render_widget(block, area);
        let list = workers(self.status());
        let label_width = 24.min(inner.width);
        for (i, w) in list.iter().enumerate() {
            let Ok(y) = u16::try_from(i) else { break };
            if y >= inner.height {
                break;
            }
            let series = w["id"].as_u64().and_then(|id| self.history.get(&id));
            let some = |d: &VecDeque<Option<u64>>| d.iter().any(Option::is_some);
            let (what, data, max) = match series {
                Some(s) if some(&s.util) => ("gpu", &s.util, Some(100)),
                Some(s) if some(&s.cpu) => (
                    "cpu",
                    &s.cpu,
                    Some(s.cpu.iter().flatten().copied().max().unwrap_or(0).max(100)),
                ),
                Some(s) => ("batches", &s.batches, None),
                None => continue,
            };
            let line = Rect {
                y: inner.y + y,
                height: 1,
                ..inner
            };
            let label = format!(
                "{:>3} {:<8} {:<8}",
                num(&w["id"]),
                w["role"].as_str().unwrap_or("?"),
                what
            );
            let selected = i == self.selected;
            let style = if selected {
                Style::new().add_modifier(Modifier::REVERSED)
            } else {
                Style::new()
            };
            frame.render_widget(
                Paragraph::new(label).style(style),
                Rect {
                    width: label_width,
                    ..line
                },
            );
            let bars = Rect {
                x: line.x + label_width,
                width: line.width - label_width,
                ..line
            };
            let skip = data.len().saturating_sub(usize::from(bars.width));
            let mut widget = Sparkline::default()
                .data(data.iter().skip(skip).map(SparklineBar::from))
                .style(Style::new().fg(Color::Green));
            if let Some(max) = max {
                widget = widget.max(max.max(1));
            }
            frame.render_widget(widget, bars);
        }
    }

    fn draw_footer(&self, frame: &mut Frame, area: Rect) {
        let mut lines = Vec::new();
        let mut status = Vec::new();
        if let Some(why) = &self.lost {
            status.push(Span::styled(
                format!("run not running ({why}); showing the last screen"),
                Style::new().fg(Color::Red).add_modifier(Modifier::BOLD),
            ));
        }
        if let Some(m) = &self.message {
            if !status.is_empty() {
                status.push(Span::raw(" · "));
            }
            status.push(Span::styled(
                m.clone(),
                Style::new().add_modifier(Modifier::BOLD),
            ));
        }
        lines.push(Line::from(status));
        let reasons: BTreeSet<&str> = workers(self.status())
            .iter()
            .filter(|w| w["gpu_power_w"].is_null())
            .filter_map(|w| w["gpu_unavailable"].as_str())
            .collect();
        if !reasons.is_empty() {
            lines.push(Line::from(format!(
                "GPU telemetry unavailable: {}",
                reasons.into_iter().collect::<Vec<_>>().join("; ")
            )));
        }
        lines.push(Line::styled(
            "↑/↓ k/j select · r restart after its current job · R restart at once · q quit",
            Style::new().fg(Color::DarkGray),
        ));
        // The key help stays on the last line however many lines come before it.
        let skip = lines.len().saturating_sub(usize::from(area.height));
        frame.render_widget(Paragraph::new(lines.split_off(skip)), area);
    }
}

/// A column of the worker table: the narrower the terminal, the fewer columns, highest
/// `priority` (least needed) first out.
struct Column {
    name: &'static str,
    width: u16,
    priority: u8,
    cell: fn(&Value) -> String,
}

const COLUMNS: [Column; 15] = [
    Column {
        name: "ID",
        width: 3,
        priority: 0,
        cell: |w| num(&w["id"]),
    },
    Column {
        name: "ROLE",
        width: 7,
        priority: 0,
        cell: |w| text(&w["role"]),
    },
    Column {
        name: "DEVICE",
        width: 6,
        priority: 0,
        cell: |w| text(&w["device"]),
    },
    Column {
        name: "PID",
        width: 7,
        priority: 5,
        cell: |w| num(&w["pid"]),
    },
    Column {
        name: "STATE",
        width: 10,
        priority: 0,
        cell: |w| text(&w["state"]),
    },
    Column {
        name: "BATCHES",
        width: 7,
        priority: 1,
        cell: |w| num(&w["batches_done"]),
    },
    Column {
        name: "RESTARTS",
        width: 8,
        priority: 1,
        cell: |w| num(&w["restarts"]),
    },
    Column {
        name: "HEARTBEAT",
        width: 9,
        priority: 3,
        cell: |w| {
            w["heartbeat_age_s"]
                .as_f64()
                .map_or("-".into(), |a| format!("{a:.1} s"))
        },
    },
    Column {
        name: "CPU%",
        width: 5,
        priority: 2,
        cell: |w| {
            w["cpu_pct"]
                .as_f64()
                .map_or("-".into(), |c| format!("{c:.0}"))
        },
    },
    Column {
        name: "RSS",
        width: 9,
        priority: 6,
        cell: |w| {
            w["rss_bytes"]
                .as_f64()
                .map_or("-".into(), |b| format::bytes(b.max(0.0) as u64))
        },
    },
    Column {
        name: "POWER",
        width: 6,
        priority: 2,
        cell: |w| {
            w["gpu_power_w"]
                .as_f64()
                .map_or("-".into(), |p| format!("{p:.0} W"))
        },
    },
    Column {
        name: "UTIL",
        width: 4,
        priority: 2,
        cell: |w| {
            w["gpu_utilization_pct"]
                .as_f64()
                .map_or("-".into(), |u| format!("{u:.0}%"))
        },
    },
    Column {
        name: "GPU MEM",
        width: 13,
        priority: 6,
        cell: gpu_memory,
    },
    Column {
        name: "TEMP",
        width: 5,
        priority: 7,
        cell: |w| {
            w["gpu_temperature_c"]
                .as_f64()
                .map_or("-".into(), |t| format!("{t:.0} C"))
        },
    },
    Column {
        name: "LAST EXIT",
        width: 12,
        priority: 4,
        cell: |w| w["last_exit"].as_str().unwrap_or("-").to_owned(),
    },
];

pub(super) fn workers(status: &Value) -> &[Value] {
    status["workers"].as_array().map_or(&[], Vec::as_slice)
}

fn spark(
    frame: &mut Frame,
    area: Rect,
    title: String,
    data: &VecDeque<Option<u64>>,
    max: Option<u64>,
    color: Color,
) {
    // Newest samples on the right; as many as fit.
    let width = usize::from(area.width.saturating_sub(2));
    let skip = data.len().saturating_sub(width);
    let bars: Vec<SparklineBar> = data.iter().skip(skip).map(SparklineBar::from).collect();
    let mut widget = Sparkline::default()
        .block(Block::bordered().title(title))
        .data(bars)
        .style(Style::new().fg(color));
    if let Some(max) = max {
        widget = widget.max(max.max(1));
    }
    frame.render_widget(widget, area);
}

fn now(series: &VecDeque<Option<u64>>, unit: &str) -> String {
    series
        .back()
        .copied()
        .flatten()
        .map_or(String::new(), |v| format!(": {v}{unit}"))
}

fn num(v: &Value) -> String {
    match v {
        Value::Number(n) => n.to_string(),
        Value::String(s) => s.clone(),
        _ => "-".into(),
    }
}

fn text(v: &Value) -> String {
    v.as_str().unwrap_or("-").to_owned()
}

fn gpu_memory(w: &Value) -> String {
    let gb = |mb: f64| mb / 1000.0;
    match (
        w["gpu_memory_used_mb"].as_f64(),
        w["gpu_memory_total_mb"].as_f64(),
    ) {
        (Some(u), Some(t)) => format!("{:.1}/{:.1} GB", gb(u), gb(t)),
        (Some(u), None) => format!("{:.1} GB", gb(u)),
        _ => "-".into(),
    }
}
