//! The embedded engine: a durable store in a local directory, no server needed.
//!
//! Built on [`surrealkv`], an LSM tree with snapshot-isolation transactions and write-write
//! conflict detection, the same transaction model as TiKV. It is the default engine for a
//! single machine, for tests and for examples.
//!
//! # Durability
//!
//! [`Durability::Immediate`] (the default of [`Embedded::open`]) makes every commit wait for an
//! `fsync` of the write-ahead log: a transaction that committed survives a process crash and a
//! power loss. [`Durability::Buffered`] returns once the write is in the operating system's page
//! cache: it survives a crash of the process but may lose the last commits on a power loss or a
//! kernel crash.
//!
//! # Versions
//!
//! Start versions come from a timestamp oracle in the store: physical milliseconds shifted left
//! by [`LOGICAL_BITS`] plus a logical counter, strictly increasing, and following the wall
//! clock (a version is the later of the wall clock and one above the last version).
//!
//! While the store is open, the oracle persists a high-water mark up to three seconds ahead of
//! the versions it hands out (one durable write per three seconds of use, not one per version),
//! and no version reaches the mark before a new one is persisted. [`Embedded::close`] writes the
//! mark back to the exact last version, so a reopened store continues from there, or from the
//! wall clock when it is later: reopening any number of times does not move the clock ahead,
//! and opening a store only to read it changes nothing. Only a crash (or a process that exits
//! without closing the store, see [`Embedded::close`]) leaves the mark ahead, at most three
//! seconds ahead of the wall clock: the next open waits until the wall clock passes it (at most
//! those three seconds, only after a crash), so the clock does not jump forward across a crash
//! and a delay counted before it is not cut short (where PD's timestamp oracle, after a leader
//! change, starts from its mark instead). The mark is always three seconds ahead of the wall
//! clock, never of the versions: a store whose versions are ahead of the wall clock persists
//! marks only a quarter of a millisecond of version time past them, so any number of crashes in
//! a row leaves the clock at most three seconds ahead, also when the host's clock went back.
//! Versions keep increasing across a restart either way.
//!
//! A version is the later of the wall clock and one above the last version. While the wall
//! clock is behind the last version (after the host's clock was set back, for as long as that;
//! an open does not wait out more than three seconds), versions rise by their logical counter
//! alone: the time they tell stands still until the wall clock passes it. Everything that reads
//! time from versions waits with it: delayed events, retries' backoffs, leases, the key/value
//! store's expiries; none of them comes early. Due times relative to now are counted from the
//! same clock (see "Due times" on [`QueueEvent`](crate::QueueEvent)).
//!
//! # Garbage collection
//!
//! The store keeps no history beyond what open transactions still read: superseded versions are
//! dropped by compaction once no snapshot needs them. [`garbage_collect`](TitoEngine::garbage_collect)
//! therefore validates its argument, records the safe point (which only moves forward) and
//! returns it; it never removes a version an open transaction can still read.
//!
//! # Performance
//!
//! - Run Tito from spawned tasks: commits go through surrealkv's group-commit task, and from a
//!   thread outside the runtime (the body of `#[tokio::main]`, `block_on`) each commit's two
//!   wake-ups cross threads (about half the buffered rate).
//! - A durable commit waits for one sync of the log, which keeps zeros written ahead of its
//!   records ([`EmbeddedOptions::wal_preallocation`]) so that sync is an `fdatasync` of data
//!   alone.
//! - [`EmbeddedOptions::block_cache_bytes`] and [`EmbeddedOptions::block_bytes`] set the block
//!   cache and the data block size.
//!
//! The measurements behind these, and the comparison with fjall and redb that kept surrealkv as
//! the engine, are in `docs/performance.md` ("The embedded engine").
//!
//! # Blocking
//!
//! Reads and scans of the underlying store are synchronous and may touch the disk. Reads of more
//! than 64 keys (batch reads of more keys, scans with a larger limit, range deletes) run through
//! [`tokio::task::block_in_place`] on a multi-threaded Tokio runtime, so other tasks keep running
//! meanwhile. Smaller reads run on the calling thread, as every call does on a current-thread
//! runtime: `block_in_place` hands the worker's place to another thread and takes it back, and
//! that hand-off costs more than such a read, which usually finds its blocks in the memtable or
//! the cache. A small read that misses the cache waits for one block from the page cache or the
//! disk on the worker.
//!
//! A commit hands its writes to surrealkv's group-commit task, which writes the log (and syncs it
//! for a durable commit) on a worker of the runtime, and awaits its answer: the committing task
//! blocks no thread.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use surrealkv::{LSMIterator, Mode, Tree, TreeBuilder};

use crate::engine::{
    self, KvPair, LOGICAL_BITS, RetryPolicy, TitoEngine, TitoTransaction, check_retention,
    check_scan,
};
use crate::error::{TitoError, TitoResult};

/// How a commit reaches the disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Durability {
    /// Every commit waits for an `fsync`: nothing committed is lost, even on power loss.
    #[default]
    Immediate,
    /// Commits return once written to the operating system: they survive a process crash, but
    /// the last ones may be lost on power loss.
    Buffered,
}

