//! `tito table`: tables and their rows, read as stored.

use tito::TitoEngine;
use tito::inspect;

use crate::cli::TableCommand;
use crate::{Failure, Outcome, counts, cursor_line, print};

/// Runs one `tito table` command.
pub(crate) async fn run<E: TitoEngine>(
    db: E,
    command: TableCommand,
    json: bool,
    rerun: &crate::rerun::Rerun,
) -> Outcome {
    match command {
        TableCommand::Ls => {
            let mut rows = Vec::new();
            for table in inspect::tables(&db, 1000).await? {
                let count = inspect::table_count(&db, &table).await?;
                rows.push((table, count));
            }
            counts(json, ("table", "rows"), &rows)
        }
        TableCommand::Get { table, id } => {
            let Some(row) = inspect::table_row(&db, &table, &id).await? else {
                return Err(Failure(format!("no row {id:?} in table {table:?}")));
            };
            print(json, &row, || {
                let body = match (&row.value, &row.raw) {
                    (Some(v), _) => serde_json::to_string_pretty(v).unwrap_or_default(),
                    (None, raw) => format!("NOT JSON: {:?}", raw.as_deref().unwrap_or("")),
                };
                match row.version {
                    1 => body,
                    0 => format!("malformed version header\n{body}"),
                    v => format!("shape version {v}\n{body}"),
                }
            })
        }
        TableCommand::Scan {
            table,
            limit,
            cursor,
        } => {
            let page = inspect::table_rows(&db, &table, cursor.as_deref(), limit).await?;
            print(json, &page, || {
                let mut out = String::new();
                for row in &page.items {
                    let id = row.id.as_deref().unwrap_or(&row.key);
                    let id = match row.version {
                        1 => id.to_string(),
                        v => format!("{id}  v{v}"),
                    };
                    match &row.value {
                        Some(v) => out.push_str(&format!("{id}  {v}\n")),
                        None => out.push_str(&format!(
                            "{id}  NOT JSON: {:?}\n",
                            row.raw.as_deref().unwrap_or("")
                        )),
                    }
                }
                let limit = limit.to_string();
                out.push_str(&cursor_line(&page.cursor, |c| {
                    rerun.line(
                        &["table", "scan"],
                        &["--limit", &limit, "--cursor", c],
                        &[&table],
                    )
                }));
                out
            })
        }
        TableCommand::Versions { table, bound } => {
            let counts = tito::schema::shape_versions(&db, &table, bound).await?;
            if counts.shapes.is_none() && counts.rows.is_empty() && counts.rewrite.is_none() {
                // Nothing under that name: a mistyped table is not an empty one.
                let tables = inspect::tables(&db, 1000).await?;
                return Err(Failure(format!(
                    "no table {table:?} in this store ({})",
                    if tables.is_empty() {
                        "it has none".to_string()
                    } else {
                        format!("its tables: {}", tables.join(", "))
                    }
                )));
            }
            print(json, &counts, || {
                let mut out = String::new();
                match &counts.shapes {
                    Some(shapes) => {
                        let seen: Vec<String> = shapes.seen.keys().map(u32::to_string).collect();
                        out.push_str(&format!(
                            "writers may write version {}; versions declared by code: {}\n",
                            shapes.writable(),
                            if seen.is_empty() {
                                "none recorded".into()
                            } else {
                                seen.join(", ")
                            }
                        ));
                    }
                    None => out.push_str("no schema catalog (no model code has used the table)\n"),
                }
                for (version, rows) in &counts.rows {
                    match version {
                        0 => out.push_str(&format!("malformed header  {rows} rows\n")),
                        v => out.push_str(&format!("version {v}  {rows} rows\n")),
                    }
                }
                if counts.rows.is_empty() {
                    out.push_str("no rows\n");
                }
                if counts.more {
                    out.push_str(&format!("(more rows than the {bound} read)\n"));
                }
                if let Some(rewrite) = &counts.rewrite {
                    out.push_str(&rewrite_lines(rewrite));
                }
                out
            })
        }
        TableCommand::AllowVersion { table, version } => {
            let before = tito::schema::catalog(&db, &table)
                .await?
                .map(|c| c.shapes.writable());
            let shapes = tito::schema::allow_shape_version(&db, &table, version).await?;
            if before == Some(version) {
                return Err(Failure(format!(
                    "writers of table {table:?} may already write version {version}: nothing changed"
                )));
            }
            print(json, &shapes, || {
                format!("writers of table {table:?} may write shape version {version} from now on")
            })
        }
    }
}

/// A shape rewrite's progress as `tito table versions` prints it.
fn rewrite_lines(rewrite: &tito::schema::RewriteProgress) -> String {
    let mut out = String::new();
    let left = rewrite.unconvertible.count + rewrite.refused.count;
    if rewrite.finished && rewrite.rewritten == 0 && left == 0 {
        // A run that found every row in its version already changed nothing.
        return format!(
            "no row needed a rewrite: the last run to version {} found all {} rows read in that \
             version already\n",
            rewrite.target, rewrite.rows_done
        );
    }
    let of = match rewrite.rows_estimate {
        Some(estimate) => format!(" of about {estimate}"),
        None => String::new(),
    };
    out.push_str(&format!(
        "rewrite to version {}: {}, {} rows read{of}, {} rewritten\n",
        rewrite.target,
        if rewrite.finished {
            "finished"
        } else {
            "running"
        },
        rewrite.rows_done,
        rewrite.rewritten,
    ));
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
        out.push_str(&format!("  {what}: {}\n", rows.count));
        for row in &rows.first {
            // One line per row, and an id that can be copied as it is: an empty id, or one
            // with spaces or control characters, is printed quoted with escapes.
            let id = if row.id.is_empty()
                || row.id.chars().any(|c| c.is_control() || c.is_whitespace())
            {
                format!("{:?}", row.id)
            } else {
                row.id.clone()
            };
            let reason: Vec<&str> = row.reason.lines().collect();
            out.push_str(&format!(
                "    id {id} (version {}): {}\n",
                row.version,
                reason.join(" ")
            ));
        }
        if rows.count > rows.first.len() as u64 {
            out.push_str(&format!(
                "    ... and {} more\n",
                rows.count - rows.first.len() as u64
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use tito::schema::{LeftRow, RewriteProgress};

    fn left(id: &str, reason: &str) -> LeftRow {
        let mut row = LeftRow::default();
        row.id = id.to_string();
        row.key = format!("table:note:{id}");
        row.version = 1;
        row.reason = reason.to_string();
        row
    }

    #[test]
    fn left_rows_print_one_line_each_and_odd_ids_quoted() {
        let mut run = RewriteProgress::default();
        run.target = 2;
        run.unconvertible.count = 4;
        run.unconvertible.first = vec![
            left("n2", "an empty note has no lines"),
            left("a\nb", "the conversion panicked: first\nsecond"),
            left("", "no id"),
            left("with space", "x"),
        ];
        let text = super::rewrite_lines(&run);
        let rows: Vec<&str> = text.lines().filter(|l| l.starts_with("    id ")).collect();
        assert_eq!(
            rows,
            [
                "    id n2 (version 1): an empty note has no lines",
                "    id \"a\\nb\" (version 1): the conversion panicked: first second",
                "    id \"\" (version 1): no id",
                "    id \"with space\" (version 1): x",
            ],
            "{text}"
        );
    }
}
