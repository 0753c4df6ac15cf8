//! The storage contract: what Tito needs from a transactional key/value store.
//!
//! ```text
//!  models, queries, queue, kv          (talk to the two traits only)
//!            |
//!   TitoEngine::transaction(|tx| ..)   (replay on conflict, never after an unknown outcome)
//!            |
//!   TitoEngine  --begin-->  TitoTransaction (get, scan, put, delete, lock, commit)
//!            |
//!   backends: embedded (surrealkv, no server)   tikv (tikv-client, a TiKV cluster)
//!             FaultyEngine<E> (wraps any engine and injects failures; `test-util` feature)
//! ```
//!
//! Keys and values are bytes. Keys are ordered bytewise. Everything above this module speaks
//! only to [`TitoEngine`] and [`TitoTransaction`], so a model, an index query or a queue worker
//! behaves the same on every backend.
//!
//! # Versions
//!
//! Every transaction has a start version, a `u64` drawn from a globally ordered source (PD's
//! timestamp oracle on TiKV, a persisted counter on the embedded engine). Versions follow the
//! layout of TiKV's timestamp oracle: physical milliseconds since the Unix epoch shifted left by
//! [`LOGICAL_BITS`], plus a logical counter. A version therefore also tells time
//! ([`version_millis`]), and leases, garbage collection and the queue read time from the engine
//! rather than from a node's clock.
//!
//! # Implementing a backend
//!
//! A backend MUST guarantee, for every transaction it hands out:
//!
//! - **Snapshot isolation.** Reads see the committed state as of the transaction's start version,
//!   plus the transaction's own uncommitted writes (read-your-own-writes), for point reads and
//!   scans alike.
//! - **Write-write conflict detection.** If another transaction committed a write to a key that
//!   this transaction writes, after this transaction's start version, the commit MUST fail with
//!   [`TitoError::Conflict`] (retryable) and MUST NOT have written anything.
//! - **Locked reads.** [`TitoTransaction::lock_keys`] makes the commit fail with a conflict when
//!   another transaction committed a write to one of those keys after this one started, as if
//!   this transaction had written it. Locking alone does not exclude another transaction that
//!   also only locks; code that needs mutual exclusion writes the key.
//! - **Reads are not validated.** A backend MAY fail a commit because of keys that were only read,
//!   but callers MUST NOT rely on it: write skew is possible, as on TiKV.
//! - **Ordered versions.** Start versions are strictly increasing across all transactions of a
//!   store, also across a restart, and follow the layout described above.
//! - **Unknown outcomes are reported as such.** When a backend cannot tell whether a commit took
//!   effect it MUST return [`TitoError::CommitOutcomeUnknown`], never a retryable error.
//! - **Atomic durability.** A commit that returned `Ok` is durable as the backend documents, and
//!   all of a transaction's writes become visible together or not at all.
//! - **Safe cancellation.** Dropping a transaction handle (or a future using it) without
//!   committing rolls it back, and never panics.
//! - **Bounded reads.** Scans take a limit between 1 and [`MAX_SCAN_LIMIT`].
//! - **Bounded writes, the same everywhere.** A key is 1 to [`MAX_KEY_BYTES`] bytes and a value
//!   at most [`MAX_VALUE_BYTES`]; `put` refuses anything else with
//!   [`TitoError::InvalidArgument`] naming the key, before it is buffered. TiKV refuses large
//!   keys and single writes near its `raft-entry-max-size` (8 MiB by default) only at commit, and
//!   the embedded store would take anything: with one limit checked at `put` on every engine, a
//!   program that works on one engine does not fail on the other.
//!
//! The conformance suite in the repository's `tests/engine_conformance.rs` checks these
//! properties; run it against a new backend before trusting it.
//!
//! # Unknown outcomes
//!
//! A commit can fail without saying whether it took effect: the reply was lost, the connection
//! broke after the request left, the store stopped half way. By default
//! [`TitoEngine::transaction`] returns [`TitoError::CommitOutcomeUnknown`] and never runs the
//! closure again. A policy that [resolves unknown outcomes](RetryPolicy::resolve_unknown_outcomes)
//! (per call through [`TitoEngine::transaction_with`], or store-wide as the handle's
//! [`TitoEngine::retry_policy`]) decides instead:
//!
//! 1. Each attempt writes a commit marker, `commit-marker:{bucket}:{start_version}:{nonce}` =
//!    `committed` (layout in `docs/storage-layout.md`), in the same transaction as its other writes.
//! 2. On an unknown outcome, a fresh transaction reads the marker. Present: the attempt
//!    committed, every write with it, and the closure's value from that attempt is returned.
//! 3. Absent: the fresh transaction writes `fenced` into the marker and commits. If that
//!    commit succeeds, the attempt can never commit, and the closure is replayed as after a
//!    conflict. If the fence conflicts, the attempt committed meanwhile: read again.
//! 4. Rounds that fail (an unreachable store, an unknown outcome of the fence itself) repeat
//!    with backoff until the policy's bound runs out; then the result is
//!    [`TitoError::CommitOutcomeUnknown`], whose message names the marker so that
//!    [`resolve_commit`] can decide later.
//!
//! **Why a committed fence proves the attempt cannot commit, on every engine.** The attempt
//! (start `s1`) and the fence (start `s2 > s1`, after the attempt's commit call returned) both
//! write the marker key. Write-write conflict detection (above) lets at most one of two
//! overlapping writers of a key commit. If the attempt had committed at a version below `s2`,
//! the fence's snapshot would hold the marker and step 3 would not run. If it commits later,
//! it overlaps the fence: whichever commits second fails. So once the fence has committed, the
//! attempt's commit (a late prewrite, a retried request) fails with a conflict.
//!
//! - **TiKV.** The fence's read of the marker meets the attempt's lock if the attempt was
//!   prewritten; the client then asks for the status of the attempt's primary key
//!   (`CheckTxnStatus`): committed, the marker resolves to its value; alive, the read waits
//!   (up to 10 s per read, and again in the next round) until the lock's TTL runs out (3 s for
//!   a small transaction, up to 20 s for a large one, plus 20 s past the last heartbeat of a
//!   transaction that ran over 10 s); expired, TiKV rolls the primary back and leaves a
//!   rollback record, which stops a late commit of the primary. The fence's prewrite then
//!   finds no lock, commits, and leaves a write record newer than the attempt's start, which
//!   makes any late prewrite of the marker a write conflict. A lost reply to the primary's
//!   commit resolves as committed within milliseconds; a commit that never arrived, after the
//!   lock TTL. With the cluster unreachable no round finishes, and the bound decides.
//! - **Embedded.** A commit is applied in memory and in the log together, so the only unknown
//!   outcomes are failures while writing the log (an I/O error, a full disk, a store that
//!   stopped in the middle of a commit group): the group may be in the log, and recovery
//!   decides when the store is opened again. The store refuses commits until then, so no fence
//!   can commit in the same process: the marker is read (visible means committed), and
//!   otherwise the result is [`TitoError::CommitOutcomeUnknown`]. After reopening the store,
//!   [`resolve_commit`] with the marker from the error decides for good.
//! - **Memory.** Commits are atomic in memory and never have unknown outcomes of their own;
//!   `FaultyEngine` (the `test-util` feature) injects them for tests, in both forms (applied and not).
//!
//! Markers are kept for [`COMMIT_MARKER_RETENTION`] (one hour) and then deleted by
//! [`sweep_commit_markers`] (queue worker maintenance and the kv sweeper run it). A resolution
//! never fences the marker of a transaction older than half of that window: it answers
//! "unknown" rather than mistake a swept marker for an absent one.

