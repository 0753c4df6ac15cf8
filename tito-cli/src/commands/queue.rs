//! `tito queue`: queues, their partitions and rows, rows set aside.

use tito::TitoEngine;
use tito::inspect::{self, QueueState};

use crate::cli::QueueCommand;
use crate::rerun::{Rerun, quote};
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

/// The queue a command works on.
struct Target {
    /// Its topic (`None`: the queue without a topic).
    topic: Option<String>,
    /// What `--topic` takes to name it: its topic; for the queue without a topic `default`, or
    /// `''` (no topic is empty) when a queue's topic is `default`.
    arg: String,
}

impl Target {
    fn new(topic: Option<String>, queues: &[inspect::QueueInfo]) -> Self {
        let arg = match &topic {
            Some(topic) => topic.clone(),
            None if names_default(queues) => String::new(),
            None => "default".to_string(),
        };
        Target { topic, arg }
    }

    /// Its name in text, as `--topic` takes it (quoted for a shell when it must be).
    fn label(&self) -> String {
        quote(&self.arg)
    }
}

/// Whether a queue of the store has the topic `default` (then `--topic default` names it, and
/// the queue without a topic is `--topic ''`).
fn names_default(queues: &[inspect::QueueInfo]) -> bool {
    queues.iter().any(|q| q.topic.as_deref() == Some("default"))
}

/// The store's queues as `--topic` names them: `default, 'two words', mail`.
fn queue_names(queues: &[inspect::QueueInfo]) -> String {
    let names: Vec<String> = queues
        .iter()
        .map(|q| Target::new(q.topic.clone(), queues).label())
        .collect();
    names.join(", ")
}

/// The queue a command works on: `--topic` when given (`''` names the queue without a topic,
/// and so does `default` unless a queue has that topic); without it, the store's only queue. A
/// store with several queues and no `--topic` is answered with their names, never silently
/// about the default queue.
async fn which<E: TitoEngine>(db: &E, topic: Option<String>) -> Result<Target, Failure> {
    let queues = inspect::queues(db, 1000).await?;
    let without = if names_default(&queues) {
        "--topic ''"
    } else {
        "--topic default"
    };
    let resolved = match topic {
        Some(t) if t.is_empty() => None,
        Some(t) if t == "default" && !names_default(&queues) => None,
        Some(t) => Some(t),
        None => match queues.as_slice() {
            [] => return Err(Failure("this store has no queue".into())),
            [only] => return Ok(Target::new(only.topic.clone(), &queues)),
            several => {
                return Err(Failure(format!(
                    "this store has {} queues ({}): name one with --topic NAME ({without} for \
                     the queue without a topic)",
                    several.len(),
                    queue_names(&queues)
                )));
            }
        },
    };
    // A mistyped name is not an empty queue: a queue exists once any key lives under its root.
    if !inspect::queue_exists(db, resolved.as_deref()).await? {
        let given = resolved.as_deref().unwrap_or("");
        return Err(Failure(format!(
            "no queue {given:?} in this store ({})",
            if queues.is_empty() {
                "it has none".to_string()
            } else {
                format!("its queues: {}", queue_names(&queues))
            }
        )));
    }
    Ok(Target::new(resolved, &queues))
}

