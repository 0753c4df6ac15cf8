//! Batches: children added at once or over time, up to a close, and callbacks that run exactly
//! once when every child ended, when every child completed, or when the first one died.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{BatchLink, Finish, GraphQueue, Graphs, Target, Wake, check_name, page, parse};
use crate::engine::{self, TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::event::publish::{check_meta, insert_pending};
use crate::event::{Published, QueueEvent, StoredEvent, partition_for};
use crate::keys;
use crate::queue::unique::{self, ToPublish};
use crate::queue::{MAX_PUBLISH_IN_TX, scan_prefix};

/// The most callbacks a batch has.
pub const MAX_BATCH_CALLBACKS: usize = 16;

/// Children cancelled per transaction by [`Graphs::cancel_batch`].
pub(crate) const CANCEL_BATCH: usize = 128;

/// When a batch's callback runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum BatchCallback {
    /// Once the batch is closed and every child ended: completed, cancelled or dead.
    Complete,
    /// Once the batch is closed and every child completed (never, if one was cancelled or
    /// died).
    Success,
    /// When the first child dies (a failure policy gave up on it), closed or not.
    Death,
}

/// A batch's children by how they ended, as a callback is told them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct BatchCounts {
    /// Children added.
    pub added: u64,
    /// Children that completed.
    pub completed: u64,
    /// Children cancelled (by a cancel, their owner's, their workflow's or the batch's).
    pub cancelled: u64,
    /// Children a failure policy moved to the dead state.
    pub dead: u64,
}

impl BatchCounts {
    /// Children that have not ended.
    pub fn open(&self) -> u64 {
        self.added
            .saturating_sub(self.completed + self.cancelled + self.dead)
    }
}

/// The payload of a batch's callback: which batch and callback, the counts when it fired, and
/// the context given with the callback. A callback's queue takes `BatchDone<P>` events.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct BatchDone<P> {
    /// The batch's id.
    pub batch: String,
    /// Which callback this is.
    pub callback: BatchCallback,
    /// The children by how they ended, when it fired.
    pub counts: BatchCounts,
    /// The payload of the event given with the callback.
    pub context: P,
}

/// A batch: children published to queues of one store, added at once
/// ([`Graphs::publish_batch`]) or over time ([`Graphs::add_to_batch`]) until it is closed,
/// and callbacks, each an event published once when its condition holds, in the transaction
/// that made it hold.
#[derive(Clone, Debug)]
pub struct Batch {
    id: String,
    callbacks: Vec<CallbackDecl>,
    refused: Option<String>,
    numbered: bool,
}

#[derive(Clone, Debug)]
struct CallbackDecl {
    kind: BatchCallback,
    target: Target,
    stored: Option<StoredEvent>,
}

impl Batch {
    /// A batch named `id` (its name in the store) without callbacks.
    pub fn new(id: impl Into<String>) -> Self {
        Batch {
            id: id.into(),
            callbacks: Vec::new(),
            refused: None,
            numbered: false,
        }
    }

    /// The batch's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Gives the children of [`Graphs::publish_batch`] and [`Graphs::publish_batch_in_tx`] the
    /// event ids `{batch id}.{n}`, `n` their position in the list from 0, whatever ids their
    /// events carry. A publication repeated after a failure then adds exactly what is missing
    /// also when the children were built with fresh ids ([`QueueEvent::now`] makes a new one
    /// each call), as long as the list is the same in the same order. (Children added with
    /// [`Graphs::add_to_batch`] keep their own ids.)
    ///
    /// ```
    /// use tito::queue::graph::Batch;
    /// use tito::QueueEvent;
    ///
    /// let batch = Batch::new("nightly-2026-12-06").numbered();
    /// // Built anew by each run of the job: child 0 is "nightly-2026-12-06.0" each time.
    /// let children: Vec<QueueEvent<u32>> =
    ///     (0..5000).map(|doc| QueueEvent::now(format!("doc-{doc}"), doc)).collect();
    /// # let _ = (batch, children);
    /// ```
    pub fn numbered(mut self) -> Self {
        self.numbered = true;
        self
    }

    /// The checked children of a whole-list publication, numbered when the batch says so.
    fn children<T: Serialize>(
        &self,
        events: &[QueueEvent<T>],
        one_tx: bool,
    ) -> TitoResult<Vec<ToPublish>> {
        let mut items = checked(events, one_tx)?;
        if self.numbered {
            for (n, item) in items.iter_mut().enumerate() {
                item.stored.id = format!("{}.{n}", self.id);
                item.bytes = item.stored.to_bytes()?;
            }
        }
        Ok(items)
    }

    /// Publishes `event` to `queue` once every child ended (see [`BatchCallback::Complete`]),
    /// its payload wrapped in a [`BatchDone`].
    pub fn on_complete<P: Serialize>(
        self,
        queue: &impl GraphQueue<BatchDone<P>>,
        event: QueueEvent<P>,
    ) -> Self {
        self.callback(BatchCallback::Complete, queue.graph_target(), event)
    }

