//! Charts drawn by the server as inline SVG: a queue's last hour (throughput, failures, depth,
//! lateness, handler time), sparklines, and bars. No scripts: each chart carries its numbers
//! as a table (for screen readers, and for anyone who wants the figures), each bar and point a
//! tooltip, and the page that shows them refreshes itself.

use std::fmt::Write;

use tito::inspect::HourMinute;

use crate::html::esc;

/// The drawing's size in SVG units (it scales to the page's width).
const WIDTH: f64 = 640.0;
const HEIGHT: f64 = 170.0;
const LEFT: f64 = 56.0;
const RIGHT: f64 = 10.0;
const TOP: f64 = 10.0;
const BOTTOM: f64 = 22.0;

/// How a chart draws its series.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// One bar per minute (the first series).
    Bars,
    /// One line per series, broken where a minute has no value.
    Lines,
}

/// How a chart's values read.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unit {
    /// A count ("12", "1,200").
    Count,
    /// Milliseconds, shown as ms, s, min or h.
    Millis,
}

impl Unit {
    pub(crate) fn format(self, value: f64) -> String {
        match self {
            // A half-way grid line of a small axis (2.5) keeps its fraction.
            Unit::Count if value.fract() != 0.0 && value < 100.0 => format!("{value:.1}"),
            Unit::Count => thousands(value.round() as u64),
            Unit::Millis if value < 1000.0 => format!("{} ms", value.round() as u64),
            Unit::Millis => seconds(value / 1000.0),
        }
    }
}

fn seconds(s: f64) -> String {
    if s < 60.0 {
        if s < 10.0 && s.fract() != 0.0 {
            format!("{s:.1} s")
        } else {
            format!("{} s", s.round() as u64)
        }
    } else if s < 3600.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{:.1} h", s / 3600.0)
    }
}

pub(crate) fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// One series of a chart: a value per minute (`None`: nothing that minute).
pub(crate) struct Series {
    pub name: &'static str,
    /// The CSS class that colours it.
    pub class: &'static str,
    pub values: Vec<Option<f64>>,
    /// Shown in the numbers table only, not drawn nor summed up in words.
    pub table_only: bool,
}

/// `HH:MM` (UTC) of a minute (Unix s / 60).
fn clock(minute: u64) -> String {
    let of_day = minute % (24 * 60);
    format!("{:02}:{:02}", of_day / 60, of_day % 60)
}

/// The least of 1, 2, 5 × 10^k at or above `value` (1 for nothing).
fn nice_ceiling(value: f64) -> f64 {
    if value.is_nan() || value <= 0.0 || !value.is_finite() {
        return 1.0;
    }
    let magnitude = 10f64.powf(value.log10().floor());
    for step in [1.0, 2.0, 5.0, 10.0] {
        if step * magnitude >= value {
            return step * magnitude;
        }
    }
    10.0 * magnitude
}

