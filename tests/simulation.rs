//! Deterministic simulation: one `u64` seed drives the workload, the faults and the schedule on
//! the in-memory engine, inside a current-thread runtime with paused time; invariants are
//! checked as it runs and after every worker drained.
//!
//! - One seed: `TITO_SIM_SEED=42 cargo test --test tito simulation::replay -- --nocapture`
//!   (`TITO_SIM_STEPS` shortens the run to find the shortest failing prefix; `TITO_SIM_TRACE=1`
//!   prints each step as it starts and ends, which shows where a run hangs).
//! - Many seeds: `TITO_SIM_SEEDS=10000 cargo test --release --test tito simulation::many --
//!   --ignored --nocapture`.
//!
//! The workload: publishers (alone, with owners, in a model write's transaction, due later, the
//! same event id twice), standalone workers starting, stopping cleanly, crashing (task aborted,
//! nothing released) and restarting over overlapping partitions, handlers that succeed, fail,
//! panic, time out, reschedule, always fail (cluster nodes run a failure policy: attempts,
//! backoff, a dead state) or run longer than their lease; kv increments; model writes
//! racing on a unique index; model writes (which publish their declared events) in callers'
//! transactions that catch the write's error and commit anyway; faults from `FaultyEngine` (conflicts, unknown commit outcomes
//! applied or not, storage errors, delays); time moving in jumps; crash loops of the store's
//! clock (restarting from its persisted mark up to four times in a row, as PD's timestamp
//! oracle does after a leader change: its lead over the wall clock stays bounded, and no event
//! starts before its due time, or before its delay less what the clock jumped meanwhile); store
//! moves of the store as it stands (copies and migrations at random batches, 1 included, with
//! runs of skipped keys planted, kills, catch-ups and overwrites), checked key by key by an
//! oracle of its own.
//!
//! Determinism: the seed is the only source of randomness (the engine's clock is the runtime's,
//! retries jitter from the seed, event ids are chosen by the workload, every select in the
//! runtime is biased), so a seed's trace hash repeats exactly.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::Hasher;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tito::backend::memory::{Memory, MemoryClock, MemoryOptions};
use tito::engine::{Fault, FaultPoint, FaultRule, FaultyEngine};
use tito::inbox::{Inbox, InboxClaim, InboxClock, InboxConfig, InboxOutcome};
use tito::kv::Kv;
use tito::model::{TitoOperation, TitoOptions};
use tito::queue::graph::{
    Batch, BatchCallback, BatchCounts, BatchDone, Graphs, OnFailure, StepName, Workflow,
};
use tito::queue::{Finished, InvocationState};

const OPERATIONS: [TitoOperation; 4] = [
    TitoOperation::Insert,
    TitoOperation::Update,
    TitoOperation::Upsert,
    TitoOperation::Delete,
];
use tito::queue::{ClusterConfig, cluster_state, run_cluster_worker, run_worker};
use tito::{
    Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, QueueOwner, RetryPolicy, TitoEngine,
    TitoError, TitoModel, TitoTransaction, WorkerConfig,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::support::pending_total;

/// 2023-11-14T22:13:20Z: the simulated clock's start.
const EPOCH_MS: u64 = 1_700_000_000_000;
const PARTITIONS: u32 = 4;
const LEASE: Duration = Duration::from_millis(300);
const HANDLER_TIMEOUT: Duration = Duration::from_secs(1);
const WORKER_SLOTS: usize = 3;
const NODE_SLOTS: usize = 3;
const NODE_TTL: Duration = Duration::from_millis(600);
/// The queue the cluster nodes run (the standalone workers run the default one).
const CLUSTER_TOPIC: &str = "c";
/// The queue periodic runners publish their ticks to (no worker: the ticks stay pending and
/// are checked at the end).
const PERIODIC_TOPIC: &str = "ticks";
/// Periodic runners that may run at once.
const TICKER_SLOTS: usize = 2;

/// The one source of randomness: splitmix64 from the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Behaviour {
    Succeed,
    FailOnce,
    PanicOnce,
    SlowerThanLease,
    TimeOutOnce,
    RescheduleOnce,
    /// Advances to a second step (a new payload whose behaviour is `Succeed`) at its first run.
    AdvanceOnce,
    /// Fails every attempt (published to the cluster queue only, whose nodes have a failure
    /// policy): dead after exactly [`MAX_ATTEMPTS`] attempts.
    AlwaysFail,
}

/// The cluster nodes' failure policy: attempts before the dead state.
const MAX_ATTEMPTS: u32 = 3;

fn failure_policy() -> tito::queue::FailurePolicy {
    tito::queue::FailurePolicy::new(MAX_ATTEMPTS)
        .backoff(Duration::from_millis(100), Duration::from_millis(400))
        .jitter_seed(0x5eed)
}

const BEHAVIOURS: [Behaviour; 7] = [
    Behaviour::Succeed,
    Behaviour::FailOnce,
    Behaviour::PanicOnce,
    Behaviour::SlowerThanLease,
    Behaviour::TimeOutOnce,
    Behaviour::RescheduleOnce,
    Behaviour::AdvanceOnce,
];

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Job {
    n: u32,
    behaviour: Behaviour,
    /// The first invocation's due time: a `RescheduleOnce` replacement is due one second later.
    first_due: i64,
}

/// A model written in the same transactions as some publications, racing on a unique handle
/// whose index holds keys, not copies.
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(table = "sim_account")]
#[tito(unique_index = "by_handle: handle", entries = "keys")]
struct Account {
    id: String,
    handle: String,
}

/// A model with two unique indexes and an index of copies, written in callers' transactions
/// that catch the write's error (a value taken, a missing or existing row, an injected storage
/// error, an operation stated wrongly) and commit their other writes anyway. Every write
/// publishes its event (no worker takes them: the queue is the writes' history).
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(table = "sim_profile")]
#[tito(event = "sim_profile")]
#[tito(unique_index = "by_email: email")]
#[tito(unique_index = "by_nick: nick")]
#[tito(index = "by_team: team")]
struct Profile {
    id: String,
    email: String,
    nick: String,
    team: String,
}

/// A model that changes shape mid-run: the first code (version 1, a name in one field) and the
/// next (version 2, the name split, with a downgrade for the rolling deploy) write the same
/// rows at once; an operator allows version 2 and rolls it back; rewrites run by step and in
/// the workers' maintenance. Names always hold one space, so both shapes hold the same value.
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(table = "sim_shape")]
#[tito(index = "shape_by_team: team")]
struct ShapeOld {
    id: String,
    team: String,
    name: String,
}

#[derive(tito::TitoShape, Serialize, Deserialize)]
#[tito(version = 1)]
struct ShapeV1 {
    id: String,
    team: String,
    name: String,
}

#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(
    table = "sim_shape",
    version = 2,
    from = "ShapeV1",
    upgrade = "shape_split",
    downgrade = "shape_join"
)]
#[tito(index = "shape_by_team: team")]
struct ShapeNew {
    id: String,
    team: String,
    first: String,
    last: String,
}

fn shape_split(v1: ShapeV1) -> Result<ShapeNew, String> {
    let (first, last) = v1.name.split_once(' ').ok_or("no space")?;
    Ok(ShapeNew {
        id: v1.id,
        team: v1.team,
        first: first.into(),
        last: last.into(),
    })
}

fn shape_join(new: &ShapeNew) -> ShapeV1 {
    ShapeV1 {
        id: new.id.clone(),
        team: new.team.clone(),
        name: format!("{} {}", new.first, new.last),
    }
}

/// What the shape step knows: each row's possible values (a name, or gone), and whether
/// version 2 was ever allowed (then the first code reads every row again only once a rewrite
/// back to version 1 finished). Every change of the allowed version is the step's own, which
/// reads the catalog first: a table the next code created allows version 2 from the start, and
/// that is seen before any rollback.
#[derive(Default)]
struct ShapeSim {
    expected: BTreeMap<String, BTreeSet<Option<String>>>,
    ever_two: bool,
    rewrites_finished: u32,
    checked_rows: u64,
}

/// An inbox row: no `locked_until` role (the lease lives in its own key), attempts counted,
/// dead letters to group "dead".
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(inbox)]
#[tito(table = "sim_task")]
struct SimTask {
    id: String,
    #[tito(group)]
    group: String,
    #[tito(priority)]
    priority: i64,
    #[tito(retry_after)]
    retry_after: i64,
    #[tito(attempt)]
    attempt: i64,
    #[tito(processed_at)]
    processed_at: Option<i64>,
}

/// What the handlers saw, shared with the checker.
#[derive(Default)]
struct Tracker {
    /// Handler starts per event.
    runs: BTreeMap<u32, u32>,
    /// The attempt number each start of an event was given (`QueueEvent::attempt`).
    attempts: BTreeMap<u32, Vec<u32>>,
    /// Runs in progress per event.
    running: BTreeMap<u32, u32>,
    /// Times a run started while another run of the same event was in progress.
    overlaps: u32,
    /// Who runs each event now, and what each overlap was.
    holders: BTreeMap<u32, Vec<(String, u128)>>,
    /// When the last clock jump ended: a jump longer than a lease makes every holder miss its
    /// renewal, so a run that started before it has no live holder after it.
    last_jump: Option<u128>,
    /// Overlaps whose earlier run lost its holder to a clock jump (allowed, counted).
    excused: u32,
    details: Vec<String>,
    /// Every run's start and end, with the simulated time (printed by `replay`).
    log: Vec<String>,
    /// When the simulation started.
    start: Option<tokio::time::Instant>,
    /// Pauses in force (`None`: the queue; a partition) and the simulated time their commit
    /// was known; a pause whose commit's outcome was not known is not counted.
    paused: BTreeMap<Option<u32>, u128>,
    /// Starts in a partition paused for longer than `PAUSE_CHECK`.
    pause_violations: Vec<String>,
    /// Events whose cancel committed, with the simulated time it was known.
    cancelled: BTreeMap<u32, u128>,
    /// The limits set on the queue, and the simulated time every worker has seen them by
    /// (their commit known, plus `PAUSE_CHECK`).
    limits: Option<(tito::queue::Limits, u128)>,
    /// Runs started under the limits and still running: (event, key, start, who).
    limited: Vec<(u32, String, u128, String)>,
    /// A rate limit was set, or may have been (an unknown outcome).
    rated: bool,
    /// Start times of runs under the limits, per key and in all (for the rates).
    limited_starts: Vec<(u128, String)>,
    /// Starts past a limit (more running, or more starts in an interval, than it allows).
    limit_violations: Vec<String>,
    /// Starts past a limit while a run that began before the last clock jump was running
    /// (its worker's heartbeat expired in the jump: allowed, counted).
    limit_excused: u32,
    /// When limits were last lifted (the priority check waits a while after).
    limits_lifted: Option<u128>,
    /// Events published (certainly) and not started yet: partition, ordering time (due time
    /// less the priority's boost, as the queue orders rows), own due time (s), when published.
    waiting: BTreeMap<u32, (u32, u64, i64, u128)>,
    /// Starts of a lower-priority row while a higher-priority row of the same partition had
    /// been due and visible for longer than a pull (with no limit or pause in force).
    priority_violations: Vec<String>,
    /// Starts checked against the priority order.
    priority_checks: u64,
    /// The store itself (beneath the faults), to read its clock from a handler.
    store: Option<Memory>,
    /// Print each start as it happens (`TITO_SIM_TRACE=1`).
    live_trace: bool,
    /// When the store's clock last jumped ahead (simulated ms).
    store_jump: Option<u128>,
    /// How far crashes of the store's process moved its clock ahead, in all (ms).
    store_jumps_ms: u128,
    /// Events published with a delay relative to their publication and not started yet: when
    /// published (simulated ms), the delay (ms), and `store_jumps_ms` then.
    delayed: BTreeMap<u32, (u128, u64, u128)>,
}

/// How far ahead of the wall clock the store's clock may be, after any number of crashes of its
/// process in a row: the oracle's window (three seconds), and a margin for the logical steps a
/// crash while the clock is ahead may add (a quarter of a millisecond each).
const CLOCK_LEAD_BOUND_MS: u64 = 3_100;

/// How long a higher-priority row may be passed over after it became due and visible: a pass
/// starts over at least every `MAX_PASS_AGE` (1 s), plus a pull and the idle backoff.
const PRIORITY_GRACE_MS: u128 = 1500;

/// The queue's ordering time of a row: its due time less a minute per step of priority, due
/// times in the first nine minutes after the epoch counted as the end of them.
fn ordered_at(due: i64, priority: u8) -> u64 {
    (due.max(0) as u64).max(540) - u64::from(priority) * 60
}

impl Tracker {
    fn new(start: tokio::time::Instant, store: Memory) -> Arc<Mutex<Tracker>> {
        Arc::new(Mutex::new(Tracker {
            start: Some(start),
            store: Some(store),
            live_trace: std::env::var_os("TITO_SIM_TRACE").is_some(),
            ..Tracker::default()
        }))
    }

    fn now(&self) -> u128 {
        self.start.map_or(0, sim_ms)
    }
}

/// A result, shortly, for the trace.
fn short<T: std::fmt::Debug>(result: &Result<T, TitoError>) -> String {
    match result {
        Ok(value) => format!("{value:?}"),
        Err(err) => error_kind(err).to_string(),
    }
}

/// Milliseconds of simulated time since the simulation started.
fn sim_ms(start: tokio::time::Instant) -> u128 {
    start.elapsed().as_millis()
}

/// Ends a run in the tracker however the handler ends (returns, panics, is cancelled).
struct Live(Arc<Mutex<Tracker>>, u32, String);

impl Drop for Live {
    fn drop(&mut self) {
        let mut tracker = self.0.lock().unwrap();
        let (n, who) = (self.1, self.2.clone());
        tracker
            .limited
            .retain(|(e, _, _, w)| !(*e == n && *w == who));
        if let Some(live) = tracker.running.get_mut(&self.1) {
            *live -= 1;
        }
        let line = format!("{} end {} on {}", tracker.now(), self.1, self.2);
        tracker.log.push(line);
        if let Some(holders) = tracker.holders.get_mut(&self.1)
            && let Some(at) = holders.iter().position(|(h, _)| *h == self.2)
        {
            holders.remove(at);
        }
    }
}

type Db = FaultyEngine<Memory>;

