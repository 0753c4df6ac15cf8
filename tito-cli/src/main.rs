//! `tito`: inspect and operate a Tito store from the command line.
//!
//! ```text
//! tito --path ./data queue stats
//! tito --pd 127.0.0.1:2379 table scan user --limit 20 --json
//! tito --path ./data serve --listen 127.0.0.1:8080
//! ```
//!
//! Every read command takes `--json` and then prints one JSON document. Exit status: 0 on
//! success, 1 when the command failed (the reason on stderr), 2 on bad usage.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use serde::Serialize;
use tito::backend::embedded::Embedded;
use tito::backend::tikv::TiKV;
use tito::inspect::{self, QueueState};
use tito::{TitoEngine, TitoError};

#[derive(Parser)]
#[command(
    name = "tito",
    version,
    about = "Inspect and operate a Tito store (embedded or TiKV)"
)]
struct Cli {
    #[command(flatten)]
    store: StoreArgs,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
    /// How long to wait for TiKV to answer, in seconds.
    #[arg(long, global = true, default_value_t = 5)]
    timeout: u64,
    #[command(subcommand)]
    command: Command,
}

#[derive(Args)]
#[group(multiple = false)]
struct StoreArgs {
    /// An embedded store's directory (no other process may hold it open).
    #[arg(long, global = true)]
    path: Option<std::path::PathBuf>,
    /// TiKV: PD endpoints, comma-separated (host:port).
    #[arg(long, global = true, value_delimiter = ',')]
    pd: Option<Vec<String>>,
}

#[derive(Subcommand)]
enum Command {
    /// Queues: list them, see one's backlog, peek at its rows.
    #[command(subcommand)]
    Queue(QueueCommand),
    /// Tables: list them, read a row, page through rows.
    #[command(subcommand)]
    Table(TableCommand),
    /// Indexes: a table's index catalog with states and build progress.
    #[command(subcommand)]
    Index(IndexCommand),
    /// Key/value namespaces: list them, read a key, page through keys.
    #[command(subcommand)]
    Kv(KvCommand),
    /// Deletes what has expired: completed queue rows past retention, expired kv keys, old
    /// commit markers. Prints what it deleted.
    Gc {
        /// The retention of completed queue rows, in seconds.
        #[arg(long, default_value_t = 86_400)]
        retention: u64,
    },
    /// Keys: show a storage key as its decoded segments.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Serves the admin dashboard (tito-admin) for this store.
    Serve {
        /// The address to listen on. Without an authorization hook the dashboard only answers
        /// loopback peers.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
    },
}

#[derive(Subcommand)]
enum QueueCommand {
    /// Every queue with its partition count.
    Ls,
    /// A queue's backlog: per partition due now and later, oldest due, lateness, leases;
    /// completed rows and throughput.
    Stats {
        /// The queue's topic (none: the default queue).
        #[arg(long)]
        topic: Option<String>,
    },
    /// A page of a queue's rows: one partition's pending rows in due order, or the newest
    /// completed ones. Malformed rows are shown raw.
    Peek {
        #[arg(long)]
        topic: Option<String>,
        /// The partition (pending rows).
        #[arg(long, default_value_t = 0)]
        partition: u32,
        /// Completed rows instead of pending ones.
        #[arg(long)]
        completed: bool,
        #[arg(long, default_value_t = 20)]
        limit: usize,
        /// The cursor a previous page printed.
        #[arg(long)]
        cursor: Option<String>,
    },
}

#[derive(Subcommand)]
enum TableCommand {
    /// Every table with rows, with a bounded row count.
    Ls,
    /// One row by id, as stored.
    Get { table: String, id: String },
    /// A page of rows in id order.
    Scan {
        table: String,
        #[arg(long, default_value_t = 20)]
        limit: usize,
        #[arg(long)]
        cursor: Option<String>,
    },
}

#[derive(Subcommand)]
enum IndexCommand {
    /// A table's catalog: each index's definition, state and progress.
    Status { table: String },
}

#[derive(Subcommand)]
enum KvCommand {
    /// Every namespace with a bounded key count.
    Ls,
    /// One live entry.
    Get { namespace: String, key: String },
    /// A page of live entries whose keys start with `--prefix`.
    List {
        namespace: String,
        #[arg(long, default_value = "")]
        prefix: String,
        #[arg(long, default_value_t = 20)]
        limit: usize,
        #[arg(long)]
        cursor: Option<String>,
    },
}

#[derive(Subcommand)]
enum KeysCommand {
    /// Decodes a key (as printed by the other commands).
    Decode { key: String },
}

/// What a command failed with, as the user should read it.
struct Failure(String);

impl From<TitoError> for Failure {
    fn from(err: TitoError) -> Self {
        Failure(err.to_string())
    }
}

