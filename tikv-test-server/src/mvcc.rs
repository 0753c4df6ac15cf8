//! Percolator over an in-memory multi-version store: per key a lock record and the list of
//! write records (commit, delete, lock, rollback) newest first, each carrying its value.
//!
//! The commands follow TiKV's (`src/storage/txn/commands` in TiKV) closely enough that the
//! client sees the same answers: the same key errors in the same fields, the same atomicity (a
//! prewrite or commit that fails on one key writes nothing), the same status transitions.

// Key errors are protocol messages returned to the client as they are.
#![allow(clippy::result_large_err)]

use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;

use crate::proto::kvrpcpb::{
    self, Action, AlreadyExist, CommitTsExpired, KeyError, LockInfo, Op, TxnNotFound,
    WriteConflict, write_conflict,
};

/// The number of logical bits in a TSO timestamp.
pub const LOGICAL_BITS: u32 = 18;

fn physical(ts: u64) -> u64 {
    ts >> LOGICAL_BITS
}

#[derive(Clone, Debug, PartialEq)]
enum LockKind {
    Put(Vec<u8>),
    Delete,
    Lock,
}

impl LockKind {
    fn op(&self) -> Op {
        match self {
            LockKind::Put(_) => Op::Put,
            LockKind::Delete => Op::Del,
            LockKind::Lock => Op::Lock,
        }
    }
}

#[derive(Clone, Debug)]
struct Lock {
    primary: Vec<u8>,
    start_ts: u64,
    ttl: u64,
    kind: LockKind,
    txn_size: u64,
    min_commit_ts: u64,
    use_async_commit: bool,
    secondaries: Vec<Vec<u8>>,
}

#[derive(Clone, Debug, PartialEq)]
enum WriteKind {
    Put(Vec<u8>),
    Delete,
    Lock,
    Rollback,
}

#[derive(Clone, Debug)]
struct Write {
    commit_ts: u64,
    start_ts: u64,
    kind: WriteKind,
}

#[derive(Default, Debug)]
struct KeyState {
    lock: Option<Lock>,
    /// Newest `commit_ts` first.
    writes: Vec<Write>,
}

impl KeyState {
    fn is_empty(&self) -> bool {
        self.lock.is_none() && self.writes.is_empty()
    }

    fn add_write(&mut self, write: Write) {
        let at = self
            .writes
            .iter()
            .position(|w| w.commit_ts < write.commit_ts)
            .unwrap_or(self.writes.len());
        self.writes.insert(at, write);
    }

    /// The committed (not rolled back) write of the transaction started at `start_ts`.
    fn committed(&self, start_ts: u64) -> Option<&Write> {
        self.writes
            .iter()
            .find(|w| w.start_ts == start_ts && w.kind != WriteKind::Rollback)
    }

    fn rolled_back(&self, start_ts: u64) -> bool {
        self.writes
            .iter()
            .any(|w| w.start_ts == start_ts && w.kind == WriteKind::Rollback)
    }

    /// The value visible at `ts`, ignoring locks.
    fn value_at(&self, ts: u64) -> Option<&Vec<u8>> {
        for write in self.writes.iter().filter(|w| w.commit_ts <= ts) {
            match &write.kind {
                WriteKind::Put(value) => return Some(value),
                WriteKind::Delete => return None,
                WriteKind::Lock | WriteKind::Rollback => continue,
            }
        }
        None
    }
}

/// What `check_txn_status` found, in the shape of `CheckTxnStatusResponse`.
#[derive(Debug, PartialEq)]
pub(crate) struct TxnStatus {
    pub lock_ttl: u64,
    pub commit_version: u64,
    pub action: Action,
    pub lock_info: Option<LockInfo>,
}

/// The multi-version store.
#[derive(Default, Debug)]
pub(crate) struct Mvcc {
    keys: BTreeMap<Vec<u8>, KeyState>,
}

fn range_bounds(start: &[u8], end: &[u8]) -> (Bound<Vec<u8>>, Bound<Vec<u8>>) {
    let upper = if end.is_empty() {
        Bound::Unbounded
    } else {
        Bound::Excluded(end.to_vec())
    };
    (Bound::Included(start.to_vec()), upper)
}

