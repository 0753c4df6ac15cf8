//! `tito queue`: queues, their partitions and rows, rows set aside.

use tito::TitoEngine;
use tito::inspect::{self, QueueState};

use crate::cli::QueueCommand;
use crate::{Failure, Outcome, cursor_line, print};

/// The `--topic` of a command that works on one queue (every one but `ls`).
fn topic_of(command: &mut QueueCommand) -> Option<&mut Option<String>> {
    use QueueCommand::*;
    match command {
        Ls => None,
        Stats { topic }
        | Peek { topic, .. }
        | SetAside { topic, .. }
        | Dead { topic, .. }
        | RetryDead { topic, .. }
        | DiscardDead { topic, .. }
        | Cancel { topic, .. }
        | CancelOwner { topic, .. }
        | Schedules { topic }
        | Pause { topic, .. }
        | Limits { topic, .. }
        | Resume { topic, .. }
        | Aside { topic, .. } => Some(topic),
    }
}

/// The queue a command works on, as its topic and its label: `--topic` when given (`default`
/// names the queue without a topic, unless a queue has that topic); without it, the store's
/// only queue. A store with several queues and no `--topic` is answered with their names,
/// never silently about the default queue.
async fn which<E: TitoEngine>(
    db: &E,
    topic: Option<String>,
) -> Result<(Option<String>, String), Failure> {
    let queues = inspect::queues(db, 1000).await?;
    let resolved = match topic {
        Some(t)
            if t == "default" && !queues.iter().any(|q| q.topic.as_deref() == Some("default")) =>
        {
            (None, "default".to_string())
        }
        Some(t) => (Some(t.clone()), t),
        None => match queues.as_slice() {
            [] => return Err(Failure("this store has no queue".into())),
            [only] => return Ok((only.topic.clone(), only.label.clone())),
            several => {
                let names: Vec<&str> = several.iter().map(|q| q.label.as_str()).collect();
                return Err(Failure(format!(
                    "this store has {} queues ({}): name one with --topic NAME (--topic default \
                     for the queue without a topic)",
                    several.len(),
                    names.join(", ")
                )));
            }
        },
    };
    // A mistyped name is not an empty queue: a queue exists once any key lives under its root.
    if !inspect::queue_exists(db, resolved.0.as_deref()).await? {
        let names: Vec<&str> = queues.iter().map(|q| q.label.as_str()).collect();
        return Err(Failure(format!(
            "no queue {:?} in this store ({})",
            resolved.1,
            if names.is_empty() {
                "it has none".to_string()
            } else {
                format!("its queues: {}", names.join(", "))
            }
        )));
    }
    Ok(resolved)
}

/// `--topic NAME` for a hint, or nothing for the default queue.
fn topic_flag(topic: &Option<String>, label: &str) -> String {
    match topic {
        Some(_) => format!(" --topic {label}"),
        None => String::new(),
    }
}