/// A start under the limits: counted, and checked against them (concurrency at this instant;
/// rates over the interval before it, less a 50 ms margin for the time between the gate's
/// admission and the handler's start).
fn limit_check(
    t: &mut Tracker,
    limits: &tito::queue::Limits,
    since: u128,
    n: u32,
    key: &str,
    who: &str,
) {
    let now = t.now();
    t.limited.push((n, key.to_string(), now, who.to_string()));
    t.limited_starts.push((now, key.to_string()));
    let total = t.limited.len() as u32;
    let of_key = t.limited.iter().filter(|(_, k, _, _)| k == key).count() as u32;
    let mut past = Vec::new();
    if let Some(limit) = limits.concurrency.filter(|limit| total > *limit) {
        past.push(format!("{total} running, queue limit {limit}"));
    }
    if let Some(limit) = limits.key_concurrency.filter(|limit| of_key > *limit) {
        past.push(format!("{of_key} running for {key}, key limit {limit}"));
    }
    for (rate, per_key) in [(limits.rate, false), (limits.key_rate, true)] {
        let Some(rate) = rate else { continue };
        let window = rate.per.as_millis().saturating_sub(50);
        let count = t
            .limited_starts
            .iter()
            .filter(|(at, k)| *at + window > now && *at >= since && (!per_key || k == key))
            .count() as u32;
        // Rates are kept on the store's clock: a jump of it within the window squeezes starts.
        let squeezed = t
            .store_jump
            .is_some_and(|at| at + rate.per.as_millis() > now);
        if count > rate.starts && squeezed {
            t.limit_excused += 1;
        } else if count > rate.starts {
            past.push(format!(
                "{count} starts within {window} ms, rate {rate:?} (per key: {per_key})"
            ));
        }
    }
    if past.is_empty() {
        return;
    }
    let jumped = t
        .last_jump
        .is_some_and(|jump| t.limited.iter().any(|(_, _, started, _)| *started < jump));
    if jumped {
        t.limit_excused += 1;
    } else {
        let line = format!("event {n} started on {who} at {now}: {}", past.join("; "));
        t.limit_violations.push(line);
    }
}

fn handler(
    tracker: Arc<Mutex<Tracker>>,
    who: String,
) -> impl Fn(QueueEvent<Job>) -> futures::future::BoxFuture<'static, tito::QueueHandlerResult<Job>>
+ Send
+ Sync
+ 'static {
    move |event: QueueEvent<Job>| {
        let (tracker, who) = (tracker.clone(), who.clone());
        Box::pin(async move {
            let n = event.payload.n;
            // The store's clock, read after the worker's pull (so no earlier than its time).
            let store = tracker.lock().unwrap().store.clone();
            let store_ms = match store {
                Some(store) => Some(u128::from(tito::engine::version_millis(
                    store.current_version().await.unwrap(),
                ))),
                None => None,
            };
            let attempt = {
                let mut t = tracker.lock().unwrap();
                t.attempts.entry(n).or_default().push(event.attempt);
                let runs = t.runs.entry(n).or_default();
                *runs += 1;
                let attempt = *runs;
                let live = t.running.entry(n).or_default();
                *live += 1;
                let overlapping = *live > 1;
                let line = format!(
                    "{} start {n} ({:?}) on {who}",
                    t.now(),
                    event.payload.behaviour
                );
                if t.live_trace {
                    eprintln!(
                        "{line} (timestamp {}, store {store_ms:?} ms)",
                        event.timestamp
                    );
                }
                t.log.push(line);
                let (last_jump, now) = (t.last_jump, t.now());
                let partition = tito::queue::partition_for(&event.key, PARTITIONS);
                let check_ms = tito::queue::PAUSE_CHECK.as_millis();
                let late: Vec<String> = t
                    .paused
                    .iter()
                    .filter(|(scope, since)| {
                        scope.is_none_or(|p| p == partition) && now > *since + check_ms
                    })
                    .map(|(scope, since)| {
                        format!(
                            "event {n} started on {who} at {now} in partition {partition}, \
                             paused ({scope:?}) since {since}"
                        )
                    })
                    .collect();
                t.pause_violations.extend(late);
                // Never before its due time, whatever its priority, on the store's clock (ahead
                // of the runtime's after crashes of the store's process).
                let engine_ms = store_ms.unwrap_or(u128::from(EPOCH_MS) + now);
                if engine_ms < event.timestamp as u128 * 1000 {
                    let line = format!(
                        "event {n} (priority {}) started on {who} at {engine_ms} ms, due at {} s",
                        event.urgency, event.timestamp
                    );
                    t.limit_violations.push(line);
                }
                // An event published with a delay starts no sooner than that delay after its
                // publication on the wall clock, less what crashes of the store's process moved
                // the store's clock ahead meanwhile (as a leader change moves PD's).
                if let Some((published, delay, jumps)) = t.delayed.remove(&n) {
                    let allowed = u128::from(delay).saturating_sub(t.store_jumps_ms - jumps);
                    if now < published + allowed {
                        let line = format!(
                            "event {n} published at {published} ms with a delay of {delay} ms \
                             started at {now} ms (clock jumps since: {} ms)",
                            t.store_jumps_ms - jumps
                        );
                        t.limit_violations.push(line);
                    }
                }
                if let Some((limits, since)) = t.limits.clone().filter(|(_, since)| now > *since) {
                    limit_check(&mut t, &limits, since, n, &event.key, &who);
                }
                if let Some((partition, key, _, _)) = t.waiting.remove(&n) {
                    // The first start of an event: no row of its partition that sorts before
                    // it was due and visible for longer than a pull, unless a limit, a pause or
                    // a clock jump was in force.
                    let quiet = t.limits.is_none()
                        && t.limits_lifted
                            .is_none_or(|at| at + PRIORITY_GRACE_MS < now)
                        && t.last_jump
                            .is_none_or(|jump| jump + PRIORITY_GRACE_MS < now)
                        && !t
                            .paused
                            .keys()
                            .any(|scope| scope.is_none_or(|p| p == partition));
                    if quiet {
                        t.priority_checks += 1;
                        let passed_over: Vec<String> = t
                            .waiting
                            .iter()
                            .filter(|(_, (p, k, due, published))| {
                                *p == partition
                                    && *k < key
                                    && published + PRIORITY_GRACE_MS < now
                                    && (*due as u128) * 1000 + PRIORITY_GRACE_MS < engine_ms
                            })
                            .map(|(m, (_, k, due, published))| {
                                format!("event {m} (ordered at {k}, due {due}, published at {published})")
                            })
                            .collect();
                        if !passed_over.is_empty() {
                            let line = format!(
                                "event {n} (ordered at {key}, priority {}) started on {who} at \
                                 {now} in partition {partition} before {passed_over:?}",
                                event.urgency
                            );
                            t.priority_violations.push(line);
                        }
                    }
                }
                if let Some(since) = t.cancelled.get(&n).filter(|since| now > **since) {
                    let line = format!("event {n} started on {who} at {now}, cancelled at {since}");
                    t.pause_violations.push(line);
                }
                let holders = t.holders.entry(n).or_default();
                let excused = holders
                    .iter()
                    .all(|(_, started)| last_jump.is_some_and(|jump| *started < jump));
                holders.push((who.clone(), now));
                if overlapping && excused {
                    t.excused += 1;
                } else if overlapping {
                    let detail = format!(
                        "event {n} started on {who} at {:?} while running on {:?}",
                        tokio::time::Instant::now(),
                        holders
                    );
                    t.details.push(detail);
                    t.overlaps += 1;
                }
                attempt
            };
            let _live = Live(tracker.clone(), n, who.clone());
            match event.payload.behaviour {
                Behaviour::AlwaysFail if attempt % 2 == 0 => {
                    // The handler's own NotFound (the row it names is gone) counts like any
                    // other error: still dead after exactly MAX_ATTEMPTS attempts.
                    return Err(TitoError::NotFound("the row it names is gone".into()));
                }
                Behaviour::AlwaysFail => {
                    return Err(TitoError::handler("fails at every attempt"));
                }
                Behaviour::FailOnce if attempt == 1 => {
                    return Err(TitoError::handler("fails at its first attempt"));
                }
                Behaviour::PanicOnce if attempt == 1 => {
                    // Unwinds like a panic, without the panic hook's output.
                    std::panic::resume_unwind(Box::new("panics at its first attempt"));
                }
                Behaviour::SlowerThanLease => tokio::time::sleep(LEASE * 2 + LEASE / 3).await,
                Behaviour::TimeOutOnce if attempt == 1 => {
                    tokio::time::sleep(HANDLER_TIMEOUT * 2).await
                }
                Behaviour::AdvanceOnce => {
                    let due = event.timestamp;
                    let step = Job {
                        behaviour: Behaviour::Succeed,
                        ..event.payload.clone()
                    };
                    return Ok(QueueHandlerOutcome::Advance(event.advanced(step, due)));
                }
                Behaviour::RescheduleOnce if event.timestamp == event.payload.first_due => {
                    let at = event.timestamp + 1;
                    return Ok(QueueHandlerOutcome::Reschedule(event.rescheduled(at)));
                }
                _ => {}
            }
            Ok(QueueHandlerOutcome::Acknowledge)
        })
    }
}

struct Worker {
    stop: watch::Sender<bool>,
    task: JoinHandle<tito::TitoResult<()>>,
}

/// How a started worker commits its outcomes: a window (zero half the time, else up to 90 ms,
/// under a third of the shortest lease) and a batch bound.
#[derive(Clone, Copy, Debug)]
struct Window {
    delay: Duration,
    batch: usize,
}

impl Window {
    const NONE: Window = Window {
        delay: Duration::ZERO,
        batch: 64,
    };

    fn pick(rng: &mut Rng) -> Window {
        if rng.chance(50) {
            return Window::NONE;
        }
        Window {
            delay: Duration::from_millis(1 + rng.below(90)),
            batch: 1 + rng.below(8) as usize,
        }
    }
}

fn start_node(
    queue: &Arc<Queue<Db>>,
    tracker: &Arc<Mutex<Tracker>>,
    id: String,
    window: Window,
) -> Worker {
    let (stop, rx) = watch::channel(false);
    let config = WorkerConfig::new(0..PARTITIONS)
        .outcome_delay(window.delay)
        .outcome_batch(window.batch)
        .handler_timeout(HANDLER_TIMEOUT)
        .max_idle_backoff(Duration::from_millis(50))
        .concurrency(4)
        .failure_policy(failure_policy());
    let cluster = ClusterConfig::new()
        .node_id(id.clone())
        .node_ttl(NODE_TTL)
        .coordinator_ttl(NODE_TTL)
        .drop_after(NODE_TTL);
    let task = tokio::spawn(run_cluster_worker(
        queue.clone(),
        config,
        cluster,
        handler(tracker.clone(), id),
        rx,
    ));
    Worker { stop, task }
}

fn start_worker(
    queue: &Arc<Queue<Db>>,
    tracker: &Arc<Mutex<Tracker>>,
    id: String,
    window: Window,
) -> Worker {
    let (stop, rx) = watch::channel(false);
    let config = WorkerConfig::new(0..PARTITIONS)
        .outcome_delay(window.delay)
        .outcome_batch(window.batch)
        .lease_duration(LEASE)
        .handler_timeout(HANDLER_TIMEOUT)
        .max_idle_backoff(Duration::from_millis(50))
        .concurrency(4)
        .worker_id(id.clone());
    let task = tokio::spawn(run_worker(
        queue.clone(),
        config,
        handler(tracker.clone(), id),
        rx,
    ));
    Worker { stop, task }
}

/// Whether an event id's publication is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Publication {
    /// Committed.
    Certain,
    /// The commit's outcome is unknown.
    Maybe,
}

/// What one seed did and found.
#[derive(Debug)]
pub struct Report {
    pub seed: u64,
    pub steps: u32,
    pub trace_hash: u64,
    pub checks: u64,
    pub faults: u64,
    pub published: usize,
    pub handler_runs: u32,
    /// Invocations a failure policy moved to the dead state.
    pub dead: usize,
    /// Handler starts under limits (each checked against them), and those excused by a clock
    /// jump.
    pub limited_starts: usize,
    pub limit_excused: u32,
    /// Periodic ticks published (each checked once).
    pub ticks: usize,
    /// First starts checked against the priority order.
    pub priority_checks: u64,
    /// Rows of the model that changes shape read and checked, and rewrite runs the steps
    /// finished.
    pub shape_rows: u64,
    pub shape_rewrites: u32,
    pub violations: Vec<String>,
    pub trace: Vec<String>,
    pub log: Vec<String>,
}

/// One queue of the simulation and what was published to it.
struct SimQueue {
    queue: Arc<Queue<Db>>,
    tracker: Arc<Mutex<Tracker>>,
    /// Event id -> (its job, what is known of its publication).
    events: BTreeMap<String, (Job, Publication)>,
    /// Event id -> whether its cancel is known to have committed (`false`: unknown outcome).
    cancels: BTreeMap<String, bool>,
}

/// A claim an inbox claimer holds, with a lower bound of its lease's end (engine ms).
struct Held {
    claimer: u64,
    claim: InboxClaim,
    id: String,
    until_ms: u64,
}

struct Sim {
    rng: Rng,
    start: tokio::time::Instant,
    db: Db,
    /// 0: the standalone workers' queue; 1: the cluster's.
    queues: [SimQueue; 2],
    kv: Kv<Db>,
    inbox: Inbox<Db, SimTask>,
    workers: Vec<Option<Worker>>,
    nodes: Vec<Option<Worker>>,
    generation: u32,
    trace: Vec<String>,
    checks: u64,
    violations: Vec<String>,
    next_event: u32,
    increments: (u64, u64),
    /// The versions of successful compare-and-sets, in order.
    cas_versions: Vec<u64>,
    cas_unknown: usize,
    /// Profile writes with events switched off (the profiles' history skips them).
    silent_profile_writes: usize,
    /// Dead invocations found by the final checks.
    dead: usize,
    tasks: u32,
    held: Vec<Held>,
    /// Rows whose `Drop` outcome applied (deleted).
    dropped: BTreeSet<String>,
    /// The queue the periodic runners publish to, and the runners.
    ticks: Arc<Queue<Db>>,
    tickers: Vec<Option<Worker>>,
    /// When the first runner started (engine seconds): no tick may be older.
    first_ticker: Option<i64>,
    /// Ticks found at the end.
    periodic_ticks: usize,
    /// Starts checked against the priority order.
    priority_checks: u64,
    shapes: ShapeSim,
    /// Print each step as it starts and ends (`TITO_SIM_TRACE=1`, with `replay`).
    live_trace: bool,
    /// Workflows and batches, with a random stream of their own.
    graphs: GraphSim,
    /// Store moves (copies and migrations of snapshots), with a random stream of their own.
    moves: MoveSim,
}

