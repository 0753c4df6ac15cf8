//! An admin dashboard and JSON API for a Tito store, as an [axum] router to mount.
//!
//! The pages are server-rendered HTML (no JavaScript, no build step); every page has a JSON
//! twin under `/api`:
//!
//! | page | JSON | shows |
//! |---|---|---|
//! | `/` | `/api/overview` | queues (pending due now and later, how late the oldest is), inboxes, tables (row counts), kv namespaces, recent actions |
//! | `/queue?topic=T` | `/api/queue?topic=T` | per partition: due now, later, oldest due and lateness, lease holder and expiry; completed in the retention window and per minute; handler runs, failures and run times over the last minutes; each worker with its process, host, age and figures (from its report); a search by event id, key or owner (`find`); cluster members and coordinator; a page of one partition's pending rows (`partition`, `cursor`), of the newest completed ones, and of dead invocations (`dead_after`) with retry and discard actions |
//! | `/inbox?table=T&group=G` | `/api/inbox?...` | ready, delayed, leased, processed, bad rows; a page of rows (`state`, `cursor`) |
//! | `/table?name=T` | `/api/table?name=T` | row count, indexes with state and build progress, the last audit, a page of rows (`cursor`) |
//! | `/kv?namespace=N` | `/api/kv?namespace=N` | key count and a page of keys (`cursor`) |
//! | `/actions` | `/api/actions` | the actions taken through this router |
//! | `/backup` | `/api/backup` | the running backup's progress and the last one's result (with [`Admin::backups`]) |
//!
//! Without `topic` the queue page shows the default queue. Every read is bounded: counts stop at
//! [`tito::inspect::COUNT_BOUND`] per partition or table and show `10000+` past it, pages hold
//! at most [`PAGE`] rows and continue with the project's cursors.
//!
//! # Actions
//!
//! `POST /erase-owner` (one owner's invocations, pending and completed), `POST /dead-retry` and
//! `POST /dead-discard` (a dead invocation back to pending, or deleted), `POST /requeue` (an
//! inbox row back into a group as a fresh job), `POST /audit` (for
//! tables whose model was registered with [`Admin::model`]) and `POST /backup` (a consistent
//! backup of the store, while it serves, into a new directory under the one set with
//! [`Admin::backups`]; it runs in the background, `/backup` shows its progress). Each first answers with a
//! confirmation form; it runs only when posted with `confirm=yes`. Every action is logged
//! (`tracing`, target `tito_admin`, with the peer address) and kept in the last [`KEPT_ACTIONS`]
//! of `/actions`. A `POST` whose `Origin` header (or, without one, its `Referer`) names another
//! host than its `Host` header, or whose `Sec-Fetch-Site` is anything but `same-origin`, is
//! refused (a page elsewhere cannot post to the dashboard). Input an action can never accept (a
//! partition the queue does not have, a zero or oversized limit, a rate out of bounds, a key
//! that is not a pending row's) is refused before the confirmation, by the checks the action
//! itself makes. "Retry all dead" and "discard all dead" handle [`DEAD_BATCH`] invocations per
//! press and say how many are left.
//!
//! # Access
//!
//! With an [authorization hook](Admin::authorize), a request is served when the hook accepts
//! it. Without one, only requests from a loopback peer are served (the router reads the peer
//! from [`ConnectInfo`]; serve it with `into_make_service_with_connect_info::<SocketAddr>()`,
//! as [`serve`] does); everything else, including requests whose peer is unknown, is refused
//! with 403.
//!
//! # Examples
//!
//! ```no_run
//! use std::net::SocketAddr;
//! use tito::backend::embedded::Embedded;
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let db = Embedded::open("./data").await?;
//! let admin = tito_admin::Admin::new(db).authorize(|request| {
//!     request.headers().get("x-admin-token").is_some_and(|t| t == "secret")
//! });
//! let app = axum::Router::new().merge(admin.mount("/tito"));
//! let listener = tokio::net::TcpListener::bind("0.0.0.0:8080").await?;
//! axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
//! # Ok(())
//! # }
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

mod charts;
mod html;
mod sources;

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::Router;
use axum::extract::{ConnectInfo, Extension, Form, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Json, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use tito::inbox::{Inbox, InboxModel, InboxRowState};
use tito::inspect;
use tito::model::TitoModelTrait;
use tito::{TitoEngine, TitoError};

pub use sources::{Auditor, InboxSource};

/// An inbox as an [`InboxSource`] showing `groups`.
pub fn inbox_source<E: TitoEngine, M: InboxModel>(
    inbox: Arc<Inbox<E, M>>,
    groups: &[&str],
) -> Arc<dyn InboxSource> {
    let groups = groups.iter().map(|g| g.to_string()).collect();
    Arc::new(sources::TypedInbox { inbox, groups })
}

/// Rows per page.
pub const PAGE: usize = 50;

/// How many actions `/actions` keeps.
pub const KEPT_ACTIONS: usize = 200;

/// Listings (queues, tables, namespaces) show at most this many names.
pub const NAMES: usize = 200;

type Hook = Arc<dyn Fn(&Request) -> bool + Send + Sync>;

/// The admin router's configuration: the store, the inboxes and models to show, the
/// authorization hook.
pub struct Admin<E: TitoEngine> {
    db: E,
    inboxes: Vec<Arc<dyn InboxSource>>,
    auditors: BTreeMap<String, Arc<dyn Auditor>>,
    authorize: Option<Hook>,
    backups: Option<PathBuf>,
    commands: Option<(Token, Arc<dyn Commands>)>,
}

/// The version of the JSON API this router serves under `/api/v1/` (and, unversioned, under
/// `/api/`): fields are only ever added within a version; a change that removes or changes one
/// gets a new version, served beside this one.
pub const API_VERSION: u32 = 1;

/// The shortest token [`Admin::commands`] accepts, in bytes.
pub const MIN_TOKEN_LEN: usize = 16;

/// Runs `tito` command lines in the application's process, for `tito --url`
/// (`tito_cli::Tool::commands` makes one with the application's models).
pub trait Commands: Send + Sync + 'static {
    /// Runs one command line (the words after `tito`, as the operator typed them, without
    /// the token); never panics on bad input: a line the tool does not parse is a reply with
    /// exit status 2.
    fn run(&self, args: Vec<String>) -> futures::future::BoxFuture<'_, CommandReply>;
}

/// What a command line run through [`Commands`] printed, and its exit status (0 done, 1
/// failed, 2 bad usage), as `POST /api/v1/command` answers it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CommandReply {
    /// The exit status `tito` exits with.
    pub exit: u8,
    /// What it printed on standard output.
    pub stdout: String,
    /// What it printed on standard error (the reason of a failure).
    pub stderr: String,
}

/// `POST /api/v1/command`'s body.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CommandRequest {
    /// The command line's words after `tito`.
    pub args: Vec<String>,
}

/// `GET /api/v1`: what this router serves.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ApiInfo {
    /// [`API_VERSION`].
    pub api: u32,
    /// This crate's version.
    pub tito_admin: String,
    /// Whether `POST /api/v1/command` runs command lines ([`Admin::commands`]).
    pub commands: bool,
}

/// The application's secret for `tito --url`: compared in constant time, never logged.
#[derive(Clone)]
struct Token(Arc<[u8]>);

impl Token {
    /// Whether `request` carries this token as `Authorization: Bearer TOKEN`.
    fn admits(&self, request: &Request) -> bool {
        let Some(given) = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
        else {
            return false;
        };
        let mine = &self.0[..];
        // Every byte compared whatever the first difference, so the time taken says nothing
        // about how much of a guess was right.
        let mut differ = (given.len() != mine.len()) as u8;
        for (i, byte) in mine.iter().enumerate() {
            differ |= byte ^ given.get(i).copied().unwrap_or(!byte);
        }
        differ == 0
    }
}

/// One action taken through the router.
#[derive(Clone, Debug, Serialize)]
pub struct ActionRecord {
    /// When (Unix ms, host clock).
    pub at_ms: i64,
    /// Who: the peer address, when known.
    pub peer: Option<String>,
    /// What (`erase-owner`, `requeue`, `audit`).
    pub action: String,
    /// On what.
    pub target: String,
    /// What came of it.
    pub result: String,
}