use std::future::Future;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::error::{TitoError, TitoResult};

#[cfg(any(test, feature = "test-util"))]
mod fault;
pub(crate) mod gate;
mod outcome;
pub(crate) mod random;
mod retry;

#[cfg(any(test, feature = "test-util"))]
pub use fault::{Fault, FaultPoint, FaultRule, Faults, FaultyEngine, FaultyTransaction};
pub use gate::{MAX_TRACKED_KEYS, MOVED_CHECK_INTERVAL, MOVED_COMMIT_DEADLINE, MOVED_KEY, Moved};
pub use outcome::{
    COMMIT_MARKER_RETENTION, COMMIT_MARKER_SWEEP_BATCH, DEFAULT_RESOLUTION_BOUND,
    MAX_RESOLUTION_BOUND, resolve_commit, sweep_commit_markers,
};
pub use retry::{RetryPolicy, write_version};

/// A key and its value, as returned by scans.
pub type KvPair = (Vec<u8>, Vec<u8>);

/// Per-store state of the layers above the engine, one value per type
/// ([`TitoEngine::extensions`]). A backend creates one with each store it opens and hands the
/// same one to every clone of the handle.
#[derive(Default)]
pub struct Extensions(
    std::sync::Mutex<
        std::collections::HashMap<
            std::any::TypeId,
            std::sync::Arc<dyn std::any::Any + Send + Sync>,
        >,
    >,
);

