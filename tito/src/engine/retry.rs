//! The transaction runner behind [`TitoEngine::transaction`]: commit, replay after a retryable
//! conflict with jittered exponential backoff, and (when the policy asks) resolve an unknown
//! outcome through the attempt's commit marker.

use std::future::Future;
use std::time::Duration;

use super::outcome::{self, Resolution};
use super::{TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::telemetry::names;
use tracing::Instrument;

/// How [`TitoEngine::transaction`] replays a closure whose commit conflicted.
///
/// The delay before attempt `n + 1` is drawn uniformly from the upper half of
/// `min(max_backoff, initial_backoff * 2^(n-1))`, so contending transactions spread out instead
/// of colliding again in step.
///
/// ```
/// use std::time::Duration;
/// use tito::RetryPolicy;
///
/// let policy = RetryPolicy::default()
///     .max_attempts(20)
///     .initial_backoff(Duration::from_millis(1))
///     .max_backoff(Duration::from_millis(50));
/// assert_eq!(policy.attempts(), 20);
/// ```
///
/// A policy can also resolve unknown commit outcomes instead of returning them
/// ([`RetryPolicy::resolve_unknown_outcomes`]; see the [module documentation](super#unknown-outcomes)).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryPolicy {
    max_attempts: u32,
    initial_backoff: Duration,
    max_backoff: Duration,
    jitter_seed: Option<u64>,
    resolution: Option<Duration>,
}

impl Default for RetryPolicy {
    /// Ten attempts, backing off from 2 ms up to 250 ms.
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 10,
            initial_backoff: Duration::from_millis(2),
            max_backoff: Duration::from_millis(250),
            jitter_seed: None,
            resolution: None,
        }
    }
}

impl RetryPolicy {
    /// A policy that runs the closure once and never replays it.
    pub fn no_retry() -> Self {
        RetryPolicy::default().max_attempts(1)
    }

    /// How many times the closure may run in all (at least one).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The backoff before the second attempt.
    pub fn initial_backoff(mut self, backoff: Duration) -> Self {
        self.initial_backoff = backoff;
        self
    }

    /// The largest backoff between two attempts.
    pub fn max_backoff(mut self, backoff: Duration) -> Self {
        self.max_backoff = backoff;
        self
    }

    /// Draws the jitter from a fixed sequence of `seed` instead of the process's randomness, so
    /// a run under simulated time repeats exactly.
    pub fn jitter_seed(mut self, seed: u64) -> Self {
        self.jitter_seed = Some(seed);
        self
    }

    /// Resolves unknown commit outcomes within [`DEFAULT_RESOLUTION_BOUND`] instead of returning
    /// them: every attempt also writes a small commit marker, and when a commit's outcome is
    /// unknown the runner reads (and if absent, fences) that marker. Committed: the closure's
    /// value is returned as a success. Fenced: the closure is replayed as after a conflict.
    /// Undecided within the bound: [`TitoError::CommitOutcomeUnknown`], naming the marker.
    ///
    /// The marker costs one small write per transaction, read-only ones included. Markers are
    /// deleted after [`COMMIT_MARKER_RETENTION`] by
    /// [`sweep_commit_markers`](super::sweep_commit_markers), which queue workers and the kv
    /// sweeper run.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tito::RetryPolicy;
    ///
    /// let policy = RetryPolicy::default().resolve_unknown_outcomes();
    /// assert_eq!(policy.resolution_bound(), Some(tito::engine::DEFAULT_RESOLUTION_BOUND));
    /// let quick = RetryPolicy::default().resolve_unknown_outcomes_within(Duration::from_secs(5));
    /// assert_eq!(quick.resolution_bound(), Some(Duration::from_secs(5)));
    /// ```
    ///
    /// [`DEFAULT_RESOLUTION_BOUND`]: super::DEFAULT_RESOLUTION_BOUND
    /// [`COMMIT_MARKER_RETENTION`]: super::COMMIT_MARKER_RETENTION
    pub fn resolve_unknown_outcomes(self) -> Self {
        self.resolve_unknown_outcomes_within(super::DEFAULT_RESOLUTION_BOUND)
    }

    /// [`RetryPolicy::resolve_unknown_outcomes`] with its own bound: the longest a resolution
    /// waits (for locks to be resolved, for an unreachable store) before it gives up. A bound
    /// under 1 ms or over [`MAX_RESOLUTION_BOUND`](super::MAX_RESOLUTION_BOUND) makes every
    /// transaction run with this policy fail with [`TitoError::InvalidArgument`] before it
    /// starts.
    pub fn resolve_unknown_outcomes_within(mut self, bound: Duration) -> Self {
        self.resolution = Some(bound);
        self
    }

