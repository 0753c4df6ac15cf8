//! The in-memory engine: the whole storage contract, no disk, no server.
//!
//! [`Memory`] keeps every key's committed versions in an ordered map and gives the same
//! guarantees as the other engines: snapshot isolation (a transaction reads the versions
//! committed before its start version, plus its own writes), first-committer-wins write-write
//! conflicts reported as a retryable [`TitoError::Conflict`], [`lock_keys`] with TiKV's
//! semantics (a locked key counts as written by the locking transaction, for the conflicts of
//! both), versions in the timestamp oracle's layout, scans both ways with limits, a garbage
//! collection safe point that only moves forward, and range destruction.
//!
//! Use it for unit tests of code written against [`TitoEngine`]: it is faster than a temporary
//! directory and leaves nothing behind. Wrap it in `tito::engine::FaultyEngine` (the
//! `test-util` feature) to inject conflicts, unknown commit outcomes, storage errors and delays.
//!
//! # Clock
//!
//! Versions carry time ([`crate::engine::version_millis`]), and leases, queue due times and kv
//! expiries read it. [`MemoryClock::Host`] (the default) takes it from the host's clock;
//! [`MemoryClock::Runtime`] from the Tokio runtime's clock, starting at a fixed Unix time: under
//! a runtime with paused time, versions, leases and due times then follow simulated time and a
//! run is repeatable.
//!
//! ```
//! use tito::backend::memory::Memory;
//! use tito::{TitoEngine, TitoError, TitoTransaction};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), TitoError> {
//! let db = Memory::new();
//! db.transaction(|tx| async move { tx.put(b"k".to_vec(), b"v".to_vec()).await })
//!     .await?;
//! let tx = db.begin().await?;
//! assert_eq!(tx.get(b"k").await?, Some(b"v".to_vec()));
//! # Ok(())
//! # }
//! ```
//!
//! [`lock_keys`]: TitoTransaction::lock_keys

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::backend::embedded::Oracle;
use crate::engine::{
    self, KvPair, LOGICAL_BITS, RetryPolicy, TitoEngine, TitoTransaction, check_retention,
    check_scan,
};
use crate::error::{TitoError, TitoResult};

/// Where a [`Memory`] store's time comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MemoryClock {
    /// The host's clock.
    #[default]
    Host,
    /// The Tokio runtime's clock, starting at `epoch_ms` (Unix milliseconds) when the store is
    /// made. Under paused time it moves only as the runtime advances it.
    Runtime {
        /// The Unix time, in milliseconds, the store's clock shows when it is made.
        epoch_ms: u64,
    },
}

/// Options for [`Memory::with_options`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct MemoryOptions {
    clock: MemoryClock,
    partitions: u32,
    retry: RetryPolicy,
}

impl Default for MemoryOptions {
    fn default() -> Self {
        MemoryOptions {
            clock: MemoryClock::Host,
            partitions: engine::DEFAULT_PARTITIONS,
            retry: RetryPolicy::default(),
        }
    }
}

impl MemoryOptions {
    /// The host clock, 16 partitions, the default retry policy.
    pub fn new() -> Self {
        Self::default()
    }

    /// Where time comes from.
    pub fn clock(mut self, clock: MemoryClock) -> Self {
        self.clock = clock;
        self
    }

    /// The default partition count for queues and model events (1 to 10000).
    pub fn partitions(mut self, partitions: u32) -> Self {
        self.partitions = partitions;
        self
    }

    /// The retry policy of [`TitoEngine::transaction`] on this handle.
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }
}

/// One committed version of a key.
#[derive(Clone, Debug)]
struct Version {
    commit: u64,
    /// The value; `None` for a delete or a lock (which changes nothing but conflicts).
    value: Option<Vec<u8>>,
    lock_only: bool,
}

struct State {
    data: BTreeMap<Vec<u8>, Vec<Version>>,
    /// The same timestamp oracle as the embedded and SQLite stores' (its marks "persisted" in
    /// memory), so a simulated crash moves the clock as a real one does.
    oracle: Oracle,
    safe_point: u64,
    /// Start versions of open transactions, with how many share one (never more than one).
    open: BTreeMap<u64, usize>,
}

struct Inner {
    state: Mutex<State>,
    clock: Clock,
    partitions: u32,
    id: u64,
    extensions: engine::Extensions,
}

