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
//!
//! # Your own `tito`, with your models
//!
//! Index builds, audits, repairs and inbox views need the application's types (a condition is
//! code; an inbox's roles are its model's). The stock binary has none; an application builds
//! its own with [`Tool`]:
//!
//! ```no_run
//! # use serde::{Deserialize, Serialize};
//! # use tito::TitoModel;
//! # #[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
//! # #[tito(table = "user")]
//! # struct User { id: String }
//! // src/bin/tito.rs of the application
//! fn main() -> std::process::ExitCode {
//!     tito_cli::Tool::new().model::<User>().main()
//! }
//! ```
//!
//! With a second binary, `cargo run` needs to know which one is the application's: set
//! `default-run = "your-app"` under `[package]`, and run the tool with `cargo run --bin tito`.
//!
//! # Features
//!
//! `tikv` (default): `--pd` opens TiKV stores. Without it (`default-features = false`) the tool
//! opens embedded stores only and the TiKV client is not built.

#![forbid(unsafe_code)]
#![warn(missing_docs)]
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use std::collections::BTreeMap;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand};
use futures::future::BoxFuture;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use tito::backend::embedded::Embedded;
#[cfg(feature = "tikv")]
use tito::backend::tikv::TiKV;
use tito::inbox::{Inbox, InboxModel};
use tito::inspect::{self, QueueState};
use tito::model::{TitoModel, TitoModelTrait};
use tito::schema::{AuditReport, IndexState, Progress, Step, TableSchema};
use tito::{TitoEngine, TitoError, TitoResult};
use tito_admin::InboxSource;

/// What one registered model can do, whatever the engine.
trait ModelOps: Send + Sync {
    fn schema(&self) -> BoxFuture<'_, TitoResult<TableSchema>>;
    fn step(&self) -> BoxFuture<'_, TitoResult<Step>>;
    fn restart(&self, index: String) -> BoxFuture<'_, TitoResult<()>>;
    fn audit(
        &self,
        repair: bool,
        progress: Box<dyn FnMut(&Progress) + Send>,
    ) -> BoxFuture<'_, TitoResult<AuditReport>>;
}

struct Typed<E: TitoEngine, T>(TitoModel<E, T>);

impl<E: TitoEngine, T: TitoModelTrait> ModelOps for Typed<E, T> {
    fn schema(&self) -> BoxFuture<'_, TitoResult<TableSchema>> {
        Box::pin(self.0.schema())
    }
    fn step(&self) -> BoxFuture<'_, TitoResult<Step>> {
        Box::pin(self.0.schema_step(tito::schema::DEFAULT_BATCH))
    }
    fn restart(&self, index: String) -> BoxFuture<'_, TitoResult<()>> {
        Box::pin(async move { self.0.restart_build(&index).await })
    }
    fn audit(
        &self,
        repair: bool,
        progress: Box<dyn FnMut(&Progress) + Send>,
    ) -> BoxFuture<'_, TitoResult<AuditReport>> {
        Box::pin(async move {
            if repair {
                self.0.repair(progress).await
            } else {
                self.0.audit(progress).await
            }
        })
    }
}

/// The registered models and inboxes, opened on the store of this run.
struct Typing {
    models: BTreeMap<String, Arc<dyn ModelOps>>,
    inboxes: BTreeMap<String, Arc<dyn InboxSource>>,
}

impl Typing {
    fn model(&self, table: &str) -> Result<&Arc<dyn ModelOps>, Failure> {
        self.models.get(table).ok_or_else(|| {
            Failure(format!(
                "table {table:?} has no model in this binary: index builds, audits and repairs \
                 run the model's code; build your own tool with \
                 tito_cli::Tool::new().model::<YourModel>().main()"
            ))
        })
    }

