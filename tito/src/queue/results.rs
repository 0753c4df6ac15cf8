//! An invocation's state and result by its event id: [`Queue::invocation_state`] reads it once,
//! [`Queue::await_result`] waits for it to finish. Both read the store (the event-id key, then
//! the row it names), so they answer the same from every process and every handle of the
//! queue, for as long as the completed row is kept (`completed_retention`).

use std::time::Duration;

use serde::de::DeserializeOwned;

use super::Queue;
use crate::engine::{TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::event::StoredEvent;
use crate::keys;

/// Where the invocation of one event id is.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum InvocationState<R> {
    /// No invocation holds the id: never published, or its completed row was deleted by
    /// retention.
    Unknown,
    /// A workflow step waiting for its dependencies: those that have not completed yet. A
    /// step that holds ([`OnFailure::Hold`](crate::queue::graph::OnFailure::Hold)) keeps a dead
    /// or cancelled dependency here until it is retried and completes (or the workflow is
    /// cancelled).
    Waiting {
        /// The steps it waits for.
        on: Vec<String>,
    },
    /// Pending: due later, waiting, running, or between attempts (`attempt` is its next one).
    /// An invocation that `Advance`d or was rescheduled is pending until its last step ends.
    Pending {
        /// The attempt its next delivery will be, from 1.
        attempt: u32,
    },
    /// Finished.
    Finished(Finished<R>),
}

/// How an invocation finished.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Finished<R> {
    /// Acknowledged, with the result its handler returned
    /// ([`QueueHandlerOutcome::acknowledge_with`](crate::QueueHandlerOutcome::acknowledge_with)),
    /// `None` for a plain `Acknowledge`.
    Completed(Option<R>),
    /// Cancelled before it finished, with the reason given.
    Cancelled(String),
    /// Moved to the dead state by a failure policy after its last attempt.
    Dead {
        /// The last attempt's error.
        error: String,
        /// How many attempts failed.
        attempts: u32,
    },
}

/// The state of the invocation of event `id` of the queue at `root`, whose event-id key names
/// `at`, where `row` is stored.
pub(crate) fn state_of<R: DeserializeOwned>(
    root: &str,
    id: &str,
    at: &[u8],
    row: &[u8],
) -> TitoResult<InvocationState<R>> {
    let stored = StoredEvent::parse(row)?;
    let at = String::from_utf8_lossy(at);
    if at.starts_with(&keys::dead_prefix(root)) {
        return Ok(InvocationState::Finished(Finished::Dead {
            error: stored.last_error.unwrap_or_default(),
            attempts: stored.failures,
        }));
    }
    if at.starts_with(&keys::waiting_prefix(root)) {
        return Ok(InvocationState::Waiting {
            on: stored.step.map(|link| link.waiting_on).unwrap_or_default(),
        });
    }
    if !at.starts_with(&keys::completed_prefix(root)) {
        return Ok(InvocationState::Pending {
            attempt: stored.failures.saturating_add(1),
        });
    }
    if let Some(why) = stored.cancelled {
        return Ok(InvocationState::Finished(Finished::Cancelled(why)));
    }
    let result =
        match stored.result {
            Some(stored) => Some(serde_json::from_value(stored.value).map_err(|err| {
                TitoError::Serialization {
                    message: format!(
                        "the result of event {id:?} does not decode as the type asked for: {err}"
                    ),
                    source: Some(Box::new(err)),
                }
            })?),
            None => None,
        };
    Ok(InvocationState::Finished(Finished::Completed(result)))
}

/// The first pause of [`Queue::await_result`]'s reads; it doubles up to [`AWAIT_POLL_MAX`].
const AWAIT_POLL_FIRST: Duration = Duration::from_millis(2);

/// The longest pause between two reads of [`Queue::await_result`].
pub const AWAIT_POLL_MAX: Duration = Duration::from_millis(100);

impl<E: TitoEngine> Queue<E> {
    /// The state of the invocation of event `id`, with its result decoded as `R` when it
    /// completed with one (a result that does not decode as `R` is a
    /// [`TitoError::Serialization`]; read it as `serde_json::Value` to see it whatever it is).
    pub async fn invocation_state<R: DeserializeOwned>(
        &self,
        id: &str,
    ) -> TitoResult<InvocationState<R>> {
        let root = self.root();
        // The row the event-id key names, read in one snapshot.
        // A read-only snapshot (nothing to commit), whose future borrows nothing of the
        // caller's for longer than the call: a handler can await it.
        let found = crate::engine::read_only(self.engine(), async |tx| {
            let Some(at) = tx.get(keys::event_id_key(root, id).as_bytes()).await? else {
                return Ok(None);
            };
            Ok(tx.get(&at).await?.map(|row| (at, row)))
        })
        .await?;
        let Some((at, row)) = found else {
            return Ok(InvocationState::Unknown);
        };
        state_of(root, id, &at, &row)
    }

    /// Waits until the invocation of event `id` finishes, at most `timeout` (`Duration::MAX`:
    /// no limit), and returns how (`None`: still pending when the timeout passed). Reads the store, from any process,
    /// with pauses from 2 ms doubling to [`AWAIT_POLL_MAX`]; an id no invocation holds is
    /// [`TitoError::NotFound`] (never published, or its completed row is past retention).
    pub async fn await_result<R: DeserializeOwned>(
        &self,
        id: &str,
        timeout: Duration,
    ) -> TitoResult<Option<Finished<R>>> {
        // A timeout past what the clock can count (`Duration::MAX`) waits without a deadline.
        let deadline = tokio::time::Instant::now().checked_add(timeout);
        let mut pause = AWAIT_POLL_FIRST;
        loop {
            match self.invocation_state::<R>(id).await? {
                InvocationState::Finished(finished) => return Ok(Some(finished)),
                InvocationState::Unknown => {
                    return Err(TitoError::NotFound(format!(
                        "no invocation of event {id:?} in queue {}: it was never published, or \
                         its completed row is past the queue's completed_retention",
                        self.label()
                    )));
                }
                InvocationState::Pending { .. } | InvocationState::Waiting { .. } => {}
            }
            let now = tokio::time::Instant::now();
            let left = match deadline {
                Some(deadline) if now >= deadline => return Ok(None),
                Some(deadline) => deadline - now,
                None => pause,
            };
            tokio::time::sleep(pause.min(left)).await;
            pause = (pause * 2).min(AWAIT_POLL_MAX);
        }
    }
}
