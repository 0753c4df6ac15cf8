//! A versioned key/value store that commits in the same transaction as everything else: an
//! idempotency marker, the effect it guards and the queue acknowledgement can commit together,
//! which a store standing beside the database cannot give.
//!
//! - **Identity** is `(namespace, key)`, both strings compared in byte order (so a prefix listing
//!   and its keyset cursor mean the same on every machine). Namespaces are 1 to
//!   [`MAX_KV_NAMESPACE_BYTES`] bytes, keys 1 to [`MAX_KV_KEY_BYTES`].
//! - **Values** are JSON, at most [`MAX_KV_VALUE_BYTES`] serialized; bigger ones are refused
//!   before anything is written.
//! - **Versions** are tokens, comparable for equality only: the version of the transaction that
//!   wrote the value. The engine's versions never repeat, so a key that expired, was pruned and
//!   was written again can never receive a token it had before. Absent and expired keys have
//!   version 0, which is why `expected: Some(0)` means "must not exist".
//! - **Expiry**: one predicate decides existence, [`is_live`]: no expiry, or an expiry after the
//!   operation's single "now" (the engine's time at the start of the transaction). An expired key
//!   is invisible from the first read after its instant, whether or not the sweeper has removed
//!   it; [`Kv::sweep`] only frees space.
//!
//! Storage layout (see `docs/storage-layout.md`): `kv:{namespace}:{key}` holds `{"v": value, "ver":
//! version, "exp": expiry_ms}`; `kv-exp:{expiry_ms:020}:{namespace}:{key}` indexes keys with an
//! expiry for the sweeper.
//!
//! ```
//! use tito::backend::embedded::Embedded;
//! use tito::kv::Kv;
//!
//! # #[tokio::main(flavor = "multi_thread")]
//! # async fn main() -> Result<(), tito::TitoError> {
//! let db = Embedded::temporary().await?;
//! let kv = Kv::new(db);
//! let version = kv.put("sessions", "ada", &"token-1", Some(0), None).await?; // must not exist
//! assert_eq!(kv.get("sessions", "ada").await?.unwrap().version, version);
//! assert_eq!(kv.incr("counters", "visits", 2, None).await?, 2);
//! # Ok(())
//! # }
//! ```

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::engine::{self, TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::keys;

/// The longest namespace, in bytes.
pub const MAX_KV_NAMESPACE_BYTES: usize = 256;
/// The longest key, in bytes.
pub const MAX_KV_KEY_BYTES: usize = 1024;
/// The largest serialized value, in bytes.
pub const MAX_KV_VALUE_BYTES: usize = 256 * 1024;
/// The largest page of a listing.
pub const MAX_KV_PAGE: usize = 1000;
/// How many expired keys one sweep step deletes at most by default.
pub const SWEEP_BATCH: usize = 256;

/// Whether an entry with this expiry (Unix milliseconds) exists at `now_ms`: the one definition
/// of existence every read, precondition and write uses.
pub fn is_live(expires_ms: Option<u64>, now_ms: u64) -> bool {
    expires_ms.is_none_or(|exp| exp > now_ms)
}

/// A live entry.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct KvEntry {
    /// The key.
    pub key: String,
    /// The value.
    pub value: Value,
    /// The version token (compare for equality only).
    pub version: u64,
    /// When it expires, in Unix milliseconds.
    pub expires_ms: Option<u64>,
}

impl KvEntry {
    /// The value as `T`.
    pub fn decode<T: serde::de::DeserializeOwned>(&self) -> TitoResult<T> {
        serde_json::from_value(self.value.clone()).map_err(TitoError::from)
    }
}

/// One page of a prefix listing.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct KvPage {
    /// Live entries in byte order of their keys.
    pub entries: Vec<KvEntry>,
    /// The key to continue after (a keyset cursor); `None` when the listing is complete.
    pub cursor: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct Stored {
    v: Value,
    ver: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    exp: Option<u64>,
}

fn check_names(namespace: &str, key: &str) -> TitoResult<()> {
    if namespace.is_empty() || namespace.len() > MAX_KV_NAMESPACE_BYTES {
        return Err(TitoError::invalid_argument(format!(
            "a kv namespace must be 1 to {MAX_KV_NAMESPACE_BYTES} bytes, not {}",
            namespace.len()
        )));
    }
    if key.is_empty() || key.len() > MAX_KV_KEY_BYTES {
        return Err(TitoError::invalid_argument(format!(
            "a kv key must be 1 to {MAX_KV_KEY_BYTES} bytes, not {}",
            key.len()
        )));
    }
    Ok(())
}

