//! Pulling: each runnable partition's fair cursor, its idle backoff, and starting handlers for
//! what a pull finds, while handler slots are free and shutdown has not been asked for.

use std::collections::HashMap;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::Running;
use super::Stop;
use super::handler::{Invoker, Report};
use crate::engine::{TitoEngine, TitoTransaction, read_only};
use crate::queue::pull::Cursor;
use crate::queue::{
    Cancellation, Gate, Holder, PAUSE_CHECK, Paused, Queue, Unslotted, admit, claim_running,
    read_limits, read_paused, release_slots, sweep_orphan_slots, with_cancellation,
};
use crate::telemetry::names;
use tracing::Instrument;

const MIN_IDLE_BACKOFF: Duration = Duration::from_millis(10);

struct PartitionState {
    cursor: Cursor,
    generation: u64,
    next_poll: Instant,
    backoff: Duration,
}

/// The partitions a worker pulls from.
pub(super) struct Pulling {
    partitions: HashMap<u32, PartitionState>,
    max_idle_backoff: Duration,
    page_size: usize,
    concurrency: usize,
    /// Invocations whose handler failed, not started again before their pause ends.
    pub cooling: Cooling,
    /// Handler runs per minute, for the worker's report.
    pub figures: std::sync::Arc<super::report::Figures>,
    /// Pending rows that do not decode as this worker's event type: a row never changes, so
    /// each costs this worker one attempt, then is stepped over (see [`MAX_UNDECODABLE_KEPT`]).
    undecodable: std::collections::HashSet<String>,
    /// The last wake-up generation of the queue this worker acted on.
    seen: u64,
    /// The queue's pause records as last read, and when (read again [`PAUSE_CHECK`] later).
    paused: Paused,
    paused_read: Option<Instant>,
    /// The cancellation of each started invocation, when their rows were last checked, how
    /// often they are checked, and the in-process cancellations already acted on.
    tokens: HashMap<String, Cancellation>,
    tokens_checked: Instant,
    cancel_check: Duration,
    cancels_seen: u64,
    /// The queue's limits as last read (with the pauses).
    gate: Gate,
    /// This worker as its concurrency slots name it.
    holder: Holder,
    /// The slots each started invocation holds (its business key, the slot keys), until
    /// released after it settles.
    slots: HashMap<String, (String, Vec<Vec<u8>>)>,
    /// A gate transaction failed with an outcome not known: slots it may have written are
    /// looked for and deleted before the next start.
    orphans: bool,
    /// The business key of each started invocation (until it settles).
    business: HashMap<String, String>,
    /// The limits changed to ones that count running invocations: those started without
    /// their slots take them (tried again at every pull until it succeeds).
    claim: bool,
    /// Per business key, the earliest row (in its partition's order) that waited for a
    /// concurrency slot: offered to the gate first at its partition's next pull, so a freed
    /// slot goes to it, not to whatever row of the key the cursor reaches next (at most
    /// [`MAX_WAITING_KEPT`] keys).
    waiting: HashMap<String, crate::queue::pull::Pulled>,
    /// Per business key, the first poll of the last handler started for it: the next handler of
    /// the key is first polled after it, so a key's handlers first run in the order they were
    /// started (the order of their rows), whatever order the runtime polls tasks in.
    first_polls: HashMap<String, super::handler::FirstPolled>,
    /// The partition the last round of pulls began with: the next round begins after it, so
    /// every due partition is first in turn.
    first_last_round: Option<u32>,
    /// The worker's fence slots, handed to every invocation it starts.
    fences: std::sync::Arc<crate::queue::lease::FencePool>,
}

/// Past this many keys, the record of handlers' first polls drops the keys whose last handler
/// was polled already.
const FIRST_POLLS_KEPT: usize = 1024;

/// How many keys' earliest waiting rows a worker remembers.
pub const MAX_WAITING_KEPT: usize = 10_000;

/// How many undecodable rows a worker remembers; past it, more are paused like failed
/// handlers (their attempts then cost a decode per pause, not per poll).
pub const MAX_UNDECODABLE_KEPT: usize = 10_000;

impl Pulling {
    /// The last wake-up generation of the queue this worker acted on.
    pub fn seen(&self) -> u64 {
        self.seen
    }

