//! A fault-injecting engine wrapper, for testing code that runs on Tito.
//!
//! [`FaultyEngine`] wraps any engine and behaves exactly like it until a [`FaultRule`] fires:
//! then the chosen call fails the way a real store can fail (a retryable conflict, a commit whose
//! outcome is unknown, a storage error) or is delayed. Rules can wait for a number of matching
//! calls and can be restricted to keys with a prefix, so a test can fail, say, the third commit
//! that writes a queue key.
//!
//! ```
//! use tito::backend::embedded::Embedded;
//! use tito::engine::{Fault, FaultPoint, FaultRule, FaultyEngine};
//! use tito::{TitoEngine, TitoError, TitoTransaction};
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), TitoError> {
//! let db = FaultyEngine::new(Embedded::temporary().await?);
//! // The first two commits conflict; the transaction runner replays the closure.
//! db.faults().add(FaultRule::new(FaultPoint::Commit, Fault::Conflict).times(2));
//! db.transaction(|tx| async move { tx.put(b"k".to_vec(), b"v".to_vec()).await }).await?;
//! assert_eq!(db.faults().calls(FaultPoint::Commit), 3);
//! # Ok(())
//! # }
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{KvPair, RetryPolicy, TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};

/// Where a fault can be injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FaultPoint {
    /// [`TitoEngine::begin`].
    Begin,
    /// [`TitoTransaction::get`] and [`TitoTransaction::batch_get`].
    Get,
    /// [`TitoTransaction::scan`] and [`TitoTransaction::scan_reverse`].
    Scan,
    /// [`TitoTransaction::put`].
    Put,
    /// [`TitoTransaction::delete`].
    Delete,
    /// [`TitoTransaction::lock_keys`].
    LockKeys,
    /// [`TitoTransaction::commit`]. Key filters match the keys the transaction wrote.
    Commit,
}

/// What an injected fault does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// Fail with a retryable [`TitoError::Conflict`]. At commit nothing is written.
    Conflict,
    /// At commit: apply the transaction, then report [`TitoError::CommitOutcomeUnknown`] (the
    /// reply was lost). Elsewhere: a storage error.
    UnknownOutcomeCommitted,
    /// At commit: discard the transaction, then report [`TitoError::CommitOutcomeUnknown`] (the
    /// request was lost). Elsewhere: a storage error.
    UnknownOutcomeNotCommitted,
    /// Fail with a non-retryable [`TitoError::Storage`]. At commit nothing is written.
    Storage,
    /// Wait this long, then carry on normally.
    Delay(Duration),
}

/// When a fault fires: at a point, after some matching calls, a number of times.
#[derive(Clone, Debug)]
pub struct FaultRule {
    point: FaultPoint,
    fault: Fault,
    skip: u64,
    times: u64,
    every: u64,
    key_prefix: Option<Vec<u8>>,
}

impl FaultRule {
    /// A rule that fires `fault` at the next call of `point`, once.
    pub fn new(point: FaultPoint, fault: Fault) -> Self {
        FaultRule {
            point,
            fault,
            skip: 0,
            times: 1,
            every: 1,
            key_prefix: None,
        }
    }

    /// Lets `calls` matching calls pass before the rule fires.
    pub fn skip(mut self, calls: u64) -> Self {
        self.skip = calls;
        self
    }

    /// Fires on this many matching calls (after the skipped ones).
    pub fn times(mut self, times: u64) -> Self {
        self.times = times;
        self
    }

    /// Fires on one matching call in `n` (the first after the skipped ones, then every `n`-th;
    /// `times` counts the calls it fired on). `every(2).always()` fails every other call, so a
    /// transaction replayed after a fault passes on its next attempt. Zero counts as one.
    pub fn every(mut self, n: u64) -> Self {
        self.every = n.max(1);
        self
    }

    /// Fires on every matching call from now on.
    pub fn always(mut self) -> Self {
        self.times = u64::MAX;
        self
    }

    /// Matches only calls that touch a key starting with `prefix` (for commits: a key the
    /// transaction wrote or deleted).
    pub fn when_key_starts_with(mut self, prefix: impl Into<Vec<u8>>) -> Self {
        self.key_prefix = Some(prefix.into());
        self
    }
}