fn encode_value<V: Serialize + ?Sized>(value: &V) -> TitoResult<Value> {
    let value = serde_json::to_value(value)?;
    let size = serde_json::to_vec(&value)?.len();
    if size > MAX_KV_VALUE_BYTES {
        return Err(TitoError::invalid_argument(format!(
            "a kv value of {size} bytes is over MAX_KV_VALUE_BYTES ({MAX_KV_VALUE_BYTES})"
        )));
    }
    Ok(value)
}

fn ttl_ms(ttl: Option<Duration>) -> TitoResult<Option<u64>> {
    match ttl {
        None => Ok(None),
        // Expiry has millisecond resolution: a TTL under one millisecond would store a value
        // that is already dead and still return a version for it.
        Some(ttl) if ttl < Duration::from_millis(1) => Err(TitoError::invalid_argument(format!(
            "a kv ttl must be at least one millisecond, not {ttl:?}"
        ))),
        Some(ttl) => Ok(Some(crate::util::millis(ttl))),
    }
}

/// "Now" for one call: the engine's time at the start of its transaction.
fn now_ms<X: TitoTransaction>(tx: &X) -> u64 {
    engine::version_millis(tx.start_version())
}

fn parse(key: &[u8], bytes: &[u8]) -> TitoResult<Stored> {
    serde_json::from_slice(bytes).map_err(|err| {
        TitoError::Integrity(format!(
            "kv row {} is malformed: {err}",
            keys::display_key(key)
        ))
    })
}

/// The row stored at `key`, live or not.
async fn load<X: TitoTransaction>(
    tx: &X,
    namespace: &str,
    key: &str,
) -> TitoResult<Option<Stored>> {
    let storage_key = keys::kv_key(namespace, key);
    match tx.get(storage_key.as_bytes()).await? {
        None => Ok(None),
        Some(bytes) => parse(storage_key.as_bytes(), &bytes).map(Some),
    }
}

/// A stored row as an entry, if it is live at `now`.
fn live(key: &str, stored: Option<Stored>, now: u64) -> Option<KvEntry> {
    stored
        .filter(|s| is_live(s.exp, now))
        .map(|stored| KvEntry {
            key: key.to_string(),
            value: stored.v,
            version: stored.ver,
            expires_ms: stored.exp,
        })
}

/// The live entry at `key`, read in `tx` at `now`.
async fn read<X: TitoTransaction>(
    tx: &X,
    namespace: &str,
    key: &str,
    now: u64,
) -> TitoResult<Option<KvEntry>> {
    Ok(live(key, load(tx, namespace, key).await?, now))
}

/// Writes `value` at `key` in `tx`, replacing `previous` (the row read before, whose expiry
/// index entry goes); returns the version.
async fn write<X: TitoTransaction>(
    tx: &X,
    namespace: &str,
    key: &str,
    value: Value,
    expires: Option<u64>,
    previous: Option<&Stored>,
) -> TitoResult<u64> {
    let version = tx.start_version();
    let stored = Stored {
        v: value,
        ver: version,
        exp: expires,
    };
    // Checked as a whole before the first write is buffered (a value over the limit leaves the
    // old expiry entry in place, not half of a write).
    let mut writes = engine::Writes::default();
    drop_expiry_index(&mut writes, namespace, key, previous);
    writes.put(keys::kv_key(namespace, key), serde_json::to_vec(&stored)?);
    if let Some(exp) = expires {
        writes.put(keys::kv_expiry_key(exp, namespace, key), Vec::new());
    }
    writes.apply(tx).await?;
    Ok(version)
}

/// Plans the removal of the expiry index entry of `previous`, the row stored at `key`, if it
/// has one.
fn drop_expiry_index(
    writes: &mut engine::Writes,
    namespace: &str,
    key: &str,
    previous: Option<&Stored>,
) {
    if let Some(exp) = previous.and_then(|p| p.exp) {
        writes.delete(keys::kv_expiry_key(exp, namespace, key));
    }
}