struct Inner<E: TitoEngine> {
    db: E,
    inboxes: Vec<Arc<dyn InboxSource>>,
    auditors: BTreeMap<String, Arc<dyn Auditor>>,
    authorize: Option<Hook>,
    actions: Mutex<VecDeque<ActionRecord>>,
    backups: Option<PathBuf>,
    backup: Mutex<BackupStatus>,
    commands: Option<(Token, Arc<dyn Commands>)>,
}

/// The dashboard's backups: where they go, the running one, the last one.
#[derive(Clone, Debug, Default, Serialize)]
pub struct BackupStatus {
    /// The directory backups go into (each in a new directory under it); `None`: backups are
    /// not enabled ([`Admin::backups`]).
    pub directory: Option<String>,
    /// The backup running now.
    pub running: Option<BackupRun>,
    /// The last backup that ended.
    pub last: Option<BackupRun>,
}

/// One backup through the dashboard.
#[derive(Clone, Debug, Default, Serialize)]
pub struct BackupRun {
    /// The backup's directory (an embedded store; open it to restore).
    pub path: String,
    /// When it started (Unix ms, host clock).
    pub started_at_ms: i64,
    /// Keys copied so far.
    pub keys: u64,
    /// Bytes of keys and values copied so far.
    pub bytes: u64,
    /// How it ended: `None` while it runs.
    pub result: Option<String>,
    /// Whether it ended well.
    pub ok: bool,
}

impl<E: TitoEngine> Admin<E> {
    /// An admin over `db`: its queues, tables and kv namespaces are found in the store.
    pub fn new(db: E) -> Self {
        Admin {
            db,
            inboxes: Vec::new(),
            auditors: BTreeMap::new(),
            authorize: None,
            backups: None,
            commands: None,
        }
    }

    /// Lets operators run `tito` commands against this store from another process or host:
    /// `tito --url http://HOST:PORT/tito --token TOKEN queue stats` (or `TITO_TOKEN` in the
    /// environment) posts the command line to `POST /api/v1/command`, and `runner` (from
    /// `tito_cli::Tool::new().model::<User>().commands(db)`) runs it here, with the same
    /// messages, confirmations and exit statuses as on a store path. Every request that carries
    /// `Authorization: Bearer TOKEN` is served from any peer (reads of the JSON API too); the
    /// command endpoint serves nothing else, not even loopback peers. Send the token over a
    /// network you trust or through TLS you terminate in front of the router: `tito --url`
    /// speaks plain HTTP.
    ///
    /// # Errors
    ///
    /// A token shorter than [`MIN_TOKEN_LEN`] bytes, or with a byte a header cannot carry
    /// (a control character, a space at either end).
    pub fn commands(mut self, token: &str, runner: Arc<dyn Commands>) -> Result<Self, TitoError> {
        if token.len() < MIN_TOKEN_LEN {
            return Err(TitoError::invalid_argument(format!(
                "the admin token is {} bytes long: give at least {MIN_TOKEN_LEN} (a random one, \
                 such as the output of `openssl rand -hex 16`)",
                token.len()
            )));
        }
        if token.trim() != token || token.bytes().any(|b| b.is_ascii_control() || !b.is_ascii()) {
            return Err(TitoError::invalid_argument(
                "the admin token must be printable ASCII without spaces at its ends (it travels \
                 in an HTTP header)",
            ));
        }
        self.commands = Some((Token(token.as_bytes().into()), runner));
        Ok(self)
    }

    /// Lets operators back the store up from the dashboard (`POST /backup`): each backup is a
    /// consistent copy of the store as of one moment ([`tito::store::backup`]), written while
    /// the application runs into a new directory `backup-{UTC time}` under `dir` (created if
    /// missing). Restore by opening that directory with `Embedded::open`, or copy it into a
    /// store of another engine with `tito store copy`.
    pub fn backups(mut self, dir: impl Into<PathBuf>) -> Self {
        self.backups = Some(dir.into());
        self
    }

    /// Shows an inbox's `groups` (inboxes are typed by their model, so they are registered).
    pub fn inbox<M: InboxModel>(mut self, inbox: Arc<Inbox<E, M>>, groups: &[&str]) -> Self {
        let groups = groups.iter().map(|g| g.to_string()).collect();
        self.inboxes
            .push(Arc::new(sources::TypedInbox { inbox, groups }));
        self
    }

    /// Shows an inbox through its [`InboxSource`] ([`inbox_source`] makes one).
    pub fn inbox_source(mut self, source: Arc<dyn InboxSource>) -> Self {
        self.inboxes.push(source);
        self
    }

    /// Lets the page of `table` start an audit through `auditor`.
    pub fn auditor(mut self, table: impl Into<String>, auditor: Arc<dyn Auditor>) -> Self {
        self.auditors.insert(table.into(), auditor);
        self
    }

    /// Lets the table page of `T` start an audit.
    pub fn model<T: TitoModelTrait>(mut self) -> Self {
        let model = self.db.clone().model::<T>();
        self.auditors
            .insert(T::default().table(), Arc::new(sources::TypedModel(model)));
        self
    }

    /// Serves a request only when `hook` accepts it (a session check, a token header). Without
    /// a hook only loopback peers are served.
    pub fn authorize(mut self, hook: impl Fn(&Request) -> bool + Send + Sync + 'static) -> Self {
        self.authorize = Some(Arc::new(hook));
        self
    }

    /// The router mounted under `path` (`"/tito"`), to merge into an application:
    /// `app.merge(admin.mount("/tito"))`. The dashboard answers at `/tito`, and `/tito/`
    /// redirects there (a router nested with `app.nest("/tito", admin.router())` answers `/tito`
    /// only: axum routes the mount path with its slash to no nested route).
    ///
    /// # Panics
    ///
    /// When `path` does not start with `/` or is the root (serve [`Admin::router`] itself
    /// there), as [`Router::nest`] does.
    pub fn mount(self, path: &str) -> Router {
        let path = path.trim_end_matches('/');
        assert!(
            path.starts_with('/'),
            "tito_admin::Admin::mount: the path must start with '/' and not be the root (serve \
             Admin::router() for the root), got {path:?}"
        );
        let to = path.to_string();
        Router::new().nest(path, self.router()).route(
            &format!("{path}/"),
            get(move || async move { axum::response::Redirect::permanent(&to) }),
        )
    }

    /// The router: [`mount`](Self::mount) it, nest it (`app.nest("/tito", admin.router())`),
    /// or [`serve`] it.
    pub fn router(self) -> Router {
        let state = Arc::new(Inner {
            db: self.db,
            inboxes: self.inboxes,
            auditors: self.auditors,
            authorize: self.authorize,
            actions: Mutex::new(VecDeque::new()),
            backup: Mutex::new(BackupStatus {
                directory: self.backups.as_ref().map(|d| d.display().to_string()),
                ..BackupStatus::default()
            }),
            backups: self.backups,
            commands: self.commands,
        });
        let mut router = Router::new()
            .route("/", get(overview_page::<E>))
            .route("/queue", get(queue_page::<E>))
            .route("/charts", get(charts_page::<E>))
            .route("/inbox", get(inbox_page::<E>))
            .route("/table", get(table_page::<E>))
            .route("/kv", get(kv_page::<E>))
            .route("/graphs", get(graphs_page::<E>))
            .route("/workflow", get(workflow_page::<E>))
            .route("/batch", get(batch_page::<E>))
            .route("/actions", get(actions_page::<E>));
        // The JSON API: versioned, and unversioned as it was first served (the same answers).
        for prefix in ["/api", "/api/v1"] {
            router = router
                .route(prefix, get(api_info::<E>))
                .route(&format!("{prefix}/command"), post(command::<E>))
                .route(&format!("{prefix}/overview"), get(overview_json::<E>))
                .route(&format!("{prefix}/queue"), get(queue_json::<E>))
                .route(&format!("{prefix}/charts"), get(charts_json::<E>))
                .route(&format!("{prefix}/inbox"), get(inbox_json::<E>))
                .route(&format!("{prefix}/table"), get(table_json::<E>))
                .route(&format!("{prefix}/kv"), get(kv_json::<E>))
                .route(&format!("{prefix}/graphs"), get(graphs_json::<E>))
                .route(&format!("{prefix}/workflow"), get(workflow_json::<E>))
                .route(&format!("{prefix}/batch"), get(batch_json::<E>))
                .route(&format!("{prefix}/actions"), get(actions_json::<E>))
                .route(&format!("{prefix}/backup"), get(backup_json::<E>));
        }
        router
            .route("/erase-owner", post(erase_owner::<E>))
            .route("/requeue", post(requeue::<E>))
            .route("/dead-retry", post(dead_retry::<E>))
            .route("/dead-discard", post(dead_discard::<E>))
            .route("/queue-action", post(queue_action::<E>))
            .route("/audit", post(audit::<E>))
            .route("/backup", get(backup_page::<E>).post(backup::<E>))
            .layer(middleware::from_fn_with_state(state.clone(), guard::<E>))
            .with_state(state)
    }
}

