//! The SQLite engine: Tito's storage contract on SQLite (through `rusqlite`, SQLite compiled
//! in), a B-tree in one file of a local directory. Behind the `sqlite` feature.
//!
//! # How the contract is kept
//!
//! One table holds every key: `kv(k, v, csn)`, `k` the primary key of a table without row ids
//! (the B-tree is ordered by key, bytewise), `v` the value or `NULL` for a deleted key (a
//! tombstone), `csn` the commit sequence number of the transaction that wrote it last.
//!
//! - **Snapshot isolation.** A transaction reads through a connection of its own (kept in a
//!   pool) inside an SQLite read transaction, which in WAL mode sees the database as of its
//!   first read: that read is the store's commit sequence number, so the snapshot and the number
//!   it was taken at are one. Writes are buffered in the transaction and overlay its reads.
//! - **Write-write conflicts.** One write connection applies commits. For each it checks, inside
//!   its SQLite write transaction, that no key the transaction writes or locked carries a
//!   sequence number above the transaction's snapshot; a conflicting commit writes nothing and
//!   fails with [`TitoError::Conflict`]. Deleted keys keep a tombstone while an open snapshot
//!   older than the delete exists, so a delete conflicts like a write; tombstones are purged
//!   once no snapshot can need them.
//! - **Group commit.** Committing tasks queue their writes; the one that gets the write
//!   connection applies every commit waiting by then (or refuses it) in one SQLite transaction
//!   and syncs once for all; the others find their answers ready. No thread is handed work:
//!   the commit runs on the committing task (through `block_in_place` on a multi-threaded
//!   runtime).
//! - **Durability.** [`Durability::Immediate`] runs the write connection with `synchronous=FULL` (each
//!   batch is synced before its commits return); [`Durability::Buffered`] with `NORMAL` (WAL
//!   frames reach the operating system at commit, the disk at checkpoints: a process crash loses
//!   nothing, a power loss may lose the last commits).
//! - **Versions** come from the same kind of oracle as the embedded engine's: the wall clock in
//!   the layout of TiKV's timestamps, strictly increasing, with a high-water mark persisted up to
//!   three seconds ahead and written back exactly at [`Sqlite::close`]; an open after a crash
//!   waits until the wall clock passes it (at most those three seconds).
//! - **Unknown outcomes.** A failure of SQLite's `COMMIT` of a batch (an I/O error while the log
//!   is written or synced) is [`TitoError::CommitOutcomeUnknown`] for every commit of the batch;
//!   a failure before it (a read of the conflict check, a write into the open transaction) rolls
//!   the batch back and is a plain storage error.
//! - **One owner.** The directory's `LOCK` file (a database SQLite keeps locked exclusively) is
//!   locked while the store is open: a second process is refused, and so is a second open in
//!   this process.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rusqlite::{Connection, OpenFlags, OptionalExtension, params};

use crate::backend::embedded::{
    Durability, OpenInProcess, Oracle, blocking, now_millis, read, wait_out_mark,
};
use crate::engine::{
    self, KvPair, LOGICAL_BITS, RetryPolicy, TitoEngine, TitoTransaction, check_retention,
    check_scan,
};
use crate::error::{TitoError, TitoResult};

/// The database file in the store's directory.
pub const DATABASE_FILE: &str = "tito.sqlite3";
/// The lock file in the store's directory.
const LOCK_FILE: &str = "LOCK";
/// How many keys one transaction of [`Sqlite::delete_range`] removes.
const DELETE_RANGE_BATCH: usize = 1_000;
/// How many tombstones may wait before the writer purges those no snapshot needs.
const PURGE_AFTER: u64 = 1_000;

const SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS kv (k BLOB PRIMARY KEY NOT NULL, v BLOB, csn INTEGER NOT NULL) WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS tomb (csn INTEGER NOT NULL, k BLOB NOT NULL, PRIMARY KEY (csn, k)) WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY NOT NULL, n INTEGER NOT NULL) WITHOUT ROWID;
    INSERT OR IGNORE INTO meta (name, n) VALUES ('csn', 0), ('oracle', 0), ('safe-point', 0);
";

/// Options for [`Sqlite::open_with`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SqliteOptions {
    durability: Durability,
    partitions: u32,
    cache_bytes: u64,
    retry: RetryPolicy,
}

impl Default for SqliteOptions {
    fn default() -> Self {
        SqliteOptions {
            durability: Durability::Immediate,
            partitions: engine::DEFAULT_PARTITIONS,
            cache_bytes: 4 << 20,
            retry: RetryPolicy::default(),
        }
    }
}

impl SqliteOptions {
    /// The defaults: durable commits, [`engine::DEFAULT_PARTITIONS`] partitions, a 4 MiB page
    /// cache per connection.
    pub fn new() -> Self {
        Self::default()
    }