/// The key/value store on an engine. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Kv<E> {
    db: E,
}

/// Adds one to `tito_kv_operations_total{operation}`.
fn counted(operation: &'static str) {
    metrics::counter!(crate::telemetry::names::KV_OPERATIONS, "operation" => operation)
        .increment(1);
}

impl<E: TitoEngine> Kv<E> {
    /// The store on `db`.
    pub fn new(db: E) -> Self {
        Kv { db }
    }

    /// The live entry at `(namespace, key)`, in a transaction of its own.
    pub async fn get(&self, namespace: &str, key: &str) -> TitoResult<Option<KvEntry>> {
        check_names(namespace, key)?;
        let (namespace, key) = (namespace.to_string(), key.to_string());
        crate::engine::read_only(&self.db, async |tx| {
            self.get_in_tx(&namespace, &key, tx).await
        })
        .await
    }

    /// The live entry at `(namespace, key)`, inside `tx`.
    pub async fn get_in_tx(
        &self,
        namespace: &str,
        key: &str,
        tx: &E::Transaction,
    ) -> TitoResult<Option<KvEntry>> {
        check_names(namespace, key)?;
        read(tx, namespace, key, now_ms(tx))
            .await
            .inspect(|_| counted("get"))
    }

    /// Many keys of one namespace, with one "now" for all of them; aligned with `keys`.
    pub async fn get_many(
        &self,
        namespace: &str,
        keys: &[String],
    ) -> TitoResult<Vec<Option<KvEntry>>> {
        let namespace = namespace.to_string();
        crate::engine::read_only(&self.db, async |tx| {
            self.get_many_in_tx(&namespace, keys, tx).await
        })
        .await
    }

    /// Many keys inside `tx`, read in one round trip with one "now".
    pub async fn get_many_in_tx(
        &self,
        namespace: &str,
        keys: &[String],
        tx: &E::Transaction,
    ) -> TitoResult<Vec<Option<KvEntry>>> {
        for key in keys {
            check_names(namespace, key)?;
        }
        let now = now_ms(tx);
        let storage: Vec<Vec<u8>> = keys
            .iter()
            .map(|key| keys::kv_key(namespace, key).into_bytes())
            .collect();
        let values = tx.batch_get(&storage).await?;
        counted("get");
        keys.iter()
            .zip(storage.iter().zip(values))
            .map(|(key, (storage_key, value))| match value {
                None => Ok(None),
                Some(bytes) => Ok(live(key, Some(parse(storage_key, &bytes)?), now)),
            })
            .collect()
    }

    /// Writes a value (in a transaction of its own, replayed on conflicts). With
    /// `expected: Some(v)` the current version must be `v` (0: the key must not exist), else
    /// [`TitoError::VersionMismatch`]. `ttl` sets an expiry. Returns the new version.
    pub async fn put<V: Serialize + ?Sized>(
        &self,
        namespace: &str,
        key: &str,
        value: &V,
        expected: Option<u64>,
        ttl: Option<Duration>,
    ) -> TitoResult<u64> {
        check_names(namespace, key)?;
        let value = encode_value(value)?;
        let (this, namespace, key) = (self.clone(), namespace.to_string(), key.to_string());
        self.db
            .transaction(|tx| async move {
                this.put_value_tx(&namespace, &key, value, expected, ttl, &tx)
                    .await
            })
            .await
            .inspect(|_| counted("put"))
    }

    /// [`Self::put`] inside `tx`.
    pub async fn put_in_tx<V: Serialize + ?Sized>(
        &self,
        namespace: &str,
        key: &str,
        value: &V,
        expected: Option<u64>,
        ttl: Option<Duration>,
        tx: &E::Transaction,
    ) -> TitoResult<u64> {
        check_names(namespace, key)?;
        let value = encode_value(value)?;
        self.put_value_tx(namespace, key, value, expected, ttl, tx)
            .await
            .inspect(|_| counted("put"))
    }