/// Options for [`Embedded::open_with`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct EmbeddedOptions {
    durability: Durability,
    partitions: u32,
    memtable_bytes: usize,
    block_cache_bytes: u64,
    block_bytes: usize,
    wal_preallocation: bool,
    create_if_missing: bool,
    retry: RetryPolicy,
}

impl Default for EmbeddedOptions {
    fn default() -> Self {
        EmbeddedOptions {
            durability: Durability::Immediate,
            partitions: engine::DEFAULT_PARTITIONS,
            memtable_bytes: 32 * 1024 * 1024,
            block_cache_bytes: DEFAULT_BLOCK_CACHE_BYTES,
            block_bytes: DEFAULT_BLOCK_BYTES,
            wal_preallocation: true,
            create_if_missing: true,
            retry: RetryPolicy::default(),
        }
    }
}

impl EmbeddedOptions {
    /// Durable commits, 16 partitions, a 32 MiB memtable and the default retry policy.
    pub fn new() -> Self {
        Self::default()
    }

    /// How commits reach the disk.
    pub fn durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// The default partition count for queues and model events (1 to 10000).
    pub fn partitions(mut self, partitions: u32) -> Self {
        self.partitions = partitions;
        self
    }

    /// The size of the in-memory write buffer before it is flushed to a table file. Memory use
    /// of an open store is roughly this much plus caches; tests can set it small.
    pub fn memtable_bytes(mut self, bytes: usize) -> Self {
        self.memtable_bytes = bytes;
        self
    }

    /// The capacity of the cache of table-file blocks (data, index and filter blocks), from
    /// 1 MiB to 1 TiB; default [`DEFAULT_BLOCK_CACHE_BYTES`]. Reads of a store larger than the
    /// cache read blocks from the operating system's page cache (or the disk) and parse them
    /// again: give the cache the size of the working set when memory allows.
    pub fn block_cache_bytes(mut self, bytes: u64) -> Self {
        self.block_cache_bytes = bytes;
        self
    }

    /// The size of a data block of the table files, from 1 KiB to 1 MiB; default
    /// [`DEFAULT_BLOCK_BYTES`]. A point read parses one block: smaller blocks make reads of one
    /// row cheaper and the block index larger. Applies to the files written from then on.
    pub fn block_bytes(mut self, bytes: usize) -> Self {
        self.block_bytes = bytes;
        self
    }

    /// Whether the write-ahead log writes zeros ahead of its records (on by default, Unix only).
    ///
    /// A durable commit syncs the log. When the commit's record grows the file, the sync also
    /// commits the file's new size to the file system's journal, and on ext4 or XFS that is most
    /// of what the sync of a small commit costs. With preallocation the log's active segment
    /// keeps 32 MiB of zeros written ahead of its end, so most syncs are of data alone
    /// (`fdatasync`): `cargo bench --bench engine` measured durable 4-key commits at 1.32-1.42
    /// times the rate without it with one task, 1.36-1.84 times with eight. A segment that is
    /// closed is cut back to its records; a crash leaves the zeros, which the replay reads as the
    /// end of the log. The disk holds up to 32 MiB more per store while it is open. Buffered
    /// commits do not sync, so it changes little for them.
    pub fn wal_preallocation(mut self, enabled: bool) -> Self {
        self.wal_preallocation = enabled;
        self
    }

    /// Whether opening a path that holds no store creates one there (the default). With
    /// `false`, [`Embedded::open_with`] refuses a path that does not exist, is not a directory,
    /// or is a directory without a store in it (see [`Embedded::is_store`]) with
    /// [`TitoError::NotFound`], and creates nothing: for tools that inspect a store and must
    /// not turn a mistyped path into an empty one.
    pub fn create_if_missing(mut self, create: bool) -> Self {
        self.create_if_missing = create;
        self
    }

    /// The retry policy of [`TitoEngine::transaction`] on this handle.
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }
}

/// A handle to an embedded store. Cheap to clone; the store closes when the last clone drops
/// (or explicitly with [`Embedded::close`]).
///
/// # Examples
///
/// ```
/// use tito::backend::embedded::Embedded;
/// use tito::{TitoEngine, TitoError, TitoTransaction};
///
/// # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
/// # async fn main() -> Result<(), TitoError> {
/// let dir = tempfile::tempdir().unwrap();
/// let db = Embedded::open(dir.path()).await?;
/// db.transaction(|tx| async move { tx.put(b"k".to_vec(), b"v".to_vec()).await })
///     .await?;
/// db.close().await?;
///
/// let db = Embedded::open(dir.path()).await?;
/// let tx = db.begin().await?;
/// assert_eq!(tx.get(b"k").await?, Some(b"v".to_vec()));
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Embedded {
    inner: Arc<Inner>,
    retry: RetryPolicy,
}

// Field order matters: the tree is dropped (and closed) before the temporary directory is removed.
struct Inner {
    tree: Tree,
    /// This process's claim on the directory, given back once the tree is closed (or dropped).
    open: Mutex<Option<OpenInProcess>>,
    oracle: Mutex<Oracle>,
    /// Serializes the read-modify-writes of the store's metadata (oracle mark, GC safe point).
    meta_writes: tokio::sync::Mutex<()>,
    /// Set by the first [`Embedded::close`].
    closed: std::sync::atomic::AtomicBool,
    extensions: engine::Extensions,
    durability: Durability,
    partitions: u32,
    path: PathBuf,
    _temp: Option<tempfile::TempDir>,
}

