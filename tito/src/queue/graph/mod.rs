//! Job graphs: workflows (steps that become due when the steps they depend on completed) and
//! batches (groups of invocations whose end runs callbacks exactly once).
//!
//! Both live in the store beside the queues. Publishing a graph is one transaction (the
//! caller's, or one of its own). A step's or a child's end is written by the transaction that
//! completes, buries or cancels it as an **end record** of its own (`graph-end:..`, a key no
//! other transaction writes), and **folded** into its graph by a transaction that follows:
//! the fold reads the graph's end records, applies them (a batch's counts and callbacks, a
//! workflow's dependents), and deletes them, all at once. So the transactions that end a
//! graph's members never write a key in common (sixteen handlers completing children of one
//! batch, two dependencies of one step ending at once, a batch taking children while its
//! earlier ones complete: none conflicts with another), and a fold applies each end exactly
//! once (it deletes what it applied in the transaction that applies it; two folds of one graph
//! write the same records, so one of them retries).
//!
//! Folds run in the process that committed the end, one task per process and store (its
//! `fold::Folder`), right after the commit; an end whose fold did not run (the process
//! crashed after the commit, the commit's outcome was unknown) is found and folded by the
//! workers' maintenance pass (at a worker's start, then every `maintenance_interval`). Readers
//! count end records not folded yet, so a batch's counts and whether it finished are exact at
//! any time; a dependent's release and a callback's publication follow the end by one fold.
//!
//! - A workflow step with dependencies waits as a row of its own (`{queue}:waiting:..`); one
//!   edge key per dependency names it. The fold of a dependency's end reads the edges and
//!   rewrites (or releases) each waiting row it names: a step is never released twice or
//!   missed (no write skew on any engine: two folds that touch one waiting row both write it).
//! - A batch counts its children added per shard (a child's shard is its partition), written
//!   by the additions only; the ends folded so far are counted in its record. A close writes
//!   the batch's closed key and an end record of its own, folded like a child's end: an
//!   addition locks the closed key, so a close and an addition never both commit unseen by
//!   each other, and neither additions nor closes write what folds write (an addition writes
//!   the record only when a shard gets its first child). Every decision to fire is taken by a
//!   transaction that writes the record (a fold; a cancel's end), so two never miss each
//!   other: the one that finds a closed batch's children all ended inserts the callbacks and
//!   marks them fired, in that transaction. `close_batch` and `publish_batch` fold the close
//!   before they return; a batch opened, filled and closed in one transaction
//!   (`publish_batch_in_tx`) is closed in it at once.

pub(crate) mod batch;
mod ends;
/// Folding graph ends (see the module): internal, public with the `test-util` feature for
/// tests that drop the folds a crash would lose.
#[cfg(feature = "test-util")]
pub mod fold;
#[cfg(not(feature = "test-util"))]
pub(crate) mod fold;
pub(crate) mod workflow;

use std::sync::Arc;

use serde::Serialize;

use crate::engine::{TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::event::StoredEvent;
use crate::keys;
use crate::queue::{Queue, TopicQueue};

pub(crate) use crate::event::links::{BatchLink, StepLink};
pub use crate::event::links::{OnFailure, StepOf};
pub(crate) use workflow::cancel_waiting;

pub use batch::{
    Batch, BatchCallback, BatchCounts, BatchDone, BatchState, BatchSummary, MAX_BATCH_CALLBACKS,
};
pub use workflow::{
    MAX_STEP_DEPENDENCIES, MAX_WORKFLOW_STEPS, StepBuilder, StepName, StepState, Workflow,
    WorkflowPublished, WorkflowState, WorkflowSummary,
};

/// The longest workflow id, step name or batch id, in bytes.
pub const MAX_GRAPH_NAME: usize = 256;

/// How an invocation ended, as its graph sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Finish {
    Completed,
    Cancelled,
    Dead,
}