    pub fn new(
        max_idle_backoff: Duration,
        page_size: usize,
        concurrency: usize,
        cancel_check: Duration,
        holder: Holder,
    ) -> Self {
        Pulling {
            partitions: HashMap::new(),
            max_idle_backoff,
            page_size,
            concurrency,
            cooling: Cooling::default(),
            figures: Default::default(),
            undecodable: std::collections::HashSet::new(),
            seen: 0,
            paused: Paused::default(),
            paused_read: None,
            tokens: HashMap::new(),
            tokens_checked: Instant::now(),
            cancel_check,
            cancels_seen: 0,
            gate: Gate::default(),
            holder,
            slots: HashMap::new(),
            orphans: false,
            business: HashMap::new(),
            claim: false,
            waiting: HashMap::new(),
            first_polls: HashMap::new(),
            first_last_round: None,
            fences: crate::queue::lease::FencePool::new(crate::queue::lease::fence_count(
                concurrency,
            )),
        }
    }

    /// Pulls from exactly these partitions (with their lease generations) from now on.
    pub fn sync(&mut self, runnable: impl Iterator<Item = (u32, u64)>) {
        let runnable: HashMap<u32, u64> = runnable.collect();
        self.partitions
            .retain(|p, state| runnable.get(p) == Some(&state.generation));
        for (partition, generation) in runnable {
            self.partitions
                .entry(partition)
                .or_insert_with(|| PartitionState {
                    cursor: Cursor::new(partition),
                    generation,
                    next_poll: Instant::now(),
                    backoff: MIN_IDLE_BACKOFF,
                });
        }
    }

    /// The earliest poll due, when a handler slot is free (`running`: handlers running; an
    /// outcome waiting for its commit holds no handler slot).
    pub fn next_wake(&self, running: usize) -> Option<Instant> {
        if running >= self.concurrency {
            return None;
        }
        self.partitions.values().map(|s| s.next_poll).min()
    }