/// On an engine whose open proves that no other process has the store (the embedded engine's
/// lock), an identity of this open of the store, shared by its handle's clones: a record a
/// worker left under another open was left by a process that is gone. Unset elsewhere.
#[derive(Debug, Default)]
pub(crate) struct ExclusiveOpen(std::sync::OnceLock<u64>);

impl ExclusiveOpen {
    /// Records this open's identity (the backend's open does, once).
    pub(crate) fn set(&self, open: u64) {
        let _ = self.0.set(open);
    }

    /// This open's identity, on an engine that proves exclusivity.
    pub(crate) fn get(&self) -> Option<u64> {
        self.0.get().copied()
    }
}

impl Extensions {
    /// A new, empty set (for a backend's open or connect).
    pub fn new() -> Self {
        Extensions::default()
    }

    /// This store's value of type `T`, created with `T::default()` on first use.
    pub fn get<T: std::any::Any + Send + Sync + Default>(&self) -> std::sync::Arc<T> {
        let mut values = crate::util::lock(&self.0);
        let value = values
            .entry(std::any::TypeId::of::<T>())
            .or_insert_with(|| std::sync::Arc::new(T::default()));
        match value.clone().downcast::<T>() {
            Ok(value) => value,
            // Entries are keyed by their own type id: a mismatch cannot happen.
            Err(_) => std::sync::Arc::new(T::default()),
        }
    }
}

impl std::fmt::Debug for Extensions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let count = self.0.lock().map_or(0, |values| values.len());
        f.debug_struct("Extensions")
            .field("values", &count)
            .finish()
    }
}

/// How many low bits of a version hold the logical counter; the bits above hold milliseconds.
pub const LOGICAL_BITS: u32 = 18;

pub use crate::keys::MAX_KEY_BYTES;

/// The largest value a transaction may write in one key (6 MiB: TiDB's default entry limit,
/// leaving a key and its value well under TiKV's default 8 MiB Raft entry).
pub const MAX_VALUE_BYTES: usize = 6 * 1024 * 1024;

/// The largest `limit` a single scan accepts. Larger reads are made of several scans.
pub const MAX_SCAN_LIMIT: usize = 10_000;

/// The partition count used by queues and model events when a connection does not name one.
pub const DEFAULT_PARTITIONS: u32 = 16;

/// The largest partition count a store accepts (partitions are written as four digits in keys).
pub const MAX_PARTITIONS: u32 = 10_000;

/// The version whose physical part is `millis` and whose logical part is zero.
pub fn version_from_millis(millis: u64) -> u64 {
    millis << LOGICAL_BITS
}

/// The physical part of a version: milliseconds since the Unix epoch.
pub fn version_millis(version: u64) -> u64 {
    version >> LOGICAL_BITS
}