    /// How commits reach the disk (default [`Durability::Immediate`]).
    pub fn durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// The partition count queues on this store use by default.
    pub fn partitions(mut self, partitions: u32) -> Self {
        self.partitions = partitions;
        self
    }

    /// The page cache of each connection (1 MiB to 64 GiB; default 4 MiB). SQLite empties a
    /// connection's cache whenever another connection committed since its last transaction,
    /// which here is at nearly every transaction, so the cache serves one transaction's reads;
    /// the file is mapped into memory, and every connection reads it through the operating
    /// system's cache.
    pub fn cache_bytes(mut self, bytes: u64) -> Self {
        self.cache_bytes = bytes;
        self
    }

    /// The retry policy of [`TitoEngine::transaction`].
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }
}

/// A store on SQLite in a local directory. Cheap to clone; clones share the store.
#[derive(Clone)]
pub struct Sqlite {
    inner: Arc<Inner>,
    retry: RetryPolicy,
}

struct Inner {
    path: PathBuf,
    file: PathBuf,
    durability: Durability,
    partitions: u32,
    cache_bytes: u64,
    extensions: engine::Extensions,
    /// Read connections not in use.
    pool: Mutex<Vec<Connection>>,
    /// Commits and metadata writes waiting for the writer.
    queue: Mutex<Vec<Request>>,
    /// The write connection, held by the task that applies the waiting requests (`None` once
    /// closed).
    writer: tokio::sync::Mutex<Option<Writer>>,
    /// The last commit sequence number the writer made visible.
    published: Arc<AtomicU64>,
    /// Open snapshots (a commit sequence number at or below each one's), counted: tombstones
    /// above the oldest are kept.
    snapshots: Arc<Mutex<BTreeMap<u64, usize>>>,
    oracle: Mutex<Oracle>,
    meta_writes: tokio::sync::Mutex<()>,
    closed: AtomicBool,
    _lock: Mutex<Connection>,
    _claim: OpenInProcess,
    _temp: Option<tempfile::TempDir>,
}

impl std::fmt::Debug for Sqlite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sqlite")
            .field("path", &self.inner.path)
            .field("durability", &self.inner.durability)
            .finish()
    }
}

impl Drop for Inner {
    /// The last handle went without [`Sqlite::close`]: the clock's mark is written back here.
    fn drop(&mut self) {
        if !self.closed.swap(true, Ordering::SeqCst) {
            let last = crate::util::lock(&self.oracle).last;
            if let Some(mut writer) = self.writer.get_mut().take() {
                let _ = writer.write_meta("oracle", last);
            }
        }
    }
}

fn sql_err(what: &str, err: rusqlite::Error) -> TitoError {
    TitoError::storage(format!("sqlite store: {what}"), err)
}

/// Work for the writer.
enum Request {
    Commit {
        writes: WriteSet,
        locks: Vec<Vec<u8>>,
        snapshot: u64,
        reply: tokio::sync::oneshot::Sender<TitoResult<()>>,
    },
    /// Writes a metadata value durably.
    Meta {
        name: &'static str,
        value: u64,
        reply: tokio::sync::oneshot::Sender<TitoResult<()>>,
    },
}

impl Request {
    fn answer(self, result: TitoResult<()>) {
        let reply = match self {
            Request::Commit { reply, .. } | Request::Meta { reply, .. } => reply,
        };
        let _ = reply.send(result);
    }
}