/// A chart of one value per minute over `minutes`: the drawing, a caption that says what it
/// shows in words (total, peak and latest of each series), and the numbers as a table.
pub(crate) fn chart(
    id: &str,
    title: &str,
    unit: Unit,
    kind: Kind,
    minutes: &[u64],
    series: &[Series],
    note: &str,
) -> String {
    let n = minutes.len().max(1);
    let (drawn, table): (Vec<&Series>, Vec<&Series>) = series.iter().partition(|s| !s.table_only);
    let peak = drawn
        .iter()
        .flat_map(|s| s.values.iter().flatten())
        .fold(0f64, |a, &b| a.max(b));
    let top = nice_ceiling(peak);
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let step = plot_w / n as f64;
    let y = |v: f64| TOP + plot_h - (v / top) * plot_h;
    let x_mid = |i: usize| LEFT + step * (i as f64 + 0.5);

    let mut summary = Vec::new();
    for s in &drawn {
        summary.push(describe(s, unit, minutes, kind == Kind::Bars));
    }
    let summary = summary.join(" ");

    let mut b = String::new();
    let _ = write!(
        b,
        "<figure class=\"chart\" id=\"{id}\" data-chart=\"{id}\"><figcaption><h3>{}</h3><p class=\"summary\" id=\"{id}-summary\">{}</p></figcaption>",
        esc(title),
        esc(&summary)
    );
    let _ = write!(
        b,
        "<svg role=\"img\" aria-labelledby=\"{id}-title {id}-summary\" viewBox=\"0 0 {WIDTH} {HEIGHT}\" preserveAspectRatio=\"none\" xmlns=\"http://www.w3.org/2000/svg\"><title id=\"{id}-title\">{}, last {} minutes</title>",
        esc(title),
        minutes.len()
    );
    // Grid and y labels: 0, half, top.
    for fraction in [0.0, 0.5, 1.0] {
        let value = top * fraction;
        let _ = write!(
            b,
            "<line class=\"grid\" x1=\"{LEFT}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\"/><text class=\"axis\" x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            WIDTH - RIGHT,
            LEFT - 6.0,
            y(value) + 4.0,
            esc(&unit.format(value)),
            y = y(value),
        );
    }
    // x labels: the first minute, every quarter, and the last.
    if !minutes.is_empty() {
        let last = minutes.len() - 1;
        let mut marks = vec![0, last];
        for quarter in 1..4 {
            let at = last * quarter / 4;
            if !marks.contains(&at) {
                marks.push(at);
            }
        }
        marks.sort_unstable();
        for at in marks {
            let anchor = if at == 0 {
                "start"
            } else if at == last {
                "end"
            } else {
                "middle"
            };
            let label = if at == last {
                format!("{} (now)", clock(minutes[at]))
            } else {
                clock(minutes[at])
            };
            let _ = write!(
                b,
                "<text class=\"axis\" x=\"{:.1}\" y=\"{}\" text-anchor=\"{anchor}\">{label}</text>",
                if at == 0 {
                    LEFT
                } else if at == last {
                    WIDTH - RIGHT
                } else {
                    x_mid(at)
                },
                HEIGHT - 6.0,
            );
        }
    }
    match kind {
        Kind::Bars => {
            if let Some(s) = drawn.first() {
                let width = (step * 0.8).max(1.0);
                for (i, value) in s.values.iter().enumerate() {
                    let Some(value) = value else { continue };
                    let top_y = y(*value);
                    let _ = write!(
                        b,
                        "<rect class=\"{}\" data-minute=\"{}\" data-value=\"{value}\" x=\"{:.1}\" y=\"{top_y:.1}\" width=\"{width:.1}\" height=\"{:.1}\"><title>{}: {} {}</title></rect>",
                        s.class,
                        minutes.get(i).copied().unwrap_or_default(),
                        x_mid(i) - width / 2.0,
                        (TOP + plot_h - top_y).max(0.0),
                        clock(minutes.get(i).copied().unwrap_or_default()),
                        esc(&unit.format(*value)),
                        s.name,
                    );
                }
            }
        }
        Kind::Lines => {
            for s in &drawn {
                // Runs of minutes with values, each one polyline.
                let mut run: Vec<(f64, f64)> = Vec::new();
                let mut lines = Vec::new();
                for (i, value) in s.values.iter().enumerate() {
                    match value {
                        Some(v) => run.push((x_mid(i), y(*v))),
                        None if !run.is_empty() => lines.push(std::mem::take(&mut run)),
                        None => {}
                    }
                }
                if !run.is_empty() {
                    lines.push(run);
                }
                for line in lines {
                    let points: Vec<String> =
                        line.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
                    let _ = write!(
                        b,
                        "<polyline class=\"{}\" fill=\"none\" points=\"{}\"/>",
                        s.class,
                        points.join(" ")
                    );
                }
                for (i, value) in s.values.iter().enumerate() {
                    let Some(value) = value else { continue };
                    let _ = write!(
                        b,
                        "<circle class=\"{}\" data-minute=\"{}\" data-value=\"{value}\" cx=\"{:.1}\" cy=\"{:.1}\" r=\"2\"><title>{}: {} {}</title></circle>",
                        s.class,
                        minutes.get(i).copied().unwrap_or_default(),
                        x_mid(i),
                        y(*value),
                        clock(minutes.get(i).copied().unwrap_or_default()),
                        esc(&unit.format(*value)),
                        s.name,
                    );
                }
            }
        }
    }
    b.push_str("</svg>");
    if drawn.len() > 1 {
        b.push_str("<p class=\"legend\">");
        for s in &drawn {
            let _ = write!(b, "<span class=\"key {}\"></span>{} ", s.class, esc(s.name));
        }
        b.push_str("</p>");
    }
    if !note.is_empty() {
        let _ = write!(b, "<p class=\"muted\">{}</p>", esc(note));
    }
    // The numbers, minute by minute, newest first.
    let _ = write!(
        b,
        "<details><summary>numbers</summary><table class=\"numbers\" id=\"{id}-numbers\"><tr><th>minute (UTC)</th>"
    );
    let columns: Vec<&Series> = drawn.iter().chain(table.iter()).copied().collect();
    for s in &columns {
        let _ = write!(b, "<th class=\"num\">{}</th>", esc(s.name));
    }
    b.push_str("</tr>");
    for (i, minute) in minutes.iter().enumerate().rev() {
        let _ = write!(
            b,
            "<tr data-minute=\"{minute}\"><td>{}</td>",
            clock(*minute)
        );
        for s in series {
            let cell = s
                .values
                .get(i)
                .copied()
                .flatten()
                .map_or("—".to_string(), |v| unit.format(v));
            let _ = write!(b, "<td class=\"num\">{}</td>", esc(&cell));
        }
        b.push_str("</tr>");
    }
    b.push_str("</table></details></figure>");
    b
}