/// Serves `router` on `listener` with the peer addresses the router's access rule needs, until
/// `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(
        listener,
        router.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
}

/// The peer of the request being served, when the server passes it ([`ConnectInfo`]).
#[derive(Clone, Copy, Debug)]
struct Peer(Option<SocketAddr>);

fn peer(request: &Request) -> Option<SocketAddr> {
    request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0)
}

async fn guard<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    request: Request,
    next: Next,
) -> Response {
    let token = state
        .commands
        .as_ref()
        .is_some_and(|(token, _)| token.admits(&request));
    let path = request.uri().path();
    if (path.ends_with("/api/v1/command") || path.ends_with("/api/command")) && !token {
        // Runs every operator action: the token only, whoever the peer is.
        return command_refusal(&state, &request);
    }
    let allowed = token
        || match &state.authorize {
            Some(hook) => hook(&request),
            None => peer(&request).is_some_and(|p| p.ip().is_loopback()),
        };
    if !allowed && state.authorize.is_none() && peer(&request).is_none() {
        tracing::warn!(target: "tito_admin", path = %request.uri().path(), "admin request refused: the peer address is unknown");
        return (
            StatusCode::FORBIDDEN,
            "refused: this request's peer address is unknown, so the rule that serves loopback \
             peers only cannot admit it. Serve the router with its connect info \
             (axum::serve(listener, app.into_make_service_with_connect_info::<std::net::SocketAddr>()), \
             or tito_admin::serve), or configure an authorization hook (Admin::authorize)\n",
        )
            .into_response();
    }
    if !allowed {
        tracing::warn!(target: "tito_admin", peer = ?peer(&request), path = %request.uri().path(), "admin request refused");
        return (
            StatusCode::FORBIDDEN,
            "refused: the Tito admin serves loopback peers only unless an authorization hook is configured (Admin::authorize)\n",
        )
            .into_response();
    }
    if request.method() == axum::http::Method::POST && !same_origin(request.headers()) {
        tracing::warn!(target: "tito_admin", peer = ?peer(&request), path = %request.uri().path(), "cross-origin admin post refused");
        return (
            StatusCode::FORBIDDEN,
            "refused: the request's Origin is not this host\n",
        )
            .into_response();
    }
    let base = html::base_of(&request);
    let mut request = request;
    let who = Peer(peer(&request));
    request.extensions_mut().insert(who);
    html::BASE.scope(base, next.run(request)).await
}

/// Whether a post comes from this dashboard's own pages: a browser's `Sec-Fetch-Site` (when
/// sent) says `same-origin` (`none`, a request the user started outside any page, is refused:
/// a form post never is one, while a typed address or a bookmark is a `GET`, which this check
/// does not concern); the `Origin`, or without one the `Referer`, names the request's `Host`. A request with none of them (a script, `curl`) is not a
/// browser's cross-site post and passes. The scheme is not compared: behind a proxy that ends
/// TLS the page is `https` while the dashboard serves plain HTTP, and a page of another scheme
/// on the same host and port cannot exist.
fn same_origin(headers: &HeaderMap) -> bool {
    let text = |name| {
        headers
            .get(name)
            .and_then(|v: &axum::http::HeaderValue| v.to_str().ok())
    };
    if let Some(site) = headers.get("sec-fetch-site")
        && site.as_bytes() != b"same-origin"
    {
        return false;
    }
    let host = text(header::HOST);
    let authority = |url: &str| {
        url.split_once("://").map(|(_, rest)| {
            rest.split(['/', '?', '#'])
                .next()
                .unwrap_or_default()
                .to_string()
        })
    };
    let named = match (headers.get(header::ORIGIN), text(header::REFERER)) {
        (Some(origin), _) => origin.to_str().ok().and_then(authority),
        (None, Some(referer)) => authority(referer),
        (None, None) => return true,
    };
    matches!((named, host), (Some(o), Some(h)) if o == h)
}

/// A failed page: the error's message, with 400 for bad input and 500 otherwise.
struct Failure(TitoError);

impl From<TitoError> for Failure {
    fn from(err: TitoError) -> Self {
        Failure(err)
    }
}

/// The HTTP status of a failure: a bad request, something not there, or the server's.
fn status_of(err: &TitoError) -> StatusCode {
    match err {
        TitoError::InvalidArgument(_) => StatusCode::BAD_REQUEST,
        TitoError::NotFound(_) => StatusCode::NOT_FOUND,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let status = status_of(&self.0);
        let body = html::page(
            "Error",
            &format!("<p class=\"error\">{}</p>", html::esc(&self.0.to_string())),
            None,
        );
        (status, Html(body)).into_response()
    }
}

/// A JSON route's failure: the same status as a page's, with `{"error": ".."}`.
struct JsonFailure(TitoError);

impl From<TitoError> for JsonFailure {
    fn from(err: TitoError) -> Self {
        JsonFailure(err)
    }
}

impl IntoResponse for JsonFailure {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "error": self.0.to_string() });
        (status_of(&self.0), Json(body)).into_response()
    }
}

type Page = Result<Html<String>, Failure>;
type Data = Result<Json<serde_json::Value>, JsonFailure>;

fn json<T: Serialize>(value: &T) -> Data {
    Ok(Json(
        serde_json::to_value(value).map_err(|e| JsonFailure(TitoError::from(e)))?,
    ))
}

// ---------------------------------------------------------------------------------------------
// Overview
// ---------------------------------------------------------------------------------------------

/// What the overview shows.
#[derive(Serialize)]
struct Overview {
    queues: Vec<inspect::QueueOverview>,
    inboxes: Vec<InboxSummary>,
    tables: Vec<TableSummary>,
    kv: Vec<NamespaceSummary>,
    actions: Vec<ActionRecord>,
}

#[derive(Serialize)]
struct InboxSummary {
    table: String,
    group: String,
    counts: tito::inbox::InboxCounts,
}

#[derive(Serialize)]
struct TableSummary {
    table: String,
    rows: inspect::Count,
}

#[derive(Serialize)]
struct NamespaceSummary {
    namespace: String,
    keys: inspect::Count,
}

async fn load_overview<E: TitoEngine>(state: &Inner<E>) -> Result<Overview, TitoError> {
    let db = &state.db;
    let mut queues = Vec::new();
    for info in inspect::queues(db, NAMES).await? {
        queues.push(inspect::queue_overview(db, info.topic.as_deref()).await?);
    }
    let mut inboxes = Vec::new();
    for inbox in &state.inboxes {
        for group in inbox.groups() {
            inboxes.push(InboxSummary {
                table: inbox.table().to_string(),
                group: group.clone(),
                counts: inbox.counts(group).await?,
            });
        }
    }
    let mut tables = Vec::new();
    for table in inspect::tables(db, NAMES).await? {
        tables.push(TableSummary {
            rows: inspect::table_count(db, &table).await?,
            table,
        });
    }
    let mut kv = Vec::new();
    for namespace in inspect::kv_namespaces(db, NAMES).await? {
        kv.push(NamespaceSummary {
            keys: inspect::kv_count(db, &namespace).await?,
            namespace,
        });
    }
    let actions = lock(&state.actions)
        .iter()
        .rev()
        .take(10)
        .cloned()
        .collect();
    Ok(Overview {
        queues,
        inboxes,
        tables,
        kv,
        actions,
    })
}

async fn overview_page<E: TitoEngine>(State(state): State<Arc<Inner<E>>>) -> Page {
    let started = Instant::now();
    let data = load_overview(&state).await?;
    Ok(Html(html::overview(&data, started)))
}

async fn overview_json<E: TitoEngine>(State(state): State<Arc<Inner<E>>>) -> Data {
    json(&load_overview(&state).await?)
}

// ---------------------------------------------------------------------------------------------
// Queue
// ---------------------------------------------------------------------------------------------