fn open_connection(file: &Path, cache_bytes: u64) -> Result<Connection, rusqlite::Error> {
    let conn = Connection::open_with_flags(
        file,
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.busy_timeout(Duration::from_secs(30))?;
    conn.execute_batch(&format!(
        "PRAGMA journal_mode=WAL; PRAGMA cache_size=-{}; PRAGMA mmap_size={};",
        cache_bytes / 1024,
        0u64
    ))?;
    Ok(conn)
}

/// Takes the store's lock for this process: an exclusive lock SQLite holds on the `LOCK`
/// database for as long as the returned connection is open (released by the operating system
/// when the process dies). A second process is refused at once.
fn lock_directory(path: &Path) -> TitoResult<Connection> {
    let refused = |err: rusqlite::Error| TitoError::Storage {
        message: format!(
            "sqlite store: {} is locked by another process (one process owns a store)",
            path.display()
        ),
        source: Some(Box::new(err)),
    };
    let conn = Connection::open(path.join(LOCK_FILE))
        .map_err(|e| sql_err("cannot open its LOCK file", e))?;
    conn.execute_batch("PRAGMA locking_mode=EXCLUSIVE; BEGIN EXCLUSIVE;")
        .map_err(refused)?;
    Ok(conn)
}

impl Sqlite {
    /// Opens (or creates) a durable store in the directory `path`.
    pub async fn open(path: impl AsRef<Path>) -> TitoResult<Self> {
        Self::open_with(path, SqliteOptions::default()).await
    }

    /// Opens (or creates) a store in `path` with options.
    pub async fn open_with(path: impl AsRef<Path>, options: SqliteOptions) -> TitoResult<Self> {
        let db = Self::open_inner(path.as_ref().to_path_buf(), None, options)?;
        // After a crash, the clock continues from the wall clock, not from ahead of it.
        let mark = crate::util::lock(&db.inner.oracle).persisted_limit;
        wait_out_mark(mark).await;
        engine::gate::load(&db).await?;
        Ok(db)
    }

    /// A fresh store in a new temporary directory, removed with the last handle; commits are
    /// buffered. For tests.
    pub async fn temporary() -> TitoResult<Self> {
        let dir = tempfile::Builder::new()
            .prefix("tito-sqlite-")
            .tempdir()
            .map_err(|err| TitoError::storage("cannot create a temporary directory", err))?;
        let path = dir.path().to_path_buf();
        let db = Self::open_inner(
            path,
            Some(dir),
            SqliteOptions::default().durability(Durability::Buffered),
        )?;
        db.inner.extensions.get::<engine::gate::Gate>().mark_local();
        Ok(db)
    }

    fn open_inner(
        path: PathBuf,
        temp: Option<tempfile::TempDir>,
        options: SqliteOptions,
    ) -> TitoResult<Self> {
        let partitions = engine::check_partitions(options.partitions)?;
        options.retry.check()?;
        if !(1 << 20..=1 << 36).contains(&options.cache_bytes) {
            return Err(TitoError::invalid_argument(format!(
                "cache_bytes must be from 1 MiB to 64 GiB, not {}",
                options.cache_bytes
            )));
        }
        std::fs::create_dir_all(&path).map_err(|err| {
            TitoError::storage(format!("cannot create directory {}", path.display()), err)
        })?;
        let claim = OpenInProcess::claim(&path, "sqlite", "Sqlite::close")?;
        let lock = lock_directory(&path)?;
        let file = path.join(DATABASE_FILE);
        let conn =
            open_connection(&file, options.cache_bytes).map_err(|e| sql_err("cannot open", e))?;
        conn.execute_batch(SCHEMA)
            .map_err(|e| sql_err("cannot create its tables", e))?;
        conn.execute_batch(match options.durability {
            Durability::Immediate => "PRAGMA synchronous=FULL;",
            _ => "PRAGMA synchronous=NORMAL;",
        })
        .map_err(|e| sql_err("pragma", e))?;
        let meta = |name: &str| -> TitoResult<u64> {
            conn.query_row("SELECT n FROM meta WHERE name = ?1", [name], |r| {
                r.get::<_, i64>(0)
            })
            .map(|n| n as u64)
            .map_err(|e| sql_err("read metadata", e))
        };
        let (csn, mark) = (meta("csn")?, meta("oracle")?);
        let published = Arc::new(AtomicU64::new(csn));
        let snapshots: Arc<Mutex<BTreeMap<u64, usize>>> = Arc::default();
        let writer = Writer {
            conn,
            csn,
            tombs: 0,
            durability: options.durability,
            published: published.clone(),
            snapshots: snapshots.clone(),
        };
        let inner = Inner {
            file,
            durability: options.durability,
            partitions,
            cache_bytes: options.cache_bytes,
            extensions: engine::Extensions::new(),
            pool: Mutex::new(Vec::new()),
            queue: Mutex::new(Vec::new()),
            writer: tokio::sync::Mutex::new(Some(writer)),
            published,
            snapshots,
            oracle: Mutex::new(Oracle::starting_at(mark)),
            meta_writes: tokio::sync::Mutex::new(()),
            closed: AtomicBool::new(false),
            _lock: Mutex::new(lock),
            _claim: claim,
            _temp: temp,
            path,
        };
        inner
            .extensions
            .get::<engine::ExclusiveOpen>()
            .set(engine::random::random_u64());
        Ok(Sqlite {
            inner: Arc::new(inner),
            retry: options.retry,
        })
    }

    /// Whether `path` holds a store of this engine.
    pub fn is_store(path: impl AsRef<Path>) -> bool {
        path.as_ref().join(DATABASE_FILE).is_file()
    }

    /// The store's directory.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Writes the clock's mark back exactly and closes the store (the last connection to close
    /// checkpoints the log into the database). Every handle fails afterwards; closing again does nothing.
    pub async fn close(&self) -> TitoResult<()> {
        let _persisting = self.inner.meta_writes.lock().await;
        if self.inner.closed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let last = {
            let mut oracle = crate::util::lock(&self.inner.oracle);
            oracle.close();
            oracle.last
        };
        crate::util::lock(&self.inner.pool).clear();
        let mut writer = self.inner.writer.lock().await;
        // Whatever waits is applied first; later requests find the store closed.
        let waiting = std::mem::take(&mut *crate::util::lock(&self.inner.queue));
        let Some(mut open) = writer.take() else {
            return Ok(());
        };
        blocking(|| {
            open.apply_all(waiting);
            open.write_meta("oracle", last)
        })
    }

    /// Queues a request and waits for its answer. Group commit: the task that gets the write
    /// connection applies every request waiting by then in one SQLite transaction (one sync);
    /// the others find their answers ready when their turn comes.
    async fn send(
        &self,
        make: impl FnOnce(tokio::sync::oneshot::Sender<TitoResult<()>>) -> Request,
    ) -> TitoResult<()> {
        let (reply, mut answer) = tokio::sync::oneshot::channel();
        crate::util::lock(&self.inner.queue).push(make(reply));
        {
            let mut writer = self.inner.writer.lock().await;
            if let Ok(done) = answer.try_recv() {
                return done;
            }
            let waiting = std::mem::take(&mut *crate::util::lock(&self.inner.queue));
            match writer.as_mut() {
                Some(open) => blocking(|| open.apply_all(waiting)),
                None => {
                    for request in waiting {
                        request.answer(Err(closed()));
                    }
                }
            }
        }
        answer.await.map_err(|_| closed())?
    }

    async fn next_version(&self) -> TitoResult<u64> {
        loop {
            if let Some(next) = crate::util::lock(&self.inner.oracle).next(now_millis()) {
                return Ok(next);
            }
            let _persisting = self.inner.meta_writes.lock().await;
            if self.inner.closed.load(Ordering::SeqCst) {
                return Err(closed());
            }
            let Some(wanted) = crate::util::lock(&self.inner.oracle).wanted(now_millis()) else {
                continue; // another task moved it meanwhile
            };
            self.send(|reply| Request::Meta {
                name: "oracle",
                value: wanted,
                reply,
            })
            .await?;
            crate::util::lock(&self.inner.oracle).raise(wanted);
        }
    }

    fn connection(&self) -> TitoResult<Connection> {
        if let Some(conn) = crate::util::lock(&self.inner.pool).pop() {
            return Ok(conn);
        }
        open_connection(&self.inner.file, self.inner.cache_bytes)
            .map_err(|e| sql_err("cannot open a connection", e))
    }
}

fn closed() -> TitoError {
    TitoError::Storage {
        message: "sqlite store: the store is closed".into(),
        source: None,
    }
}

/// The write connection and what it keeps.
struct Writer {
    conn: Connection,
    csn: u64,
    tombs: u64,
    durability: Durability,
    published: Arc<AtomicU64>,
    snapshots: Arc<Mutex<BTreeMap<u64, usize>>>,
}

type Reply = tokio::sync::oneshot::Sender<TitoResult<()>>;

/// A transaction's buffered writes (a value, or `None` for a delete).
type WriteSet = Vec<(Vec<u8>, Option<Vec<u8>>)>;

/// One commit waiting for the writer: its writes, its locked keys, its snapshot, its answer.
type Pending = (WriteSet, Vec<Vec<u8>>, u64, Reply);

impl Writer {
    /// Applies `requests` in order: commits together (one SQLite transaction, one sync),
    /// metadata writes between them as they come.
    fn apply_all(&mut self, requests: Vec<Request>) {
        let mut commits = Vec::new();
        for request in requests {
            match request {
                Request::Commit {
                    writes,
                    locks,
                    snapshot,
                    reply,
                } => commits.push((writes, locks, snapshot, reply)),
                Request::Meta { name, value, reply } => {
                    self.commit_batch(std::mem::take(&mut commits));
                    let _ = reply.send(self.write_meta(name, value));
                }
            }
        }
        self.commit_batch(commits);
        if self.tombs >= PURGE_AFTER {
            self.purge();
        }
    }

    fn write_meta(&mut self, name: &str, value: u64) -> TitoResult<()> {
        let buffered = self.durability != Durability::Immediate;
        if buffered {
            let _ = self.conn.execute_batch("PRAGMA synchronous=FULL;");
        }
        let result = self
            .conn
            .execute(
                "UPDATE meta SET n = ?2 WHERE name = ?1",
                params![name, value as i64],
            )
            .map(|_| ())
            .map_err(|e| sql_err("write metadata", e));
        if buffered {
            let _ = self.conn.execute_batch("PRAGMA synchronous=NORMAL;");
        }
        result
    }

    /// Applies a batch of commits in one SQLite transaction: each is checked for conflicts and
    /// applied or refused; one sync for all.
    fn commit_batch(&mut self, commits: Vec<Pending>) {
        if commits.is_empty() {
            return;
        }
        if let Err(err) = self.conn.execute_batch("BEGIN IMMEDIATE") {
            for (.., reply) in commits {
                let _ = reply.send(Err(batch_err("begin a commit", &err)));
            }
            return;
        }
        let start_csn = self.csn;
        let start_tombs = self.tombs;
        let mut outcomes: Vec<(Reply, TitoResult<()>)> = Vec::with_capacity(commits.len());
        let mut failed: Option<rusqlite::Error> = None;
        for (writes, locks, snapshot, reply) in commits {
            if failed.is_some() {
                outcomes.push((reply, Ok(())));
                continue;
            }
            match self.apply(&writes, &locks, snapshot) {
                Ok(true) => outcomes.push((reply, Ok(()))),
                Ok(false) => outcomes.push((
                    reply,
                    Err(TitoError::conflict(
                        "sqlite store: another transaction committed a write to a key this one \
                         writes or locked after it started",
                    )),
                )),
                Err(err) => {
                    failed = Some(err);
                    outcomes.push((reply, Ok(())));
                }
            }
        }
        if let Some(err) = failed {
            // Nothing of the batch is kept: every commit of it fails, definitely.
            let _ = self.conn.execute_batch("ROLLBACK");
            self.csn = start_csn;
            self.tombs = start_tombs;
            for (reply, _) in outcomes {
                let _ = reply.send(Err(batch_err("commit", &err)));
            }
            return;
        }
        let committed = self
            .conn
            .execute(
                "UPDATE meta SET n = ?1 WHERE name = 'csn'",
                [self.csn as i64],
            )
            .and_then(|_| self.conn.execute_batch("COMMIT"));
        match committed {
            Ok(()) => {
                self.published.store(self.csn, Ordering::SeqCst);
                for (reply, outcome) in outcomes {
                    let _ = reply.send(outcome);
                }
            }
            Err(err) => {
                let _ = self.conn.execute_batch("ROLLBACK");
                // Whether the log holds the batch is decided when the store opens again.
                let stored: Option<i64> = self
                    .conn
                    .query_row("SELECT n FROM meta WHERE name = 'csn'", [], |r| r.get(0))
                    .optional()
                    .ok()
                    .flatten();
                self.csn = stored.map_or(start_csn, |n| n as u64);
                self.tombs = start_tombs;
                for (reply, outcome) in outcomes {
                    let answer = match outcome {
                        Ok(()) => Err(TitoError::CommitOutcomeUnknown {
                            message: format!(
                                "sqlite store: the commit of a batch failed while its log was \
                                 written; recovery decides whether it took effect: {err}"
                            ),
                            source: None,
                        }),
                        refused => refused,
                    };
                    let _ = reply.send(answer);
                }
            }
        }
    }

    /// Checks one commit against the keys' sequence numbers and applies it; `Ok(false)` on a
    /// conflict (nothing applied).
    fn apply(
        &mut self,
        writes: &[(Vec<u8>, Option<Vec<u8>>)],
        locks: &[Vec<u8>],
        snapshot: u64,
    ) -> Result<bool, rusqlite::Error> {
        {
            let mut check = self
                .conn
                .prepare_cached("SELECT csn FROM kv WHERE k = ?1")?;
            for key in writes.iter().map(|(k, _)| k).chain(locks) {
                let csn: Option<i64> = check.query_row([key], |r| r.get(0)).optional()?;
                if csn.is_some_and(|csn| csn as u64 > snapshot) {
                    return Ok(false);
                }
            }
        }
        self.csn += 1;
        let csn = self.csn as i64;
        let mut upsert = self.conn.prepare_cached(
            "INSERT INTO kv (k, v, csn) VALUES (?1, ?2, ?3) \
             ON CONFLICT (k) DO UPDATE SET v = excluded.v, csn = excluded.csn",
        )?;
        let mut tomb = self
            .conn
            .prepare_cached("INSERT OR IGNORE INTO tomb (csn, k) VALUES (?1, ?2)")?;
        let written: BTreeSet<&Vec<u8>> = writes.iter().map(|(k, _)| k).collect();
        for (key, value) in writes {
            upsert.execute(params![key, value, csn])?;
            if value.is_none() {
                tomb.execute(params![csn, key])?;
                self.tombs += 1;
            }
        }
        // A locked key counts as written by this commit: its number moves, its value stays (a
        // missing key gets a tombstone).
        let mut touch = self.conn.prepare_cached(
            "INSERT INTO kv (k, v, csn) VALUES (?1, NULL, ?2) \
             ON CONFLICT (k) DO UPDATE SET csn = excluded.csn",
        )?;
        for key in locks.iter().filter(|k| !written.contains(k)) {
            if touch.execute(params![key, csn])? > 0 {
                tomb.execute(params![csn, key])?;
                self.tombs += 1;
            }
        }
        Ok(true)
    }

    /// Deletes the tombstones no open snapshot can need (those at or below the oldest one).
    fn purge(&mut self) {
        let oldest = crate::util::lock(&self.snapshots)
            .keys()
            .next()
            .copied()
            .unwrap_or(self.csn);
        let purged = self.conn.execute_batch("BEGIN IMMEDIATE").and_then(|_| {
            self.conn.execute(
                "DELETE FROM kv WHERE v IS NULL AND k IN (SELECT k FROM tomb WHERE csn <= ?1) \
                 AND csn <= ?1",
                [oldest as i64],
            )?;
            let left = self
                .conn
                .execute("DELETE FROM tomb WHERE csn <= ?1", [oldest as i64]);
            left.and_then(|_| self.conn.execute_batch("COMMIT"))
        });
        match purged {
            Ok(()) => {
                self.tombs = self
                    .conn
                    .query_row("SELECT count(*) FROM tomb", [], |r| r.get::<_, i64>(0))
                    .map_or(0, |n| n as u64);
            }
            Err(err) => {
                let _ = self.conn.execute_batch("ROLLBACK");
                tracing::debug!(error = %err, "sqlite store: purging tombstones failed; tried again later");
            }
        }
    }
}

/// A storage error naming an SQLite error shared by the commits of a batch.
fn batch_err(what: &str, err: &rusqlite::Error) -> TitoError {
    TitoError::Storage {
        message: format!("sqlite store: {what}: {err}"),
        source: None,
    }
}

impl TitoEngine for Sqlite {
    type Transaction = SqliteTransaction;

    async fn begin(&self) -> TitoResult<SqliteTransaction> {
        if self.inner.closed.load(Ordering::SeqCst) {
            return Err(closed());
        }
        let start_version = self.next_version().await?;
        // Registered before the snapshot is taken, at a number it can only be above of.
        let registered = self.inner.published.load(Ordering::SeqCst);
        *crate::util::lock(&self.inner.snapshots)
            .entry(registered)
            .or_default() += 1;
        let unregister = || {
            let mut snapshots = crate::util::lock(&self.inner.snapshots);
            if let Some(count) = snapshots.get_mut(&registered) {
                *count -= 1;
                if *count == 0 {
                    snapshots.remove(&registered);
                }
            }
        };
        let conn = match self.connection() {
            Ok(conn) => conn,
            Err(err) => {
                unregister();
                return Err(err);
            }
        };
        let snapshot = conn
            .prepare_cached("BEGIN")
            .and_then(|mut begin| begin.execute([]))
            .and_then(|_| {
                conn.prepare_cached("SELECT n FROM meta WHERE name = 'csn'")?
                    .query_row([], |r| r.get::<_, i64>(0))
            });
        let snapshot = match snapshot {
            Ok(n) => n as u64,
            Err(err) => {
                unregister();
                return Err(sql_err("begin", err));
            }
        };
        Ok(SqliteTransaction {
            inner: Arc::new(TxInner {
                start_version,
                engine: self.clone(),
                registered,
                state: Mutex::new(TxState::Active(Box::new(Active {
                    conn,
                    snapshot,
                    writes: BTreeMap::new(),
                    locks: BTreeSet::new(),
                }))),
                failed: engine::FirstFailure::default(),
                hooks: engine::AfterCommit::default(),
            }),
        })
    }

    async fn current_version(&self) -> TitoResult<u64> {
        self.next_version().await
    }

    async fn garbage_collect(&self, retention: Duration) -> TitoResult<u64> {
        let retention_ms = check_retention(retention)?;
        let now = self.next_version().await?;
        let wanted = (engine::version_millis(now).saturating_sub(retention_ms)) << LOGICAL_BITS;
        let _writing = self.inner.meta_writes.lock().await;
        let conn = self.connection()?;
        let current: i64 = conn
            .query_row("SELECT n FROM meta WHERE name = 'safe-point'", [], |r| {
                r.get(0)
            })
            .map_err(|e| sql_err("read metadata", e))?;
        crate::util::lock(&self.inner.pool).push(conn);
        let current = current as u64;
        if wanted <= current {
            return Ok(current);
        }
        self.send(|reply| Request::Meta {
            name: "safe-point",
            value: wanted,
            reply,
        })
        .await?;
        Ok(wanted)
    }

    async fn delete_range(&self, start: &[u8], end: &[u8]) -> TitoResult<()> {
        engine::check_destroy_range(start, end)?;
        let mut from = start.to_vec();
        loop {
            let tx = self.begin().await?;
            let keys: Vec<Vec<u8>> = tx
                .scan(&from, end, DELETE_RANGE_BATCH)
                .await?
                .into_iter()
                .map(|(k, _)| k)
                .collect();
            let Some(last) = keys.last().cloned() else {
                tx.rollback().await?;
                return Ok(());
            };
            for key in &keys {
                tx.delete(key.clone()).await?;
            }
            tx.commit().await.map_err(|err| match err {
                TitoError::Conflict { .. } => TitoError::conflict(
                    "delete_range raced a concurrent write; it is an offline operation",
                ),
                other => other,
            })?;
            if keys.len() < DELETE_RANGE_BATCH {
                return Ok(());
            }
            from = last;
            from.push(0);
        }
    }

    fn partitions(&self) -> u32 {
        self.inner.partitions
    }

    fn extensions(&self) -> &engine::Extensions {
        &self.inner.extensions
    }

    fn retry_policy(&self) -> RetryPolicy {
        self.retry.clone()
    }
}

/// A transaction of the [`Sqlite`] engine.
#[derive(Clone)]
pub struct SqliteTransaction {
    inner: Arc<TxInner>,
}

impl std::fmt::Debug for SqliteTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteTransaction")
            .field("start_version", &self.inner.start_version)
            .finish()
    }
}