/// Runs one `tito queue` command.
pub(crate) async fn run<E: TitoEngine>(db: E, mut command: QueueCommand, json: bool) -> Outcome {
    let mut label = String::new();
    let mut flag = String::new();
    if let Some(topic) = topic_of(&mut command) {
        let (resolved, name) = which(&db, topic.take()).await?;
        flag = topic_flag(&resolved, &name);
        *topic = resolved;
        label = name;
    }
    // What an action that changed nothing says: on stderr, with a non-zero exit status.
    let nothing = |what: String| Err(Failure(format!("queue {label}: {what}")));
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
                let count = inspect::queues(&db, 1000)
                    .await?
                    .into_iter()
                    .find(|q| q.topic == topic)
                    .and_then(|q| q.partitions);
                if let Some(count) = count.filter(|count| partition >= *count) {
                    return Err(Failure(format!(
                        "queue {label} has {count} partition{} (0 to {}): no partition {partition}",
                        if count == 1 { "" } else { "s" },
                        count - 1
                    )));
                }
                QueueState::Pending(partition)
            };
            let page =
                inspect::queue_scan(&db, topic.as_deref(), state, cursor.as_deref(), limit).await?;
            let what = if completed {
                "completed rows, newest first".to_string()
            } else {
                format!("partition {partition}, pending rows in run order")
            };
            print(json, &page, || {
                format!("queue {label}, {what}:\n{}", peek_text(&page, &flag))
            })
        }
        QueueCommand::SetAside { topic, key, why } => {
            let moved = tito::queue::set_aside(&db, topic.as_deref(), &key, &why).await?;
            if !moved {
                return nothing(format!("{key}: not pending (nothing moved)"));
            }
            print(
                json,
                &serde_json::json!({ "queue": label, "key": key, "set_aside": moved }),
                || format!("queue {label}: {key}: set aside"),
            )
        }
        QueueCommand::Dead {
            topic,
            limit,
            after,
        } => {
            let dead = tito::queue::dead(&db, topic.as_deref(), after.as_deref(), limit).await?;
            print(json, &dead, || {
                format!("queue {label}: {}", dead_text(&dead, limit, &flag))
            })
        }
        QueueCommand::RetryDead { topic, id } => {
            let moved = tito::queue::retry_dead(&db, topic.as_deref(), &id).await?;
            if !moved {
                return nothing(format!(
                    "{id}: not dead (nothing moved; `tito queue dead{flag}` lists the dead)"
                ));
            }
            print(
                json,
                &serde_json::json!({ "queue": label, "id": id, "retried": moved }),
                || format!("queue {label}: {id}: pending again (attempt 1, due now)"),
            )
        }
        QueueCommand::DiscardDead { topic, id, yes } => {
            if !yes {
                return Err(Failure(format!(
                    "queue {label}: discarding dead invocation {id:?} deletes it for good; run \
                     again with --yes: tito queue discard-dead {id}{flag} --yes"
                )));
            }
            let deleted = tito::queue::discard_dead(&db, topic.as_deref(), &id).await?;
            if !deleted {
                return nothing(format!(
                    "{id}: not dead (nothing deleted; `tito queue dead{flag}` lists the dead)"
                ));
            }
            print(
                json,
                &serde_json::json!({ "queue": label, "id": id, "discarded": deleted }),
                || format!("queue {label}: {id}: discarded"),
            )
        }
        QueueCommand::Cancel { topic, id, why } => {
            let cancelled = tito::queue::cancel(&db, topic.as_deref(), &id, &why).await?;
            if !cancelled {
                return nothing(format!("{id}: not pending (nothing cancelled)"));
            }
            print(
                json,
                &serde_json::json!({ "queue": label, "id": id, "cancelled": cancelled }),
                || format!("queue {label}: {id}: cancelled"),
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
            if cancelled == 0 {
                return nothing(format!(
                    "no pending invocation of {}/{} (nothing cancelled)",
                    who.kind, who.id
                ));
            }
            print(
                json,
                &serde_json::json!({ "queue": label, "owner": who, "cancelled": cancelled }),
                || {
                    format!(
                        "queue {label}: {cancelled} pending invocations of {}/{} cancelled",
                        who.kind, who.id
                    )
                },
            )
        }
        QueueCommand::Schedules { topic } => {
            let schedules = tito::queue::schedules(&db, topic.as_deref()).await?;
            print(json, &schedules, || {
                if schedules.is_empty() {
                    return format!("queue {label}: no periodic schedule has run on this queue");
                }
                let lines: Vec<String> = schedules
                    .iter()
                    .map(|s| {
                        let at = chrono::DateTime::from_timestamp(s.last_tick, 0)
                            .map_or(s.last_tick.to_string(), |t| t.to_rfc3339());
                        let next = s
                            .next_tick
                            .and_then(|t| chrono::DateTime::from_timestamp(t, 0))
                            .map_or("?".into(), |t| t.to_rfc3339());
                        format!(
                            "{}  {}  last tick {at}  next {next}  written by {}",
                            s.name,
                            s.schedule.as_deref().unwrap_or("?"),
                            s.runner.as_deref().unwrap_or("?")
                        )
                    })
                    .collect();
                format!("queue {label}:\n{}", lines.join("\n"))
            })
        }
        QueueCommand::Pause {
            topic,
            partition,
            why,
        } => {
            let paused = tito::queue::pause(&db, topic.as_deref(), partition, &why).await?;
            let what = scope(partition);
            if !paused {
                return nothing(format!(
                    "{what} was already paused (its first reason is kept; nothing changed)"
                ));
            }
            print(
                json,
                &serde_json::json!({ "queue": label, "partition": partition, "paused": paused }),
                || {
                    format!(
                        "queue {label}: {what} paused: workers start nothing there within 0.5 s"
                    )
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
            print(json, &usage, || {
                format!("queue {label}: {}", limits_text(&usage))
            })
        }
        QueueCommand::Resume { topic, partition } => {
            let resumed = tito::queue::resume(&db, topic.as_deref(), partition).await?;
            let what = scope(partition);
            if !resumed {
                return nothing(format!("{what} was not paused (nothing changed)"));
            }
            print(
                json,
                &serde_json::json!({ "queue": label, "partition": partition, "resumed": resumed }),
                || format!("queue {label}: {what} resumed"),
            )
        }
        QueueCommand::Aside {
            topic,
            limit,
            cursor,
        } => {
            let page =
                inspect::queue_aside(&db, topic.as_deref(), cursor.as_deref(), limit).await?;
            print(json, &page, || {
                format!("queue {label}, rows set aside:\n{}", aside_text(&page))
            })
        }
    }
}

/// `STARTS/INTERVAL`, the interval a number with `s`, `m`, `h` or `d`: `100/1m`.
fn parse_rate(text: &str) -> Result<tito::queue::Rate, Failure> {
    Ok(tito::queue::Rate::parse(text)?)
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
    let h = &o.handlers;
    out.push_str(&format!(
        "\nhandlers in the last {} minutes: {} runs, {} failed{}",
        inspect::THROUGHPUT_MINUTES,
        h.runs,
        h.failed,
        match h.mean_ms() {
            Some(mean) => format!(", mean {mean} ms, longest {} ms", h.max_ms),
            None => String::new(),
        }
    ));
    let since = (o.now_ms / 60_000).saturating_sub(inspect::THROUGHPUT_MINUTES - 1);
    for w in &o.workers {
        let f = w.since(since);
        out.push_str(&format!(
            "\nworker {} ({}): started {} s ago, reported {} s ago{}, {} runs, {} failed",
            w.worker,
            w.runner,
            o.now_ms.saturating_sub(w.started_ms) / 1000,
            o.now_ms.saturating_sub(w.written_ms) / 1000,
            if w.stopped { " (stopped)" } else { "" },
            f.runs,
            f.failed,
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
fn peek_text(page: &tito::model::TitoPage<inspect::QueueRow>, flag: &str) -> String {
    let mut out = String::new();
    for row in &page.items {
        if let Some(note) = &row.undecodable {
            out.push_str(&format!(
                "{}  UNDECODABLE as {}: {} (tito queue set-aside{flag} KEY moves it aside)\n",
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
fn dead_text(dead: &[tito::queue::DeadInvocation], limit: usize, flag: &str) -> String {
    if dead.is_empty() {
        return "no dead invocations".into();
    }
    let mut out = String::from("\n");
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
    out.push_str(&format!(
        "retry: tito queue retry-dead ID{flag}; discard: tito queue discard-dead ID{flag} --yes"
    ));
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