impl Drop for Inner {
    /// The last handle went without [`Embedded::close`]: close now, waiting for it where the
    /// thread may block (a multi-threaded runtime), so that the next open needs no recovery and
    /// continues the clock exactly. Elsewhere surrealkv's own drop closes in the background.
    fn drop(&mut self) {
        if self.closed.load(std::sync::atomic::Ordering::SeqCst) || self._temp.is_some() {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if handle.runtime_flavor() != tokio::runtime::RuntimeFlavor::MultiThread {
            return;
        }
        // A runtime that is shutting down (the handle was held by a task it drops) no longer
        // drives the close's timers and tasks: the wait is bounded by a thread of its own, and
        // a panic of a runtime that refuses the close is caught. Either way the store is then
        // recovered at its next open, as after a crash.
        let (fire, expired) = tokio::sync::oneshot::channel::<()>();
        std::thread::spawn(move || {
            std::thread::sleep(DROP_CLOSE_WAIT);
            let _ = fire.send(());
        });
        let closed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            tokio::task::block_in_place(|| {
                handle.block_on(async {
                    tokio::select! {
                        closed = self.close() => Some(closed),
                        _ = expired => None,
                    }
                })
            })
        }));
        match closed {
            Ok(Some(Ok(()))) => {}
            Ok(Some(Err(err))) => {
                tracing::warn!(error = %err, path = %self.path.display(), "embedded store: closing on drop failed")
            }
            Ok(None) | Err(_) => tracing::warn!(
                path = %self.path.display(),
                "embedded store: closing on drop did not finish (was the runtime shutting down?); \
                 the next open recovers the store: call Embedded::close before exiting"
            ),
        }
    }
}

impl std::fmt::Debug for Embedded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedded")
            .field("path", &self.inner.path)
            .field("durability", &self.inner.durability)
            .field("partitions", &self.inner.partitions)
            .finish()
    }
}

/// The default of [`EmbeddedOptions::block_cache_bytes`]: 128 MiB.
pub const DEFAULT_BLOCK_CACHE_BYTES: u64 = 128 << 20;

/// The default of [`EmbeddedOptions::block_bytes`]: 4 KiB.
///
/// A get that misses the block cache reads and searches one data block, so smaller blocks make
/// it cheaper, while a range read of a page of rows spans a block or two either way. A million
/// users of the models benchmark (941 MiB, 7 times the block cache), one task, the same build
/// one run after the other: gets by id 1.15-1.35 times the rate with 4 KiB blocks than with 16
/// KiB (144-154k against 112-127k per second), a team's 10 newest 1.15 times (28.6-29.7k
/// against 24.6-25.7k); 2 KiB and 8 KiB were no better than 4 KiB.
pub const DEFAULT_BLOCK_BYTES: usize = 4 << 10;

/// User keys live under this byte; the store's own metadata under `0x00`, out of their reach.
const DATA: u8 = 0x01;
const META_ORACLE: &[u8] = b"\x00oracle-high-water";
const META_SAFE_POINT: &[u8] = b"\x00gc-safe-point";
/// How far ahead of the wall clock the oracle persists its high-water mark.
pub(super) const ORACLE_WINDOW_MS: u64 = 3_000;

/// While the versions are ahead of the wall clock (after a crash left the mark ahead), how many
/// versions past the next one a persisted mark covers: 2^16 logical steps, a quarter of a
/// millisecond of version time. Each crash can leave the clock at most this much further
/// ahead than the window, less than any restart takes.
pub(super) const ORACLE_AHEAD_STEP: u64 = 1 << 16;
/// The longest the drop of the last handle waits for the store to close.
const DROP_CLOSE_WAIT: Duration = Duration::from_secs(2);
/// How many keys one transaction of [`Embedded::delete_range`] removes.
const DELETE_RANGE_BATCH: usize = 1_000;

fn data_key(key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(key.len() + 1);
    out.push(DATA);
    out.extend_from_slice(key);
    out
}

/// The internal end bound of a user range: an empty user end means the end of the data space.
fn data_end(end: &[u8]) -> Vec<u8> {
    if end.is_empty() {
        vec![DATA + 1]
    } else {
        data_key(end)
    }
}

/// The directories of the embedded stores open in this process.
static OPEN_IN_PROCESS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// This process's claim on a store's directory (the embedded and the SQLite engine's), from
/// before its open until its handles are gone, so a second open in the same process is told so
/// (rather than that another process holds the store's lock).
pub(super) struct OpenInProcess(PathBuf);

impl OpenInProcess {
    /// Claims `path` for a store of `engine` (`"embedded"`), closed by `close`.
    pub(super) fn claim(path: &Path, engine: &str, close: &str) -> TitoResult<Self> {
        let dir = std::fs::canonicalize(path).map_err(|err| {
            TitoError::storage(
                format!("{engine} store: cannot resolve {}", path.display()),
                err,
            )
        })?;
        let mut open = crate::util::lock(&OPEN_IN_PROCESS);
        if open.contains(&dir) {
            return Err(TitoError::Storage {
                message: format!(
                    "{engine} store: {} is already open in this process; a store has one \
                     owner: clone the handle already open (every clone is the same store), or \
                     close it ({close}) before opening it again",
                    path.display()
                ),
                source: None,
            });
        }
        open.push(dir.clone());
        Ok(OpenInProcess(dir))
    }
}