/// What to do once a transaction that changed graphs has committed.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Wake {
    /// Wake the workers of a partition that got due rows.
    Due { root: String, partition: u32 },
    /// Fold a graph's end records.
    Fold(ends::GraphRef),
}

impl Wake {
    /// The partition `partition` of the queue at `root`.
    pub fn due(root: &str, partition: u32) -> Self {
        Wake::Due {
            root: root.to_string(),
            partition,
        }
    }
}

/// When an invocation's end is applied to its graphs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Apply {
    /// By a fold after the commit: a worker's outcomes, so that its transactions never write
    /// a key in common.
    Folded,
    /// In the transaction that ended it: cancellations and erasures, whose callers read the
    /// cascade (a dependent cancelled, a callback due) right after their commit.
    Now,
}

/// Applies an invocation's end to its graphs inside `tx` (the transaction that ended it),
/// now or as an end record per graph (its batch, its workflow) folded once `tx` commits (see
/// the module). Returns what to do after the commit.
pub(crate) async fn finished<X: TitoTransaction>(
    tx: &X,
    root: &str,
    stored: &StoredEvent,
    how: Finish,
    apply: Apply,
) -> TitoResult<Vec<Wake>> {
    let mut wakes = Vec::new();
    if let Some(link) = &stored.batch {
        match apply {
            Apply::Folded => {
                batch::child_ended(tx, root, &stored.id, link, how, &mut wakes).await?
            }
            Apply::Now => batch::child_ended_now(tx, &link.id, how, &mut wakes).await?,
        }
    }
    if let Some(link) = &stored.step {
        match apply {
            Apply::Folded => workflow::step_ended(tx, link, how, &mut wakes).await?,
            Apply::Now => {
                workflow::step_finished(tx, &link.workflow, &link.step, how, &mut wakes).await?
            }
        }
    }
    Ok(wakes)
}

/// The graphs among `wakes` (to fold once their transaction committed).
pub(crate) fn folds_in(wakes: &[Wake]) -> Vec<ends::GraphRef> {
    wakes
        .iter()
        .filter_map(|wake| match wake {
            Wake::Fold(graph) => Some(graph.clone()),
            Wake::Due { .. } => None,
        })
        .collect()
}

/// Folds `graphs` now, their ends committed (a cancel's or a close's, whose caller reads the
/// cascade when the call returns); what fails is left to the background fold and the
/// maintenance.
pub(crate) async fn fold_now<E: TitoEngine>(db: &E, mut graphs: Vec<ends::GraphRef>) {
    graphs.sort();
    graphs.dedup();
    while !graphs.is_empty() {
        match fold::fold(db, &graphs).await {
            Ok(more) => graphs = more,
            Err(err) => {
                tracing::warn!(error = %err, "folding graph ends failed; they are folded later");
                fold::request(db, graphs);
                return;
            }
        }
    }
}

/// Wakes this process's workers of the partitions among `wakes` once `tx` commits, and folds
/// the graphs among them.
pub(crate) fn wake_after_commit<E: TitoEngine, X: TitoTransaction>(
    db: &E,
    tx: &X,
    wakes: Vec<Wake>,
) {
    let mut folds = Vec::new();
    for wake in wakes {
        match wake {
            Wake::Due { root, partition } => {
                crate::event::nudge::wakeups(db, &root).wake_after_commit(tx, partition)
            }
            Wake::Fold(graph) => folds.push(graph),
        }
    }
    if !folds.is_empty() {
        let db = db.clone();
        tx.after_commit(Box::new(move || fold::request(&db, folds)));
    }
}

/// A queue a graph's step or child (or a batch's callback) is published to: a [`Queue`]
/// takes events of any type, a [`TopicQueue`] only its own, so a step of the wrong type does
/// not compile.
pub trait GraphQueue<T> {
    #[doc(hidden)]
    fn graph_target(&self) -> Target;
}

/// Where a graph's invocation goes (a queue's root and partition count).
#[doc(hidden)]
#[derive(Clone, Debug)]
pub struct Target {
    pub(crate) root: String,
    pub(crate) partitions: u32,
}