    /// Returns unknown commit outcomes to the caller again (the default).
    pub fn return_unknown_outcomes(mut self) -> Self {
        self.resolution = None;
        self
    }

    /// The bound of unknown-outcome resolution, or `None` when unknown outcomes are returned.
    pub fn resolution_bound(&self) -> Option<Duration> {
        self.resolution
    }

    /// Checks the settings: a resolution bound from 1 ms to
    /// [`MAX_RESOLUTION_BOUND`](super::MAX_RESOLUTION_BOUND). Stores check the policy they are
    /// opened with, and every transaction the policy it runs under.
    pub fn check(&self) -> TitoResult<()> {
        match self.resolution {
            Some(bound) => outcome::check_bound(bound),
            None => Ok(()),
        }
    }

    /// This policy, resolving unknown outcomes (with its own bound if it has one).
    pub(crate) fn resolving(self) -> Self {
        match self.resolution {
            Some(_) => self,
            None => self.resolve_unknown_outcomes(),
        }
    }

    /// How many times the closure may run in all.
    pub fn attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The delay after failed attempt number `attempt` (1-based).
    pub(crate) fn backoff(&self, attempt: u32) -> Duration {
        super::random::jittered_backoff(
            self.initial_backoff,
            self.max_backoff,
            attempt,
            self.jitter_seed,
        )
    }
}

tokio::task_local! {
    /// While the runner's closure runs: (this attempt's start version, the first attempt's).
    static ATTEMPT: (u64, u64);
}

/// The version a write in `tx` names itself by: the start version of the first attempt when `tx`
/// is a replay of [`TitoEngine::transaction`]'s closure (so every replay of one call answers the
/// same), otherwise `tx`'s own start version. Unique to one call of the runner, since start
/// versions are unique to a transaction and a replay runs only after its earlier attempts are
/// known not to have committed. Model events take their ids from it.
pub fn write_version<X: TitoTransaction>(tx: &X) -> u64 {
    let own = tx.start_version();
    ATTEMPT
        .try_with(|&(current, first)| if current == own { first } else { own })
        .unwrap_or(own)
}

pub(crate) async fn run<D, F, Fut, T, E>(db: &D, policy: RetryPolicy, f: F) -> Result<T, E>
where
    D: TitoEngine,
    F: FnOnce(D::Transaction) -> Fut + Clone + Send,
    Fut: Future<Output = Result<T, E>> + Send,
    T: Send,
    E: From<TitoError> + Send,
{
    policy.check()?;
    let mut attempt: u32 = 0;
    let mut first_version = None;
    loop {
        attempt += 1;
        let span =
            tracing::debug_span!("tito.transaction", attempt, outcome = tracing::field::Empty);
        metrics::counter!(names::TRANSACTIONS_BEGUN).increment(1);
        let step = one_attempt(db, &policy, f.clone(), attempt, &mut first_version, &span)
            .instrument(span.clone())
            .await;
        let err = match step {
            Attempt::Done(result) => return result,
            Attempt::Replay(err) => err,
        };
        if attempt >= policy.attempts() {
            return Err(E::from(TitoError::RetriesExhausted {
                attempts: attempt,
                source: Box::new(err),
            }));
        }
        let delay = policy.backoff(attempt);
        tracing::debug!(attempt, ?delay, error = %err, "transaction did not commit; replaying");
        metrics::counter!(names::TRANSACTIONS_REPLAYED).increment(1);
        tokio::time::sleep(delay).await;
    }
}

/// What one attempt came to: a result to return, or an error after which the closure is
/// replayed (a conflict, or an unknown outcome proven not applied).
enum Attempt<T, E> {
    Done(Result<T, E>),
    Replay(TitoError),
}

fn unknown_outcome(resolution: &'static str) {
    metrics::counter!(names::TRANSACTIONS_UNKNOWN, "resolution" => resolution).increment(1);
}