#[derive(Deserialize)]
struct QueueParams {
    topic: Option<String>,
    /// Parsed by the page (`partition_param`), so that text which is not a partition is
    /// answered with what to give.
    partition: Option<String>,
    cursor: Option<String>,
    completed_cursor: Option<String>,
    dead_after: Option<String>,
    /// An event id or a business key to find across partitions.
    find: Option<String>,
}

#[derive(Serialize)]
struct QueueData {
    overview: inspect::QueueOverview,
    partition: u32,
    pending: tito::TitoPage<inspect::QueueRow>,
    completed: tito::TitoPage<inspect::QueueRow>,
    /// The first dead invocations in event-id order (`dead_after` continues).
    dead: Vec<tito::queue::DeadInvocation>,
    /// The periodic schedules that have run on the queue.
    schedules: Vec<tito::queue::ScheduleView>,
    /// What a search found (`None` without a search).
    found: Option<(String, Vec<inspect::QueueRow>)>,
}

async fn load_queue<E: TitoEngine>(
    state: &Inner<E>,
    params: &QueueParams,
) -> Result<QueueData, TitoError> {
    let topic = params.topic.as_deref().filter(|t| !t.is_empty());
    // The overview and both pages in one snapshot: a row's failed attempt is never shown
    // beside a partition read before its worker leased it.
    let inspect::QueueView {
        overview,
        partition,
        pending,
        completed,
    } = match inspect::queue_view(
        &state.db,
        topic,
        partition_param(params.partition.as_deref())?,
        params.cursor.as_deref(),
        params.completed_cursor.as_deref(),
        PAGE,
    )
    .await
    {
        Err(TitoError::NotFound(_)) => return Err(no_such_queue(&state.db, topic).await),
        other => other?,
    };
    let dead_after = params.dead_after.as_deref().filter(|a| !a.is_empty());
    let dead = tito::queue::dead(&state.db, topic, dead_after, PAGE).await?;
    let schedules = tito::queue::schedules(&state.db, topic).await?;
    let found = match params
        .find
        .as_deref()
        .map(str::trim)
        .filter(|f| !f.is_empty())
    {
        Some(text) => Some((
            text.to_string(),
            inspect::queue_find(&state.db, topic, text, FIND_LIMIT).await?,
        )),
        None => None,
    };
    Ok(QueueData {
        overview,
        partition,
        pending,
        completed,
        dead,
        schedules,
        found,
    })
}

async fn queue_page<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Query(params): Query<QueueParams>,
) -> Page {
    let started = Instant::now();
    let data = load_queue(&state, &params).await?;
    Ok(Html(html::queue(&data, started)))
}

async fn queue_json<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Query(params): Query<QueueParams>,
) -> Data {
    json(&load_queue(&state, &params).await?)
}

// ---------------------------------------------------------------------------------------------
// Charts
// ---------------------------------------------------------------------------------------------

/// How often the charts page reloads itself unless asked otherwise (s).
pub(crate) const CHARTS_REFRESH: u64 = 15;

#[derive(Deserialize)]
struct ChartsParams {
    topic: Option<String>,
    /// A partition number (parsed by the page, so that other text is answered with what to
    /// give).
    partition: Option<String>,
    /// Seconds between reloads: 0 for none, else 5 to 3,600.
    refresh: Option<String>,
}

/// A queue's last hour: its overview (with the hour), the partition asked for, and how often
/// the page reloads.
#[derive(Serialize)]
struct ChartsData {
    #[serde(skip)]
    overview: inspect::QueueOverview,
    queue: String,
    partition: Option<u32>,
    now_ms: u64,
    /// The hour asked for (the queue's, or the partition's), oldest minute first.
    minutes: Vec<inspect::HourMinute>,
    /// Each partition's hour in brief (the whole queue only).
    partitions: Vec<inspect::PartitionHour>,
    #[serde(skip)]
    refresh: u64,
}

async fn load_charts<E: TitoEngine>(
    state: &Inner<E>,
    params: &ChartsParams,
) -> Result<ChartsData, TitoError> {
    let topic = params.topic.as_deref().filter(|t| !t.is_empty());
    let refresh_help = "give the seconds between reloads, 5 to 3600, or 0 for none";
    let refresh = match params.refresh.as_deref().map(str::trim) {
        None | Some("") => CHARTS_REFRESH,
        Some(text) => text.parse::<u64>().map_err(|_| {
            TitoError::invalid_argument(format!("refresh={text:?}: {refresh_help}"))
        })?,
    };
    if refresh != 0 && !(5..=3600).contains(&refresh) {
        return Err(TitoError::invalid_argument(format!(
            "refresh={refresh}: {refresh_help}"
        )));
    }
    let overview = inspect::queue_overview(&state.db, topic).await?;
    let Some(count) = overview.info.partitions else {
        return Err(no_such_queue(&state.db, topic).await);
    };
    let out_of_range = |text: &str| {
        TitoError::invalid_argument(format!(
            "partition={text:?}: {} has partitions 0 to {}",
            queue_named(topic),
            count - 1
        ))
    };
    let partition = match params.partition.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(text) => match text.parse::<u32>() {
            Ok(p) if p < count => Some(p),
            _ => return Err(out_of_range(text)),
        },
    };
    let (minutes, partitions) = match partition {
        Some(p) => (overview.hour_of(Some(p)), Vec::new()),
        None => (overview.hour.clone(), overview.partition_hours.clone()),
    };
    Ok(ChartsData {
        queue: overview.info.label.clone(),
        partition,
        now_ms: overview.now_ms,
        minutes,
        partitions,
        overview,
        refresh,
    })
}

async fn charts_page<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Query(params): Query<ChartsParams>,
) -> Page {
    let started = Instant::now();
    let data = load_charts(&state, &params).await?;
    Ok(Html(html::charts(&data, started)))
}

async fn charts_json<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Query(params): Query<ChartsParams>,
) -> Data {
    json(&load_charts(&state, &params).await?)
}

// ---------------------------------------------------------------------------------------------
// Inbox
// ---------------------------------------------------------------------------------------------

#[derive(Deserialize)]
struct InboxParams {
    table: String,
    group: String,
    state: Option<String>,
    cursor: Option<String>,
}

#[derive(Serialize)]
struct InboxData {
    table: String,
    group: String,
    state: Option<InboxRowState>,
    counts: tito::inbox::InboxCounts,
    rows: tito::TitoPage<tito::inbox::InboxRow>,
    bad: Vec<String>,
    groups: Vec<String>,
}

fn parse_state(state: Option<&str>) -> Result<Option<InboxRowState>, TitoError> {
    match state.filter(|s| !s.is_empty()) {
        None => Ok(None),
        Some(text) => serde_json::from_value(serde_json::Value::from(text))
            .map(Some)
            .map_err(|_| {
                TitoError::invalid_argument(format!(
                    "unknown inbox state {text:?} (ready, delayed, leased, processed)"
                ))
            }),
    }
}

fn find_inbox<'a, E: TitoEngine>(
    state: &'a Inner<E>,
    table: &str,
) -> Result<&'a Arc<dyn InboxSource>, TitoError> {
    state
        .inboxes
        .iter()
        .find(|i| i.table() == table)
        .ok_or_else(|| TitoError::NotFound(format!("no inbox {table:?} is registered")))
}

async fn load_inbox<E: TitoEngine>(
    state: &Inner<E>,
    params: &InboxParams,
) -> Result<InboxData, TitoError> {
    let inbox = find_inbox(state, &params.table)?;
    let wanted = parse_state(params.state.as_deref())?;
    Ok(InboxData {
        table: params.table.clone(),
        group: params.group.clone(),
        state: wanted,
        counts: inbox.counts(&params.group).await?,
        rows: inbox
            .scan(&params.group, wanted, params.cursor.as_deref(), PAGE)
            .await?,
        bad: inbox.bad_rows().await?,
        groups: inbox.groups().to_vec(),
    })
}

async fn inbox_page<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Query(params): Query<InboxParams>,
) -> Page {
    let started = Instant::now();
    let data = load_inbox(&state, &params).await?;
    Ok(Html(html::inbox(&data, started)))
}

async fn inbox_json<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Query(params): Query<InboxParams>,
) -> Data {
    json(&load_inbox(&state, &params).await?)
}

// ---------------------------------------------------------------------------------------------
// Table
// ---------------------------------------------------------------------------------------------