enum Clock {
    Host,
    Runtime {
        epoch_ms: u64,
        start: tokio::time::Instant,
    },
}

impl Clock {
    fn now_ms(&self) -> u64 {
        match self {
            Clock::Host => crate::backend::embedded::now_millis(),
            Clock::Runtime { epoch_ms, start } => {
                epoch_ms.saturating_add(crate::util::millis(start.elapsed()))
            }
        }
    }
}

/// An in-memory store. Cheap to clone; clones share the store, which lives as long as they do.
#[derive(Clone)]
pub struct Memory {
    inner: Arc<Inner>,
    retry: RetryPolicy,
}

impl std::fmt::Debug for Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Memory")
            .field("id", &self.inner.id)
            .field("partitions", &self.inner.partitions)
            .finish()
    }
}

impl Default for Memory {
    fn default() -> Self {
        Memory::new()
    }
}

static STORES: AtomicU64 = AtomicU64::new(0);

impl Memory {
    /// An empty store on the host clock.
    pub fn new() -> Self {
        Self::with_options(MemoryOptions::default()).expect("the default options are valid")
    }

    /// An empty store with options. A [`MemoryClock::Runtime`] clock needs a Tokio runtime.
    pub fn with_options(options: MemoryOptions) -> TitoResult<Self> {
        let partitions = engine::check_partitions(options.partitions)?;
        options.retry.check()?;
        let clock = match options.clock {
            MemoryClock::Host => Clock::Host,
            MemoryClock::Runtime { epoch_ms } => {
                if tokio::runtime::Handle::try_current().is_err() {
                    return Err(TitoError::invalid_argument(
                        "MemoryClock::Runtime needs a running Tokio runtime",
                    ));
                }
                Clock::Runtime {
                    epoch_ms,
                    start: tokio::time::Instant::now(),
                }
            }
        };
        Ok(Memory {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    data: BTreeMap::new(),
                    oracle: Oracle::starting_at(0),
                    safe_point: 0,
                    open: BTreeMap::new(),
                }),
                clock,
                partitions,
                id: STORES.fetch_add(1, Ordering::Relaxed),
                extensions: {
                    let extensions = engine::Extensions::new();
                    extensions.get::<engine::gate::Gate>().mark_local();
                    extensions
                },
            }),
            retry: options.retry,
        })
    }

    /// A new handle to the same store with another retry policy.
    pub fn with_retry_policy(&self, policy: RetryPolicy) -> Self {
        Memory {
            inner: Arc::clone(&self.inner),
            retry: policy,
        }
    }

    /// How many keys hold at least one live value now (for tests and tooling).
    pub fn len(&self) -> usize {
        let state = self.inner.lock();
        state
            .data
            .values()
            .filter(|versions| visible(versions, u64::MAX).is_some())
            .count()
    }

    /// Whether no key holds a live value.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Moves the store's clock as a restart of a timestamp oracle that does not wait out its
    /// lead moves it (PD's after a leader change): versions continue from the mark the oracle
    /// last persisted, up to three seconds ahead of the clock (see
    /// [`crate::backend::embedded`]); the data stays. For simulations of crash loops: the
    /// clock's lead must stay bounded however many restarts follow each other.
    #[cfg(feature = "test-util")]
    pub fn crash_clock(&self) {
        let mut state = self.inner.lock();
        let mark = state.oracle.persisted_limit;
        state.oracle = Oracle::starting_at(mark);
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update below leaves the state consistent before it can panic.
        crate::util::lock(&self.state)
    }

    /// The next version: the clock, or one above the last version handed out.
    fn next_version(&self, state: &mut State) -> u64 {
        let now_ms = self.clock.now_ms();
        loop {
            if let Some(next) = state.oracle.next(now_ms) {
                return next;
            }
            // The mark is kept, not written: it is what a crash would resume from.
            let mark = state
                .oracle
                .wanted(now_ms)
                .expect("a version refused by the oracle asks for a mark");
            state.oracle.raise(mark);
        }
    }
}

/// The value of a key as of `snapshot` (versions committed before it), skipping locks.
fn visible(versions: &[Version], snapshot: u64) -> Option<&Vec<u8>> {
    versions
        .iter()
        .rev()
        .filter(|v| v.commit < snapshot && !v.lock_only)
        .map(|v| v.value.as_ref())
        .next()
        .flatten()
}

impl TitoEngine for Memory {
    type Transaction = MemoryTransaction;

