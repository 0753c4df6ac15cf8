//! A subscription's run loop: claims, handlers in flight, lease extensions, outcomes, and the
//! registration that keeps one subscription per (model, group) per store.

use std::collections::HashSet;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use serde::de::DeserializeOwned;
use tokio::task::JoinSet;

use crate::engine::TitoEngine;
use crate::error::{TitoError, TitoResult};
use crate::runtime::Shutdown;
use crate::telemetry::names;
use tracing::Instrument;

use super::{Inbox, InboxClaim, InboxConfig, InboxDelivery, InboxModel, InboxOutcome};

/// The (model, group) subscriptions of one store in this process, on the store's handle
/// ([`TitoEngine::extensions`]).
#[derive(Default)]
struct Subscriptions(Mutex<HashSet<String>>);

/// The registration of one (model, group) subscription of a store in this process.
struct Subscription(Arc<Subscriptions>, String);

impl Subscription {
    fn take(subscriptions: Arc<Subscriptions>, name: String) -> TitoResult<Subscription> {
        let fresh = crate::util::lock(&subscriptions.0).insert(name.clone());
        if !fresh {
            return Err(TitoError::AlreadySubscribed(name));
        }
        Ok(Subscription(subscriptions, name))
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        crate::util::lock(&self.0.0).remove(&self.1);
    }
}