    fn inbox(&self, table: &str) -> Result<&Arc<dyn InboxSource>, Failure> {
        self.inboxes.get(table).ok_or_else(|| {
            Failure(format!(
                "table {table:?} has no inbox model in this binary (its roles are the model's); \
                 build your own tool with tito_cli::Tool::new().inbox::<YourModel>().main()"
            ))
        })
    }
}

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
    /// Inboxes (registered inbox models): counts by state, dead-lettered and bad rows.
    #[command(subcommand)]
    Inbox(InboxCommand),
    /// Checks a table (registered model) against its ready indexes; changes nothing.
    Audit { table: String },
    /// Fixes what an audit finds, in bounded batches.
    Repair { table: String },
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
    /// Moves one pending row aside (out of its partition, kept under the queue's `aside:`
    /// keys): for a row no worker can decode, or one that must not run. Prints whether it was
    /// pending.
    SetAside {
        #[arg(long)]
        topic: Option<String>,
        /// The row's storage key, as `queue peek` prints it.
        key: String,
        /// Why, kept with the row.
        #[arg(long, default_value = "set aside by an operator")]
        why: String,
    },
    /// A page of the rows a queue moved aside.
    Aside {
        #[arg(long)]
        topic: Option<String>,
        #[arg(long, default_value_t = 20)]
        limit: usize,
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
    /// Builds the table's building indexes (registered model) to the end, in bounded,
    /// resumable batches; with an index name, refuses unless that index is building.
    Build {
        table: String,
        index: Option<String>,
    },
    /// Finishes dropping the indexes the code no longer declares (registered model); with an
    /// index name, refuses unless that index is dropping.
    Drop {
        table: String,
        index: Option<String>,
    },
    /// Starts a build that stopped on duplicate values again from the first row.
    Restart { table: String, index: String },
}

#[derive(Subcommand)]
enum InboxCommand {
    /// One group's rows by state (bounded count), with the table's bad rows.
    Stats {
        table: String,
        #[arg(long)]
        group: String,
    },
    /// The rows of a dead-letter group (the group dead letters go to) and the bad rows.
    Dead {
        table: String,
        /// The dead-letter group.
        #[arg(long)]
        group: String,
        #[arg(long, default_value_t = 20)]
        limit: usize,
        #[arg(long)]
        cursor: Option<String>,
    },
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

/// What a command prints on success.
type Outcome = Result<String, Failure>;

/// The command line, with the models and inboxes of an application registered.
#[derive(Default)]
pub struct Tool {
    models: Vec<Registered>,
    inboxes: Vec<RegisteredInbox>,
    write_grace: Option<std::time::Duration>,
}

/// A model registered for both engines the tool can open.
struct Registered {
    table: String,
    embedded: Box<dyn Fn(Embedded) -> Arc<dyn ModelOps> + Send + Sync>,
    #[cfg(feature = "tikv")]
    tikv: Box<dyn Fn(TiKV) -> Arc<dyn ModelOps> + Send + Sync>,
}

struct RegisteredInbox {
    table: String,
    embedded: Box<dyn Fn(Embedded) -> TitoResult<Arc<dyn InboxSource>> + Send + Sync>,
    #[cfg(feature = "tikv")]
    tikv: Box<dyn Fn(TiKV) -> TitoResult<Arc<dyn InboxSource>> + Send + Sync>,
}

impl Tool {
    /// The stock tool: every command that needs no model type.
    pub fn new() -> Self {
        Tool::default()
    }

    /// Registers a model: `index build|drop|restart`, `audit` and `repair` of its table.
    pub fn model<T: TitoModelTrait>(mut self) -> Self {
        self.models.push(Registered {
            table: T::default().table(),
            embedded: Box::new(|db| Arc::new(Typed::<Embedded, T>(db.model::<T>()))),
            #[cfg(feature = "tikv")]
            tikv: Box::new(|db| Arc::new(Typed::<TiKV, T>(db.model::<T>()))),
        });
        self
    }