    /// Pulls from every due partition and starts handlers while slots are free and the leases
    /// are fresh (until `fresh_until`). Stops at once (starting nothing more) when `stop` is
    /// asked for or the leases went stale, even between a pull and its starts.
    pub async fn start<E, T>(
        &mut self,
        queue: &Queue<E>,
        fresh_until: Instant,
        in_flight: &mut HashMap<String, u32>,
        handlers: &mut JoinSet<(Running, Report<T>)>,
        invoke: &Invoker<T>,
        stop: &mut Stop,
    ) where
        E: TitoEngine,
        T: Serialize + DeserializeOwned + Send + 'static,
    {
        let (now, woken) = queue.wakeups.woken_since(self.seen);
        self.seen = now;
        for partition in woken {
            if let Some(state) = self.partitions.get_mut(&partition) {
                state.next_poll = Instant::now();
                state.backoff = MIN_IDLE_BACKOFF;
                // A wake-up of a partition this worker holds paused may be its resume: read the
                // pause records again now rather than when the view is [`PAUSE_CHECK`] old.
                if self.paused.holds(partition) {
                    self.paused_read = None;
                }
            }
        }
        let mut due: Vec<u32> = self
            .partitions
            .iter()
            .filter(|(_, s)| s.next_poll <= Instant::now())
            .map(|(p, _)| *p)
            .collect();
        due.sort_unstable();
        // Each round begins with the partition after the one the last began with, and gives
        // each due partition its share of the free handlers (below): a partition with a
        // backlog never takes every handler while another has due rows.
        if let Some(last) = self.first_last_round {
            let after = due.iter().position(|p| *p > last).unwrap_or(0);
            due.rotate_left(after);
        }
        if let Some(first) = due.first() {
            self.first_last_round = Some(*first);
        }
        let gate_before = self.gate.clone();
        // Read while partitions are due, and while handlers run (new limits count them).
        if (!due.is_empty() || !in_flight.is_empty())
            && !fresh_pauses(
                &mut self.paused,
                &mut self.gate,
                &mut self.paused_read,
                queue,
            )
            .await
        {
            // The pauses could not be read: start nothing this round rather than run what
            // may be paused; try again after a short pause.
            for partition in due {
                if let Some(state) = self.partitions.get_mut(&partition) {
                    state.next_poll = Instant::now() + state.backoff;
                    state.backoff = (state.backoff * 2).min(self.max_idle_backoff);
                }
            }
            return;
        }
        if self.gate != gate_before {
            let limits = self.gate.limits();
            self.claim = limits.concurrency.is_some() || limits.key_concurrency.is_some();
        }
        if self.claim {
            self.claim_slots(queue, in_flight).await;
        }
        let counters = queue.counters();
        self.cooling.prune(self.max_idle_backoff);
        let rounds = due.len();
        for (turn, partition) in due.into_iter().enumerate() {
            // Handler slots: outcomes waiting in the outcome window hold none (their rows stay
            // in flight, so no pull returns them again).
            let free = self.concurrency.saturating_sub(handlers.len());
            if free == 0 || stop.requested() || Instant::now() >= fresh_until {
                return;
            }
            // This partition's share of the free handlers: what is left over (a partition
            // that found less than its share) goes to the partitions after it.
            let share = free.div_ceil(rounds - turn);
            let mut want = share.min(self.page_size);
            let state = self.partitions.get_mut(&partition).expect("due partition");
            if let Some(limit) = self.gate.limits().concurrency {
                // This worker's own slots count against the queue's limit: pull no more than
                // could start, and nothing while they fill it (a release wakes the partitions).
                want = want.min((limit as usize).saturating_sub(self.slots.len()));
                if want == 0 {
                    state.next_poll = Instant::now() + self.max_idle_backoff;
                    continue;
                }
            }
            if self.paused.holds(partition) {
                // Paused: nothing starts; look again when the pause records are read again.
                state.next_poll = Instant::now() + PAUSE_CHECK;
                continue;
            }
            let (cooling, undecodable) = (&self.cooling, &self.undecodable);
            // Cancellations this process committed while the pull ran are checked before
            // anything it found starts (its snapshot may predate them).
            let cancels_before = queue.wakeups.cancels();
            // What a new pass would read again: this partition's rows in flight, and the
            // cooling ones (of any partition: a bound).
            let behind =
                in_flight.values().filter(|p| **p == partition).count() + self.cooling.len();
            // Rows of this partition that waited for a slot go first, earliest first (their
            // presence is checked again by the gate), and the cursor brings the rest.
            if !self.gate.active() {
                self.waiting.clear();
            }
            let mut first: Vec<crate::queue::pull::Pulled> = Vec::new();
            if !self.waiting.is_empty() {
                let mut mine: Vec<&String> = self
                    .waiting
                    .iter()
                    .filter(|(_, row)| row.parsed.partition == partition)
                    .map(|(key, _)| key)
                    .collect();
                mine.sort_by(|a, b| self.waiting[*a].key.cmp(&self.waiting[*b].key));
                let taken: Vec<String> = mine.into_iter().take(want).cloned().collect();
                for key in taken {
                    if let Some(row) = self.waiting.remove(&key)
                        && !in_flight.contains_key(&row.key)
                    {
                        first.push(row);
                    }
                }
            }
            let cursor_want = want.saturating_sub(first.len());
            let pulled = async {
                if cursor_want == 0 {
                    // The waiting rows fill the pull: the cursor stays where it is.
                    return Ok(crate::queue::pull::PullResult::default());
                }
                let tx = queue.engine().begin().await?;
                let now = Instant::now();
                let running: &HashMap<String, u32> = in_flight;
                let skip = |key: &str| {
                    running.contains_key(key)
                        || cooling.holds(key, now)
                        || undecodable.contains(key)
                };
                let result = state
                    .cursor
                    .pull(&tx, queue.root(), cursor_want, &skip, counters, behind)
                    .await;
                let _ = tx.rollback().await;
                result
            }
            .await;
            let pulled = match pulled {
                Ok(pulled) if queue.wakeups.cancels() != cancels_before => {
                    still_pending(queue, pulled).await
                }
                Ok(pulled) => Ok(pulled),
                Err(err) => Err(err),
            };
            let pulled = match pulled {
                Ok(pulled) => pulled,
                Err(err) => {
                    tracing::warn!(partition, error = %err, "pulling queue rows failed");
                    state.next_poll = Instant::now() + state.backoff;
                    state.backoff = (state.backoff * 2).min(self.max_idle_backoff);
                    continue;
                }
            };
            let mut pulled = pulled;
            if !first.is_empty() {
                let offered: std::collections::HashSet<String> =
                    first.iter().map(|row| row.key.clone()).collect();
                pulled.items.retain(|row| !offered.contains(&row.key));
                first.extend(std::mem::take(&mut pulled.items));
                pulled.items = first;
            }
            let found = pulled.items.len();
            if self.gate.active() && !pulled.items.is_empty() {
                // Limits: take slots and rate-log entries for what was found, in one
                // transaction; what they do not allow waits (or, over a rate, moves later).
                let mut items = std::mem::take(&mut pulled.items);
                if let Some(limit) = self.gate.limits().key_concurrency {
                    let mut running: HashMap<&str, usize> = HashMap::new();
                    for (key, _) in self.slots.values() {
                        *running.entry(key.as_str()).or_default() += 1;
                    }
                    let (free, held): (Vec<_>, Vec<_>) = items.into_iter().partition(|item| {
                        running.get(item.stored.key.as_str()).copied().unwrap_or(0) < limit as usize
                    });
                    items = free;
                    queue.count(&counters.limited, names::QUEUE_LIMITED, held.len() as u64);
                    remember_waiting(&mut self.waiting, held);
                }
                let admitted = admit_each_if_refused(
                    queue,
                    &self.holder,
                    &self.gate,
                    items,
                    &mut self.cooling,
                    self.max_idle_backoff,
                )
                .await;
                match admitted {
                    Ok(admitted) if admitted.stale => {
                        // The limits changed since they were read: read them again, then pull.
                        self.paused_read = None;
                    }
                    Ok(mut admitted) => {
                        queue.count(
                            &counters.limited,
                            names::QUEUE_LIMITED,
                            admitted.waiting as u64,
                        );
                        remember_waiting(&mut self.waiting, std::mem::take(&mut admitted.waited));
                        let moved = admitted.moved as u64;
                        queue.count(&counters.rate_limited, names::QUEUE_RATE_LIMITED, moved);
                        for (item, slot_keys) in admitted.start {
                            if !slot_keys.is_empty() {
                                let business = item.stored.key.clone();
                                self.slots.insert(item.key.clone(), (business, slot_keys));
                            }
                            pulled.items.push(item);
                        }
                    }
                    Err(err) => {
                        self.orphans = true;
                        tracing::warn!(partition, error = %err, "taking concurrency slots failed; nothing started");
                    }
                }
                // What waits was passed over: the pass goes on past it (rows of other keys
                // may run), and starts over from the front, where it waits, when that is cheap.
                state.cursor.passed_over(found - pulled.items.len());
                if pulled.items.is_empty() {
                    // Nothing may start: wait like an idle partition (a release in this
                    // process wakes it sooner).
                    pulled.exhausted = true;
                    pulled.next_due = None;
                }
            }
            if pulled.exhausted && pulled.items.is_empty() {
                state.backoff = (state.backoff * 2).min(self.max_idle_backoff);
                let mut next = Instant::now() + state.backoff;
                if let Some(due) = pulled.next_due {
                    // Wake at the due second exactly (plus a millisecond), not a whole second late,
                    // by the engine's clock (the one the runnable boundary is read from).
                    let until_due = Duration::from_millis(
                        due.saturating_mul(1000).saturating_sub(pulled.now_ms) + 1,
                    );
                    // (Never past the idle backoff: a due time centuries away cannot overflow.)
                    next = next.min(Instant::now() + until_due.min(self.max_idle_backoff));
                }
                state.next_poll = next;
            } else {
                // Work was found: come back at once (no sleep after a full page).
                state.backoff = MIN_IDLE_BACKOFF;
                state.next_poll = Instant::now();
            }
            // A slow pull may outlive the pause view it began with: look again (a no-op while
            // it is fresh) before starting anything, and start nothing in a paused partition
            // (the pass starts over, so what it found is found again after the resume).
            if !pulled.items.is_empty()
                && (!fresh_pauses(
                    &mut self.paused,
                    &mut self.gate,
                    &mut self.paused_read,
                    queue,
                )
                .await
                    || self.paused.holds(partition))
            {
                state.cursor = Cursor::new(partition);
                state.next_poll = Instant::now() + PAUSE_CHECK;
                continue;
            }
            // Shutdown asked for, or the leases went stale, during the pull: what it found stays
            // pending, unstarted.
            if stop.requested() || Instant::now() >= fresh_until {
                return;
            }
            for item in pulled.items {
                // A model event's row of an older shape is read through a newer model of its
                // table that this process knows, when the handler's type does not take it as
                // it is.
                // A handler typed by a versioned model this process knows reads the row through
                // that model's conversions, by the shape the event says it is in.
                let typed = match crate::event::readers::for_handler(
                    queue.engine(),
                    std::any::TypeId::of::<T>(),
                    &item.stored.payload,
                ) {
                    Some(Some(payload)) => item.stored.typed_from::<T>(payload),
                    Some(None) => Err(crate::error::TitoError::Integrity(format!(
                        "the row of this model event is in a shape the conversions of {} do not \
                         read",
                        std::any::type_name::<T>()
                    ))),
                    None => item.stored.typed::<T>().or_else(|err| {
                        crate::event::readers::upgraded_payloads(
                            queue.engine(),
                            &item.stored.payload,
                        )
                        .into_iter()
                        .find_map(|payload| item.stored.typed_from::<T>(payload).ok())
                        .ok_or(err)
                    }),
                };
                let event = match typed {
                    Ok(event) => event,
                    Err(err) => {
                        undecodable_row::<E, T>(
                            &mut self.undecodable,
                            &mut self.cooling,
                            self.max_idle_backoff,
                            queue,
                            &item.key,
                            &err,
                        )
                        .await;
                        continue;
                    }
                };
                in_flight.insert(item.key.clone(), partition);
                self.business
                    .insert(item.key.clone(), item.stored.key.clone());
                queue.count(&counters.delivered, names::QUEUE_DELIVERED, 1);
                let label = queue.label().to_string();
                let late_ms = chrono::Utc::now()
                    .timestamp_millis()
                    .saturating_sub(item.stored.timestamp.saturating_mul(1000))
                    .max(0);
                metrics::histogram!(names::QUEUE_LATENESS_SECONDS, "queue" => label.clone())
                    .record(late_ms as f64 / 1000.0);
                let span = tracing::info_span!(
                    "tito.queue.handler",
                    queue = %label,
                    partition,
                    event_id = %item.stored.id,
                    key = %item.stored.key,
                    due = item.stored.timestamp,
                );
                let running = Running {
                    pulled: item,
                    generation: state.generation,
                    fences: self.fences.clone(),
                    replays: 0,
                };
                let token = Cancellation::default();
                self.tokens
                    .insert(running.pulled.key.clone(), token.clone());
                let polled = super::handler::FirstPolled::default();
                if self.first_polls.len() >= FIRST_POLLS_KEPT {
                    self.first_polls.retain(|_, polled| !polled.is_closed());
                }
                let previous = self
                    .first_polls
                    .insert(running.pulled.stored.key.clone(), polled.clone());
                let start = (queue.wakeups.clone(), running.pulled.key.clone());
                let work = super::handler::in_start_order(
                    previous,
                    polled,
                    start,
                    with_cancellation(token, invoke(running, event)),
                );
                let figures = self.figures.clone();
                let late_ms = late_ms as u64;
                handlers.spawn(
                    async move {
                        let started = std::time::Instant::now();
                        let done = work.await;
                        let took = started.elapsed();
                        metrics::histogram!(names::QUEUE_HANDLER_SECONDS, "queue" => label)
                            .record(took.as_secs_f64());
                        figures.record(
                            partition,
                            took,
                            matches!(done.1, Report::Failed(_)),
                            late_ms,
                            done.0.replays,
                        );
                        done
                    }
                    .instrument(span),
                );
            }
        }
    }
}