/// A transactional, ordered key/value store.
///
/// A handle is cheap to clone and every clone talks to the same store. See the
/// [module documentation](self) for what an implementation must guarantee.
pub trait TitoEngine: Clone + Send + Sync + 'static {
    /// The transaction type of this backend.
    type Transaction: TitoTransaction;

    /// Starts a transaction with a fresh start version.
    fn begin(&self) -> impl Future<Output = TitoResult<Self::Transaction>> + Send;

    /// A fresh version from the store's ordered source: greater than the start version of every
    /// transaction begun before this call.
    fn current_version(&self) -> impl Future<Output = TitoResult<u64>> + Send;

    /// Lets the store discard versions older than `retention` before the store's current time.
    ///
    /// Returns the safe point in effect afterwards (a version). A zero `retention` is
    /// [`TitoError::InvalidArgument`]. Succeeds also when the store already holds a newer safe
    /// point, or has nothing to collect. Choose a window longer than every transaction and
    /// historical read still running.
    fn garbage_collect(&self, retention: Duration) -> impl Future<Output = TitoResult<u64>> + Send;

    /// Destroys every key in `start..end` (start inclusive, end exclusive). Both bounds must be
    /// named: an empty `start` or `end` is [`TitoError::InvalidArgument`] (a destructive call
    /// never reaches to the edge of the key space by default), and so is `start >= end`.
    ///
    /// To clear everything under a prefix, pass the prefix and its end:
    /// `db.delete_range(b"table:old:", &tito::prefix_end_bytes(b"table:old:"))`.
    ///
    /// This is an offline, destructive maintenance operation for reset, restore and drop-style
    /// work with application traffic stopped. It is not a transaction: concurrent transactions
    /// may observe it half done. Use ordinary deletes in transactions for everything else.
    fn delete_range(&self, start: &[u8], end: &[u8])
    -> impl Future<Output = TitoResult<()>> + Send;

    /// The partition count given when this handle was opened; queues and model events created
    /// from this handle use it unless they name their own.
    fn partitions(&self) -> u32 {
        DEFAULT_PARTITIONS
    }

    /// The retry policy [`TitoEngine::transaction`] uses for this handle.
    fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy::default()
    }

    /// The state the layers above keep for this store in this process (the schema catalog's
    /// cache and registered builders, the inbox subscriptions). Created by the backend's open or
    /// connect and shared by every clone of the handle (and by wrappers such as
    /// `FaultyEngine`, which return their inner engine's), so two stores in one process never
    /// share it.
    fn extensions(&self) -> &Extensions;

    /// The operations on model `T` stored in this engine: `db.clone().model::<User>()` is a
    /// [`TitoModel<Self, User>`](struct@crate::TitoModel).
    fn model<T: OnStore<Self>>(self) -> T::Handle {
        T::handle(self)
    }

    /// Runs `f` in a transaction and commits it, replaying `f` in a new transaction after a
    /// retryable conflict.
    ///
    /// - `f` is called with a transaction handle. On `Ok` the transaction is committed; on `Err`
    ///   it is rolled back and the error is returned unchanged.
    /// - A commit that fails with [`TitoError::Conflict`] is retried with jittered exponential
    ///   backoff as [`TitoEngine::retry_policy`] says; each attempt calls a fresh clone of `f`,
    ///   so every attempt starts from the same captured values. When the attempts run out the
    ///   result is [`TitoError::RetriesExhausted`].
    /// - A commit whose outcome is unknown returns [`TitoError::CommitOutcomeUnknown`] and `f`
    ///   is never run again, unless the policy
    ///   [resolves unknown outcomes](RetryPolicy::resolve_unknown_outcomes): then a committed
    ///   attempt returns its value and one proven not to have committed is replayed (see
    ///   [Unknown outcomes](self#unknown-outcomes)).
    /// - Dropping the returned future rolls the transaction back.
    /// - Two shapes of `f`: an async closure, `async |tx| { .. }`, borrows what it uses from
    ///   its surroundings (a model handle, an id, a request body) and is replayed with the same
    ///   borrowed values, no clones; `|tx| async move { .. }` owns what it captures, cloned per
    ///   attempt (for a transaction spawned as a task of its own, which cannot borrow). Both
    ///   work in generic code over `E: TitoEngine` and in spawned tasks: the returned future is
    ///   a boxed `Send` future (one allocation per call), which is what lets rustc prove
    ///   `Send` for a borrowing async closure in generic code (its opaque `impl Future` could
    ///   not be, rust-lang/rust#110338).
    /// - `f` may handle an error of an operation it ran and still return `Ok`: Tito's
    ///   operations (model writes, publications, kv writes) check what can refuse them before
    ///   they buffer anything, so a refused one left nothing behind. One that failed after
    ///   buffering part of its writes [marked the transaction failed](TitoTransaction::fail):
    ///   the commit then returns [`TitoError::TransactionAborted`] naming that failure, and `f`
    ///   is not replayed.
    ///
    /// # Examples
    ///
    /// ```
    /// use tito::backend::embedded::Embedded;
    /// use tito::{TitoEngine, TitoError, TitoTransaction};
    ///
    /// # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
    /// # async fn main() -> Result<(), TitoError> {
    /// let db = Embedded::temporary().await?;
    /// db.transaction(|tx| async move {
    ///     tx.put(b"greeting".to_vec(), b"hello".to_vec()).await?;
    ///     Ok::<_, TitoError>(())
    /// })
    /// .await?;
    ///
    /// let value = db
    ///     .transaction(|tx| async move { tx.get(b"greeting").await })
    ///     .await?;
    /// assert_eq!(value.as_deref(), Some(&b"hello"[..]));
    ///
    /// // An async closure borrows `key` and `suffix`: nothing is cloned by hand.
    /// let (key, suffix) = (b"greeting".to_vec(), String::from(", world"));
    /// let longer = db
    ///     .transaction(async |tx| {
    ///         let mut value = tx.get(&key).await?.unwrap_or_default();
    ///         value.extend_from_slice(suffix.as_bytes());
    ///         tx.put(key.clone(), value.clone()).await?;
    ///         Ok::<_, TitoError>(value)
    ///     })
    ///     .await?;
    /// assert_eq!(longer, b"hello, world");
    /// # Ok(())
    /// # }
    /// ```
    fn transaction<'a, F, Fut, T, E>(&'a self, f: F) -> BoxFuture<'a, Result<T, E>>
    where
        F: FnOnce(Self::Transaction) -> Fut + Clone + Send + 'a,
        Fut: Future<Output = Result<T, E>> + Send + 'a,
        T: Send + 'a,
        E: From<TitoError> + Send + 'a,
    {
        let policy = self.retry_policy();
        Box::pin(retry::run(self, policy, f))
    }

    /// [`TitoEngine::transaction`] with an explicit retry policy.
    fn transaction_with<'a, F, Fut, T, E>(
        &'a self,
        policy: RetryPolicy,
        f: F,
    ) -> BoxFuture<'a, Result<T, E>>
    where
        F: FnOnce(Self::Transaction) -> Fut + Clone + Send + 'a,
        Fut: Future<Output = Result<T, E>> + Send + 'a,
        T: Send + 'a,
        E: From<TitoError> + Send + 'a,
    {
        Box::pin(retry::run(self, policy, f))
    }
}