    /// Publishes `event` to `queue` once every child completed ([`BatchCallback::Success`]).
    pub fn on_success<P: Serialize>(
        self,
        queue: &impl GraphQueue<BatchDone<P>>,
        event: QueueEvent<P>,
    ) -> Self {
        self.callback(BatchCallback::Success, queue.graph_target(), event)
    }

    /// Publishes `event` to `queue` when the first child dies ([`BatchCallback::Death`]).
    pub fn on_death<P: Serialize>(
        self,
        queue: &impl GraphQueue<BatchDone<P>>,
        event: QueueEvent<P>,
    ) -> Self {
        self.callback(BatchCallback::Death, queue.graph_target(), event)
    }

    fn callback<P: Serialize>(
        mut self,
        kind: BatchCallback,
        target: Target,
        event: QueueEvent<P>,
    ) -> Self {
        let stored = match StoredEvent::from_event(&event) {
            Ok(stored) => Some(stored),
            Err(err) => {
                self.refused
                    .get_or_insert_with(|| format!("its {kind:?} callback: {err}"));
                None
            }
        };
        self.callbacks.push(CallbackDecl {
            kind,
            target,
            stored,
        });
        self
    }

    /// Checks the batch; the callbacks' stored forms with room for any counts.
    fn check(&self) -> TitoResult<Vec<StoredCallback>> {
        let refuse = |why: String| {
            TitoError::invalid_argument(format!("batch {:?}: {why}; nothing was written", self.id))
        };
        super::check_new_name("a batch id", &self.id)?;
        if let Some(why) = &self.refused {
            return Err(refuse(why.clone()));
        }
        if self.callbacks.len() > MAX_BATCH_CALLBACKS {
            return Err(refuse(format!(
                "{} callbacks; at most {MAX_BATCH_CALLBACKS}",
                self.callbacks.len()
            )));
        }
        let mut ids = HashSet::new();
        let mut out = Vec::with_capacity(self.callbacks.len());
        for callback in &self.callbacks {
            let event = callback.stored.clone().expect("checked above");
            if !ids.insert((callback.target.root.clone(), event.id.clone())) {
                return Err(refuse(format!(
                    "two callbacks have event id {:?} in one queue",
                    event.id
                )));
            }
            let stored = StoredCallback {
                kind: callback.kind,
                q: callback.target.root.clone(),
                p: callback.target.partitions,
                event,
            };
            // The event it will publish, with the largest counts: it must fit when it fires.
            let most = BatchCounts {
                added: u64::MAX,
                completed: u64::MAX,
                cancelled: u64::MAX,
                dead: u64::MAX,
            };
            stored
                .fired(&self.id, most, 0)
                .to_bytes()
                .map_err(|err| refuse(format!("its {:?} callback: {err}", callback.kind)))?;
            out.push(stored);
        }
        Ok(out)
    }
}

/// A batch's record: its callbacks, whether it is closed, the ends folded so far, how many
/// shards have open children by the counts of versions before end records.
#[derive(Serialize, Deserialize)]
struct BatchRecord {
    created_ms: u64,
    #[serde(default)]
    closed: bool,
    /// Shards whose `open` count is above zero. Kept by additions for versions before end
    /// records (which end children by their shard's counts and fire when it reaches zero);
    /// this version fires by the counts.
    #[serde(default)]
    busy: u32,
    /// The children's ends folded into the record (`added` unused: additions count in the
    /// shards).
    #[serde(default)]
    folded: BatchCounts,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    callbacks: Vec<StoredCallback>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    fired: Vec<BatchCallback>,
}

/// A callback as the record keeps it: its kind, queue (root, partition count) and event.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct StoredCallback {
    kind: BatchCallback,
    q: String,
    p: u32,
    event: StoredEvent,
}

impl StoredCallback {
    /// The event it publishes for batch `id` with `counts`, due at the later of its own due
    /// time and `now_s`.
    fn fired(&self, id: &str, counts: BatchCounts, now_s: i64) -> StoredEvent {
        let mut event = self.event.clone();
        event.payload = serde_json::json!({
            "batch": id,
            "callback": self.kind,
            "counts": counts,
            "context": event.payload,
        });
        event.timestamp = event.timestamp.max(now_s);
        event
    }
}

/// One shard's counts.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
struct ShardCounts {
    open: u64,
    #[serde(flatten)]
    counts: BatchCounts,
}

/// A child's record: its queue and event id (kept until the batch expires).
#[derive(Serialize, Deserialize)]
pub(crate) struct ChildRecord {
    pub(crate) q: String,
    pub(crate) id: String,
}