/// A series in words: "handled: 1,200 in all, at most 40 a minute (21:33), 12 this minute."
fn describe(s: &Series, unit: Unit, minutes: &[u64], summed: bool) -> String {
    let values: Vec<(usize, f64)> = s
        .values
        .iter()
        .enumerate()
        .filter_map(|(i, v)| v.map(|v| (i, v)))
        .collect();
    let Some(&(peak_at, peak)) = values
        .iter()
        .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)))
    else {
        return format!("{}: no figures in the hour.", s.name);
    };
    let latest = s.values.last().copied().flatten();
    let latest = latest.map_or("none this minute".to_string(), |v| {
        format!("{} this minute", unit.format(v))
    });
    let at = minutes.get(peak_at).map_or(String::new(), |m| clock(*m));
    if summed {
        let total: f64 = values.iter().map(|(_, v)| v).sum();
        format!(
            "{}: {} in all, at most {} a minute ({at}), {latest}.",
            s.name,
            unit.format(total),
            unit.format(peak)
        )
    } else {
        format!(
            "{}: at most {} ({at}), {latest}.",
            s.name,
            unit.format(peak)
        )
    }
}

/// A small line of values with no axes, for a table cell; its numbers are in the row beside it.
pub(crate) fn sparkline(values: &[u64], label: &str) -> String {
    const W: f64 = 120.0;
    const H: f64 = 22.0;
    let top = nice_ceiling(values.iter().copied().max().unwrap_or(0) as f64);
    let step = W / values.len().max(1) as f64;
    let mut b = format!(
        "<svg class=\"spark\" role=\"img\" aria-label=\"{}\" viewBox=\"0 0 {W} {H}\" width=\"{W}\" height=\"{H}\" xmlns=\"http://www.w3.org/2000/svg\">",
        esc(label)
    );
    for (i, value) in values.iter().enumerate() {
        if *value == 0 {
            continue;
        }
        let h = (*value as f64 / top) * (H - 2.0);
        let _ = write!(
            b,
            "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{h:.1}\"/>",
            step * i as f64,
            H - h,
            (step * 0.9).max(0.5)
        );
    }
    b.push_str("</svg>");
    b
}