/// Remembers, per business key, the earliest of `rows` (and of what was remembered) that
/// waited for a concurrency slot.
fn remember_waiting(
    waiting: &mut HashMap<String, crate::queue::pull::Pulled>,
    rows: Vec<crate::queue::pull::Pulled>,
) {
    for row in rows {
        let full = waiting.len() >= MAX_WAITING_KEPT;
        match waiting.get_mut(&row.stored.key) {
            Some(kept) if kept.parsed.partition == row.parsed.partition && row.key < kept.key => {
                *kept = row
            }
            Some(_) => {}
            None if !full => {
                waiting.insert(row.stored.key.clone(), row);
            }
            None => {}
        }
    }
}

/// [`admit`], and when the limits' gate refuses what a pull found as a whole with an error
/// that retrying cannot cure (a derived key or value the engines refuse), each row alone: one
/// row the gate cannot take never holds up the others. A row refused alone is kept from this
/// worker's starts like a failed handler (paused, then tried again), and logged.
async fn admit_each_if_refused<E: TitoEngine>(
    queue: &Queue<E>,
    holder: &Holder,
    gate: &Gate,
    items: Vec<crate::queue::pull::Pulled>,
    cooling: &mut Cooling,
    cap: Duration,
) -> crate::error::TitoResult<crate::queue::Admitted> {
    use crate::error::TitoError;
    let refused = |err: &TitoError| {
        matches!(
            err,
            TitoError::InvalidArgument(_)
                | TitoError::Integrity(_)
                | TitoError::Serialization { .. }
        )
    };
    let all = items.clone();
    match admit(queue, holder, gate, items).await {
        Err(err) if refused(&err) => {
            let mut admitted = crate::queue::Admitted::default();
            for item in all {
                let key = item.key.clone();
                let (event_id, business_key) = (item.stored.id.clone(), item.stored.key.clone());
                let partition = item.parsed.partition;
                match admit(queue, holder, gate, vec![item]).await {
                    Ok(one) => admitted.merge(one),
                    Err(err) => {
                        tracing::warn!(queue = %queue.label(), partition, event_id = %event_id, key = %business_key, error = %err, "the limits' gate refuses this row; the others go on");
                        cooling.failed(&key, cap);
                    }
                }
            }
            Ok(admitted)
        }
        other => other,
    }
}