    async fn begin(&self) -> TitoResult<MemoryTransaction> {
        let start_version = {
            let mut state = self.inner.lock();
            let version = self.inner.next_version(&mut state);
            *state.open.entry(version).or_default() += 1;
            version
        };
        Ok(MemoryTransaction {
            inner: Arc::new(TxInner {
                db: self.inner.clone(),
                start_version,
                state: Mutex::new(TxState::Active {
                    writes: BTreeMap::new(),
                    locks: BTreeSet::new(),
                }),
                failed: engine::FirstFailure::default(),
                hooks: engine::AfterCommit::default(),
            }),
        })
    }

    async fn current_version(&self) -> TitoResult<u64> {
        let mut state = self.inner.lock();
        Ok(self.inner.next_version(&mut state))
    }

    async fn garbage_collect(&self, retention: Duration) -> TitoResult<u64> {
        let retention_ms = check_retention(retention)?;
        let mut state = self.inner.lock();
        let now = self.inner.next_version(&mut state);
        let wanted = engine::version_millis(now).saturating_sub(retention_ms) << LOGICAL_BITS;
        if wanted > state.safe_point {
            state.safe_point = wanted;
        }
        // Versions older than what the safe point (and every open snapshot) still reads go.
        let horizon = state
            .open
            .keys()
            .next()
            .copied()
            .unwrap_or(u64::MAX)
            .min(state.safe_point);
        state.data.retain(|_, versions| {
            let keep_from = versions
                .iter()
                .rposition(|v| v.commit < horizon && !v.lock_only)
                .unwrap_or(0);
            versions.drain(..keep_from);
            versions.retain(|v| !(v.lock_only && v.commit < horizon));
            // A key whose only version is an old delete is gone for every snapshot.
            let gone = match versions.as_slice() {
                [] => true,
                [only] => only.value.is_none() && only.commit < horizon,
                _ => false,
            };
            !gone
        });
        Ok(state.safe_point)
    }

    async fn delete_range(&self, start: &[u8], end: &[u8]) -> TitoResult<()> {
        engine::check_destroy_range(start, end)?;
        let _pass = self
            .inner
            .extensions
            .get::<engine::gate::Gate>()
            .enter_untracked()?;
        let mut state = self.inner.lock();
        let doomed: Vec<Vec<u8>> = state
            .data
            .range::<[u8], _>((Bound::Included(start), Bound::Excluded(end)))
            .map(|(k, _)| k.clone())
            .collect();
        for key in doomed {
            state.data.remove(&key);
        }
        Ok(())
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

/// A transaction of the [`Memory`] engine.
#[derive(Clone)]
pub struct MemoryTransaction {
    inner: Arc<TxInner>,
}

struct TxInner {
    db: Arc<Inner>,
    start_version: u64,
    state: Mutex<TxState>,
    failed: engine::FirstFailure,
    /// Run after a successful commit.
    hooks: engine::AfterCommit,
}

enum TxState {
    Active {
        /// Buffered writes: `None` deletes.
        writes: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
        locks: BTreeSet<Vec<u8>>,
    },
    Finished(&'static str),
}

impl std::fmt::Debug for MemoryTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryTransaction")
            .field("start_version", &self.inner.start_version)
            .finish()
    }
}

impl TxInner {
    /// Forgets this transaction's snapshot (once).
    fn close(&self, state: &mut TxState, how: &'static str) {
        if matches!(state, TxState::Active { .. }) {
            *state = TxState::Finished(how);
            let mut db = self.db.lock();
            if let Some(count) = db.open.get_mut(&self.start_version) {
                *count -= 1;
                if *count == 0 {
                    db.open.remove(&self.start_version);
                }
            }
        }
    }
}

impl Drop for TxInner {
    fn drop(&mut self) {
        let mut state = std::mem::replace(
            self.state.get_mut().unwrap_or_else(|e| e.into_inner()),
            TxState::Finished("dropped"),
        );
        if matches!(state, TxState::Active { .. }) {
            self.close(&mut state, "rolled back");
        }
    }
}

type Writes = BTreeMap<Vec<u8>, Option<Vec<u8>>>;

impl MemoryTransaction {
    fn with_active<R>(
        &self,
        f: impl FnOnce(&mut Writes, &mut BTreeSet<Vec<u8>>) -> TitoResult<R>,
    ) -> TitoResult<R> {
        let mut state = crate::util::lock(&self.inner.state);
        match &mut *state {
            TxState::Active { writes, locks } => f(writes, locks),
            TxState::Finished(how) => Err(TitoError::TransactionFinished(how)),
        }
    }