impl Drop for OpenInProcess {
    fn drop(&mut self) {
        crate::util::lock(&OPEN_IN_PROCESS).retain(|dir| dir != &self.0);
    }
}

fn storage_err(what: &str, err: surrealkv::Error) -> TitoError {
    TitoError::storage(format!("embedded store: {what}"), err)
}

pub(super) fn now_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(crate::util::millis)
        .unwrap_or(0)
}

/// Reads of at most this many keys (point reads, batch reads, scans by their limit) run on the
/// calling thread; larger ones through [`blocking`]. See "Blocking" in the module docs.
pub(super) const INLINE_READ_KEYS: usize = 64;

/// Runs a read of `keys` keys: inline when small, else where blocking is allowed.
pub(super) fn read<R>(keys: usize, f: impl FnOnce() -> R) -> R {
    if keys <= INLINE_READ_KEYS {
        f()
    } else {
        blocking(f)
    }
}

/// Runs a synchronous storage call where blocking is allowed.
pub(super) fn blocking<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

/// Waits, at an open, until the wall clock passes a persisted mark that a crash left at most
/// [`ORACLE_WINDOW_MS`] ahead of it, so versions continue from the wall clock instead of from
/// ahead of it: time read from versions (due times, delays, leases) does not jump forward
/// across a crash. A mark further ahead (the host's clock went back) is not waited for: the
/// versions continue from it and the time they tell stands still until the wall clock passes
/// it. Returns how long it waited.
pub(super) async fn wait_out_mark(mark: u64) -> Duration {
    let mark_ms = crate::engine::version_millis(mark);
    let now = now_millis();
    if mark_ms < now || mark_ms - now > ORACLE_WINDOW_MS {
        return Duration::ZERO;
    }
    // One millisecond past the mark's, so the first version is the wall clock's.
    let wait = Duration::from_millis(mark_ms - now + 1);
    tokio::time::sleep(wait).await;
    wait
}

/// A local store's timestamp oracle (the embedded and the SQLite engine's): see "Versions" in
/// the module docs. The store persists the mark [`Oracle::wanted`] asks for, then raises it.
pub(super) struct Oracle {
    /// The last version handed out.
    pub(super) last: u64,
    /// No version at or above it is handed out: the store's persisted high-water mark.
    pub(super) persisted_limit: u64,
}

impl Oracle {
    /// An oracle starting at the mark a store persisted.
    pub(super) fn starting_at(mark: u64) -> Self {
        Oracle {
            last: mark,
            persisted_limit: mark,
        }
    }

    /// The version to hand out next: the clock (`now_ms`, Unix milliseconds), or one above the
    /// last version if the clock has not moved past it.
    fn candidate(&self, now_ms: u64) -> u64 {
        (now_ms << LOGICAL_BITS).max(self.last + 1)
    }

    /// The next version when it is below the persisted mark (taken), else `None`.
    pub(super) fn next(&mut self, now_ms: u64) -> Option<u64> {
        let next = self.candidate(now_ms);
        (next < self.persisted_limit).then(|| {
            self.last = next;
            next
        })
    }

    /// The mark to persist before the next version can be handed out, or `None` when another
    /// task moved it meanwhile: [`ORACLE_WINDOW_MS`] ahead of the wall clock, never of the
    /// versions. While the versions are ahead of the wall clock (a crash left the mark ahead),
    /// the mark covers only [`ORACLE_AHEAD_STEP`] versions past the next one, so a crash in
    /// that time cannot push the clock a window further ahead: the lead never compounds.
    pub(super) fn wanted(&self, now_ms: u64) -> Option<u64> {
        let next = self.candidate(now_ms);
        (next >= self.persisted_limit).then(|| {
            let window = (now_ms + ORACLE_WINDOW_MS) << LOGICAL_BITS;
            window.max(next.saturating_add(ORACLE_AHEAD_STEP))
        })
    }

    /// After `mark` was persisted.
    pub(super) fn raise(&mut self, mark: u64) {
        self.persisted_limit = self.persisted_limit.max(mark);
    }

    /// At close: no version is handed out past the last one; returns it when the mark was
    /// ahead of it (the store writes it back exactly).
    pub(super) fn close(&mut self) -> Option<u64> {
        let ahead = self.persisted_limit > self.last;
        self.persisted_limit = self.persisted_limit.min(self.last);
        ahead.then_some(self.last)
    }
}

impl Embedded {
    /// Opens (or creates) a durable store in `path`: every commit is synced to disk before it
    /// returns.
    pub async fn open(path: impl AsRef<Path>) -> TitoResult<Self> {
        Self::open_with(path, EmbeddedOptions::default()).await
    }

    /// Opens (or creates) a store in `path` with options.
    pub async fn open_with(path: impl AsRef<Path>, options: EmbeddedOptions) -> TitoResult<Self> {
        Self::open_inner(path.as_ref().to_path_buf(), None, options).await
    }