fn inbox_config() -> InboxConfig<Db, SimTask> {
    InboxConfig::new("g")
        .lease(LEASE)
        .max_attempts(3)
        .clock(InboxClock::Engine)
        .dead_letter(tito::inbox::DeadLetter::Group("dead".into()))
}

impl Sim {
    fn check(&mut self, holds: bool, what: impl FnOnce() -> String) {
        self.checks += 1;
        if !holds {
            self.violations.push(what());
        }
    }

    async fn now_secs(&self) -> i64 {
        let version = self.db.inner().current_version().await.unwrap();
        (tito::engine::version_millis(version) / 1000) as i64
    }

    async fn publish(&mut self, step: u32) -> String {
        let which = self.rng.below(2) as usize;
        let (n, again) = match self.queues[which].events.keys().last().cloned() {
            Some(last) if self.rng.chance(15) => (self.queues[which].events[&last].0.n, Some(last)),
            _ => {
                self.next_event += 1;
                (self.next_event, None)
            }
        };
        let id = again.clone().unwrap_or_else(|| format!("e{n:05}"));
        let mut relative = None;
        let job = match &again {
            Some(id) => self.queues[which].events[id].0.clone(),
            None => {
                let later = if self.rng.chance(20) {
                    1 + self.rng.below(3) as i64
                } else {
                    0
                };
                let mut pick = BEHAVIOURS[self.rng.below(BEHAVIOURS.len() as u64) as usize];
                // Half the delayed events count their delay from their publication (in ms).
                if later > 0 && self.rng.chance(50) {
                    relative = Some(1 + self.rng.below(later as u64 * 1000));
                    // Its due time is settled at publication: no first due time to compare.
                    if pick == Behaviour::RescheduleOnce {
                        pick = Behaviour::Succeed;
                    }
                }
                let always_fail = which == 1 && self.rng.chance(10);
                Job {
                    n,
                    behaviour: if always_fail {
                        Behaviour::AlwaysFail
                    } else {
                        pick
                    },
                    first_due: self.now_secs().await + later,
                }
            }
        };
        // Now and then a business key far longer than any derived key may be (slots, rate
        // logs): it must run like any other.
        let key = if self.rng.chance(5) {
            format!("key-{}-{}", n % 7, "k".repeat(5000))
        } else {
            format!("key-{}", n % 7)
        };
        // Recorded once this publication is known to have written the row (an id whose first
        // publication failed may be published again with its absolute due time).
        let mut delayed = None;
        let mut event = match relative {
            Some(delay_ms) => {
                let tracker = self.queues[which].tracker.lock().unwrap();
                delayed = Some((tracker.now(), delay_ms, tracker.store_jumps_ms));
                QueueEvent::after(key, job.clone(), Duration::from_millis(delay_ms))
            }
            None => QueueEvent::new(key, job.clone(), job.first_due),
        }
        .with_id(id.clone());
        if self.rng.chance(25) {
            event = event.with_owner(QueueOwner::new("account", format!("a{}", n % 5)));
        }
        if self.rng.chance(30) {
            event = event.with_urgency(self.rng.below(10) as u8);
        }
        let order = (
            tito::queue::partition_for(&event.key, PARTITIONS),
            ordered_at(event.timestamp, event.urgency),
            event.timestamp,
        );
        let with_model = self.rng.chance(30);
        let result = if with_model {
            let (queue, accounts) = (
                self.queues[which].queue.clone(),
                self.db.clone().model::<Account>(),
            );
            let account = Account {
                id: format!("pub-{n}"),
                handle: format!("h{}", self.rng.below(6)),
            };
            self.db
                .transaction(|tx| {
                    let (queue, accounts, account, event) = (
                        queue.clone(),
                        accounts.clone(),
                        account.clone(),
                        event.clone(),
                    );
                    async move {
                        accounts
                            .upsert_with_options(account, TitoOptions::default(), &tx)
                            .await?;
                        queue.publish_in_tx(&event, &tx).await
                    }
                })
                .await
        } else {
            self.queues[which].queue.publish(event).await
        };
        let outcome = match &result {
            Ok(published) => {
                let known = self.queues[which].events.get(&id).map(|(_, p)| *p);
                // Whatever was known, the id's publication is now certain.
                self.queues[which]
                    .events
                    .insert(id.clone(), (job, Publication::Certain));
                let duplicate = published.duplicate;
                {
                    let mut tracker = self.queues[which].tracker.lock().unwrap();
                    if let Some(entry) = delayed.filter(|_| !duplicate) {
                        tracker.delayed.insert(n, entry);
                    }
                    // (An event due after a delay is left out: its due time is settled at its
                    // publication, on the store's clock, and `timestamp` is this host's guess.)
                    if !duplicate
                        && known.is_none()
                        && relative.is_none()
                        && !tracker.runs.contains_key(&n)
                    {
                        let now = tracker.now();
                        tracker.waiting.insert(n, (order.0, order.1, order.2, now));
                    }
                }
                if known == Some(Publication::Certain) {
                    self.check(duplicate, || {
                        format!("step {step}: {id} published twice while live")
                    });
                }
                if duplicate { "duplicate" } else { "new" }.to_string()
            }
            Err(TitoError::CommitOutcomeUnknown { .. }) => {
                self.queues[which]
                    .events
                    .entry(id.clone())
                    .or_insert((job, Publication::Maybe));
                "unknown".to_string()
            }
            Err(err) => error_kind(err),
        };
        let delay = relative
            .map(|ms| format!(" after {ms}ms"))
            .unwrap_or_default();
        format!("publish q{which} {id}{delay} model={with_model} {outcome}")
    }

    async fn stop_worker(&mut self, slot: usize, node: bool) -> String {
        let taken = if node {
            self.nodes[slot].take()
        } else {
            self.workers[slot].take()
        };
        let Some(worker) = taken else {
            return "stop none".into();
        };
        worker.stop.send(true).ok();
        let joined = tokio::time::timeout(HANDLER_TIMEOUT * 20, worker.task).await;
        let ok = matches!(joined, Ok(Ok(Ok(()))));
        self.check(ok, || {
            format!("worker {slot} (node: {node}) did not stop cleanly: {joined:?}")
        });
        format!("stop {}{slot} {ok}", if node { "n" } else { "w" })
    }

    /// How far the store's clock is ahead of the simulated wall clock (ms).
    async fn store_lead_ms(&self) -> u64 {
        let wall = EPOCH_MS + sim_ms(self.start) as u64;
        self.now_ms().await.saturating_sub(wall)
    }

    async fn now_ms(&self) -> u64 {
        tito::engine::version_millis(self.db.inner().current_version().await.unwrap())
    }

    async fn add_task(&mut self) -> String {
        self.tasks += 1;
        let task = SimTask {
            id: format!("t{:04}", self.tasks),
            group: "g".into(),
            priority: self.rng.below(3) as i64,
            ..SimTask::default()
        };
        match self.db.clone().model::<SimTask>().build(task).await {
            Ok(_) => format!("task t{:04}", self.tasks),
            Err(err) => format!("task t{:04} {}", self.tasks, error_kind(&err)),
        }
    }

    async fn claim(&mut self, step: u32) -> String {
        let claimer = self.rng.below(2);
        let config = inbox_config();
        // The claim's lease runs from its transaction's start, somewhere between these two.
        let before = self.now_ms().await;
        let claimed = match self.inbox.claim::<serde_json::Value>(&config, 2).await {
            Ok(claimed) => claimed,
            Err(err) => return format!("claim c{claimer} {}", error_kind(&err)),
        };
        let now = self.now_ms().await;
        let mut ids = Vec::new();
        for (claim, delivery) in claimed {
            let live_elsewhere = self
                .held
                .iter()
                .any(|h| h.id == delivery.id && h.until_ms > now);
            // (`until_ms` is a lower bound of the earlier lease's end and `now` an upper bound of
            // this claim's start: a hit is a certain overlap.)
            self.check(!live_elsewhere, || {
                format!(
                    "step {step}: row {} handed to a second live claim",
                    delivery.id
                )
            });
            ids.push(delivery.id.clone());
            self.held.push(Held {
                claimer,
                claim,
                id: delivery.id,
                until_ms: before + LEASE.as_millis() as u64,
            });
        }
        format!("claim c{claimer} {ids:?}")
    }

    async fn complete(&mut self) -> String {
        if self.held.is_empty() {
            return "complete none".into();
        }
        let held = self
            .held
            .remove(self.rng.below(self.held.len() as u64) as usize);
        let outcome = match self.rng.below(4) {
            0 => InboxOutcome::Ack,
            1 => InboxOutcome::Retry,
            2 => InboxOutcome::RetryAfter(Duration::from_millis(self.rng.below(500))),
            _ => InboxOutcome::Drop,
        };
        let result = self
            .inbox
            .complete(&inbox_config(), &held.claim, outcome)
            .await;
        if matches!(result, Ok(true)) && outcome == InboxOutcome::Drop {
            self.dropped.insert(held.id.clone());
        }
        let result = match result {
            Ok(applied) => applied.to_string(),
            Err(err) => error_kind(&err),
        };
        format!(
            "complete c{} {} {outcome:?} {result}",
            held.claimer, held.id
        )
    }

    async fn compare_and_set(&mut self) -> String {
        let current = match self.kv.get("sim", "cas").await {
            Ok(current) => current,
            Err(err) => return format!("cas read {}", error_kind(&err)),
        };
        let expected = current.as_ref().map_or(0, |e| e.version);
        let next = current
            .and_then(|e| e.value.as_i64())
            .unwrap_or(0)
            .saturating_add(1);
        match self.kv.put("sim", "cas", &next, Some(expected), None).await {
            Ok(version) => {
                let last = self.cas_versions.last().copied();
                self.check(last.is_none_or(|last| version > last), || {
                    format!("cas version {version} after {last:?}")
                });
                self.cas_versions.push(version);
                "cas ok".into()
            }
            Err(TitoError::CommitOutcomeUnknown { .. }) => {
                self.cas_unknown += 1;
                "cas unknown".into()
            }
            Err(err) => format!("cas {}", error_kind(&err)),
        }
    }

    /// One fault rule. Failures hit the data the workload writes and reads (rows, queue rows,
    /// kv), never lease renewals or heartbeats: a holder that cannot renew for a whole lease is
    /// no longer alive, and the overlap invariant only speaks of live holders. Delays (up to
    /// 30 ms, under a third of a lease) hit any scan, renewing workers' included.
    fn fault(&mut self) -> String {
        const DATA: [&str; 6] = [
            "queue:pending:",
            "queue:completed:",
            "queue@c:pending:",
            "queue@c:completed:",
            "table:",
            "kv:",
        ];
        let skip = self.rng.below(12);
        let data = DATA[self.rng.below(DATA.len() as u64) as usize];
        let (point, fault) = match self.rng.below(6) {
            0 => (FaultPoint::Commit, Fault::Conflict),
            1 => (FaultPoint::Commit, Fault::UnknownOutcomeCommitted),
            2 => (FaultPoint::Commit, Fault::UnknownOutcomeNotCommitted),
            3 => (FaultPoint::Commit, Fault::Storage),
            4 => (FaultPoint::Get, Fault::Storage),
            _ => (
                FaultPoint::Scan,
                Fault::Delay(Duration::from_millis(1 + self.rng.below(30))),
            ),
        };
        let rule = FaultRule::new(point, fault).skip(skip);
        let rule = if point == FaultPoint::Scan {
            rule
        } else {
            rule.when_key_starts_with(data)
        };
        self.db.faults().add(rule);
        format!("fault {point:?} {fault:?} after {skip} on {data}")
    }

    async fn increment(&mut self) -> String {
        match self.kv.incr("sim", "counter", 1, None).await {
            Ok(_) => {
                self.increments.0 += 1;
                "incr ok".into()
            }
            Err(TitoError::CommitOutcomeUnknown { .. }) => {
                self.increments.1 += 1;
                "incr unknown".into()
            }
            Err(err) => format!("incr {}", error_kind(&err)),
        }
    }

    async fn unique_race(&mut self, step: u32) -> String {
        let accounts = self.db.clone().model::<Account>();
        let handle = format!("h{}", self.rng.below(6));
        let racers: Vec<_> = (0..2)
            .map(|i| {
                let (accounts, handle) = (accounts.clone(), handle.clone());
                tokio::spawn(async move {
                    accounts
                        .build(Account {
                            id: format!("race-{step}-{i}"),
                            handle,
                        })
                        .await
                })
            })
            .collect();
        let mut outcomes = Vec::new();
        for racer in racers {
            outcomes.push(match racer.await.unwrap() {
                Ok(_) => "ok".to_string(),
                Err(err) => error_kind(&err),
            });
        }
        let winners = outcomes.iter().filter(|o| *o == "ok").count();
        self.check(winners <= 1, || {
            format!("step {step}: two rows took handle {handle}")
        });
        format!("race {handle} {outcomes:?}")
    }

    /// A caller's transaction that writes a key of its own and a profile, catches the profile
    /// write's error and commits anyway: committed, it must hold the whole write or none of it.
    async fn caught_write(&mut self, step: u32) -> String {
        let profiles = self.db.clone().model::<Profile>();
        let profile = Profile {
            id: format!("p{}", self.rng.below(8)),
            email: format!("e{}", self.rng.below(5)),
            nick: format!("n{}", self.rng.below(5)),
            team: format!("t{}", self.rng.below(3)),
        };
        let mode = self.rng.below(4);
        // Mostly the default (events report what the write did); sometimes an operation stated,
        // right or wrong, or events switched off.
        let options = match self.rng.below(10) {
            0 => TitoOptions::with_events(OPERATIONS[self.rng.below(4) as usize]),
            1 => TitoOptions::without_events(),
            _ => TitoOptions::default(),
        };
        if options.skip_events {
            self.silent_profile_writes += 1;
        }
        let result = self
            .db
            .transaction(|tx| {
                let (profiles, profile, options) =
                    (profiles.clone(), profile.clone(), options.clone());
                async move {
                    tx.put(b"sim:caught".to_vec(), step.to_string().into_bytes())
                        .await?;
                    let written = match mode {
                        0 => profiles.build_with_options(profile, options, &tx).await,
                        1 => profiles.update_with_options(profile, options, &tx).await,
                        2 => profiles.upsert_with_options(profile, options, &tx).await,
                        _ => profiles
                            .delete_by_id_with_options(&profile.id, options, &tx)
                            .await
                            .map(|()| Profile::default()),
                    };
                    // The caller handles the error and commits its own write.
                    Ok::<_, TitoError>(written.err().map(|err| error_kind(&err)))
                }
            })
            .await;
        match result {
            Ok(caught) => format!(
                "caught-write {mode} {} {:?}/{} {caught:?}",
                profile.id, options.events, options.skip_events
            ),
            Err(err) => format!(
                "caught-write {mode} {} commit {}",
                profile.id,
                error_kind(&err)
            ),
        }
    }