struct TxInner {
    start_version: u64,
    engine: Sqlite,
    registered: u64,
    state: Mutex<TxState>,
    failed: engine::FirstFailure,
    hooks: engine::AfterCommit,
}

struct Active {
    conn: Connection,
    snapshot: u64,
    /// Buffered writes: a value, or `None` for a delete.
    writes: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
    locks: BTreeSet<Vec<u8>>,
}

enum TxState {
    Active(Box<Active>),
    Finished(&'static str),
}

impl TxInner {
    /// Ends the read transaction and gives the connection back.
    fn release(&self, active: Active) {
        let Active { conn, .. } = active;
        let ended = conn
            .prepare_cached("ROLLBACK")
            .and_then(|mut rollback| rollback.execute([]));
        if ended.is_ok() && !self.engine.inner.closed.load(Ordering::SeqCst) {
            crate::util::lock(&self.engine.inner.pool).push(conn);
        }
    }

    /// Forgets the snapshot: tombstones above it may go. Once the transaction is rolled back,
    /// or its commit answered (the writer checks the commit against tombstones above it).
    fn unregister(&self) {
        let mut snapshots = crate::util::lock(&self.engine.inner.snapshots);
        if let Some(count) = snapshots.get_mut(&self.registered) {
            *count -= 1;
            if *count == 0 {
                snapshots.remove(&self.registered);
            }
        }
    }
}

impl Drop for TxInner {
    fn drop(&mut self) {
        let state = std::mem::replace(
            self.state.get_mut().unwrap_or_else(|p| p.into_inner()),
            TxState::Finished("dropped"),
        );
        if let TxState::Active(active) = state {
            self.release(*active);
        }
        // Whatever the state: a committed transaction unregisters here too, once its handle
        // (and so its commit) is done.
        self.unregister();
    }
}

impl SqliteTransaction {
    fn lock(&self) -> MutexGuard<'_, TxState> {
        crate::util::lock(&self.inner.state)
    }