#[derive(Deserialize)]
struct TableParams {
    name: String,
    cursor: Option<String>,
}

/// How many rows the table page reads to count them by shape version.
const SHAPE_BOUND: u64 = 10_000;

#[derive(Serialize)]
struct TableData {
    table: String,
    rows: inspect::Count,
    schema: tito::schema::TableSchema,
    shapes: tito::schema::ShapeCounts,
    last_audit: Option<tito::schema::AuditReport>,
    can_audit: bool,
    page: tito::TitoPage<inspect::RawRow>,
}

async fn load_table<E: TitoEngine>(
    state: &Inner<E>,
    params: &TableParams,
) -> Result<TableData, TitoError> {
    let table = &params.name;
    Ok(TableData {
        table: table.clone(),
        rows: inspect::table_count(&state.db, table).await?,
        schema: tito::schema::table_schema(&state.db, table).await?,
        shapes: tito::schema::shape_versions(&state.db, table, SHAPE_BOUND).await?,
        last_audit: tito::schema::last_audit(&state.db, table).await?,
        can_audit: state.auditors.contains_key(table),
        page: inspect::table_rows(&state.db, table, params.cursor.as_deref(), PAGE).await?,
    })
}

async fn table_page<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Query(params): Query<TableParams>,
) -> Page {
    let started = Instant::now();
    let data = load_table(&state, &params).await?;
    Ok(Html(html::table(&data, started)))
}

async fn table_json<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Query(params): Query<TableParams>,
) -> Data {
    json(&load_table(&state, &params).await?)
}

// ---------------------------------------------------------------------------------------------
// Kv
// ---------------------------------------------------------------------------------------------

#[derive(Deserialize)]
struct KvParams {
    namespace: String,
    cursor: Option<String>,
}

#[derive(Serialize)]
struct KvData {
    namespace: String,
    keys: inspect::Count,
    page: tito::kv::KvPage,
}

async fn load_kv<E: TitoEngine>(state: &Inner<E>, params: &KvParams) -> Result<KvData, TitoError> {
    let kv = tito::kv::Kv::new(state.db.clone());
    Ok(KvData {
        namespace: params.namespace.clone(),
        keys: inspect::kv_count(&state.db, &params.namespace).await?,
        page: kv
            .list(&params.namespace, "", PAGE, params.cursor.as_deref())
            .await?,
    })
}

async fn kv_page<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Query(params): Query<KvParams>,
) -> Page {
    let started = Instant::now();
    let data = load_kv(&state, &params).await?;
    Ok(Html(html::kv(&data, started)))
}

async fn kv_json<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Query(params): Query<KvParams>,
) -> Data {
    json(&load_kv(&state, &params).await?)
}

// ---------------------------------------------------------------------------------------------
// Job graphs
// ---------------------------------------------------------------------------------------------

#[derive(Deserialize)]
struct GraphsParams {
    /// Continue after this workflow id.
    after_workflow: Option<String>,
    /// Continue after this batch id.
    after_batch: Option<String>,
}

#[derive(Serialize)]
struct GraphsData {
    workflows: Vec<tito::queue::graph::WorkflowSummary>,
    batches: Vec<tito::queue::graph::BatchSummary>,
}

async fn load_graphs<E: TitoEngine>(
    state: &Inner<E>,
    params: &GraphsParams,
) -> Result<GraphsData, TitoError> {
    let graphs = tito::queue::graph::Graphs::new(state.db.clone());
    Ok(GraphsData {
        workflows: graphs
            .workflows(params.after_workflow.as_deref(), PAGE)
            .await?,
        batches: graphs.batches(params.after_batch.as_deref(), PAGE).await?,
    })
}

async fn graphs_page<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Query(params): Query<GraphsParams>,
) -> Page {
    let started = Instant::now();
    let data = load_graphs(&state, &params).await?;
    Ok(Html(html::graphs(&data.workflows, &data.batches, started)))
}

async fn graphs_json<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Query(params): Query<GraphsParams>,
) -> Data {
    json(&load_graphs(&state, &params).await?)
}

#[derive(Deserialize)]
struct IdParams {
    #[serde(default)]
    id: Option<String>,
}

impl IdParams {
    /// The id asked for, or a bad request that says how to ask.
    fn id(&self, page: &str) -> Result<&str, TitoError> {
        self.id
            .as_deref()
            .ok_or_else(|| TitoError::invalid_argument(format!("name the {page}: /{page}?id=<id>")))
    }
}

async fn load_workflow<E: TitoEngine>(
    state: &Inner<E>,
    id: &str,
) -> Result<tito::queue::graph::WorkflowState, TitoError> {
    tito::queue::graph::Graphs::new(state.db.clone())
        .workflow(id)
        .await?
        .ok_or_else(|| TitoError::NotFound(format!("no workflow {id:?}")))
}

async fn workflow_page<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Query(params): Query<IdParams>,
) -> Page {
    let started = Instant::now();
    let data = load_workflow(&state, params.id("workflow")?).await?;
    Ok(Html(html::workflow(&data, started)))
}

async fn workflow_json<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Query(params): Query<IdParams>,
) -> Data {
    json(&load_workflow(&state, params.id("workflow")?).await?)
}

async fn load_batch<E: TitoEngine>(
    state: &Inner<E>,
    id: &str,
) -> Result<tito::queue::graph::BatchState, TitoError> {
    tito::queue::graph::Graphs::new(state.db.clone())
        .batch(id)
        .await?
        .ok_or_else(|| TitoError::NotFound(format!("no batch {id:?}")))
}

async fn batch_page<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Query(params): Query<IdParams>,
) -> Page {
    let started = Instant::now();
    let data = load_batch(&state, params.id("batch")?).await?;
    Ok(Html(html::batch(&data, started)))
}

async fn batch_json<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Query(params): Query<IdParams>,
) -> Data {
    json(&load_batch(&state, params.id("batch")?).await?)
}

// ---------------------------------------------------------------------------------------------
// Actions
// ---------------------------------------------------------------------------------------------

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl<E: TitoEngine> Inner<E> {
    fn record(&self, peer: Option<SocketAddr>, action: &str, target: String, result: String) {
        let record = ActionRecord {
            at_ms: chrono::Utc::now().timestamp_millis(),
            peer: peer.map(|p| p.to_string()),
            action: action.to_string(),
            target,
            result,
        };
        tracing::info!(
            target: "tito_admin",
            action = %record.action,
            target_object = %record.target,
            result = %record.result,
            peer = ?record.peer,
            "admin action"
        );
        let mut actions = lock(&self.actions);
        actions.push_back(record);
        while actions.len() > KEPT_ACTIONS {
            actions.pop_front();
        }
    }
}

async fn actions_page<E: TitoEngine>(State(state): State<Arc<Inner<E>>>) -> Page {
    let actions: Vec<ActionRecord> = lock(&state.actions).iter().rev().cloned().collect();
    Ok(Html(html::actions(&actions)))
}

async fn actions_json<E: TitoEngine>(State(state): State<Arc<Inner<E>>>) -> Data {
    let actions: Vec<ActionRecord> = lock(&state.actions).iter().rev().cloned().collect();
    json(&actions)
}

fn confirmed(confirm: &Option<String>) -> bool {
    confirm.as_deref() == Some("yes")
}

#[derive(Deserialize)]
struct EraseForm {
    topic: Option<String>,
    kind: String,
    id: String,
    confirm: Option<String>,
}

async fn erase_owner<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Extension(Peer(peer)): Extension<Peer>,
    Form(form): Form<EraseForm>,
) -> Page {
    let topic = form.topic.clone().filter(|t| !t.is_empty());
    let owner = tito::QueueOwner::new(form.kind.clone(), form.id.clone());
    owner_check(&owner)?;
    let target = format!(
        "{}, owner {}/{}",
        queue_named(topic.as_deref()),
        owner.kind,
        owner.id
    );
    if !confirmed(&form.confirm) {
        let fields = [
            ("topic", topic.clone().unwrap_or_default()),
            ("kind", form.kind.clone()),
            ("id", form.id.clone()),
        ];
        return Ok(Html(html::confirm(
            "Erase an owner's work",
            &format!("Delete every pending and completed invocation of {target}?"),
            "erase-owner",
            &fields,
        )));
    }
    let info = inspect::queues(&state.db, NAMES)
        .await?
        .into_iter()
        .find(|q| q.topic == topic)
        .ok_or_else(|| TitoError::NotFound(format!("no queue {target}")))?;
    let mut config = tito::QueueConfig::new(
        info.partitions.unwrap_or(1),
        std::time::Duration::from_secs(60),
    );
    config.topic = topic.clone();
    let queue = tito::Queue::new(state.db.clone(), config);
    let owner_ref = &owner;
    let queue_ref = &queue;
    let deleted = state
        .db
        .transaction(|tx| async move {
            queue_ref
                .delete_by_owner_matching_in_tx::<serde_json::Value, _>(owner_ref, |_| true, &tx)
                .await
        })
        .await?;
    let result = format!("{deleted} invocations deleted");
    state.record(peer, "erase-owner", target.clone(), result.clone());
    Ok(Html(html::done(
        "Owner erased",
        &format!("{target}: {result}."),
    )))
}