    async fn step(&mut self, step: u32) {
        let roll = self.rng.below(100);
        let started = sim_ms(self.start);
        if self.live_trace {
            // A step that never ends (a hang) shows here, before its line would.
            eprintln!("step {step}: roll {roll} @{started}");
        }
        let line = match roll {
            0..=29 => self.publish(step).await,
            30..=37 => {
                let node = self.rng.chance(50);
                let slots = if node { &self.nodes } else { &self.workers };
                match slots.iter().position(Option::is_none) {
                    Some(slot) => {
                        self.generation += 1;
                        let window = Window::pick(&mut self.rng);
                        if node {
                            // A restarted node is a new member (a new id, as a new pod would be).
                            let id = format!("n{slot}.{}", self.generation);
                            let q = &self.queues[1];
                            self.nodes[slot] = Some(start_node(&q.queue, &q.tracker, id, window));
                        } else {
                            let id = format!("w{slot}.{}", self.generation);
                            let q = &self.queues[0];
                            self.workers[slot] =
                                Some(start_worker(&q.queue, &q.tracker, id, window));
                        }
                        format!(
                            "start {}{slot} window {:?}/{}",
                            if node { "n" } else { "w" },
                            window.delay,
                            window.batch
                        )
                    }
                    None => "start none".into(),
                }
            }
            38..=42 => {
                let node = self.rng.chance(50);
                let slot = self.rng.below(WORKER_SLOTS.min(NODE_SLOTS) as u64) as usize;
                self.stop_worker(slot, node).await
            }
            43..=46 => {
                let node = self.rng.chance(50);
                let slot = self.rng.below(WORKER_SLOTS.min(NODE_SLOTS) as u64) as usize;
                let taken = if node {
                    self.nodes[slot].take()
                } else {
                    self.workers[slot].take()
                };
                match taken {
                    Some(worker) => {
                        worker.task.abort();
                        format!("crash {}{slot}", if node { "n" } else { "w" })
                    }
                    None => "crash none".into(),
                }
            }
            47..=54 => self.fault(),
            55..=58 => self.increment().await,
            59..=61 => self.compare_and_set().await,
            62..=64 => self.unique_race(step).await,
            65..=68 => self.add_task().await,
            69..=72 => self.claim(step).await,
            73..=76 => self.complete().await,
            77 => {
                // A clock jump: everything due in the next two seconds is due at once.
                // Recorded first: the runtime runs other tasks inside `advance`.
                for queue in &self.queues {
                    let mut tracker = queue.tracker.lock().unwrap();
                    tracker.last_jump = Some(tracker.now() + 2000);
                }
                tokio::time::advance(Duration::from_secs(2)).await;
                "jump 2s".into()
            }
            78..=81 => self.caught_write(step).await,
            82..=83 => self.pause_or_resume().await,
            84..=85 => self.cancel_one().await,
            86 => self.set_limits().await,
            87 => self.toggle_ticker().await,
            88..=91 => self.shape_step(step).await,
            92 => self.crash_store().await,
            _ => {
                let pause = 1 + self.rng.below(400);
                // Now and then a graph action first (its own random stream).
                let mut graph = if self.graphs.rng.chance(60) {
                    let db = self.db.clone();
                    format!("{}; ", self.graphs.step(&db).await)
                } else {
                    String::new()
                };
                // Now and then a store move of the store as it is (its own stream too).
                if self.moves.rng.chance(25) {
                    let (line, violation) = self.moves.step(self.db.inner()).await;
                    self.checks += 1;
                    if let Some(violation) = violation {
                        self.violations.push(violation);
                    }
                    graph.push_str(&format!("{line}; "));
                }
                tokio::time::sleep(Duration::from_millis(pause)).await;
                format!("{graph}sleep {pause}")
            }
        };
        if self.live_trace {
            eprintln!("{step} {line} @{started}");
        }
        self.trace.push(format!("{step} {line} @{started}"));
    }

    /// A crash loop of the store's clock: it restarts from the mark it persisted, one to four
    /// times in a row with no time between, as PD's timestamp oracle does after leader changes
    /// (the embedded and SQLite stores wait the lead out when they open, see `tests/crash.rs`).
    /// The clock's lead over the wall clock stays within the oracle's window however many
    /// crashes follow each other.
    async fn crash_store(&mut self) -> String {
        let store = self.db.inner().clone();
        let before = self.now_ms().await;
        let crashes = 1 + self.rng.below(4);
        for _ in 0..crashes {
            store.crash_clock();
        }
        let after = self.now_ms().await;
        let lead = after.saturating_sub(EPOCH_MS + sim_ms(self.start) as u64);
        self.check(lead <= CLOCK_LEAD_BOUND_MS, || {
            format!(
                "the store's clock is {lead} ms ahead of the wall clock after {crashes} crashes"
            )
        });
        // Leases, memberships and concurrency slots may have expired in the jump, as in a clock
        // jump; but the workers' own timers did not move, so they hold their leases fresh for
        // up to two thirds of a period more: runs started until then count as before the jump.
        // Rates are kept on the store's clock: starts around the jump are closer on the wall
        // clock than the rate allows.
        let jump = u128::from(after.saturating_sub(before));
        for queue in &self.queues {
            let mut tracker = queue.tracker.lock().unwrap();
            tracker.store_jumps_ms += jump;
            if jump > 0 {
                let now = tracker.now();
                tracker.last_jump = Some(now + NODE_TTL.as_millis() * 2 / 3 + 1);
                tracker.store_jump = Some(now);
            }
        }
        format!("crash store x{crashes} +{jump}ms, {lead}ms ahead")
    }

    /// Pauses a queue or one of its partitions, or resumes it when it is paused.
    async fn pause_or_resume(&mut self) -> String {
        let which = self.rng.below(2) as usize;
        let scope = if self.rng.chance(50) {
            None
        } else {
            Some(self.rng.below(u64::from(PARTITIONS)) as u32)
        };
        let q = &self.queues[which];
        let paused = q.tracker.lock().unwrap().paused.contains_key(&scope);
        if paused {
            let result = q.queue.resume(scope).await;
            // Even an unknown outcome may have resumed it: no longer counted.
            q.tracker.lock().unwrap().paused.remove(&scope);
            format!("resume q{which} {scope:?}: {}", short(&result))
        } else {
            let result = q.queue.pause(scope, "simulated").await;
            let mut tracker = q.tracker.lock().unwrap();
            // In force once known (`false`: already paused by an attempt whose outcome was
            // unknown): counted from now, which is no earlier than its commit.
            if result.is_ok() {
                let now = tracker.now();
                tracker.paused.insert(scope, now);
            }
            format!("pause q{which} {scope:?}: {}", short(&result))
        }
    }

    /// Starts a periodic runner in a free slot, or stops or crashes a running one.
    async fn toggle_ticker(&mut self) -> String {
        let slot = self.rng.below(TICKER_SLOTS as u64) as usize;
        match self.tickers[slot].take() {
            Some(ticker) if self.rng.chance(50) => {
                ticker.task.abort();
                format!("crash ticker {slot}")
            }
            Some(ticker) => {
                ticker.stop.send(true).ok();
                let joined = tokio::time::timeout(tito::queue::TICK_TIMEOUT * 2, ticker.task).await;
                let ok = matches!(joined, Ok(Ok(Ok(()))));
                self.check(ok, || {
                    format!("ticker {slot} did not stop cleanly: {joined:?}")
                });
                format!("stop ticker {slot} {ok}")
            }
            None => {
                let now = self.now_secs().await;
                self.first_ticker.get_or_insert(now);
                let (stop, rx) = watch::channel(false);
                let schedule =
                    tito::queue::Schedule::every("tick", Duration::from_secs(1)).unwrap();
                let job = tito::queue::PeriodicJob::new(
                    schedule,
                    Job {
                        n: 0,
                        behaviour: Behaviour::Succeed,
                        first_due: 0,
                    },
                );
                let task =
                    tokio::spawn(tito::queue::run_periodic(self.ticks.clone(), vec![job], rx));
                self.tickers[slot] = Some(Worker { stop, task });
                format!("start ticker {slot}")
            }
        }
    }

    /// The periodic queue after the run: every tick published once (one row per id, the id
    /// naming the row's due time), none before the first runner started or after now.
    async fn check_ticks(&mut self) {
        for slot in 0..TICKER_SLOTS {
            if let Some(ticker) = self.tickers[slot].take() {
                ticker.stop.send(true).ok();
                let joined = tokio::time::timeout(tito::queue::TICK_TIMEOUT * 2, ticker.task).await;
                self.check(matches!(joined, Ok(Ok(Ok(())))), || {
                    format!("ticker {slot} did not stop cleanly at the end")
                });
            }
        }
        let now = self.now_secs().await;
        let root = tito::keys::queue_root(Some(PERIODIC_TOPIC));
        let tx = self.db.begin().await.unwrap();
        let rows = scan_all(&tx, format!("{root}:pending:").as_bytes()).await;
        tx.rollback().await.unwrap();
        let mut seen = BTreeSet::new();
        for (key, value) in &rows {
            let row: serde_json::Value = serde_json::from_slice(value).unwrap();
            let id = row["id"].as_str().unwrap_or_default().to_string();
            let due = row["timestamp"].as_i64().unwrap_or(-1);
            let fresh = seen.insert(id.clone());
            self.check(fresh, || format!("tick {id} published twice"));
            let named = id == tito::queue::tick_id("tick", due);
            let first = self.first_ticker;
            let in_time = first.is_some_and(|first| due > first) && due <= now;
            self.check(named && in_time, || {
                format!(
                    "tick row {} (id {id}, due {due}) outside ({first:?}, {now}] or misnamed",
                    String::from_utf8_lossy(key),
                )
            });
        }
        self.periodic_ticks = rows.len();
    }

    /// Sets limits on a queue, once per queue per run (a limit lowered under running
    /// handlers would make the running ones count against it).
    async fn set_limits(&mut self) -> String {
        use tito::queue::{Limits, Rate};
        let which = self.rng.below(2) as usize;
        if self.queues[which].tracker.lock().unwrap().limits.is_some() {
            // Lifted: what the limits held or moved runs again (the drain at the end
            // checks that nothing stays behind).
            return self.lift_limits(which).await;
        }
        let mut limits = Limits::none();
        if self.rng.chance(60) {
            limits = limits.concurrency(1 + self.rng.below(3) as u32);
        }
        if self.rng.chance(60) {
            limits = limits.key_concurrency(1 + self.rng.below(2) as u32);
        }
        if self.rng.chance(25) {
            limits = limits.rate(Rate::new(
                4 + self.rng.below(5) as u32,
                Duration::from_secs(1),
            ));
        }
        if self.rng.chance(25) {
            limits = limits.key_rate(Rate::new(
                2 + self.rng.below(3) as u32,
                Duration::from_secs(1),
            ));
        }
        if self.rng.chance(15) {
            // A rate that moves what it refuses hours ahead: only lifting it brings them back.
            limits = limits.rate(Rate::new(1, Duration::from_secs(3600)));
        }
        if limits.is_none() {
            limits = limits.key_concurrency(1);
        }
        let q = &self.queues[which];
        let result = q.queue.set_limits(limits.clone()).await;
        q.tracker.lock().unwrap().rated |= limits.rate.is_some() || limits.key_rate.is_some();
        if result.is_ok() {
            let mut tracker = q.tracker.lock().unwrap();
            let since = tracker.now() + tito::queue::PAUSE_CHECK.as_millis();
            tracker.limits = Some((limits.clone(), since));
        }
        format!("limits q{which} {limits:?}: {}", short(&result))
    }

    /// Lifts the limits of queue `which`.
    async fn lift_limits(&mut self, which: usize) -> String {
        let q = &self.queues[which];
        {
            // The lift applies when it commits, before the call returns (it then brings back
            // what the limits moved): starts from now on are not checked against the old
            // limits, whatever the outcome.
            let mut tracker = q.tracker.lock().unwrap();
            tracker.limits = None;
            tracker.limits_lifted = Some(tracker.now());
        }
        let result = q.queue.set_limits(tito::queue::Limits::none()).await;
        {
            let mut tracker = q.tracker.lock().unwrap();
            tracker.limits_lifted = Some(tracker.now());
        }
        format!("lift limits q{which}: {}", short(&result))
    }

    /// Cancels one published event, pending or not.
    async fn cancel_one(&mut self) -> String {
        let which = self.rng.below(2) as usize;
        let count = self.queues[which].events.len() as u64;
        if count == 0 {
            return "cancel none".into();
        }
        let pick = self.rng.below(count) as usize;
        let (id, n) = {
            let (id, (job, _)) = self.queues[which].events.iter().nth(pick).unwrap();
            (id.clone(), job.n)
        };
        let q = &mut self.queues[which];
        // Whatever the cancel's outcome, the event no longer takes part in the priority check.
        q.tracker.lock().unwrap().waiting.remove(&n);
        let result = q.queue.cancel(&id, "simulated").await;
        match &result {
            Ok(true) => {
                q.cancels.insert(id.clone(), true);
                let mut tracker = q.tracker.lock().unwrap();
                let now = tracker.now();
                tracker.cancelled.insert(n, now);
            }
            Ok(false) => {}
            Err(_) => {
                q.cancels.entry(id.clone()).or_insert(false);
            }
        }
        format!("cancel q{which} {id}: {}", short(&result))
    }

    /// Lifts every pause (the drain runs everything).
    async fn resume_all(&mut self) {
        for q in &self.queues {
            for scope in std::iter::once(None).chain((0..PARTITIONS).map(Some)) {
                let resumed = q.queue.resume(scope).await;
                self.checks += 1;
                if let Err(err) = resumed {
                    self.violations
                        .push(format!("resume without faults failed: {err}"));
                }
            }
            q.tracker.lock().unwrap().paused.clear();
        }
    }

