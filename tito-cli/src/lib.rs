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
//! `tikv` (default): `--pd` opens TiKV stores (`--keyspace NAME` for an API v2 keyspace,
//! `--tls-ca`, `--tls-cert` and `--tls-key` together for TLS). Without it (`default-features = false`) the tool
//! opens embedded stores only and the TiKV client is not built.

#![forbid(unsafe_code)]
#![warn(missing_docs)]
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

use std::any::Any;
use std::process::ExitCode;
use std::time::Duration;

use std::sync::Arc;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use tito::backend::embedded::Embedded;
#[cfg(feature = "tikv")]
use tito::backend::tikv::TiKV;
use tito::inbox::{Inbox, InboxModel};
use tito::inspect;
use tito::model::TitoModelTrait;
use tito::{TitoEngine, TitoError, TitoResult};
use tito_admin::InboxSource;

mod cli;
mod commands;
mod remote;
mod rerun;
mod typing;

use cli::{Cli, Command, KeysCommand, StoreCommand};
use remote::Remote;
use typing::{ModelOps, Typed, Typing};

/// What a command failed with, as the user should read it.
pub(crate) struct Failure(String);

impl From<TitoError> for Failure {
    fn from(err: TitoError) -> Self {
        Failure(err.to_string())
    }
}

/// What a command prints on success.
pub(crate) type Outcome = Result<String, Failure>;

/// How a command line that did not succeed ended: failed (exit status 1) or, as the
/// application that ran it for `tito --url` said, misused (exit status 2, clap's text).
#[derive(Debug)]
pub(crate) enum Ended {
    Failed(String),
    Usage(String),
}

impl From<Failure> for Ended {
    fn from(Failure(message): Failure) -> Self {
        Ended::Failed(message)
    }
}

impl From<TitoError> for Ended {
    fn from(err: TitoError) -> Self {
        Ended::Failed(err.to_string())
    }
}

/// The command line, with the models and inboxes of an application registered.
#[derive(Default)]
pub struct Tool {
    models: Vec<Registered>,
    inboxes: Vec<RegisteredInbox>,
    write_grace: Option<std::time::Duration>,
}

/// Makes a registered model's operations on a store of any engine the tool knows (`None`
/// for an engine it does not).
type MakeModel = Box<dyn Fn(&dyn Any) -> Option<Arc<dyn ModelOps>> + Send + Sync>;

/// Makes a registered inbox model's source on a store, as [`MakeModel`].
type MakeInbox = Box<dyn Fn(&dyn Any) -> Option<TitoResult<Arc<dyn InboxSource>>> + Send + Sync>;

/// A model registered for every engine the tool can open.
struct Registered {
    table: String,
    make: MakeModel,
}

struct RegisteredInbox {
    table: String,
    make: MakeInbox,
}

/// `$on::<E, $t>(db)` for the first engine `E` this tool was built with that `db` is: the one
/// list of engines a registration tries.
macro_rules! on_any_engine {
    ($on:ident, $t:ty, $db:expr) => {{
        let db: &dyn Any = $db;
        let made = $on::<Embedded, $t>(db).or_else(|| $on::<tito::backend::memory::Memory, $t>(db));
        #[cfg(feature = "tikv")]
        let made = made.or_else(|| $on::<TiKV, $t>(db));
        #[cfg(feature = "sqlite")]
        let made = made.or_else(|| $on::<tito::backend::sqlite::Sqlite, $t>(db));
        made
    }};
}

/// `T`'s operations on `db` when it is an `E` store.
fn model_on<E: TitoEngine, T: TitoModelTrait>(db: &dyn Any) -> Option<Arc<dyn ModelOps>> {
    let db = db.downcast_ref::<E>()?;
    Some(Arc::new(Typed::<E, T>(db.clone().model::<T>())))
}