fn owner_check(owner: &tito::QueueOwner) -> Result<(), TitoError> {
    if owner.kind.is_empty() || owner.id.is_empty() {
        return Err(TitoError::invalid_argument(
            "an owner needs a kind and an id",
        ));
    }
    Ok(())
}

#[derive(Deserialize)]
struct RequeueForm {
    table: String,
    id: String,
    group: String,
    confirm: Option<String>,
}

async fn requeue<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Extension(Peer(peer)): Extension<Peer>,
    Form(form): Form<RequeueForm>,
) -> Page {
    let inbox = find_inbox(&state, &form.table)?;
    if form.id.is_empty() || form.group.is_empty() {
        return Err(TitoError::invalid_argument("a requeue needs a row id and a group").into());
    }
    let target = format!(
        "inbox {:?}, row {:?} into group {:?}",
        form.table, form.id, form.group
    );
    if !confirmed(&form.confirm) {
        let fields = [
            ("table", form.table.clone()),
            ("id", form.id.clone()),
            ("group", form.group.clone()),
        ];
        return Ok(Html(html::confirm(
            "Move a row back to ready",
            &format!("Move {target} as a fresh job (attempts 0, no delay, no lease)?"),
            "requeue",
            &fields,
        )));
    }
    inbox.requeue(&form.id, &form.group).await?;
    state.record(peer, "requeue", target.clone(), "moved".into());
    Ok(Html(html::done(
        "Row requeued",
        &format!("{target}: moved."),
    )))
}

#[derive(Deserialize)]
struct DeadForm {
    topic: Option<String>,
    id: String,
    confirm: Option<String>,
}

impl DeadForm {
    fn topic(&self) -> Option<&str> {
        self.topic.as_deref().filter(|t| !t.is_empty())
    }

    fn target(&self) -> String {
        format!(
            "{}, dead invocation {:?}",
            queue_named(self.topic()),
            self.id
        )
    }

    fn fields(&self) -> [(&'static str, String); 2] {
        [
            ("topic", self.topic().unwrap_or_default().to_string()),
            ("id", self.id.clone()),
        ]
    }
}

async fn dead_retry<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Extension(Peer(peer)): Extension<Peer>,
    Form(form): Form<DeadForm>,
) -> Page {
    dead_action(&state, peer, form, DeadAction::Retry).await
}

async fn dead_discard<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Extension(Peer(peer)): Extension<Peer>,
    Form(form): Form<DeadForm>,
) -> Page {
    dead_action(&state, peer, form, DeadAction::Discard).await
}

/// What an operator does to a dead invocation.
#[derive(Clone, Copy)]
enum DeadAction {
    Retry,
    Discard,
}

/// A dead invocation retried or discarded: a confirmation form first, then the action, logged.
async fn dead_action<E: TitoEngine>(
    state: &Inner<E>,
    peer: Option<SocketAddr>,
    form: DeadForm,
    action: DeadAction,
) -> Page {
    let (name, verb, title, question, done_title) = match action {
        DeadAction::Retry => (
            "dead-retry",
            "a retry",
            "Retry a dead invocation",
            "Move {target} back to pending (attempt 1, due now)?",
            "Dead invocation retried",
        ),
        DeadAction::Discard => (
            "dead-discard",
            "a discard",
            "Discard a dead invocation",
            "Delete {target} for good (its event id may be published again)?",
            "Dead invocation discarded",
        ),
    };
    if form.id.is_empty() {
        return Err(TitoError::invalid_argument(format!("{verb} needs an event id")).into());
    }
    let target = form.target();
    if !confirmed(&form.confirm) {
        return Ok(Html(html::confirm(
            title,
            &question.replace("{target}", &target),
            name,
            &form.fields(),
        )));
    }
    let result = match action {
        DeadAction::Retry => {
            match tito::queue::retry_dead(&state.db, form.topic(), &form.id).await? {
                true => "pending again",
                false => "not dead",
            }
        }
        DeadAction::Discard => {
            match tito::queue::discard_dead(&state.db, form.topic(), &form.id).await? {
                true => "discarded",
                false => "not dead",
            }
        }
    };
    state.record(peer, name, target.clone(), result.into());
    Ok(Html(html::done(
        done_title,
        &format!("{target}: {result}."),
    )))
}

/// One of the queue page's operator forms: `action` names it, the other fields are its
/// arguments (empty ones are absent).
#[derive(Deserialize, Default)]
struct QueueActionForm {
    action: String,
    topic: Option<String>,
    partition: Option<String>,
    id: Option<String>,
    kind: Option<String>,
    owner: Option<String>,
    key: Option<String>,
    why: Option<String>,
    concurrency: Option<String>,
    key_concurrency: Option<String>,
    rate: Option<String>,
    key_rate: Option<String>,
    /// For "retry all" and "discard all": how many earlier presses handled (the progress the
    /// next page shows).
    so_far: Option<String>,
    confirm: Option<String>,
}

/// A form field's value, `None` when absent or blank.
fn field(value: &Option<String>) -> Option<&str> {
    value.as_deref().map(str::trim).filter(|v| !v.is_empty())
}

/// A form field that must be there.
fn required<'a>(value: &'a Option<String>, what: &str) -> Result<&'a str, TitoError> {
    field(value).ok_or_else(|| TitoError::invalid_argument(format!("{what} is needed")))
}

/// A form field that, when given, is a whole number.
fn number<T: std::str::FromStr>(
    value: &Option<String>,
    what: &str,
) -> Result<Option<T>, TitoError> {
    field(value)
        .map(|v| {
            v.parse().map_err(|_| {
                TitoError::invalid_argument(format!("{what} must be a whole number, not {v:?}"))
            })
        })
        .transpose()
}

/// How many pending rows of a key's partition a search reads at most.
const FIND_LIMIT: usize = 1000;

/// How many dead invocations one press of "retry all" or "discard all" handles (one bounded
/// transaction each); the page it answers with says how many are left and continues.
pub const DEAD_BATCH: usize = 100;

/// The queue page's operator actions: pause and resume (the queue or one partition), cancel
/// one invocation or an owner's, set and lift limits, set a row aside, retry or discard every
/// dead invocation. Each asks for confirmation first, then runs and is logged as the other
/// actions are.
/// How confirmations, results and the action log name a queue: a topic quoted, the queue
/// without a topic in words (no topic reads like that), so a queue whose topic is `default`
/// and the queue without a topic are told apart.
/// A queue's page's `partition`: absent or empty for none, else a partition number.
fn partition_param(text: Option<&str>) -> Result<Option<u32>, TitoError> {
    match text.map(str::trim) {
        None | Some("") => Ok(None),
        Some(text) => text.parse().map(Some).map_err(|_| {
            TitoError::invalid_argument(format!(
                "partition={text:?}: give a partition number of the queue (0 or more)"
            ))
        }),
    }
}

/// The answer for a queue the store does not have: which queues it has.
async fn no_such_queue<E: TitoEngine>(db: &E, topic: Option<&str>) -> TitoError {
    let known: Vec<String> = inspect::queues(db, NAMES)
        .await
        .map(|queues| {
            queues
                .iter()
                .filter(|q| q.partitions.is_some())
                .map(|q| queue_named(q.topic.as_deref()))
                .collect()
        })
        .unwrap_or_default();
    let listed = if known.is_empty() {
        "it has none".to_string()
    } else {
        format!("its queues: {}", known.join(", "))
    };
    TitoError::NotFound(match topic {
        Some(topic) => format!("no queue {topic:?} in this store ({listed})"),
        None => format!("the queue without a topic is not in this store ({listed})"),
    })
}