/// Serves one group of an inbox until `shutdown` resolves: claims ready rows (up to
/// `concurrency` in flight), hands each to `handler` (the payload decoded as `P`, or the whole
/// row), extends leases while it runs and applies its outcome if the lease still holds. An
/// `Err` or a panic counts an attempt and releases the row to be claimed again after the retry
/// backoff (to the dead-letter group, when configured, once the attempts run out); a lost lease
/// applies nothing: the row is claimable again when its lease ends. A second subscription to the same (model, group) in this process fails at once with
/// [`TitoError::AlreadySubscribed`].
///
/// The returned future is `Send + 'static`: spawn it, or await it in place.
pub fn run_inbox<E, M, P, F, Fut, S>(
    inbox: Arc<Inbox<E, M>>,
    config: InboxConfig<E, M>,
    handler: F,
    shutdown: S,
) -> BoxFuture<'static, TitoResult<()>>
where
    E: TitoEngine,
    M: InboxModel,
    P: DeserializeOwned + Send + 'static,
    F: Fn(InboxDelivery<P>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = TitoResult<InboxOutcome>> + Send + 'static,
    S: Shutdown,
{
    if let Err(err) = config.check() {
        return Box::pin(async move { Err(err) });
    }
    Box::pin(inbox_loop(inbox, config, handler, shutdown))
}

impl crate::runtime::Workers {
    /// Starts [`run_inbox`] in this set: one group of `inbox`, `handler` given the payload
    /// decoded as `P`.
    pub fn spawn_inbox<E, M, P, F, Fut>(
        &mut self,
        inbox: Arc<Inbox<E, M>>,
        config: InboxConfig<E, M>,
        handler: F,
    ) -> &mut Self
    where
        E: TitoEngine,
        M: InboxModel,
        P: DeserializeOwned + Send + 'static,
        F: Fn(InboxDelivery<P>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = TitoResult<InboxOutcome>> + Send + 'static,
    {
        self.spawn(|stop| run_inbox(inbox, config, handler, stop))
    }
}

async fn inbox_loop<E, M, P, F, Fut, S>(
    inbox: Arc<Inbox<E, M>>,
    config: InboxConfig<E, M>,
    handler: F,
    shutdown: S,
) -> TitoResult<()>
where
    E: TitoEngine,
    M: InboxModel,
    P: DeserializeOwned + Send + 'static,
    F: Fn(InboxDelivery<P>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = TitoResult<InboxOutcome>> + Send + 'static,
    S: Shutdown,
{
    let group = if inbox.spec.group.is_some() {
        config.group.clone()
    } else {
        String::new()
    };
    let _subscription = Subscription::take(
        inbox.db.extensions().get::<Subscriptions>(),
        format!("{}/{group}", inbox.table),
    )?;
    let config = Arc::new(config);
    let handler = Arc::new(handler);
    let mut shutdown = shutdown.wait();
    let mut running: JoinSet<()> = JoinSet::new();
    let mut idle = Duration::from_millis(5);
    let mut stopping = false;
    // New rows of the table written in this process wake the subscription after their commit
    // (rows written elsewhere are found by the next claim, within `max_idle`).
    let new_rows =
        crate::event::nudge::wakeups(&inbox.db, &crate::event::wake::table_rows(&inbox.table));
    loop {
        // Read before the claim: a row committed between the claim and the wait is not missed.
        let seen = new_rows.generation();
        while running.try_join_next().is_some() {}
        // Shutdown is looked at before every claim (and wins the select below).
        if !stopping && shutdown.as_mut().now_or_never().is_some() {
            stopping = true;
        }
        if stopping {
            if running.is_empty() {
                return Ok(());
            }
            let _ = running.join_next().await;
            continue;
        }
        let free = config.concurrency.saturating_sub(running.len());
        let mut claimed_any = false;
        if free > 0 {
            match inbox.claim::<P>(&config, free).await {
                Ok(claims) => {
                    claimed_any = !claims.is_empty();
                    for (claim, delivery) in claims {
                        inbox.stats.claimed.fetch_add(1, Ordering::Relaxed);
                        inbox.record(names::INBOX_CLAIMED, &config.group, None);
                        let span = tracing::info_span!(
                            "tito.inbox.delivery",
                            table = %inbox.table,
                            group = %config.group,
                            id = %claim.id,
                            attempt = delivery.attempt,
                        );
                        let work = handle(
                            inbox.clone(),
                            config.clone(),
                            handler.clone(),
                            claim,
                            delivery,
                        );
                        running.spawn(work.instrument(span));
                    }
                }
                Err(err) => tracing::warn!(error = %err, "inbox claim failed"),
            }
        }
        idle = if claimed_any {
            Duration::from_millis(5)
        } else {
            (idle * 2).min(config.max_idle)
        };
        let full = running.len() >= config.concurrency;
        let pause = if claimed_any && !full {
            Duration::ZERO
        } else {
            idle
        };
        tokio::select! {
            biased;
            _ = &mut shutdown => stopping = true,
            _ = running.join_next(), if full => {}
            _ = tokio::time::sleep(pause) => {}
            _ = new_rows.changed_since(seen), if !full => idle = Duration::from_millis(5),
        }
    }
}

async fn handle<E, M, P, F, Fut>(
    inbox: Arc<Inbox<E, M>>,
    config: Arc<InboxConfig<E, M>>,
    handler: Arc<F>,
    claim: InboxClaim,
    delivery: InboxDelivery<P>,
) where
    E: TitoEngine,
    M: InboxModel,
    P: DeserializeOwned + Send + 'static,
    F: Fn(InboxDelivery<P>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = TitoResult<InboxOutcome>> + Send + 'static,
{
    let attempt = u32::try_from(delivery.attempt.max(1)).unwrap_or(u32::MAX);
    // The call that builds the future is supervised with it (a handler that panics before it
    // returns a future fails like one whose future panics).
    let mut work = std::panic::AssertUnwindSafe(async move { handler(delivery).await })
        .catch_unwind()
        .boxed();
    let mut claim = claim;
    let extend_every = config.lease / 3;
    let result = loop {
        tokio::select! {
            biased;
            result = &mut work => break result,
            _ = tokio::time::sleep(extend_every) => {
                match inbox.extend(&config, &claim).await {
                    Ok(Some(extended)) => claim = extended,
                    Ok(None) => {
                        inbox.stats.lease_lost.fetch_add(1, Ordering::Relaxed);
                        inbox.record(names::INBOX_OUTCOMES, &config.group, Some("lease_lost"));
                        tracing::warn!(id = %claim.id, "inbox lease lost while the handler ran");
                    }
                    Err(err) => tracing::warn!(id = %claim.id, error = %err, "extending an inbox lease failed"),
                }
            }
        }
    };
    let (error, panicked) = match result {
        Ok(Ok(outcome)) => return apply(&inbox, &config, &claim, outcome).await,
        Ok(Err(err)) => (err.to_string(), false),
        Err(_) => ("the handler panicked".to_string(), true),
    };
    inbox.stats.failed.fetch_add(1, Ordering::Relaxed);
    inbox.record(names::INBOX_OUTCOMES, &config.group, Some("failed"));
    // The failure releases the row to its retry time (or dead-letters it), instead of holding
    // it for the rest of the lease.
    let policy = config.failures();
    let (backoff, dead) = match policy.after_failure(attempt, panicked) {
        crate::queue::AfterFailure::Retry(backoff) => (backoff, false),
        // Out of attempts: the retry below dead-letters it (the claim's attempt count is at
        // the limit); a fatal panic dead-letters it whatever the count.
        crate::queue::AfterFailure::Dead => (Duration::ZERO, panicked && policy.panics_fatal()),
    };
    match inbox.release_failed(&config, &claim, backoff, dead).await {
        Ok(true) => {
            tracing::warn!(id = %claim.id, attempt, error = %error, ?backoff, "inbox handler failed; the row is released to its retry time")
        }
        Ok(false) => {
            tracing::warn!(id = %claim.id, attempt, error = %error, "inbox handler failed; the row is claimable when its lease ends")
        }
        Err(err) => {
            tracing::warn!(id = %claim.id, attempt, error = %error, release_error = %err, "inbox handler failed and releasing the row failed; it is claimable when its lease ends")
        }
    }
}

/// Applies a handler's outcome and counts it.
async fn apply<E: TitoEngine, M: InboxModel>(
    inbox: &Inbox<E, M>,
    config: &InboxConfig<E, M>,
    claim: &InboxClaim,
    outcome: InboxOutcome,
) {
    match inbox.complete(config, claim, outcome).await {
        Ok(true) => {
            inbox.stats.completed.fetch_add(1, Ordering::Relaxed);
            let label = match outcome {
                InboxOutcome::Ack => "ack",
                InboxOutcome::Drop => "drop",
                InboxOutcome::Retry | InboxOutcome::RetryAfter(_) => "retry",
            };
            inbox.record(names::INBOX_OUTCOMES, &config.group, Some(label));
        }
        Ok(false) => {
            inbox.stats.lease_lost.fetch_add(1, Ordering::Relaxed);
            inbox.record(names::INBOX_OUTCOMES, &config.group, Some("lease_lost"));
            tracing::warn!(id = %claim.id, "inbox outcome refused: the lease was lost");
        }
        Err(err @ TitoError::InvalidArgument(_)) => {
            inbox.stats.failed.fetch_add(1, Ordering::Relaxed);
            inbox.record(names::INBOX_OUTCOMES, &config.group, Some("refused"));
            tracing::error!(id = %claim.id, error = %err, "inbox outcome refused; the row is claimable when its lease ends");
        }
        Err(err) => {
            tracing::warn!(id = %claim.id, error = %err, "applying an inbox outcome failed")
        }
    }
}
