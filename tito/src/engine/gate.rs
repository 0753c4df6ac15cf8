//! The write gate: every commit that writes passes it, on every engine, so that a store being
//! moved ([`crate::store::migrate`]) can tell which keys changed while it copied, and refuse
//! writes once it switched.
//!
//! - **Moved.** A store whose move finished holds the marker [`MOVED_KEY`] (the new store's
//!   name). Its gate then refuses every commit that writes anything but the marker with
//!   [`TitoError::StoreMoved`]. On a store with one owner (embedded, SQLite, memory) the
//!   flag is set in memory by the move itself and read from the marker at open. On TiKV each
//!   process reads the marker again when its last check is older than [`MOVED_CHECK_INTERVAL`],
//!   and a commit that has not finished [`MOVED_COMMIT_DEADLINE`] after it passed the gate is
//!   abandoned (an unknown outcome): so every commit a process lets through after the marker
//!   committed gets its version within the two, and the move waits for both before its last
//!   pass (see DESIGN.md, "Moving a store").
//! - **Tracked.** While a move of a store with one owner runs, the gate records the keys each
//!   commit writes. A catch-up pass then copies only those keys, and the switch's last pass is
//!   as short as the writes made since the one before.
//! - **Epochs.** A commit passes the gate in the current epoch and leaves it when its commit
//!   returned. [`Gate::flip`] changes what the gate does (starts tracking, takes the recorded
//!   keys, sets the moved flag) in a new epoch and waits until every commit of the older ones
//!   returned: after it, every commit either is visible to a new snapshot or passed the gate
//!   under the new rules.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::{TitoError, TitoResult};

/// The key of a moved store's marker: JSON naming the store it moved to. A store that holds it
/// refuses writes through Tito; [`crate::store::reopen`] deletes it.
pub const MOVED_KEY: &[u8] = b"store-moved";

/// How old a TiKV process's last read of the moved marker may be when a commit passes its gate.
pub const MOVED_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// How long a TiKV commit may take after it passed the gate before it is abandoned as an
/// unknown outcome (see the module docs).
pub const MOVED_COMMIT_DEADLINE: Duration = Duration::from_secs(10);

/// The most keys a move records between two passes; past it the next pass compares every key.
pub const MAX_TRACKED_KEYS: usize = 1_000_000;

/// What the marker holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Moved {
    /// The store the data moved to, as the move named it.
    pub to: String,
    /// When the switch began, in the source's milliseconds.
    pub at_ms: u64,
    /// When the move's last pass finished (`None` while the switch runs, or after it failed):
    /// a finished move is not run again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_ms: Option<u64>,
}

impl Moved {
    fn refusal(&self) -> TitoError {
        TitoError::StoreMoved {
            to: self.to.clone(),
            at_ms: self.at_ms,
        }
    }
}

/// Keys recorded since the last [`Gate::take_tracked`].
#[derive(Debug, Default)]
pub(crate) enum Tracked {
    /// Not recording.
    #[default]
    Off,
    /// Every key written since.
    Keys(BTreeSet<Vec<u8>>),
    /// Too many keys, or a write the gate cannot see the keys of (a range delete): compare
    /// every key.
    Lost,
}

#[derive(Debug, Default)]
struct State {
    moved: Option<Moved>,
    /// When a TiKV process last read the marker (absent: never).
    #[cfg_attr(not(feature = "tikv"), allow(dead_code))]
    checked: Option<Instant>,
    epoch: u64,
    /// Commits in flight, per epoch they passed the gate in.
    inflight: BTreeMap<u64, u64>,
    tracked: Tracked,
    /// Every write of the store passes this gate (a store with one owner).
    local: bool,
}

/// One store's gate, shared by its handle's clones (in [`super::Extensions`]).
#[derive(Debug, Default)]
pub(crate) struct Gate {
    state: Mutex<State>,
    drained: tokio::sync::Notify,
}

/// A commit in flight; it leaves the gate when dropped.
pub(crate) struct Pass {
    gate: Arc<Gate>,
    epoch: u64,
}

impl Drop for Pass {
    fn drop(&mut self) {
        let mut state = crate::util::lock(&self.gate.state);
        if let Some(count) = state.inflight.get_mut(&self.epoch) {
            *count -= 1;
            if *count == 0 {
                state.inflight.remove(&self.epoch);
                self.gate.drained.notify_waiters();
            }
        }
    }
}