pub(crate) fn queue_named(topic: Option<&str>) -> String {
    match topic {
        Some(topic) => format!("queue {topic:?}"),
        None => "the queue without a topic".to_string(),
    }
}

async fn queue_action<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Extension(Peer(peer)): Extension<Peer>,
    Form(form): Form<QueueActionForm>,
) -> Page {
    let db = &state.db;
    let topic = field(&form.topic);
    let named = queue_named(topic);
    let partition: Option<u32> = number(&form.partition, "the partition")?;
    let why = field(&form.why).unwrap_or("from the dashboard");
    let scope = partition.map_or(named.clone(), |p| format!("{named}, partition {p}"));
    // Input that can never succeed is refused now, by the checks the action itself makes,
    // rather than after a confirmation.
    if let ("pause" | "resume", Some(p)) = (form.action.as_str(), partition) {
        tito::queue::check_partition(db, topic, p).await?;
    }
    // What the action is, as the log and the confirmation say it; then the action itself.
    let (title, target, question) = match form.action.as_str() {
        "pause" => {
            tito::queue::check_pause_reason(topic, why)?;
            (
                "Pause",
                scope.clone(),
                format!("Pause {scope} (\"{why}\")? Workers start nothing there within 0.5 s."),
            )
        }
        "resume" => ("Resume", scope.clone(), format!("Resume {scope}?")),
        "cancel" => {
            let id = required(&form.id, "an event id")?;
            tito::queue::check_cancel_reason(topic, why)?;
            let target = format!("{named}, invocation {id:?}");
            (
                "Cancel an invocation",
                target.clone(),
                format!("Cancel {target} (\"{why}\")?"),
            )
        }
        "cancel-owner" => {
            let owner = tito::QueueOwner::new(
                required(&form.kind, "an owner kind")?,
                required(&form.owner, "an owner id")?,
            );
            owner_check(&owner)?;
            tito::queue::check_cancel_reason(topic, why)?;
            let target = format!("{named}, owner {}/{}", owner.kind, owner.id);
            (
                "Cancel an owner's work",
                target.clone(),
                format!("Cancel every pending invocation of {target} (\"{why}\")?"),
            )
        }
        "limits" => {
            let limits = form_limits(&form)?;
            tito::queue::check_limits(topic, &limits)?;
            let target = format!("{named}, limits");
            let what = if limits.is_none() {
                "Lift every limit of".to_string()
            } else {
                format!("Set {} on", describe_limits(&limits))
            };
            ("Set limits", target, format!("{what} {named}?"))
        }
        "set-aside" => {
            let key = required(&form.key, "the key of a pending row")?;
            tito::queue::check_set_aside_key(db, topic, key).await?;
            let target = format!("{named}, row {key:?}");
            (
                "Set a row aside",
                target.clone(),
                format!("Move {target} out of its partition (\"{why}\")?"),
            )
        }
        "retry-all-dead" => (
            "Retry every dead invocation",
            format!("{named}, every dead invocation"),
            format!("Move every dead invocation of {named} back to pending (attempt 1, due now)?"),
        ),
        "discard-all-dead" => (
            "Discard every dead invocation",
            format!("{named}, every dead invocation"),
            format!("Delete every dead invocation of {named} for good?"),
        ),
        other => {
            return Err(TitoError::invalid_argument(format!("no queue action {other:?}")).into());
        }
    };
    if !confirmed(&form.confirm) {
        let fields: Vec<(&str, String)> = [
            ("action", Some(form.action.as_str())),
            ("topic", topic),
            ("partition", field(&form.partition)),
            ("id", field(&form.id)),
            ("kind", field(&form.kind)),
            ("owner", field(&form.owner)),
            ("key", field(&form.key)),
            ("why", field(&form.why)),
            ("concurrency", field(&form.concurrency)),
            ("key_concurrency", field(&form.key_concurrency)),
            ("rate", field(&form.rate)),
            ("key_rate", field(&form.key_rate)),
        ]
        .into_iter()
        .filter_map(|(name, value)| value.map(|v| (name, v.to_string())))
        .collect();
        return Ok(Html(html::confirm(
            title,
            &question,
            "queue-action",
            &fields,
        )));
    }
    let result = match form.action.as_str() {
        "pause" => match tito::queue::pause(db, topic, partition, why).await? {
            true => "paused".to_string(),
            false => "already paused (its first reason kept)".to_string(),
        },
        "resume" => match tito::queue::resume(db, topic, partition).await? {
            true => "resumed".to_string(),
            false => "was not paused".to_string(),
        },
        "cancel" => {
            match tito::queue::cancel(db, topic, required(&form.id, "an event id")?, why).await? {
                true => "cancelled".to_string(),
                false => "not pending (nothing cancelled)".to_string(),
            }
        }
        "cancel-owner" => {
            let owner = tito::QueueOwner::new(
                required(&form.kind, "an owner kind")?,
                required(&form.owner, "an owner id")?,
            );
            let n = tito::queue::cancel_owner(db, topic, &owner, why).await?;
            format!("{n} pending invocations cancelled")
        }
        "limits" => {
            let limits = form_limits(&form)?;
            tito::queue::set_limits(db, topic, limits.clone()).await?;
            if limits.is_none() {
                "every limit lifted".to_string()
            } else {
                format!("set to {}", describe_limits(&limits))
            }
        }
        "set-aside" => match tito::queue::set_aside(
            db,
            topic,
            required(&form.key, "the key of a pending row")?,
            why,
        )
        .await?
        {
            true => "set aside".to_string(),
            false => "not pending (nothing moved)".to_string(),
        },
        action => {
            // One batch per press: at most DEAD_BATCH rows, one bounded transaction each;
            // what is left is counted and the page offers the next press.
            let retry = action == "retry-all-dead";
            let page = tito::queue::dead(db, topic, None, DEAD_BATCH).await?;
            let mut handled = 0usize;
            for dead in &page {
                let done = if retry {
                    tito::queue::retry_dead(db, topic, &dead.id).await?
                } else {
                    tito::queue::discard_dead(db, topic, &dead.id).await?
                };
                handled += usize::from(done);
            }
            let so_far: usize = number(&form.so_far, "so_far")?.unwrap_or(0);
            let total = so_far.saturating_add(handled);
            let left = inspect::queue_dead_count(db, topic, inspect::COUNT_BOUND).await?;
            let verb = if retry { "pending again" } else { "discarded" };
            let result = format!(
                "{} {verb}{}, {}",
                thousands(handled),
                if so_far > 0 {
                    format!(" ({} in all)", thousands(total))
                } else {
                    String::new()
                },
                if left.value == 0 {
                    "none left".to_string()
                } else {
                    format!("{} left", count_text(&left))
                }
            );
            state.record(
                peer,
                &format!("queue-{}", form.action),
                target.clone(),
                result.clone(),
            );
            let next = (left.value > 0).then(|| {
                let fields = [
                    ("action", form.action.clone()),
                    ("topic", topic.unwrap_or_default().to_string()),
                    ("so_far", total.to_string()),
                    ("confirm", "yes".to_string()),
                ];
                let button = format!(
                    "Continue: the next {}",
                    thousands(DEAD_BATCH.min(left.value as usize))
                );
                (fields, button)
            });
            return Ok(Html(html::batch_done(
                title,
                &format!("{target}: {result}."),
                next.as_ref()
                    .map(|(fields, button)| (&fields[..], button.as_str())),
            )));
        }
    };
    state.record(
        peer,
        &format!("queue-{}", form.action),
        target.clone(),
        result.clone(),
    );
    Ok(Html(html::done(title, &format!("{target}: {result}."))))
}

/// Limits in words, each rate exactly and in readable units: "concurrency 3, 1 per key, rate
/// 100 per 1 m, per-key rate 5 per 1.5 s".
fn describe_limits(limits: &tito::queue::Limits) -> String {
    let mut parts = Vec::new();
    if let Some(n) = limits.concurrency {
        parts.push(format!("concurrency {n}"));
    }
    if let Some(n) = limits.key_concurrency {
        parts.push(format!("{n} per key"));
    }
    if let Some(r) = &limits.rate {
        parts.push(format!("rate {r}"));
    }
    if let Some(r) = &limits.key_rate {
        parts.push(format!("per-key rate {r}"));
    }
    parts.join(", ")
}