async fn one_attempt<D, F, Fut, T, E>(
    db: &D,
    policy: &RetryPolicy,
    f: F,
    attempt: u32,
    first_version: &mut Option<u64>,
    span: &tracing::Span,
) -> Attempt<T, E>
where
    D: TitoEngine,
    F: FnOnce(D::Transaction) -> Fut + Send,
    Fut: Future<Output = Result<T, E>> + Send,
    T: Send,
    E: From<TitoError> + Send,
{
    // Records the attempt's outcome on its span (`tito.transaction`).
    let outcome_is = |outcome: &'static str| {
        span.record("outcome", outcome);
    };
    let tx = match db.begin().await {
        Ok(tx) => tx,
        Err(err) => {
            outcome_is("error");
            return Attempt::Done(Err(E::from(err)));
        }
    };
    let first = *first_version.get_or_insert(tx.start_version());
    let value = match ATTEMPT
        .scope((tx.start_version(), first), f(tx.clone()))
        .await
    {
        Ok(value) => value,
        Err(err) => {
            outcome_is("closure_error");
            // The closure's error wins; a rollback failure only matters to the log.
            if let Err(rollback_err) = tx.rollback().await
                && !matches!(rollback_err, TitoError::TransactionFinished(_))
            {
                tracing::warn!(error = %rollback_err, "rollback after a failed transaction closure failed");
            }
            return Attempt::Done(Err(err));
        }
    };
    let marker = match policy.resolution {
        Some(_) => {
            let marker = outcome::marker_key(tx.start_version(), policy.jitter_seed);
            if let Err(err) = tx.put(marker.clone(), outcome::COMMITTED.to_vec()).await {
                outcome_is("error");
                return Attempt::Done(Err(E::from(err)));
            }
            Some(marker)
        }
        None => None,
    };
    let started = std::time::Instant::now();
    let committed = tx.commit().await;
    metrics::histogram!(names::COMMIT_SECONDS).record(started.elapsed().as_secs_f64());
    match committed {
        Ok(()) => {
            outcome_is("committed");
            metrics::counter!(names::TRANSACTIONS_COMMITTED).increment(1);
            Attempt::Done(Ok(value))
        }
        Err(err) if err.is_retryable() => {
            outcome_is("conflict");
            metrics::counter!(names::TRANSACTIONS_CONFLICTED).increment(1);
            Attempt::Replay(err)
        }
        Err(err @ TitoError::CommitOutcomeUnknown { .. }) => {
            outcome_is("unknown");
            let (Some(marker), Some(bound)) = (marker, policy.resolution) else {
                unknown_outcome("unresolved");
                return Attempt::Done(Err(E::from(err)));
            };
            match outcome::resolve(db, &marker, bound).await {
                Resolution::Committed => {
                    unknown_outcome("committed");
                    metrics::counter!(names::TRANSACTIONS_COMMITTED).increment(1);
                    tracing::debug!(attempt, error = %err, "unknown commit outcome resolved: committed");
                    Attempt::Done(Ok(value))
                }
                Resolution::NotCommitted => {
                    unknown_outcome("not_committed");
                    tracing::debug!(attempt, error = %err, "unknown commit outcome resolved: not committed; replaying");
                    Attempt::Replay(err)
                }
                Resolution::Undecided(why) => {
                    unknown_outcome("undecided");
                    let marker = String::from_utf8_lossy(&marker);
                    Attempt::Done(Err(E::from(TitoError::CommitOutcomeUnknown {
                        message: format!(
                            "{err}; resolving it through commit marker {marker} failed: {why} \
                             (tito::engine::resolve_commit can decide it later)"
                        ),
                        source: Some(Box::new(err)),
                    })))
                }
            }
        }
        Err(err) => {
            outcome_is("error");
            Attempt::Done(Err(E::from(err)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_stays_under_the_ceiling() {
        let policy = RetryPolicy::default()
            .initial_backoff(Duration::from_millis(4))
            .max_backoff(Duration::from_millis(20));
        for _ in 0..100 {
            let first = policy.backoff(1);
            assert!(first >= Duration::from_millis(2) && first <= Duration::from_millis(4));
            let late = policy.backoff(10);
            assert!(late >= Duration::from_millis(10) && late <= Duration::from_millis(20));
        }
    }

    #[test]
    fn resolution_is_opt_in_and_keeps_its_bound() {
        assert_eq!(RetryPolicy::default().resolution_bound(), None);
        let policy = RetryPolicy::default().resolve_unknown_outcomes_within(Duration::from_secs(3));
        assert_eq!(
            policy.clone().resolving().resolution_bound(),
            Some(Duration::from_secs(3))
        );
        assert_eq!(
            RetryPolicy::default().resolving().resolution_bound(),
            Some(super::super::DEFAULT_RESOLUTION_BOUND)
        );
        assert_eq!(policy.return_unknown_outcomes().resolution_bound(), None);
    }

    #[test]
    fn at_least_one_attempt() {
        assert_eq!(RetryPolicy::default().max_attempts(0).attempts(), 1);
        assert_eq!(RetryPolicy::no_retry().attempts(), 1);
    }
}
