//! Resolving unknown commit outcomes: the commit marker a transaction writes, the fence that
//! proves an attempt can no longer commit, and the sweep that expires markers. The argument for
//! why this is safe on each engine is in the [module documentation](super#unknown-outcomes).

use std::time::Duration;

use super::{TitoEngine, TitoTransaction, version_from_millis, version_millis};
use crate::error::{TitoError, TitoResult};
use crate::keys;

/// How long commit markers are kept before a sweep deletes them (one hour).
///
/// A resolution refuses to decide "not committed" about a transaction that started more than
/// half of this ago (it returns [`TitoError::CommitOutcomeUnknown`] instead), so a sweep can
/// never delete a marker that a resolution still needs.
pub const COMMIT_MARKER_RETENTION: Duration = Duration::from_secs(3600);

/// The bound of a resolution when a policy does not name one (30 s): longer than the time TiKV
/// takes to roll back the locks of a transaction that ran under 10 s and whose commit never
/// arrived (a 3 s lock TTL, up to 20 s for transactions of many megabytes), with room for a
/// read's own waits.
pub const DEFAULT_RESOLUTION_BOUND: Duration = Duration::from_secs(30);

/// The longest resolution bound a policy accepts (ten minutes, well inside half of
/// [`COMMIT_MARKER_RETENTION`]).
pub const MAX_RESOLUTION_BOUND: Duration = Duration::from_secs(600);

/// How many expired markers one sweep deletes at most by default.
pub const COMMIT_MARKER_SWEEP_BATCH: usize = 256;

/// The value a transaction writes into its own marker.
pub(crate) const COMMITTED: &[u8] = b"committed";
/// The value a resolution writes into the marker of an attempt it fenced off.
pub(crate) const FENCED: &[u8] = b"fenced";

/// What a resolution found out about one attempt.
#[derive(Debug)]
pub(crate) enum Resolution {
    /// The attempt's marker is committed: so are all of its writes.
    Committed,
    /// The attempt's marker was absent and is now fenced: the attempt can never commit.
    NotCommitted,
    /// Neither could be established within the bound; why.
    Undecided(String),
}

/// The marker key of a transaction that starts at `start_version`. `seed` (a policy's jitter
/// seed) makes the nonce repeatable under simulation; otherwise it is random.
pub(crate) fn marker_key(start_version: u64, seed: Option<u64>) -> Vec<u8> {
    let nonce = match seed {
        Some(seed) => super::random::splitmix(seed ^ start_version.rotate_left(17)),
        None => super::random::random_u64(),
    };
    keys::commit_marker_key(start_version, nonce).into_bytes()
}

/// Determines whether the attempt whose marker is `marker` committed, within `bound`.
///
/// Each round reads the marker in a fresh transaction (on TiKV, a read that meets the
/// attempt's lock resolves it through the primary, waiting while the lock's TTL runs). A
/// marker found decides at once. An absent one is fenced: the round writes `fenced` into it
/// and commits, which the storage contract's write-write conflict detection makes exclusive
/// with the attempt's own write of the same key. A fence that conflicts means the attempt
/// committed meanwhile, and the next round reads it. Errors and unknown fence outcomes are
/// retried with backoff until the bound runs out.
pub(crate) async fn resolve<D: TitoEngine>(db: &D, marker: &[u8], bound: Duration) -> Resolution {
    let deadline = crate::util::deadline_after(bound);
    let mut pause = Duration::from_millis(5);
    let mut last = String::from("no resolution round finished");
    loop {
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        if remaining.is_zero() {
            return Resolution::Undecided(format!("{last} (bound {bound:?})"));
        }
        match tokio::time::timeout(remaining, round(db, marker)).await {
            Err(_) => {
                return Resolution::Undecided(format!(
                    "{last}; the last round was still running when the bound ({bound:?}) ran out"
                ));
            }
            Ok(Ok(Some(decided))) => return decided,
            // The fence conflicted: the attempt (or a sweep) wrote the marker. Read again.
            Ok(Ok(None)) => last = "the fence conflicted".to_string(),
            Ok(Err(TitoError::Integrity(why))) => return Resolution::Undecided(why),
            Ok(Err(err)) => {
                last = err.to_string();
                let wait =
                    pause.min(deadline.saturating_duration_since(tokio::time::Instant::now()));
                tokio::time::sleep(wait).await;
                pause = (pause * 2).min(Duration::from_millis(500));
            }
        }
    }
}