    fn with_active<R>(
        &self,
        keys: usize,
        f: impl FnOnce(&mut Active) -> TitoResult<R>,
    ) -> TitoResult<R> {
        read(keys, || {
            let mut state = self.lock();
            match &mut *state {
                TxState::Active(active) => f(active),
                TxState::Finished(how) => Err(TitoError::TransactionFinished(how)),
            }
        })
    }

    fn take(&self, how: &'static str) -> TitoResult<Box<Active>> {
        let mut state = self.lock();
        match std::mem::replace(&mut *state, TxState::Finished(how)) {
            TxState::Active(active) => Ok(active),
            TxState::Finished(was) => {
                *state = TxState::Finished(was);
                Err(TitoError::TransactionFinished(was))
            }
        }
    }
}

fn get_one(active: &Active, key: &[u8]) -> TitoResult<Option<Vec<u8>>> {
    if let Some(buffered) = active.writes.get(key) {
        return Ok(buffered.clone());
    }
    let mut statement = active
        .conn
        .prepare_cached("SELECT v FROM kv WHERE k = ?1")
        .map_err(|e| sql_err("get", e))?;
    let value: Option<Option<Vec<u8>>> = statement
        .query_row([key], |r| r.get(0))
        .optional()
        .map_err(|e| sql_err("get", e))?;
    Ok(value.flatten())
}