    /// A fresh store in a new temporary directory, removed when the last handle drops. Commits
    /// are buffered (the directory does not outlive the process anyway) and the memtable is
    /// small. For tests and examples.
    pub async fn temporary() -> TitoResult<Self> {
        Self::temporary_with(
            EmbeddedOptions::default()
                .durability(Durability::Buffered)
                .memtable_bytes(4 * 1024 * 1024),
        )
        .await
    }

    /// [`Embedded::temporary`] with options.
    pub async fn temporary_with(options: EmbeddedOptions) -> TitoResult<Self> {
        let dir = tempfile::Builder::new()
            .prefix("tito-")
            .tempdir()
            .map_err(|err| TitoError::storage("cannot create a temporary directory", err))?;
        let path = dir.path().to_path_buf();
        Self::open_inner(path, Some(dir), options).await
    }

    async fn open_inner(
        path: PathBuf,
        temp: Option<tempfile::TempDir>,
        options: EmbeddedOptions,
    ) -> TitoResult<Self> {
        let partitions = engine::check_partitions(options.partitions)?;
        options.retry.check()?;
        if options.memtable_bytes < 64 * 1024 {
            return Err(TitoError::invalid_argument(
                "memtable_bytes must be at least 64 KiB",
            ));
        }
        if !(1 << 20..=1 << 40).contains(&options.block_cache_bytes) {
            return Err(TitoError::invalid_argument(format!(
                "block_cache_bytes must be from 1 MiB to 1 TiB, not {}",
                options.block_cache_bytes
            )));
        }
        if !(1 << 10..=1 << 20).contains(&options.block_bytes) {
            return Err(TitoError::invalid_argument(format!(
                "block_bytes must be from 1 KiB to 1 MiB, not {}",
                options.block_bytes
            )));
        }
        if !options.create_if_missing && !Self::is_store(&path) {
            let why = if !path.exists() {
                "it does not exist"
            } else if !path.is_dir() {
                "it is not a directory"
            } else {
                "the directory holds no store (no manifest/ in it)"
            };
            return Err(TitoError::NotFound(format!(
                "{} is not an embedded Tito store: {why}; nothing was created",
                path.display()
            )));
        }
        std::fs::create_dir_all(&path).map_err(|err| {
            TitoError::storage(format!("cannot create directory {}", path.display()), err)
        })?;
        let open = OpenInProcess::claim(&path, "embedded", "Embedded::close")?;
        let builder = TreeBuilder::with_options(
            surrealkv::Options::new()
                .with_path(path.clone())
                .with_max_memtable_size(options.memtable_bytes)
                .with_block_cache_capacity(options.block_cache_bytes)
                .with_block_size(options.block_bytes)
                .with_wal_preallocation(options.wal_preallocation),
        );
        let tree = builder
            .build_async()
            .await
            .map_err(|err| storage_err(&format!("cannot open {}", path.display()), err))?;

        let stored_limit = read_meta(&tree, META_ORACLE)?.unwrap_or(0);
        wait_out_mark(stored_limit).await;
        let inner = Inner {
            tree,
            open: Mutex::new(Some(open)),
            meta_writes: tokio::sync::Mutex::new(()),
            closed: std::sync::atomic::AtomicBool::new(false),
            extensions: engine::Extensions::new(),
            oracle: Mutex::new(Oracle::starting_at(stored_limit)),
            durability: options.durability,
            partitions,
            path,
            _temp: temp,
        };
        // The store's lock is held: no other process has it, so leases its workers left under
        // an earlier open belong to a process that is gone (see `queue::lease`).
        inner
            .extensions
            .get::<engine::ExclusiveOpen>()
            .set(engine::random::random_u64());
        let db = Embedded {
            inner: Arc::new(inner),
            retry: options.retry,
        };
        engine::gate::load(&db).await?;
        Ok(db)
    }

    /// Whether `path` is a directory that holds an embedded store (one that
    /// [`Embedded::open`] created: its `manifest/` directory is there). Reads the directory
    /// only.
    pub fn is_store(path: impl AsRef<Path>) -> bool {
        path.as_ref().join("manifest").is_dir()
    }

    /// The directory of the store.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// The durability of commits on this handle.
    pub fn durability(&self) -> Durability {
        self.inner.durability
    }

    /// Flushes and closes the store. Every handle fails afterwards; closing again does nothing.
    ///
    /// The clock's high-water mark is written back to the last version handed out, so the next
    /// open continues from it (or from the wall clock, when that is later) instead of from the
    /// mark kept ahead of it while the store was open (see "Versions" in the module docs).
    ///
    /// End a program with it. Dropping the last handle closes the store too: on a
    /// multi-threaded Tokio runtime (`#[tokio::main]`'s default) the drop waits for the close
    /// to finish; elsewhere (a current-thread runtime, no runtime, or a handle dropped while
    /// the runtime shuts down) the close is left to the background and may not finish before
    /// the process exits. A store that was not closed is recovered from its log at the next
    /// open, which is slower, and its clock starts from the mark kept ahead (up to three
    /// seconds past the wall clock).
    pub async fn close(&self) -> TitoResult<()> {
        self.inner.close().await
    }

    /// A new handle to the same store with another retry policy for
    /// [`TitoEngine::transaction`].
    pub fn with_retry_policy(&self, policy: RetryPolicy) -> Self {
        Embedded {
            inner: Arc::clone(&self.inner),
            retry: policy,
        }
    }