    fn read(&self, key: &[u8], writes: &Writes) -> Option<Vec<u8>> {
        if let Some(own) = writes.get(key) {
            return own.clone();
        }
        let db = self.inner.db.lock();
        db.data
            .get(key)
            .and_then(|versions| visible(versions, self.inner.start_version))
            .cloned()
    }

    fn scan_dir(
        &self,
        start: &[u8],
        end: &[u8],
        limit: usize,
        reverse: bool,
    ) -> TitoResult<Vec<KvPair>> {
        check_scan(start, end, limit)?;
        let upper: Bound<&[u8]> = if end.is_empty() {
            Bound::Unbounded
        } else {
            Bound::Excluded(end)
        };
        let range = (Bound::Included(start), upper);
        self.with_active(|writes, _| {
            let db = self.inner.db.lock();
            let snapshot = self.inner.start_version;
            // Committed keys and own writes, merged in key order.
            let mut keys: BTreeSet<&[u8]> = BTreeSet::new();
            let mut out = Vec::new();
            let committed = db.data.range::<[u8], _>(range);
            let own = writes.range::<[u8], _>(range);
            let take = |key: &[u8], out: &mut Vec<KvPair>| {
                let value = match writes.get(key) {
                    Some(own) => own.clone(),
                    None => db
                        .data
                        .get(key)
                        .and_then(|versions| visible(versions, snapshot))
                        .cloned(),
                };
                if let Some(value) = value {
                    out.push((key.to_vec(), value));
                }
            };
            if reverse {
                let mut committed = committed.rev().map(|(k, _)| k.as_slice()).peekable();
                let mut own = own.rev().map(|(k, _)| k.as_slice()).peekable();
                while out.len() < limit {
                    let next = match (committed.peek(), own.peek()) {
                        (None, None) => break,
                        (Some(a), Some(b)) if a >= b => committed.next(),
                        (Some(_), None) => committed.next(),
                        _ => own.next(),
                    }
                    .expect("peeked");
                    if keys.insert(next) {
                        take(next, &mut out);
                    }
                }
            } else {
                let mut committed = committed.map(|(k, _)| k.as_slice()).peekable();
                let mut own = own.map(|(k, _)| k.as_slice()).peekable();
                while out.len() < limit {
                    let next = match (committed.peek(), own.peek()) {
                        (None, None) => break,
                        (Some(a), Some(b)) if a <= b => committed.next(),
                        (Some(_), None) => committed.next(),
                        _ => own.next(),
                    }
                    .expect("peeked");
                    if keys.insert(next) {
                        take(next, &mut out);
                    }
                }
            }
            Ok(out)
        })
    }
}

impl TitoTransaction for MemoryTransaction {
    fn start_version(&self) -> u64 {
        self.inner.start_version
    }

    async fn get(&self, key: &[u8]) -> TitoResult<Option<Vec<u8>>> {
        self.with_active(|writes, _| Ok(self.read(key, writes)))
    }

    async fn batch_get(&self, keys: &[Vec<u8>]) -> TitoResult<Vec<Option<Vec<u8>>>> {
        self.with_active(|writes, _| Ok(keys.iter().map(|k| self.read(k, writes)).collect()))
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
        engine::check_write(&key, &value)?;
        self.with_active(|writes, _| {
            writes.insert(key, Some(value));
            Ok(())
        })
    }

    async fn delete(&self, key: Vec<u8>) -> TitoResult<()> {
        self.with_active(|writes, _| {
            writes.insert(key, None);
            Ok(())
        })
    }

