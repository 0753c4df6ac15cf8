//! `tito index`, `tito audit` and `tito repair`: a table's index catalog, builds and drops
//! with progress, and the audit that checks every row against its indexes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tito::TitoEngine;
use tito::schema::{IndexState, Progress};

use crate::cli::IndexCommand;
use crate::typing::{ModelOps, Typing};
use crate::{Failure, Outcome, bar, print};

/// Runs one `tito index` command.
pub(crate) async fn run<E: TitoEngine>(
    db: E,
    typed: &Typing,
    command: IndexCommand,
    json: bool,
    rerun: &crate::rerun::Rerun,
) -> Outcome {
    match command {
        IndexCommand::Status { table } => {
            let schema = tito::schema::table_schema(&db, &table).await?;
            let audit = tito::schema::last_audit(&db, &table).await?;
            let value = serde_json::json!({ "schema": schema, "last_audit": audit });
            print(json, &value, || {
                let mut out = format!("table {table}: schema version {}", schema.version);
                if schema.indexes.is_empty() {
                    out.push_str("\n(no index in the catalog)");
                }
                for index in &schema.indexes {
                    out.push_str(&format!(
                        "\n{:<28} {:<9} {}{}",
                        index.name,
                        index.state.to_string(),
                        index.definition,
                        index
                            .progress
                            .as_ref()
                            .map_or(String::new(), |p| format!("  [{p}]"))
                    ));
                }
                match &audit {
                    None => out.push_str("\nnever audited"),
                    Some(r) => out.push_str(&format!(
                        "\nlast {}: {} rows, {} keys, {}",
                        if r.repair { "repair" } else { "audit" },
                        r.rows,
                        r.keys,
                        if r.is_clean() { "clean" } else { "findings" }
                    )),
                }
                out
            })
        }
        IndexCommand::Build { table, index } => {
            schema_work(
                typed.model(&table)?,
                &table,
                index,
                IndexState::Building,
                json,
            )
            .await
        }
        IndexCommand::Drop { table, index } => {
            schema_work(
                typed.model(&table)?,
                &table,
                index,
                IndexState::Dropping,
                json,
            )
            .await
        }
        IndexCommand::Restart { table, index } => {
            typed.model(&table)?.restart(index.clone()).await?;
            print(json, &serde_json::json!({ "restarted": index }), || {
                format!(
                    "the build of {table}.{index} starts again from the first row; run: {}",
                    rerun.line(&["index", "build"], &[], &[&table])
                )
            })
        }
    }
}

/// Runs schema steps until none is left, reporting rows on a progress bar.
pub(crate) async fn schema_work(
    model: &Arc<dyn ModelOps>,
    table: &str,
    index: Option<String>,
    wanted: IndexState,
    json: bool,
) -> Outcome {
    let before = model.schema().await?;
    let pending: Vec<_> = before
        .indexes
        .iter()
        .filter(|i| i.state == wanted)
        .filter(|i| index.as_ref().is_none_or(|name| &i.name == name))
        .collect();
    if let Some(name) = &index
        && pending.is_empty()
    {
        return Err(Failure(format!("index {table}.{name} is not {wanted}")));
    }
    let estimate = pending
        .iter()
        .filter_map(|i| i.progress.as_ref()?.rows_estimate)
        .sum::<u64>();
    let progress = bar(
        (estimate > 0).then_some(estimate),
        json,
        format!("{table}: {wanted}"),
    );
    let started = Instant::now();
    let mut handled = 0u64;
    let mut finished = Vec::new();
    loop {
        let step = model.step().await?;
        if step.idle() {
            break;
        }
        if let Some(wait) = step.waiting {
            progress.set_message(format!("{table}: waiting {wait:?} (write grace)"));
            tokio::time::sleep(wait.min(Duration::from_millis(250))).await;
            continue;
        }
        handled += step.handled as u64;
        progress.set_position(handled);
        if step.finished {
            finished.push(format!("{} {}", step.work, step.index.unwrap_or_default()));
        }
    }
    progress.finish_and_clear();
    let after = model.schema().await?;
    let value = serde_json::json!({
        "finished": finished,
        "rows": handled,
        "seconds": started.elapsed().as_secs_f64(),
        "schema": after,
    });
    print(json, &value, || {
        let states: Vec<String> = after
            .indexes
            .iter()
            .map(|i| format!("{} {}", i.name, i.state))
            .collect();
        format!(
            "{table}: {handled} rows in {:.1?}; finished: {}; indexes now: {}",
            started.elapsed(),
            if finished.is_empty() {
                "nothing".into()
            } else {
                finished.join(", ")
            },
            if states.is_empty() {
                "none".into()
            } else {
                states.join(", ")
            }
        )
    })
}

pub(crate) async fn audit(
    model: &Arc<dyn ModelOps>,
    table: &str,
    repair: bool,
    json: bool,
) -> Outcome {
    let what = if repair { "repair" } else { "audit" };
    let progress = bar(None, json, format!("{table}: {what}"));
    let shown = progress.clone();
    let report = model
        .audit(
            repair,
            Box::new(move |p: &Progress| {
                if let Some(total) = p.rows_estimate {
                    shown.set_length(total);
                }
                shown.set_position(p.rows_done);
                shown.set_message(format!("{what}: {}", p.phase));
            }),
        )
        .await?;
    progress.finish_and_clear();
    print(json, &report, || {
        let mut out = format!(
            "{what} of {table}: {} rows, {} keys, {}",
            report.rows,
            report.keys,
            if report.is_clean() {
                "clean"
            } else {
                "findings:"
            }
        );
        for (kind, finding) in &report.findings {
            if finding.count > 0 {
                out.push_str(&format!(
                    "\n  {kind:?}: {} (first: {})",
                    finding.count,
                    finding.first.join(", ")
                ));
            }
        }
        if !report.unrepaired.is_empty() {
            out.push_str(&format!(
                "\n  left unrepaired: {}",
                report.unrepaired.join(", ")
            ));
        }
        out
    })
}