/// A horizontal bar for `part` of `whole` with its numbers beside it (a `<progress>` element,
/// which screen readers announce as a percentage).
pub(crate) fn bar(id: &str, part: u64, whole: Option<u64>, what: &str) -> String {
    match whole {
        Some(whole) if whole > 0 => {
            let shown = part.min(whole);
            format!(
                "<progress id=\"{id}\" max=\"{whole}\" value=\"{shown}\" aria-label=\"{}\">{shown} of {whole}</progress> <span class=\"muted\">{} of {} {} ({:.0}%)</span>",
                esc(what),
                thousands(part),
                thousands(whole),
                esc(what),
                shown as f64 * 100.0 / whole as f64,
            )
        }
        _ => format!(
            "<progress id=\"{id}\" aria-label=\"{}\"></progress> <span class=\"muted\">{} {} (total unknown)</span>",
            esc(what),
            thousands(part),
            esc(what)
        ),
    }
}

/// The five charts of a queue's (or a partition's) hour; `partitions`: how many partitions the
/// hour covers.
pub(crate) fn hour_charts(hour: &[HourMinute], partitions: u32) -> String {
    let minutes: Vec<u64> = hour.iter().map(|m| m.minute).collect();
    let per = |f: &dyn Fn(&HourMinute) -> Option<f64>| hour.iter().map(f).collect::<Vec<_>>();
    let mut b = String::new();
    b.push_str(&chart(
        "throughput",
        "Throughput: handler runs that succeeded, per minute",
        Unit::Count,
        Kind::Bars,
        &minutes,
        &[Series {
            name: "handled",
            class: "s-ok",
            values: per(&|m| Some(m.handled() as f64)),
            table_only: false,
        }],
        "",
    ));
    b.push_str(&chart(
        "failures",
        "Failures: handler runs that failed (an error, a panic or a timeout), and transactional handler calls replayed, per minute",
        Unit::Count,
        Kind::Bars,
        &minutes,
        &[
            Series {
                name: "failed",
                class: "s-bad",
                values: per(&|m| Some(m.failed as f64)),
                table_only: false,
            },
            Series {
                name: "replayed",
                class: "s-warn",
                values: per(&|m| Some(m.replayed as f64)),
                table_only: false,
            },
        ],
        "",
    ));
    let capped = hour.iter().any(|m| m.due_more);
    // Minutes (before this one) whose depth covers fewer than all the partitions.
    let partial = hour
        .iter()
        .filter(|m| m.due.is_some() && m.sampled < partitions)
        .count();
    let mut note = "Each worker counts the partitions it holds once a minute (64 at most, in turn); a partition not counted in a minute keeps its last count; this minute's figure is this page's own count.".to_string();
    if partial > 0 {
        let _ = write!(
            note,
            " In {partial} minute{} not every one of the {partitions} partitions had been counted yet: those minutes show the rows of the partitions counted (see \"partitions counted\" in the numbers), not the whole queue's.",
            if partial == 1 { "" } else { "s" }
        );
    }
    if capped {
        note.push_str(" Some counts stopped at their bound: the queue held more.");
    }
    b.push_str(&chart(
        "depth",
        "Depth: rows due and waiting",
        Unit::Count,
        Kind::Lines,
        &minutes,
        &[
            Series {
                name: "due",
                class: "s-depth",
                values: per(&|m| m.due.map(|d| d as f64)),
                table_only: false,
            },
            Series {
                name: "partitions counted",
                class: "",
                values: per(&|m| m.due.map(|_| f64::from(m.sampled))),
                table_only: true,
            },
        ],
        &note,
    ));
    b.push_str(&chart(
        "lateness",
        "Lateness: how long after its due time a handler started",
        Unit::Millis,
        Kind::Lines,
        &minutes,
        &[
            Series {
                name: "mean",
                class: "s-mean",
                values: per(&|m| m.mean_late_ms().map(|v| v as f64)),
                table_only: false,
            },
            Series {
                name: "latest",
                class: "s-max",
                values: per(&|m| (m.runs > 0).then_some(m.late_max_ms as f64)),
                table_only: false,
            },
            Series {
                name: "oldest waiting",
                class: "s-wait",
                values: per(&|m| m.oldest_late_s.map(|s| s as f64 * 1000.0)),
                table_only: false,
            },
        ],
        "\"oldest waiting\" is how late the oldest due row was when the depth was counted.",
    ));
    b.push_str(&chart(
        "handler-time",
        "Handler time",
        Unit::Millis,
        Kind::Lines,
        &minutes,
        &[
            Series {
                name: "mean",
                class: "s-mean",
                values: per(&|m| m.mean_ms().map(|v| v as f64)),
                table_only: false,
            },
            Series {
                name: "longest",
                class: "s-max",
                values: per(&|m| (m.runs > 0).then_some(m.max_ms as f64)),
                table_only: false,
            },
        ],
        "",
    ));
    b
}