    async fn lock_keys(&self, keys: &[Vec<u8>]) -> TitoResult<()> {
        self.with_active(|_, locks| {
            locks.extend(keys.iter().cloned());
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
        let mut state = crate::util::lock(&self.inner.state);
        let (writes, locks) = match &mut *state {
            TxState::Active { writes, locks } => (std::mem::take(writes), std::mem::take(locks)),
            TxState::Finished(how) => return Err(TitoError::TransactionFinished(how)),
        };
        // Held until the commit applied (a move waits for it).
        let _pass = if writes.is_empty() {
            None
        } else {
            match self
                .inner
                .db
                .extensions
                .get::<engine::gate::Gate>()
                .enter(writes.keys().map(Vec::as_slice))
            {
                Ok(pass) => Some(pass),
                Err(refused) => {
                    self.inner.close(&mut state, "rolled back");
                    drop(state);
                    self.inner.hooks.finish(false);
                    return Err(refused);
                }
            }
        };
        let result = {
            let mut db = self.inner.db.lock();
            let start = self.inner.start_version;
            let conflict = writes
                .keys()
                .chain(locks.iter())
                .find(|key| {
                    db.data
                        .get(key.as_slice())
                        .and_then(|versions| versions.last())
                        .is_some_and(|latest| latest.commit > start)
                })
                .cloned();
            match conflict {
                Some(key) => Err(TitoError::conflict(format!(
                    "another transaction committed a write to {} after this one started",
                    crate::keys::display_key(&key)
                ))),
                None => {
                    let commit = self.inner.db.next_version(&mut db);
                    for key in locks.iter().filter(|k| !writes.contains_key(*k)) {
                        db.data.entry(key.clone()).or_default().push(Version {
                            commit,
                            value: None,
                            lock_only: true,
                        });
                    }
                    for (key, value) in writes {
                        db.data.entry(key).or_default().push(Version {
                            commit,
                            value,
                            lock_only: false,
                        });
                    }
                    Ok(())
                }
            }
        };
        self.inner.close(&mut state, "committed");
        drop(state);
        self.inner.hooks.finish(result.is_ok());
        result
    }

    fn after_commit(&self, hook: engine::AfterCommitHook) {
        self.inner.hooks.push(hook);
    }

    async fn rollback(&self) -> TitoResult<()> {
        let mut state = crate::util::lock(&self.inner.state);
        match &*state {
            TxState::Active { .. } => {
                self.inner.close(&mut state, "rolled back");
                Ok(())
            }
            TxState::Finished(how) => Err(TitoError::TransactionFinished(how)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn put(db: &Memory, key: &[u8], value: Option<&[u8]>) {
        let tx = db.begin().await.unwrap();
        match value {
            Some(value) => tx.put(key.to_vec(), value.to_vec()).await.unwrap(),
            None => tx.delete(key.to_vec()).await.unwrap(),
        }
        tx.commit().await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn garbage_collection_keeps_what_open_snapshots_read() {
        let db = Memory::with_options(MemoryOptions::new().clock(MemoryClock::Runtime {
            epoch_ms: 1_000_000,
        }))
        .unwrap();
        put(&db, b"a", Some(b"1")).await;
        put(&db, b"gone", Some(b"x")).await;
        let reader = db.begin().await.unwrap();
        tokio::time::advance(Duration::from_secs(10)).await;
        put(&db, b"a", Some(b"2")).await;
        put(&db, b"gone", None).await;
        tokio::time::advance(Duration::from_secs(10)).await;
        let safe = db.garbage_collect(Duration::from_secs(1)).await.unwrap();
        assert!(engine::version_millis(safe) >= 1_000_000 + 19_000);
        // The open reader still sees its snapshot.
        assert_eq!(reader.get(b"a").await.unwrap().as_deref(), Some(&b"1"[..]));
        assert_eq!(
            reader.get(b"gone").await.unwrap().as_deref(),
            Some(&b"x"[..])
        );
        reader.rollback().await.unwrap();
        // Once it is gone, old versions and the deleted key go too.
        db.garbage_collect(Duration::from_secs(1)).await.unwrap();
        {
            let state = db.inner.lock();
            assert_eq!(state.data.get(&b"a"[..]).map(Vec::len), Some(1));
            assert!(!state.data.contains_key(&b"gone"[..]));
        }
        assert_eq!(db.len(), 1);
        // The safe point never moves back.
        let again = db.garbage_collect(Duration::from_secs(3600)).await.unwrap();
        assert!(again >= safe);
    }

    #[tokio::test]
    async fn bad_options_are_refused() {
        let result = std::thread::spawn(|| {
            Memory::with_options(MemoryOptions::new().clock(MemoryClock::Runtime { epoch_ms: 0 }))
        })
        .join()
        .unwrap();
        assert!(matches!(result, Err(TitoError::InvalidArgument(_))));
        assert!(Memory::with_options(MemoryOptions::new().partitions(0)).is_err());
    }
}
