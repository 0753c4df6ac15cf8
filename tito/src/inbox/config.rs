//! A subscription's settings, a handler's outcomes and what it is delivered.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::engine::TitoEngine;
use crate::error::{TitoError, TitoResult};

use super::MIN_INBOX_LEASE;

/// What happened to a delivered row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InboxOutcome {
    /// Done: `processed_at` is set (without that role, the row is deleted).
    Ack,
    /// Deleted.
    Drop,
    /// Ready again now.
    Retry,
    /// Ready again after this long. Needs a `retry_after` role: on a model without one, a
    /// nonzero delay is refused ([`Inbox::complete`](super::Inbox::complete) returns [`TitoError::InvalidArgument`](crate::TitoError::InvalidArgument),
    /// `run_inbox` logs it at error level and the row is claimable again when its lease ends).
    /// A delay beyond what Unix milliseconds in an `i64` can hold saturates to "never".
    RetryAfter(Duration),
}

/// Writes a dead-lettered row into another model, inside the claim's transaction.
pub type DeadLetterWriter<E, M> = Arc<
    dyn Fn(M, <E as TitoEngine>::Transaction) -> BoxFuture<'static, TitoResult<()>> + Send + Sync,
>;

/// Where rows go when their attempts run out.
#[derive(Clone)]
pub enum DeadLetter<E: TitoEngine, M> {
    /// Into another group of the same model.
    Group(String),
    /// Into another model: the callback writes it inside the transaction; the row is deleted.
    Model(DeadLetterWriter<E, M>),
}

/// Where "now" comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InboxClock {
    /// The host's clock.
    #[default]
    Host,
    /// The engine's clock (the time in its versions; TSO physical time on TiKV).
    Engine,
}

/// How a subscription runs. Build with [`InboxConfig::new`] and the setters.
#[non_exhaustive]
pub struct InboxConfig<E: TitoEngine, M> {
    /// The group served (ignored when the model has no group role).
    pub group: String,
    /// Handlers in flight at once.
    pub concurrency: usize,
    /// How long a claim holds a row; extended every third of it while the handler runs.
    pub lease: Duration,
    /// Claims at which a row is dead-lettered instead of delivered (with an attempt role).
    pub max_attempts: u64,
    /// Where dead letters go; `None` leaves rows at the limit in place (reported).
    pub dead_letter: Option<DeadLetter<E, M>>,
    /// Where "now" comes from.
    pub clock: InboxClock,
    /// The longest pause between claims when nothing is ready.
    pub max_idle: Duration,
    /// How a failed delivery (the handler's `Err`, a panic) is retried: its backoff, and
    /// whether a panic dead-letters the row at once. Set with [`InboxConfig::failure_policy`],
    /// which also sets `max_attempts`; `None` backs off from 1 s, doubling up to the lease.
    pub failure_policy: Option<crate::queue::FailurePolicy>,
}

impl<E: TitoEngine, M> InboxConfig<E, M> {
    /// A subscription to `group`: 8 handlers, 30 s leases, 5 attempts, no dead letter, host clock.
    pub fn new(group: impl Into<String>) -> Self {
        InboxConfig {
            group: group.into(),
            concurrency: 8,
            lease: Duration::from_secs(30),
            max_attempts: 5,
            dead_letter: None,
            clock: InboxClock::Host,
            max_idle: Duration::from_secs(1),
            failure_policy: None,
        }
    }

    /// Retries failed deliveries as `policy` says: the row is released to a retry time after
    /// the policy's backoff (needs a `retry_after` role), dead-lettered after the policy's
    /// attempts (sets `max_attempts`), and at the first panic when panics are fatal.
    pub fn failure_policy(mut self, policy: crate::queue::FailurePolicy) -> Self {
        self.max_attempts = u64::from(policy.max_attempts());
        self.failure_policy = Some(policy);
        self
    }

    /// The policy failed deliveries follow: the one given, or the default (this config's
    /// attempts, backing off from 1 s up to the lease).
    pub(super) fn failures(&self) -> crate::queue::FailurePolicy {
        self.failure_policy.clone().unwrap_or_else(|| {
            let attempts = u32::try_from(self.max_attempts).unwrap_or(u32::MAX);
            crate::queue::FailurePolicy::new(attempts.clamp(1, crate::queue::MAX_ATTEMPTS))
                .backoff(Duration::from_secs(1).min(self.lease), self.lease)
        })
    }

    /// Handlers in flight at once.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// The lease length.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Claims before dead-lettering.
    pub fn max_attempts(mut self, attempts: u64) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// Where dead letters go.
    pub fn dead_letter(mut self, dead_letter: DeadLetter<E, M>) -> Self {
        self.dead_letter = Some(dead_letter);
        self
    }

    /// Where "now" comes from.
    pub fn clock(mut self, clock: InboxClock) -> Self {
        self.clock = clock;
        self
    }

    /// The longest idle pause.
    pub fn max_idle(mut self, pause: Duration) -> Self {
        self.max_idle = pause;
        self
    }

    /// Checks the settings: a lease of at least [`MIN_INBOX_LEASE`] (it is extended every third
    /// of it), at least one handler and one attempt, a nonzero idle pause, and no duration over
    /// [`MAX_SETTING`](crate::queue::MAX_SETTING). `claim`, `extend`
    /// and `run_inbox` refuse a configuration that fails it with
    /// [`TitoError::InvalidArgument`](crate::TitoError::InvalidArgument) naming the setting, before anything is written.
    pub fn check(&self) -> TitoResult<()> {
        let bad = |what: String| Err(TitoError::invalid_argument(what));
        let longest = crate::queue::MAX_SETTING;
        if self.lease < MIN_INBOX_LEASE || self.lease > longest {
            return bad(format!(
                "InboxConfig::lease is {:?}; it must be between {MIN_INBOX_LEASE:?} and {longest:?}",
                self.lease
            ));
        }
        if self.max_idle > longest {
            return bad(format!(
                "InboxConfig::max_idle is {:?}, over {longest:?}",
                self.max_idle
            ));
        }
        if self.concurrency == 0 {
            return bad("InboxConfig::concurrency is zero".into());
        }
        if self.max_attempts == 0 {
            return bad("InboxConfig::max_attempts is zero".into());
        }
        if self.max_idle.is_zero() {
            return bad("InboxConfig::max_idle is zero".into());
        }
        if let Some(policy) = &self.failure_policy {
            policy.check()?;
        }
        Ok(())
    }
}

/// One delivered row.
#[derive(Clone, Debug, PartialEq)]
pub struct InboxDelivery<P> {
    /// The row's id.
    pub id: String,
    /// The payload (or the whole row, without a payload role).
    pub payload: P,
    /// The headers (empty without that role).
    pub headers: BTreeMap<String, String>,
    /// Which claim this is (1 for the first), when the model counts attempts.
    pub attempt: u64,
    /// The row's partition key, when it has one.
    pub partition_key: Option<String>,
}