/// A batch's counts: its shards' (children added, and ended by versions before end records)
/// and the ends folded into `record`.
async fn totals<X: TitoTransaction>(
    tx: &X,
    id: &str,
    record: &BatchRecord,
) -> TitoResult<BatchCounts> {
    let mut total = record.folded;
    total.added = 0;
    for (key, value) in scan_prefix(tx, &keys::batch_shard_prefix(id)).await? {
        let shard: ShardCounts = parse("batch shard", &key, &value)?;
        total.added += shard.counts.added;
        total.completed += shard.counts.completed;
        total.cancelled += shard.counts.cancelled;
        total.dead += shard.counts.dead;
    }
    Ok(total)
}

/// An end record of a batch: a child's end (its key names the batch, the child's queue and
/// event id), or the batch's close.
#[derive(Serialize, Deserialize)]
struct ChildEnd {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    how: Option<Finish>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    close: bool,
}

impl ChildEnd {
    /// Applies it to `record`: a child's end to its counts, a close to its flag.
    fn apply(&self, record: &mut BatchRecord) {
        if let Some(how) = self.how {
            count_end(&mut record.folded, how);
        }
        if self.close {
            record.closed = true;
        }
    }
}

/// Adds the end `how` to `counts`.
fn count_end(counts: &mut BatchCounts, how: Finish) {
    match how {
        Finish::Completed => counts.completed += 1,
        Finish::Cancelled => counts.cancelled += 1,
        Finish::Dead => counts.dead += 1,
    }
}

/// Publishes the callbacks of batch `id` whose condition holds and that have not fired, and
/// marks them fired in `record` (the caller writes it).
async fn fire_due<X: TitoTransaction>(
    tx: &X,
    id: &str,
    record: &mut BatchRecord,
    wakes: &mut Vec<Wake>,
) -> TitoResult<()> {
    let waiting: Vec<StoredCallback> = record
        .callbacks
        .iter()
        .filter(|c| !record.fired.contains(&c.kind))
        .cloned()
        .collect();
    if waiting.is_empty() {
        return Ok(());
    }
    let counts = totals(tx, id, record).await?;
    let all_ended = record.closed && counts.open() == 0;
    let now_s = i64::try_from(engine::version_millis(tx.start_version()) / 1000).unwrap_or(0);
    for callback in waiting {
        let due = match callback.kind {
            BatchCallback::Complete => all_ended,
            BatchCallback::Success => all_ended && counts.cancelled == 0 && counts.dead == 0,
            BatchCallback::Death => counts.dead > 0,
        };
        if !due {
            continue;
        }
        record.fired.push(callback.kind);
        let mut event = callback.fired(id, counts, now_s);
        let id_key = keys::event_id_key(&callback.q, &event.id);
        if tx.get(id_key.as_bytes()).await?.is_some() {
            // Held since the batch opened (by a finished invocation, or one published since):
            // the callback still runs, once, under an id of its own.
            let derived = free_id(tx, &callback.q, &event.id, record.created_ms).await?;
            tracing::info!(
                batch = id,
                callback = ?callback.kind,
                event = event.id,
                fires_as = derived,
                "a batch callback's event id is held by another invocation; the callback fires under a derived id"
            );
            event.id = derived;
        }
        insert_pending(tx, &callback.q, callback.p, &event, event.to_bytes()?).await?;
        wakes.push(Wake::due(
            &callback.q,
            partition_for(&event.key, callback.p),
        ));
    }
    Ok(())
}

/// Whether the row an event-id key names (`at`) is a finished invocation of queue `root`
/// (completed, cancelled or dead), which no longer runs.
fn finished_row(root: &str, at: &[u8]) -> bool {
    std::str::from_utf8(at).is_ok_and(|at| {
        at.starts_with(&keys::completed_prefix(root)) || at.starts_with(&keys::dead_prefix(root))
    })
}

/// The id a batch callback fires under when its own (`id`) is held: `{id}.{created_ms}` (the
/// batch's creation time, so each batch of one id has its own), or that followed by `.2`,
/// `.3`, ... up to `.16` when that is held too.
async fn free_id<X: TitoTransaction>(
    tx: &X,
    root: &str,
    id: &str,
    created_ms: u64,
) -> TitoResult<String> {
    for n in 1..=16u32 {
        let candidate = if n == 1 {
            format!("{id}.{created_ms}")
        } else {
            format!("{id}.{created_ms}.{n}")
        };
        if tx
            .get(keys::event_id_key(root, &candidate).as_bytes())
            .await?
            .is_none()
        {
            return Ok(candidate);
        }
    }
    Err(TitoError::Integrity(format!(
        "a batch callback's event id {id:?} and sixteen ids derived from it are held in queue {}",
        keys::queue_name(root)
    )))
}

/// Records the end of batch child `event_id` of queue `root` inside `tx`: an end record,
/// folded into the batch once `tx` commits (see the module). Writes nothing another
/// transaction's end writes.
pub(super) async fn child_ended<X: TitoTransaction>(
    tx: &X,
    root: &str,
    event_id: &str,
    link: &BatchLink,
    how: Finish,
    wakes: &mut Vec<Wake>,
) -> TitoResult<()> {
    let value = serde_json::to_vec(&ChildEnd {
        how: Some(how),
        close: false,
    })?;
    let graph = super::ends::GraphRef::batch(&link.id);
    super::ends::write_end(tx, graph, &[root, event_id], value, wakes).await
}