fn lock_info(key: &[u8], lock: &Lock) -> LockInfo {
    LockInfo {
        primary_lock: lock.primary.clone(),
        lock_version: lock.start_ts,
        key: key.to_vec(),
        lock_ttl: lock.ttl,
        txn_size: lock.txn_size,
        lock_type: lock.kind.op() as i32,
        use_async_commit: lock.use_async_commit,
        min_commit_ts: lock.min_commit_ts,
        secondaries: lock.secondaries.clone(),
        ..Default::default()
    }
}

fn locked(key: &[u8], lock: &Lock) -> KeyError {
    KeyError {
        locked: Some(lock_info(key, lock)),
        ..Default::default()
    }
}

fn txn_not_found(start_ts: u64, primary: &[u8]) -> KeyError {
    KeyError {
        txn_not_found: Some(TxnNotFound {
            start_ts,
            primary_key: primary.to_vec(),
        }),
        ..Default::default()
    }
}

/// TiKV reports a commit whose lock is gone (rolled back by another transaction) as a retryable
/// `TxnLockNotFound`.
fn lock_not_found(start_ts: u64, commit_ts: u64, key: &[u8]) -> KeyError {
    KeyError {
        retryable: format!(
            "TxnLockNotFound {{ start_ts: {start_ts}, commit_ts: {commit_ts}, key: {key:?} }}"
        ),
        ..Default::default()
    }
}

/// A prewrite's mutation.
pub(crate) struct Mutation<'a> {
    pub op: Op,
    pub key: &'a [u8],
    pub value: &'a [u8],
}

/// A prewrite's transaction-wide fields.
pub(crate) struct Prewrite<'a> {
    pub primary: &'a [u8],
    pub start_ts: u64,
    pub ttl: u64,
    pub txn_size: u64,
    pub min_commit_ts: u64,
    pub use_async_commit: bool,
    pub secondaries: &'a [Vec<u8>],
}

impl Mvcc {
    /// Reads `key` at `ts`: a lock of another transaction started at or before `ts` is an error
    /// (unless the caller already resolved it), as in TiKV's snapshot isolation reads.
    pub fn get(&self, key: &[u8], ts: u64, resolved: &[u64]) -> Result<Option<Vec<u8>>, KeyError> {
        match self.keys.get(key) {
            None => Ok(None),
            Some(state) => Self::read(key, state, ts, resolved),
        }
    }

    fn read(
        key: &[u8],
        state: &KeyState,
        ts: u64,
        resolved: &[u64],
    ) -> Result<Option<Vec<u8>>, KeyError> {
        if let Some(lock) = &state.lock
            && lock.start_ts <= ts
            && lock.kind != LockKind::Lock
            && !resolved.contains(&lock.start_ts)
        {
            return Err(locked(key, lock));
        }
        Ok(state.value_at(ts).cloned())
    }

    /// Reads many keys; found values and locked keys become pairs, absent keys are left out.
    pub fn batch_get(&self, keys: &[Vec<u8>], ts: u64, resolved: &[u64]) -> Vec<kvrpcpb::KvPair> {
        let mut pairs = Vec::new();
        for key in keys {
            match self.get(key, ts, resolved) {
                Ok(Some(value)) => pairs.push(kvrpcpb::KvPair {
                    key: key.clone(),
                    value,
                    ..Default::default()
                }),
                Ok(None) => {}
                Err(error) => pairs.push(kvrpcpb::KvPair {
                    key: key.clone(),
                    error: Some(error),
                    ..Default::default()
                }),
            }
        }
        pairs
    }