    /// Stops everything, lets one clean worker and two clean nodes drain the queues, and checks
    /// the end state.
    async fn finish(&mut self) {
        self.db.faults().clear();
        self.phase("resume and lift limits");
        self.resume_all().await;
        // Whatever the limits held or moved (up to hours ahead) follows their lifting.
        for which in 0..2 {
            let lifted = self.lift_limits(which).await;
            self.check(lifted.ends_with("()"), || {
                format!("lifting limits without faults failed: {lifted}")
            });
        }
        for slot in 0..WORKER_SLOTS {
            self.stop_worker(slot, false).await;
        }
        for slot in 0..NODE_SLOTS {
            self.stop_worker(slot, true).await;
        }
        self.phase("drain");
        let q = &self.queues[0];
        let drainer = start_worker(&q.queue, &q.tracker, "drainer".into(), Window::NONE);
        let q = &self.queues[1];
        let nodes = [
            start_node(&q.queue, &q.tracker, "final-a".into(), Window::NONE),
            start_node(&q.queue, &q.tracker, "final-b".into(), Window::NONE),
        ];
        let mut waited = Duration::ZERO;
        loop {
            let pending = pending_total(&self.queues[0].queue).await
                + pending_total(&self.queues[1].queue).await;
            if pending == 0 || waited >= Duration::from_secs(120) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            waited += Duration::from_millis(200);
        }
        self.phase("balance");
        // Balance once membership is stable: P/N leases per node. (Memberships live on the
        // store's clock, which stands still while it is ahead of the wall clock after a jump.)
        let lead = self.store_lead_ms().await;
        tokio::time::sleep(NODE_TTL * 3 + Duration::from_millis(lead)).await;
        let state = cluster_state(&self.queues[1].queue).await.unwrap();
        let mut held: BTreeMap<&str, u32> = BTreeMap::new();
        for owner in state.leases.values() {
            *held.entry(owner.as_str()).or_default() += 1;
        }
        let balanced = state.leases.len() == PARTITIONS as usize
            && held.len() == 2
            && held.values().all(|n| *n == PARTITIONS / 2);
        self.check(balanced, || {
            format!("stable cluster leases not balanced: {:?}", state.leases)
        });
        for worker in std::iter::once(drainer).chain(nodes) {
            worker.stop.send(true).ok();
            let joined = tokio::time::timeout(HANDLER_TIMEOUT * 20, worker.task).await;
            self.check(matches!(joined, Ok(Ok(Ok(())))), || {
                "a final worker did not stop cleanly".into()
            });
        }
        self.phase("check queues");
        for which in 0..2 {
            self.check_queue(which).await;
        }
        self.phase("check models and kv");
        self.check_models_and_kv().await;
        self.phase("check shapes");
        self.check_shapes_at_end().await;
        self.phase("check inbox");
        self.check_inbox().await;
        self.phase("check ticks");
        self.check_ticks().await;
        self.phase("check graphs");
        let db = self.db.clone();
        let (checks, violations) = self.graphs.finish(&db).await;
        self.checks += checks;
        self.violations.extend(violations);
    }

    /// Names a phase of the final checks (with `TITO_SIM_TRACE=1`).
    fn phase(&self, name: &str) {
        if self.live_trace {
            eprintln!("finish: {name} @{}", sim_ms(self.start));
        }
    }

    async fn check_queue(&mut self, which: usize) {
        let queue = self.queues[which].queue.clone();
        let root = if which == 0 {
            "queue".to_string()
        } else {
            tito::keys::queue_root(Some(CLUSTER_TOPIC))
        };
        let pending = pending_total(&queue).await;
        self.check(pending == 0, || {
            format!("q{which}: {pending} invocations still pending")
        });
        // Completed invocations per event id, as stored.
        let tx = self.db.begin().await.unwrap();
        let completed = scan_all(&tx, format!("{root}:completed:").as_bytes()).await;
        let mut done: BTreeMap<String, u32> = BTreeMap::new();
        for (key, value) in &completed {
            let row: serde_json::Value = serde_json::from_slice(value).unwrap();
            let id = row["id"].as_str().unwrap_or_default().to_string();
            *done.entry(id.clone()).or_default() += 1;
            // The id's key names its live invocation (the last completed one).
            let named = tx
                .get(tito::keys::event_id_key(&root, &id).as_bytes())
                .await
                .unwrap()
                .is_some();
            self.check(named, || {
                format!(
                    "completed {} has no event id key",
                    String::from_utf8_lossy(key)
                )
            });
        }
        // Dead invocations (the cluster queue's failure policy): only those that always fail,
        // each after exactly its maximum attempts, with its id key pointing at it.
        let mut dead: BTreeSet<String> = BTreeSet::new();
        for (key, value) in scan_all(&tx, format!("{root}:dead:").as_bytes()).await {
            let row: serde_json::Value = serde_json::from_slice(&value).unwrap();
            let id = row["id"].as_str().unwrap_or_default().to_string();
            let behaviour = self.queues[which]
                .events
                .get(&id)
                .map(|(job, _)| job.behaviour);
            let failures = row["failures"].as_u64().unwrap_or(0);
            self.check(
                which == 1
                    && behaviour == Some(Behaviour::AlwaysFail)
                    && failures == u64::from(MAX_ATTEMPTS),
                || format!("q{which}: {id} ({behaviour:?}) dead after {failures} failures"),
            );
            let named = tx
                .get(tito::keys::event_id_key(&root, &id).as_bytes())
                .await
                .unwrap();
            self.check(named.as_deref() == Some(key.as_slice()), || {
                format!("dead {id}: its id key is {named:?}")
            });
            self.check(dead.insert(id.clone()), || format!("{id} dead twice"));
        }
        self.dead += dead.len();
        // Attempt numbers start at 1 and rise by at most one from one start to the next (a
        // start whose outcome never committed is delivered again with the same number); a
        // replacement starts again at 1.
        let attempts = self.queues[which].tracker.lock().unwrap().attempts.clone();
        for (n, seen) in &attempts {
            let rising = seen.first() == Some(&1)
                && seen
                    .windows(2)
                    .all(|w| w[1] == w[0] || w[1] == w[0] + 1 || w[1] == 1);
            let bounded = seen.iter().all(|a| *a <= MAX_ATTEMPTS);
            let policy = which == 1 || seen.iter().all(|a| *a == 1);
            self.check(rising && bounded && policy, || {
                format!("q{which}: event {n} was given attempts {seen:?}")
            });
        }
        let events = self.queues[which].events.clone();
        let cancels = self.queues[which].cancels.clone();
        let rated = self.queues[which].tracker.lock().unwrap().rated;
        for (id, (job, publication)) in &events {
            if let Some(certain) = cancels.get(id) {
                // Cancelled while pending: completed as cancelled (once more than the runs
                // before it), never dead; an unknown cancel may have done either.
                let got = done.get(id).copied().unwrap_or(0);
                let most = if matches!(
                    job.behaviour,
                    Behaviour::RescheduleOnce | Behaviour::AdvanceOnce
                ) {
                    2
                } else {
                    1
                };
                let fine = if *certain {
                    (1..=most).contains(&got) && !dead.contains(id)
                } else {
                    got <= most
                };
                self.check(fine, || {
                    format!(
                        "q{which}: {id} ({:?}) cancelled ({certain}): completed {got}, dead {}",
                        job.behaviour,
                        dead.contains(id)
                    )
                });
                continue;
            }
            if job.behaviour == Behaviour::AlwaysFail {
                let died = dead.contains(id);
                let fine = (died || *publication == Publication::Maybe) && !done.contains_key(id);
                self.check(fine, || {
                    format!(
                        "q{which}: {id} always fails; dead {died}, completed {:?}",
                        done.get(id)
                    )
                });
                continue;
            }
            let expected = if matches!(
                job.behaviour,
                Behaviour::RescheduleOnce | Behaviour::AdvanceOnce
            ) {
                2
            } else {
                1
            };
            let got = done.get(id).copied().unwrap_or(0);
            // A rate limit may move a row before it runs: a `RescheduleOnce` moved before its
            // first run no longer sees its first due time and acknowledges at once.
            let moved = job.behaviour == Behaviour::RescheduleOnce && rated && got == 1;
            let fine = got == expected || moved || (*publication == Publication::Maybe && got == 0);
            self.check(fine, || {
                format!(
                    "q{which}: {id} ({:?}, {publication:?}) completed {got} times, expected {expected}",
                    job.behaviour
                )
            });
        }
        for id in done.keys() {
            let known = events.contains_key(id);
            self.check(known, || {
                format!("q{which}: {id} completed but never published")
            });
        }
        // Owner keys match rows, both ways.
        let mut owned = BTreeSet::new();
        for (key, _) in scan_all(&tx, format!("{root}:owner:").as_bytes()).await {
            let text = String::from_utf8(key.clone()).unwrap();
            let target = tito::keys::owner_key_target(&text).unwrap();
            let exists = tx.get(target.as_bytes()).await.unwrap().is_some();
            self.check(exists, || format!("owner key {text} points at nothing"));
            owned.insert(target);
        }
        for (key, value) in &completed {
            let row: serde_json::Value = serde_json::from_slice(value).unwrap();
            if !row["owner"].is_null() {
                let key = String::from_utf8(key.clone()).unwrap();
                let has = owned.contains(&key);
                self.check(has, || {
                    format!("completed {key} has an owner but no owner key")
                });
            }
        }
        tx.rollback().await.unwrap();
        let pause_violations = self.queues[which]
            .tracker
            .lock()
            .unwrap()
            .pause_violations
            .clone();
        self.check(pause_violations.is_empty(), || {
            format!("q{which}: started while paused or after a cancel: {pause_violations:?}")
        });
        let (priority_violations, priority_checks) = {
            let tracker = self.queues[which].tracker.lock().unwrap();
            (tracker.priority_violations.clone(), tracker.priority_checks)
        };
        self.priority_checks += priority_checks;
        self.check(priority_violations.is_empty(), || {
            format!("q{which}: a higher priority was passed over: {priority_violations:?}")
        });
        let limit_violations = self.queues[which]
            .tracker
            .lock()
            .unwrap()
            .limit_violations
            .clone();
        self.check(limit_violations.is_empty(), || {
            format!("q{which}: started past a limit or before its due time: {limit_violations:?}")
        });
        let (overlaps, details) = {
            let tracker = self.queues[which].tracker.lock().unwrap();
            (tracker.overlaps, tracker.details.clone())
        };
        self.check(overlaps == 0, || {
            format!("q{which}: {overlaps} overlapping runs: {details:?}")
        });
    }

    /// One step of the model that changes shape: a write by either code, a delete, an
    /// operator's allow or rollback, a rewrite batch, or a read of every row by both codes.
    async fn shape_step(&mut self, step: u32) -> String {
        let olds = self.db.clone().model::<ShapeOld>();
        let news = self.db.clone().model::<ShapeNew>();
        let id = format!("s{}", self.rng.below(8));
        let team = format!("t{}", self.rng.below(2));
        match self.rng.below(10) {
            0..=2 => {
                let name = format!("old{step} x");
                let row = ShapeOld {
                    id: id.clone(),
                    team,
                    name: name.clone(),
                };
                let result = olds.upsert(row).await;
                self.shape_written(&id, Some(name), &result);
                format!("shape old-write {id} {}", short(&result.map(|_| ())))
            }
            3..=5 => {
                let row = ShapeNew {
                    id: id.clone(),
                    team,
                    first: format!("new{step}"),
                    last: "y".into(),
                };
                let result = news.upsert(row).await;
                self.shape_written(&id, Some(format!("new{step} y")), &result);
                format!("shape new-write {id} {}", short(&result.map(|_| ())))
            }
            6 => {
                let result = if self.rng.chance(50) {
                    olds.delete_by_id(&id).await
                } else {
                    news.delete_by_id(&id).await
                };
                // A delete of a missing row is NotFound and changes nothing.
                if !matches!(result, Err(TitoError::NotFound(_))) {
                    self.shape_written(&id, None, &result);
                }
                format!("shape delete {id} {}", short(&result))
            }
            7 => {
                let writable = self.shape_writable().await;
                let to = if writable == Some(2) { 1 } else { 2 };
                let result = tito::schema::allow_shape_version(&self.db, "sim_shape", to).await;
                if to == 2 && !matches!(result, Err(TitoError::InvalidArgument(_))) {
                    // Committed or perhaps committed: the first code may meet newer rows.
                    self.shapes.ever_two |= !matches!(result, Err(TitoError::Storage { .. }));
                }
                format!("shape allow {to} {}", short(&result.map(|s| s.writable())))
            }
            8 => match news.rewrite_step(3).await {
                Ok(done) => {
                    self.shapes.rewrites_finished += u32::from(done.finished);
                    format!(
                        "shape rewrite {} {} {}",
                        done.handled, done.rewritten, done.finished
                    )
                }
                Err(err) => format!("shape rewrite {}", error_kind(&err)),
            },
            _ => self.check_shape_rows(false).await,
        }
    }

    /// Records a shape write's outcome in what each row may hold.
    fn shape_written<T>(&mut self, id: &str, value: Option<String>, result: &Result<T, TitoError>) {
        let known = self
            .shapes
            .expected
            .entry(id.to_string())
            .or_insert_with(|| BTreeSet::from([None]));
        match result {
            Ok(_) => *known = BTreeSet::from([value]),
            Err(TitoError::CommitOutcomeUnknown { .. }) => {
                known.insert(value);
            }
            Err(_) => {}
        }
    }

    /// The version writers may write, as the catalog says (`None`: unknown, a read failed).
    /// Version 2 seen allowed once (an operator's step, or the next code creating the table)
    /// means rows of version 2 may exist.
    async fn shape_writable(&mut self) -> Option<u32> {
        let writable = match tito::schema::catalog(&self.db, "sim_shape").await {
            Ok(catalog) => Some(catalog.map_or(1, |c| c.shapes.writable())),
            Err(_) => None,
        };
        self.shapes.ever_two |= writable == Some(2);
        writable
    }