    fn oracle(&self) -> MutexGuard<'_, Oracle> {
        self.inner.oracle()
    }

    /// The next version of the oracle. No version at or above the persisted high-water mark
    /// is ever handed out, so a reopened store (which starts at that mark) stays above them all.
    async fn next_version(&self) -> TitoResult<u64> {
        loop {
            if let Some(next) = self.oracle().next(now_millis()) {
                return Ok(next);
            }
            // Slow path, about once per window: move the mark ahead, then try again.
            let _persisting = self.inner.meta_writes.lock().await;
            let Some(wanted) = self.oracle().wanted(now_millis()) else {
                continue; // another task moved it meanwhile
            };
            self.write_meta(META_ORACLE, wanted).await?;
            self.oracle().raise(wanted);
        }
    }

    /// Writes a metadata value durably, whatever the handle's durability.
    async fn write_meta(&self, key: &[u8], value: u64) -> TitoResult<()> {
        self.inner.write_meta(key, value).await
    }
}

impl Inner {
    fn oracle(&self) -> MutexGuard<'_, Oracle> {
        crate::util::lock(&self.oracle)
    }

    /// See [`Embedded::close`].
    async fn close(&self) -> TitoResult<()> {
        {
            let _persisting = self.meta_writes.lock().await;
            // No version is handed out past this point: one that asks for a version now takes
            // the slow path, which waits for this lock and then finds the store closed.
            let exact = self.oracle().close();
            let first_close = !self.closed.swap(true, std::sync::atomic::Ordering::SeqCst);
            if let Some(last) = exact
                && first_close
                && let Err(err) = self.write_meta(META_ORACLE, last).await
            {
                // The mark stays ahead: safe, the next open only starts later than it needs to.
                tracing::warn!(error = %err, "embedded store: writing the clock's mark at close failed");
            }
        }
        self.tree
            .close()
            .await
            .map_err(|e| storage_err("close", e))?;
        // Closed: this process may open the directory again.
        self.open.lock().unwrap_or_else(|e| e.into_inner()).take();
        Ok(())
    }

    /// Writes a metadata value durably, whatever the handle's durability.
    async fn write_meta(&self, key: &[u8], value: u64) -> TitoResult<()> {
        let mut tx = self.tree.begin().map_err(|e| storage_err("begin", e))?;
        tx.set_durability(surrealkv::Durability::Immediate);
        tx.set(key, value.to_be_bytes().as_slice())
            .map_err(|e| storage_err("write metadata", e))?;
        tx.commit()
            .await
            .map_err(|e| storage_err("write metadata", e))
    }
}

/// Reads a metadata value of the store.
fn read_meta(tree: &Tree, key: &[u8]) -> TitoResult<Option<u64>> {
    let tx = tree
        .begin_with_mode(Mode::ReadOnly)
        .map_err(|e| storage_err("begin", e))?;
    match read(1, || tx.get(key)).map_err(|e| storage_err("read metadata", e))? {
        None => Ok(None),
        Some(bytes) => decode_u64(&bytes).map(Some).ok_or_else(|| {
            TitoError::Integrity(format!(
                "embedded store: malformed metadata value under {}",
                crate::keys::display_key(key)
            ))
        }),
    }
}

fn decode_u64(bytes: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(bytes.try_into().ok()?))
}

impl TitoEngine for Embedded {
    type Transaction = EmbeddedTransaction;