impl<E: TitoEngine, T: Serialize> GraphQueue<T> for Queue<E> {
    fn graph_target(&self) -> Target {
        Target {
            root: self.root().to_string(),
            partitions: self.config().partitions,
        }
    }
}

impl<E: TitoEngine, T: Serialize> GraphQueue<T> for TopicQueue<E, T> {
    fn graph_target(&self) -> Target {
        GraphQueue::<T>::graph_target(&**self.queue())
    }
}

impl<T, Q: GraphQueue<T> + ?Sized> GraphQueue<T> for Arc<Q> {
    fn graph_target(&self) -> Target {
        (**self).graph_target()
    }
}

impl<T, Q: GraphQueue<T> + ?Sized> GraphQueue<T> for &Q {
    fn graph_target(&self) -> Target {
        (**self).graph_target()
    }
}

/// A graph record at `key` that does not decode.
pub(crate) fn malformed(what: &str, key: &[u8], err: impl std::fmt::Display) -> TitoError {
    TitoError::Integrity(format!(
        "{what} {} is malformed: {err}",
        keys::display_key(key)
    ))
}

/// A graph record (`what`, stored at `key`) decoded, or an integrity error naming it.
pub(crate) fn parse<T: serde::de::DeserializeOwned>(
    what: &str,
    key: &[u8],
    bytes: &[u8],
) -> TitoResult<T> {
    serde_json::from_slice(bytes).map_err(|err| malformed(what, key, err))
}

/// Up to `limit` (1 to 1000) records under `prefix` (each key: the prefix, then an id encoded
/// as a string segment), from `start`: their ids, keys and values. `what` names a page in
/// errors.
pub(crate) async fn page<E: TitoEngine>(
    db: &E,
    what: &str,
    prefix: &str,
    start: String,
    limit: usize,
) -> TitoResult<Vec<(String, Vec<u8>, Vec<u8>)>> {
    if limit == 0 || limit > 1000 {
        return Err(TitoError::invalid_argument(format!(
            "a page of {what} holds 1 to 1000; {limit} asked"
        )));
    }
    let end = keys::prefix_end(prefix.to_string());
    let rows = crate::engine::read_only(db, async |tx| {
        tx.scan(start.as_bytes(), end.as_bytes(), limit).await
    })
    .await?;
    rows.into_iter()
        .map(|(key, value)| {
            let id = keys::decode_str(&keys::key_str(&key)?[prefix.len()..])?;
            Ok((id, key, value))
        })
        .collect()
}

/// Refuses a graph cancellation's reason over
/// [`MAX_CANCEL_REASON`](crate::queue::MAX_CANCEL_REASON) bytes.
pub(crate) fn check_reason(why: &str) -> TitoResult<()> {
    let max = crate::queue::MAX_CANCEL_REASON;
    if why.len() > max {
        return Err(TitoError::invalid_argument(format!(
            "a cancellation's reason holds at most {max} bytes; {} given",
            why.len()
        )));
    }
    Ok(())
}

/// Refuses an empty or overlong workflow id, step name or batch id.
pub(crate) fn check_name(what: &str, name: &str) -> TitoResult<()> {
    if name.is_empty() {
        return Err(TitoError::invalid_argument(format!("{what} is empty")));
    }
    if name.len() > MAX_GRAPH_NAME {
        return Err(TitoError::invalid_argument(format!(
            "{what} {:?}… is {} bytes; at most {MAX_GRAPH_NAME}",
            name.chars().take(32).collect::<String>(),
            name.len()
        )));
    }
    Ok(())
}

/// [`check_name`], and for a name being created: no control characters (a newline or tab in
/// an id would break the lines the CLI prints and an operator runs).
pub(crate) fn check_new_name(what: &str, name: &str) -> TitoResult<()> {
    check_name(what, name)?;
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return Err(TitoError::invalid_argument(format!(
            "{what} {name:?} holds the control character {c:?}: use printable characters"
        )));
    }
    Ok(())
}