    /// Reads every row by the next code (it must read each, as one of its possible values) and,
    /// while the first code may run (version 1 allowed and no newer row can be left), by the
    /// first code too. `at_end`: no fault is left, a read must succeed.
    async fn check_shape_rows(&mut self, at_end: bool) -> String {
        let writable = self.shape_writable().await;
        let progress = tito::schema::rewrite_progress(&self.db, "sim_shape").await;
        let first_code_runs = writable == Some(1)
            && (!self.shapes.ever_two
                || matches!(&progress, Ok(Some(p)) if p.finished && p.target == 1));
        let olds = self.db.clone().model::<ShapeOld>();
        let news = self.db.clone().model::<ShapeNew>();
        let ids: Vec<String> = self.shapes.expected.keys().cloned().collect();
        let mut read = 0;
        for id in ids {
            let possible = self.shapes.expected[&id].clone();
            match news.get(&id).await {
                Ok(row) => {
                    let value = row.map(|r| format!("{} {}", r.first, r.last));
                    self.check(possible.contains(&value), || {
                        format!("shape row {id} read as {value:?} by the next code, expected one of {possible:?}")
                    });
                    read += 1;
                }
                Err(TitoError::Storage { .. }) if !at_end => continue,
                Err(err) => self.check(false, || {
                    format!("the next code could not read shape row {id}: {err}")
                }),
            }
            if first_code_runs {
                match olds.get(&id).await {
                    Ok(row) => {
                        let value = row.map(|r| r.name);
                        self.check(possible.contains(&value), || {
                            format!("shape row {id} read as {value:?} by the first code, expected one of {possible:?}")
                        });
                    }
                    Err(TitoError::Storage { .. }) if !at_end => {}
                    Err(err) => self.check(false, || {
                        format!(
                            "the first code could not read shape row {id} while it may run: {err}"
                        )
                    }),
                }
            }
        }
        self.shapes.checked_rows += read;
        format!("shape check {read} rows, first code {first_code_runs}")
    }

    /// At the end, with no fault left: a whole rewrite by the next code leaves every row in the
    /// allowed version, every row reads as it should by both codes where they may run, and the
    /// audit finds nothing.
    async fn check_shapes_at_end(&mut self) {
        let news = self.db.clone().model::<ShapeNew>();
        if self.shapes.expected.is_empty() {
            return;
        }
        let rewrite = news
            .rewrite_shapes(tito::schema::RewriteOptions::default(), |_| {})
            .await;
        self.check(rewrite.is_ok(), || {
            format!("the final shape rewrite failed: {rewrite:?}")
        });
        let writable = self.shape_writable().await.unwrap_or(0);
        if let Ok(done) = &rewrite {
            self.check(
                done.unconvertible.count == 0 && done.refused.count == 0,
                || format!("the final shape rewrite left rows: {done:?}"),
            );
        }
        let counts = tito::schema::shape_versions(&self.db, "sim_shape", 1000)
            .await
            .unwrap();
        self.check(counts.rows.keys().all(|v| *v == writable), || {
            format!(
                "rows left in another version than {writable}: {:?}",
                counts.rows
            )
        });
        let line = self.check_shape_rows(true).await;
        self.trace.push(format!("end {line}"));
        let audit = news.audit(|_| {}).await;
        self.check(matches!(&audit, Ok(report) if report.is_clean()), || {
            format!("the shape table's audit: {audit:?}")
        });
    }

    async fn check_models_and_kv(&mut self) {
        let tx = self.db.begin().await.unwrap();
        // Indexes and claims of both models: every entry listed by a manifest, every listed key
        // present.
        for table in ["sim_account", "sim_task", "sim_profile"] {
            let mut listed = BTreeSet::new();
            let manifests = format!("reverse-index:table:{table}:");
            for (key, value) in scan_all(&tx, manifests.as_bytes()).await {
                let record: serde_json::Value = serde_json::from_slice(&value).unwrap();
                let manifest: Vec<String> = serde_json::from_value(record["keys"].clone()).unwrap();
                for entry in manifest {
                    let present = tx.get(entry.as_bytes()).await.unwrap().is_some();
                    self.check(present, || {
                        format!("{} lists missing {entry}", String::from_utf8_lossy(&key))
                    });
                    listed.insert(entry);
                }
            }
            for prefix in [format!("index:{table}:"), format!("unique:{table}:")] {
                for (key, value) in scan_all(&tx, prefix.as_bytes()).await {
                    let text = String::from_utf8(key).unwrap();
                    let owned = listed.contains(&text);
                    self.check(owned, || format!("orphaned {text}"));
                    // The account index holds keys only.
                    if text.starts_with("index:sim_account:") {
                        self.check(value.is_empty(), || format!("{text} is not empty"));
                    }
                }
            }
        }
        // The unique index equals what the rows imply: every row's handle is claimed by it, and
        // every claim names a row that holds the handle.
        let mut handles: BTreeMap<String, String> = BTreeMap::new();
        for (_, value) in scan_all(&tx, b"table:sim_account:").await {
            let row: serde_json::Value = serde_json::from_slice(&value).unwrap();
            let (id, handle) = (row["id"].as_str().unwrap(), row["handle"].as_str().unwrap());
            let claimed = handles.insert(handle.to_string(), id.to_string());
            self.check(claimed.is_none(), || {
                format!("handle {handle} held by two rows")
            });
        }
        let claims = scan_all(&tx, b"unique:sim_account:").await;
        self.check(claims.len() == handles.len(), || {
            format!(
                "{} claims for {} claimed handles",
                claims.len(),
                handles.len()
            )
        });
        for (handle, id) in &handles {
            let key = tito::keys::unique_claim_key(
                "sim_account",
                "by_handle",
                &[("handle", &tito::keys::KeyValue::String(handle.clone()))],
            )
            .unwrap();
            let owner = tx.get(key.as_bytes()).await.unwrap();
            self.check(owner.as_deref() == Some(id.as_bytes()), || {
                format!("claim of {handle} is {owner:?}, row {id} holds it")
            });
            // The index of keys answers with the row.
            let accounts = self.db.clone().model::<Account>();
            let found = accounts.by_handle(handle).execute_in_tx(&tx).await;
            let ids: Option<Vec<String>> = found
                .ok()
                .map(|page| page.items.into_iter().map(|a| a.id).collect());
            self.check(ids.as_deref() == Some(std::slice::from_ref(id)), || {
                format!("query of handle {handle} found {ids:?}, row {id} holds it")
            });
        }
        // Profiles, written in transactions that caught their errors and committed anyway: each
        // row holds its two claims and its team entry, nothing else is claimed or indexed.
        let mut profile_keys = BTreeSet::new();
        for (_, value) in scan_all(&tx, b"table:sim_profile:").await {
            let row: serde_json::Value = serde_json::from_slice(&value).unwrap();
            let id = row["id"].as_str().unwrap().to_string();
            for (index, field) in [("by_email", "email"), ("by_nick", "nick")] {
                let value = row[field].as_str().unwrap().to_string();
                let claim = tito::keys::unique_claim_key(
                    "sim_profile",
                    index,
                    &[(field, &tito::keys::KeyValue::String(value))],
                )
                .unwrap();
                let owner = tx.get(claim.as_bytes()).await.unwrap();
                self.check(owner.as_deref() == Some(id.as_bytes()), || {
                    format!("profile {id}: claim {claim} is owned by {owner:?}")
                });
                profile_keys.insert(claim);
            }
            let team = profiles_by_team(&tx, &self.db, row["team"].as_str().unwrap()).await;
            self.check(team.contains(&id), || {
                format!("profile {id} is missing from its team's index: {team:?}")
            });
        }
        self.check_profile_history(&tx).await;
        let claims = scan_all(&tx, b"unique:sim_profile:").await;
        self.check(claims.len() == profile_keys.len(), || {
            format!(
                "{} profile claims for {} that rows imply",
                claims.len(),
                profile_keys.len()
            )
        });
        // Kv: the counter holds every acknowledged increment and at most the unknown ones.
        let value = |entry: Option<tito::kv::KvEntry>| {
            entry.map_or(0, |e| e.value.as_i64().unwrap_or(-1) as u64)
        };
        let counter = value(self.kv.get_in_tx("sim", "counter", &tx).await.unwrap());
        let (ok, unknown) = self.increments;
        self.check(counter >= ok && counter <= ok + unknown, || {
            format!("counter {counter}: {ok} acknowledged and {unknown} unknown increments")
        });
        // Each compare-and-set that committed added one.
        let cas = value(self.kv.get_in_tx("sim", "cas", &tx).await.unwrap()) as usize;
        let (ok, unknown) = (self.cas_versions.len(), self.cas_unknown);
        self.check(cas >= ok && cas <= ok + unknown, || {
            format!("cas value {cas} after {ok} successful and {unknown} unknown compare-and-sets")
        });
        tx.rollback().await.unwrap();
    }

    /// No profile write without its event, no event without its write: replayed in the order of
    /// their transactions, each profile's events are a valid history (an insert of an absent
    /// row, an update or delete of a present one, a delete carrying the row it removed) that
    /// ends in the stored row. Checked while no write switched events off.
    async fn check_profile_history(&mut self, tx: &<Db as TitoEngine>::Transaction) {
        let root = tito::keys::queue_root(Some("sim_profile"));
        // Per profile: ((transaction version, n), event payload).
        type History = Vec<((u64, u32), serde_json::Value)>;
        let mut histories: BTreeMap<String, History> = BTreeMap::new();
        let mut ids = BTreeSet::new();
        for (key, value) in scan_all(tx, format!("{root}:pending:").as_bytes()).await {
            let key = String::from_utf8(key).unwrap();
            let parsed = tito::keys::parse_pending_key(&root, &key).unwrap();
            let event: serde_json::Value = serde_json::from_slice(&value).unwrap();
            let row_id = event["payload"]["id"].as_str().unwrap().to_string();
            // `sim_profile:{id}:{write version}`, `.{n}` after it for a row's later writes in
            // one transaction.
            let id = parsed.event_id.clone();
            let rest = id.strip_prefix(&format!("sim_profile:{row_id}:"));
            let sequence = rest.and_then(|rest| match rest.split_once('.') {
                Some((version, n)) => Some((version.parse::<u64>().ok()?, n.parse::<u32>().ok()?)),
                None => Some((rest.parse::<u64>().ok()?, 0)),
            });
            self.check(sequence.is_some(), || {
                format!("model event id {id:?} of row {row_id}")
            });
            self.check(ids.insert(id.clone()), || {
                format!("model event id {id:?} twice")
            });
            let n = sequence.map_or(0, |(_, n)| n);
            histories
                .entry(row_id)
                .or_default()
                .push(((parsed.version, n), event["payload"].clone()));
        }
        if self.silent_profile_writes > 0 {
            return;
        }
        for n in 0..8 {
            let id = format!("p{n}");
            let mut events = histories.remove(&id).unwrap_or_default();
            events.sort_by_key(|(order, _)| *order);
            let mut state: Option<serde_json::Value> = None;
            for (_, event) in &events {
                let operation = event["operation"].as_str().unwrap_or_default();
                let row = event["row"].clone();
                let valid = match operation {
                    "Insert" => state.is_none(),
                    "Update" => state.is_some(),
                    "Upsert" => true,
                    "Delete" => state.as_ref() == Some(&row),
                    _ => false,
                };
                self.check(valid, || {
                    format!(
                        "profile {id}: {operation} of {row} after {state:?}; history {events:?}"
                    )
                });
                state = (operation != "Delete").then_some(row);
            }
            let stored = tx
                .get(tito::keys::row_key("sim_profile", &id).as_bytes())
                .await
                .unwrap()
                .map(|bytes| serde_json::from_slice::<serde_json::Value>(&bytes).unwrap());
            self.check(stored == state, || {
                format!("profile {id} is {stored:?}; its events end in {state:?}: {events:?}")
            });
        }
        self.check(histories.is_empty(), || {
            format!("events of unknown profiles: {histories:?}")
        });
    }

    /// Every inbox row ends acknowledged, dead-lettered, ready (its lease over) or, after a
    /// `Drop`, deleted.
    async fn check_inbox(&mut self) {
        // A store's clock that jumped ahead stands still until the wall clock passes it: the
        // leases it gave out meanwhile end that much later on the wall clock.
        let lead = self.store_lead_ms().await;
        tokio::time::sleep(LEASE * 2 + Duration::from_millis(lead)).await;
        let now = self.now_ms().await as i64;
        let tasks = self.db.clone().model::<SimTask>();
        for n in 1..=self.tasks {
            let id = format!("t{n:04}");
            let tx = self.db.begin().await.unwrap();
            let row = tasks.find_by_id_in_tx(&id, &tx).await;
            let lease = tx
                .get(tito::keys::inbox_lease_key("sim_task", &id).as_bytes())
                .await
                .unwrap();
            tx.rollback().await.unwrap();
            let lease_over = lease
                .as_deref()
                .and_then(|b| std::str::from_utf8(b).ok()?.parse::<i64>().ok())
                .is_none_or(|until| until <= now);
            let fine = match &row {
                Ok(task) => task.processed_at.is_some() || task.group == "dead" || lease_over,
                // Deleted: only by a `Drop` (or a build that never committed).
                Err(TitoError::NotFound(_)) => true,
                Err(_) => false,
            };
            self.check(fine, || {
                format!("inbox row {id} ended as {row:?}, lease {lease:?}")
            });
        }
    }
}

async fn scan_all<X: TitoTransaction>(tx: &X, prefix: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    let end = tito::keys::prefix_end_bytes(prefix);
    let mut start = prefix.to_vec();
    let mut out = Vec::new();
    loop {
        let rows = tx.scan(&start, &end, 1000).await.unwrap();
        let full = rows.len() == 1000;
        if let Some((last, _)) = rows.last() {
            start = tito::keys::key_after_bytes(last);
        }
        out.extend(rows);
        if !full {
            return out;
        }
    }
}

fn error_kind(err: &TitoError) -> String {
    match err {
        TitoError::Conflict { .. } => "conflict".into(),
        TitoError::RetriesExhausted { .. } => "retries-exhausted".into(),
        TitoError::CommitOutcomeUnknown { .. } => "unknown".into(),
        TitoError::UniqueViolation { .. } => "unique-violation".into(),
        TitoError::Storage { .. } => "storage".into(),
        TitoError::TransactionAborted(_) => "aborted".into(),
        TitoError::AlreadyExists(_) => "exists".into(),
        TitoError::NotFound(_) => "not-found".into(),
        other => format!("error {other}"),
    }
}