    async fn put_value_tx(
        &self,
        namespace: &str,
        key: &str,
        value: Value,
        expected: Option<u64>,
        ttl: Option<Duration>,
        tx: &E::Transaction,
    ) -> TitoResult<u64> {
        let ttl = ttl_ms(ttl)?;
        let now = now_ms(tx);
        let previous = load(tx, namespace, key).await?;
        if let Some(expected) = expected {
            let actual = previous
                .as_ref()
                .filter(|p| is_live(p.exp, now))
                .map_or(0, |p| p.ver);
            if actual != expected {
                return Err(TitoError::VersionMismatch {
                    key: format!("{namespace}/{key}"),
                    expected,
                    actual,
                });
            }
        }
        write(
            tx,
            namespace,
            key,
            value,
            ttl.map(|t| now.saturating_add(t)),
            previous.as_ref(),
        )
        .await
    }

    /// Writes the value only if the key does not exist (or has expired): `Some(version)` when
    /// written, `None` when a live value was there.
    pub async fn put_if_absent<V: Serialize + ?Sized>(
        &self,
        namespace: &str,
        key: &str,
        value: &V,
        ttl: Option<Duration>,
    ) -> TitoResult<Option<u64>> {
        check_names(namespace, key)?;
        let value = encode_value(value)?;
        let (this, namespace, key) = (self.clone(), namespace.to_string(), key.to_string());
        self.db
            .transaction(|tx| async move {
                this.put_if_absent_value_tx(&namespace, &key, value, ttl, &tx)
                    .await
            })
            .await
            .inspect(|_| counted("put_if_absent"))
    }

    /// [`Self::put_if_absent`] inside `tx`.
    pub async fn put_if_absent_in_tx<V: Serialize + ?Sized>(
        &self,
        namespace: &str,
        key: &str,
        value: &V,
        ttl: Option<Duration>,
        tx: &E::Transaction,
    ) -> TitoResult<Option<u64>> {
        check_names(namespace, key)?;
        let value = encode_value(value)?;
        self.put_if_absent_value_tx(namespace, key, value, ttl, tx)
            .await
            .inspect(|_| counted("put_if_absent"))
    }

    async fn put_if_absent_value_tx(
        &self,
        namespace: &str,
        key: &str,
        value: Value,
        ttl: Option<Duration>,
        tx: &E::Transaction,
    ) -> TitoResult<Option<u64>> {
        match self
            .put_value_tx(namespace, key, value, Some(0), ttl, tx)
            .await
        {
            Ok(version) => Ok(Some(version)),
            Err(TitoError::VersionMismatch { .. }) => Ok(None),
            Err(err) => Err(err),
        }
    }

    /// Adds `by` to an integer value (an absent or expired key counts as 0) and returns the
    /// result; a value that is not an integer is [`TitoError::InvalidArgument`]. `ttl`, when
    /// given, sets a new expiry; otherwise a live key keeps its own.
    pub async fn incr(
        &self,
        namespace: &str,
        key: &str,
        by: i64,
        ttl: Option<Duration>,
    ) -> TitoResult<i64> {
        check_names(namespace, key)?;
        let (this, namespace, key) = (self.clone(), namespace.to_string(), key.to_string());
        self.db
            .transaction(|tx| async move { this.incr_in(&namespace, &key, by, ttl, &tx).await })
            .await
            .inspect(|_| counted("incr"))
    }

    /// [`Self::incr`] inside `tx`.
    pub async fn incr_in_tx(
        &self,
        namespace: &str,
        key: &str,
        by: i64,
        ttl: Option<Duration>,
        tx: &E::Transaction,
    ) -> TitoResult<i64> {
        let next = self.incr_in(namespace, key, by, ttl, tx).await?;
        counted("incr");
        Ok(next)
    }

    async fn incr_in(
        &self,
        namespace: &str,
        key: &str,
        by: i64,
        ttl: Option<Duration>,
        tx: &E::Transaction,
    ) -> TitoResult<i64> {
        check_names(namespace, key)?;
        let ttl = ttl_ms(ttl)?;
        let now = now_ms(tx);
        let previous = load(tx, namespace, key).await?;
        let (base, kept_expiry) = match previous.as_ref().filter(|p| is_live(p.exp, now)) {
            None => (0, None),
            Some(entry) => {
                let value = entry.v.as_i64().ok_or_else(|| {
                    TitoError::invalid_argument(format!(
                        "kv {namespace}/{key} holds {}, not an integer",
                        entry.v
                    ))
                })?;
                (value, entry.exp)
            }
        };
        let next = base.checked_add(by).ok_or_else(|| {
            TitoError::invalid_argument(format!(
                "kv {namespace}/{key}: {base} + {by} overflows i64"
            ))
        })?;
        let expires = ttl.map(|t| now.saturating_add(t)).or(kept_expiry);
        write(
            tx,
            namespace,
            key,
            Value::from(next),
            expires,
            previous.as_ref(),
        )
        .await?;
        Ok(next)
    }

