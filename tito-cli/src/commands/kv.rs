//! `tito kv`: namespaces and their live keys.

use tito::TitoEngine;
use tito::inspect;

use crate::cli::KvCommand;
use crate::{Failure, Outcome, counts, cursor_line, print};

/// Runs one `tito kv` command.
pub(crate) async fn run<E: TitoEngine>(
    db: E,
    command: KvCommand,
    json: bool,
    rerun: &crate::rerun::Rerun,
) -> Outcome {
    match command {
        KvCommand::Ls => {
            let mut rows = Vec::new();
            for namespace in inspect::kv_namespaces(&db, 1000).await? {
                let count = inspect::kv_count(&db, &namespace).await?;
                rows.push((namespace, count));
            }
            counts(json, ("namespace", "keys"), &rows)
        }
        KvCommand::Get { namespace, key } => {
            let kv = tito::kv::Kv::new(db);
            let Some(entry) = kv.get(&namespace, &key).await? else {
                return Err(Failure(format!(
                    "no live key {key:?} in namespace {namespace:?}"
                )));
            };
            print(json, &entry, || {
                format!("{} (version {})", entry.value, entry.version)
            })
        }
        KvCommand::List {
            namespace,
            prefix,
            limit,
            cursor,
        } => {
            let kv = tito::kv::Kv::new(db);
            let page = kv
                .list(&namespace, &prefix, limit, cursor.as_deref())
                .await?;
            print(json, &page, || {
                let mut out = String::new();
                for e in &page.entries {
                    out.push_str(&format!(
                        "{}  {}  (version {})\n",
                        e.key, e.value, e.version
                    ));
                }
                let limit = limit.to_string();
                out.push_str(&cursor_line(&page.cursor, |c| {
                    rerun.line(
                        &["kv", "list"],
                        &["--prefix", &prefix, "--limit", &limit, "--cursor", c],
                        &[&namespace],
                    )
                }));
                out
            })
        }
    }
}