#[derive(Default)]
struct State {
    rules: Vec<(FaultRule, u64, u64)>,
    calls: HashMap<FaultPoint, u64>,
    injected: u64,
}

/// The shared set of fault rules of a [`FaultyEngine`] and its transactions, with counters.
#[derive(Clone, Default)]
pub struct Faults {
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for Faults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.lock();
        f.debug_struct("Faults")
            .field("rules", &state.rules.len())
            .field("injected", &state.injected)
            .finish()
    }
}

impl Faults {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        crate::util::lock(&self.state)
    }

    /// Adds a rule.
    pub fn add(&self, rule: FaultRule) {
        self.lock().rules.push((rule, 0, 0));
    }

    /// Removes every rule (counters are kept).
    pub fn clear(&self) {
        self.lock().rules.clear();
    }

    /// How many calls of `point` were made, faulty or not.
    pub fn calls(&self, point: FaultPoint) -> u64 {
        self.lock().calls.get(&point).copied().unwrap_or(0)
    }

    /// How many faults fired so far.
    pub fn injected(&self) -> u64 {
        self.lock().injected
    }

    fn check<'a>(
        &self,
        point: FaultPoint,
        keys: impl IntoIterator<Item = &'a [u8]> + Clone,
    ) -> Option<Fault> {
        let mut state = self.lock();
        *state.calls.entry(point).or_default() += 1;
        let mut fired = None;
        for (rule, seen, count) in state.rules.iter_mut() {
            if rule.point != point {
                continue;
            }
            if let Some(prefix) = &rule.key_prefix
                && !keys.clone().into_iter().any(|key| key.starts_with(prefix))
            {
                continue;
            }
            *seen += 1;
            if *seen > rule.skip && (*seen - rule.skip - 1) % rule.every == 0 && *count < rule.times
            {
                *count += 1;
                fired = Some(rule.fault);
                break;
            }
        }
        if fired.is_some() {
            state.injected += 1;
        }
        fired
    }

    async fn apply<'a>(
        &self,
        point: FaultPoint,
        keys: impl IntoIterator<Item = &'a [u8]> + Clone,
    ) -> TitoResult<()> {
        match self.check(point, keys) {
            None => Ok(()),
            Some(Fault::Delay(delay)) => {
                tokio::time::sleep(delay).await;
                Ok(())
            }
            Some(Fault::Conflict) => Err(TitoError::conflict(format!(
                "injected conflict at {point:?}"
            ))),
            Some(_) => Err(injected_storage_error(point)),
        }
    }
}

fn injected_storage_error(point: FaultPoint) -> TitoError {
    TitoError::Storage {
        message: format!("injected failure at {point:?}"),
        source: None,
    }
}

/// An engine that behaves like the one it wraps, except where a [`FaultRule`] fires.
#[derive(Clone, Debug)]
pub struct FaultyEngine<E> {
    inner: E,
    faults: Faults,
}

impl<E: TitoEngine> FaultyEngine<E> {
    /// Wraps an engine, with no rules yet.
    pub fn new(inner: E) -> Self {
        FaultyEngine {
            inner,
            faults: Faults::default(),
        }
    }

    /// The rules and counters.
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// The wrapped engine.
    pub fn inner(&self) -> &E {
        &self.inner
    }
}

impl<E: TitoEngine> TitoEngine for FaultyEngine<E> {
    type Transaction = FaultyTransaction<E::Transaction>;

    async fn begin(&self) -> TitoResult<Self::Transaction> {
        self.faults
            .apply(FaultPoint::Begin, std::iter::empty())
            .await?;
        Ok(FaultyTransaction {
            inner: self.inner.begin().await?,
            faults: self.faults.clone(),
            written: Arc::new(Mutex::new(Vec::new())),
            failed: Arc::default(),
        })
    }

    async fn current_version(&self) -> TitoResult<u64> {
        self.inner.current_version().await
    }

    async fn garbage_collect(&self, retention: Duration) -> TitoResult<u64> {
        self.inner.garbage_collect(retention).await
    }

    async fn delete_range(&self, start: &[u8], end: &[u8]) -> TitoResult<()> {
        self.inner.delete_range(start, end).await
    }

    fn partitions(&self) -> u32 {
        self.inner.partitions()
    }

    fn extensions(&self) -> &super::Extensions {
        self.inner.extensions()
    }