async fn simulate(seed: u64, steps: u32) -> Report {
    let memory = Memory::with_options(
        MemoryOptions::new()
            .clock(MemoryClock::Runtime { epoch_ms: EPOCH_MS })
            .partitions(PARTITIONS)
            .retry_policy(RetryPolicy::default().max_attempts(20).jitter_seed(seed)),
    )
    .unwrap();
    let memory_for_trackers = memory.clone();
    let db = FaultyEngine::new(memory);
    let start = tokio::time::Instant::now();
    let queue = |topic: Option<&str>| {
        let mut config = QueueConfig::new(PARTITIONS, Duration::from_secs(3600));
        if let Some(topic) = topic {
            config = config.topic(topic);
        }
        SimQueue {
            queue: Arc::new(Queue::new(db.clone(), config)),
            tracker: Tracker::new(start, memory_for_trackers.clone()),
            events: BTreeMap::new(),
            cancels: BTreeMap::new(),
        }
    };
    let db_for_ticks = db.clone();
    let db_for_graphs = db.clone();
    let mut sim = Sim {
        rng: Rng(seed),
        start,
        kv: Kv::new(db.clone()),
        queues: [queue(None), queue(Some(CLUSTER_TOPIC))],
        inbox: Inbox::new(db.clone()).unwrap(),
        db,
        workers: (0..WORKER_SLOTS).map(|_| None).collect(),
        nodes: (0..NODE_SLOTS).map(|_| None).collect(),
        generation: 0,
        trace: Vec::new(),
        checks: 0,
        violations: Vec::new(),
        next_event: 0,
        increments: (0, 0),
        cas_versions: Vec::new(),
        cas_unknown: 0,
        silent_profile_writes: 0,
        dead: 0,
        tasks: 0,
        held: Vec::new(),
        dropped: BTreeSet::new(),
        ticks: Arc::new(Queue::new(
            db_for_ticks,
            QueueConfig::new(PARTITIONS, Duration::from_secs(3600)).topic(PERIODIC_TOPIC),
        )),
        tickers: (0..TICKER_SLOTS).map(|_| None).collect(),
        first_ticker: None,
        periodic_ticks: 0,
        priority_checks: 0,
        shapes: ShapeSim::default(),
        live_trace: std::env::var_os("TITO_SIM_TRACE").is_some(),
        graphs: GraphSim::new(seed, &db_for_graphs),
        moves: MoveSim {
            rng: Rng(seed ^ 0xbb67_ae85_84ca_a73b),
            destination: None,
        },
    };
    // Rewrites start soon after the allowed version changes.
    tito::schema::set_write_grace(&sim.db, Duration::from_millis(200)).unwrap();
    for step in 0..steps {
        sim.step(step).await;
    }
    sim.finish().await;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    for line in &sim.trace {
        hasher.write(line.as_bytes());
        hasher.write_u8(b'\n');
    }
    let runs = sim
        .queues
        .iter()
        .map(|q| q.tracker.lock().unwrap().runs.values().sum::<u32>())
        .sum();
    Report {
        seed,
        steps,
        trace_hash: hasher.finish(),
        checks: sim.checks,
        faults: sim.db.faults().injected(),
        published: sim.queues.iter().map(|q| q.events.len()).sum(),
        handler_runs: runs,
        limited_starts: sim
            .queues
            .iter()
            .map(|q| q.tracker.lock().unwrap().limited_starts.len())
            .sum(),
        limit_excused: sim
            .queues
            .iter()
            .map(|q| q.tracker.lock().unwrap().limit_excused)
            .sum(),
        ticks: sim.periodic_ticks,
        priority_checks: sim.priority_checks,
        shape_rows: sim.shapes.checked_rows,
        shape_rewrites: sim.shapes.rewrites_finished,
        dead: sim.dead,
        violations: sim.violations,
        trace: sim.trace,
        log: sim.queues[1].tracker.lock().unwrap().log.clone(),
    }
}

/// Runs one seed in a current-thread runtime with paused time.
pub fn run(seed: u64, steps: u32) -> Report {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    runtime.block_on(simulate(seed, steps))
}

fn steps() -> u32 {
    std::env::var("TITO_SIM_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(120)
}

fn assert_clean(report: &Report) {
    assert!(
        report.violations.is_empty(),
        "seed {} failed ({} steps): {:#?}\nreplay: TITO_SIM_SEED={} TITO_SIM_STEPS={} cargo test --test tito simulation::replay -- --nocapture",
        report.seed,
        report.steps,
        report.violations,
        report.seed,
        report.steps
    );
}

/// A range of seeds, as CI runs them; prints the totals.
fn campaign(seeds: std::ops::Range<u64>) {
    let started = std::time::Instant::now();
    let (mut checks, mut faults, mut runs, mut published, mut dead) = (0, 0, 0u64, 0, 0);
    let (mut limited, mut excused, mut ticks, mut ordered) = (0, 0, 0, 0);
    let (mut shape_rows, mut shape_rewrites, mut moves) = (0, 0, 0);
    let count = seeds.end - seeds.start;
    for seed in seeds {
        let report = run(seed, steps());
        assert_clean(&report);
        checks += report.checks;
        faults += report.faults;
        runs += u64::from(report.handler_runs);
        published += report.published;
        dead += report.dead;
        limited += report.limited_starts;
        excused += report.limit_excused;
        ticks += report.ticks;
        ordered += report.priority_checks;
        shape_rows += report.shape_rows;
        shape_rewrites += report.shape_rewrites;
        moves += report
            .trace
            .iter()
            .filter(|l| l.contains("move copy") || l.contains("move migrate"))
            .count();
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "simulation: {count} seeds in {secs:.1} s ({:.1} seeds/s), {checks} invariant checks, \
         {faults} faults injected, {published} events published, {runs} handler runs, \
         {dead} dead after their last attempt, {limited} starts under limits ({excused} past \
         one after a clock jump), {ticks} periodic ticks, {ordered} first starts checked \
         against the priority order, {shape_rows} rows of a model changing shape read by both \
         codes' checks, {shape_rewrites} shape rewrites finished by steps, {moves} store moves \
         (copies and migrations at random batches) checked key by key",
        count as f64 / secs
    );
}

/// The ids of the profiles the team index lists for `team`.
async fn profiles_by_team<E: TitoEngine>(tx: &E::Transaction, db: &E, team: &str) -> Vec<String> {
    let profiles = db.clone().model::<Profile>();
    match profiles.by_team(team).execute_in_tx(tx).await {
        Ok(page) => page.items.into_iter().map(|p| p.id).collect(),
        Err(err) => vec![format!("query failed: {err}")],
    }
}

#[test]
fn seeds_in_ci() {
    campaign(0..300);
}

/// Seeds that found defects, kept as regression cases. 864: after a clock jump longer than the
/// node TTL, a node whose membership had lapsed started handlers for partitions another node had
/// just taken over (fixed: handlers start only on fresh leases). 8 found a checker mistake
/// instead (runs cut off by a jump counted as overlaps), and 7001 another (a claim's lease
/// measured from after the claim returned, not from its transaction); both stay as regressions.
/// 157: a limits change returned a rate-moved row to its due time while its handler ran, and
/// the row (under a new key) started again on the same node (fixed: the gate deletes the move
/// record of a row it admits). 2460: a lift whose restore failed (an injected storage error)
/// left the rows an hour-long rate had moved an hour ahead, and no later limits change brought
/// them back (fixed: limits without a rate, and maintenance, bring back what is still moved).
/// 4458: a crashed node's membership, renewed while the store's clock stood ahead of the wall
/// clock, outlived the balance check's wait on the wall clock (a checker mistake). 1563: an
/// event whose publication with a delay failed was published again with its
/// absolute due time, and the checker held it to the delay (a checker mistake). 1344: an inbox
/// lease given out while the store's clock stood ahead of the wall clock (after a
/// jump) outlived the check's wait, which counted on the wall clock (a checker mistake).
/// 34: the next code of a model that changes shape created its table (so version 2 was allowed
/// from the start) and the checker, which counted only operators' steps, expected the first
/// code to read every row after a rollback before any rewrite (a checker mistake).
#[test]
fn seeds_that_found_defects() {
    for seed in [8, 34, 157, 864, 1344, 1563, 2460, 4458, 7001] {
        assert_clean(&run(seed, 120));
    }
}

#[test]
fn a_seed_replays_exactly() {
    let first = run(7, steps());
    let second = run(7, steps());
    assert_eq!(first.trace_hash, second.trace_hash);
    assert_eq!(first.checks, second.checks);
    assert_eq!(first.handler_runs, second.handler_runs);
    assert_clean(&first);
}

#[test]
fn replay() {
    let Some(seed) = std::env::var("TITO_SIM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    else {
        return;
    };
    let report = run(seed, steps());
    for line in &report.trace {
        println!("{line}");
    }
    for line in &report.log {
        println!("{line}");
    }
    println!("{:?}", report.violations);
    assert_clean(&report);
}

#[test]
#[ignore = "long: TITO_SIM_SEEDS seeds (default 10000)"]
fn many() {
    let seeds = std::env::var("TITO_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    campaign(0..seeds);
}

/// The graphs' queue (steps and children) and the queue their batches call back to (no worker:
/// the callbacks are counted where they wait).
const GRAPH_TOPIC: &str = "g";
const GRAPH_CALLBACKS: &str = "gcb";

/// A workflow step or batch child of the graph simulation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct GStep {
    step: u32,
    /// Fails every attempt (dead after the policy's last).
    fail: bool,
}

/// What the graph worker's handler saw.
#[derive(Default)]
struct GraphTracker {
    /// Runs started, by event id.
    runs: BTreeMap<String, u32>,
    violations: Vec<String>,
    checks: u64,
    /// Starts whose dependencies could not be read (an injected fault).
    unchecked: u64,
}

/// A workflow as published: each step's dependencies, rule and whether it fails.
struct GWorkflow {
    steps: Vec<(Vec<u32>, OnFailure, bool)>,
    certain: bool,
}

/// Workflows and batches published under faults beside the rest of the simulation, with their
/// own random stream (the other steps' choices stay those of their seed).
struct GraphSim {
    rng: Rng,
    queue: Arc<Queue<Db>>,
    callbacks: Arc<Queue<Db>>,
    graphs: Graphs<Db>,
    tracker: Arc<Mutex<GraphTracker>>,
    worker: Option<Worker>,
    workflows: BTreeMap<String, GWorkflow>,
    /// Batch id -> each child's `fail`, and whether its publication is known.
    batches: BTreeMap<String, (Vec<bool>, bool)>,
    next: u32,
}

/// A publication's outcome for the trace: `ok`, or the error's kind.
fn outcome<T>(result: &Result<T, TitoError>) -> String {
    match result {
        Ok(_) => "ok".into(),
        Err(err) => error_kind(err),
    }
}

fn graph_handler(
    tracker: Arc<Mutex<GraphTracker>>,
    graphs: Graphs<Db>,
) -> impl Fn(QueueEvent<GStep>) -> futures::future::BoxFuture<'static, tito::QueueHandlerResult<GStep>>
+ Send
+ Sync
+ 'static {
    move |event: QueueEvent<GStep>| {
        let (tracker, graphs) = (tracker.clone(), graphs.clone());
        Box::pin(async move {
            *tracker
                .lock()
                .unwrap()
                .runs
                .entry(event.id.clone())
                .or_default() += 1;
            // No step before its dependencies: each one ended as its rule requires.
            if let Some(of) = &event.workflow {
                match graphs.workflow(&of.workflow).await {
                    Ok(Some(state)) => {
                        let me = state.steps.iter().find(|s| s.name == of.step).unwrap();
                        let mut t = tracker.lock().unwrap();
                        for dep in &me.after {
                            let d = state.steps.iter().find(|s| &s.name == dep).unwrap();
                            let ok = matches!(
                                (&d.state, me.on_failure),
                                (InvocationState::Finished(Finished::Completed(_)), _)
                                    | (InvocationState::Finished(_), OnFailure::RunAnyway)
                            );
                            t.checks += 1;
                            if !ok {
                                t.violations.push(format!(
                                    "step {} of {} started while its dependency {dep} was {:?}",
                                    of.step, of.workflow, d.state
                                ));
                            }
                        }
                    }
                    _ => tracker.lock().unwrap().unchecked += 1,
                }
            }
            if event.payload.fail {
                return Err(TitoError::handler("this step fails"));
            }
            QueueHandlerOutcome::acknowledge_with(&event.payload.step)
        })
    }
}

impl GraphSim {
    /// Batch `id` with its callbacks, and its children (each failing or not): the same every
    /// time it is built (ids of their own), so a publication that failed can be repeated.
    fn batch_of(&self, id: &str, children: &[bool]) -> (Batch, Vec<QueueEvent<GStep>>) {
        let callback =
            |kind: &str| QueueEvent::now("cb", id.to_string()).with_id(format!("{id}.{kind}"));
        let batch = Batch::new(id)
            .on_complete(&self.callbacks, callback("complete"))
            .on_success(&self.callbacks, callback("success"))
            .on_death(&self.callbacks, callback("death"));
        let events = children
            .iter()
            .enumerate()
            .map(|(i, &fail)| {
                let step = GStep {
                    step: i as u32,
                    fail,
                };
                QueueEvent::now(format!("gk{i}"), step).with_id(format!("{id}.c{i}"))
            })
            .collect();
        (batch, events)
    }

    fn new(seed: u64, db: &Db) -> Self {
        let queue = |topic: &str| {
            Arc::new(Queue::new(
                db.clone(),
                QueueConfig::new(PARTITIONS, Duration::from_secs(3600)).topic(topic),
            ))
        };
        GraphSim {
            rng: Rng(seed ^ 0x6a09_e667_f3bc_c908),
            queue: queue(GRAPH_TOPIC),
            callbacks: queue(GRAPH_CALLBACKS),
            graphs: Graphs::new(db.clone()),
            tracker: Arc::default(),
            worker: None,
            workflows: BTreeMap::new(),
            batches: BTreeMap::new(),
            next: 0,
        }
    }

    fn start_worker(&mut self, window: Window) {
        let (stop, rx) = watch::channel(false);
        let config = WorkerConfig::new(0..PARTITIONS)
            .outcome_delay(window.delay)
            .outcome_batch(window.batch)
            .lease_duration(LEASE)
            .handler_timeout(HANDLER_TIMEOUT)
            .max_idle_backoff(Duration::from_millis(50))
            .concurrency(4)
            .failure_policy(failure_policy());
        let task = tokio::spawn(run_worker(
            self.queue.clone(),
            config,
            graph_handler(self.tracker.clone(), self.graphs.clone()),
            rx,
        ));
        self.worker = Some(Worker { stop, task });
    }