/// One transaction of a [`TitoEngine`].
///
/// The handle is cheap to clone; clones share the transaction. Writes are buffered until
/// [`commit`](TitoTransaction::commit). After commit or rollback every call fails with
/// [`TitoError::TransactionFinished`]. Dropping the last handle of an unfinished transaction
/// rolls it back.
pub trait TitoTransaction: Clone + Send + Sync + 'static {
    /// The start version: the snapshot this transaction reads, unique to this transaction.
    fn start_version(&self) -> u64;

    /// Reads one key.
    fn get(&self, key: &[u8]) -> impl Future<Output = TitoResult<Option<Vec<u8>>>> + Send;

    /// Reads many keys in one round trip. The result has one entry per requested key, in the
    /// same order.
    fn batch_get(
        &self,
        keys: &[Vec<u8>],
    ) -> impl Future<Output = TitoResult<Vec<Option<Vec<u8>>>>> + Send;

    /// Reads up to `limit` pairs of `start..end` in ascending key order (an empty `end` means the
    /// end of the key space). `limit` must be between 1 and [`MAX_SCAN_LIMIT`].
    fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        limit: usize,
    ) -> impl Future<Output = TitoResult<Vec<KvPair>>> + Send;

    /// Reads up to `limit` pairs of `start..end` in descending key order, starting from the
    /// greatest key below `end`.
    fn scan_reverse(
        &self,
        start: &[u8],
        end: &[u8],
        limit: usize,
    ) -> impl Future<Output = TitoResult<Vec<KvPair>>> + Send;

    /// Writes a key (buffered until commit).
    fn put(&self, key: Vec<u8>, value: Vec<u8>) -> impl Future<Output = TitoResult<()>> + Send;

    /// Deletes a key (buffered until commit). Deleting a missing key is not an error.
    fn delete(&self, key: Vec<u8>) -> impl Future<Output = TitoResult<()>> + Send;

    /// Makes the commit conflict if another transaction commits a write to any of these keys
    /// after this transaction started, as if this transaction wrote them.
    fn lock_keys(&self, keys: &[Vec<u8>]) -> impl Future<Output = TitoResult<()>> + Send;

    /// Commits the buffered writes atomically. A transaction [marked failed](Self::fail) is
    /// rolled back instead, and the commit returns [`TitoError::TransactionAborted`] naming the
    /// first failure.
    fn commit(&self) -> impl Future<Output = TitoResult<()>> + Send;

    /// Marks the transaction failed: `cause` (the first one counts) left part of an operation's
    /// writes buffered, so its commit must be refused. Reads, writes and rollback go on as
    /// before; only [`commit`](Self::commit) changes. Tito's operations call it when they fail
    /// after buffering a write; see [`aborting`].
    fn fail(&self, cause: &TitoError);

    /// Runs `hook` once this transaction has committed, right after the commit succeeds; never
    /// when it rolls back, its commit fails (including an unknown outcome) or it is dropped.
    /// Tito wakes this process's workers with it, so that they poll a partition only once the
    /// publication that woke them is visible.
    fn after_commit(&self, hook: AfterCommitHook);

    /// Discards the buffered writes. Rolling back a finished transaction is an error.
    fn rollback(&self) -> impl Future<Output = TitoResult<()>> + Send;
}