    async fn begin(&self) -> TitoResult<EmbeddedTransaction> {
        let start_version = self.next_version().await?;
        let mut tx = self
            .inner
            .tree
            .begin()
            .map_err(|e| storage_err("begin", e))?;
        tx.set_durability(match self.inner.durability {
            Durability::Immediate => surrealkv::Durability::Immediate,
            Durability::Buffered => surrealkv::Durability::Eventual,
        });
        Ok(EmbeddedTransaction {
            inner: Arc::new(TxInner {
                start_version,
                state: Mutex::new(TxState::Active(tx)),
                written: Mutex::new(Vec::new()),
                gate: self.inner.extensions.get::<engine::gate::Gate>(),
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
        let wanted =
            (crate::engine::version_millis(now).saturating_sub(retention_ms)) << LOGICAL_BITS;
        // Taken after `next_version`, which may take it too: the safe point only moves forward
        // even when collections race.
        let _writing = self.inner.meta_writes.lock().await;
        let current = read_meta(&self.inner.tree, META_SAFE_POINT)?.unwrap_or(0);
        if wanted <= current {
            return Ok(current);
        }
        self.write_meta(META_SAFE_POINT, wanted).await?;
        Ok(wanted)
    }

    async fn delete_range(&self, start: &[u8], end: &[u8]) -> TitoResult<()> {
        crate::engine::check_destroy_range(start, end)?;
        let _pass = self
            .inner
            .extensions
            .get::<engine::gate::Gate>()
            .enter_untracked()?;
        let mut from = data_key(start);
        let to = data_end(end);
        loop {
            let mut tx = self
                .inner
                .tree
                .begin()
                .map_err(|e| storage_err("begin", e))?;
            let keys = read(DELETE_RANGE_BATCH, || {
                collect_keys(&tx, &from, &to, DELETE_RANGE_BATCH)
            })
            .map_err(|e| storage_err("scan for delete_range", e))?;
            let Some(last) = keys.last().cloned() else {
                return Ok(());
            };
            for key in &keys {
                tx.delete(key.as_slice())
                    .map_err(|e| storage_err("delete_range", e))?;
            }
            tx.commit().await.map_err(|e| match e {
                surrealkv::Error::TransactionWriteConflict => TitoError::conflict(
                    "delete_range raced a concurrent write; it is an offline operation",
                ),
                other => storage_err("delete_range commit", other),
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

fn collect_keys(
    tx: &surrealkv::Transaction,
    from: &[u8],
    to: &[u8],
    limit: usize,
) -> Result<Vec<Vec<u8>>, surrealkv::Error> {
    let mut iter = tx.range(from, to)?;
    let mut out = Vec::new();
    let mut valid = iter.seek_first()?;
    while valid && out.len() < limit {
        out.push(iter.key().user_key().to_vec());
        valid = iter.next()?;
    }
    Ok(out)
}

/// A transaction of the [`Embedded`] engine.
#[derive(Clone)]
pub struct EmbeddedTransaction {
    inner: Arc<TxInner>,
}

struct TxInner {
    start_version: u64,
    state: Mutex<TxState>,
    /// The keys put or deleted, for the store's write gate.
    written: Mutex<Vec<Vec<u8>>>,
    gate: Arc<engine::gate::Gate>,
    failed: engine::FirstFailure,
    /// Run after a successful commit.
    hooks: engine::AfterCommit,
}

enum TxState {
    Active(surrealkv::Transaction),
    Finished(&'static str),
}

impl Drop for TxInner {
    fn drop(&mut self) {
        let state = self
            .state
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let TxState::Active(tx) = state {
            tx.rollback();
        }
    }
}

impl std::fmt::Debug for EmbeddedTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedTransaction")
            .field("start_version", &self.inner.start_version)
            .finish()
    }
}

impl EmbeddedTransaction {
    fn lock(&self) -> MutexGuard<'_, TxState> {
        // A panic while the lock was held cannot leave the transaction half-updated in a way
        // that matters: surrealkv keeps its own state consistent per call.
        crate::util::lock(&self.inner.state)
    }

    /// Runs `f`, a read of `keys` keys, on the active transaction (see [`read`]).
    fn with_active<R>(
        &self,
        keys: usize,
        f: impl FnOnce(&mut surrealkv::Transaction) -> TitoResult<R>,
    ) -> TitoResult<R> {
        read(keys, || {
            let mut state = self.lock();
            match &mut *state {
                TxState::Active(tx) => f(tx),
                TxState::Finished(how) => Err(TitoError::TransactionFinished(how)),
            }
        })
    }

    fn scan_dir(
        &self,
        start: &[u8],
        end: &[u8],
        limit: usize,
        reverse: bool,
    ) -> TitoResult<Vec<KvPair>> {
        check_scan(start, end, limit)?;
        let from = data_key(start);
        let to = data_end(end);
        self.with_active(limit, |tx| {
            let run = || -> Result<Vec<KvPair>, surrealkv::Error> {
                let mut iter = tx.range(from.as_slice(), to.as_slice())?;
                let mut out = Vec::with_capacity(limit.min(256));
                let mut valid = if reverse {
                    iter.seek_last()?
                } else {
                    iter.seek_first()?
                };
                while valid && out.len() < limit {
                    let key = iter.key().user_key()[1..].to_vec();
                    out.push((key, iter.value()?));
                    valid = if reverse { iter.prev()? } else { iter.next()? };
                }
                Ok(out)
            };
            run().map_err(|e| storage_err("scan", e))
        })
    }
}

impl TitoTransaction for EmbeddedTransaction {
    fn start_version(&self) -> u64 {
        self.inner.start_version
    }

    async fn get(&self, key: &[u8]) -> TitoResult<Option<Vec<u8>>> {
        let key = data_key(key);
        self.with_active(1, |tx| {
            tx.get(key.as_slice()).map_err(|e| storage_err("get", e))
        })
    }

    async fn batch_get(&self, keys: &[Vec<u8>]) -> TitoResult<Vec<Option<Vec<u8>>>> {
        self.with_active(keys.len(), |tx| {
            keys.iter()
                .map(|key| {
                    tx.get(data_key(key).as_slice())
                        .map_err(|e| storage_err("batch_get", e))
                })
                .collect()
        })
    }

    async fn scan(&self, start: &[u8], end: &[u8], limit: usize) -> TitoResult<Vec<KvPair>> {
        self.scan_dir(start, end, limit, false)
    }

    async fn scan_reverse(
        &self,
        start: &[u8],
        end: &[u8],
        limit: usize,
    ) -> TitoResult<Vec<KvPair>> {
        self.scan_dir(start, end, limit, true)
    }

    async fn put(&self, key: Vec<u8>, value: Vec<u8>) -> TitoResult<()> {
        crate::engine::check_write(&key, &value)?;
        let stored = data_key(&key);
        let mut state = self.lock();
        match &mut *state {
            TxState::Active(tx) => {
                tx.set(stored, value).map_err(|e| storage_err("put", e))?;
                crate::util::lock(&self.inner.written).push(key);
                Ok(())
            }
            TxState::Finished(how) => Err(TitoError::TransactionFinished(how)),
        }
    }

    async fn delete(&self, key: Vec<u8>) -> TitoResult<()> {
        let stored = data_key(&key);
        let mut state = self.lock();
        match &mut *state {
            TxState::Active(tx) => {
                tx.delete(stored).map_err(|e| storage_err("delete", e))?;
                crate::util::lock(&self.inner.written).push(key);
                Ok(())
            }
            TxState::Finished(how) => Err(TitoError::TransactionFinished(how)),
        }
    }

    async fn lock_keys(&self, keys: &[Vec<u8>]) -> TitoResult<()> {
        self.with_active(keys.len(), |tx| {
            for key in keys {
                tx.get_for_update(data_key(key).as_slice())
                    .map_err(|e| storage_err("lock_keys", e))?;
            }
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
        let mut tx = {
            let mut state = self.lock();
            match std::mem::replace(&mut *state, TxState::Finished("committed")) {
                TxState::Active(tx) => tx,
                TxState::Finished(how) => {
                    *state = TxState::Finished(how);
                    return Err(TitoError::TransactionFinished(how));
                }
            }
        };
        let written = std::mem::take(&mut *crate::util::lock(&self.inner.written));
        // Held until the commit applied (a move waits for it).
        let _pass = if written.is_empty() {
            None
        } else {
            match self.inner.gate.enter(written.iter().map(Vec::as_slice)) {
                Ok(pass) => Some(pass),
                Err(refused) => {
                    tx.rollback();
                    self.inner.hooks.finish(false);
                    return Err(refused);
                }
            }
        };
        // The group-commit task writes and syncs the log; this task only waits for its answer,
        // so there is nothing to hand off (a hand-off measured at 0.85 of the durable rate).
        let result = tx.commit().await.map_err(classify_commit_error);
        self.inner.hooks.finish(result.is_ok());
        result
    }

    fn after_commit(&self, hook: engine::AfterCommitHook) {
        self.inner.hooks.push(hook);
    }

    async fn rollback(&self) -> TitoResult<()> {
        let mut state = self.lock();
        match std::mem::replace(&mut *state, TxState::Finished("rolled back")) {
            TxState::Active(mut tx) => {
                tx.rollback();
                Ok(())
            }
            TxState::Finished(how) => {
                *state = TxState::Finished(how);
                Err(TitoError::TransactionFinished(how))
            }
        }
    }
}

fn classify_commit_error(err: surrealkv::Error) -> TitoError {
    use surrealkv::Error as E;
    match err {
        E::TransactionWriteConflict | E::TransactionRetry => TitoError::Conflict {
            message: err.to_string(),
            source: Some(Box::new(err)),
        },
        // Refused before anything reached the log: a determined failure.
        E::TransactionClosed
        | E::TransactionReadOnly
        | E::TransactionWriteOnly
        | E::EmptyKey
        | E::BatchTooLarge
        | E::InvalidBatchRecord
        | E::InvalidArgument(_) => storage_err("commit", err),
        // Everything else fails in or after the write of the log (an I/O error, a full disk, a
        // commit group that failed part way and stopped the store): the commit may be in the
        // log, and recovery decides when the store is opened again.
        other => TitoError::CommitOutcomeUnknown {
            message: format!(
                "embedded commit failed while writing its log; recovery decides whether it \
                 took effect when the store is opened again: {other}"
            ),
            source: Some(Box::new(other)),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{version_from_millis, version_millis};

    /// A store that crashes right after persisting a mark, fifty times in a row with no time
    /// passing between: the mark each restart starts from stays within the window of the wall
    /// clock (plus the step a crash may add), and versions keep rising.
    #[test]
    fn crashes_in_a_row_never_compound_the_clocks_lead() {
        let mut mark = 0;
        let mut last = 0;
        let crashes = 50u64;
        for _ in 0..crashes {
            let mut oracle = Oracle::starting_at(mark);
            assert!(
                oracle.next(now_millis()).is_none(),
                "no version before a mark covers it"
            );
            let wanted = oracle.wanted(now_millis()).unwrap();
            oracle.raise(wanted);
            let version = oracle.next(now_millis()).unwrap();
            assert!(version > last && version < wanted);
            last = version;
            mark = wanted; // killed: the next open starts from the persisted mark
        }
        let lead_ms = version_millis(mark).saturating_sub(now_millis());
        let bound = ORACLE_WINDOW_MS + crashes * version_millis(ORACLE_AHEAD_STEP).max(1);
        assert!(
            lead_ms <= bound,
            "{lead_ms} ms ahead after {crashes} crashes"
        );
        // Once the wall clock passed the lead, marks are a window ahead of it again.
        let mut oracle = Oracle::starting_at(version_from_millis(now_millis() - 10_000));
        let lead_ms =
            version_millis(oracle.wanted(now_millis()).unwrap()).saturating_sub(now_millis());
        assert!((ORACLE_WINDOW_MS - 100..=ORACLE_WINDOW_MS).contains(&lead_ms));
        oracle.raise(u64::MAX);
        assert!(oracle.next(now_millis()).is_some());
    }
}