/// What a pull found, less the rows that left the pending state since (read again in one
/// batch: a cancel committed in this process during the pull).
async fn still_pending<E: TitoEngine>(
    queue: &Queue<E>,
    mut pulled: crate::queue::pull::PullResult,
) -> crate::error::TitoResult<crate::queue::pull::PullResult> {
    if pulled.items.is_empty() {
        return Ok(pulled);
    }
    let keys: Vec<Vec<u8>> = pulled
        .items
        .iter()
        .map(|item| item.key.clone().into_bytes())
        .collect();
    let rows = read_only(queue.engine(), async |tx| tx.batch_get(&keys).await).await?;
    let mut present = rows.iter().map(Option::is_some);
    pulled.items.retain(|_| present.next().unwrap_or(false));
    Ok(pulled)
}

impl Pulling {
    /// Concurrency limits were set while handlers of this worker ran without slots: they take
    /// slots now (above the limit when it is full), so the limit counts them and nothing more
    /// starts until they finish. Until it succeeds, it is tried again at every pull.
    async fn claim_slots<E: TitoEngine>(
        &mut self,
        queue: &Queue<E>,
        in_flight: &HashMap<String, u32>,
    ) {
        let queue_slot = |slots: &[Vec<u8>]| {
            let prefix = format!("{}all:", crate::keys::slots_prefix(queue.root()));
            slots.iter().any(|slot| slot.starts_with(prefix.as_bytes()))
        };
        let limits = self.gate.limits().clone();
        let unslotted: Vec<Unslotted> = in_flight
            .keys()
            .filter_map(|invocation| {
                let key = self.business.get(invocation)?;
                let held = self
                    .slots
                    .get(invocation)
                    .map(|(_, slots)| slots.as_slice());
                let has_queue = held.is_some_and(queue_slot);
                let has_key = held.is_some_and(|slots| slots.len() > usize::from(has_queue));
                let item = Unslotted {
                    invocation: invocation.clone(),
                    key: key.clone(),
                    queue: limits.concurrency.is_some() && !has_queue,
                    per_key: limits.key_concurrency.is_some() && !has_key,
                };
                (item.queue || item.per_key).then_some(item)
            })
            .collect();
        if unslotted.is_empty() {
            self.claim = false;
            return;
        }
        match claim_running(queue, &self.holder, &unslotted).await {
            Ok(taken) => {
                self.claim = false;
                tracing::info!(
                    queue = %queue.label(),
                    running = taken.len(),
                    "running invocations now count against the queue's new concurrency limits"
                );
                for (invocation, key, slots) in taken {
                    let entry = self
                        .slots
                        .entry(invocation)
                        .or_insert_with(|| (key, Vec::new()));
                    entry.1.extend(slots);
                }
            }
            Err(err) => {
                // Slots it may have written name this worker and invocations in flight: they
                // are released with them.
                tracing::warn!(error = %err, "counting running invocations against new limits failed; tried again");
            }
        }
    }