    /// Deletes a key; with `expected: Some(v)` only if its version is `v`
    /// ([`TitoError::VersionMismatch`] otherwise). Returns whether a live value was deleted.
    pub async fn delete(
        &self,
        namespace: &str,
        key: &str,
        expected: Option<u64>,
    ) -> TitoResult<bool> {
        check_names(namespace, key)?;
        let (this, namespace, key) = (self.clone(), namespace.to_string(), key.to_string());
        self.db
            .transaction(|tx| async move { this.delete_in(&namespace, &key, expected, &tx).await })
            .await
            .inspect(|_| counted("delete"))
    }

    /// [`Self::delete`] inside `tx`.
    pub async fn delete_in_tx(
        &self,
        namespace: &str,
        key: &str,
        expected: Option<u64>,
        tx: &E::Transaction,
    ) -> TitoResult<bool> {
        let deleted = self.delete_in(namespace, key, expected, tx).await?;
        counted("delete");
        Ok(deleted)
    }

    async fn delete_in(
        &self,
        namespace: &str,
        key: &str,
        expected: Option<u64>,
        tx: &E::Transaction,
    ) -> TitoResult<bool> {
        check_names(namespace, key)?;
        let previous = load(tx, namespace, key).await?;
        let now = now_ms(tx);
        let actual = previous
            .as_ref()
            .filter(|p| is_live(p.exp, now))
            .map_or(0, |p| p.ver);
        if let Some(expected) = expected
            && expected != actual
        {
            return Err(TitoError::VersionMismatch {
                key: format!("{namespace}/{key}"),
                expected,
                actual,
            });
        }
        let mut writes = engine::Writes::default();
        drop_expiry_index(&mut writes, namespace, key, previous.as_ref());
        writes.delete(keys::kv_key(namespace, key));
        writes.apply(tx).await?;
        // Versions are never 0, so a live row had a nonzero one.
        Ok(actual != 0)
    }

    /// Live entries of a namespace whose keys start with `prefix`, in byte order, at most `limit`
    /// (1..=[`MAX_KV_PAGE`]), continuing after `cursor` (the last key of the previous page).
    pub async fn list(
        &self,
        namespace: &str,
        prefix: &str,
        limit: usize,
        cursor: Option<&str>,
    ) -> TitoResult<KvPage> {
        let namespace = namespace.to_string();
        crate::engine::read_only(&self.db, async |tx| {
            self.list_in_tx(&namespace, prefix, limit, cursor, tx).await
        })
        .await
    }

    /// [`Self::list`] inside `tx`.
    pub async fn list_in_tx(
        &self,
        namespace: &str,
        prefix: &str,
        limit: usize,
        cursor: Option<&str>,
        tx: &E::Transaction,
    ) -> TitoResult<KvPage> {
        check_names(namespace, "x")?;
        counted("list");
        if limit == 0 || limit > MAX_KV_PAGE {
            return Err(TitoError::invalid_argument(format!(
                "a kv page holds 1 to {MAX_KV_PAGE} entries, not {limit}"
            )));
        }
        let range_start = keys::kv_key(namespace, prefix);
        let end = if prefix.is_empty() {
            keys::prefix_end(keys::kv_namespace_prefix(namespace))
        } else {
            keys::prefix_end(range_start.clone())
        };
        let start = match cursor {
            Some(after) => {
                if !after.starts_with(prefix) {
                    return Err(TitoError::invalid_argument(
                        "the cursor is outside the listed prefix",
                    ));
                }
                keys::key_after(keys::kv_key(namespace, after))
            }
            None if prefix.is_empty() => keys::kv_namespace_prefix(namespace),
            None => range_start,
        };
        let now = now_ms(tx);
        let mut entries = Vec::with_capacity(limit);
        let mut next = start.into_bytes();
        // The last key scanned, live or not: where a page that stops early continues.
        let mut scanned: Option<String> = None;
        // Expired rows are skipped; at most eight scans per page, then a cursor to continue.
        for _ in 0..8 {
            let rows = tx.scan(&next, end.as_bytes(), limit + 1).await?;
            let exhausted = rows.len() <= limit;
            for (storage_key, bytes) in rows {
                next = keys::key_after_bytes(&storage_key);
                let stored = parse(&storage_key, &bytes)?;
                let text = keys::key_str(&storage_key)?;
                let key = keys::kv_key_name(namespace, text)?;
                if !is_live(stored.exp, now) {
                    scanned = Some(key);
                    continue;
                }
                if entries.len() == limit {
                    let cursor = entries.last().map(|e: &KvEntry| e.key.clone());
                    return Ok(KvPage { entries, cursor });
                }
                scanned = Some(key.clone());
                entries.push(KvEntry {
                    key,
                    value: stored.v,
                    version: stored.ver,
                    expires_ms: stored.exp,
                });
            }
            if exhausted {
                return Ok(KvPage {
                    entries,
                    cursor: None,
                });
            }
        }
        // Stopped early (many expired rows in a row): continue after the last key scanned, even
        // when this page holds no entry at all.
        Ok(KvPage {
            entries,
            cursor: scanned,
        })
    }