/// `1,200`: a number with thousands separators.
fn thousands(n: usize) -> String {
    charts::thousands(n as u64)
}

/// A bounded count in words: `1,200`, or `10,000+` past its bound.
fn count_text(count: &inspect::Count) -> String {
    format!(
        "{}{}",
        thousands(count.value as usize),
        if count.more { "+" } else { "" }
    )
}

/// The limits a "limits" form asks for: every field blank lifts them all.
fn form_limits(form: &QueueActionForm) -> Result<tito::queue::Limits, TitoError> {
    let mut limits = tito::queue::Limits::none();
    limits.concurrency = number(&form.concurrency, "the concurrency")?;
    limits.key_concurrency = number(&form.key_concurrency, "the per-key concurrency")?;
    limits.rate = field(&form.rate)
        .map(tito::queue::Rate::parse)
        .transpose()?;
    limits.key_rate = field(&form.key_rate)
        .map(tito::queue::Rate::parse)
        .transpose()?;
    Ok(limits)
}

#[derive(Deserialize)]
struct AuditForm {
    table: String,
    confirm: Option<String>,
}

async fn audit<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Extension(Peer(peer)): Extension<Peer>,
    Form(form): Form<AuditForm>,
) -> Page {
    let auditor = state.auditors.get(&form.table).cloned().ok_or_else(|| {
        TitoError::NotFound(format!(
            "table {:?} has no registered model (Admin::model) to audit with",
            form.table
        ))
    })?;
    let target = format!("table {:?}", form.table);
    if !confirmed(&form.confirm) {
        return Ok(Html(html::confirm(
            "Audit a table",
            &format!("Audit {target}? It reads every row and index entry (nothing is changed)."),
            "audit",
            &[("table", form.table.clone())],
        )));
    }
    let report = auditor.audit().await?;
    let result = if report.is_clean() {
        format!("clean: {} rows, {} keys", report.rows, report.keys)
    } else {
        let found: u64 = report.findings.values().map(|f| f.count).sum();
        format!(
            "{found} findings in {} rows, {} keys",
            report.rows, report.keys
        )
    };
    state.record(peer, "audit", target.clone(), result.clone());
    Ok(Html(html::done(
        "Audit finished",
        &format!("{target}: {result}."),
    )))
}

// ---------------------------------------------------------------------------------------------
// Backups
// ---------------------------------------------------------------------------------------------

async fn backup_page<E: TitoEngine>(State(state): State<Arc<Inner<E>>>) -> Page {
    let status = lock(&state.backup).clone();
    Ok(Html(html::backup(&status)))
}

async fn backup_json<E: TitoEngine>(State(state): State<Arc<Inner<E>>>) -> Data {
    let status = lock(&state.backup).clone();
    json(&status)
}

#[derive(Deserialize)]
struct BackupForm {
    confirm: Option<String>,
}

async fn backup<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Extension(Peer(peer)): Extension<Peer>,
    Form(form): Form<BackupForm>,
) -> Page {
    let Some(dir) = state.backups.clone() else {
        return Err(Failure(TitoError::invalid_argument(
            "backups are not enabled: the application sets their directory with \
             Admin::backups",
        )));
    };
    if let Some(running) = &lock(&state.backup).running {
        return Err(Failure(TitoError::invalid_argument(format!(
            "a backup is running (into {}): wait for it to end",
            running.path
        ))));
    }
    if !confirmed(&form.confirm) {
        return Ok(Html(html::confirm(
            "Back up the store",
            &format!(
                "Back up the store into a new directory under {}? It copies every key as of \
                 one moment while the application goes on.",
                dir.display()
            ),
            "backup",
            &[],
        )));
    }
    let now = chrono::Utc::now();
    let path = dir.join(format!("backup-{}", now.format("%Y%m%d-%H%M%S-%3f")));
    let run = BackupRun {
        path: path.display().to_string(),
        started_at_ms: now.timestamp_millis(),
        ..BackupRun::default()
    };
    {
        let mut status = lock(&state.backup);
        if let Some(running) = &status.running {
            return Err(Failure(TitoError::invalid_argument(format!(
                "a backup is running (into {}): wait for it to end",
                running.path
            ))));
        }
        status.running = Some(run.clone());
    }
    std::fs::create_dir_all(&dir).map_err(|err| {
        lock(&state.backup).running = None;
        Failure(TitoError::storage(
            format!("cannot create the backup directory {}", dir.display()),
            err,
        ))
    })?;
    state.record(peer, "backup", run.path.clone(), "started".into());
    let task = state.clone();
    tokio::spawn(async move {
        let started = Instant::now();
        let progress_state = task.clone();
        let result =
            tito::store::backup(&task.db, &path, tito::store::CopyOptions::new(), move |p| {
                if let Some(running) = &mut lock(&progress_state.backup).running {
                    running.keys = p.keys_written;
                    running.bytes = p.bytes_written;
                }
            })
            .await;
        let (result, ok) = match result {
            Ok(report) => (
                format!(
                    "{} keys ({} bytes) in {:.1} s",
                    report.progress.keys_written,
                    report.progress.bytes_written,
                    started.elapsed().as_secs_f64()
                ),
                true,
            ),
            Err(err) => (format!("failed: {err}"), false),
        };
        let mut status = lock(&task.backup);
        if let Some(mut run) = status.running.take() {
            run.result = Some(result.clone());
            run.ok = ok;
            status.last = Some(run);
        }
        drop(status);
        task.record(peer, "backup", path.display().to_string(), result);
    });
    Ok(Html(html::done(
        "Backup started",
        &format!(
            "The backup into {} runs in the background: its progress is on the backup page.",
            run.path
        ),
    )))
}

// ---------------------------------------------------------------------------------------------
// The versioned API and `tito --url`
// ---------------------------------------------------------------------------------------------

async fn api_info<E: TitoEngine>(State(state): State<Arc<Inner<E>>>) -> Json<ApiInfo> {
    Json(ApiInfo {
        api: API_VERSION,
        tito_admin: env!("CARGO_PKG_VERSION").to_string(),
        commands: state.commands.is_some(),
    })
}

/// A JSON error: `{"error": message}` with `status`.
fn json_error(status: StatusCode, message: &str) -> Response {
    (status, Json(serde_json::json!({ "error": message }))).into_response()
}

/// Why a command request without the right token is refused.
fn command_refusal<E: TitoEngine>(state: &Inner<E>, request: &Request) -> Response {
    tracing::warn!(target: "tito_admin", peer = ?peer(request), "admin command refused: no valid token");
    if state.commands.is_none() {
        return json_error(
            StatusCode::FORBIDDEN,
            "this application's admin router runs no commands: it enables them with \
             Admin::commands(token, tito_cli::Tool::new().commands(db))",
        );
    }
    let given = request.headers().contains_key(header::AUTHORIZATION);
    json_error(
        StatusCode::UNAUTHORIZED,
        if given {
            "refused: the token is not this application's (tito --token TOKEN, or TITO_TOKEN in \
             the environment)"
        } else {
            "refused: commands need the application's token (tito --token TOKEN, or TITO_TOKEN \
             in the environment)"
        },
    )
}

async fn command<E: TitoEngine>(
    State(state): State<Arc<Inner<E>>>,
    Extension(Peer(peer)): Extension<Peer>,
    body: axum::body::Bytes,
) -> Response {
    let Some((_, runner)) = &state.commands else {
        return json_error(StatusCode::FORBIDDEN, "this router runs no commands");
    };
    let request: CommandRequest = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(err) => {
            return json_error(
                StatusCode::BAD_REQUEST,
                &format!("the body is not a command request ({{\"args\": [..]}}): {err}"),
            );
        }
    };
    // Quoted as a shell reads it back, so the log shows which words were one argument.
    let line = request
        .args
        .iter()
        .map(|word| shell_word(word))
        .collect::<Vec<_>>()
        .join(" ");
    let reply = runner.run(request.args).await;
    let result = match reply.exit {
        0 => "done".to_string(),
        status => format!(
            "exit {status}: {}",
            reply.stderr.lines().next().unwrap_or_default()
        ),
    };
    tracing::info!(target: "tito_admin", peer = ?peer, command = %line, %result, "admin command");
    state.record(peer, "command", line, result);
    Json(reply).into_response()
}

/// `word` as a POSIX shell reads it back: as it is when every character is plain, else in
/// single quotes (a quote inside written `'\''`).
fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=,@+%".contains(c));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}