    /// Releases the concurrency slots of invocations no longer in flight (one transaction);
    /// wakes every partition when it did, so what waited for a slot is pulled again at once.
    /// Slots whose release fails are tried again next time (and are free anyway once this
    /// worker is gone).
    pub async fn release_settled<E: TitoEngine>(
        &mut self,
        queue: &Queue<E>,
        in_flight: &HashMap<String, u32>,
    ) {
        if self.orphans {
            let keep: std::collections::HashSet<String> = self.slots.keys().cloned().collect();
            match sweep_orphan_slots(queue, &self.holder, &keep).await {
                Ok(deleted) => {
                    self.orphans = false;
                    if deleted > 0 {
                        tracing::info!(
                            deleted,
                            "deleted concurrency slots a failed transaction left"
                        );
                    }
                }
                Err(err) => {
                    tracing::debug!(error = %err, "looking for slots a failed transaction left failed")
                }
            }
        }
        self.business.retain(|key, _| in_flight.contains_key(key));
        let settled: Vec<(String, Vec<u8>)> = self
            .slots
            .iter()
            .filter(|(key, _)| !in_flight.contains_key(*key))
            .flat_map(|(key, (_, slots))| slots.iter().map(|slot| (key.clone(), slot.clone())))
            .collect();
        if settled.is_empty() {
            return;
        }
        match release_slots(queue, &self.holder, &settled).await {
            Ok(()) => {
                self.slots.retain(|key, _| in_flight.contains_key(key));
                for state in self.partitions.values_mut() {
                    state.next_poll = Instant::now();
                    state.backoff = MIN_IDLE_BACKOFF;
                }
            }
            Err(err) => {
                tracing::warn!(error = %err, slots = settled.len(), "releasing concurrency slots failed; tried again later");
            }
        }
    }