    fn retry_policy(&self) -> RetryPolicy {
        self.inner.retry_policy()
    }
}

/// A transaction of a [`FaultyEngine`].
#[derive(Clone)]
pub struct FaultyTransaction<T> {
    inner: T,
    faults: Faults,
    written: Arc<Mutex<Vec<Vec<u8>>>>,
    failed: Arc<super::FirstFailure>,
}

impl<T> FaultyTransaction<T> {
    fn record(&self, key: &[u8]) {
        crate::util::lock(&self.written).push(key.to_vec());
    }
}

impl<T: TitoTransaction> TitoTransaction for FaultyTransaction<T> {
    fn start_version(&self) -> u64 {
        self.inner.start_version()
    }

    async fn get(&self, key: &[u8]) -> TitoResult<Option<Vec<u8>>> {
        self.faults.apply(FaultPoint::Get, [key]).await?;
        self.inner.get(key).await
    }

    async fn batch_get(&self, keys: &[Vec<u8>]) -> TitoResult<Vec<Option<Vec<u8>>>> {
        self.faults
            .apply(FaultPoint::Get, keys.iter().map(Vec::as_slice))
            .await?;
        self.inner.batch_get(keys).await
    }

    async fn scan(&self, start: &[u8], end: &[u8], limit: usize) -> TitoResult<Vec<KvPair>> {
        self.faults.apply(FaultPoint::Scan, [start]).await?;
        self.inner.scan(start, end, limit).await
    }

    async fn scan_reverse(
        &self,
        start: &[u8],
        end: &[u8],
        limit: usize,
    ) -> TitoResult<Vec<KvPair>> {
        self.faults.apply(FaultPoint::Scan, [start]).await?;
        self.inner.scan_reverse(start, end, limit).await
    }

    async fn put(&self, key: Vec<u8>, value: Vec<u8>) -> TitoResult<()> {
        self.faults.apply(FaultPoint::Put, [key.as_slice()]).await?;
        self.record(&key);
        self.inner.put(key, value).await
    }

    async fn delete(&self, key: Vec<u8>) -> TitoResult<()> {
        self.faults
            .apply(FaultPoint::Delete, [key.as_slice()])
            .await?;
        self.record(&key);
        self.inner.delete(key).await
    }

    async fn lock_keys(&self, keys: &[Vec<u8>]) -> TitoResult<()> {
        self.faults
            .apply(FaultPoint::LockKeys, keys.iter().map(Vec::as_slice))
            .await?;
        self.inner.lock_keys(keys).await
    }

    fn fail(&self, cause: &TitoError) {
        self.failed.record(cause);
        self.inner.fail(cause);
    }

    async fn commit(&self) -> TitoResult<()> {
        // A failed transaction is refused before any fault is drawn.
        if let Some(refusal) = self.failed.refusal() {
            self.inner.rollback().await?;
            return Err(refusal);
        }
        let written = crate::util::lock(&self.written).clone();
        let fault = self
            .faults
            .check(FaultPoint::Commit, written.iter().map(Vec::as_slice));
        match fault {
            None => self.inner.commit().await,
            Some(Fault::Delay(delay)) => {
                tokio::time::sleep(delay).await;
                self.inner.commit().await
            }
            Some(Fault::Conflict) => {
                self.inner.rollback().await?;
                Err(TitoError::conflict("injected conflict at commit"))
            }
            Some(Fault::UnknownOutcomeCommitted) => {
                self.inner.commit().await?;
                Err(TitoError::commit_outcome_unknown(
                    "injected: the commit applied but its reply was lost",
                ))
            }
            Some(Fault::UnknownOutcomeNotCommitted) => {
                self.inner.rollback().await?;
                Err(TitoError::commit_outcome_unknown(
                    "injected: the commit request was lost",
                ))
            }
            Some(Fault::Storage) => {
                self.inner.rollback().await?;
                Err(injected_storage_error(FaultPoint::Commit))
            }
        }
    }

    fn after_commit(&self, hook: super::AfterCommitHook) {
        // The inner transaction's commit runs it: an injected failure after an applied commit
        // still wakes (the publication is there), one before it does not.
        self.inner.after_commit(hook);
    }

    async fn rollback(&self) -> TitoResult<()> {
        self.inner.rollback().await
    }
}