type Outcome = Result<(), Failure>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("tito: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure(message)) => {
            eprintln!("tito: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Outcome {
    if let Command::Keys(KeysCommand::Decode { key }) = &cli.command {
        // Needs no store.
        let segments = inspect::key_segments(key.as_bytes())?;
        return print(cli.json, &segments, || segments.join("\n"));
    }
    if let Some(path) = &cli.store.path {
        let db = open_embedded(path).await?;
        return execute(db, cli).await;
    }
    let Some(endpoints) = cli.store.pd.clone() else {
        return Err(Failure(
            "which store? give --path DIR (embedded) or --pd HOST:PORT (TiKV)".into(),
        ));
    };
    let db = connect_tikv(&endpoints, Duration::from_secs(cli.timeout.max(1))).await?;
    execute(db, cli).await
}

async fn open_embedded(path: &std::path::Path) -> Result<Embedded, Failure> {
    if !path.is_dir() {
        return Err(Failure(format!(
            "{} is not a store directory (it does not exist or is not a directory)",
            path.display()
        )));
    }
    Embedded::open(path).await.map_err(|err| {
        let text = chain(&err);
        if text.contains("already locked") {
            Failure(format!(
                "the store at {} is held by another process (an embedded store has one owner). \
                 Inspect it live by mounting the admin router in that process: \
                 app.nest(\"/tito\", tito_admin::Admin::new(db).router())",
                path.display()
            ))
        } else {
            Failure(format!(
                "cannot open the store at {}: {text}",
                path.display()
            ))
        }
    })
}

/// An error with its sources, as one line.
fn chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

async fn connect_tikv(endpoints: &[String], timeout: Duration) -> Result<TiKV, Failure> {
    let connect = TiKV::connect_with_config(endpoints.to_vec(), 16, timeout);
    let db = match tokio::time::timeout(timeout, connect).await {
        Ok(Ok(db)) => db,
        Ok(Err(err)) => {
            return Err(Failure(format!(
                "PD at {} does not answer: {}",
                endpoints.join(","),
                chain(&err)
            )));
        }
        Err(_) => {
            return Err(Failure(format!(
                "PD at {} did not answer within {timeout:?}",
                endpoints.join(",")
            )));
        }
    };
    // The client connects lazily to TiKV itself: one read proves the cluster answers.
    match tokio::time::timeout(timeout, db.current_version()).await {
        Ok(Ok(_)) => Ok(db),
        Ok(Err(err)) => Err(Failure(format!(
            "the TiKV cluster of PD {} does not answer: {}",
            endpoints.join(","),
            chain(&err)
        ))),
        Err(_) => Err(Failure(format!(
            "the TiKV cluster of PD {} did not answer within {timeout:?}",
            endpoints.join(",")
        ))),
    }
}

fn print<T: Serialize>(json: bool, value: &T, text: impl FnOnce() -> String) -> Outcome {
    if json {
        let out = serde_json::to_string_pretty(value).map_err(|e| Failure(e.to_string()))?;
        println!("{out}");
    } else {
        println!("{}", text());
    }
    Ok(())
}

fn cursor_line(cursor: &Option<String>) -> String {
    match cursor {
        Some(c) => format!("next page: --cursor {c}"),
        None => "(last page)".into(),
    }
}

async fn execute<E: TitoEngine>(db: E, cli: Cli) -> Outcome {
    let json = cli.json;
    match cli.command {
        Command::Queue(QueueCommand::Ls) => {
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
        Command::Queue(QueueCommand::Stats { topic }) => {
            let o = inspect::queue_overview(&db, topic.as_deref()).await?;
            if o.info.partitions.is_none() {
                return Err(Failure(format!(
                    "no queue {:?} in this store",
                    o.info.label
                )));
            }
            print(json, &o, || {
                let now_s = o.now_ms / 1000;
                let mut out = format!(
                    "queue {}: {} due now, {} due later, {} completed kept",
                    o.info.label, o.due_now, o.future, o.completed
                );
                if let Some(due) = o.oldest_due.filter(|_| o.due_now.value > 0) {
                    out.push_str(&format!(
                        "; the oldest due is {} s late",
                        now_s.saturating_sub(due)
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
            })
        }
        Command::Queue(QueueCommand::Peek {
            topic,
            partition,
            completed,
            limit,
            cursor,
        }) => {
            let state = if completed {
                QueueState::Completed
            } else {
                QueueState::Pending(partition)
            };
            let page =
                inspect::queue_scan(&db, topic.as_deref(), state, cursor.as_deref(), limit).await?;
            print(json, &page, || {
                let mut out = String::new();
                for row in &page.items {
                    match (&row.event, &row.malformed) {
                        (Some(e), None) => out.push_str(&format!(
                            "{}  id={} key={} due={} payload={}\n",
                            row.key, e.id, e.key, e.timestamp, e.payload
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
            })
        }
        Command::Table(TableCommand::Ls) => {
            let mut rows = Vec::new();
            for table in inspect::tables(&db, 1000).await? {
                let count = inspect::table_count(&db, &table).await?;
                rows.push(serde_json::json!({ "table": table, "rows": count }));
            }
            print(json, &rows, || {
                let mut out = format!("{:<32} {:>10}", "TABLE", "ROWS");
                for r in &rows {
                    out.push_str(&format!(
                        "\n{:<32} {:>10}",
                        r["table"].as_str().unwrap_or_default(),
                        format!(
                            "{}{}",
                            r["rows"]["value"],
                            if r["rows"]["more"] == true { "+" } else { "" }
                        )
                    ));
                }
                out
            })
        }
        Command::Table(TableCommand::Get { table, id }) => {
            let Some(row) = inspect::table_row(&db, &table, &id).await? else {
                return Err(Failure(format!("no row {id:?} in table {table:?}")));
            };
            print(json, &row, || match (&row.value, &row.raw) {
                (Some(v), _) => serde_json::to_string_pretty(v).unwrap_or_default(),
                (None, raw) => format!("NOT JSON: {:?}", raw.as_deref().unwrap_or("")),
            })
        }
        Command::Table(TableCommand::Scan {
            table,
            limit,
            cursor,
        }) => {
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
        Command::Index(IndexCommand::Status { table }) => {
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
        Command::Kv(KvCommand::Ls) => {
            let mut rows = Vec::new();
            for namespace in inspect::kv_namespaces(&db, 1000).await? {
                let count = inspect::kv_count(&db, &namespace).await?;
                rows.push(serde_json::json!({ "namespace": namespace, "keys": count }));
            }
            print(json, &rows, || {
                let mut out = format!("{:<32} {:>10}", "NAMESPACE", "KEYS");
                for r in &rows {
                    out.push_str(&format!(
                        "\n{:<32} {:>10}",
                        r["namespace"].as_str().unwrap_or_default(),
                        r["keys"]["value"]
                    ));
                }
                out
            })
        }
        Command::Kv(KvCommand::Get { namespace, key }) => {
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
        Command::Kv(KvCommand::List {
            namespace,
            prefix,
            limit,
            cursor,
        }) => {
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
                out.push_str(&cursor_line(&page.cursor));
                out
            })
        }
        Command::Gc { retention } => gc(&db, Duration::from_secs(retention), json).await,
        Command::Serve { listen } => serve(db, listen).await,
        Command::Keys(_) => unreachable!("answered before the store is opened"),
    }
}

async fn gc<E: TitoEngine>(db: &E, retention: Duration, json: bool) -> Outcome {
    let started = Instant::now();
    let mut report = serde_json::Map::new();
    for info in inspect::queues(db, 1000).await? {
        let Some(partitions) = info.partitions else {
            continue;
        };
        let mut config = tito::QueueConfig::new(partitions, retention);
        config.topic = info.topic.clone();
        let queue = tito::Queue::new(db.clone(), config);
        let mut deleted = 0;
        loop {
            let batch = queue.expire_completed().await?;
            deleted += batch;
            if batch < tito::queue::RETENTION_BATCH {
                break;
            }
        }
        report.insert(format!("queue {}", info.label), deleted.into());
    }
    let kv = tito::kv::Kv::new(db.clone());
    let mut expired = 0;
    loop {
        let batch = kv.sweep(tito::kv::SWEEP_BATCH).await?;
        expired += batch;
        if batch < tito::kv::SWEEP_BATCH {
            break;
        }
    }
    report.insert("kv expired".into(), expired.into());
    let mut markers = 0;
    loop {
        let batch =
            tito::engine::sweep_commit_markers(db, tito::engine::COMMIT_MARKER_SWEEP_BATCH).await?;
        markers += batch;
        if batch < tito::engine::COMMIT_MARKER_SWEEP_BATCH {
            break;
        }
    }
    report.insert("commit markers".into(), markers.into());
    report.insert(
        "seconds".into(),
        serde_json::json!(started.elapsed().as_secs_f64()),
    );
    print(json, &report, || {
        report
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect::<Vec<_>>()
            .join("\n")
    })
}

async fn serve<E: TitoEngine>(db: E, listen: SocketAddr) -> Outcome {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| Failure(format!("cannot listen on {listen}: {e}")))?;
    let local = listener
        .local_addr()
        .map_err(|e| Failure(format!("cannot listen on {listen}: {e}")))?;
    if !local.ip().is_loopback() {
        eprintln!(
            "tito: listening on {local}, not loopback: without an authorization hook the dashboard \
             refuses every peer but loopback ones (mount tito_admin::Admin with Admin::authorize in \
             your own server to serve others)"
        );
    }
    println!("serving the Tito admin on http://{local}/ (Ctrl-C stops)");
    let router = tito_admin::Admin::new(db).router();
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    tito_admin::serve(listener, router, shutdown)
        .await
        .map_err(|e| Failure(format!("serving failed: {e}")))
}