    /// When the rows of running handlers are to be checked next (`None`: nothing runs).
    pub fn next_cancel_check(&self) -> Option<Instant> {
        (!self.tokens.is_empty()).then_some(self.tokens_checked + self.cancel_check)
    }

    /// While handlers run, after a cancellation committed in this process and otherwise every
    /// `cancel_check` (a third of the lease): reads their pending rows (one batched read) and
    /// fires the cancellation of each whose row is gone (cancelled, erased by its owner, moved
    /// aside). Forgets the tokens of invocations no longer in flight.
    pub async fn check_cancelled<E: TitoEngine>(
        &mut self,
        queue: &Queue<E>,
        in_flight: &HashMap<String, u32>,
    ) {
        self.tokens.retain(|key, _| in_flight.contains_key(key));
        let cancels = queue.wakeups.cancels();
        let told = cancels != self.cancels_seen;
        self.cancels_seen = cancels;
        if self.tokens.is_empty() || (!told && self.tokens_checked.elapsed() < self.cancel_check) {
            return;
        }
        self.tokens_checked = Instant::now();
        // Cancelled in this process: known for certain, whatever snapshot a read would get.
        for (key, token) in &self.tokens {
            if !token.is_cancelled() && queue.wakeups.was_cancelled(key) {
                tracing::info!(
                    key,
                    "a running invocation was cancelled: its handler is told"
                );
                token.cancel();
            }
        }
        let keys: Vec<Vec<u8>> = self
            .tokens
            .iter()
            .filter(|(_, token)| !token.is_cancelled())
            .map(|(key, _)| key.clone().into_bytes())
            .collect();
        if keys.is_empty() {
            return;
        }
        let read = read_only(queue.engine(), async |tx| tx.batch_get(&keys).await).await;
        match read {
            Ok(rows) => {
                for (key, row) in keys.iter().zip(rows) {
                    if row.is_none()
                        && let Ok(key) = std::str::from_utf8(key)
                        && let Some(token) = self.tokens.get(key)
                    {
                        tracing::info!(
                            key,
                            "a running invocation left the pending state (cancelled?): its handler is told"
                        );
                        token.cancel();
                    }
                }
            }
            Err(err) => {
                tracing::debug!(error = %err, "checking running invocations for cancellation failed");
            }
        }
    }
}