/// One read-then-fence round; `None` when the fence conflicted.
async fn round<D: TitoEngine>(db: &D, marker: &[u8]) -> TitoResult<Option<Resolution>> {
    let tx = db.begin().await?;
    let found = tx.get(marker).await?;
    match found.as_deref() {
        Some(COMMITTED) => {
            let _ = tx.rollback().await;
            Ok(Some(Resolution::Committed))
        }
        Some(FENCED) => {
            // An earlier round's fence committed although its reply was lost.
            let _ = tx.rollback().await;
            Ok(Some(Resolution::NotCommitted))
        }
        Some(other) => Err(TitoError::Integrity(format!(
            "commit marker {} holds {} instead of `committed` or `fenced`",
            keys::display_key(marker),
            keys::display_key(other)
        ))),
        None => {
            if let Some(why) = too_old_to_fence(marker, tx.start_version()) {
                let _ = tx.rollback().await;
                return Ok(Some(Resolution::Undecided(why)));
            }
            tx.put(marker.to_vec(), FENCED.to_vec()).await?;
            match tx.commit().await {
                Ok(()) => Ok(Some(Resolution::NotCommitted)),
                Err(err) if err.is_retryable() => Ok(None),
                Err(err) => Err(err),
            }
        }
    }
}

/// A marker absent because a sweep deleted it must not be fenced: refuses markers of
/// transactions that started more than half of [`COMMIT_MARKER_RETENTION`] before `now`.
fn too_old_to_fence(marker: &[u8], now: u64) -> Option<String> {
    let text = std::str::from_utf8(marker).ok()?;
    let (_, started, _) = keys::parse_commit_marker_key(text).ok()?;
    let age_ms = version_millis(now).saturating_sub(version_millis(started));
    let half = crate::util::millis(COMMIT_MARKER_RETENTION) / 2;
    (age_ms > half).then(|| {
        format!(
            "the transaction started {age_ms} ms ago, longer than half the marker retention: \
             its marker may have been swept"
        )
    })
}

/// Decides the outcome of a transaction from its commit marker: `Ok(true)` when it committed,
/// `Ok(false)` when it did not and never can (its marker is fenced), and
/// [`TitoError::CommitOutcomeUnknown`] when that could not be established within `within`.
///
/// [`TitoEngine::transaction`] calls this itself for policies that
/// [resolve unknown outcomes](super::RetryPolicy::resolve_unknown_outcomes); call it directly
/// with the marker key named in a [`TitoError::CommitOutcomeUnknown`] to decide later, for
/// example after reopening an embedded store that stopped in the middle of a commit. A key
/// that is not a commit marker is [`TitoError::InvalidArgument`].
pub async fn resolve_commit<E: TitoEngine>(
    db: &E,
    marker: &[u8],
    within: Duration,
) -> TitoResult<bool> {
    let text = std::str::from_utf8(marker)
        .map_err(|_| TitoError::invalid_argument("a commit marker key is UTF-8 text"))?;
    keys::parse_commit_marker_key(text)
        .map_err(|err| TitoError::invalid_argument(err.to_string()))?;
    check_bound(within)?;
    match resolve(db, marker, within).await {
        Resolution::Committed => Ok(true),
        Resolution::NotCommitted => Ok(false),
        Resolution::Undecided(why) => Err(TitoError::commit_outcome_unknown(format!(
            "commit marker {text} could not be decided: {why}"
        ))),
    }
}

/// Checks a resolution bound: from one millisecond to [`MAX_RESOLUTION_BOUND`].
pub(crate) fn check_bound(bound: Duration) -> TitoResult<()> {
    if bound < Duration::from_millis(1) || bound > MAX_RESOLUTION_BOUND {
        return Err(TitoError::invalid_argument(format!(
            "the bound for resolving unknown commit outcomes must be between 1 ms and \
             {MAX_RESOLUTION_BOUND:?}, got {bound:?}"
        )));
    }
    Ok(())
}

/// Deletes up to `batch` commit markers older than [`COMMIT_MARKER_RETENTION`], in one
/// transaction; returns how many. A full batch means more may be waiting. Queue workers run it
/// in their maintenance, and [`Kv::run_sweeper`](crate::kv::Kv::run_sweeper) with its own
/// sweep; call it yourself when neither runs. `batch` is clamped to 1..=[`MAX_SCAN_LIMIT`].
///
/// [`MAX_SCAN_LIMIT`]: super::MAX_SCAN_LIMIT
pub async fn sweep_commit_markers<E: TitoEngine>(db: &E, batch: usize) -> TitoResult<usize> {
    let batch = batch.clamp(1, super::MAX_SCAN_LIMIT);
    db.transaction(|tx| async move {
        let retention_ms = crate::util::millis(COMMIT_MARKER_RETENTION);
        let now_ms = version_millis(tx.start_version());
        let Some(cutoff_ms) = now_ms.checked_sub(retention_ms) else {
            return Ok(0);
        };
        let cutoff = version_from_millis(cutoff_ms);
        let mut deleted = 0;
        for bucket in 0..keys::COMMIT_MARKER_BUCKETS {
            if deleted == batch {
                break;
            }
            let start = keys::commit_marker_bucket_prefix(bucket);
            let end = keys::commit_marker_before(bucket, cutoff);
            let rows = tx
                .scan(start.as_bytes(), end.as_bytes(), batch - deleted)
                .await?;
            for (key, _) in rows {
                tx.delete(key).await?;
                deleted += 1;
            }
        }
        Ok::<_, TitoError>(deleted)
    })
    .await
}