/// Runs one `tito queue` command.
pub(crate) async fn run<E: TitoEngine>(
    db: E,
    mut command: QueueCommand,
    json: bool,
    rerun: &Rerun,
) -> Outcome {
    let mut target = Target {
        topic: None,
        arg: String::new(),
    };
    if let Some(topic) = topic_of(&mut command) {
        target = which(&db, topic.take()).await?;
        *topic = target.topic.clone();
    }
    let label = target.label();
    let name = target.arg.clone();
    // A command line on this queue, as a person can run it.
    let line = |command: &[&str], options: &[&str], positionals: &[&str]| {
        let mut all = vec!["--topic", target.arg.as_str()];
        all.extend_from_slice(options);
        rerun.line(command, &all, positionals)
    };
    // What an action that changed nothing says: on stderr, with a non-zero exit status.
    let nothing = |what: String| Err(Failure(format!("queue {label}: {what}")));
    match command {
        QueueCommand::Ls => {
            let queues = inspect::queues(&db, 1000).await?;
            print(json, &queues, || {
                let mut out = format!("{:<32} {:>10}", "QUEUE", "PARTITIONS");
                for q in &queues {
                    let parts = q.partitions.map_or("?".into(), |p| p.to_string());
                    let name = Target::new(q.topic.clone(), &queues).label();
                    out.push_str(&format!("\n{name:<32} {parts:>10}"));
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
            print(json, &o, || stats_text(&o, &label))
        }
        QueueCommand::Peek {
            topic,
            partition,
            completed,
            limit,
            cursor,
        } => {
            // A partition the queue does not have is refused by the scan, naming the queue.
            let state = if completed {
                QueueState::Completed
            } else {
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
                let set_aside =
                    |key: &str| line(&["queue", "set-aside"], &["--why", "undecodable"], &[key]);
                let (partition, limit) = (partition.to_string(), limit.to_string());
                let next = |cursor: &str| {
                    let mut options = vec!["--limit", &limit, "--cursor", cursor];
                    if completed {
                        options.push("--completed");
                    } else {
                        options.extend_from_slice(&["--partition", &partition]);
                    }
                    line(&["queue", "peek"], &options, &[])
                };
                format!(
                    "queue {label}, {what}:\n{}",
                    peek_text(&page, &set_aside, &next)
                )
            })
        }
        QueueCommand::SetAside { topic, key, why } => {
            let moved = tito::queue::set_aside(&db, topic.as_deref(), &key, &why).await?;
            if !moved {
                return nothing(format!("{key}: not pending (nothing moved)"));
            }
            print(
                json,
                &serde_json::json!({ "queue": name, "key": key, "set_aside": moved }),
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
                let hints = |id: &str| {
                    (
                        line(&["queue", "retry-dead"], &[], &[id]),
                        line(&["queue", "discard-dead"], &["--yes"], &[id]),
                    )
                };
                let next = |after: &str| line(&["queue", "dead"], &["--after", after], &[]);
                format!("queue {label}: {}", dead_text(&dead, limit, &hints, &next))
            })
        }
        QueueCommand::RetryDead { topic, id } => {
            let moved = tito::queue::retry_dead(&db, topic.as_deref(), &id).await?;
            if !moved {
                return nothing(format!(
                    "{id}: not dead (nothing moved; `{}` lists the dead)",
                    line(&["queue", "dead"], &[], &[])
                ));
            }
            print(
                json,
                &serde_json::json!({ "queue": name, "id": id, "retried": moved }),
                || format!("queue {label}: {id}: pending again (attempt 1, due now)"),
            )
        }
        QueueCommand::DiscardDead { topic, id, yes } => {
            if !yes {
                return Err(Failure(format!(
                    "queue {label}: discarding dead invocation {id:?} deletes it for good; run \
                     again with --yes: {}",
                    line(&["queue", "discard-dead"], &["--yes"], &[&id])
                )));
            }
            let deleted = tito::queue::discard_dead(&db, topic.as_deref(), &id).await?;
            if !deleted {
                return nothing(format!(
                    "{id}: not dead (nothing deleted; `{}` lists the dead)",
                    line(&["queue", "dead"], &[], &[])
                ));
            }
            print(
                json,
                &serde_json::json!({ "queue": name, "id": id, "discarded": deleted }),
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
                &serde_json::json!({ "queue": name, "id": id, "cancelled": cancelled }),
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
                &serde_json::json!({ "queue": name, "owner": who, "cancelled": cancelled }),
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
                &serde_json::json!({ "queue": name, "partition": partition, "paused": paused }),
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
                &serde_json::json!({ "queue": name, "partition": partition, "resumed": resumed }),
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
                let limit = limit.to_string();
                let next = |cursor: &str| {
                    line(
                        &["queue", "aside"],
                        &["--limit", &limit, "--cursor", cursor],
                        &[],
                    )
                };
                format!(
                    "queue {label}, rows set aside:\n{}",
                    aside_text(&page, &next)
                )
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
            "rate {r}: {} in the current interval",
            usage.recent_starts
        ));
    }
    if let Some(r) = &l.key_rate {
        lines.push(format!("per-key rate {r}"));
    }
    lines.join("\n")
}

/// `queue stats` as text: the totals, then one line per partition.
fn scope(partition: Option<u32>) -> String {
    partition.map_or("the queue".to_string(), |p| format!("partition {p}"))
}

fn stats_text(o: &inspect::QueueOverview, label: &str) -> String {
    let now_s = o.now_ms / 1000;
    let mut out = format!(
        "queue {label}: {} due now, {} due later, {} completed kept, {} dead",
        o.due_now, o.future, o.completed, o.dead
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
    let hour = inspect::HourMinute::sum_of(&o.hour);
    out.push_str(&format!(
        "\nthe last hour: {} runs, {} failed{}",
        hour.runs,
        hour.failed,
        match (hour.mean_ms(), hour.mean_late_ms()) {
            (Some(mean), Some(late)) => format!(
                ", mean {mean} ms, longest {} ms; started {late} ms late on average, at most {} ms",
                hour.max_ms, hour.late_max_ms
            ),
            _ => String::new(),
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
            w.state_note(o.now_ms),
            f.runs,
            f.failed,
        ));
    }
    out.push_str(&format!(
        "\n{:>9} {:>10} {:>10} {:>8} {:>8} {:>9}  {}",
        "PARTITION", "DUE NOW", "LATER", "LATE S", "RUNS 1H", "FAILED 1H", "LEASE"
    ));
    for p in &o.partitions {
        let lease = p.lease.as_ref().map_or("free".to_string(), |l| {
            if l.ran_out(o.now_ms) {
                format!("free (the lease of {} ran out)", l.holder)
            } else {
                l.holder.clone()
            }
        });
        let hour = o
            .partition_hours
            .iter()
            .find(|h| h.partition == p.partition)
            .map(|h| (h.total.runs, h.total.failed))
            .unwrap_or_default();
        out.push_str(&format!(
            "\n{:>9} {:>10} {:>10} {:>8} {:>8} {:>9}  {lease}",
            p.partition,
            p.due_now.to_string(),
            p.future.to_string(),
            if p.due_now.value > 0 {
                p.oldest_late_s
            } else {
                0
            },
            hour.0,
            hour.1,
        ));
    }
    out
}

/// `queue peek` as text: one line per row, undecodable and malformed rows marked.
fn peek_text(
    page: &tito::model::TitoPage<inspect::QueueRow>,
    set_aside: &dyn Fn(&str) -> String,
    next: &dyn Fn(&str) -> String,
) -> String {
    let mut out = String::new();
    for row in &page.items {
        if let Some(note) = &row.undecodable {
            out.push_str(&format!(
                "{}  UNDECODABLE as {}: {}\n  set it aside: {}\n",
                row.key,
                note.type_name,
                note.error,
                set_aside(&row.key)
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
    out.push_str(&cursor_line(&page.cursor, next));
    out
}

/// `queue dead` as text: one block per dead invocation with the lines that retry and discard
/// it, then how to continue.
fn dead_text(
    dead: &[tito::queue::DeadInvocation],
    limit: usize,
    hints: &dyn Fn(&str) -> (String, String),
    next: &dyn Fn(&str) -> String,
) -> String {
    if dead.is_empty() {
        return "no dead invocations".into();
    }
    let mut out = format!(
        "{} dead invocation{}{}\n",
        dead.len(),
        if dead.len() == 1 { "" } else { "s" },
        if dead.len() == limit {
            " on this page"
        } else {
            ""
        }
    );
    for d in dead {
        let (retry, discard) = hints(&d.id);
        out.push_str(&format!(
            "{}  key {}  {} attempts  died {}\n  error: {}\n  payload: {}\n  retry: {retry}\n  \
             discard: {discard}\n",
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
        out.push_str(&format!("next page: {}\n", next(&last.id)));
    }
    out.trim_end().to_string()
}

/// `queue aside` as text: one line per row set aside.
fn aside_text(
    page: &tito::model::TitoPage<inspect::AsideRow>,
    next: &dyn Fn(&str) -> String,
) -> String {
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
    out.push_str(&cursor_line(&page.cursor, next));
    out
}