/// Reads the queue's pause records into `paused` when the last reading began [`PAUSE_CHECK`]
/// ago or more (one scan). `false` when they could not be read (logged; read again next time).
async fn fresh_pauses<E: TitoEngine>(
    paused: &mut Paused,
    gate: &mut Gate,
    paused_read: &mut Option<Instant>,
    queue: &Queue<E>,
) -> bool {
    if paused_read.is_some_and(|read| read.elapsed() < PAUSE_CHECK) {
        return true;
    }
    let started = Instant::now();
    let read = read_only(queue.engine(), async |tx| {
        let paused = read_paused(tx, queue.root()).await?;
        let limits = read_limits(tx, queue.root()).await?;
        Ok((paused, limits))
    })
    .await;
    match read {
        Ok((found, limits)) => {
            let limits = Gate::new(limits);
            if limits != *gate {
                tracing::info!(queue = %queue.label(), limits = ?limits.limits(), "the queue's limits changed");
                *gate = limits;
            }
            if found != *paused {
                tracing::info!(
                    queue = %queue.label(),
                    queue_paused = found.queue.is_some(),
                    partitions_paused = ?found.partitions.keys().collect::<Vec<_>>(),
                    "the queue's pauses changed"
                );
            }
            *paused = found;
            // Fresh from the moment the read began.
            *paused_read = Some(started);
            true
        }
        Err(err) => {
            tracing::warn!(error = %err, "reading the queue's pause records failed");
            false
        }
    }
}

/// A pending row that does not decode as `T`: counted and logged at warn once, noted in the
/// store for operators (the inspection API, the dashboard and `tito queue peek` show it;
/// [`Queue::set_aside`] moves it out of the partition), and never pulled again by this
/// worker. Past [`MAX_UNDECODABLE_KEPT`] rows it is paused like a failed handler instead.
async fn undecodable_row<E: TitoEngine, T>(
    undecodable: &mut std::collections::HashSet<String>,
    cooling: &mut Cooling,
    max_idle_backoff: Duration,
    queue: &Queue<E>,
    key: &str,
    err: &crate::error::TitoError,
) {
    if undecodable.len() >= MAX_UNDECODABLE_KEPT {
        cooling.failed(key, max_idle_backoff);
        tracing::debug!(key, error = %err, "queue row does not decode as the handler's event type");
        return;
    }
    if !undecodable.insert(key.to_string()) {
        return;
    }
    let type_name = std::any::type_name::<T>();
    queue.count(&queue.counters().malformed, names::QUEUE_MALFORMED, 1);
    let parsed = crate::keys::parse_pending_key(queue.root(), key).ok();
    tracing::warn!(
        queue = %queue.label(),
        partition = parsed.as_ref().map(|p| p.partition),
        event_id = parsed.as_ref().map(|p| p.event_id.as_str()),
        event_type = type_name,
        error = %err,
        "queue row does not decode as this worker's event type: left pending for a worker \
         of the right type, not pulled again by this one (Queue::set_aside moves it aside)"
    );
    if let Err(note_err) = queue
        .note_undecodable(key, type_name, &err.to_string())
        .await
    {
        tracing::debug!(key, error = %note_err, "noting an undecodable queue row failed");
    }
}

/// The shortest pause before an invocation whose handler failed is started again by this worker.
pub const MIN_RETRY_BACKOFF: Duration = Duration::from_millis(50);

/// Invocations whose handler failed (an error, a panic, a timeout), kept from new starts by
/// this worker for a pause that doubles with every failure in a row, from
/// [`MIN_RETRY_BACKOFF`] up to the worker's idle backoff. Without it a failing invocation that
/// is due is pulled again at once, and a handler that always fails runs in a tight loop.
/// Executor state only: another worker (or this one after a restart) may run it sooner.
#[derive(Debug, Default)]
pub struct Cooling {
    keys: HashMap<String, (Instant, u32)>,
}

impl Cooling {
    /// Records a failure of `key`'s handler.
    pub fn failed(&mut self, key: &str, cap: Duration) {
        let now = Instant::now();
        let entry = self.keys.entry(key.to_string()).or_insert((now, 0));
        entry.1 = entry.1.saturating_add(1);
        let pause = MIN_RETRY_BACKOFF
            .saturating_mul(1 << (entry.1 - 1).min(16))
            .min(cap.max(MIN_RETRY_BACKOFF));
        entry.0 = now + pause;
    }

    /// Forgets `key` (its outcome was applied).
    pub fn settled(&mut self, key: &str) {
        self.keys.remove(key);
    }

    /// How many invocations are remembered.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether `key` may not start yet.
    pub fn holds(&self, key: &str, now: Instant) -> bool {
        self.keys.get(key).is_some_and(|(until, _)| *until > now)
    }

    /// Forgets keys whose pause ended more than `cap` ago (they completed elsewhere, or will
    /// fail again and start over from the shortest pause).
    pub fn prune(&mut self, cap: Duration) {
        if self.keys.is_empty() {
            return;
        }
        let now = Instant::now();
        self.keys.retain(|_, (until, _)| *until + cap > now);
    }
}
