//! The failure policy of a worker: attempts, backoff, what a panic counts as.

use std::time::Duration;

use super::MAX_SETTING;
use crate::error::{TitoError, TitoResult};

pub use crate::event::MAX_ATTEMPTS;

/// What a failed attempt of an invocation leads to, for a worker given one
/// ([`WorkerConfig::failure_policy`](super::WorkerConfig::failure_policy)). Without a policy the
/// seed's rule holds: a failure leaves the invocation pending, unchanged, and it runs again.
///
/// With one, a failure (the handler's `Err`, a panic, a timeout; a lost lease or a row erased
/// meanwhile is not the invocation's failure) commits an outcome of its own, under the lease
/// like every outcome:
/// - before the last attempt, the invocation is replaced by the same event (id, key, owner,
///   payload) due after a backoff, with its failure count and last error kept beside the row;
///   the next delivery's [`QueueEvent::attempt`](crate::QueueEvent::attempt) is one higher;
/// - at the last attempt (or at a panic, when panics are fatal), it moves to the queue's dead
///   state: kept until an operator retries it (back to pending, attempt 1) or discards it
///   ([`Queue::dead`](crate::Queue::dead), `tito queue dead`, the dashboard).
///
/// The backoff before attempt `n + 1` is drawn uniformly from the upper half of
/// `min(max_backoff, initial_backoff * 2^(n-1))`. Due times are whole seconds, so the next
/// attempt is due at the first whole second at or after the backoff ends.
///
/// ```
/// use std::time::Duration;
/// use tito::queue::FailurePolicy;
///
/// let policy = FailurePolicy::new(5)
///     .backoff(Duration::from_secs(2), Duration::from_secs(600))
///     .panics_are_fatal();
/// assert_eq!(policy.max_attempts(), 5);
/// assert!(policy.check().is_ok());
/// assert!(FailurePolicy::new(0).check().is_err());
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailurePolicy {
    max_attempts: u32,
    initial_backoff: Duration,
    max_backoff: Duration,
    panics_are_fatal: bool,
    jitter_seed: Option<u64>,
}

impl FailurePolicy {
    /// At most `max_attempts` attempts (1 to [`MAX_ATTEMPTS`]), backing off from 1 s up to
    /// 1 h; a panic counts as one failed attempt.
    pub fn new(max_attempts: u32) -> Self {
        FailurePolicy {
            max_attempts,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(3600),
            panics_are_fatal: false,
            jitter_seed: None,
        }
    }

    /// The same policy with `max_attempts` attempts.
    pub fn attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts;
        self
    }

    /// The backoff after the first failure, and the largest backoff.
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.initial_backoff = initial;
        self.max_backoff = max;
        self
    }

    /// A panic moves the invocation to the dead state at once, whatever attempt it was.
    pub fn panics_are_fatal(mut self) -> Self {
        self.panics_are_fatal = true;
        self
    }

    /// Draws the jitter from a fixed sequence of `seed` (for runs under simulated time).
    pub fn jitter_seed(mut self, seed: u64) -> Self {
        self.jitter_seed = Some(seed);
        self
    }

    /// The most attempts.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// Whether a panic is fatal.
    pub fn panics_fatal(&self) -> bool {
        self.panics_are_fatal
    }

    /// Checks the settings: 1 to [`MAX_ATTEMPTS`] attempts; backoffs over zero, the initial one
    /// at most the largest, the largest at most [`MAX_SETTING`].
    pub fn check(&self) -> TitoResult<()> {
        if self.max_attempts == 0 || self.max_attempts > MAX_ATTEMPTS {
            return Err(TitoError::invalid_argument(format!(
                "FailurePolicy::max_attempts is {}; it must be from 1 to {MAX_ATTEMPTS}",
                self.max_attempts
            )));
        }
        if self.initial_backoff.is_zero()
            || self.initial_backoff > self.max_backoff
            || self.max_backoff > MAX_SETTING
        {
            return Err(TitoError::invalid_argument(format!(
                "FailurePolicy::backoff is {:?} up to {:?}; the first must be over zero and at \
                 most the largest, the largest at most {MAX_SETTING:?}",
                self.initial_backoff, self.max_backoff
            )));
        }
        Ok(())
    }

    /// What failed attempt number `attempt` (from 1) leads to.
    pub(crate) fn after_failure(&self, attempt: u32, panicked: bool) -> AfterFailure {
        if attempt >= self.max_attempts || (panicked && self.panics_are_fatal) {
            return AfterFailure::Dead;
        }
        AfterFailure::Retry(self.backoff_after(attempt))
    }

    fn backoff_after(&self, attempt: u32) -> Duration {
        crate::engine::random::jittered_backoff(
            self.initial_backoff,
            self.max_backoff,
            attempt,
            self.jitter_seed,
        )
    }
}

/// What one failure leads to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AfterFailure {
    Retry(Duration),
    Dead,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_within_its_jitter_up_to_the_cap() {
        let policy = FailurePolicy::new(10)
            .backoff(Duration::from_secs(1), Duration::from_secs(8))
            .jitter_seed(7);
        for attempt in 1..10 {
            let ceiling = Duration::from_secs(1 << (attempt - 1).min(3));
            match policy.after_failure(attempt, false) {
                AfterFailure::Retry(backoff) => {
                    assert!(
                        backoff >= ceiling / 2 && backoff <= ceiling,
                        "{attempt}: {backoff:?}"
                    )
                }
                AfterFailure::Dead => panic!("attempt {attempt} of 10 is not the last"),
            }
        }
        assert_eq!(policy.after_failure(10, false), AfterFailure::Dead);
        assert_eq!(policy.after_failure(11, false), AfterFailure::Dead);
        assert!(matches!(
            policy.after_failure(1, true),
            AfterFailure::Retry(_)
        ));
        let fatal = policy.clone().panics_are_fatal();
        assert_eq!(fatal.after_failure(1, true), AfterFailure::Dead);
        assert_eq!(
            FailurePolicy::new(1).after_failure(1, false),
            AfterFailure::Dead
        );
    }

    #[test]
    fn settings_are_checked() {
        assert!(FailurePolicy::new(1).check().is_ok());
        assert!(FailurePolicy::new(MAX_ATTEMPTS).check().is_ok());
        for bad in [
            FailurePolicy::new(0),
            FailurePolicy::new(MAX_ATTEMPTS + 1),
            FailurePolicy::new(3).backoff(Duration::ZERO, Duration::from_secs(1)),
            FailurePolicy::new(3).backoff(Duration::from_secs(2), Duration::from_secs(1)),
            FailurePolicy::new(3).backoff(Duration::from_secs(1), MAX_SETTING * 2),
        ] {
            let err = bad.check().unwrap_err();
            assert!(matches!(err, TitoError::InvalidArgument(_)), "{err:?}");
        }
    }
}
