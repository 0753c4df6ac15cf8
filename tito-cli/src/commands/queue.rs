//! `tito queue`: queues, their partitions and rows, rows set aside.

use tito::TitoEngine;
use tito::inspect::{self, QueueState};

use crate::cli::QueueCommand;
use crate::{Failure, Outcome, cursor_line, print};

/// Runs one `tito queue` command.
pub(crate) async fn run<E: TitoEngine>(db: E, command: QueueCommand, json: bool) -> Outcome {
    match command {
        QueueCommand::Ls => {
            let queues = inspect::queues(&db, 1000).await?;
            print(json, &queues, || {
                let mut out = format!("{:<32} {:>10}", "QUEUE", "PARTITIONS");
                for q in &queues {
                    let parts = q.partitions.map_or("?".into(), |p| p.to_string());
                    out.push_str(&format!("\n{:<32} {:>10}", q.label, parts));
                }
                out
            })
        }
        QueueCommand::Stats { topic } => {
            let o = inspect::queue_overview(&db, topic.as_deref()).await?;
            if o.info.partitions.is_none() {
                return Err(Failure(format!(
                    "no queue {:?} in this store",
                    o.info.label
                )));
            }
            print(json, &o, || stats_text(&o))
        }
        QueueCommand::Peek {
            topic,
            partition,
            completed,
            limit,
            cursor,
        } => {
            let state = if completed {
                QueueState::Completed
            } else {
                QueueState::Pending(partition)
            };
            let page =
                inspect::queue_scan(&db, topic.as_deref(), state, cursor.as_deref(), limit).await?;
            print(json, &page, || peek_text(&page))
        }
        QueueCommand::SetAside { topic, key, why } => {
            let moved = tito::queue::set_aside(&db, topic.as_deref(), &key, &why).await?;
            print(
                json,
                &serde_json::json!({ "key": key, "set_aside": moved }),
                || {
                    if moved {
                        format!("{key}: set aside")
                    } else {
                        format!("{key}: not pending (nothing moved)")
                    }
                },
            )
        }
        QueueCommand::Dead {
            topic,
            limit,
            after,
        } => {
            let dead = tito::queue::dead(&db, topic.as_deref(), after.as_deref(), limit).await?;
            print(json, &dead, || dead_text(&dead, limit))
        }
        QueueCommand::RetryDead { topic, id } => {
            let moved = tito::queue::retry_dead(&db, topic.as_deref(), &id).await?;
            print(
                json,
                &serde_json::json!({ "id": id, "retried": moved }),
                || {
                    if moved {
                        format!("{id}: pending again (attempt 1, due now)")
                    } else {
                        format!("{id}: not dead (nothing moved)")
                    }
                },
            )
        }
        QueueCommand::DiscardDead { topic, id, yes } => {
            if !yes {
                return Err(Failure(format!(
                    "discarding dead invocation {id:?} deletes it for good; run again with --yes"
                )));
            }
            let deleted = tito::queue::discard_dead(&db, topic.as_deref(), &id).await?;
            print(
                json,
                &serde_json::json!({ "id": id, "discarded": deleted }),
                || {
                    if deleted {
                        format!("{id}: discarded")
                    } else {
                        format!("{id}: not dead (nothing deleted)")
                    }
                },
            )
        }
        QueueCommand::Cancel { topic, id, why } => {
            let cancelled = tito::queue::cancel(&db, topic.as_deref(), &id, &why).await?;
            print(
                json,
                &serde_json::json!({ "id": id, "cancelled": cancelled }),
                || {
                    if cancelled {
                        format!("{id}: cancelled")
                    } else {
                        format!("{id}: not pending (nothing cancelled)")
                    }
                },
            )
        }
        QueueCommand::CancelOwner {
            topic,
            kind,
            owner,
            why,
        } => {
            let who = tito::QueueOwner::new(kind, owner);
            let cancelled = tito::queue::cancel_owner(&db, topic.as_deref(), &who, &why).await?;
            print(
                json,
                &serde_json::json!({ "owner": who, "cancelled": cancelled }),
                || {
                    format!(
                        "{cancelled} pending invocations of {}/{} cancelled",
                        who.kind, who.id
                    )
                },
            )
        }
        QueueCommand::Schedules { topic } => {
            let schedules = tito::queue::schedules(&db, topic.as_deref()).await?;
            print(json, &schedules, || {
                if schedules.is_empty() {
                    return "no periodic schedule has run on this queue".into();
                }
                schedules
                    .iter()
                    .map(|s| {
                        let at = chrono::DateTime::from_timestamp(s.last_tick, 0)
                            .map_or(s.last_tick.to_string(), |t| t.to_rfc3339());
                        format!("{}  last tick {at}", s.name)
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            })
        }
        QueueCommand::Pause {
            topic,
            partition,
            why,
        } => {
            let paused = tito::queue::pause(&db, topic.as_deref(), partition, &why).await?;
            let what = scope(partition);
            print(
                json,
                &serde_json::json!({ "partition": partition, "paused": paused }),
                || {
                    if paused {
                        format!("{what} paused: workers start nothing there within 0.5 s")
                    } else {
                        format!("{what} was already paused (its first reason is kept)")
                    }
                },
            )
        }
        QueueCommand::Limits {
            topic,
            concurrency,
            key_concurrency,
            rate,
            key_rate,
            none,
        } => {
            let setting = none
                || concurrency.is_some()
                || key_concurrency.is_some()
                || rate.is_some()
                || key_rate.is_some();
            if setting {
                let mut limits = tito::queue::Limits::none();
                limits.concurrency = concurrency;
                limits.key_concurrency = key_concurrency;
                limits.rate = rate.as_deref().map(parse_rate).transpose()?;
                limits.key_rate = key_rate.as_deref().map(parse_rate).transpose()?;
                tito::queue::set_limits(&db, topic.as_deref(), limits).await?;
            }
            let usage = tito::queue::limit_usage(&db, topic.as_deref()).await?;
            print(json, &usage, || limits_text(&usage))
        }
        QueueCommand::Resume { topic, partition } => {
            let resumed = tito::queue::resume(&db, topic.as_deref(), partition).await?;
            let what = scope(partition);
            print(
                json,
                &serde_json::json!({ "partition": partition, "resumed": resumed }),
                || {
                    if resumed {
                        format!("{what} resumed")
                    } else {
                        format!("{what} was not paused (nothing changed)")
                    }
                },
            )
        }
        QueueCommand::Aside {
            topic,
            limit,
            cursor,
        } => {
            let page =
                inspect::queue_aside(&db, topic.as_deref(), cursor.as_deref(), limit).await?;
            print(json, &page, || aside_text(&page))
        }
    }
}

/// `STARTS/INTERVAL`, the interval a number with `s`, `m`, `h` or `d`: `100/1m`.
fn parse_rate(text: &str) -> Result<tito::queue::Rate, Failure> {
    let bad = || {
        Failure(format!(
            "{text:?} is not a rate: write STARTS/INTERVAL, such as 100/1m or 5/1s (s, m, h or d)"
        ))
    };
    let (starts, per) = text.split_once('/').ok_or_else(bad)?;
    let starts: u32 = starts.trim().parse().map_err(|_| bad())?;
    let per = per.trim();
    let unit = per.chars().last().ok_or_else(bad)?;
    let amount: u64 = per[..per.len() - unit.len_utf8()]
        .parse()
        .map_err(|_| bad())?;
    let seconds = match unit {
        's' => amount,
        'm' => amount.checked_mul(60).ok_or_else(bad)?,
        'h' => amount.checked_mul(3600).ok_or_else(bad)?,
        'd' => amount.checked_mul(86_400).ok_or_else(bad)?,
        _ => return Err(bad()),
    };
    Ok(tito::queue::Rate::new(
        starts,
        std::time::Duration::from_secs(seconds),
    ))
}

/// A queue's limits and how close it is to them, as text.
pub(crate) fn limits_text(usage: &tito::queue::LimitUsage) -> String {
    let l = &usage.limits;
    if l.is_none() {
        return "no limits".into();
    }
    let rate = |r: &tito::queue::Rate| format!("{} starts per {:?}", r.starts, r.per);
    let mut lines = Vec::new();
    if let Some(n) = l.concurrency {
        lines.push(format!("concurrency {n}: {} running", usage.running));
    }
    if let Some(n) = l.key_concurrency {
        let busiest = usage.running_by_key.values().max().copied().unwrap_or(0);
        lines.push(format!(
            "per key {n}: {} keys running, the busiest with {busiest}",
            usage.running_by_key.len()
        ));
    }
    if let Some(r) = &l.rate {
        lines.push(format!(
            "rate {}: {} in the current interval",
            rate(r),
            usage.recent_starts
        ));
    }
    if let Some(r) = &l.key_rate {
        lines.push(format!("per-key rate {}", rate(r)));
    }
    lines.join("\n")
}

/// `queue stats` as text: the totals, then one line per partition.
fn scope(partition: Option<u32>) -> String {
    partition.map_or("the queue".to_string(), |p| format!("partition {p}"))
}

fn stats_text(o: &inspect::QueueOverview) -> String {
    let now_s = o.now_ms / 1000;
    let mut out = format!(
        "queue {}: {} due now, {} due later, {} completed kept, {} dead",
        o.info.label, o.due_now, o.future, o.completed, o.dead
    );
    if let Some(due) = o.oldest_due.filter(|_| o.due_now.value > 0) {
        out.push_str(&format!(
            "; the oldest due is {} s late",
            now_s.saturating_sub(due)
        ));
    }
    if let Some(pause) = &o.paused.queue {
        out.push_str(&format!("\nPAUSED: {}", pause.why));
    }
    for (partition, pause) in &o.paused.partitions {
        out.push_str(&format!("\npartition {partition} PAUSED: {}", pause.why));
    }
    if !o.limits.limits.is_none() {
        out.push_str(&format!(
            "\nLIMITS: {}",
            limits_text(&o.limits).replace('\n', "; ")
        ));
    }
    let minutes: Vec<String> = o
        .completed_per_minute
        .iter()
        .map(|c| c.to_string())
        .collect();
    out.push_str(&format!(
        "\ncompleted per minute (this minute first): {}",
        minutes.join(" ")
    ));
    if let Some(c) = &o.coordinator {
        out.push_str(&format!(
            "\ncoordinator {c}, members {}",
            o.members.join(",")
        ));
    }
    out.push_str(&format!(
        "\n{:>9} {:>10} {:>10} {:>8}  {}",
        "PARTITION", "DUE NOW", "LATER", "LATE S", "LEASE"
    ));
    for p in &o.partitions {
        let lease = p
            .lease
            .as_ref()
            .map_or("free".to_string(), |l| l.holder.clone());
        out.push_str(&format!(
            "\n{:>9} {:>10} {:>10} {:>8}  {lease}",
            p.partition,
            p.due_now.to_string(),
            p.future.to_string(),
            if p.due_now.value > 0 {
                p.oldest_late_s
            } else {
                0
            },
        ));
    }
    out
}

/// `queue peek` as text: one line per row, undecodable and malformed rows marked.
fn peek_text(page: &tito::model::TitoPage<inspect::QueueRow>) -> String {
    let mut out = String::new();
    for row in &page.items {
        if let Some(note) = &row.undecodable {
            out.push_str(&format!(
                "{}  UNDECODABLE as {}: {} (tito queue set-aside moves it aside)\n",
                row.key, note.type_name, note.error
            ));
        }
        match (&row.event, &row.malformed) {
            (Some(e), None) => out.push_str(&format!(
                "{}  id={} key={} due={} payload={}{}\n",
                row.key,
                e.id,
                e.key,
                e.timestamp,
                e.payload,
                e.cancelled
                    .as_ref()
                    .map_or(String::new(), |why| format!("  CANCELLED: {why}"))
            )),
            _ => out.push_str(&format!(
                "{}  MALFORMED: {} raw={:?}\n",
                row.key,
                row.malformed.as_deref().unwrap_or(""),
                row.raw.as_deref().unwrap_or("")
            )),
        }
    }
    out.push_str(&cursor_line(&page.cursor));
    out
}

/// `queue dead` as text: one block per dead invocation, then how to continue.
fn dead_text(dead: &[tito::queue::DeadInvocation], limit: usize) -> String {
    if dead.is_empty() {
        return "no dead invocations".into();
    }
    let mut out = String::new();
    for d in dead {
        out.push_str(&format!(
            "{}  key {}  {} attempts  died {}
  error: {}
  payload: {}
",
            d.id,
            d.key,
            d.attempts,
            chrono::DateTime::<chrono::Utc>::from_timestamp_millis(d.dead_at_ms as i64)
                .map_or("?".into(), |t| t
                    .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)),
            d.error,
            d.payload
        ));
    }
    if dead.len() == limit
        && let Some(last) = dead.last()
    {
        out.push_str(&format!(
            "next page: --after {}
",
            last.id
        ));
    }
    out.push_str("retry: tito queue retry-dead ID; discard: tito queue discard-dead ID --yes");
    out
}

/// `queue aside` as text: one line per row set aside.
fn aside_text(page: &tito::model::TitoPage<inspect::AsideRow>) -> String {
    let mut out = String::new();
    for row in &page.items {
        match &row.record {
            Some(record) => out.push_str(&format!(
                "{}  why={:?} row={}\n",
                row.key, record.why, record.row
            )),
            None => out.push_str(&format!(
                "{}  MALFORMED raw={:?}\n",
                row.key,
                row.raw.as_deref().unwrap_or("")
            )),
        }
    }
    out.push_str(&cursor_line(&page.cursor));
    out
}