    /// Scans `[start, end)` (an empty `end` is unbounded) at `ts`, forward or backward, up to
    /// `limit` pairs; a locked key yields a pair carrying the lock error.
    #[allow(clippy::too_many_arguments)]
    pub fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        limit: usize,
        ts: u64,
        key_only: bool,
        reverse: bool,
        resolved: &[u64],
    ) -> Vec<kvrpcpb::KvPair> {
        let range = self.keys.range(range_bounds(start, end));
        let iter: Box<dyn Iterator<Item = (&Vec<u8>, &KeyState)>> = if reverse {
            Box::new(range.rev())
        } else {
            Box::new(range)
        };
        let mut pairs = Vec::new();
        for (key, state) in iter {
            if pairs.len() >= limit {
                break;
            }
            match Self::read(key, state, ts, resolved) {
                Ok(Some(value)) => pairs.push(kvrpcpb::KvPair {
                    key: key.clone(),
                    value: if key_only { Vec::new() } else { value },
                    ..Default::default()
                }),
                Ok(None) => {}
                Err(error) => pairs.push(kvrpcpb::KvPair {
                    key: key.clone(),
                    error: Some(error),
                    ..Default::default()
                }),
            }
        }
        pairs
    }

    /// The first phase of two-phase commit. All or nothing: when any key fails, no lock is
    /// written and every failure is reported.
    pub fn prewrite(&mut self, mutations: &[Mutation<'_>], txn: &Prewrite<'_>) -> Vec<KeyError> {
        let mut errors = Vec::new();
        let mut to_lock = Vec::new();
        for mutation in mutations {
            let state = self.keys.get(mutation.key);
            if let Some(state) = state {
                if let Some(lock) = &state.lock {
                    if lock.start_ts != txn.start_ts {
                        errors.push(locked(mutation.key, lock));
                    }
                    // Our own lock: a retried prewrite, already done.
                    continue;
                }
                if state.committed(txn.start_ts).is_some() {
                    // Already committed: a late retry of the prewrite.
                    continue;
                }
                if state.rolled_back(txn.start_ts) {
                    errors.push(conflict(
                        txn,
                        mutation.key,
                        txn.start_ts,
                        txn.start_ts,
                        write_conflict::Reason::SelfRolledBack,
                    ));
                    continue;
                }
                if let Some(newer) = state
                    .writes
                    .iter()
                    .find(|w| w.commit_ts > txn.start_ts && w.kind != WriteKind::Rollback)
                {
                    errors.push(conflict(
                        txn,
                        mutation.key,
                        newer.start_ts,
                        newer.commit_ts,
                        write_conflict::Reason::Optimistic,
                    ));
                    continue;
                }
            }
            let exists = state.is_some_and(|s| s.value_at(u64::MAX).is_some());
            let kind = match mutation.op {
                Op::Put => LockKind::Put(mutation.value.to_vec()),
                Op::Del => LockKind::Delete,
                Op::Lock => LockKind::Lock,
                Op::Insert | Op::CheckNotExists if exists => {
                    errors.push(KeyError {
                        already_exist: Some(AlreadyExist {
                            key: mutation.key.to_vec(),
                        }),
                        ..Default::default()
                    });
                    continue;
                }
                Op::Insert => LockKind::Put(mutation.value.to_vec()),
                Op::CheckNotExists => continue,
                other => {
                    errors.push(KeyError {
                        abort: format!("the test server does not support mutation {other:?}"),
                        ..Default::default()
                    });
                    continue;
                }
            };
            to_lock.push((mutation.key.to_vec(), kind));
        }
        if !errors.is_empty() {
            return errors;
        }
        for (key, kind) in to_lock {
            let secondaries = if key == txn.primary && txn.use_async_commit {
                txn.secondaries.to_vec()
            } else {
                Vec::new()
            };
            self.keys.entry(key).or_default().lock = Some(Lock {
                primary: txn.primary.to_vec(),
                start_ts: txn.start_ts,
                ttl: txn.ttl,
                kind,
                txn_size: txn.txn_size,
                min_commit_ts: txn.min_commit_ts,
                use_async_commit: txn.use_async_commit,
                secondaries,
            });
        }
        Vec::new()
    }

    /// The second phase: turns this transaction's locks on `keys` into writes at `commit_ts`.
    /// All or nothing; a key already committed by this transaction is fine (a retry).
    pub fn commit(
        &mut self,
        keys: &[Vec<u8>],
        start_ts: u64,
        commit_ts: u64,
    ) -> Result<(), KeyError> {
        for key in keys {
            let state = self.keys.get(key);
            match state.and_then(|s| s.lock.as_ref()) {
                Some(lock) if lock.start_ts == start_ts => {
                    if commit_ts < lock.min_commit_ts {
                        return Err(KeyError {
                            commit_ts_expired: Some(CommitTsExpired {
                                start_ts,
                                attempted_commit_ts: commit_ts,
                                key: key.clone(),
                                min_commit_ts: lock.min_commit_ts,
                            }),
                            ..Default::default()
                        });
                    }
                }
                _ => {
                    if state.and_then(|s| s.committed(start_ts)).is_none() {
                        return Err(lock_not_found(start_ts, commit_ts, key));
                    }
                }
            }
        }
        for key in keys {
            self.commit_key(key, start_ts, commit_ts);
        }
        Ok(())
    }

    fn commit_key(&mut self, key: &[u8], start_ts: u64, commit_ts: u64) {
        let Some(state) = self.keys.get_mut(key) else {
            return;
        };
        let Some(lock) = state.lock.take_if(|lock| lock.start_ts == start_ts) else {
            return;
        };
        let kind = match lock.kind {
            LockKind::Put(value) => WriteKind::Put(value),
            LockKind::Delete => WriteKind::Delete,
            LockKind::Lock => WriteKind::Lock,
        };
        state.add_write(Write {
            commit_ts,
            start_ts,
            kind,
        });
    }

    /// Rolls back this transaction on one key: removes its lock and leaves a rollback record so
    /// that a late prewrite cannot succeed. A key the transaction already committed is an error.
    fn rollback_key(&mut self, key: &[u8], start_ts: u64) -> Result<(), KeyError> {
        let state = self.keys.entry(key.to_vec()).or_default();
        if state.committed(start_ts).is_some() {
            return Err(KeyError {
                abort: format!("Committed {{ start_ts: {start_ts}, key: {key:?} }}"),
                ..Default::default()
            });
        }
        state.lock.take_if(|lock| lock.start_ts == start_ts);
        if !state.rolled_back(start_ts) {
            state.add_write(Write {
                commit_ts: start_ts,
                start_ts,
                kind: WriteKind::Rollback,
            });
        }
        Ok(())
    }

    /// Rolls back this transaction on every key, or on none if one of them was committed.
    pub fn batch_rollback(&mut self, keys: &[Vec<u8>], start_ts: u64) -> Result<(), KeyError> {
        if let Some(key) = keys.iter().find(|key| {
            self.keys
                .get(*key)
                .is_some_and(|s| s.committed(start_ts).is_some())
        }) {
            return Err(KeyError {
                abort: format!("Committed {{ start_ts: {start_ts}, key: {key:?} }}"),
                ..Default::default()
            });
        }
        for key in keys {
            self.rollback_key(key, start_ts)?;
        }
        Ok(())
    }

    /// The status of the transaction whose primary key is `primary`, rolling it back when its
    /// lock expired at `current_ts` or (when asked) when it left no trace.
    pub fn check_txn_status(
        &mut self,
        primary: &[u8],
        lock_ts: u64,
        current_ts: u64,
        rollback_if_not_exist: bool,
    ) -> Result<TxnStatus, KeyError> {
        let state = self.keys.get(primary);
        if let Some(lock) = state.and_then(|s| s.lock.as_ref())
            && lock.start_ts == lock_ts
        {
            if physical(current_ts) >= physical(lock_ts).saturating_add(lock.ttl) {
                self.rollback_key(primary, lock_ts)?;
                return Ok(TxnStatus {
                    lock_ttl: 0,
                    commit_version: 0,
                    action: Action::TtlExpireRollback,
                    lock_info: None,
                });
            }
            return Ok(TxnStatus {
                lock_ttl: lock.ttl,
                commit_version: 0,
                action: Action::NoAction,
                lock_info: Some(lock_info(primary, lock)),
            });
        }
        if let Some(write) = state.and_then(|s| s.committed(lock_ts)) {
            return Ok(TxnStatus {
                lock_ttl: 0,
                commit_version: write.commit_ts,
                action: Action::NoAction,
                lock_info: None,
            });
        }
        if state.is_some_and(|s| s.rolled_back(lock_ts)) {
            return Ok(TxnStatus {
                lock_ttl: 0,
                commit_version: 0,
                action: Action::NoAction,
                lock_info: None,
            });
        }
        if rollback_if_not_exist {
            self.rollback_key(primary, lock_ts)?;
            return Ok(TxnStatus {
                lock_ttl: 0,
                commit_version: 0,
                action: Action::LockNotExistRollback,
                lock_info: None,
            });
        }
        Err(txn_not_found(lock_ts, primary))
    }

    /// `KvCleanup`: rolls back this transaction's lock on `key` if it expired at `current_ts`
    /// (or unconditionally when `current_ts` is 0). Returns the commit version when the key was
    /// already committed.
    pub fn cleanup(&mut self, key: &[u8], start_ts: u64, current_ts: u64) -> Result<u64, KeyError> {
        let state = self.keys.get(key);
        if let Some(lock) = state.and_then(|s| s.lock.as_ref())
            && lock.start_ts == start_ts
            && current_ts != 0
            && physical(current_ts) < physical(start_ts).saturating_add(lock.ttl)
        {
            return Err(locked(key, lock));
        }
        if let Some(write) = state.and_then(|s| s.committed(start_ts)) {
            return Ok(write.commit_ts);
        }
        self.rollback_key(key, start_ts)?;
        Ok(0)
    }

    /// `KvCheckSecondaryLocks`: the locks this transaction still holds on `keys`, or its commit
    /// version; a key with neither is rolled back, which decides the whole transaction.
    pub fn check_secondary_locks(
        &mut self,
        keys: &[Vec<u8>],
        start_ts: u64,
    ) -> (Vec<LockInfo>, u64) {
        let mut locks = Vec::new();
        let mut commit_ts = 0;
        for key in keys {
            let state = self.keys.get(key);
            if let Some(lock) = state.and_then(|s| s.lock.as_ref())
                && lock.start_ts == start_ts
            {
                locks.push(lock_info(key, lock));
                continue;
            }
            if let Some(write) = state.and_then(|s| s.committed(start_ts)) {
                commit_ts = write.commit_ts;
                continue;
            }
            // Neither locked nor committed: the transaction cannot commit any more.
            let _ = self.rollback_key(key, start_ts);
            return (Vec::new(), 0);
        }
        (locks, commit_ts)
    }

    /// Commits (`commit_ts > 0`) or rolls back (`0`) the locks of the given transactions in
    /// `[start, end)`, or only on `keys` when some are given.
    pub fn resolve_locks(
        &mut self,
        start: &[u8],
        end: &[u8],
        txns: &HashMap<u64, u64>,
        keys: &[Vec<u8>],
    ) {
        let targets: Vec<(Vec<u8>, u64)> = if keys.is_empty() {
            self.keys
                .range(range_bounds(start, end))
                .filter_map(|(key, state)| {
                    let lock = state.lock.as_ref()?;
                    txns.contains_key(&lock.start_ts)
                        .then(|| (key.clone(), lock.start_ts))
                })
                .collect()
        } else {
            keys.iter()
                .filter_map(|key| {
                    let lock = self.keys.get(key)?.lock.as_ref()?;
                    txns.contains_key(&lock.start_ts)
                        .then(|| (key.clone(), lock.start_ts))
                })
                .collect()
        };
        for (key, start_ts) in targets {
            match txns[&start_ts] {
                0 => {
                    let _ = self.rollback_key(&key, start_ts);
                }
                commit_ts => self.commit_key(&key, start_ts, commit_ts),
            }
        }
    }

    /// Locks in `[start, end)` taken at or before `max_version`, up to `limit` (0: no limit).
    pub fn scan_locks(
        &self,
        start: &[u8],
        end: &[u8],
        max_version: u64,
        limit: usize,
    ) -> Vec<LockInfo> {
        let limit = if limit == 0 { usize::MAX } else { limit };
        self.keys
            .range(range_bounds(start, end))
            .filter_map(|(key, state)| {
                let lock = state.lock.as_ref()?;
                (lock.start_ts <= max_version).then(|| lock_info(key, lock))
            })
            .take(limit)
            .collect()
    }

    /// Extends the TTL of the primary lock; returns the TTL now in force.
    pub fn heart_beat(
        &mut self,
        primary: &[u8],
        start_ts: u64,
        advise_ttl: u64,
    ) -> Result<u64, KeyError> {
        match self
            .keys
            .get_mut(primary)
            .and_then(|s| s.lock.as_mut())
            .filter(|lock| lock.start_ts == start_ts)
        {
            Some(lock) => {
                lock.ttl = lock.ttl.max(advise_ttl);
                Ok(lock.ttl)
            }
            None => Err(txn_not_found(start_ts, primary)),
        }
    }

    /// Removes every version and lock in `[start, end)` (empty `end`: unbounded).
    pub fn destroy_range(&mut self, start: &[u8], end: &[u8]) -> usize {
        let doomed: Vec<Vec<u8>> = self
            .keys
            .range(range_bounds(start, end))
            .map(|(key, _)| key.clone())
            .collect();
        for key in &doomed {
            self.keys.remove(key);
        }
        doomed.len()
    }

    /// MVCC garbage collection at `safe_point`: keeps, per key, every write newer than the safe
    /// point and the newest value at or below it (none when that is a delete). Returns the
    /// number of write records removed.
    pub fn gc(&mut self, safe_point: u64) -> usize {
        let mut removed = 0;
        self.keys.retain(|_, state| {
            let before = state.writes.len();
            let mut kept_base = false;
            state.writes.retain(|write| {
                if write.commit_ts > safe_point {
                    return true;
                }
                if kept_base {
                    return false;
                }
                match write.kind {
                    WriteKind::Put(_) => {
                        kept_base = true;
                        true
                    }
                    WriteKind::Delete => {
                        kept_base = true;
                        false
                    }
                    WriteKind::Lock | WriteKind::Rollback => false,
                }
            });
            removed += before - state.writes.len();
            !state.is_empty()
        });
        removed
    }

    /// Every key with a lock or a write record, in order, for tests.
    pub fn keys(&self) -> Vec<Vec<u8>> {
        self.keys.keys().cloned().collect()
    }

    /// The number of locks held, for tests.
    pub fn lock_count(&self) -> usize {
        self.keys.values().filter(|s| s.lock.is_some()).count()
    }

    /// The number of write records (versions, deletes, locks, rollbacks) stored, for tests.
    pub fn version_count(&self) -> usize {
        self.keys.values().map(|s| s.writes.len()).sum()
    }
}