    /// One graph action: publish a workflow or a batch, start or crash the worker, or a fault
    /// on the graphs' keys.
    async fn step(&mut self, db: &Db) -> String {
        self.next += 1;
        let n = self.next;
        match self.rng.below(100) {
            0..=34 => {
                let id = format!("wf{n}");
                let count = 2 + self.rng.below(5) as u32;
                let mut steps = Vec::new();
                let mut workflow = Workflow::new(&id);
                for i in 0..count {
                    let mut after: Vec<u32> = (0..i).filter(|_| self.rng.chance(40)).collect();
                    after.truncate(3);
                    let rule = if self.rng.chance(30) {
                        OnFailure::RunAnyway
                    } else {
                        OnFailure::Cancel
                    };
                    let fail = self.rng.chance(12);
                    // Ids of its own: runs of one seed repeat exactly.
                    let event = QueueEvent::now(
                        format!("gk{}", self.rng.below(5)),
                        GStep { step: i, fail },
                    )
                    .with_id(format!("{id}.s{i}"));
                    workflow
                        .step(&StepName::<u32>::named(format!("s{i}")), &self.queue, event)
                        .after(after.iter().map(|d| format!("s{d}")))
                        .on_failure(rule);
                    steps.push((after, rule, fail));
                }
                let result = self.graphs.publish_workflow(&workflow).await;
                let certain = result.is_ok();
                self.workflows
                    .insert(id.clone(), GWorkflow { steps, certain });
                format!("graph workflow {id} ({count} steps): {}", outcome(&result))
            }
            35..=59 => {
                let id = format!("b{n}");
                let children: Vec<bool> = (0..1 + self.rng.below(6))
                    .map(|_| self.rng.chance(15))
                    .collect();
                let (batch, events) = self.batch_of(&id, &children);
                let result = self
                    .graphs
                    .publish_batch(&batch, &self.queue, &events)
                    .await;
                self.batches
                    .insert(id.clone(), (children.clone(), result.is_ok()));
                format!(
                    "graph batch {id} ({} children): {}",
                    children.len(),
                    outcome(&result)
                )
            }
            60..=74 => {
                if self.worker.is_none() {
                    let window = Window::pick(&mut self.rng);
                    self.start_worker(window);
                    format!("graph worker start {:?}/{}", window.delay, window.batch)
                } else {
                    "graph worker running".into()
                }
            }
            75..=84 => match self.worker.take() {
                Some(worker) => {
                    worker.task.abort();
                    "graph worker crash".into()
                }
                None => "graph worker none".into(),
            },
            _ => {
                const KEYS: [&str; 4] = [
                    "queue@g:pending:",
                    "batch-shard:",
                    "workflow-edge:",
                    "queue@g:waiting:",
                ];
                let data = KEYS[self.rng.below(KEYS.len() as u64) as usize];
                let fault = match self.rng.below(4) {
                    0 => Fault::Conflict,
                    1 => Fault::UnknownOutcomeCommitted,
                    2 => Fault::UnknownOutcomeNotCommitted,
                    _ => Fault::Storage,
                };
                let skip = self.rng.below(8);
                db.faults().add(
                    FaultRule::new(FaultPoint::Commit, fault)
                        .skip(skip)
                        .when_key_starts_with(data),
                );
                format!("graph fault {fault:?} after {skip} on {data}")
            }
        }
    }

    /// Without faults: a worker runs every graph to its end; then every invariant is checked.
    async fn finish(&mut self, db: &Db) -> (u64, Vec<String>) {
        if let Some(worker) = self.worker.take() {
            worker.task.abort();
        }
        self.start_worker(Window::NONE);
        // A batch whose publication failed part way is open: published again (as a caller
        // retries), it gets what is missing and closes.
        for (id, (children, certain)) in &self.batches {
            if !certain && self.graphs.batch(id).await.unwrap().is_some() {
                let (batch, events) = self.batch_of(id, children);
                self.graphs
                    .publish_batch(&batch, &self.queue, &events)
                    .await
                    .unwrap();
            }
        }
        let mut waited = Duration::ZERO;
        loop {
            let mut open = 0;
            for id in self.workflows.keys() {
                if let Some(state) = self.graphs.workflow(id).await.unwrap()
                    && !state.finished()
                {
                    open += 1;
                }
            }
            for id in self.batches.keys() {
                if let Some(state) = self.graphs.batch(id).await.unwrap()
                    && !state.finished()
                {
                    open += 1;
                }
            }
            if open == 0 || waited >= Duration::from_secs(120) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            waited += Duration::from_millis(200);
        }
        let worker = self.worker.take().unwrap();
        worker.stop.send(true).ok();
        let _ = tokio::time::timeout(HANDLER_TIMEOUT * 20, worker.task).await;
        let mut checks = 0;
        let mut violations = std::mem::take(&mut self.tracker.lock().unwrap().violations);
        let mut check = |holds: bool, what: &dyn Fn() -> String| {
            checks += 1;
            if !holds {
                violations.push(what());
            }
        };
        let runs = self.tracker.lock().unwrap().runs.clone();
        for (id, published) in &self.workflows {
            let Some(state) = self.graphs.workflow(id).await.unwrap() else {
                check(!published.certain, &|| {
                    format!("workflow {id} was published and is gone")
                });
                continue;
            };
            check(state.finished(), &|| {
                format!("workflow {id} never finished: {state:?}")
            });
            for (i, (after, rule, fail)) in published.steps.iter().enumerate() {
                let step = &state.steps[i];
                let ran = runs.get(&step.event_id).copied().unwrap_or(0);
                let deps_completed = after.iter().all(|d| {
                    matches!(
                        state.steps[*d as usize].state,
                        InvocationState::Finished(Finished::Completed(_))
                    )
                });
                match &step.state {
                    InvocationState::Finished(Finished::Completed(result)) => {
                        check(!fail && ran >= 1, &|| {
                            format!("{id} step {i} completed (fail {fail}, {ran} runs)")
                        });
                        check(result == &Some(serde_json::json!(i)), &|| {
                            format!("{id} step {i}'s result was lost: {result:?}")
                        });
                        check(deps_completed || *rule == OnFailure::RunAnyway, &|| {
                            format!("{id} step {i} completed after a failed dependency")
                        });
                    }
                    InvocationState::Finished(Finished::Cancelled(_)) => {
                        check(
                            ran == 0 && !deps_completed && *rule == OnFailure::Cancel,
                            &|| format!("{id} step {i} cancelled ({ran} runs, rule {rule:?})"),
                        );
                    }
                    InvocationState::Finished(Finished::Dead { .. }) => {
                        check(*fail, &|| format!("{id} step {i} died though it succeeds"));
                    }
                    other => check(false, &|| format!("{id} step {i} ended {other:?}")),
                }
            }
        }
        // Callbacks, counted where they wait (the callback queue has no worker).
        let mut calls: BTreeMap<(String, BatchCallback), Vec<BatchCounts>> = BTreeMap::new();
        let tx = db.begin().await.unwrap();
        let prefix = format!("queue@{GRAPH_CALLBACKS}:pending:");
        for (_, value) in scan_all(&tx, prefix.as_bytes()).await {
            let row: serde_json::Value = serde_json::from_slice(&value).unwrap();
            let done: BatchDone<String> = serde_json::from_value(row["payload"].clone()).unwrap();
            calls
                .entry((done.batch, done.callback))
                .or_default()
                .push(done.counts);
        }
        tx.rollback().await.unwrap();
        for (id, (children, certain)) in &self.batches {
            let Some(state) = self.graphs.batch(id).await.unwrap() else {
                check(!certain, &|| {
                    format!("batch {id} was published and is gone")
                });
                continue;
            };
            let dead = children.iter().filter(|f| **f).count() as u64;
            let c = state.counts;
            check(
                state.finished()
                    && c.added == children.len() as u64
                    && c.dead == dead
                    && c.completed == children.len() as u64 - dead,
                &|| format!("batch {id}: {state:?}, {dead} should die"),
            );
            let count = |kind| calls.get(&(id.clone(), kind)).map_or(0, Vec::len);
            check(count(BatchCallback::Complete) == 1, &|| {
                format!(
                    "batch {id}: {} complete callbacks",
                    count(BatchCallback::Complete)
                )
            });
            check(
                count(BatchCallback::Success) == usize::from(dead == 0),
                &|| {
                    format!(
                        "batch {id}: {} success callbacks, {dead} dead",
                        count(BatchCallback::Success)
                    )
                },
            );
            check(
                count(BatchCallback::Death) == usize::from(dead > 0),
                &|| {
                    format!(
                        "batch {id}: {} death callbacks, {dead} dead",
                        count(BatchCallback::Death)
                    )
                },
            );
            if let Some(told) = calls.get(&(id.clone(), BatchCallback::Complete)) {
                check(told[0] == c, &|| {
                    format!("batch {id} told {:?}, has {c:?}", told[0])
                });
            }
        }
        let t = self.tracker.lock().unwrap();
        (checks + t.checks, violations)
    }
}

/// Store moves in the simulation: the store as it is now is read by the simulation's own
/// paging into a frozen source (with runs of keys a copy skips planted between its keys), then
/// copied or migrated with a random batch (1 included) and byte bound, into a fresh destination
/// or over the last one (a catch-up or an overwrite), sometimes killed part way and resumed.
/// The oracle shares nothing with the copy's ranges: every key the source holds, but for the
/// copy record, the moved marker and holder keys, is in the destination with its value, and
/// nothing else is; the destination's own holder keys stay.
struct MoveSim {
    rng: Rng,
    destination: Option<Memory>,
}

fn move_store() -> Memory {
    Memory::with_options(
        MemoryOptions::new()
            .clock(MemoryClock::Runtime { epoch_ms: EPOCH_MS })
            .partitions(PARTITIONS),
    )
    .unwrap()
}

impl MoveSim {
    async fn step(&mut self, live: &Memory) -> (String, Option<String>) {
        use tito::store::{CopyOptions, Existing, MigrateOptions};
        // The frozen source: the live store's keys, and runs of skipped keys among them.
        let mut keys = crate::support::every_key(live).await;
        let migrate = self.rng.chance(30);
        let runs = self.rng.below(4);
        for run in 0..runs {
            let length = if self.rng.chance(20) {
                300 + self.rng.below(1200)
            } else {
                1 + self.rng.below(20)
            };
            let at = ["", "queue:", "queue@c:", "table:", "zz"][self.rng.below(5) as usize];
            for i in 0..length {
                let key = match self.rng.below(3) {
                    0 => format!("{at}queue:lease:{run}{i:05}"),
                    1 => format!("queue@m{run}:lease-expiry:{i:05}"),
                    _ => format!("queue@m{run}:report:{i:05}"),
                };
                keys.insert(key.into_bytes(), b"holder".to_vec());
            }
        }
        if !migrate && self.rng.chance(30) {
            keys.insert(b"store-moved".to_vec(), b"{}".to_vec());
        }
        let source = move_store();
        let pairs: Vec<(Vec<u8>, Vec<u8>)> = keys.clone().into_iter().collect();
        crate::support::put_all(&source, &pairs).await;
        let batch = match self.rng.below(5) {
            0 => 1,
            1 => 1 + self.rng.below(8) as usize,
            2 | 3 => 1 + self.rng.below(300) as usize,
            _ => 1000,
        };
        let bytes = if self.rng.chance(25) {
            1 + self.rng.below(2000) as usize
        } else {
            4 << 20
        };
        // Over the last destination (a catch-up or an overwrite), or a fresh one; the
        // destination holds a lease of its own and a key the source lacks.
        let reuse = self.destination.is_some() && self.rng.chance(50);
        let destination = match (reuse, self.destination.take()) {
            (true, Some(old)) => old,
            _ => {
                let fresh = move_store();
                if self.rng.chance(50) {
                    fresh
                        .transaction(|tx| async move {
                            tx.put(b"queue:lease:9999".to_vec(), b"theirs".to_vec())
                                .await?;
                            tx.put(b"zzzz-stale".to_vec(), b"1".to_vec()).await
                        })
                        .await
                        .unwrap();
                }
                fresh
            }
        };
        let theirs_before = crate::support::read(&destination, b"queue:lease:9999").await;
        let existing = if reuse && self.rng.chance(50) {
            Existing::Resume
        } else {
            Existing::Overwrite
        };
        let options = CopyOptions::new()
            .batch(batch)
            .batch_bytes(bytes)
            .existing(existing);
        let kill_after = if self.rng.chance(30) {
            Some(self.rng.below(6))
        } else {
            None
        };
        let what = format!(
            "{} batch {batch} bytes {bytes} {existing:?} runs {runs} kill {kill_after:?}",
            if migrate { "migrate" } else { "copy" }
        );
        let result = if migrate {
            tito::store::migrate(
                &source,
                &destination,
                MigrateOptions::new("sim").copy(options),
                |_| {},
            )
            .await
            .map(|_| ())
        } else {
            let mut run = options.clone();
            if let Some(kill_after) = kill_after {
                // Killed: the copy's future is dropped after `kill_after` ranges (a kill
                // stops it between any two awaits).
                let stop = Arc::new(tokio::sync::Notify::new());
                let fire = stop.clone();
                let mut ranges = 0;
                let first = tito::store::copy(&source, &destination, options.clone(), move |_| {
                    ranges += 1;
                    if ranges > kill_after {
                        fire.notify_one();
                    }
                });
                let killed = tokio::select! {
                    biased;
                    _ = stop.notified() => None,
                    done = first => Some(done),
                };
                if let Some(Err(err)) = killed {
                    return (
                        format!("move {what}: failed"),
                        Some(format!("move {what}: the copy failed: {err}")),
                    );
                }
                // Killed (or finished): resumed from its cursor.
                run = options.existing(Existing::Resume);
            }
            tito::store::copy(&source, &destination, run, |_| {})
                .await
                .map(|_| ())
        };
        if let Err(err) = result {
            return (
                format!("move {what}: failed"),
                Some(format!("move {what}: {err}")),
            );
        }
        let copied = crate::support::every_key(&destination).await;
        let want = crate::support::carried(&keys, false);
        let got = crate::support::carried(&copied, false);
        let mut violation = None;
        if want != got {
            let missing = want.keys().filter(|k| got.get(*k) != want.get(*k)).count();
            let extra = got.keys().filter(|k| !want.contains_key(*k)).count();
            violation = Some(format!(
                "move {what}: {} keys to carry, {} carried, {missing} missing or different, \
                 {extra} extra",
                want.len(),
                got.len()
            ));
        } else if crate::support::read(&destination, b"queue:lease:9999").await != theirs_before {
            violation = Some(format!(
                "move {what}: the destination's own holder key changed"
            ));
        }
        self.destination = Some(destination);
        (format!("move {what}: {} keys", want.len()), violation)
    }
}