fn scan_dir(
    active: &Active,
    start: &[u8],
    end: &[u8],
    limit: usize,
    reverse: bool,
) -> TitoResult<Vec<KvPair>> {
    let in_range = |key: &[u8]| key >= start && (end.is_empty() || key < end);
    let buffered: Vec<(&Vec<u8>, &Option<Vec<u8>>)> =
        active.writes.iter().filter(|(k, _)| in_range(k)).collect();
    // Each buffered key can hide or replace one stored row.
    let wanted = (limit + buffered.len()) as i64;
    let order = if reverse { "DESC" } else { "ASC" };
    let sql = if end.is_empty() {
        format!("SELECT k, v FROM kv WHERE k >= ?1 AND v IS NOT NULL ORDER BY k {order} LIMIT ?2")
    } else {
        format!(
            "SELECT k, v FROM kv WHERE k >= ?1 AND k < ?3 AND v IS NOT NULL ORDER BY k {order} LIMIT ?2"
        )
    };
    let mut statement = active
        .conn
        .prepare_cached(&sql)
        .map_err(|e| sql_err("scan", e))?;
    let map = |r: &rusqlite::Row<'_>| Ok((r.get::<_, Vec<u8>>(0)?, r.get::<_, Vec<u8>>(1)?));
    let rows: Vec<KvPair> = if end.is_empty() {
        statement
            .query_map(params![start, wanted], map)
            .and_then(|rows| rows.collect())
    } else {
        statement
            .query_map(params![start, wanted, end], map)
            .and_then(|rows| rows.collect())
    }
    .map_err(|e| sql_err("scan", e))?;
    if buffered.is_empty() {
        let mut rows = rows;
        rows.truncate(limit);
        return Ok(rows);
    }
    let mut merged: BTreeMap<Vec<u8>, Vec<u8>> = rows.into_iter().collect();
    for (key, value) in buffered {
        match value {
            Some(value) => {
                merged.insert(key.clone(), value.clone());
            }
            None => {
                merged.remove(key);
            }
        }
    }
    let out: Vec<KvPair> = if reverse {
        merged.into_iter().rev().take(limit).collect()
    } else {
        merged.into_iter().take(limit).collect()
    };
    Ok(out)
}