    /// The schema write grace of the store this tool opens
    /// ([`tito::schema::set_write_grace`]): how long a build waits after an index this tool's
    /// models register before it scans rows. Ten seconds unless set; give your application's
    /// setting. Over an hour is refused when a command opens the store.
    pub fn write_grace(mut self, grace: std::time::Duration) -> Self {
        self.write_grace = Some(grace);
        self
    }

    /// Registers an inbox model: `inbox stats|dead` of its table.
    pub fn inbox<M: InboxModel>(mut self) -> Self {
        self.inboxes.push(RegisteredInbox {
            table: M::default().table(),
            embedded: Box::new(|db| {
                Ok(tito_admin::inbox_source(
                    Arc::new(Inbox::<_, M>::new(db)?),
                    &[],
                ))
            }),
            #[cfg(feature = "tikv")]
            tikv: Box::new(|db| {
                Ok(tito_admin::inbox_source(
                    Arc::new(Inbox::<_, M>::new(db)?),
                    &[],
                ))
            }),
        });
        self
    }

    /// Parses the process's arguments, runs the command, prints its output (errors on stderr)
    /// and returns the exit status.
    pub fn main(self) -> ExitCode {
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
        match runtime.block_on(self.run(cli)) {
            Ok(output) => {
                if !output.is_empty() {
                    say(&output);
                }
                ExitCode::SUCCESS
            }
            Err(Failure(message)) => {
                eprintln!("tito: {message}");
                ExitCode::FAILURE
            }
        }
    }

    /// Runs one command line (`args` without the program name) in-process and returns what it
    /// would print, or its error message. Bad usage is an error too.
    pub async fn execute<I, S>(self, args: I) -> Result<String, String>
    where
        I: IntoIterator<Item = S>,
        S: Into<std::ffi::OsString> + Clone,
    {
        let all = std::iter::once(std::ffi::OsString::from("tito"))
            .chain(args.into_iter().map(Into::into));
        let cli = Cli::try_parse_from(all).map_err(|e| e.to_string())?;
        self.run(cli).await.map_err(|Failure(m)| m)
    }

    async fn run(self, cli: Cli) -> Outcome {
        if let Command::Keys(KeysCommand::Decode { key }) = &cli.command {
            // Needs no store.
            let segments = inspect::key_segments(key.as_bytes())?;
            return print(cli.json, &segments, || segments.join("\n"));
        }
        if let Some(path) = &cli.store.path {
            let db = open_embedded(path).await?;
            if let Some(grace) = self.write_grace {
                tito::schema::set_write_grace(&db, grace)?;
            }
            let models = self
                .models
                .iter()
                .map(|m| (m.table.clone(), (m.embedded)(db.clone())))
                .collect();
            let inboxes = self
                .inboxes
                .iter()
                .map(|i| Ok((i.table.clone(), (i.embedded)(db.clone())?)))
                .collect::<TitoResult<_>>()?;
            let typed = Typing { models, inboxes };
            let result = execute(db.clone(), &typed, cli).await;
            drop(typed);
            // Closed before the process exits, so the next command can open the store at once.
            let _ = db.close().await;
            return result;
        }
        let Some(endpoints) = cli.store.pd.clone() else {
            return Err(Failure(
                "which store? give --path DIR (embedded) or --pd HOST:PORT (TiKV)".into(),
            ));
        };
        self.run_tikv(endpoints, cli).await
    }

    #[cfg(not(feature = "tikv"))]
    async fn run_tikv(self, _endpoints: Vec<String>, _cli: Cli) -> Outcome {
        Err(Failure(
            "this tito was built without TiKV (tito-cli's `tikv` feature): it opens embedded \
             stores only (--path DIR)"
                .into(),
        ))
    }