impl Gate {
    /// Lets a commit that writes `keys` through (or refuses it: the store moved), recording
    /// the keys while a move tracks them. Hold the pass until the commit returned.
    pub(crate) fn enter<'k>(
        self: &Arc<Self>,
        keys: impl Iterator<Item = &'k [u8]> + Clone,
    ) -> TitoResult<Pass> {
        let mut state = crate::util::lock(&self.state);
        if let Some(moved) = &state.moved
            && keys.clone().any(|key| key != MOVED_KEY)
        {
            return Err(moved.refusal());
        }
        if let Tracked::Keys(set) = &mut state.tracked {
            set.extend(keys.map(<[u8]>::to_vec));
            if set.len() > MAX_TRACKED_KEYS {
                state.tracked = Tracked::Lost;
            }
        }
        let epoch = state.epoch;
        *state.inflight.entry(epoch).or_default() += 1;
        Ok(Pass {
            gate: self.clone(),
            epoch,
        })
    }

    /// A write whose keys the gate cannot record (a range delete) is about to run: refused
    /// when the store moved, and a running move compares every key in its next pass.
    pub(crate) fn enter_untracked(self: &Arc<Self>) -> TitoResult<Pass> {
        let mut state = crate::util::lock(&self.state);
        if let Some(moved) = &state.moved {
            return Err(moved.refusal());
        }
        if matches!(state.tracked, Tracked::Keys(_)) {
            state.tracked = Tracked::Lost;
        }
        let epoch = state.epoch;
        *state.inflight.entry(epoch).or_default() += 1;
        Ok(Pass {
            gate: self.clone(),
            epoch,
        })
    }

    /// Changes the gate in a new epoch, then waits until every commit that passed it before
    /// returned. Returns what `change` returned.
    pub(crate) async fn flip<T>(&self, change: impl FnOnce(&mut StateView<'_>) -> T) -> T {
        let (value, epoch) = {
            let mut state = crate::util::lock(&self.state);
            let value = change(&mut StateView(&mut state));
            state.epoch += 1;
            (value, state.epoch)
        };
        loop {
            let drained = self.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            let busy = crate::util::lock(&self.state)
                .inflight
                .keys()
                .any(|&older| older < epoch);
            if !busy {
                return value;
            }
            drained.await;
        }
    }

    /// Says that every write of the store passes this gate: its open proved it has the only
    /// owner (embedded, SQLite) or it lives in this process (memory).
    pub(crate) fn mark_local(&self) {
        crate::util::lock(&self.state).local = true;
    }

    /// Whether every write of the store passes this gate.
    pub(crate) fn is_local(&self) -> bool {
        crate::util::lock(&self.state).local
    }

    /// How many keys were recorded since the last take (`None`: not recording, or too many).
    pub(crate) fn tracked_keys(&self) -> Option<u64> {
        match &crate::util::lock(&self.state).tracked {
            Tracked::Keys(keys) => Some(keys.len() as u64),
            Tracked::Off | Tracked::Lost => None,
        }
    }

    #[cfg_attr(not(feature = "tikv"), allow(dead_code))]
    /// Whether a TiKV process must read the marker again before letting a commit through.
    pub(crate) fn needs_check(&self) -> bool {
        crate::util::lock(&self.state)
            .checked
            .is_none_or(|at| at.elapsed() >= MOVED_CHECK_INTERVAL)
    }

    #[cfg_attr(not(feature = "tikv"), allow(dead_code))]
    /// Records a read of the marker begun at `at`.
    pub(crate) fn checked(&self, at: Instant, moved: Option<Moved>) {
        let mut state = crate::util::lock(&self.state);
        if state.checked.is_none_or(|last| last < at) {
            state.checked = Some(at);
            state.moved = moved;
        }
    }
}

/// What [`Gate::flip`] may change.
pub(crate) struct StateView<'a>(&'a mut State);

impl StateView<'_> {
    /// Starts recording keys (again), returning what was recorded since the last call.
    pub(crate) fn take_tracked(&mut self) -> Tracked {
        std::mem::replace(&mut self.0.tracked, Tracked::Keys(BTreeSet::new()))
    }

    /// Stops recording keys.
    pub(crate) fn stop_tracking(&mut self) -> Tracked {
        std::mem::take(&mut self.0.tracked)
    }

    /// Sets (or clears) the moved flag.
    pub(crate) fn set_moved(&mut self, moved: Option<Moved>) {
        self.0.moved = moved;
    }
}

/// Decodes a marker's value.
pub(crate) fn decode(value: &[u8]) -> TitoResult<Moved> {
    serde_json::from_slice(value).map_err(|err| {
        TitoError::Integrity(format!(
            "the moved marker ({}) is not what Tito writes: {err}",
            crate::keys::display_key(MOVED_KEY)
        ))
    })
}

/// Reads the marker of a store with one owner into its gate and marks the gate local (the open
/// of a local store does, so a moved store refuses writes from its first commit).
pub(crate) async fn load<E: super::TitoEngine>(engine: &E) -> TitoResult<()> {
    use super::TitoTransaction;
    let tx = engine.begin().await?;
    let value = tx.get(MOVED_KEY).await;
    let _ = tx.rollback().await;
    let moved = value?.as_deref().map(decode).transpose()?;
    let gate = engine.extensions().get::<Gate>();
    let mut state = crate::util::lock(&gate.state);
    state.moved = moved;
    state.local = true;
    Ok(())
}
