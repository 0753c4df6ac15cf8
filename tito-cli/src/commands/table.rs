//! `tito table`: tables and their rows, read as stored.

use tito::TitoEngine;
use tito::inspect;

use crate::cli::TableCommand;
use crate::{Failure, Outcome, counts, cursor_line, print};

/// Runs one `tito table` command.
pub(crate) async fn run<E: TitoEngine>(db: E, command: TableCommand, json: bool) -> Outcome {
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
            print(json, &row, || match (&row.value, &row.raw) {
                (Some(v), _) => serde_json::to_string_pretty(v).unwrap_or_default(),
                (None, raw) => format!("NOT JSON: {:?}", raw.as_deref().unwrap_or("")),
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
                    match &row.value {
                        Some(v) => out.push_str(&format!("{id}  {v}\n")),
                        None => out.push_str(&format!(
                            "{id}  NOT JSON: {:?}\n",
                            row.raw.as_deref().unwrap_or("")
                        )),
                    }
                }
                out.push_str(&cursor_line(&page.cursor));
                out
            })
        }
    }
}