impl TitoTransaction for SqliteTransaction {
    fn start_version(&self) -> u64 {
        self.inner.start_version
    }

    async fn get(&self, key: &[u8]) -> TitoResult<Option<Vec<u8>>> {
        self.with_active(1, |active| get_one(active, key))
    }

    async fn batch_get(&self, keys: &[Vec<u8>]) -> TitoResult<Vec<Option<Vec<u8>>>> {
        self.with_active(keys.len(), |active| {
            keys.iter().map(|key| get_one(active, key)).collect()
        })
    }

    async fn scan(&self, start: &[u8], end: &[u8], limit: usize) -> TitoResult<Vec<KvPair>> {
        check_scan(start, end, limit)?;
        self.with_active(limit, |active| scan_dir(active, start, end, limit, false))
    }

    async fn scan_reverse(
        &self,
        start: &[u8],
        end: &[u8],
        limit: usize,
    ) -> TitoResult<Vec<KvPair>> {
        check_scan(start, end, limit)?;
        self.with_active(limit, |active| scan_dir(active, start, end, limit, true))
    }

    async fn put(&self, key: Vec<u8>, value: Vec<u8>) -> TitoResult<()> {
        engine::check_write(&key, &value)?;
        self.with_active(0, |active| {
            active.writes.insert(key, Some(value));
            Ok(())
        })
    }

