//! `tito workflow` and `tito batch`: job graphs.

use tito::TitoEngine;
use tito::queue::graph::Graphs;
use tito::queue::{Finished, InvocationState};

use crate::cli::{BatchCommand, WorkflowCommand};
use crate::{Failure, Outcome, print};

/// A step's state in a few words.
fn state_text(state: &InvocationState<serde_json::Value>) -> String {
    match state {
        InvocationState::Waiting { on } => format!("waiting for {}", on.join(", ")),
        InvocationState::Pending { attempt } => format!("pending (attempt {attempt})"),
        InvocationState::Finished(Finished::Completed(Some(result))) => {
            format!("completed: {result}")
        }
        InvocationState::Finished(Finished::Completed(None)) => "completed".into(),
        InvocationState::Finished(Finished::Cancelled(why)) => format!("cancelled: {why}"),
        InvocationState::Finished(Finished::Dead { error, attempts }) => {
            format!("dead after {attempts} attempts: {error}")
        }
        InvocationState::Unknown => "gone (past retention)".into(),
        _ => "unknown state".into(),
    }
}

/// The line that reads the next page, when this one was full.
fn next_page(
    rerun: &crate::rerun::Rerun,
    group: &str,
    last: Option<&str>,
    full: bool,
    limit: usize,
) -> String {
    match last {
        Some(last) if full => {
            let limit = limit.to_string();
            format!(
                "next page: {}",
                rerun.line(&[group, "ls"], &["--limit", &limit, "--after", last], &[])
            )
        }
        _ => "(last page)".into(),
    }
}

/// Runs one `tito workflow` command.
pub(crate) async fn workflow<E: TitoEngine>(
    db: E,
    command: WorkflowCommand,
    json: bool,
    rerun: &crate::rerun::Rerun,
) -> Outcome {
    let graphs = Graphs::new(db);
    match command {
        WorkflowCommand::Ls { limit, after } => {
            let page = graphs.workflows(after.as_deref(), limit).await?;
            print(json, &page, || {
                let mut out = format!("{:<40} {:>6}  {}\n", "WORKFLOW", "STEPS", "PUBLISHED");
                for w in &page {
                    out.push_str(&format!(
                        "{:<40} {:>6}  {}\n",
                        w.id,
                        w.steps,
                        crate::millis_text(w.created_ms)
                    ));
                }
                let last = page.last().map(|w| w.id.as_str());
                out.push_str(&next_page(
                    rerun,
                    "workflow",
                    last,
                    page.len() == limit,
                    limit,
                ));
                out
            })
        }
        WorkflowCommand::Show { id } => {
            let Some(state) = graphs.workflow(&id).await? else {
                return Err(Failure(format!("no workflow {id:?}")));
            };
            print(json, &state, || {
                let counts: Vec<String> = state
                    .counts()
                    .iter()
                    .filter(|(_, n)| *n > 0)
                    .map(|(what, n)| format!("{n} {what}"))
                    .collect();
                let mut out = format!(
                    "workflow {} ({} steps: {})\n",
                    state.id,
                    state.steps.len(),
                    counts.join(", ")
                );
                for step in &state.steps {
                    let after = if step.after.is_empty() {
                        String::new()
                    } else {
                        format!(" after {}", step.after.join(", "))
                    };
                    out.push_str(&format!(
                        "  {} [{} {}]{after}: {}\n",
                        step.name,
                        step.queue,
                        step.event_id,
                        state_text(&step.state)
                    ));
                }
                out.trim_end().to_string()
            })
        }
        WorkflowCommand::Cancel { id, why } => {
            let cancelled = graphs.cancel_workflow(&id, &why).await?;
            print(json, &serde_json::json!({ "cancelled": cancelled }), || {
                format!("cancelled {cancelled} steps of workflow {id}")
            })
        }
    }
}

/// Runs one `tito batch` command.
pub(crate) async fn batch<E: TitoEngine>(
    db: E,
    command: BatchCommand,
    json: bool,
    rerun: &crate::rerun::Rerun,
) -> Outcome {
    let graphs = Graphs::new(db);
    match command {
        BatchCommand::Ls { limit, after } => {
            let page = graphs.batches(after.as_deref(), limit).await?;
            print(json, &page, || {
                let mut out = format!("{:<40} {:<7} {}\n", "BATCH", "STATE", "OPENED");
                for b in &page {
                    out.push_str(&format!(
                        "{:<40} {:<7} {}\n",
                        b.id,
                        if b.closed { "closed" } else { "open" },
                        crate::millis_text(b.created_ms)
                    ));
                }
                let last = page.last().map(|b| b.id.as_str());
                out.push_str(&next_page(rerun, "batch", last, page.len() == limit, limit));
                out
            })
        }
        BatchCommand::Show { id } => {
            let Some(state) = graphs.batch(&id).await? else {
                return Err(Failure(format!("no batch {id:?}")));
            };
            print(json, &state, || {
                let c = state.counts;
                let callbacks: Vec<String> = state
                    .callbacks
                    .iter()
                    .map(|(kind, fired)| {
                        format!("{kind:?}: {}", if *fired { "fired" } else { "not fired" })
                    })
                    .collect();
                format!(
                    "batch {} ({})\n  added {}, open {}, completed {}, cancelled {}, dead {}\n  callbacks: {}",
                    state.id,
                    if state.closed { "closed" } else { "open" },
                    c.added,
                    c.open(),
                    c.completed,
                    c.cancelled,
                    c.dead,
                    if callbacks.is_empty() {
                        "none".to_string()
                    } else {
                        callbacks.join(", ")
                    }
                )
            })
        }
        BatchCommand::Cancel { id, why } => {
            let cancelled = graphs.cancel_batch(&id, &why).await?;
            print(json, &serde_json::json!({ "cancelled": cancelled }), || {
                format!("cancelled {cancelled} children of batch {id}")
            })
        }
    }
}