/// A type with a handle over a store: what [`TitoEngine::model`] builds. The model layer
/// implements it for every [`TitoModelTrait`](crate::TitoModelTrait) type (the handle is its
/// [`TitoModel`](struct@crate::TitoModel)), so the storage contract names no layer above it.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a Tito model",
    label = "not a model",
    note = "derive it: `#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]`"
)]
pub trait OnStore<E>: Sized {
    /// The handle: a [`TitoModel<E, Self>`](struct@crate::TitoModel) for a model.
    type Handle;
    /// The handle of this type over `engine`.
    fn handle(engine: E) -> Self::Handle;
}

/// Runs `read` in a transaction of its own, then rolls that transaction back (nothing was
/// written, so a failed rollback loses nothing).
pub(crate) async fn read_only<E: TitoEngine, R>(
    db: &E,
    read: impl AsyncFnOnce(&E::Transaction) -> TitoResult<R>,
) -> TitoResult<R> {
    let tx = db.begin().await?;
    let result = read(&tx).await;
    let _ = tx.rollback().await;
    result
}

/// Runs the write phase of an operation in a caller's transaction: on an error, `tx` is
/// [marked failed](TitoTransaction::fail) (part of the operation may be buffered), so a caller
/// that handles the error and commits anyway gets [`TitoError::TransactionAborted`] instead of
/// storing half of it. Tito's operations check what they can foresee before this phase.
pub async fn aborting<X: TitoTransaction, R>(
    tx: &X,
    work: impl Future<Output = TitoResult<R>>,
) -> TitoResult<R> {
    let result = work.await;
    if let Err(err) = &result {
        tx.fail(err);
    }
    result
}

/// What [`TitoTransaction::after_commit`] runs.
pub type AfterCommitHook = Box<dyn FnOnce() + Send + 'static>;

/// The hooks of one transaction, run after its commit succeeded (see
/// [`TitoTransaction::after_commit`]).
#[derive(Default)]
pub(crate) struct AfterCommit(std::sync::Mutex<Vec<AfterCommitHook>>);

impl std::fmt::Debug for AfterCommit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AfterCommit({} hooks)", crate::util::lock(&self.0).len())
    }
}

impl AfterCommit {
    /// Keeps `hook` for the commit.
    pub(crate) fn push(&self, hook: AfterCommitHook) {
        crate::util::lock(&self.0).push(hook);
    }

    /// After a commit: runs the hooks (once) when it succeeded, drops them otherwise.
    pub(crate) fn finish(&self, committed: bool) {
        let hooks = std::mem::take(&mut *crate::util::lock(&self.0));
        if committed {
            for hook in hooks {
                hook();
            }
        }
    }
}

/// The first failure of a transaction, kept for its commit (see [`TitoTransaction::fail`]).
#[derive(Debug, Default)]
pub(crate) struct FirstFailure(std::sync::OnceLock<String>);

impl FirstFailure {
    /// Records `cause` unless a failure is recorded already.
    pub(crate) fn record(&self, cause: &TitoError) {
        let _ = self.0.set(cause.to_string());
    }

    /// The error a commit returns, when a failure was recorded.
    pub(crate) fn refusal(&self) -> Option<TitoError> {
        self.0
            .get()
            .map(|cause| TitoError::TransactionAborted(cause.clone()))
    }
}

/// A plan of writes, checked as a whole before any is buffered: every key and value against
/// [`MAX_KEY_BYTES`] and [`MAX_VALUE_BYTES`], then applied in order; a failure while applying
/// marks the transaction failed ([`aborting`]).
#[derive(Debug, Default)]
pub(crate) struct Writes(Vec<(Vec<u8>, Option<Vec<u8>>)>);