/// The store's workflows and batches: publish, read, cancel, and read a step's dependencies'
/// results. Cheap to clone; every handle on one store sees the same graphs.
#[derive(Clone, Debug)]
pub struct Graphs<E> {
    db: E,
}

/// Graph records [`Graphs::expire`] looks at per page.
const EXPIRE_PAGE: usize = 256;

/// Where a worker's maintenance goes on expiring graphs ([`Graphs::expire_step`]): the next
/// workflow and batch records to look at (`None`: the first).
#[derive(Clone, Debug, Default)]
pub struct GraphSweep {
    workflows: Option<String>,
    batches: Option<String>,
}

/// The publication time a workflow's and a batch's record both carry.
#[derive(serde::Deserialize)]
struct Created {
    created_ms: u64,
}

/// The two kinds of graph record retention deletes.
#[derive(Clone, Copy)]
enum Kind {
    Workflows,
    Batches,
}

impl Kind {
    fn prefix(self) -> String {
        match self {
            Kind::Workflows => keys::workflow_prefix(),
            Kind::Batches => keys::batch_prefix(),
        }
    }

    /// What a page of them is called in errors.
    fn what(self) -> &'static str {
        match self {
            Kind::Workflows => "workflows",
            Kind::Batches => "batches",
        }
    }
}

/// What [`Graphs::expire`] deleted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Expired {
    /// Finished workflows deleted with their step records.
    pub workflows: usize,
    /// Finished batches deleted with their counts.
    pub batches: usize,
}

impl<E: TitoEngine> Graphs<E> {
    /// Deletes the records of workflows and batches that finished and were published more
    /// than `older_than` ago (on the store's clock): a workflow whose every step finished (or
    /// whose completed rows retention deleted), a closed batch whose every child ended (its
    /// callbacks fired with its last child). Unfinished ones are kept however old. Reads every
    /// record in pages of 256; `tito gc` runs it with its retention.
    pub async fn expire(&self, older_than: std::time::Duration) -> TitoResult<Expired> {
        let before_ms = self.expiry_bound(older_than).await?;
        Ok(Expired {
            workflows: self.expire_each(Kind::Workflows, before_ms).await?,
            batches: self.expire_each(Kind::Batches, before_ms).await?,
        })
    }

    /// One step of [`Self::expire`] for a worker's maintenance
    /// ([`WorkerConfig::expire_graphs`](crate::queue::WorkerConfig::expire_graphs)): looks at
    /// up to 256 workflows and as many batches from where `sweep` stopped, deletes
    /// the finished ones published more than `older_than` ago, and moves `sweep` on (back to
    /// the first record once it reached the last). Answers what it deleted and whether more
    /// records follow the pages it read.
    pub async fn expire_step(
        &self,
        older_than: std::time::Duration,
        sweep: &mut GraphSweep,
    ) -> TitoResult<(Expired, bool)> {
        let before_ms = self.expiry_bound(older_than).await?;
        let mut more = false;
        let mut step = async |kind: Kind, after: &mut Option<String>| {
            let start = after.take().unwrap_or_else(|| kind.prefix());
            let (expired, next) = self.expire_page(kind, start, before_ms).await?;
            more |= next.is_some();
            *after = next;
            Ok::<_, TitoError>(expired)
        };
        let expired = Expired {
            workflows: step(Kind::Workflows, &mut sweep.workflows).await?,
            batches: step(Kind::Batches, &mut sweep.batches).await?,
        };
        Ok((expired, more))
    }

    /// The publication time (store clock, ms) before which a finished graph is old enough.
    async fn expiry_bound(&self, older_than: std::time::Duration) -> TitoResult<u64> {
        let now_ms = crate::engine::read_only(&self.db, async |tx| {
            Ok(crate::engine::version_millis(tx.start_version()))
        })
        .await?;
        Ok(now_ms.saturating_sub(crate::util::millis(older_than)))
    }