    #[cfg(feature = "tikv")]
    async fn run_tikv(self, endpoints: Vec<String>, cli: Cli) -> Outcome {
        let db = connect_tikv(&endpoints, Duration::from_secs(cli.timeout.max(1))).await?;
        if let Some(grace) = self.write_grace {
            tito::schema::set_write_grace(&db, grace)?;
        }
        let models = self
            .models
            .iter()
            .map(|m| (m.table.clone(), (m.tikv)(db.clone())))
            .collect();
        let inboxes = self
            .inboxes
            .iter()
            .map(|i| Ok((i.table.clone(), (i.tikv)(db.clone())?)))
            .collect::<TitoResult<_>>()?;
        execute(db, &Typing { models, inboxes }, cli).await
    }
}

/// Prints a line on stdout. A reader that went away (`tito queue stats | head -2`) ends the
/// output quietly, as other Unix tools do, instead of panicking on the closed pipe.
fn say(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{text}").and_then(|()| out.flush()) {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::BrokenPipe => {}
        Err(err) => eprintln!("tito: cannot write the output: {err}"),
    }
}

/// Opens an existing store. No command creates one: a path that is not a store (a mistyped
/// path, a directory of other files) is refused and left untouched.
async fn open_embedded(path: &std::path::Path) -> Result<Embedded, Failure> {
    let options = tito::backend::embedded::EmbeddedOptions::new().create_if_missing(false);
    Embedded::open_with(path, options).await.map_err(|err| {
        let text = chain(&err);
        if let TitoError::NotFound(message) = &err {
            Failure(message.clone())
        } else if text.contains("already locked") {
            Failure(format!(
                "the store at {} is held by another process (an embedded store has one owner). \
                 Inspect it live by mounting the admin router in that process: \
                 app.merge(tito_admin::Admin::new(db).mount(\"/tito\"))",
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

#[cfg(feature = "tikv")]
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
        serde_json::to_string_pretty(value).map_err(|e| Failure(e.to_string()))
    } else {
        Ok(text())
    }
}

/// Names with their bounded counts: JSON objects `{name_field: name, count_field: count}`, or a
/// two-column table whose counts say `+` past their bound.
fn counts(json: bool, (name, count): (&str, &str), rows: &[(String, inspect::Count)]) -> Outcome {
    let value: Vec<serde_json::Value> = rows
        .iter()
        .map(|(n, c)| serde_json::json!({ name: n, count: c }))
        .collect();
    print(json, &value, || {
        let mut out = format!("{:<32} {:>10}", name.to_uppercase(), count.to_uppercase());
        for (n, c) in rows {
            out.push_str(&format!("\n{n:<32} {:>10}", c.to_string()));
        }
        out
    })
}

fn cursor_line(cursor: &Option<String>) -> String {
    match cursor {
        Some(c) => format!("next page: --cursor {c}"),
        None => "(last page)".into(),
    }
}

async fn execute<E: TitoEngine>(db: E, typed: &Typing, cli: Cli) -> Outcome {
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
                    if let Some(note) = &row.undecodable {
                        out.push_str(&format!(
                            "{}  UNDECODABLE as {}: {} (tito queue set-aside moves it aside)\n",
                            row.key, note.type_name, note.error
                        ));
                    }
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
        Command::Queue(QueueCommand::SetAside { topic, key, why }) => {
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
        Command::Queue(QueueCommand::Aside {
            topic,
            limit,
            cursor,
        }) => {
            let page =
                inspect::queue_aside(&db, topic.as_deref(), cursor.as_deref(), limit).await?;
            print(json, &page, || {
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
            })
        }
        Command::Table(TableCommand::Ls) => {
            let mut rows = Vec::new();
            for table in inspect::tables(&db, 1000).await? {
                let count = inspect::table_count(&db, &table).await?;
                rows.push((table, count));
            }
            counts(json, ("table", "rows"), &rows)
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
                rows.push((namespace, count));
            }
            counts(json, ("namespace", "keys"), &rows)
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
        Command::Index(IndexCommand::Build { table, index }) => {
            schema_work(
                typed.model(&table)?,
                &table,
                index,
                IndexState::Building,
                json,
            )
            .await
        }
        Command::Index(IndexCommand::Drop { table, index }) => {
            schema_work(
                typed.model(&table)?,
                &table,
                index,
                IndexState::Dropping,
                json,
            )
            .await
        }
        Command::Index(IndexCommand::Restart { table, index }) => {
            typed.model(&table)?.restart(index.clone()).await?;
            print(json, &serde_json::json!({ "restarted": index }), || {
                format!(
                    "the build of {table}.{index} starts again from the first row (run `index build`)"
                )
            })
        }
        Command::Audit { table } => audit(typed.model(&table)?, &table, false, json).await,
        Command::Repair { table } => audit(typed.model(&table)?, &table, true, json).await,
        Command::Inbox(InboxCommand::Stats { table, group }) => {
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
        Command::Inbox(InboxCommand::Dead {
            table,
            group,
            limit,
            cursor,
        }) => {
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
                out.push_str(&cursor_line(&rows.cursor));
                if !bad.is_empty() {
                    out.push_str(&format!("\nbad rows: {}", bad.join(", ")));
                }
                out
            })
        }
        Command::Gc { retention } => gc(&db, Duration::from_secs(retention), json).await,
        Command::Serve { listen } => serve(db, typed, listen).await,
        Command::Keys(_) => unreachable!("answered before the store is opened"),
    }
}

/// Runs `batch` until it handles fewer than `full` items (nothing more is waiting); returns the
/// total handled.
async fn until_short(
    full: usize,
    mut batch: impl AsyncFnMut() -> TitoResult<usize>,
) -> TitoResult<usize> {
    let mut total = 0;
    loop {
        let handled = batch().await?;
        total += handled;
        if handled < full {
            return Ok(total);
        }
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
        let full = tito::queue::RETENTION_BATCH;
        let deleted = until_short(full, async || queue.expire_completed().await).await?;
        report.insert(format!("queue {}", info.label), deleted.into());
    }
    let kv = tito::kv::Kv::new(db.clone());
    let full = tito::kv::SWEEP_BATCH;
    let expired = until_short(full, async || kv.sweep(full).await).await?;
    report.insert("kv expired".into(), expired.into());
    let full = tito::engine::COMMIT_MARKER_SWEEP_BATCH;
    let sweep = async || tito::engine::sweep_commit_markers(db, full).await;
    report.insert(
        "commit markers".into(),
        until_short(full, sweep).await?.into(),
    );
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

/// A progress bar on stderr (hidden when stderr is not a terminal or output is JSON).
fn bar(len: Option<u64>, json: bool, message: String) -> ProgressBar {
    let bar = match len {
        _ if json => ProgressBar::hidden(),
        Some(len) => ProgressBar::new(len),
        None => ProgressBar::new_spinner(),
    };
    let style = ProgressStyle::with_template("{msg} {bar:40} {pos}/{len} rows ({per_sec}, {eta})")
        .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_message(message);
    bar
}

/// Runs schema steps until none is left, reporting rows on a progress bar.
async fn schema_work(
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

async fn audit(model: &Arc<dyn ModelOps>, table: &str, repair: bool, json: bool) -> Outcome {
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

async fn serve<E: TitoEngine>(db: E, typed: &Typing, listen: SocketAddr) -> Outcome {
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
    say(&format!(
        "serving the Tito admin on http://{local}/ (Ctrl-C stops)"
    ));
    let mut admin = tito_admin::Admin::new(db);
    for (table, model) in &typed.models {
        admin = admin.auditor(table.clone(), Arc::new(ModelAuditor(model.clone())));
    }
    let router = admin.router();
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    tito_admin::serve(listener, router, shutdown)
        .await
        .map_err(|e| Failure(format!("serving failed: {e}")))?;
    Ok(String::new())
}

/// A registered model as the dashboard's auditor.
struct ModelAuditor(Arc<dyn ModelOps>);

impl tito_admin::Auditor for ModelAuditor {
    fn audit(&self) -> BoxFuture<'_, TitoResult<AuditReport>> {
        self.0.audit(false, Box::new(|_| {}))
    }
}