impl Writes {
    pub(crate) fn put(&mut self, key: impl Into<Vec<u8>>, value: Vec<u8>) {
        self.0.push((key.into(), Some(value)));
    }

    pub(crate) fn delete(&mut self, key: impl Into<Vec<u8>>) {
        self.0.push((key.into(), None));
    }

    /// Whether the plan's last write of `key` puts a value.
    pub(crate) fn has(&self, key: &[u8]) -> bool {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .is_some_and(|(_, value)| value.is_some())
    }

    /// Checks every write against the limits; nothing is buffered.
    pub(crate) fn check(&self) -> TitoResult<()> {
        for (key, value) in &self.0 {
            check_write(key, value.as_deref().unwrap_or_default())?;
        }
        Ok(())
    }

    /// Checks, then buffers every write in `tx`; a failure after the check marks `tx` failed.
    pub(crate) async fn apply<X: TitoTransaction>(self, tx: &X) -> TitoResult<()> {
        self.check()?;
        aborting(tx, async {
            for (key, value) in self.0 {
                match value {
                    Some(value) => tx.put(key, value).await?,
                    None => tx.delete(key).await?,
                }
            }
            Ok(())
        })
        .await
    }
}

/// Checks the arguments of a scan: a limit in range and `start < end` (or an open end).
pub(crate) fn check_scan(start: &[u8], end: &[u8], limit: usize) -> TitoResult<()> {
    if limit == 0 || limit > MAX_SCAN_LIMIT {
        return Err(TitoError::invalid_argument(format!(
            "scan limit must be between 1 and {MAX_SCAN_LIMIT}, got {limit}"
        )));
    }
    check_range(start, end)
}

/// Checks that a range is not empty: `start < end`, or `end` empty (the end of the key space).
pub(crate) fn check_range(start: &[u8], end: &[u8]) -> TitoResult<()> {
    if !end.is_empty() && start >= end {
        return Err(TitoError::invalid_argument(format!(
            "range start must sort before its end (start {}, end {})",
            crate::keys::display_key(start),
            crate::keys::display_key(end)
        )));
    }
    Ok(())
}

/// Checks one write against [`MAX_KEY_BYTES`] and [`MAX_VALUE_BYTES`].
pub(crate) fn check_write(key: &[u8], value: &[u8]) -> TitoResult<()> {
    let shown = || {
        let text = crate::keys::display_key(&key[..key.len().min(96)]);
        if key.len() > 96 {
            format!("{text}…")
        } else {
            text
        }
    };
    if key.is_empty() {
        return Err(TitoError::invalid_argument("a key is empty"));
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(TitoError::invalid_argument(format!(
            "key {} is {} bytes, over MAX_KEY_BYTES ({MAX_KEY_BYTES}): shorten the id or the \
             indexed value it holds",
            shown(),
            key.len()
        )));
    }
    if value.len() > MAX_VALUE_BYTES {
        return Err(TitoError::invalid_argument(format!(
            "the value of key {} is {} bytes, over MAX_VALUE_BYTES ({MAX_VALUE_BYTES})",
            shown(),
            value.len()
        )));
    }
    Ok(())
}

/// Checks the bounds of a destructive range: both named, `start < end`.
pub(crate) fn check_destroy_range(start: &[u8], end: &[u8]) -> TitoResult<()> {
    if start.is_empty() || end.is_empty() {
        return Err(TitoError::invalid_argument(format!(
            "delete_range needs both bounds (start {}, end {}); pass a prefix and \
             keys::prefix_end_bytes(prefix) to clear a prefix",
            crate::keys::display_key(start),
            crate::keys::display_key(end)
        )));
    }
    check_range(start, end)
}

/// Checks a garbage-collection retention window.
pub(crate) fn check_retention(retention: Duration) -> TitoResult<u64> {
    let millis = crate::util::millis(retention);
    if millis == 0 {
        return Err(TitoError::invalid_argument(
            "garbage collection retention must be at least one millisecond",
        ));
    }
    Ok(millis)
}

/// Checks a partition count given when a store is opened.
pub(crate) fn check_partitions(partitions: u32) -> TitoResult<u32> {
    if partitions == 0 || partitions > MAX_PARTITIONS {
        return Err(TitoError::invalid_argument(format!(
            "partition count must be between 1 and {MAX_PARTITIONS}, got {partitions}"
        )));
    }
    Ok(partitions)
}
