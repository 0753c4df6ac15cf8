//! Server-rendered pages: plain HTML and a little CSS, no scripts.

use std::fmt::Write;
use std::time::Instant;

use tito::inspect::{Count, QueueRow};

use crate::{ActionRecord, ChartsData, InboxData, KvData, Overview, QueueData, TableData};

const STYLE: &str = r#"
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #1d2330; background: #f6f7f9; }
header { background: #1d2330; color: #fff; padding: 10px 24px; display: flex; gap: 24px; align-items: baseline; }
header a { color: #cfd6e4; text-decoration: none; } header a:hover { color: #fff; }
header .brand { font-weight: 700; color: #fff; font-size: 16px; }
main { padding: 16px 24px 40px; max-width: 1200px; }
h1 { font-size: 20px; margin: 8px 0 12px; } h2 { font-size: 16px; margin: 24px 0 8px; }
table { border-collapse: collapse; background: #fff; width: 100%; box-shadow: 0 1px 2px rgba(0,0,0,.06); }
th, td { text-align: left; padding: 6px 10px; border-bottom: 1px solid #e6e8ec; vertical-align: top; }
th { background: #eef0f4; font-weight: 600; font-size: 12px; text-transform: uppercase; letter-spacing: .03em; color: #4a5365; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
.cards { display: flex; gap: 12px; flex-wrap: wrap; margin: 8px 0 4px; }
.card { background: #fff; padding: 10px 14px; min-width: 130px; box-shadow: 0 1px 2px rgba(0,0,0,.06); border-radius: 4px; }
.card .value { font-size: 22px; font-weight: 650; font-variant-numeric: tabular-nums; }
.card .label { color: #5b6476; font-size: 12px; }
.late, .warn { color: #b3261e; font-weight: 600; } .ok { color: #1f7a3a; } .muted { color: #7a8294; }
.error { color: #b3261e; } .bad { background: #fff3f2; }
code, pre { font: 12px/1.4 ui-monospace, SFMono-Regular, Menlo, monospace; }
pre { margin: 0; white-space: pre-wrap; word-break: break-all; }
a { color: #1a56c4; }
form.inline { display: inline; }
button { font: inherit; padding: 3px 10px; border: 1px solid #9aa3b5; background: #fff; border-radius: 3px; cursor: pointer; }
button.danger { border-color: #b3261e; color: #b3261e; }
input { font: inherit; padding: 3px 6px; border: 1px solid #9aa3b5; border-radius: 3px; }
.pager { margin: 8px 0; } footer { color: #7a8294; font-size: 12px; margin-top: 24px; }
.state { display: inline-block; padding: 0 6px; border-radius: 3px; font-size: 12px; background: #eef0f4; }
tr.shown td { background: #eef4ff; font-weight: 600; }
.state.ready { background: #e3f4e8; } .state.leased { background: #e5ecfb; } .state.delayed { background: #fdf3dc; } .state.building, .state.dropping { background: #fdf3dc; }
"#;

/// Escapes text for HTML content and attribute values.
pub(crate) fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            // Bidirectional controls would reorder the text around them on screen (a name
            // that reads as another): shown as their code points instead.
            '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}' | '\u{200E}' | '\u{200F}' => {
                out.push_str(&format!("&lt;U+{:04X}&gt;", c as u32))
            }
            c if c.is_control() && !matches!(c, '\n' | '\t' | '\r') => {
                out.push_str(&format!("&lt;U+{:04X}&gt;", c as u32))
            }
            c => out.push(c),
        }
    }
    out
}

/// Escapes a query-string value.
fn q(text: &str) -> String {
    let mut out = String::new();
    for byte in text.bytes() {
        match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(byte as char)
            }
            _ => {
                let _ = write!(out, "%{byte:02X}");
            }
        }
    }
    out
}

tokio::task_local! {
    /// The path the router is mounted at, with a final `/`, for the request being served.
    pub(crate) static BASE: String;
}

/// The router's mount path for a request: its original path less the path the router sees
/// (`/tito/queue` seen as `/queue` → `/tito/`).
pub(crate) fn base_of(request: &axum::extract::Request) -> String {
    let inner = request.uri().path();
    let original = request
        .extensions()
        .get::<axum::extract::OriginalUri>()
        .map_or(inner, |o| o.0.path());
    let prefix = if inner == "/" && !original.ends_with('/') {
        original
    } else {
        original.strip_suffix(inner).unwrap_or("")
    };
    format!("{prefix}/")
}

/// A whole page. Links are relative to the router's mount path (`<base>`), so the router works
/// wherever it is mounted.
pub(crate) fn page(title: &str, body: &str, started: Option<Instant>) -> String {
    page_with(title, body, started, "")
}

/// A whole page with more in its `<head>` (a refresh).
pub(crate) fn page_with(title: &str, body: &str, started: Option<Instant>, head: &str) -> String {
    let base = BASE.try_with(Clone::clone).unwrap_or_else(|_| "/".into());
    let home = home(&base);
    let timing = started.map_or(String::new(), |s| {
        format!(
            "<footer>times in UTC · read in <span id=\"read-ms\">{:.1}</span> ms</footer>",
            s.elapsed().as_secs_f64() * 1000.0
        )
    });
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <base href=\"{base}\">{head}<title>{title} · Tito</title><style>{STYLE}{charts}</style></head><body>\
         <header><a class=\"brand\" href=\"{home}\">Tito</a><a href=\"{home}\">Overview</a>\
         <a href=\"graphs\">Graphs</a><a href=\"actions\">Actions</a><a href=\"backup\">Backup</a></header><main><h1>{title}</h1>{body}{timing}</main></body></html>",
        title = esc(title),
        base = esc(&base),
        home = esc(&home),
        charts = crate::charts::STYLE,
    )
}

/// The overview's path: the mount path itself (`/tito`, which a nested router answers; `/tito/`
/// it does not), or `/` at the root.
fn home(base: &str) -> String {
    match base.trim_end_matches('/') {
        "" => "/".to_string(),
        mount => mount.to_string(),
    }
}

fn card(label: &str, value: &str, id: &str) -> String {
    format!(
        "<div class=\"card\"><div class=\"value\" data-figure=\"{id}\">{}</div><div class=\"label\">{}</div></div>",
        esc(value),
        esc(label)
    )
}

fn utc_ms(ms: u64) -> String {
    chrono::DateTime::from_timestamp_millis(ms as i64).map_or_else(
        || ms.to_string(),
        |t| t.format("%Y-%m-%d %H:%M:%S").to_string(),
    )
}

fn utc_s(s: u64) -> String {
    utc_ms(s.saturating_mul(1000))
}

fn duration_s(s: u64) -> String {
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {:02}s", s / 60, s % 60),
        3600..86_400 => format!("{}h {:02}m", s / 3600, s / 60 % 60),
        _ => format!("{}d {:02}h", s / 86_400, s / 3600 % 24),
    }
}

fn late_cell(late_s: u64, due: bool) -> String {
    if !due {
        return "<span class=\"muted\">—</span>".into();
    }
    let class = if late_s >= 60 { "late" } else { "ok" };
    format!("<span class=\"{class}\">{}</span>", duration_s(late_s))
}

fn count(c: &Count) -> String {
    c.to_string()
}

fn json_cell(value: &serde_json::Value) -> String {
    // Compact: one line per row (wrapped when long), so a page of rows stays readable.
    let text = serde_json::to_string(value).unwrap_or_default();
    format!("<pre>{}</pre>", esc(&text))
}

fn topic_query(topic: Option<&str>) -> String {
    topic.map_or(String::new(), |t| format!("topic={}&", q(t)))
}

/// The charts page of a queue (and of one partition, with a refresh when given).
fn charts_href(topic: Option<&str>, partition: Option<u32>, refresh: Option<u64>) -> String {
    let mut params = Vec::new();
    if let Some(topic) = topic {
        params.push(format!("topic={}", q(topic)));
    }
    if let Some(p) = partition {
        params.push(format!("partition={p}"));
    }
    if let Some(r) = refresh {
        params.push(format!("refresh={r}"));
    }
    if params.is_empty() {
        "charts".to_string()
    } else {
        format!("charts?{}", params.join("&"))
    }
}

pub(crate) fn overview(data: &Overview, started: Instant) -> String {
    let mut b = String::new();
    let due: u64 = data.queues.iter().map(|q| q.due_now.value).sum();
    let later: u64 = data.queues.iter().map(|q| q.future.value).sum();
    let any_more = data.queues.iter().any(|q| q.due_now.more);
    b.push_str("<div class=\"cards\">");
    b.push_str(&card("queues", &data.queues.len().to_string(), "queues"));
    b.push_str(&card(
        "due now",
        &format!("{due}{}", if any_more { "+" } else { "" }),
        "due-now",
    ));
    b.push_str(&card("due later", &later.to_string(), "due-later"));
    b.push_str(&card("tables", &data.tables.len().to_string(), "tables"));
    b.push_str("</div>");

    b.push_str("<h2>Queues</h2><table id=\"queues\"><tr><th>queue</th><th class=\"num\">partitions</th><th class=\"num\">due now</th><th class=\"num\">later</th><th>oldest due</th><th>late by</th><th class=\"num\">completed (kept)</th><th class=\"num\">last minute</th><th>last hour</th><th class=\"num\">dead</th><th>state</th><th>limits</th></tr>");
    if data.queues.is_empty() {
        b.push_str("<tr><td colspan=\"12\" class=\"muted\">no queue in this store</td></tr>");
    }
    for queue in &data.queues {
        let now_s = queue.now_ms / 1000;
        let late = queue.oldest_due.map_or(0, |d| now_s.saturating_sub(d));
        let hour_handled: u64 = queue.hour.iter().map(|m| m.handled()).sum();
        let _ = write!(
            b,
            "<tr data-queue=\"{key}\"><td><a href=\"queue?{topic}\">{label}</a></td><td class=\"num\">{parts}</td>\
             <td class=\"num\" data-figure=\"due-now\">{due}</td><td class=\"num\">{later}</td><td>{oldest}</td><td>{late}</td>\
             <td class=\"num\">{completed}</td><td class=\"num\">{minute}</td>\
             <td data-figure=\"hour\"><a href=\"{charts}\" title=\"charts of the last hour\">{spark}</a> {hour_total}</td>\
             <td class=\"num{dead_class}\" data-figure=\"dead\">{dead}</td><td data-figure=\"state\">{state}</td>\
             <td data-figure=\"limits\">{limits}</td></tr>",
            key = esc(&queue.info.label),
            label = queue_cell(queue.info.topic.as_deref()),
            topic = topic_query(queue.info.topic.as_deref()),
            parts = queue.info.partitions.map_or("?".into(), |p| p.to_string()),
            due = count(&queue.due_now),
            later = count(&queue.future),
            oldest = queue.oldest_due.map_or("—".into(), utc_s),
            late = late_cell(late, queue.due_now.value > 0),
            completed = count(&queue.completed),
            minute = queue.completed_per_minute.first().map_or("0".into(), count),
            spark = crate::charts::sparkline(
                &queue.hour.iter().map(|m| m.handled()).collect::<Vec<_>>(),
                &format!("handled per minute over the last hour: {hour_handled} in all"),
            ),
            hour_total = hour_handled,
            charts = esc(&charts_href(queue.info.topic.as_deref(), None, None)),
            dead = count(&queue.dead),
            dead_class = if queue.dead.value > 0 { " warn" } else { "" },
            state = queue_state(&queue.paused),
            limits = esc(&limits_summary(&queue.limits)),
        );
    }
    b.push_str("</table>");

    if !data.inboxes.is_empty() {
        b.push_str("<h2>Inboxes</h2><table id=\"inboxes\"><tr><th>inbox</th><th>group</th><th class=\"num\">ready</th><th class=\"num\">delayed</th><th class=\"num\">leased</th><th class=\"num\">processed</th><th class=\"num\">bad rows</th></tr>");
        for inbox in &data.inboxes {
            let c = &inbox.counts;
            let more = if c.more { "+" } else { "" };
            let _ = write!(
                b,
                "<tr data-inbox=\"{table}/{group}\"><td><a href=\"inbox?table={tq}&group={gq}\">{table}</a></td><td>{group}</td>\
                 <td class=\"num\" data-figure=\"ready\">{}{more}</td><td class=\"num\">{}{more}</td><td class=\"num\">{}{more}</td>\
                 <td class=\"num\">{}{more}</td><td class=\"num\">{}</td></tr>",
                c.ready,
                c.delayed,
                c.leased,
                c.processed,
                c.bad,
                table = esc(&inbox.table),
                group = esc(&inbox.group),
                tq = q(&inbox.table),
                gq = q(&inbox.group),
            );
        }
        b.push_str("</table>");
    }

    b.push_str(
        "<h2>Tables</h2><table id=\"tables\"><tr><th>table</th><th class=\"num\">rows</th></tr>",
    );
    if data.tables.is_empty() {
        b.push_str("<tr><td colspan=\"2\" class=\"muted\">no rows in this store</td></tr>");
    }
    for table in &data.tables {
        let _ = write!(
            b,
            "<tr data-table=\"{t}\"><td><a href=\"table?name={tq}\">{t}</a></td><td class=\"num\" data-figure=\"rows\">{}</td></tr>",
            count(&table.rows),
            t = esc(&table.table),
            tq = q(&table.table)
        );
    }
    b.push_str("</table>");

    if !data.kv.is_empty() {
        b.push_str("<h2>Key/value namespaces</h2><table id=\"kv\"><tr><th>namespace</th><th class=\"num\">keys</th></tr>");
        for ns in &data.kv {
            let _ = write!(
                b,
                "<tr data-namespace=\"{n}\"><td><a href=\"kv?namespace={nq}\">{n}</a></td><td class=\"num\" data-figure=\"keys\">{}</td></tr>",
                count(&ns.keys),
                n = esc(&ns.namespace),
                nq = q(&ns.namespace)
            );
        }
        b.push_str("</table>");
    }
    if !data.actions.is_empty() {
        b.push_str("<h2>Recent actions</h2>");
        b.push_str(&actions_table(&data.actions));
    }
    page("Overview", &b, Some(started))
}

fn row_table(rows: &[QueueRow], completed: bool) -> String {
    let mut b = String::new();
    let when = if completed { "completed" } else { "due" };
    let _ = write!(
        b,
        "<table class=\"rows\"><tr><th>event id</th><th>key</th><th>{when}</th><th class=\"num\">urgency</th><th class=\"num\">attempt</th><th>owner</th><th>payload</th></tr>"
    );
    if rows.is_empty() {
        b.push_str("<tr><td colspan=\"7\" class=\"muted\">none</td></tr>");
    }
    for row in rows {
        let when = if completed {
            row.processed_ms.map_or("?".into(), utc_ms)
        } else {
            row.due.map_or("?".into(), utc_s)
        };
        match (&row.event, &row.malformed) {
            (Some(event), None) => {
                let owner = event.owner.as_ref().map_or(String::new(), |o| {
                    format!("{}/{}", esc(&o.kind), esc(&o.id))
                });
                // A worker could not decode it as its handler's type: say so on the row.
                let undecodable = row.undecodable.as_ref().map_or(String::new(), |note| {
                    format!(
                        "<div class=\"error\" data-undecodable=\"1\">undecodable as <code>{}</code>: {} (the “Set row aside” form below moves it aside, with this row's key)</div>",
                        esc(&note.type_name),
                        esc(&note.error)
                    )
                });
                let class = if undecodable.is_empty() {
                    ""
                } else {
                    " class=\"bad\""
                };
                // Completed because it was cancelled: say so, and why.
                let undecodable = match &event.cancelled {
                    Some(why) => format!(
                        "{undecodable}<div class=\"muted\" data-cancelled=\"1\">cancelled: {}</div>",
                        esc(why)
                    ),
                    None => undecodable,
                };
                // A failed attempt: its error under the payload.
                let undecodable = match &event.last_error {
                    Some(error) => format!(
                        "{undecodable}<div class=\"error\" data-last-error=\"1\">last error: {}</div>",
                        esc(error)
                    ),
                    None => undecodable,
                };
                let _ = write!(
                    b,
                    "<tr{class} data-event=\"{id}\"><td><code>{id}</code></td><td>{key}</td><td>{when}</td>\
                     <td class=\"num\" data-figure=\"urgency\">{urgency}</td><td class=\"num\" data-figure=\"attempt\">{attempt}</td>\
                     <td>{owner}</td><td>{}{undecodable}</td></tr>",
                    json_cell(&event.payload),
                    id = esc(&event.id),
                    key = esc(&event.key),
                    urgency = event.urgency,
                    attempt = event.attempt,
                );
            }
            _ => {
                let _ = write!(
                    b,
                    "<tr class=\"bad\" data-malformed=\"1\"><td colspan=\"2\"><code>{}</code></td><td>{when}</td><td colspan=\"4\"><span class=\"error\">{}</span><pre>{}</pre></td></tr>",
                    esc(&row.key),
                    esc(row.malformed.as_deref().unwrap_or("")),
                    esc(row.raw.as_deref().unwrap_or("")),
                );
            }
        }
    }
    b.push_str("</table>");
    b
}

/// Whether a queue runs, on one line: "running", "PAUSED: why", or the partitions paused.
fn queue_state(paused: &tito::queue::Paused) -> String {
    if let Some(pause) = &paused.queue {
        return format!("<span class=\"warn\">PAUSED</span>: {}", esc(&pause.why));
    }
    if paused.partitions.is_empty() {
        return "running".into();
    }
    let which: Vec<String> = paused
        .partitions
        .iter()
        .map(|(p, pause)| format!("{p}: {}", esc(&pause.why)))
        .collect();
    format!(
        "<span class=\"warn\">{} partition{} paused</span> ({})",
        which.len(),
        if which.len() == 1 { "" } else { "s" },
        which.join(", ")
    )
}

/// A queue's limits and how close it is to each, on one line ("—" without limits).
fn limits_summary(usage: &tito::queue::LimitUsage) -> String {
    let l = &usage.limits;
    let mut parts = Vec::new();
    if let Some(n) = l.concurrency {
        parts.push(format!("{} of {n} running", usage.running));
    }
    if let Some(n) = l.key_concurrency {
        let busiest = usage.running_by_key.values().max().copied().unwrap_or(0);
        parts.push(format!("{n} per key (busiest {busiest})"));
    }
    if let Some(r) = &l.rate {
        parts.push(format!("{} started, rate {r}", usage.recent_starts));
    }
    if let Some(r) = &l.key_rate {
        parts.push(format!("per-key rate {r}"));
    }
    if parts.is_empty() {
        return "—".into();
    }
    parts.join("; ")
}

pub(crate) fn queue(data: &QueueData, started: Instant) -> String {
    let o = &data.overview;
    let topic = o.info.topic.as_deref();
    let tq = topic_query(topic);
    let now_s = o.now_ms / 1000;
    let mut b = String::new();
    b.push_str("<div class=\"cards\">");
    b.push_str(&card("due now", &count(&o.due_now), "due-now"));
    b.push_str(&card("due later", &count(&o.future), "due-later"));
    b.push_str(&card(
        "oldest due is late by",
        &o.oldest_due
            .filter(|_| o.due_now.value > 0)
            .map_or("—".into(), |d| duration_s(now_s.saturating_sub(d))),
        "late",
    ));
    b.push_str(&card("completed (kept)", &count(&o.completed), "completed"));
    b.push_str(&card("dead", &count(&o.dead), "dead"));
    let paused = match (&o.paused.queue, o.paused.partitions.len()) {
        (Some(pause), _) => format!("yes: {}", pause.why),
        (None, 0) => "no".to_string(),
        (None, n) => {
            let list: Vec<String> = o
                .paused
                .partitions
                .iter()
                .map(|(p, pause)| format!("{p}: {}", pause.why))
                .collect();
            format!(
                "{n} partition{} ({})",
                if n == 1 { "" } else { "s" },
                list.join(", ")
            )
        }
    };
    b.push_str(&card("paused", &paused, "paused"));
    b.push_str(&card("limits", &limits_summary(&o.limits), "limits"));
    b.push_str(&card(
        "coordinator",
        o.coordinator.as_deref().unwrap_or("—"),
        "coordinator",
    ));
    b.push_str("</div>");

    let _ = write!(
        b,
        "<p><a id=\"charts-link\" href=\"{}\">Charts of the last hour</a> (throughput, failures, depth, lateness, handler time; per partition too)</p>",
        esc(&charts_href(topic, None, None))
    );
    b.push_str("<h2>Throughput</h2><table id=\"throughput\"><tr>");
    for minute in 0..o.completed_per_minute.len() {
        let label = if minute == 0 {
            "this minute".to_string()
        } else {
            format!("{minute} min ago")
        };
        let _ = write!(b, "<th class=\"num\">{label}</th>");
    }
    b.push_str("</tr><tr>");
    for c in &o.completed_per_minute {
        let _ = write!(b, "<td class=\"num\">{}</td>", count(c));
    }
    b.push_str("</tr></table>");
    b.push_str(&handler_figures(o));

    b.push_str("<h2>Partitions</h2><table id=\"partitions\"><tr><th class=\"num\">partition</th><th class=\"num\">due now</th><th class=\"num\">later</th><th>oldest due</th><th>late by</th><th>lease holder</th><th>lease until</th></tr>");
    for p in &o.partitions {
        let (holder, until) = match &p.lease {
            Some(l) => (
                format!("<code>{}</code>", esc(&l.holder)),
                if l.expires_ms == 0 {
                    "—".into()
                } else {
                    utc_ms(l.expires_ms)
                },
            ),
            None => ("<span class=\"muted\">free</span>".into(), "—".into()),
        };
        let _ = write!(
            b,
            "<tr data-partition=\"{n}\"{shown}><td class=\"num\"><a href=\"queue?{tq}partition={n}\">{n}</a></td><td class=\"num\" data-figure=\"due-now\">{}</td><td class=\"num\">{}</td><td>{}</td><td>{}</td><td>{holder}</td><td>{until}</td></tr>",
            count(&p.due_now),
            count(&p.future),
            p.oldest_due.map_or("—".into(), utc_s),
            late_cell(p.oldest_late_s, p.due_now.value > 0),
            n = p.partition,
            shown = if p.partition == data.partition {
                " class=\"shown\""
            } else {
                ""
            },
        );
    }
    b.push_str("</table>");
    b.push_str(&lease_holders(o));
    b.push_str(&busy_keys(&o.limits));
    // Find an invocation by event id or business key, whatever its partition.
    let (text, found) = match &data.found {
        Some((text, rows)) => (text.as_str(), Some(rows)),
        None => ("", None),
    };
    let _ = write!(
        b,
        "<h2 id=\"find\">Find</h2><form method=\"get\" action=\"queue\">\
         <input type=\"hidden\" name=\"topic\" value=\"{}\">\
         <input name=\"find\" placeholder=\"event id, key or owner kind:id\" value=\"{}\" size=\"40\"> \
         <button type=\"submit\">Find</button></form>",
        esc(topic.unwrap_or("")),
        esc(text)
    );
    if let Some(rows) = found {
        let _ = write!(
            b,
            "<p data-figure=\"found\">{} found for <code>{}</code> (by event id, and pending by key)</p>",
            rows.len(),
            esc(text)
        );
        b.push_str(&row_table(rows, false));
    }
    if !o.members.is_empty() {
        let members: Vec<String> = o
            .members
            .iter()
            .map(|m| format!("<code>{}</code>", esc(m)))
            .collect();
        let _ = write!(b, "<p>Cluster members: {}</p>", members.join(", "));
    }

    let _ = write!(
        b,
        "<h2 id=\"pending\">Pending in partition {}</h2>",
        data.partition
    );
    b.push_str(&row_table(&data.pending.items, false));
    if let Some(cursor) = &data.pending.cursor {
        let _ = write!(
            b,
            "<div class=\"pager\"><a href=\"queue?{tq}partition={}&cursor={}\">next page →</a></div>",
            data.partition,
            q(cursor)
        );
    }
    b.push_str("<h2>Recently completed</h2>");
    b.push_str(&row_table(&data.completed.items, true));
    if let Some(cursor) = &data.completed.cursor {
        let _ = write!(
            b,
            "<div class=\"pager\"><a href=\"queue?{tq}partition={}&completed_cursor={}\">older →</a></div>",
            data.partition,
            q(cursor)
        );
    }
    if !data.schedules.is_empty() {
        b.push_str("<h2>Periodic schedules</h2><table id=\"schedules\"><tr><th>schedule</th><th>when</th><th>last tick</th><th>next tick</th><th>last written by</th></tr>");
        for schedule in &data.schedules {
            let at = utc_s(schedule.last_tick.max(0) as u64);
            let next = schedule
                .next_tick
                .map_or("—".into(), |t| utc_s(t.max(0) as u64));
            let _ = write!(
                b,
                "<tr data-schedule=\"{name}\"><td><code>{name}</code></td><td data-figure=\"when\">{}</td><td>{}</td>\
                 <td data-figure=\"next\">{}</td><td data-figure=\"runner\">{}</td></tr>",
                esc(schedule.schedule.as_deref().unwrap_or("—")),
                esc(&at),
                esc(&next),
                esc(schedule.runner.as_deref().unwrap_or("—")),
                name = esc(&schedule.name)
            );
        }
        b.push_str("</table>");
    }
    b.push_str(&dead_table(&data.dead, topic));
    if let Some(last) = data.dead.last().filter(|_| data.dead.len() == crate::PAGE) {
        let _ = write!(
            b,
            "<div class=\"pager\"><a href=\"queue?{tq}dead_after={}\">more dead →</a></div>",
            q(&last.id)
        );
    }
    b.push_str(&operate(o, topic));
    let _ = write!(
        b,
        "<h2>Erase an owner's work</h2><form method=\"post\" action=\"erase-owner\">\
         <input type=\"hidden\" name=\"topic\" value=\"{}\">\
         <input name=\"kind\" placeholder=\"owner kind\" required> <input name=\"id\" placeholder=\"owner id\" required> \
         <button class=\"danger\" type=\"submit\">Erase…</button></form>",
        esc(topic.unwrap_or(""))
    );
    let title = match o.info.topic.as_deref() {
        Some(topic) => format!("Queue {topic}"),
        None => "Queue without a topic".to_string(),
    };
    page(&title, &b, Some(started))
}

/// Under a per-key concurrency limit, the keys running now, busiest first (at most 20): the
/// ones at their limit hold back their other rows.
fn busy_keys(usage: &tito::queue::LimitUsage) -> String {
    let Some(limit) = usage.limits.key_concurrency else {
        return String::new();
    };
    if usage.running_by_key.is_empty() {
        return String::new();
    }
    let mut keys: Vec<(&String, &u32)> = usage.running_by_key.iter().collect();
    keys.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    let mut b = String::from(
        "<h2>Keys running</h2><table id=\"keys\"><tr><th>key</th><th class=\"num\">running</th><th>state</th></tr>",
    );
    for (key, running) in keys.into_iter().take(20) {
        let state = if *running >= limit {
            format!("<span class=\"warn\">at its limit of {limit}</span>: its other rows wait")
        } else {
            format!("below its limit of {limit}")
        };
        let _ = write!(
            b,
            "<tr data-key=\"{k}\"><td><code>{k}</code></td><td class=\"num\">{running}</td><td>{state}</td></tr>",
            k = esc(key),
        );
    }
    b.push_str("</table>");
    b
}

/// The handlers' runs, failures and run times over the last minutes, from the workers' reports.
fn handler_figures(o: &tito::inspect::QueueOverview) -> String {
    let h = &o.handlers;
    let failed = if h.runs == 0 {
        "—".to_string()
    } else {
        format!(
            "{} ({:.1}%)",
            h.failed,
            h.failed as f64 * 100.0 / h.runs as f64
        )
    };
    format!(
        "<h2>Handlers, last {} minutes</h2><table id=\"handlers\"><tr><th class=\"num\">runs</th><th class=\"num\">failed</th><th class=\"num\">mean</th><th class=\"num\">longest</th><th class=\"num\">replayed</th><th class=\"num\">workers reporting</th></tr>\
         <tr><td class=\"num\" data-figure=\"runs\">{}</td><td class=\"num\" data-figure=\"failed\">{failed}</td><td class=\"num\" data-figure=\"mean\">{}</td><td class=\"num\" data-figure=\"longest\">{}</td><td class=\"num\" data-figure=\"replayed\">{}</td><td class=\"num\">{}</td></tr></table>\
         <p class=\"muted\">Each worker reports every {} s; figures of the current minute are partial.</p>",
        tito::inspect::THROUGHPUT_MINUTES,
        h.runs,
        h.mean_ms().map_or("—".into(), |ms| format!("{ms} ms")),
        if h.runs == 0 {
            "—".into()
        } else {
            format!("{} ms", h.max_ms)
        },
        h.replayed,
        o.workers.iter().filter(|w| w.running(o.now_ms)).count(),
        tito::queue::REPORT_EVERY.as_secs(),
    )
}

/// Each worker (or cluster node) once: the partitions it holds and when the first of its leases
/// runs out without renewal, and from its report the process and host that run it, its age,
/// its last report and its handlers over the last minutes. Workers that reported recently but
/// hold nothing (stopped, or idle without leases) are listed too.
fn lease_holders(o: &tito::inspect::QueueOverview) -> String {
    let mut holders: std::collections::BTreeMap<&str, (Vec<u32>, u64)> = Default::default();
    for p in &o.partitions {
        if let Some(lease) = &p.lease {
            let entry = holders
                .entry(lease.holder.as_str())
                .or_insert((Vec::new(), u64::MAX));
            entry.0.push(p.partition);
            if lease.expires_ms > 0 {
                entry.1 = entry.1.min(lease.expires_ms);
            }
        }
    }
    for report in &o.workers {
        holders
            .entry(report.worker.as_str())
            .or_insert((Vec::new(), u64::MAX));
    }
    if holders.is_empty() {
        return String::new();
    }
    let since = (o.now_ms / 60_000).saturating_sub(tito::inspect::THROUGHPUT_MINUTES - 1);
    let mut b = String::from(
        "<h2>Workers</h2><table id=\"holders\"><tr><th>worker</th><th>runs in</th><th>age</th><th>last report</th><th class=\"num\">partitions</th><th>holds</th><th>first lease until</th><th class=\"num\">runs</th><th class=\"num\">failed</th><th class=\"num\">mean</th></tr>",
    );
    for (holder, (partitions, until)) in holders {
        let list: Vec<String> = partitions.iter().map(u32::to_string).collect();
        let report = o.workers.iter().find(|r| r.worker == holder);
        let ago = |ms: u64| duration_s(o.now_ms.saturating_sub(ms) / 1000);
        let (runner, age, last, runs, failed, mean) = match report {
            Some(r) => {
                let f = r.since(since);
                (
                    esc(&r.runner),
                    ago(r.started_ms),
                    format!("{} ago{}", ago(r.written_ms), r.state_note(o.now_ms)),
                    f.runs.to_string(),
                    f.failed.to_string(),
                    f.mean_ms().map_or("—".into(), |ms| format!("{ms} ms")),
                )
            }
            None => {
                let none = || "<span class=\"muted\">no report</span>".to_string();
                (
                    none(),
                    "—".into(),
                    "—".into(),
                    "—".into(),
                    "—".into(),
                    "—".into(),
                )
            }
        };
        let _ = write!(
            b,
            "<tr data-holder=\"{h}\"><td><code>{h}</code></td><td data-figure=\"runner\">{runner}</td><td data-figure=\"age\">{age}</td><td>{last}</td><td class=\"num\" data-figure=\"held\">{}</td><td>{}</td><td>{}</td><td class=\"num\" data-figure=\"runs\">{runs}</td><td class=\"num\" data-figure=\"failed\">{failed}</td><td class=\"num\">{mean}</td></tr>",
            partitions.len(),
            list.join(", "),
            if until == u64::MAX {
                "—".into()
            } else {
                utc_ms(until)
            },
            h = esc(holder),
        );
    }
    b.push_str("</table>");
    b
}

/// The queue page's operator forms, each posted to `queue-action` (which asks for
/// confirmation before it does anything).
fn operate(o: &tito::inspect::QueueOverview, topic: Option<&str>) -> String {
    let form = |action: &str, id: &str, inputs: &str, button: &str, danger: bool| {
        format!(
            "<form method=\"post\" action=\"queue-action\" id=\"{id}\">\
             <input type=\"hidden\" name=\"action\" value=\"{action}\">\
             <input type=\"hidden\" name=\"topic\" value=\"{topic}\">{inputs} \
             <button type=\"submit\"{class}>{button}…</button></form>",
            topic = esc(topic.unwrap_or("")),
            class = if danger { " class=\"danger\"" } else { "" },
        )
    };
    let partition = "<input name=\"partition\" placeholder=\"partition (blank: all)\" size=\"16\">";
    let why = "<input name=\"why\" placeholder=\"why\">";
    let l = &o.limits.limits;
    let value = |v: Option<String>| v.map_or(String::new(), |v| esc(&v));
    // Exactly as stored (`10 per 1.5 s`), which the form parses back: a form sent unchanged
    // stores what was there.
    let rate = |r: &Option<tito::queue::Rate>| value(r.as_ref().map(|r| r.to_string()));
    let limits = format!(
        "<input name=\"concurrency\" placeholder=\"concurrency\" size=\"11\" value=\"{}\"> \
         <input name=\"key_concurrency\" placeholder=\"per key\" size=\"8\" value=\"{}\"> \
         <input name=\"rate\" placeholder=\"rate 100/1m\" size=\"11\" value=\"{}\"> \
         <input name=\"key_rate\" placeholder=\"per-key rate\" size=\"11\" value=\"{}\">",
        value(l.concurrency.map(|n| n.to_string())),
        value(l.key_concurrency.map(|n| n.to_string())),
        rate(&l.rate),
        rate(&l.key_rate),
    );
    let mut b = String::from("<h2>Operate</h2><div class=\"operate\">");
    b.push_str(&form(
        "pause",
        "pause",
        &format!("{partition} {why}"),
        "Pause",
        true,
    ));
    b.push_str(&form("resume", "resume", partition, "Resume", false));
    b.push_str(&form(
        "cancel",
        "cancel",
        &format!("<input name=\"id\" placeholder=\"event id\" required> {why}"),
        "Cancel invocation",
        true,
    ));
    b.push_str(&form(
        "cancel-owner",
        "cancel-owner",
        &format!(
            "<input name=\"kind\" placeholder=\"owner kind\" required> \
             <input name=\"owner\" placeholder=\"owner id\" required> {why}"
        ),
        "Cancel owner's work",
        true,
    ));
    b.push_str(&form(
        "limits",
        "limits",
        &limits,
        "Set limits (blank lifts)",
        false,
    ));
    b.push_str(&form(
        "set-aside",
        "set-aside",
        &format!("<input name=\"key\" placeholder=\"pending row key\" required> {why}"),
        "Set row aside",
        true,
    ));
    if o.dead.value > 0 {
        b.push_str(&form(
            "retry-all-dead",
            "retry-all-dead",
            "",
            "Retry all dead",
            false,
        ));
        b.push_str(&form(
            "discard-all-dead",
            "discard-all-dead",
            "",
            "Discard all dead",
            true,
        ));
    }
    b.push_str("</div>");
    b
}

pub(crate) fn inbox(data: &InboxData, started: Instant) -> String {
    let c = &data.counts;
    let more = if c.more { "+" } else { "" };
    let mut b = String::new();
    b.push_str("<div class=\"cards\">");
    b.push_str(&card("ready", &format!("{}{more}", c.ready), "ready"));
    b.push_str(&card("delayed", &format!("{}{more}", c.delayed), "delayed"));
    b.push_str(&card("leased", &format!("{}{more}", c.leased), "leased"));
    b.push_str(&card(
        "processed",
        &format!("{}{more}", c.processed),
        "processed",
    ));
    b.push_str(&card("bad rows (all groups)", &c.bad.to_string(), "bad"));
    b.push_str("</div>");
    let base = format!("inbox?table={}&group={}", q(&data.table), q(&data.group));
    b.push_str("<p>Show: ");
    for (label, state) in [
        ("all", ""),
        ("ready", "ready"),
        ("delayed", "delayed"),
        ("leased", "leased"),
        ("processed", "processed"),
    ] {
        let _ = write!(b, "<a href=\"{base}&state={state}\">{label}</a> · ");
    }
    b.push_str("</p>");
    b.push_str("<table id=\"rows\"><tr><th>id</th><th>state</th><th class=\"num\">attempt</th><th>retry after</th><th>lease until</th><th>row</th><th></th></tr>");
    if data.rows.items.is_empty() {
        b.push_str("<tr><td colspan=\"7\" class=\"muted\">none</td></tr>");
    }
    let groups: Vec<&String> = data.groups.iter().filter(|g| **g != data.group).collect();
    for row in &data.rows.items {
        let state = serde_json::to_value(row.state)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        let ms = |v: Option<i64>| {
            v.filter(|v| *v > 0)
                .map_or("—".into(), |v| utc_ms(v as u64))
        };
        let mut forms = String::new();
        for group in &groups {
            let _ = write!(
                forms,
                "<form class=\"inline\" method=\"post\" action=\"requeue\">\
                 <input type=\"hidden\" name=\"table\" value=\"{}\"><input type=\"hidden\" name=\"id\" value=\"{}\">\
                 <input type=\"hidden\" name=\"group\" value=\"{g}\"><button type=\"submit\">move to {g}…</button></form> ",
                esc(&data.table),
                esc(&row.id),
                g = esc(group),
            );
        }
        let _ = write!(
            b,
            "<tr data-row=\"{id}\"><td><code>{id}</code></td><td><span class=\"state {state}\">{state}</span></td><td class=\"num\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{forms}</td></tr>",
            row.attempt.map_or("—".into(), |a| a.to_string()),
            ms(row.retry_after),
            ms(row.locked_until),
            json_cell(&row.row),
            id = esc(&row.id),
        );
    }
    b.push_str("</table>");
    if let Some(cursor) = &data.rows.cursor {
        let state = data
            .state
            .and_then(|s| serde_json::to_value(s).ok())
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        let _ = write!(
            b,
            "<div class=\"pager\"><a href=\"{base}&state={state}&cursor={}\">next page →</a></div>",
            q(cursor)
        );
    }
    b.push_str("<h2>Bad rows</h2><table id=\"bad\"><tr><th>row id</th><th>key</th></tr>");
    if data.bad.is_empty() {
        b.push_str("<tr><td colspan=\"2\" class=\"muted\">none</td></tr>");
    }
    for id in &data.bad {
        let _ = write!(
            b,
            "<tr class=\"bad\"><td><code>{}</code></td><td><code>{}</code></td></tr>",
            esc(id),
            esc(&tito::inspect::inbox_bad_key(&data.table, id))
        );
    }
    b.push_str("</table>");
    page(
        &format!("Inbox {} / {}", data.table, data.group),
        &b,
        Some(started),
    )
}

/// A table's shape versions: what writers may write, what code declared, rows by version and
/// the rewrite's progress.
fn shapes(b: &mut String, counts: &tito::schema::ShapeCounts) {
    b.push_str("<h2>Shape versions</h2><div id=\"shapes\">");
    match &counts.shapes {
        Some(shapes) => {
            let seen: Vec<String> = shapes.seen.keys().map(u32::to_string).collect();
            let _ = write!(
                b,
                "<p>Writers may write version <b data-figure=\"writable\">{}</b>; versions declared by code: {}</p>",
                shapes.writable(),
                if seen.is_empty() {
                    "none recorded".into()
                } else {
                    seen.join(", ")
                }
            );
        }
        None => b.push_str("<p class=\"muted\">no catalog: no model code has used the table</p>"),
    }
    b.push_str("<table id=\"versions\"><tr><th>version</th><th class=\"num\">rows</th><th>share of the rows counted</th></tr>");
    let counted: u64 = counts.rows.values().sum();
    for (version, rows) in &counts.rows {
        let name = match version {
            0 => "<span class=\"error\">malformed header</span>".to_string(),
            v => v.to_string(),
        };
        let _ = write!(
            b,
            "<tr data-version=\"{version}\"><td>{name}</td><td class=\"num\" data-figure=\"rows\">{rows}</td><td>{}</td></tr>",
            crate::charts::bar(&format!("share-{version}"), *rows, Some(counted), "rows")
        );
    }
    if counts.rows.is_empty() {
        b.push_str("<tr><td colspan=\"3\" class=\"muted\">no rows</td></tr>");
    }
    b.push_str("</table>");
    if counts.more {
        b.push_str("<p class=\"muted\">counted over the first 10,000 rows</p>");
    }
    if let Some(rewrite) = &counts.rewrite {
        let of = rewrite
            .rows_estimate
            .map_or(String::new(), |e| format!(" of about {e}"));
        let _ = write!(
            b,
            "<p id=\"rewrite\">Rewrite to version {}: <span data-figure=\"rewrite\">{}</span>, {} rows read{of}, {} rewritten</p><p>{}</p>",
            rewrite.target,
            if rewrite.finished {
                "finished"
            } else {
                "running"
            },
            rewrite.rows_done,
            rewrite.rewritten,
            crate::charts::bar(
                "rewrite-progress",
                if rewrite.finished {
                    rewrite
                        .rows_estimate
                        .unwrap_or(rewrite.rows_done)
                        .max(rewrite.rows_done)
                } else {
                    rewrite.rows_done
                },
                if rewrite.finished {
                    Some(
                        rewrite
                            .rows_estimate
                            .unwrap_or(rewrite.rows_done)
                            .max(rewrite.rows_done),
                    )
                } else {
                    rewrite.rows_estimate
                },
                "rows read"
            ),
        );
        for (what, rows) in [
            (
                "rows no code that ran the rewrite reads",
                &rewrite.unconvertible,
            ),
            ("rows refused in the new shape", &rewrite.refused),
        ] {
            if rows.count == 0 {
                continue;
            }
            let first: Vec<String> = rows
                .first
                .iter()
                .map(|r| {
                    format!(
                        "id <code>{}</code> (version {}): {}",
                        esc(&r.id),
                        r.version,
                        esc(&r.reason)
                    )
                })
                .collect();
            let _ = write!(
                b,
                "<p class=\"late\">{what}: {}: {}</p>",
                rows.count,
                first.join("; ")
            );
        }
    }
    b.push_str("</div>");
}

pub(crate) fn table(data: &TableData, started: Instant) -> String {
    let mut b = String::new();
    b.push_str("<div class=\"cards\">");
    b.push_str(&card("rows", &count(&data.rows), "rows"));
    b.push_str(&card(
        "schema version",
        &data.schema.version.to_string(),
        "version",
    ));
    b.push_str(&card(
        "indexes",
        &data.schema.indexes.len().to_string(),
        "indexes",
    ));
    b.push_str("</div>");
    b.push_str("<h2>Indexes</h2><table id=\"indexes\"><tr><th>index</th><th>definition</th><th>state</th><th class=\"num\">since</th><th>progress</th></tr>");
    if data.schema.indexes.is_empty() {
        b.push_str("<tr><td colspan=\"5\" class=\"muted\">no catalog or no index</td></tr>");
    }
    for index in &data.schema.indexes {
        let state = index.state.to_string();
        let _ = write!(
            b,
            "<tr data-index=\"{n}\"><td><code>{n}</code></td><td><code>{}</code></td><td><span class=\"state {state}\" data-figure=\"state\">{state}</span></td><td class=\"num\">{}</td><td>{}</td></tr>",
            esc(&index.definition.to_string()),
            index.since,
            index.progress.as_ref().map_or("—".into(), |p| {
                let bar = crate::charts::bar(
                    &format!("progress-{}", esc(&index.name)),
                    p.rows_done,
                    p.rows_estimate,
                    "rows",
                );
                match &p.failure {
                    Some(failure) => format!(
                        "{bar} <span class=\"late\">stopped: {}</span>",
                        esc(failure)
                    ),
                    None if p.rows_finished => {
                        format!("{bar} <span class=\"muted\">rows done; deleting leftovers</span>")
                    }
                    None => bar,
                }
            }),
            n = esc(&index.name),
        );
    }
    b.push_str("</table>");
    shapes(&mut b, &data.shapes);
    b.push_str("<h2>Last audit</h2>");
    match &data.last_audit {
        None => b.push_str("<p class=\"muted\" id=\"audit\">never audited</p>"),
        Some(report) => {
            let found: u64 = report.findings.values().map(|f| f.count).sum();
            let _ = write!(
                b,
                "<p id=\"audit\">{} {} rows, {} keys: {}</p>",
                if report.repair { "Repair:" } else { "Audit:" },
                report.rows,
                report.keys,
                if !report.finished {
                    "<span class=\"late\">unfinished</span>".to_string()
                } else if report.is_clean() {
                    "<span class=\"ok\" data-figure=\"audit\">clean</span>".to_string()
                } else {
                    format!("<span class=\"late\" data-figure=\"audit\">{found} findings</span>")
                }
            );
            for (kind, finding) in &report.findings {
                if finding.count > 0 {
                    let first: Vec<String> = finding
                        .first
                        .iter()
                        .map(|k| format!("<code>{}</code>", esc(k)))
                        .collect();
                    let _ = write!(
                        b,
                        "<p>{kind:?}: {} — {}</p>",
                        finding.count,
                        first.join(", ")
                    );
                }
            }
        }
    }
    if data.can_audit {
        let _ = write!(
            b,
            "<form method=\"post\" action=\"audit\"><input type=\"hidden\" name=\"table\" value=\"{}\"><button type=\"submit\">Start an audit…</button></form>",
            esc(&data.table)
        );
    }
    b.push_str("<h2>Rows</h2><table id=\"rows\"><tr><th>id</th><th>row</th></tr>");
    if data.page.items.is_empty() {
        b.push_str("<tr><td colspan=\"2\" class=\"muted\">none</td></tr>");
    }
    for row in &data.page.items {
        let mut cell = match (&row.value, &row.raw) {
            (Some(value), _) => json_cell(value),
            (None, raw) => format!(
                "<span class=\"error\">not JSON</span><pre>{}</pre>",
                esc(raw.as_deref().unwrap_or(""))
            ),
        };
        // The shape version as stored, where it is not the first (rows are shown as stored).
        match row.version {
            1 => {}
            0 => cell.insert_str(0, "<span class=\"error\">malformed version header</span> "),
            v => cell.insert_str(0, &format!("<span class=\"muted\">shape v{v}</span> ")),
        }
        let _ = write!(
            b,
            "<tr data-row=\"{id}\"><td><code>{id}</code></td><td>{cell}</td></tr>",
            id = esc(row.id.as_deref().unwrap_or(&row.key)),
        );
    }
    b.push_str("</table>");
    if let Some(cursor) = &data.page.cursor {
        let _ = write!(
            b,
            "<div class=\"pager\"><a href=\"table?name={}&cursor={}\">next page →</a></div>",
            q(&data.table),
            q(cursor)
        );
    }
    page(&format!("Table {}", data.table), &b, Some(started))
}

pub(crate) fn kv(data: &KvData, started: Instant) -> String {
    let mut b = String::new();
    b.push_str("<div class=\"cards\">");
    b.push_str(&card(
        "keys (expired ones until swept)",
        &count(&data.keys),
        "keys",
    ));
    b.push_str("</div><table id=\"entries\"><tr><th>key</th><th class=\"num\">version</th><th>expires</th><th>value</th></tr>");
    if data.page.entries.is_empty() {
        b.push_str("<tr><td colspan=\"4\" class=\"muted\">none</td></tr>");
    }
    for entry in &data.page.entries {
        let _ = write!(
            b,
            "<tr data-key=\"{k}\"><td><code>{k}</code></td><td class=\"num\">{}</td><td>{}</td><td>{}</td></tr>",
            entry.version,
            entry.expires_ms.map_or("never".into(), utc_ms),
            json_cell(&entry.value),
            k = esc(&entry.key),
        );
    }
    b.push_str("</table>");
    if let Some(cursor) = &data.page.cursor {
        let _ = write!(
            b,
            "<div class=\"pager\"><a href=\"kv?namespace={}&cursor={}\">next page →</a></div>",
            q(&data.namespace),
            q(cursor)
        );
    }
    page(&format!("Namespace {}", data.namespace), &b, Some(started))
}

/// The workflows and batches, a page of each.
pub(crate) fn graphs(
    workflows: &[tito::queue::graph::WorkflowSummary],
    batches: &[tito::queue::graph::BatchSummary],
    started: Instant,
) -> String {
    let mut b = String::from(
        "<h2>Workflows</h2><table id=\"workflows\"><tr><th>workflow</th><th class=\"num\">steps</th><th>published</th></tr>",
    );
    if workflows.is_empty() {
        b.push_str("<tr><td colspan=\"3\" class=\"muted\">none</td></tr>");
    }
    for w in workflows {
        let _ = write!(
            b,
            "<tr data-workflow=\"{id}\"><td><a href=\"workflow?id={}\"><code>{id}</code></a></td><td class=\"num\">{}</td><td>{}</td></tr>",
            q(&w.id),
            w.steps,
            utc_ms(w.created_ms),
            id = esc(&w.id),
        );
    }
    b.push_str("</table>");
    if let Some(last) = workflows.last().filter(|_| workflows.len() == crate::PAGE) {
        let _ = write!(
            b,
            "<div class=\"pager\"><a href=\"graphs?after_workflow={}\">more workflows →</a></div>",
            q(&last.id)
        );
    }
    b.push_str("<h2>Batches</h2><table id=\"batches\"><tr><th>batch</th><th>state</th><th>opened</th></tr>");
    if batches.is_empty() {
        b.push_str("<tr><td colspan=\"3\" class=\"muted\">none</td></tr>");
    }
    for batch in batches {
        let _ = write!(
            b,
            "<tr data-batch=\"{id}\"><td><a href=\"batch?id={}\"><code>{id}</code></a></td><td>{}</td><td>{}</td></tr>",
            q(&batch.id),
            if batch.closed { "closed" } else { "open" },
            utc_ms(batch.created_ms),
            id = esc(&batch.id),
        );
    }
    b.push_str("</table>");
    if let Some(last) = batches.last().filter(|_| batches.len() == crate::PAGE) {
        let _ = write!(
            b,
            "<div class=\"pager\"><a href=\"graphs?after_batch={}\">more batches →</a></div>",
            q(&last.id)
        );
    }
    page("Workflows and batches", &b, Some(started))
}

/// A step's state as a word (its colour's name) and as a sentence.
fn step_state(state: &tito::queue::InvocationState<serde_json::Value>) -> (&'static str, String) {
    use tito::queue::{Finished, InvocationState};
    match state {
        InvocationState::Waiting { on } => ("waiting", format!("waiting for {}", on.join(", "))),
        InvocationState::Pending { attempt } => ("pending", format!("pending, attempt {attempt}")),
        InvocationState::Finished(Finished::Completed(Some(result))) => {
            ("completed", format!("completed: {result}"))
        }
        InvocationState::Finished(Finished::Completed(None)) => ("completed", "completed".into()),
        InvocationState::Finished(Finished::Cancelled(why)) => {
            ("cancelled", format!("cancelled: {why}"))
        }
        InvocationState::Finished(Finished::Dead { error, attempts }) => {
            ("dead", format!("dead after {attempts} attempts: {error}"))
        }
        _ => ("gone", "gone (past retention)".into()),
    }
}

/// The most steps a workflow's drawing shows (the table below lists them all).
const DRAWN_STEPS: usize = 400;

/// A workflow drawn as an inline SVG (a column per depth, edges from each dependency, each
/// step coloured by its state, its state and result in its title), then a table of its steps.
pub(crate) fn workflow(state: &tito::queue::graph::WorkflowState, started: Instant) -> String {
    let steps = &state.steps;
    let mut b = String::from("<div class=\"cards\">");
    for (what, n) in state.counts() {
        b.push_str(&card(what, &n.to_string(), what));
    }
    b.push_str("</div>");
    if steps.len() <= DRAWN_STEPS {
        let index: std::collections::HashMap<&str, usize> = steps
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.as_str(), i))
            .collect();
        // Depth: 0 without dependencies, else one more than the deepest dependency (steps are
        // stored in the order they were added, which is no topological order: iterate).
        let mut depth = vec![0usize; steps.len()];
        for _ in 0..steps.len() {
            let mut changed = false;
            for (i, s) in steps.iter().enumerate() {
                let d = s
                    .after
                    .iter()
                    .filter_map(|a| index.get(a.as_str()))
                    .map(|&a| depth[a] + 1)
                    .max()
                    .unwrap_or(0);
                if d != depth[i] {
                    depth[i] = d;
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        let mut rows = vec![0usize; steps.len() + 1];
        let mut place = vec![(0usize, 0usize); steps.len()];
        for (i, &d) in depth.iter().enumerate() {
            place[i] = (d, rows[d]);
            rows[d] += 1;
        }
        let (w, h, gap_x, gap_y) = (150, 36, 60, 16);
        let columns = depth.iter().max().map_or(0, |d| d + 1);
        let tallest = rows.iter().copied().max().unwrap_or(0);
        let width = columns * (w + gap_x) + 20;
        let height = tallest * (h + gap_y) + 20;
        let at = |i: usize| (10 + place[i].0 * (w + gap_x), 10 + place[i].1 * (h + gap_y));
        let _ = write!(
            b,
            "<svg id=\"workflow-graph\" role=\"img\" aria-label=\"workflow {} as a graph\" width=\"{width}\" height=\"{height}\" viewBox=\"0 0 {width} {height}\" xmlns=\"http://www.w3.org/2000/svg\">",
            esc(&state.id)
        );
        for (i, s) in steps.iter().enumerate() {
            for a in &s.after {
                if let Some(&d) = index.get(a.as_str()) {
                    let ((x1, y1), (x2, y2)) = (at(d), at(i));
                    let _ = write!(
                        b,
                        "<line class=\"edge\" x1=\"{}\" y1=\"{}\" x2=\"{x2}\" y2=\"{}\" stroke=\"#888\"/>",
                        x1 + w,
                        y1 + h / 2,
                        y2 + h / 2
                    );
                }
            }
        }
        for (i, s) in steps.iter().enumerate() {
            let (class, sentence) = step_state(&s.state);
            let (x, y) = at(i);
            let fill = match class {
                "waiting" => "#e0e0e0",
                "pending" => "#ffe082",
                "completed" => "#a5d6a7",
                "cancelled" => "#bdbdbd",
                "dead" => "#ef9a9a",
                _ => "#f5f5f5",
            };
            let label: String = s.name.chars().take(18).collect();
            let _ = write!(
                b,
                "<g class=\"step {class}\" data-step=\"{name}\" data-state=\"{class}\"><title>{name}: {}</title>\
                 <rect x=\"{x}\" y=\"{y}\" width=\"{w}\" height=\"{h}\" rx=\"6\" fill=\"{fill}\" stroke=\"#555\"/>\
                 <text x=\"{}\" y=\"{}\" font-size=\"12\">{}</text></g>",
                esc(&sentence),
                x + 8,
                y + h / 2 + 4,
                esc(&label),
                name = esc(&s.name),
            );
        }
        b.push_str("</svg>");
    } else {
        let _ = write!(
            b,
            "<p class=\"muted\">{} steps: too many to draw ({DRAWN_STEPS} at most); the table lists them.</p>",
            steps.len()
        );
    }
    b.push_str("<table id=\"steps\"><tr><th>step</th><th>queue</th><th>event id</th><th>after</th><th>on failure</th><th>state</th></tr>");
    for s in steps {
        let (class, sentence) = step_state(&s.state);
        let _ = write!(
            b,
            "<tr data-step=\"{}\" data-state=\"{class}\"><td>{}</td><td>{}</td><td><code>{}</code></td><td>{}</td><td>{:?}</td><td class=\"{}\">{}</td></tr>",
            esc(&s.name),
            esc(&s.name),
            esc(&s.queue),
            esc(&s.event_id),
            esc(&s.after.join(", ")),
            s.on_failure,
            if class == "dead" { "error" } else { "" },
            esc(&sentence),
        );
    }
    b.push_str("</table>");
    page(&format!("Workflow {}", state.id), &b, Some(started))
}

/// A batch: its counts and callbacks.
pub(crate) fn batch(state: &tito::queue::graph::BatchState, started: Instant) -> String {
    let c = state.counts;
    let mut b = String::from("<div class=\"cards\">");
    for (label, value, id) in [
        ("added", c.added, "added"),
        ("open", c.open(), "open"),
        ("completed", c.completed, "completed"),
        ("cancelled", c.cancelled, "cancelled"),
        ("dead", c.dead, "dead"),
    ] {
        b.push_str(&card(label, &value.to_string(), id));
    }
    b.push_str("</div>");
    let _ = write!(
        b,
        "<p>{}, opened {}</p><table id=\"callbacks\"><tr><th>callback</th><th>fired</th></tr>",
        if state.closed {
            "closed"
        } else {
            "open (children may still be added)"
        },
        utc_ms(state.created_ms)
    );
    if state.callbacks.is_empty() {
        b.push_str("<tr><td colspan=\"2\" class=\"muted\">none</td></tr>");
    }
    for (kind, fired) in &state.callbacks {
        let _ = write!(
            b,
            "<tr data-callback=\"{kind:?}\"><td>{kind:?}</td><td>{}</td></tr>",
            if *fired { "fired" } else { "not fired" }
        );
    }
    b.push_str("</table>");
    page(&format!("Batch {}", state.id), &b, Some(started))
}

fn actions_table(actions: &[ActionRecord]) -> String {
    let mut b = String::from(
        "<table id=\"actions\"><tr><th>when</th><th>peer</th><th>action</th><th>target</th><th>result</th></tr>",
    );
    if actions.is_empty() {
        b.push_str("<tr><td colspan=\"5\" class=\"muted\">none yet</td></tr>");
    }
    for a in actions {
        let _ = write!(
            b,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            utc_ms(a.at_ms.max(0) as u64),
            esc(a.peer.as_deref().unwrap_or("?")),
            esc(&a.action),
            esc(&a.target),
            esc(&a.result)
        );
    }
    b.push_str("</table>");
    b
}

/// The dead invocations of a queue, each with its retry and discard forms.
fn dead_table(dead: &[tito::queue::DeadInvocation], topic: Option<&str>) -> String {
    let mut b = String::from("<h2 id=\"dead\">Dead</h2>");
    if dead.is_empty() {
        b.push_str("<p class=\"muted\">none</p>");
        return b;
    }
    b.push_str("<table id=\"dead-rows\"><tr><th>event id</th><th>key</th><th class=\"num\">attempts</th><th>last error</th><th>died</th><th>payload</th><th></th></tr>");
    let hidden = |id: &str| {
        format!(
            "<input type=\"hidden\" name=\"topic\" value=\"{}\"><input type=\"hidden\" name=\"id\" value=\"{}\">",
            esc(topic.unwrap_or("")),
            esc(id)
        )
    };
    for d in dead {
        let payload = d.payload.to_string();
        let _ = write!(
            b,
            "<tr data-dead=\"{id}\"><td><code>{id}</code></td><td><code>{}</code></td><td class=\"num\">{}</td><td class=\"error\">{}</td><td>{}</td><td><code>{}</code></td>\
             <td><form method=\"post\" action=\"dead-retry\">{h}<button type=\"submit\">Retry…</button></form> \
             <form method=\"post\" action=\"dead-discard\">{h}<button class=\"danger\" type=\"submit\">Discard…</button></form></td></tr>",
            esc(&d.key),
            d.attempts,
            esc(&d.error),
            if d.dead_at_ms == 0 {
                "—".into()
            } else {
                utc_ms(d.dead_at_ms)
            },
            esc(&payload),
            id = esc(&d.id),
            h = hidden(&d.id),
        );
    }
    b.push_str("</table>");
    b
}

pub(crate) fn backup(status: &crate::BackupStatus) -> String {
    let mut b = String::new();
    let Some(dir) = &status.directory else {
        b.push_str(
            "<p>Backups are not enabled: the application sets their directory with \
             <code>Admin::backups</code>.</p>",
        );
        return page("Backup", &b, None);
    };
    let _ = write!(
        b,
        "<p>Each backup is a consistent copy of the store as of one moment, written while the \
         application runs, into a new directory under <code>{}</code>. Restore by opening it \
         as an embedded store, or copy it into another engine with <code>tito store copy</code>.</p>",
        esc(dir)
    );
    let run_row = |b: &mut String, label: &str, run: &crate::BackupRun| {
        let _ = write!(
            b,
            "<tr><th scope=\"row\">{}</th><td>{}</td><td>{}</td><td data-figure=\"backup-keys\">{}</td><td>{}</td></tr>",
            esc(label),
            esc(&run.path),
            utc_ms(run.started_at_ms.max(0) as u64),
            run.keys,
            esc(run.result.as_deref().unwrap_or("running")),
        );
    };
    b.push_str(
        "<table><tr><th></th><th>directory</th><th>started</th><th>keys</th><th>result</th></tr>",
    );
    if let Some(run) = &status.running {
        run_row(&mut b, "running", run);
    }
    if let Some(run) = &status.last {
        run_row(&mut b, "last", run);
    }
    b.push_str("</table>");
    if status.running.is_none() {
        b.push_str(
            "<form method=\"post\" action=\"backup\"><button type=\"submit\" id=\"backup\">Back up now</button></form>",
        );
    }
    page("Backup", &b, None)
}

pub(crate) fn actions(actions: &[ActionRecord]) -> String {
    page("Actions", &actions_table(actions), None)
}

pub(crate) fn confirm(
    title: &str,
    question: &str,
    action: &str,
    fields: &[(&str, String)],
) -> String {
    let mut hidden = String::new();
    for (name, value) in fields {
        let _ = write!(
            hidden,
            "<input type=\"hidden\" name=\"{name}\" value=\"{}\">",
            esc(value)
        );
    }
    let body = format!(
        "<p>{}</p><form method=\"post\" action=\"{}\">{hidden}<input type=\"hidden\" name=\"confirm\" value=\"yes\">\
         <button class=\"danger\" type=\"submit\" id=\"confirm\">Yes, do it</button> <a href=\"{home}\">cancel</a></form>",
        esc(question),
        esc(action),
        home = esc(&home(
            &BASE.try_with(Clone::clone).unwrap_or_else(|_| "/".into())
        )),
    );
    page(title, &body, None)
}

/// The page after one batch of a long action: what it did, and, while work is left, a form that
/// posts the next batch (`fields` already confirmed).
pub(crate) fn batch_done(
    title: &str,
    message: &str,
    next: Option<(&[(&str, String)], &str)>,
) -> String {
    let mut body = format!("<p id=\"result\">{}</p>", esc(message));
    if let Some((fields, button)) = next {
        body.push_str("<form method=\"post\" action=\"queue-action\" id=\"continue\">");
        for (name, value) in fields {
            let _ = write!(
                body,
                "<input type=\"hidden\" name=\"{name}\" value=\"{}\">",
                esc(value)
            );
        }
        let _ = write!(
            body,
            "<button type=\"submit\">{}</button></form>",
            esc(button)
        );
    }
    body.push_str("<p><a href=\"actions\">all actions</a></p>");
    page(title, &body, None)
}

pub(crate) fn done(title: &str, message: &str) -> String {
    page(
        title,
        &format!(
            "<p id=\"result\">{}</p><p><a href=\"actions\">all actions</a></p>",
            esc(message)
        ),
        None,
    )
}

/// A queue's name in a listing: its topic, or (the queue without a topic) "no topic" in italics,
/// which no topic's cell looks like.
fn queue_cell(topic: Option<&str>) -> String {
    match topic {
        Some(topic) => esc(topic),
        None => "<em>no topic</em>".to_string(),
    }
}

/// A queue's last hour as charts, or one partition's; the page reloads itself every `refresh`
/// seconds (never with 0).
pub(crate) fn charts(data: &ChartsData, started: Instant) -> String {
    let o = &data.overview;
    let topic = o.info.topic.as_deref();
    let tq = topic_query(topic);
    let mut b = String::new();
    let refresh = if data.refresh == 0 {
        format!(
            "This page does not refresh itself. <a href=\"{}\">Refresh every {} s</a>",
            esc(&charts_href(
                topic,
                data.partition,
                Some(crate::CHARTS_REFRESH)
            )),
            crate::CHARTS_REFRESH,
        )
    } else {
        format!(
            "This page refreshes itself every <span id=\"refresh\">{}</span> s. <a href=\"{}\">Stop refreshing</a>",
            data.refresh,
            esc(&charts_href(topic, data.partition, Some(0))),
        )
    };
    let _ = write!(
        b,
        "<p><a href=\"queue?{tq}\">The queue's page</a>{} · {refresh}</p>",
        if data.partition.is_some() {
            format!(
                " · <a href=\"{}\">all partitions</a>",
                esc(&charts_href(topic, None, None))
            )
        } else {
            String::new()
        }
    );
    let (hour, scope) = match data.partition {
        Some(p) => (o.hour_of(Some(p)), format!("partition {p}")),
        None => (o.hour.clone(), "every partition".to_string()),
    };
    let workers = o.workers.iter().filter(|w| w.running(o.now_ms)).count();
    let _ = write!(
        b,
        "<p class=\"muted\">The last {} minutes of {scope}, from the reports of the workers that ran it (each writes one every {} s; {workers} running now). The current minute is partial.</p>",
        hour.len(),
        tito::queue::REPORT_EVERY.as_secs(),
    );
    b.push_str("<div class=\"charts\">");
    let partitions = match data.partition {
        Some(_) => 1,
        None => o.info.partitions.unwrap_or(0),
    };
    b.push_str(&crate::charts::hour_charts(&hour, partitions));
    b.push_str("</div>");
    if data.partition.is_none() && !o.partition_hours.is_empty() {
        b.push_str("<h2>Partitions, last hour</h2><table id=\"partition-hours\"><tr><th class=\"num\">partition</th><th>handled per minute</th><th class=\"num\">handled</th><th class=\"num\">failed</th><th class=\"num\">mean</th><th class=\"num\">longest</th><th class=\"num\">latest start</th><th class=\"num\">due now</th><th>held by</th></tr>");
        for p in &o.partition_hours {
            let t = &p.total;
            let holder = o
                .partitions
                .iter()
                .find(|v| v.partition == p.partition)
                .and_then(|v| v.lease.as_ref())
                .map_or("<span class=\"muted\">nobody</span>".to_string(), |l| {
                    if l.ran_out(o.now_ms) {
                        format!(
                            "<span class=\"muted\">nobody (the lease of <code>{}</code> ran out)</span>",
                            esc(&l.holder)
                        )
                    } else {
                        format!("<code>{}</code>", esc(&l.holder))
                    }
                });
            let _ = write!(
                b,
                "<tr data-partition=\"{n}\"><td class=\"num\"><a href=\"{href}\">{n}</a></td><td><a href=\"{href}\">{spark}</a></td>\
                 <td class=\"num\" data-figure=\"handled\">{handled}</td><td class=\"num{fail_class}\" data-figure=\"failed\">{failed}</td><td class=\"num\">{mean}</td><td class=\"num\">{longest}</td>\
                 <td class=\"num\">{late}</td><td class=\"num\" data-figure=\"due\">{due}</td><td>{holder}</td></tr>",
                n = p.partition,
                href = esc(&charts_href(topic, Some(p.partition), None)),
                spark = crate::charts::sparkline(
                    &p.handled,
                    &format!("partition {}: handled per minute", p.partition)
                ),
                handled = t.handled(),
                failed = t.failed,
                fail_class = if t.failed > 0 { " warn" } else { "" },
                mean = t.mean_ms().map_or("—".into(), |ms| format!("{ms} ms")),
                longest = if t.runs > 0 {
                    format!("{} ms", t.max_ms)
                } else {
                    "—".into()
                },
                late = if t.runs > 0 {
                    crate::charts::Unit::Millis.format(t.late_max_ms as f64)
                } else {
                    "—".into()
                },
                due = t.due.map_or("—".into(), |d| format!(
                    "{d}{}",
                    if t.due_more { "+" } else { "" }
                )),
            );
        }
        b.push_str("</table>");
    }
    let title = match data.partition {
        Some(p) => format!("Queue {} · partition {p} · last hour", o.info.label),
        None => format!("Queue {} · last hour", o.info.label),
    };
    let head = if data.refresh == 0 {
        String::new()
    } else {
        format!("<meta http-equiv=\"refresh\" content=\"{}\">", data.refresh)
    };
    page_with(&title, &b, Some(started), &head)
}