/// Applies the end `how` of a child of batch `id` inside `tx`: its record's counts and the
/// callbacks now due.
pub(super) async fn child_ended_now<X: TitoTransaction>(
    tx: &X,
    id: &str,
    how: Finish,
    wakes: &mut Vec<Wake>,
) -> TitoResult<()> {
    let record_key = keys::batch_key(id);
    let Some(bytes) = tx.get(record_key.as_bytes()).await? else {
        // The batch was deleted.
        return Ok(());
    };
    let mut record: BatchRecord = parse("batch", record_key.as_bytes(), &bytes)?;
    // Ends not folded yet stay for their folds (each asked for one at its commit), which fire
    // what they make due.
    count_end(&mut record.folded, how);
    fire_due(tx, id, &mut record, wakes).await?;
    tx.put(record_key.into_bytes(), serde_json::to_vec(&record)?)
        .await
}

/// Folds batch `id`'s end records inside `tx`: adds them to its record's counts, deletes them,
/// and fires the callbacks now due. Returns whether more end records wait than one fold takes.
pub(super) async fn fold_batch<X: TitoTransaction>(
    tx: &X,
    id: &str,
    wakes: &mut Vec<Wake>,
) -> TitoResult<bool> {
    let ends = super::ends::ends_of(tx, super::ends::BATCH, id).await?;
    if ends.is_empty() {
        return Ok(false);
    }
    let full = ends.len() == super::ends::FOLD_ENDS;
    let record_key = keys::batch_key(id);
    let Some(bytes) = tx.get(record_key.as_bytes()).await? else {
        // The batch was deleted (expired): its ends count for nothing.
        for (key, _) in ends {
            tx.delete(key).await?;
        }
        return Ok(full);
    };
    let mut record: BatchRecord = parse("batch", record_key.as_bytes(), &bytes)?;
    for (key, value) in ends {
        let end: ChildEnd = parse("batch end", &key, &value)?;
        end.apply(&mut record);
        tx.delete(key).await?;
    }
    fire_due(tx, id, &mut record, wakes).await?;
    tx.put(record_key.into_bytes(), serde_json::to_vec(&record)?)
        .await?;
    Ok(full)
}

/// The ends of batch `id` not folded yet, counted, read in `tx` (readers add them to the
/// record's, so counts are exact before the fold).
async fn unfolded<X: TitoTransaction>(tx: &X, id: &str) -> TitoResult<BatchCounts> {
    let mut counts = BatchCounts::default();
    let start = keys::graph_end_prefix(super::ends::BATCH, id).into_bytes();
    let end = keys::prefix_end_bytes(&start);
    let mut from = start;
    loop {
        let page = tx.scan(&from, &end, 1000).await?;
        for (key, value) in &page {
            let record: ChildEnd = parse("batch end", key, value)?;
            if let Some(how) = record.how {
                count_end(&mut counts, how);
            }
        }
        match page.last() {
            Some((key, _)) if page.len() == 1000 => from = keys::key_after_bytes(key),
            _ => return Ok(counts),
        }
    }
}

/// A batch as [`Graphs::batch`] reads it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct BatchState {
    /// Its id.
    pub id: String,
    /// When it was opened (Unix ms, the store's clock).
    pub created_ms: u64,
    /// Whether it is closed (no more children).
    pub closed: bool,
    /// Its children by how they ended.
    pub counts: BatchCounts,
    /// Its callbacks, each with whether it fired.
    pub callbacks: Vec<(BatchCallback, bool)>,
}

impl BatchState {
    /// Whether it is closed and every child ended.
    pub fn finished(&self) -> bool {
        self.closed && self.counts.open() == 0
    }
}

/// One batch of [`Graphs::batches`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct BatchSummary {
    /// Its id.
    pub id: String,
    /// When it was opened (Unix ms).
    pub created_ms: u64,
    /// Whether it is closed.
    pub closed: bool,
}

impl<E: TitoEngine> Graphs<E> {
    /// Opens a batch in a transaction of its own; `false` (nothing written) when a batch of its
    /// id is there already.
    pub async fn open_batch(&self, batch: &Batch) -> TitoResult<bool> {
        let batch = Arc::new(batch.clone());
        let callbacks = Arc::new(batch.check()?);
        self.db
            .transaction(|tx| {
                let (batch, callbacks) = (batch.clone(), callbacks.clone());
                async move { open(&tx, &batch.id, &callbacks).await }
            })
            .await
    }

    /// [`Graphs::open_batch`] inside `tx`.
    pub async fn open_batch_in_tx(&self, batch: &Batch, tx: &E::Transaction) -> TitoResult<bool> {
        let callbacks = batch.check()?;
        open(tx, &batch.id, &callbacks).await
    }