/// `M`'s inbox source on `db` when it is an `E` store.
fn inbox_on<E: TitoEngine, M: InboxModel>(
    db: &dyn Any,
) -> Option<TitoResult<Arc<dyn InboxSource>>> {
    let db = db.downcast_ref::<E>()?;
    Some(Inbox::<_, M>::new(db.clone()).map(|inbox| tito_admin::inbox_source(Arc::new(inbox), &[])))
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
            make: Box::new(|db| on_any_engine!(model_on, T, db)),
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
            make: Box::new(|db| on_any_engine!(inbox_on, M, db)),
        });
        self
    }

    /// The runner of `tito --url` command lines for an application's admin router: mount it
    /// with [`tito_admin::Admin::commands`], and operators run this tool's commands (with these
    /// models and inboxes) against `db` from anywhere the router is reachable:
    ///
    /// ```no_run
    /// # use serde::{Deserialize, Serialize};
    /// # use tito::TitoModel;
    /// # #[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
    /// # #[tito(table = "user")]
    /// # struct User { id: String }
    /// # async fn app(db: tito::backend::embedded::Embedded) -> Result<(), Box<dyn std::error::Error>> {
    /// let token = std::env::var("TITO_ADMIN_TOKEN")?;
    /// let commands = tito_cli::Tool::new().model::<User>().commands(db.clone());
    /// let admin = tito_admin::Admin::new(db).commands(&token, commands)?;
    /// let app = axum::Router::new().merge(admin.mount("/tito"));
    /// # let _ = app; Ok(()) }
    /// ```
    ///
    /// Then `TITO_TOKEN=... tito --url http://HOST:PORT/tito queue stats`. Commands that
    /// name their own stores (`store copy`, `store verify`) and `serve` are refused; the
    /// [write grace](Self::write_grace) is the application's, not this tool's.
    pub fn commands<E: TitoEngine>(self, db: E) -> Arc<dyn tito_admin::Commands> {
        Arc::new(Remote(Arc::new((self, db))))
    }

    /// The registered models and inboxes, opened on `db`.
    fn typing<E: TitoEngine>(&self, db: &E) -> TitoResult<Typing> {
        let any = db as &dyn Any;
        let models = self
            .models
            .iter()
            .filter_map(|m| Some((m.table.clone(), (m.make)(any)?)))
            .collect();
        let inboxes = self
            .inboxes
            .iter()
            .filter_map(|i| Some((i.table.clone(), (i.make)(any)?)))
            .map(|(table, source)| Ok((table, source?)))
            .collect::<TitoResult<_>>()?;
        Ok(Typing { models, inboxes })
    }

    /// Parses the process's arguments, runs the command, prints its output (errors on stderr)
    /// and returns the exit status.
    pub fn main(self) -> ExitCode {
        let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
        let cli = Cli::parse_from(std::iter::once("tito".into()).chain(args.iter().cloned()));
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
        match runtime.block_on(self.run(cli, args)) {
            Ok(output) => {
                if !output.is_empty() {
                    say(&output);
                }
                ExitCode::SUCCESS
            }
            Err(Ended::Failed(message)) => {
                eprintln!("tito: {message}");
                ExitCode::FAILURE
            }
            Err(Ended::Usage(text)) => {
                eprint!("{text}");
                ExitCode::from(2)
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
        let args: Vec<std::ffi::OsString> = args.into_iter().map(Into::into).collect();
        let all = std::iter::once(std::ffi::OsString::from("tito")).chain(args.iter().cloned());
        let cli = Cli::try_parse_from(all).map_err(|e| e.to_string())?;
        self.run(cli, args).await.map_err(|ended| match ended {
            Ended::Failed(m) | Ended::Usage(m) => m,
        })
    }

    /// Runs `cli`, parsed from `args` (the words after `tito`).
    async fn run(self, cli: Cli, args: Vec<std::ffi::OsString>) -> Result<String, Ended> {
        if let Command::Keys(command) = &cli.command {
            // Needs no store.
            return Ok(keys_command(command, cli.json)?);
        }
        if let Command::Store(command) = cli.command {
            // Names its stores itself.
            if cli.store.path.is_some() || cli.store.pd.is_some() || cli.store.url.is_some() {
                return Err(Ended::Failed(
                    "tito store names its stores as arguments (embedded:DIR, sqlite:DIR, \
                     tikv:HOST:PORT): leave out --path, --pd and --url"
                        .into(),
                ));
            }
            let timeout = Duration::from_secs(cli.timeout);
            let done = match command {
                StoreCommand::Copy {
                    from,
                    to,
                    resume,
                    overwrite,
                    batch,
                    rate,
                    no_count,
                    holders,
                } => {
                    let existing = match (resume, overwrite) {
                        (true, _) => tito::store::Existing::Resume,
                        (_, true) => tito::store::Existing::Overwrite,
                        _ => tito::store::Existing::Refuse,
                    };
                    let args = commands::moving::CopyArgs {
                        from,
                        to,
                        existing,
                        batch: batch as usize,
                        rate,
                        count: !no_count,
                        holders,
                    };
                    commands::moving::copy(args, cli.json, timeout).await
                }
                StoreCommand::Verify {
                    a,
                    b,
                    batch,
                    holders,
                } => {
                    let options = tito::store::VerifyOptions::new()
                        .batch(batch as usize)
                        .holders(holders);
                    commands::moving::verify(a, b, options, cli.json, timeout).await
                }
            };
            return Ok(done?);
        }
        if cli.store.token.is_some() && cli.store.url.is_none() {
            return Err(Ended::Failed(
                "--token goes with --url (the token of the application whose admin router runs \
                 the command)"
                    .into(),
            ));
        }
        if let Some(url) = &cli.store.url {
            if let Command::Serve { .. } = cli.command {
                return Err(Ended::Failed(format!(
                    "tito serve serves a store this process opens; the application at {url} \
                     serves its own dashboard there"
                )));
            }
            // An empty token is no token (an unset variable exported empty).
            let token = cli
                .store
                .token
                .clone()
                .filter(|t| !t.is_empty())
                .or_else(|| std::env::var("TITO_TOKEN").ok().filter(|t| !t.is_empty()));
            let timeout = Duration::from_secs(cli.timeout);
            return remote::send(url, token.as_deref(), remote::without_token(args)?, timeout)
                .await;
        }
        if let Some(path) = &cli.store.path {
            let db = open_embedded(path).await?;
            if let Some(grace) = self.write_grace {
                tito::schema::set_write_grace(&db, grace)?;
            }
            let typed = self.typing(&db)?;
            let result = execute(db.clone(), &typed, cli).await;
            drop(typed);
            // Closed before the process exits, so the next command can open the store at once.
            let _ = db.close().await;
            return Ok(result?);
        }
        let Some(endpoints) = cli.store.pd.clone() else {
            return Err(Ended::Failed(
                "which store? give --path DIR (embedded) or --pd HOST:PORT (TiKV)".into(),
            ));
        };
        Ok(self.run_tikv(endpoints, cli).await?)
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
        let db = connect_tikv(&endpoints, &cli.store, Duration::from_secs(cli.timeout)).await?;
        if let Some(grace) = self.write_grace {
            tito::schema::set_write_grace(&db, grace)?;
        }
        let typed = self.typing(&db)?;
        execute(db, &typed, cli).await
    }
}

/// Prints a line on stdout. A reader that went away (`tito queue stats | head -2`) ends the
/// output quietly, as other Unix tools do, instead of panicking on the closed pipe.
pub(crate) fn say(text: &str) {
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
                 Operate it live through that process's admin router: mount it there with \
                 commands (app.merge(tito_admin::Admin::new(db.clone()).commands(&token, \
                 tito_cli::Tool::new().commands(db))?.mount(\"/tito\"))) and run \
                 tito --url http://HOST:PORT/tito with TITO_TOKEN set",
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
async fn connect_tikv(
    endpoints: &[String],
    store: &cli::StoreArgs,
    timeout: Duration,
) -> Result<TiKV, Failure> {
    use tito::backend::tikv::{TiKVOptions, TlsFiles};
    let mut options = TiKVOptions::default()
        .partitions(16)
        .request_timeout(timeout)
        .connect_timeout(timeout);
    match (&store.tls_ca, &store.tls_cert, &store.tls_key) {
        (None, None, None) => {}
        (Some(ca), Some(cert), Some(key)) => {
            options = options.tls(TlsFiles::new(ca, cert, key));
        }
        _ => {
            return Err(Failure(
                "TLS takes three files: give --tls-ca, --tls-cert and --tls-key together".into(),
            ));
        }
    }
    if let Some(keyspace) = &store.keyspace {
        options = options.keyspace(keyspace.clone());
    }
    let connect = TiKV::connect_with(endpoints.to_vec(), options);
    let db = match tokio::time::timeout(timeout, connect).await {
        Ok(Ok(db)) => db,
        // The error says what failed (a refused option, a missing keyspace, a connection and
        // why): no "does not answer" in front of what is not about answering.
        Ok(Err(err)) => return Err(Failure(chain(&err))),
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

pub(crate) fn print<T: Serialize>(json: bool, value: &T, text: impl FnOnce() -> String) -> Outcome {
    if json {
        serde_json::to_string_pretty(value).map_err(|e| Failure(e.to_string()))
    } else {
        Ok(text())
    }
}

/// Names with their bounded counts: JSON objects `{name_field: name, count_field: count}`, or a
/// two-column table whose counts say `+` past their bound.
pub(crate) fn counts(
    json: bool,
    (name, count): (&str, &str),
    rows: &[(String, inspect::Count)],
) -> Outcome {
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

/// The line that reads the next page (`next`, given the cursor, prints the command), or
/// `(last page)`.
pub(crate) fn cursor_line(cursor: &Option<String>, next: impl Fn(&str) -> String) -> String {
    match cursor {
        Some(c) => format!("next page: {}", next(c)),
        None => "(last page)".into(),
    }
}

async fn execute<E: TitoEngine>(db: E, typed: &Typing, cli: Cli) -> Outcome {
    let json = cli.json;
    let rerun = rerun::Rerun::new(&cli.store, cli.timeout);
    match cli.command {
        Command::Queue(command) => commands::queue::run(db, command, json, &rerun).await,
        Command::Table(command) => commands::table::run(db, command, json, &rerun).await,
        Command::Index(command) => commands::index::run(db, typed, command, json, &rerun).await,
        Command::Kv(command) => commands::kv::run(db, command, json, &rerun).await,
        Command::Workflow(command) => commands::graph::workflow(db, command, json, &rerun).await,
        Command::Batch(command) => commands::graph::batch(db, command, json, &rerun).await,
        Command::Inbox(command) => commands::inbox::run(typed, command, json, &rerun).await,
        Command::Audit { table } => {
            commands::index::audit(typed.model(&table)?, &table, false, json).await
        }
        Command::Repair { table } => {
            commands::index::audit(typed.model(&table)?, &table, true, json).await
        }
        Command::Gc {
            retention,
            graph_retention,
        } => {
            let graphs = Duration::from_secs(graph_retention.unwrap_or(retention));
            commands::store::gc(&db, Duration::from_secs(retention), graphs, json).await
        }
        Command::Serve { listen } => commands::store::serve(db, typed, listen).await,
        Command::Keys(command) => keys_command(&command, json),
        Command::Store(_) => Err(Failure(
            "tito store names its own stores (embedded:DIR, sqlite:DIR, tikv:HOST:PORT) and \
             runs before any store is opened: run it as a command of its own"
                .into(),
        )),
    }
}

/// `tito keys`: needs no store, wherever it runs (here, or in an application for `--url`).
pub(crate) fn keys_command(command: &KeysCommand, json: bool) -> Outcome {
    match command {
        KeysCommand::Decode { key } => {
            let segments = inspect::key_segments(key.as_bytes())?;
            print(json, &segments, || segments.join("\n"))
        }
    }
}

/// Runs `batch` until it handles fewer than `full` items (nothing more is waiting); returns the
/// total handled.
pub(crate) async fn until_short(
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

/// A progress bar on stderr (hidden when stderr is not a terminal or output is JSON).
pub(crate) fn bar(len: Option<u64>, json: bool, message: String) -> ProgressBar {
    let bar = match len {
        _ if json || remote::running_remotely() => ProgressBar::hidden(),
        Some(len) => ProgressBar::new(len),
        None => ProgressBar::new_spinner(),
    };
    let style = ProgressStyle::with_template("{msg} {bar:40} {pos}/{len} rows ({per_sec}, {eta})")
        .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_message(message);
    bar
}

/// Unix milliseconds as an RFC 3339 time to the second.
pub(crate) fn millis_text(ms: u64) -> String {
    chrono::DateTime::<chrono::Utc>::from_timestamp_millis(i64::try_from(ms).unwrap_or(i64::MAX))
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
        .unwrap_or_else(|| ms.to_string())
}