    async fn delete(&self, key: Vec<u8>) -> TitoResult<()> {
        self.with_active(0, |active| {
            active.writes.insert(key, None);
            Ok(())
        })
    }

    async fn lock_keys(&self, keys: &[Vec<u8>]) -> TitoResult<()> {
        self.with_active(0, |active| {
            active.locks.extend(keys.iter().cloned());
            Ok(())
        })
    }

    fn fail(&self, cause: &TitoError) {
        self.inner.failed.record(cause);
    }

    async fn commit(&self) -> TitoResult<()> {
        if let Some(refusal) = self.inner.failed.refusal() {
            self.rollback().await?;
            return Err(refusal);
        }
        let mut active = self.take("committed")?;
        let writes: WriteSet = std::mem::take(&mut active.writes).into_iter().collect();
        let locks: Vec<Vec<u8>> = std::mem::take(&mut active.locks).into_iter().collect();
        let snapshot = active.snapshot;
        // The read transaction ends before the commit waits (the writer checks conflicts by
        // number); the snapshot stays registered until the handle goes, so the tombstones the
        // check needs stay.
        self.inner.release(*active);
        // Held until the commit applied (a move waits for it).
        let _pass = if writes.is_empty() {
            None
        } else {
            match self
                .inner
                .engine
                .inner
                .extensions
                .get::<engine::gate::Gate>()
                .enter(writes.iter().map(|(key, _)| key.as_slice()))
            {
                Ok(pass) => Some(pass),
                Err(refused) => {
                    self.inner.hooks.finish(false);
                    return Err(refused);
                }
            }
        };
        let result = if writes.is_empty() && locks.is_empty() {
            Ok(())
        } else {
            self.inner
                .engine
                .send(|reply| Request::Commit {
                    writes,
                    locks,
                    snapshot,
                    reply,
                })
                .await
        };
        self.inner.hooks.finish(result.is_ok());
        result
    }

    fn after_commit(&self, hook: engine::AfterCommitHook) {
        self.inner.hooks.push(hook);
    }

    async fn rollback(&self) -> TitoResult<()> {
        let active = self.take("rolled back")?;
        self.inner.release(*active);
        Ok(())
    }
}