    /// Publishes `events` to `queue` as children of the open batch `id`, in one transaction
    /// of its own (at most [`MAX_PUBLISH_IN_TX`]; add a longer list in several calls).
    /// Idempotent per event id: a duplicate (answered as in
    /// [`Queue::publish`](crate::Queue::publish)) is no new child. Refused for an unknown or
    /// closed batch.
    pub async fn add_to_batch<T: Serialize>(
        &self,
        id: &str,
        queue: &impl GraphQueue<T>,
        events: &[QueueEvent<T>],
    ) -> TitoResult<Vec<Published>> {
        let target = queue.graph_target();
        let items = Arc::new(checked(events, true)?);
        let (db, id) = (self.db.clone(), id.to_string());
        self.db
            .transaction(|tx| {
                let (db, id, target, items) =
                    (db.clone(), id.clone(), target.clone(), items.clone());
                async move {
                    let mut wakes = Vec::new();
                    let published = add(&tx, &id, &target, &items, &mut wakes).await?;
                    super::wake_after_commit(&db, &tx, wakes);
                    Ok::<_, TitoError>(published)
                }
            })
            .await
    }

    /// [`Graphs::add_to_batch`] inside `tx`, atomically with the rest of it.
    pub async fn add_to_batch_in_tx<T: Serialize>(
        &self,
        id: &str,
        queue: &impl GraphQueue<T>,
        events: &[QueueEvent<T>],
        tx: &E::Transaction,
    ) -> TitoResult<Vec<Published>> {
        let items = checked(events, true)?;
        let mut wakes = Vec::new();
        let published = add(tx, id, &queue.graph_target(), &items, &mut wakes).await?;
        super::wake_after_commit(&self.db, tx, wakes);
        Ok(published)
    }

    /// Closes batch `id`: no child can be added any more, and the callbacks whose condition
    /// holds fire (at once when every child ended already). `false` when it was closed.
    pub async fn close_batch(&self, id: &str) -> TitoResult<bool> {
        let id = id.to_string();
        let closed = self
            .db
            .transaction(|tx| {
                let id = id.clone();
                async move {
                    // Its fold runs here once it committed, not in the background.
                    let mut wakes = Vec::new();
                    let closed = close(&tx, &id, &mut wakes).await?;
                    Ok::<_, TitoError>(closed)
                }
            })
            .await?;
        if closed {
            // The close's fold (and what it fires) before the call returns.
            super::fold_now(&self.db, vec![super::ends::GraphRef::batch(&id)]).await;
        }
        Ok(closed)
    }

    /// [`Graphs::close_batch`] inside `tx`.
    pub async fn close_batch_in_tx(&self, id: &str, tx: &E::Transaction) -> TitoResult<bool> {
        let mut wakes = Vec::new();
        let closed = close(tx, id, &mut wakes).await?;
        super::wake_after_commit(&self.db, tx, wakes);
        Ok(closed)
    }

    /// Opens `batch`, adds `events` to `queue` as its children and closes it, in transactions
    /// of its own: the children in bulk publication's transactions (at most
    /// [`PUBLISH_BATCH`](crate::queue::PUBLISH_BATCH) events and
    /// [`PUBLISH_BATCH_BYTES`](crate::queue::PUBLISH_BATCH_BYTES) each), the close in the
    /// last. No callback can fire before the close, so a failure part way leaves an open
    /// batch: publishing the same batch and events again adds what is missing (the rest are
    /// duplicates by their ids: give the children ids of their own, or make the batch
    /// [`Batch::numbered`], since [`QueueEvent::now`] makes a fresh id each time it is called;
    /// also those whose completed rows retention deleted since: a batch keeps its children's
    /// ids until it expires) and closes it. A batch of its id there
    /// and closed already is answered with `None` (nothing written), and so is one that
    /// another publication of it closed while this one ran (what this one added before is in
    /// it). For one transaction, with the data that caused it, use
    /// [`Graphs::publish_batch_in_tx`].
    pub async fn publish_batch<T: Serialize>(
        &self,
        batch: &Batch,
        queue: &impl GraphQueue<T>,
        events: &[QueueEvent<T>],
    ) -> TitoResult<Option<Vec<Published>>> {
        batch.check()?;
        let items = batch.children(events, false)?;
        let target = queue.graph_target();
        let id = batch.id.clone();
        // Opened now, or left open by a publication that failed part way: go on.
        let opened = self.open_batch(batch).await?;
        if !opened && self.batch(&id).await?.is_some_and(|state| state.closed) {
            return Ok(None);
        }
        let mut chunks: Vec<Vec<ToPublish>> = crate::queue::publish_chunks(&items)
            .into_iter()
            .map(<[ToPublish]>::to_vec)
            .collect();
        if chunks.is_empty() {
            chunks.push(Vec::new());
        }
        let mut published = Vec::with_capacity(items.len());
        for chunk in chunks {
            let chunk = Arc::new(chunk);
            let (db, id, target) = (self.db.clone(), id.clone(), target.clone());
            let answers = self
                .db
                .transaction(|tx| {
                    let (db, id, target, chunk) =
                        (db.clone(), id.clone(), target.clone(), chunk.clone());
                    async move {
                        // Closed meanwhile by another publication of this batch (which added
                        // what this one had not): nothing more to do here.
                        let mut wakes = Vec::new();
                        let Some(answers) =
                            add_unless_closed(&tx, &id, &target, &chunk, &mut wakes).await?
                        else {
                            return Ok::<_, TitoError>(None);
                        };
                        super::wake_after_commit(&db, &tx, wakes);
                        Ok(Some(answers))
                    }
                })
                .await?;
            let Some(answers) = answers else {
                return Ok(None);
            };
            published.extend(answers);
        }
        // The close in a small transaction of its own: the children's transactions never
        // write the record, which the folds of children completing meanwhile write. Closed by
        // another publication of the batch since this one's last children: they are in it.
        self.close_batch(&id).await?;
        Ok(Some(published))
    }