fn conflict(
    txn: &Prewrite<'_>,
    key: &[u8],
    conflict_start_ts: u64,
    conflict_commit_ts: u64,
    reason: write_conflict::Reason,
) -> KeyError {
    KeyError {
        conflict: Some(WriteConflict {
            start_ts: txn.start_ts,
            conflict_ts: conflict_start_ts,
            key: key.to_vec(),
            primary: txn.primary.to_vec(),
            conflict_commit_ts,
            reason: reason as i32,
        }),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(ms: u64) -> u64 {
        ms << LOGICAL_BITS
    }

    fn prewrite(
        mvcc: &mut Mvcc,
        keys: &[(&[u8], Option<&[u8]>)],
        primary: &[u8],
        start: u64,
    ) -> Vec<KeyError> {
        let mutations: Vec<Mutation<'_>> = keys
            .iter()
            .map(|(key, value)| Mutation {
                op: if value.is_some() { Op::Put } else { Op::Del },
                key,
                value: value.unwrap_or_default(),
            })
            .collect();
        mvcc.prewrite(
            &mutations,
            &Prewrite {
                primary,
                start_ts: start,
                ttl: 3000,
                txn_size: keys.len() as u64,
                min_commit_ts: 0,
                use_async_commit: false,
                secondaries: &[],
            },
        )
    }

    #[test]
    fn snapshot_reads_see_only_what_committed_before_them() {
        let mut mvcc = Mvcc::default();
        assert!(prewrite(&mut mvcc, &[(b"a", Some(b"1"))], b"a", ts(10)).is_empty());
        mvcc.commit(&[b"a".to_vec()], ts(10), ts(11)).unwrap();
        assert!(prewrite(&mut mvcc, &[(b"a", Some(b"2"))], b"a", ts(20)).is_empty());
        // A reader older than the lock ignores it; a newer reader is blocked by it.
        assert_eq!(mvcc.get(b"a", ts(15), &[]).unwrap(), Some(b"1".to_vec()));
        assert!(mvcc.get(b"a", ts(25), &[]).unwrap_err().locked.is_some());
        assert_eq!(
            mvcc.get(b"a", ts(25), &[ts(20)]).unwrap(),
            Some(b"1".to_vec())
        );
        mvcc.commit(&[b"a".to_vec()], ts(20), ts(21)).unwrap();
        assert_eq!(mvcc.get(b"a", ts(15), &[]).unwrap(), Some(b"1".to_vec()));
        assert_eq!(mvcc.get(b"a", ts(25), &[]).unwrap(), Some(b"2".to_vec()));
    }

    #[test]
    fn a_conflicting_prewrite_writes_nothing() {
        let mut mvcc = Mvcc::default();
        assert!(prewrite(&mut mvcc, &[(b"b", Some(b"x"))], b"b", ts(10)).is_empty());
        mvcc.commit(&[b"b".to_vec()], ts(10), ts(12)).unwrap();
        // Started before the commit at 12: a write conflict on b, so no lock on a either.
        let errors = prewrite(
            &mut mvcc,
            &[(b"a", Some(b"1")), (b"b", Some(b"2"))],
            b"a",
            ts(11),
        );
        assert_eq!(errors.len(), 1);
        let conflict = errors[0].conflict.as_ref().unwrap();
        assert_eq!(
            (conflict.conflict_ts, conflict.conflict_commit_ts),
            (ts(10), ts(12))
        );
        assert_eq!(mvcc.lock_count(), 0);
    }

    #[test]
    fn commit_after_rollback_is_refused_and_rollback_after_commit_too() {
        let mut mvcc = Mvcc::default();
        assert!(prewrite(&mut mvcc, &[(b"a", Some(b"1"))], b"a", ts(10)).is_empty());
        mvcc.batch_rollback(&[b"a".to_vec()], ts(10)).unwrap();
        assert!(
            !mvcc
                .commit(&[b"a".to_vec()], ts(10), ts(11))
                .unwrap_err()
                .retryable
                .is_empty()
        );
        // The rollback record stops a late prewrite of the same transaction.
        let late = prewrite(&mut mvcc, &[(b"a", Some(b"1"))], b"a", ts(10));
        assert!(late[0].conflict.is_some());

        assert!(prewrite(&mut mvcc, &[(b"c", Some(b"1"))], b"c", ts(20)).is_empty());
        mvcc.commit(&[b"c".to_vec()], ts(20), ts(21)).unwrap();
        mvcc.commit(&[b"c".to_vec()], ts(20), ts(21)).unwrap();
        assert!(
            !mvcc
                .batch_rollback(&[b"c".to_vec()], ts(20))
                .unwrap_err()
                .abort
                .is_empty()
        );
    }

    #[test]
    fn txn_status_follows_the_primary() {
        let mut mvcc = Mvcc::default();
        assert!(
            prewrite(
                &mut mvcc,
                &[(b"p", Some(b"1")), (b"s", Some(b"2"))],
                b"p",
                ts(100)
            )
            .is_empty()
        );
        let alive = mvcc
            .check_txn_status(b"p", ts(100), ts(200), false)
            .unwrap();
        assert_eq!(alive.lock_ttl, 3000);
        assert!(alive.lock_info.is_some());
        // Past the TTL, the primary is rolled back and the secondary's lock resolves to it.
        let expired = mvcc
            .check_txn_status(b"p", ts(100), ts(3100), false)
            .unwrap();
        assert_eq!(expired.action, Action::TtlExpireRollback);
        mvcc.resolve_locks(b"", b"", &HashMap::from([(ts(100), 0)]), &[]);
        assert_eq!(mvcc.lock_count(), 0);
        assert_eq!(mvcc.get(b"s", ts(4000), &[]).unwrap(), None);
        // Unknown transaction.
        assert!(
            mvcc.check_txn_status(b"q", ts(5), ts(6), false)
                .unwrap_err()
                .txn_not_found
                .is_some()
        );
        let rolled = mvcc.check_txn_status(b"q", ts(5), ts(6), true).unwrap();
        assert_eq!(rolled.action, Action::LockNotExistRollback);
    }

    #[test]
    fn gc_keeps_the_newest_version_below_the_safe_point() {
        let mut mvcc = Mvcc::default();
        for (start, value) in [
            (10u64, Some(&b"1"[..])),
            (20, Some(b"2")),
            (30, None),
            (40, Some(b"4")),
        ] {
            assert!(prewrite(&mut mvcc, &[(b"k", value)], b"k", ts(start)).is_empty());
            mvcc.commit(&[b"k".to_vec()], ts(start), ts(start + 1))
                .unwrap();
        }
        assert_eq!(mvcc.gc(ts(25)), 1);
        assert_eq!(mvcc.get(b"k", ts(25), &[]).unwrap(), Some(b"2".to_vec()));
        assert_eq!(mvcc.gc(ts(35)), 2);
        assert_eq!(mvcc.get(b"k", ts(50), &[]).unwrap(), Some(b"4".to_vec()));
        assert_eq!(mvcc.version_count(), 1);
    }
}