/// The charts' styles.
pub(crate) const STYLE: &str = r#"
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 16px; }
figure.chart { background: #fff; margin: 0; padding: 10px 14px; box-shadow: 0 1px 2px rgba(0,0,0,.06); border-radius: 4px; }
figure.chart h3 { font-size: 14px; margin: 0 0 2px; } figure.chart .summary { margin: 0 0 6px; color: #4a5365; font-size: 12px; }
figure.chart p.muted { font-size: 12px; margin: 4px 0 0; }
figure.chart svg { width: 100%; height: 170px; display: block; }
figure.chart .grid { stroke: #e6e8ec; stroke-width: 1; } figure.chart .axis { fill: #7a8294; font-size: 11px; }
.s-ok { fill: #2f7dd1; } .s-bad { fill: #c8362c; } .s-warn { fill: #d1902f; } .s-depth { stroke: #7a4fd1; stroke-width: 2; } circle.s-depth { fill: #7a4fd1; }
polyline.s-mean { stroke: #2f7dd1; stroke-width: 2; } circle.s-mean { fill: #2f7dd1; }
polyline.s-max { stroke: #d17a2f; stroke-width: 1.5; stroke-dasharray: 4 3; } circle.s-max { fill: #d17a2f; }
polyline.s-wait { stroke: #c8362c; stroke-width: 1.5; } circle.s-wait { fill: #c8362c; }
.legend { font-size: 12px; color: #4a5365; margin: 4px 0 0; } .legend .key { display: inline-block; width: 12px; height: 3px; margin: 0 4px 3px 8px; vertical-align: middle; }
.key.s-mean { background: #2f7dd1; } .key.s-max { background: #d17a2f; } .key.s-wait { background: #c8362c; }
details summary { cursor: pointer; color: #5b6476; font-size: 12px; margin-top: 4px; }
table.numbers { margin-top: 4px; } table.numbers td, table.numbers th { padding: 2px 8px; }
svg.spark { fill: #2f7dd1; vertical-align: middle; }
progress { width: 200px; height: 12px; vertical-align: middle; }
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_round_up_to_readable_tops() {
        assert_eq!(nice_ceiling(0.0), 1.0);
        assert_eq!(nice_ceiling(f64::NAN), 1.0);
        assert_eq!(nice_ceiling(1.0), 1.0);
        assert_eq!(nice_ceiling(3.0), 5.0);
        assert_eq!(nice_ceiling(11.0), 20.0);
        assert_eq!(nice_ceiling(999.0), 1000.0);
        assert_eq!(nice_ceiling(1001.0), 2000.0);
        assert_eq!(nice_ceiling(u64::MAX as f64), 2e19);
    }

    #[test]
    fn values_read_in_their_units() {
        assert_eq!(Unit::Count.format(1_234_567.0), "1,234,567");
        assert_eq!(Unit::Count.format(2.5), "2.5");
        assert_eq!(Unit::Millis.format(12.0), "12 ms");
        assert_eq!(Unit::Millis.format(1500.0), "1.5 s");
        assert_eq!(Unit::Millis.format(90_000.0), "1.5 min");
        assert_eq!(Unit::Millis.format(7_200_000.0), "2.0 h");
        assert_eq!(clock(0), "00:00");
        assert_eq!(clock(24 * 60 + 61), "01:01");
    }

    #[test]
    fn a_chart_draws_a_bar_per_minute_with_a_value_and_says_it_in_words() {
        let minutes = [100, 101, 102];
        let html = chart(
            "t",
            "Throughput",
            Unit::Count,
            Kind::Bars,
            &minutes,
            &[Series {
                name: "handled",
                class: "s-ok",
                values: vec![Some(4.0), None, Some(10.0)],
                table_only: false,
            }],
            "",
        );
        assert_eq!(html.matches("<rect ").count(), 2, "{html}");
        assert!(
            html.contains("data-minute=\"102\" data-value=\"10\""),
            "{html}"
        );
        assert!(
            html.contains("handled: 14 in all, at most 10 a minute (01:42), 10 this minute."),
            "{html}"
        );
        // The numbers table has every minute, a missing one as a dash.
        assert_eq!(html.matches("<tr data-minute=").count(), 3);
        assert!(
            html.contains("<td>01:41</td><td class=\"num\">—</td>"),
            "{html}"
        );
    }

    #[test]
    fn a_line_breaks_where_a_minute_has_no_value() {
        let html = chart(
            "d",
            "Depth",
            Unit::Count,
            Kind::Lines,
            &[1, 2, 3, 4, 5],
            &[Series {
                name: "due",
                class: "s-depth",
                values: vec![Some(1.0), Some(2.0), None, Some(3.0), Some(3.0)],
                table_only: false,
            }],
            "",
        );
        assert_eq!(html.matches("<polyline").count(), 2, "{html}");
        assert_eq!(html.matches("<circle").count(), 4, "{html}");
        let empty = chart("e", "Empty", Unit::Count, Kind::Lines, &[1, 2], &[], "");
        assert!(!empty.contains("<polyline"));
    }

    #[test]
    fn a_depth_of_some_partitions_only_says_so() {
        let minute = |minute, due: Option<u64>, sampled| HourMinute {
            due,
            sampled,
            ..HourMinute::at(minute)
        };
        let hour = [
            minute(1, None, 0),
            minute(2, Some(30), 64),
            minute(3, Some(900), 1000),
        ];
        let html = hour_charts(&hour, 1000);
        assert!(
            html.contains("In 1 minute not every one of the 1000 partitions had been counted yet"),
            "{html}"
        );
        // The count of partitions is in the numbers, not drawn.
        assert!(html.contains("<th class=\"num\">partitions counted</th>"));
        assert!(
            html.contains("<td class=\"num\">30</td><td class=\"num\">64</td>"),
            "{html}"
        );
        let whole = hour_charts(&[minute(2, Some(30), 4)], 4);
        assert!(!whole.contains("not every one"));
    }

    #[test]
    fn a_bar_without_a_total_says_so() {
        assert!(bar("b", 5, Some(10), "rows").contains("5 of 10 rows (50%)"));
        assert!(bar("b", 15, Some(10), "rows").contains("value=\"10\""));
        assert!(bar("b", 5, None, "rows").contains("5 rows (total unknown)"));
        assert!(bar("b", 5, Some(0), "rows").contains("total unknown"));
    }
}