    /// Deletes up to `batch` expired keys (a disk-space job: expired keys are already
    /// invisible). Returns how many; a full batch means more may be waiting.
    pub async fn sweep(&self, batch: usize) -> TitoResult<usize> {
        sweep_expired(&self.db, batch).await
    }

    /// Sweeps on its own until `shutdown` resolves: a full batch continues at once, a short one
    /// waits `interval`. Each pass also expires old commit markers
    /// ([`sweep_commit_markers`](crate::engine::sweep_commit_markers)). (A queue worker can do
    /// the same: [`WorkerConfig::sweep_kv`].)
    ///
    /// [`WorkerConfig::sweep_kv`]: crate::queue::WorkerConfig::sweep_kv
    pub async fn run_sweeper(&self, interval: Duration, shutdown: impl crate::runtime::Shutdown) {
        let mut shutdown = shutdown.wait();
        loop {
            let mut full = match self.sweep(SWEEP_BATCH).await {
                Ok(deleted) => deleted == SWEEP_BATCH,
                Err(err) => {
                    tracing::warn!(error = %err, "kv sweep failed");
                    false
                }
            };
            let batch = engine::COMMIT_MARKER_SWEEP_BATCH;
            match engine::sweep_commit_markers(&self.db, batch).await {
                Ok(deleted) => full |= deleted == batch,
                Err(err) => tracing::warn!(error = %err, "commit marker sweep failed"),
            }
            let pause = if full { Duration::ZERO } else { interval };
            tokio::select! {
                biased;
                _ = &mut shutdown => return,
                _ = tokio::time::sleep(pause) => {}
            }
        }
    }
}

/// Deletes up to `batch` expired kv rows through the expiry index.
pub(crate) async fn sweep_expired<E: TitoEngine>(db: &E, batch: usize) -> TitoResult<usize> {
    let batch = batch.clamp(1, engine::MAX_SCAN_LIMIT);
    db.transaction(|tx| async move {
        let now = now_ms(&tx);
        let start = keys::kv_expiry_prefix();
        let end = keys::kv_expiry_before(now.saturating_add(1));
        let rows = tx.scan(start.as_bytes(), end.as_bytes(), batch).await?;
        for (index_key, _) in &rows {
            tx.delete(index_key.clone()).await?;
            let Ok(text) = keys::key_str(index_key) else {
                continue;
            };
            let Ok((exp, namespace, key)) = keys::parse_kv_expiry_key(text) else {
                continue;
            };
            let storage_key = keys::kv_key(&namespace, &key);
            if let Some(bytes) = tx.get(storage_key.as_bytes()).await?
                && let Ok(stored) = serde_json::from_slice::<Stored>(&bytes)
                && stored.exp == Some(exp)
                && !is_live(stored.exp, now)
            {
                tx.delete(storage_key.into_bytes()).await?;
            }
        }
        Ok::<_, TitoError>(rows.len())
    })
    .await
    .inspect(|_| counted("sweep"))
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Defect 10: kv rows decode or are refused, never panic.
        #[test]
        fn kv_rows_decode_or_are_refused(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..96)) {
            let _ = parse(b"kv:ns:k", &bytes);
        }
    }
}