    /// [`Graphs::publish_batch`] inside `tx`, atomically with the rest of it (the data that
    /// caused it).
    pub async fn publish_batch_in_tx<T: Serialize>(
        &self,
        batch: &Batch,
        queue: &impl GraphQueue<T>,
        events: &[QueueEvent<T>],
        tx: &E::Transaction,
    ) -> TitoResult<Option<Vec<Published>>> {
        let callbacks = batch.check()?;
        let items = batch.children(events, true)?;
        let published = publish(tx, &batch.id, &callbacks, &queue.graph_target(), &items).await?;
        Ok(published.map(|(published, wakes)| {
            super::wake_after_commit(&self.db, tx, wakes);
            published
        }))
    }

    /// Batch `id`: its counts and callbacks, read in one snapshot; `None` when there is none.
    pub async fn batch(&self, id: &str) -> TitoResult<Option<BatchState>> {
        check_name("a batch id", id)?;
        engine::read_only(&self.db, async |tx| {
            let key = keys::batch_key(id);
            let Some(bytes) = tx.get(key.as_bytes()).await? else {
                return Ok(None);
            };
            let record: BatchRecord = parse("batch", key.as_bytes(), &bytes)?;
            // Closed by a close not folded yet too.
            let closed = record.closed
                || tx
                    .get(keys::batch_closed_key(id).as_bytes())
                    .await?
                    .is_some();
            let mut counts = totals(tx, id, &record).await?;
            let pending = unfolded(tx, id).await?;
            counts.completed += pending.completed;
            counts.cancelled += pending.cancelled;
            counts.dead += pending.dead;
            Ok(Some(BatchState {
                id: id.to_string(),
                created_ms: record.created_ms,
                closed,
                counts,
                callbacks: record
                    .callbacks
                    .iter()
                    .map(|c| (c.kind, record.fired.contains(&c.kind)))
                    .collect(),
            }))
        })
        .await
    }