    /// Expires the finished records of `kind` published before `before_ms`, every page of
    /// them; answers how many it expired.
    async fn expire_each(&self, kind: Kind, before_ms: u64) -> TitoResult<usize> {
        let mut expired = 0;
        let mut start = kind.prefix();
        loop {
            let (n, next) = self.expire_page(kind, start, before_ms).await?;
            expired += n;
            match next {
                Some(next) => start = next,
                None => return Ok(expired),
            }
        }
    }

    /// Expires the finished records of `kind` published before `before_ms` among one page of
    /// [`EXPIRE_PAGE`] from `start`; answers how many it expired and where the next page
    /// starts (`None`: this was the last).
    async fn expire_page(
        &self,
        kind: Kind,
        start: String,
        before_ms: u64,
    ) -> TitoResult<(usize, Option<String>)> {
        let page = page(&self.db, kind.what(), &kind.prefix(), start, EXPIRE_PAGE).await?;
        let mut expired = 0;
        let mut next = None;
        for (id, key, value) in &page {
            next = Some(keys::key_after(keys::key_str(key)?.to_string()));
            // Too young by the record's own time: its steps or children are not read.
            let young = serde_json::from_slice::<Created>(value)
                .is_ok_and(|record| record.created_ms >= before_ms);
            if young {
                continue;
            }
            let gone = match kind {
                Kind::Workflows => self.expire_workflow(id, before_ms).await?,
                Kind::Batches => self.expire_batch(id, before_ms).await?,
            };
            expired += usize::from(gone);
        }
        Ok((expired, next.filter(|_| page.len() == EXPIRE_PAGE)))
    }

    /// Deletes workflow `id`'s records when it finished and was published before
    /// `before_ms`.
    async fn expire_workflow(&self, id: &str, before_ms: u64) -> TitoResult<bool> {
        match self.workflow(id).await? {
            Some(state) if state.created_ms < before_ms && state.finished() => {}
            _ => return Ok(false),
        }
        let id = id.to_string();
        self.db
            .transaction(|tx| {
                let id = id.clone();
                async move {
                    // Finished is final: nothing writes a finished workflow's records again.
                    tx.delete(keys::workflow_key(&id).into_bytes()).await?;
                    for prefix in [
                        keys::workflow_step_prefix(&id),
                        keys::workflow_edges_prefix(&id),
                        keys::graph_end_prefix(ends::WORKFLOW, &id),
                    ] {
                        for (key, _) in crate::queue::scan_prefix(&tx, &prefix).await? {
                            tx.delete(key).await?;
                        }
                    }
                    Ok::<_, TitoError>(true)
                }
            })
            .await
    }

    /// Deletes batch `id`'s records when it finished and was opened before `before_ms`.
    async fn expire_batch(&self, id: &str, before_ms: u64) -> TitoResult<bool> {
        match self.batch(id).await? {
            Some(state) if state.created_ms < before_ms && state.finished() => {}
            _ => return Ok(false),
        }
        let id = id.to_string();
        self.db
            .transaction(|tx| {
                let id = id.clone();
                async move {
                    // An end not folded yet may still fire a callback: the next pass.
                    if !ends::ends_of(&tx, ends::BATCH, &id).await?.is_empty() {
                        return Ok(false);
                    }
                    tx.delete(keys::batch_key(&id).into_bytes()).await?;
                    tx.delete(keys::batch_closed_key(&id).into_bytes()).await?;
                    for prefix in [keys::batch_shard_prefix(&id), keys::batch_child_prefix(&id)] {
                        for (key, _) in crate::queue::scan_prefix(&tx, &prefix).await? {
                            tx.delete(key).await?;
                        }
                    }
                    Ok::<_, TitoError>(true)
                }
            })
            .await
    }

    /// The graphs of the store `db`.
    pub fn new(db: E) -> Self {
        Graphs { db }
    }

    /// The store.
    pub fn engine(&self) -> &E {
        &self.db
    }
}
