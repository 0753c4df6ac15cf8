//! `tito inbox`: an inbox model's counts per state, and its dead and bad rows.

use crate::cli::InboxCommand;
use crate::typing::Typing;
use crate::{Outcome, cursor_line, print};

/// Runs one `tito inbox` command.
pub(crate) async fn run(
    typed: &Typing,
    command: InboxCommand,
    json: bool,
    rerun: &crate::rerun::Rerun,
) -> Outcome {
    match command {
        InboxCommand::Stats { table, group } => {
            let counts = typed.inbox(&table)?.counts(&group).await?;
            print(json, &counts, || {
                let more = if counts.more { "+" } else { "" };
                format!(
                    "inbox {table} group {group}: {}{more} ready, {}{more} delayed, {}{more} leased, \
                     {}{more} processed; {} bad rows in the table ({} rows read)",
                    counts.ready,
                    counts.delayed,
                    counts.leased,
                    counts.processed,
                    counts.bad,
                    counts.scanned
                )
            })
        }
        InboxCommand::Dead {
            table,
            group,
            limit,
            cursor,
        } => {
            let inbox = typed.inbox(&table)?;
            let rows = inbox.scan(&group, None, cursor.as_deref(), limit).await?;
            let bad = inbox.bad_rows().await?;
            let value = serde_json::json!({ "rows": rows, "bad": bad });
            print(json, &value, || {
                let mut out = String::new();
                for row in &rows.items {
                    out.push_str(&format!(
                        "{}  attempt={}  {}\n",
                        row.id,
                        row.attempt.map_or("-".into(), |a| a.to_string()),
                        row.row
                    ));
                }
                let limit = limit.to_string();
                out.push_str(&cursor_line(&rows.cursor, |c| {
                    rerun.line(
                        &["inbox", "dead"],
                        &["--group", &group, "--limit", &limit, "--cursor", c],
                        &[&table],
                    )
                }));
                if !bad.is_empty() {
                    out.push_str(&format!("\nbad rows: {}", bad.join(", ")));
                }
                out
            })
        }
    }
}