    /// Up to `limit` (1 to 1000) batches in id order, after `after` when given.
    pub async fn batches(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> TitoResult<Vec<BatchSummary>> {
        let prefix = keys::batch_prefix();
        let start = match after {
            Some(id) => keys::key_after(keys::batch_key(id)),
            None => prefix.clone(),
        };
        page(&self.db, "batches", &prefix, start, limit)
            .await?
            .into_iter()
            .map(|(id, key, value)| {
                let record: BatchRecord = parse("batch", &key, &value)?;
                Ok(BatchSummary {
                    id,
                    created_ms: record.created_ms,
                    closed: record.closed,
                })
            })
            .collect()
    }
}

/// Every event checked and encoded, the first bad one named; `one_tx`: at most
/// [`MAX_PUBLISH_IN_TX`] (they go in one transaction).
fn checked<T: Serialize>(events: &[QueueEvent<T>], one_tx: bool) -> TitoResult<Vec<ToPublish>> {
    if one_tx && events.len() > MAX_PUBLISH_IN_TX {
        return Err(TitoError::invalid_argument(format!(
            "{} children added in one transaction; at most {MAX_PUBLISH_IN_TX}: add a longer \
             list in several calls before closing the batch",
            events.len()
        )));
    }
    events
        .iter()
        .enumerate()
        .map(|(at, event)| {
            ToPublish::of(event, None).map_err(|err| match err {
                TitoError::InvalidArgument(why) => TitoError::InvalidArgument(format!(
                    "child {at} of {} (id {:?}): {why}; nothing was published",
                    events.len(),
                    event.id
                )),
                other => other,
            })
        })
        .collect()
}

/// Writes batch `id`'s record inside `tx`; `false` when it is there already.
async fn open<X: TitoTransaction>(
    tx: &X,
    id: &str,
    callbacks: &[StoredCallback],
) -> TitoResult<bool> {
    let key = keys::batch_key(id);
    if tx.get(key.as_bytes()).await?.is_some() {
        return Ok(false);
    }
    let mut writes = engine::Writes::default();
    let mut roots: BTreeMap<&str, u32> = BTreeMap::new();
    for callback in callbacks {
        roots.insert(&callback.q, callback.p);
    }
    for (root, partitions) in roots {
        check_meta(tx, root, partitions, &mut writes).await?;
    }
    // A callback's event id a pending invocation holds could never fire under it: refused. One
    // a finished invocation holds (the callback of an earlier batch of this id, published again
    // after it expired; a job that completed) fires under a derived id (see `fire_due`).
    let id_keys: Vec<Vec<u8>> = callbacks
        .iter()
        .map(|c| keys::event_id_key(&c.q, &c.event.id).into_bytes())
        .collect();
    for (callback, at) in callbacks.iter().zip(tx.batch_get(&id_keys).await?) {
        if let Some(at) = at
            && !finished_row(&callback.q, &at)
        {
            return Err(TitoError::invalid_argument(format!(
                "batch {id:?}: its {:?} callback's event id {:?} is held by a pending invocation \
                 of queue {} (give the callback's event another id, or leave the event's own \
                 fresh one); nothing was written",
                callback.kind,
                callback.event.id,
                keys::queue_name(&callback.q)
            )));
        }
    }
    let record = BatchRecord {
        created_ms: engine::version_millis(tx.start_version()),
        closed: false,
        busy: 0,
        folded: BatchCounts::default(),
        callbacks: callbacks.to_vec(),
        fired: Vec::new(),
    };
    writes.put(key, serde_json::to_vec(&record)?);
    writes.apply(tx).await?;
    Ok(true)
}

/// Adds checked children to open batch `id` inside `tx`.
async fn add<X: TitoTransaction>(
    tx: &X,
    id: &str,
    target: &Target,
    items: &[ToPublish],
    wakes: &mut Vec<Wake>,
) -> TitoResult<Vec<Published>> {
    add_unless_closed(tx, id, target, items, wakes)
        .await?
        .ok_or_else(|| {
            TitoError::invalid_argument(format!(
                "batch {id:?} is closed: no child can be added; nothing was published"
            ))
        })
}

/// [`add`], answering `None` (nothing written) when the batch is closed.
async fn add_unless_closed<X: TitoTransaction>(
    tx: &X,
    id: &str,
    target: &Target,
    items: &[ToPublish],
    wakes: &mut Vec<Wake>,
) -> TitoResult<Option<Vec<Published>>> {
    check_name("a batch id", id)?;
    let record_key = keys::batch_key(id);
    let Some(bytes) = tx.get(record_key.as_bytes()).await? else {
        return Err(TitoError::NotFound(format!(
            "no batch {id:?}: open it first (Graphs::open_batch), or publish it with its \
             children (Graphs::publish_batch)"
        )));
    };
    let mut record: BatchRecord = parse("batch", record_key.as_bytes(), &bytes)?;
    if record.closed {
        return Ok(None);
    }
    // A close writes this key: an addition and a close never both commit without one seeing
    // the other (the record is not locked, since folds write it while children are added).
    let closed_key = keys::batch_closed_key(id).into_bytes();
    if tx.get(&closed_key).await?.is_some() {
        return Ok(None);
    }
    tx.lock_keys(std::slice::from_ref(&closed_key)).await?;
    let Target { root, partitions } = target;
    let items: Vec<ToPublish> = items
        .iter()
        .map(|item| {
            let mut item = item.clone();
            item.stored.batch = Some(BatchLink {
                id: id.to_string(),
                shard: partition_for(&item.stored.key, *partitions),
            });
            item.bytes = item.stored.to_bytes()?;
            Ok(item)
        })
        .collect::<TitoResult<_>>()?;
    // Children of this batch already (kept until the batch expires): a publication repeated
    // after their rows passed retention must not add and run them again.
    let child_keys: Vec<Vec<u8>> = items
        .iter()
        .map(|item| keys::batch_child_key(id, root, &item.stored.id).into_bytes())
        .collect();
    let known = tx.batch_get(&child_keys).await?;
    let (fresh, old): (Vec<usize>, Vec<usize>) =
        (0..items.len()).partition(|&i| known[i].is_none());
    let items_to_plan: Vec<ToPublish> = fresh.iter().map(|&i| items[i].clone()).collect();
    let mut writes = engine::Writes::default();
    check_meta(tx, root, *partitions, &mut writes).await?;
    let planned = unique::plan(tx, root, *partitions, &items_to_plan, &mut writes).await?;
    // Answers in the events' order: a known child is a duplicate (its invocation's key when
    // it still holds its id, else its batch-child key).
    let mut answers: Vec<Option<Published>> = vec![None; items.len()];
    if !old.is_empty() {
        let id_keys: Vec<Vec<u8>> = old
            .iter()
            .map(|&i| keys::event_id_key(root, &items[i].stored.id).into_bytes())
            .collect();
        let held = tx.batch_get(&id_keys).await?;
        for (&i, at) in old.iter().zip(held) {
            let key = match at {
                Some(at) => keys::key_str(&at)?.to_string(),
                None => keys::key_text(&child_keys[i]),
            };
            answers[i] = Some(Published::duplicate_of(items[i].stored.id.clone(), key));
        }
    }
    for (&i, (published, _)) in fresh.iter().zip(&planned) {
        answers[i] = Some(published.clone());
    }
    let items = items_to_plan;
    let mut per_shard: BTreeMap<u32, u64> = BTreeMap::new();
    for ((published, partition), item) in planned.iter().zip(&items) {
        if published.duplicate {
            continue;
        }
        *per_shard.entry(*partition).or_default() += 1;
        writes.put(
            keys::batch_child_key(id, root, &item.stored.id),
            serde_json::to_vec(&ChildRecord {
                q: root.clone(),
                id: item.stored.id.clone(),
            })?,
        );
        wakes.push(Wake::due(root, *partition));
    }
    let shard_keys: Vec<Vec<u8>> = per_shard
        .keys()
        .map(|&s| keys::batch_shard_key(id, s).into_bytes())
        .collect();
    let shards = tx.batch_get(&shard_keys).await?;
    let busy_before = record.busy;
    for ((key, value), added) in shard_keys.into_iter().zip(shards).zip(per_shard.values()) {
        let mut shard: ShardCounts = match value {
            Some(bytes) => parse("batch shard", &key, &bytes)?,
            None => ShardCounts::default(),
        };
        if shard.open == 0 {
            record.busy += 1;
        }
        shard.open += added;
        shard.counts.added += added;
        writes.put(key, serde_json::to_vec(&shard)?);
    }
    if record.busy != busy_before {
        writes.put(record_key, serde_json::to_vec(&record)?);
    }
    writes.apply(tx).await?;
    wakes.sort();
    wakes.dedup();
    Ok(Some(answers.into_iter().flatten().collect()))
}

/// Closes batch `id` inside `tx`; `false` when it was closed. Writes the closed key (which
/// additions lock) and an end record of the close, folded after the commit like a child's end
/// (the fold fires what is due): a close never writes what folds write, so it does not
/// conflict with children completing.
async fn close<X: TitoTransaction>(tx: &X, id: &str, wakes: &mut Vec<Wake>) -> TitoResult<bool> {
    check_name("a batch id", id)?;
    let key = keys::batch_key(id);
    let closed_key = keys::batch_closed_key(id);
    let read = tx
        .batch_get(&[key.clone().into_bytes(), closed_key.clone().into_bytes()])
        .await?;
    let Some(bytes) = &read[0] else {
        return Err(TitoError::NotFound(format!("no batch {id:?}")));
    };
    let record: BatchRecord = parse("batch", key.as_bytes(), bytes)?;
    if record.closed || read[1].is_some() {
        return Ok(false);
    }
    let value = serde_json::to_vec(&ChildEnd {
        how: None,
        close: true,
    })?;
    tx.put(closed_key.into_bytes(), Vec::new()).await?;
    let graph = super::ends::GraphRef::batch(id);
    super::ends::write_end(tx, graph, &["close"], value, wakes).await?;
    Ok(true)
}

/// Closes batch `id`, opened in `tx` itself (no fold can touch it before `tx` commits), firing
/// what is due at once.
async fn close_new<X: TitoTransaction>(tx: &X, id: &str, wakes: &mut Vec<Wake>) -> TitoResult<()> {
    let key = keys::batch_key(id);
    let Some(bytes) = tx.get(key.as_bytes()).await? else {
        return Err(TitoError::NotFound(format!("no batch {id:?}")));
    };
    let mut record: BatchRecord = parse("batch", key.as_bytes(), &bytes)?;
    record.closed = true;
    // The callbacks' rows and the record are written as they go: a failure part way marks
    // the caller's transaction failed (it refuses to commit half a close).
    engine::aborting(tx, async {
        tx.put(keys::batch_closed_key(id).into_bytes(), Vec::new())
            .await?;
        fire_due(tx, id, &mut record, wakes).await?;
        tx.put(key.into_bytes(), serde_json::to_vec(&record)?).await
    })
    .await
}

/// Opens, fills and closes batch `id` inside `tx`; `None` when it was there.
async fn publish<X: TitoTransaction>(
    tx: &X,
    id: &str,
    callbacks: &[StoredCallback],
    target: &Target,
    items: &[ToPublish],
) -> TitoResult<Option<(Vec<Published>, Vec<Wake>)>> {
    if !open(tx, id, callbacks).await? {
        return Ok(None);
    }
    let mut wakes = Vec::new();
    let published = engine::aborting(tx, async {
        let published = add(tx, id, target, items, &mut wakes).await?;
        close_new(tx, id, &mut wakes).await?;
        Ok(published)
    })
    .await?;
    Ok(Some((published, wakes)))
}
