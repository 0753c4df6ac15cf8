//! Workflows: steps published together, each due once the steps it depends on completed.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::marker::PhantomData;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::{
    Finish, GraphQueue, Graphs, OnFailure, StepLink, Target, Wake, check_name, malformed, page,
    parse,
};
use crate::engine::{self, TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::event::publish::{check_meta, insert_pending, plan_insert};
use crate::event::{QueueEvent, StoredEvent, partition_for};
use crate::keys;
use crate::queue::results::{Finished, InvocationState, state_of};
use crate::queue::scan_prefix;

/// The most steps a workflow holds.
pub const MAX_WORKFLOW_STEPS: usize = 10_000;

/// The most dependencies one step names.
pub const MAX_STEP_DEPENDENCIES: usize = 1_000;

/// The steps cancelled per transaction by [`Graphs::cancel_workflow`].
pub(crate) const CANCEL_BATCH: usize = 128;

/// A step's name, typed by the result its handler returns
/// ([`QueueHandlerOutcome::acknowledge_with`](crate::QueueHandlerOutcome::acknowledge_with)):
/// declared once, used where the step is added to a [`Workflow`] and where a dependent reads
/// its result ([`Graphs::dependency`]), so both agree on the type.
///
/// ```
/// use tito::queue::graph::StepName;
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Receipt { charge_id: String }
/// const CHARGE: StepName<Receipt> = StepName::new("charge");
/// assert_eq!(CHARGE.name(), "charge");
/// ```
pub struct StepName<R = serde_json::Value> {
    name: Cow<'static, str>,
    result: PhantomData<fn() -> R>,
}

impl<R> StepName<R> {
    /// A step named `name`.
    pub const fn new(name: &'static str) -> Self {
        StepName {
            name: Cow::Borrowed(name),
            result: PhantomData,
        }
    }

    /// A step named at run time (a step per item of a list).
    pub fn named(name: impl Into<String>) -> Self {
        StepName {
            name: Cow::Owned(name.into()),
            result: PhantomData,
        }
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl<R> Clone for StepName<R> {
    fn clone(&self) -> Self {
        StepName {
            name: self.name.clone(),
            result: PhantomData,
        }
    }
}

impl<R> std::fmt::Debug for StepName<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StepName({:?})", self.name)
    }
}

impl<R> AsRef<str> for StepName<R> {
    fn as_ref(&self) -> &str {
        &self.name
    }
}

/// A workflow: steps (invocations of any queues of one store) published together, each due
/// once every step it depends on completed. Build it with [`Workflow::step`], publish it with
/// [`Graphs::publish_workflow`] or [`Graphs::publish_workflow_in_tx`].
///
/// Refused at publication, before anything is written: an empty or duplicate step name, a
/// dependency no step has, a step depending on itself or on one step twice, a cycle (named,
/// step by step), two steps with one event id in one queue, a step's event id that a live
/// invocation holds, more than [`MAX_WORKFLOW_STEPS`] steps or [`MAX_STEP_DEPENDENCIES`]
/// dependencies per step, and names over [`MAX_GRAPH_NAME`](super::MAX_GRAPH_NAME) bytes.
#[derive(Clone, Debug)]
pub struct Workflow {
    id: String,
    steps: Vec<StepDecl>,
    /// The first step whose event was refused, and why.
    refused: Option<String>,
}

#[derive(Clone, Debug)]
struct StepDecl {
    name: String,
    target: Target,
    stored: Option<StoredEvent>,
    after: Vec<String>,
    on_failure: OnFailure,
}

/// Adds to the step [`Workflow::step`] just added.
pub struct StepBuilder<'a> {
    step: &'a mut StepDecl,
}

impl StepBuilder<'_> {
    /// The step waits until each of these steps completed (`CHARGE`, `"charge"`, or a list of
    /// either); call it again to add more.
    pub fn after<I, S>(self, steps: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        self.step
            .after
            .extend(steps.into_iter().map(|s| s.as_ref().to_string()));
        self
    }

    /// What a dependency's death or cancellation does to this step (by default
    /// [`OnFailure::Cancel`]).
    pub fn on_failure(self, rule: OnFailure) -> Self {
        self.step.on_failure = rule;
        self
    }
}

impl Workflow {
    /// An empty workflow. Its id names it in the store: publishing an id that is there already
    /// writes nothing and answers [`WorkflowPublished::duplicate`].
    pub fn new(id: impl Into<String>) -> Self {
        Workflow {
            id: id.into(),
            steps: Vec::new(),
            refused: None,
        }
    }

    /// The workflow's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// How many steps it has.
    pub fn len(&self) -> usize {
        self.steps.len()
    }

    /// Whether it has no step.
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// Adds a step: `event` published to `queue` once the steps named with
    /// [`StepBuilder::after`] completed (at once without any). A [`TopicQueue`](crate::queue::TopicQueue)
    /// takes only events of its type. The event keeps its id, key, owner, urgency and
    /// attempts; a due time in the future still holds after the step is released.
    pub fn step<T: Serialize, R>(
        &mut self,
        name: &StepName<R>,
        queue: &impl GraphQueue<T>,
        event: QueueEvent<T>,
    ) -> StepBuilder<'_> {
        let stored = match StoredEvent::from_event(&event) {
            Ok(stored) => Some(stored),
            Err(err) => {
                self.refused
                    .get_or_insert_with(|| format!("step {:?}: {err}", name.name()));
                None
            }
        };
        self.steps.push(StepDecl {
            name: name.name().to_string(),
            target: queue.graph_target(),
            stored,
            after: Vec::new(),
            on_failure: OnFailure::Cancel,
        });
        let last = self.steps.len() - 1;
        StepBuilder {
            step: &mut self.steps[last],
        }
    }

    /// Checks the graph; the error names the first problem and says nothing was published.
    fn check(&self) -> TitoResult<()> {
        let refuse = |why: String| {
            Err(TitoError::invalid_argument(format!(
                "workflow {:?}: {why}; nothing was published",
                self.id
            )))
        };
        super::check_new_name("a workflow id", &self.id)?;
        if let Some(why) = &self.refused {
            return refuse(why.clone());
        }
        if self.steps.is_empty() {
            return refuse("it has no step".into());
        }
        if self.steps.len() > MAX_WORKFLOW_STEPS {
            return refuse(format!(
                "it has {} steps; at most {MAX_WORKFLOW_STEPS}",
                self.steps.len()
            ));
        }
        let mut names = HashSet::new();
        let mut ids = HashSet::new();
        for step in &self.steps {
            if let Err(err) = super::check_new_name("a step name", &step.name) {
                return refuse(err.to_string());
            }
            if !names.insert(step.name.as_str()) {
                return refuse(format!("two steps are named {:?}", step.name));
            }
            let id = &step.stored.as_ref().expect("checked above").id;
            if !ids.insert((step.target.root.as_str(), id.as_str())) {
                return refuse(format!(
                    "step {:?} has event id {id:?}, as another step of its queue",
                    step.name
                ));
            }
        }
        for step in &self.steps {
            if step.after.len() > MAX_STEP_DEPENDENCIES {
                return refuse(format!(
                    "step {:?} depends on {} steps; at most {MAX_STEP_DEPENDENCIES}",
                    step.name,
                    step.after.len()
                ));
            }
            let mut seen = HashSet::new();
            for dep in &step.after {
                if dep == &step.name {
                    return refuse(format!("step {:?} depends on itself", step.name));
                }
                if !names.contains(dep.as_str()) {
                    return refuse(format!(
                        "step {:?} depends on {dep:?}, which is no step of the workflow",
                        step.name
                    ));
                }
                if !seen.insert(dep.as_str()) {
                    return refuse(format!("step {:?} names {dep:?} twice", step.name));
                }
            }
        }
        if let Some(cycle) = self.cycle() {
            return refuse(format!("its steps wait for each other: {cycle}"));
        }
        Ok(())
    }

    /// A cycle among the steps, as `a waits for b, b waits for a`; `None` when there is none.
    fn cycle(&self) -> Option<String> {
        let index: HashMap<&str, usize> = self
            .steps
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.as_str(), i))
            .collect();
        // Kahn's algorithm over "waits for" edges: what it cannot remove lies on or behind a
        // cycle.
        let mut waiting: Vec<usize> = self.steps.iter().map(|s| s.after.len()).collect();
        let mut dependents: Vec<Vec<usize>> = vec![Vec::new(); self.steps.len()];
        for (i, step) in self.steps.iter().enumerate() {
            for dep in &step.after {
                dependents[index[dep.as_str()]].push(i);
            }
        }
        let mut ready: Vec<usize> = (0..self.steps.len()).filter(|&i| waiting[i] == 0).collect();
        let mut removed = vec![false; self.steps.len()];
        while let Some(i) = ready.pop() {
            removed[i] = true;
            for &d in &dependents[i] {
                waiting[d] -= 1;
                if waiting[d] == 0 {
                    ready.push(d);
                }
            }
        }
        let start = removed.iter().position(|r| !r)?;
        // Every step left waits for a step left: follow those until one repeats.
        let mut path = vec![start];
        let mut at = start;
        loop {
            let next = self.steps[at]
                .after
                .iter()
                .map(|d| index[d.as_str()])
                .find(|&d| !removed[d])
                .expect("a step left by Kahn's algorithm waits for another left");
            if let Some(from) = path.iter().position(|&p| p == next) {
                let cycle = &path[from..];
                let names: Vec<String> = cycle
                    .iter()
                    .zip(cycle.iter().cycle().skip(1))
                    .map(|(&a, &b)| {
                        format!(
                            "{:?} waits for {:?}",
                            self.steps[a].name, self.steps[b].name
                        )
                    })
                    .collect();
                return Some(names.join(", "));
            }
            path.push(next);
            at = next;
        }
    }
}

/// What [`Graphs::publish_workflow`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkflowPublished {
    /// The workflow's id.
    pub id: String,
    /// Whether a workflow of this id was there already, so nothing was written (`steps` then
    /// names the stored steps' event ids).
    pub duplicate: bool,
    /// Each step's name and event id (await a step's end with
    /// [`Queue::await_result`](crate::Queue::await_result)), in the order they were added.
    pub steps: Vec<(String, String)>,
}

impl WorkflowPublished {
    /// The event id of the step named `name`.
    pub fn step_id(&self, name: impl AsRef<str>) -> Option<&str> {
        let name = name.as_ref();
        self.steps
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, id)| id.as_str())
    }
}

/// A workflow's record.
#[derive(Serialize, Deserialize)]
struct WorkflowRecord {
    created_ms: u64,
    steps: usize,
}

/// A step's record.
#[derive(Clone, Serialize, Deserialize)]
pub(crate) struct StepRecord {
    /// Its queue's root.
    pub(crate) q: String,
    /// Its event id.
    pub(crate) id: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    after: Vec<String>,
    #[serde(default, skip_serializing_if = "OnFailure::is_default")]
    on: OnFailure,
    /// The order it was added in.
    n: usize,
}

/// An edge: a waiting step's row, its queue and its queue's partition count.
#[derive(Serialize, Deserialize)]
struct Edge {
    w: String,
    q: String,
    p: u32,
}

/// Plans a checked workflow's writes inside `tx`; returns the answer and the partitions of its
/// first steps.
async fn plan<X: TitoTransaction>(
    tx: &X,
    workflow: &Workflow,
    writes: &mut engine::Writes,
) -> TitoResult<(WorkflowPublished, Vec<Wake>)> {
    let id = &workflow.id;
    if tx.get(keys::workflow_key(id).as_bytes()).await?.is_some() {
        let steps = step_records(tx, id).await?;
        return Ok((
            WorkflowPublished {
                id: id.clone(),
                duplicate: true,
                steps: steps.into_iter().map(|(name, r)| (name, r.id)).collect(),
            },
            Vec::new(),
        ));
    }
    let mut roots: BTreeMap<&str, u32> = BTreeMap::new();
    for step in &workflow.steps {
        roots.insert(&step.target.root, step.target.partitions);
    }
    for (root, partitions) in roots {
        check_meta(tx, root, partitions, writes).await?;
    }
    let id_keys: Vec<Vec<u8>> = workflow
        .steps
        .iter()
        .map(|s| {
            let stored = s.stored.as_ref().expect("checked");
            keys::event_id_key(&s.target.root, &stored.id).into_bytes()
        })
        .collect();
    let held = tx.batch_get(&id_keys).await?;
    if let Some((step, _)) = workflow
        .steps
        .iter()
        .zip(&held)
        .find(|(_, held)| held.is_some())
    {
        return Err(TitoError::invalid_argument(format!(
            "workflow {id:?}: step {:?}'s event id {:?} is held by a live invocation of queue \
             {} (give the step another id, or leave the event's own fresh one); nothing was \
             published",
            step.name,
            step.stored.as_ref().expect("checked").id,
            keys::queue_name(&step.target.root)
        )));
    }
    let start = tx.start_version();
    writes.put(
        keys::workflow_key(id),
        serde_json::to_vec(&WorkflowRecord {
            created_ms: engine::version_millis(start),
            steps: workflow.steps.len(),
        })?,
    );
    let mut wakes = Vec::new();
    let mut answer = Vec::with_capacity(workflow.steps.len());
    for (n, step) in workflow.steps.iter().enumerate() {
        let Target { root, partitions } = &step.target;
        let mut stored = step.stored.clone().expect("checked");
        answer.push((step.name.clone(), stored.id.clone()));
        writes.put(
            keys::workflow_step_key(id, &step.name),
            serde_json::to_vec(&StepRecord {
                q: root.clone(),
                id: stored.id.clone(),
                after: step.after.clone(),
                on: step.on_failure,
                n,
            })?,
        );
        stored.step = Some(StepLink {
            workflow: id.clone(),
            step: step.name.clone(),
            waiting_on: step.after.clone(),
            on_failure: step.on_failure,
        });
        if step.after.is_empty() {
            let bytes = stored.to_bytes()?;
            plan_insert(start, root, *partitions, &stored, bytes, writes)?;
            wakes.push(Wake::due(root, partition_for(&stored.key, *partitions)));
            continue;
        }
        let stored = stored.settle_due(start).unwrap_or(stored);
        let waiting_key = keys::waiting_key(root, id, &step.name);
        for dep in &step.after {
            writes.put(
                keys::workflow_edge_key(id, dep, &step.name),
                serde_json::to_vec(&Edge {
                    w: waiting_key.clone(),
                    q: root.clone(),
                    p: *partitions,
                })?,
            );
        }
        writes.put(waiting_key.clone(), stored.to_bytes()?);
        writes.put(
            keys::event_id_key(root, &stored.id),
            waiting_key.clone().into_bytes(),
        );
        if let Some(owner) = &stored.owner {
            let owner_key = keys::owner_key(
                root,
                &owner.kind,
                &owner.id,
                keys::OWNER_WAITING,
                &waiting_key,
            );
            writes.put(owner_key, Vec::new());
        }
    }
    Ok((
        WorkflowPublished {
            id: id.clone(),
            duplicate: false,
            steps: answer,
        },
        wakes,
    ))
}

/// A workflow step's end record (its key names the workflow and the step too).
#[derive(Serialize, Deserialize)]
struct StepEnd {
    step: String,
    how: Finish,
}

/// Records the end of workflow step `link` inside `tx`: an end record, folded into the
/// workflow once `tx` commits (see the module). Writes nothing another transaction's end
/// writes.
pub(super) async fn step_ended<X: TitoTransaction>(
    tx: &X,
    link: &StepLink,
    how: Finish,
    wakes: &mut Vec<Wake>,
) -> TitoResult<()> {
    let value = serde_json::to_vec(&StepEnd {
        step: link.step.clone(),
        how,
    })?;
    let graph = super::ends::GraphRef::workflow(&link.workflow);
    super::ends::write_end(tx, graph, &[&link.step], value, wakes).await
}

/// Folds workflow `id`'s end records inside `tx`, in the order they were written: applies
/// each (see [`step_finished`]) and deletes it. Returns whether more end records wait than one
/// fold takes.
pub(super) async fn fold_workflow<X: TitoTransaction>(
    tx: &X,
    id: &str,
    wakes: &mut Vec<Wake>,
) -> TitoResult<bool> {
    let ends = super::ends::ends_of(tx, super::ends::WORKFLOW, id).await?;
    let full = ends.len() == super::ends::FOLD_ENDS;
    for (key, value) in ends {
        let end: StepEnd = parse("workflow step end", &key, &value)?;
        step_finished(tx, id, &end.step, end.how, wakes).await?;
        tx.delete(key).await?;
    }
    Ok(full)
}

/// Applies the end of step `step` of workflow `workflow` inside `tx`: each step waiting for it
/// drops it (released when it waits for nothing more) or, when it ended without completing,
/// follows its [`OnFailure`] rule; cancellations cascade the same way.
pub(super) async fn step_finished<X: TitoTransaction>(
    tx: &X,
    workflow: &str,
    step: &str,
    how: Finish,
    wakes: &mut Vec<Wake>,
) -> TitoResult<()> {
    // A worklist, not recursion: a cancellation may cascade through thousands of steps.
    let mut ended = vec![(step.to_string(), how)];
    while let Some((step, how)) = ended.pop() {
        for (edge_key, value) in
            scan_prefix(tx, &keys::workflow_edge_prefix(workflow, &step)).await?
        {
            let edge: Edge = parse("workflow edge", &edge_key, &value)?;
            let Some(row) = tx.get(edge.w.as_bytes()).await? else {
                // The waiting step ended already (cancelled, erased).
                tx.delete(edge_key).await?;
                continue;
            };
            let mut waiting = StoredEvent::parse(&row)?;
            let Some(mut waiting_link) = waiting.step.take() else {
                return Err(malformed(
                    "waiting step",
                    edge.w.as_bytes(),
                    "no workflow link",
                ));
            };
            let satisfied = match (how, waiting_link.on_failure) {
                (Finish::Completed, _) | (_, OnFailure::RunAnyway) => true,
                // The edge stays: the dependency, retried and completed, releases the step.
                (_, OnFailure::Hold) => continue,
                (_, OnFailure::Cancel) => false,
            };
            tx.delete(edge_key).await?;
            if !satisfied {
                let why = format!(
                    "dependency {step:?} {}",
                    if how == Finish::Dead {
                        "died"
                    } else {
                        "was cancelled"
                    }
                );
                waiting.step = Some(waiting_link.clone());
                cancel_waiting_row(tx, &edge.q, &edge.w, waiting, &why, wakes).await?;
                ended.push((waiting_link.step, Finish::Cancelled));
                continue;
            }
            waiting_link.waiting_on.retain(|s| *s != step);
            let released = waiting_link.waiting_on.is_empty();
            waiting.step = Some(waiting_link);
            if released {
                remove_waiting(tx, &edge.q, &edge.w, &waiting).await?;
                insert_pending(tx, &edge.q, edge.p, &waiting, waiting.to_bytes()?).await?;
                wakes.push(Wake::due(&edge.q, partition_for(&waiting.key, edge.p)));
            } else {
                tx.put(edge.w.clone().into_bytes(), waiting.to_bytes()?)
                    .await?;
            }
        }
    }
    Ok(())
}

/// Deletes a waiting row and its owner key inside `tx`.
async fn remove_waiting<X: TitoTransaction>(
    tx: &X,
    root: &str,
    key: &str,
    stored: &StoredEvent,
) -> TitoResult<()> {
    tx.delete(key.as_bytes().to_vec()).await?;
    if let Some(owner) = &stored.owner {
        let owner_key = keys::owner_key(root, &owner.kind, &owner.id, keys::OWNER_WAITING, key);
        tx.delete(owner_key.into_bytes()).await?;
    }
    Ok(())
}

/// Completes a waiting step as cancelled inside `tx` (its row `stored`, read at `key`), and
/// applies that to its batch; the caller cascades to its dependents.
async fn cancel_waiting_row<X: TitoTransaction>(
    tx: &X,
    root: &str,
    key: &str,
    mut stored: StoredEvent,
    why: &str,
    wakes: &mut Vec<Wake>,
) -> TitoResult<()> {
    remove_waiting(tx, root, key, &stored).await?;
    stored.cancelled = Some(why.to_string());
    if let Some(link) = &mut stored.step {
        link.waiting_on.clear();
    }
    crate::queue::completed::store_completed(tx, root, &mut stored, true).await?;
    if let Some(batch) = &stored.batch {
        super::batch::child_ended_now(tx, &batch.id, Finish::Cancelled, wakes).await?;
    }
    Ok(())
}

/// Cancels the waiting step at `key` inside `tx`, cascading to its dependents; `None` when it
/// is not there.
pub(crate) async fn cancel_waiting<X: TitoTransaction>(
    tx: &X,
    root: &str,
    key: &str,
    why: &str,
) -> TitoResult<Option<Vec<Wake>>> {
    let Some(row) = tx.get(key.as_bytes()).await? else {
        return Ok(None);
    };
    let stored = StoredEvent::parse(&row)?;
    let Some(link) = stored.step.clone() else {
        return Err(malformed(
            "waiting step",
            key.as_bytes(),
            "no workflow link",
        ));
    };
    let mut wakes = Vec::new();
    cancel_waiting_row(tx, root, key, stored, why, &mut wakes).await?;
    step_finished(
        tx,
        &link.workflow,
        &link.step,
        Finish::Cancelled,
        &mut wakes,
    )
    .await?;
    Ok(Some(wakes))
}

/// A workflow as [`Graphs::workflow`] reads it.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[non_exhaustive]
pub struct WorkflowState {
    /// Its id.
    pub id: String,
    /// When it was published (Unix ms, the store's clock).
    pub created_ms: u64,
    /// Its steps, in the order they were added.
    pub steps: Vec<StepState>,
}

impl WorkflowState {
    /// Whether every step finished (completed, died, or was cancelled; a step whose row
    /// retention deleted counts as finished).
    pub fn finished(&self) -> bool {
        self.steps.iter().all(|s| {
            matches!(
                s.state,
                InvocationState::Finished(_) | InvocationState::Unknown
            )
        })
    }

    /// How many steps are in each state: waiting, pending (due, running or between
    /// attempts), completed, cancelled, dead.
    pub fn counts(&self) -> [(&'static str, usize); 5] {
        let mut counts = [
            ("waiting", 0),
            ("pending", 0),
            ("completed", 0),
            ("cancelled", 0),
            ("dead", 0),
        ];
        for step in &self.steps {
            let slot = match &step.state {
                InvocationState::Waiting { .. } => 0,
                InvocationState::Pending { .. } => 1,
                InvocationState::Finished(Finished::Completed(_)) | InvocationState::Unknown => 2,
                InvocationState::Finished(Finished::Cancelled(_)) => 3,
                InvocationState::Finished(Finished::Dead { .. }) => 4,
            };
            counts[slot].1 += 1;
        }
        counts
    }
}

/// One step of a [`WorkflowState`].
#[derive(Clone, Debug, PartialEq, Serialize)]
#[non_exhaustive]
pub struct StepState {
    /// Its name.
    pub name: String,
    /// Its queue, as its user named it (`default` for the default queue).
    pub queue: String,
    /// Its event id.
    pub event_id: String,
    /// The steps it depends on.
    pub after: Vec<String>,
    /// What a dependency's failure does to it.
    pub on_failure: OnFailure,
    /// Where it is, with its result or error when it finished.
    pub state: InvocationState<serde_json::Value>,
}

/// One workflow of [`Graphs::workflows`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct WorkflowSummary {
    /// Its id.
    pub id: String,
    /// When it was published (Unix ms).
    pub created_ms: u64,
    /// How many steps it has.
    pub steps: usize,
}

/// The step records of workflow `id`, in the order they were added, with their names.
pub(crate) async fn step_records<X: TitoTransaction>(
    tx: &X,
    id: &str,
) -> TitoResult<Vec<(String, StepRecord)>> {
    let mut steps = Vec::new();
    for (key, value) in scan_prefix(tx, &keys::workflow_step_prefix(id)).await? {
        let record: StepRecord = parse("workflow step", &key, &value)?;
        let name = keys::key_str(&key)?
            .strip_prefix(&keys::workflow_step_prefix(id))
            .map(keys::decode_str)
            .transpose()?
            .unwrap_or_default();
        steps.push((name, record));
    }
    steps.sort_by_key(|(_, record)| record.n);
    Ok(steps)
}

impl<E: TitoEngine> Graphs<E> {
    /// Publishes a workflow in a transaction of its own: its steps without dependencies are
    /// due at once, the others wait. Idempotent per workflow id.
    pub async fn publish_workflow(&self, workflow: &Workflow) -> TitoResult<WorkflowPublished> {
        workflow.check()?;
        let workflow = Arc::new(workflow.clone());
        let db = self.db.clone();
        self.db
            .transaction(|tx| {
                let (workflow, db) = (workflow.clone(), db.clone());
                async move {
                    let mut writes = engine::Writes::default();
                    let (answer, wakes) = plan(&tx, &workflow, &mut writes).await?;
                    writes.apply(&tx).await?;
                    super::wake_after_commit(&db, &tx, wakes);
                    Ok::<_, TitoError>(answer)
                }
            })
            .await
    }

    /// Publishes many workflows in transactions of their own, in their order: each
    /// transaction holds whole workflows of at most [`PUBLISH_BATCH`](crate::queue::PUBLISH_BATCH)
    /// steps together (a larger workflow goes alone). Returns one answer per workflow, in order.
    ///
    /// Every workflow is checked before anything is written (two of one id in the list are
    /// refused). When a transaction fails, the ones before it stay committed and the error
    /// ([`TitoError::PartiallyPublished`]) says how many workflows were published: publishing
    /// the same list again is safe, since a workflow id published already is answered
    /// `duplicate: true` and writes nothing.
    pub async fn publish_workflows(
        &self,
        workflows: &[Workflow],
    ) -> TitoResult<Vec<WorkflowPublished>> {
        let mut ids = std::collections::HashSet::new();
        for (at, workflow) in workflows.iter().enumerate() {
            workflow.check().map_err(|err| match err {
                TitoError::InvalidArgument(why) => TitoError::InvalidArgument(format!(
                    "workflow {at} of {} ({:?}): {why}; nothing was published",
                    workflows.len(),
                    workflow.id
                )),
                other => other,
            })?;
            if !ids.insert(workflow.id.as_str()) {
                return Err(TitoError::invalid_argument(format!(
                    "workflow id {:?} appears twice in the list; nothing was published",
                    workflow.id
                )));
            }
        }
        let mut chunks: Vec<Vec<Workflow>> = Vec::new();
        let mut steps_in_last = 0;
        for workflow in workflows {
            let steps = workflow.steps.len();
            match chunks.last_mut() {
                Some(last) if steps_in_last + steps <= crate::queue::PUBLISH_BATCH => {
                    last.push(workflow.clone());
                    steps_in_last += steps;
                }
                _ => {
                    chunks.push(vec![workflow.clone()]);
                    steps_in_last = steps;
                }
            }
        }
        let mut published = Vec::with_capacity(workflows.len());
        for chunk in chunks {
            let chunk = Arc::new(chunk);
            let db = self.db.clone();
            let answers = self
                .db
                .transaction(|tx| {
                    let (chunk, db) = (chunk.clone(), db.clone());
                    async move {
                        let mut answers = Vec::with_capacity(chunk.len());
                        for workflow in chunk.iter() {
                            let mut writes = engine::Writes::default();
                            let (answer, wakes) = plan(&tx, workflow, &mut writes).await?;
                            writes.apply(&tx).await?;
                            super::wake_after_commit(&db, &tx, wakes);
                            answers.push(answer);
                        }
                        Ok::<_, TitoError>(answers)
                    }
                })
                .await;
            match answers {
                Ok(answers) => published.extend(answers),
                Err(err) if published.is_empty() => return Err(err),
                Err(err) => {
                    return Err(TitoError::PartiallyPublished {
                        published: published.len(),
                        total: workflows.len(),
                        cause: Box::new(err),
                    });
                }
            }
        }
        Ok(published)
    }

    /// Publishes a workflow inside `tx`, atomically with the rest of it (the data that caused
    /// it): all of it or, on an error, nothing of it in `tx`.
    pub async fn publish_workflow_in_tx(
        &self,
        workflow: &Workflow,
        tx: &E::Transaction,
    ) -> TitoResult<WorkflowPublished> {
        workflow.check()?;
        let mut writes = engine::Writes::default();
        let (answer, wakes) = plan(tx, workflow, &mut writes).await?;
        writes.apply(tx).await?;
        super::wake_after_commit(&self.db, tx, wakes);
        Ok(answer)
    }

    /// Workflow `id` and each step's state, read in one snapshot; `None` when there is no
    /// such workflow.
    pub async fn workflow(&self, id: &str) -> TitoResult<Option<WorkflowState>> {
        check_name("a workflow id", id)?;
        engine::read_only(&self.db, async |tx| {
            let Some(bytes) = tx.get(keys::workflow_key(id).as_bytes()).await? else {
                return Ok(None);
            };
            let record: WorkflowRecord = parse("workflow", id.as_bytes(), &bytes)?;
            let steps = step_records(tx, id).await?;
            let id_keys: Vec<Vec<u8>> = steps
                .iter()
                .map(|(_, r)| keys::event_id_key(&r.q, &r.id).into_bytes())
                .collect();
            let at: Vec<Option<Vec<u8>>> = tx.batch_get(&id_keys).await?;
            let rows = tx
                .batch_get(&at.iter().flatten().cloned().collect::<Vec<_>>())
                .await?;
            let mut rows = rows.into_iter();
            let mut out = Vec::with_capacity(steps.len());
            for ((name, record), at) in steps.into_iter().zip(at) {
                let state = match at {
                    None => InvocationState::Unknown,
                    Some(at) => match rows.next().flatten() {
                        None => InvocationState::Unknown,
                        // Past retention, its event id taken by another invocation since.
                        Some(row) if !row_is_step(&row, id, &name)? => InvocationState::Unknown,
                        Some(row) => state_of(&record.q, &record.id, &at, &row)?,
                    },
                };
                out.push(StepState {
                    name,
                    queue: keys::queue_name(&record.q),
                    event_id: record.id,
                    after: record.after,
                    on_failure: record.on,
                    state,
                });
            }
            Ok(Some(WorkflowState {
                id: id.to_string(),
                created_ms: record.created_ms,
                steps: out,
            }))
        })
        .await
    }

    /// Up to `limit` (1 to 1000) workflows in id order, after `after` when given.
    pub async fn workflows(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> TitoResult<Vec<WorkflowSummary>> {
        let prefix = keys::workflow_prefix();
        let start = match after {
            Some(id) => keys::key_after(keys::workflow_key(id)),
            None => prefix.clone(),
        };
        page(&self.db, "workflows", &prefix, start, limit)
            .await?
            .into_iter()
            .map(|(id, key, value)| {
                let record: WorkflowRecord = parse("workflow", &key, &value)?;
                Ok(WorkflowSummary {
                    id,
                    created_ms: record.created_ms,
                    steps: record.steps,
                })
            })
            .collect()
    }

    /// The end of dependency `step` of the workflow step `event` is (in its handler):
    /// `Completed` with its result decoded as `R`, or, for a step that runs anyway,
    /// `Dead`/`Cancelled`. Refused when `event` is no workflow step or `step` is not one of
    /// its dependencies; `NotFound` when the dependency's completed row is past its queue's
    /// `completed_retention` (keep it longer than a step waits).
    pub async fn dependency<T, R: DeserializeOwned>(
        &self,
        event: &QueueEvent<T>,
        step: &StepName<R>,
    ) -> TitoResult<Finished<R>> {
        let Some(of) = &event.workflow else {
            return Err(TitoError::invalid_argument(format!(
                "event {:?} is no workflow step: only a step's handler reads its \
                 dependencies' results",
                event.id
            )));
        };
        let (workflow, name) = (of.workflow.as_str(), step.name());
        engine::read_only(&self.db, async |tx| {
            let wanted = [
                keys::workflow_step_key(workflow, &of.step).into_bytes(),
                keys::workflow_step_key(workflow, name).into_bytes(),
            ];
            let found = tx.batch_get(&wanted).await?;
            let record = |i: usize| -> TitoResult<Option<StepRecord>> {
                found[i]
                    .as_deref()
                    .map(|bytes| parse("workflow step", &wanted[i], bytes))
                    .transpose()
            };
            let own = record(0)?;
            let dependency = record(1)?;
            let (Some(own), Some(dependency)) = (own, dependency) else {
                return Err(TitoError::NotFound(format!(
                    "workflow {workflow:?} has no step {name:?} (or no step {:?})",
                    of.step
                )));
            };
            if !own.after.iter().any(|d| d == name) {
                return Err(TitoError::invalid_argument(format!(
                    "step {name:?} is not a dependency of step {:?} in workflow {workflow:?}: \
                     declare it with .after([{name:?}])",
                    of.step
                )));
            }
            let at = tx
                .get(keys::event_id_key(&dependency.q, &dependency.id).as_bytes())
                .await?;
            let row = match &at {
                Some(at) => tx.get(at).await?,
                None => None,
            };
            // Gone, or its event id taken by another invocation since retention deleted it.
            let (Some(at), Some(row)) = (
                at,
                row.filter(|row| row_is_step(row, workflow, name).unwrap_or(false)),
            ) else {
                return Err(TitoError::NotFound(format!(
                    "step {name:?} of workflow {workflow:?} (event {:?}) is past its queue's \
                     completed_retention",
                    dependency.id
                )));
            };
            match state_of::<R>(&dependency.q, &dependency.id, &at, &row)? {
                InvocationState::Finished(finished) => Ok(finished),
                _ => Err(TitoError::invalid_argument(format!(
                    "step {name:?} of workflow {workflow:?} has not finished: a step runs once \
                     its dependencies ended"
                ))),
            }
        })
        .await
    }
}

/// Whether a stored invocation row is step `step` of workflow `workflow` (an event id of a
/// step whose completed row retention deleted may name a later, unrelated invocation).
pub(crate) fn row_is_step(row: &[u8], workflow: &str, step: &str) -> TitoResult<bool> {
    let stored = crate::event::StoredEvent::parse(row)?;
    Ok(stored
        .step
        .is_some_and(|link| link.workflow == workflow && link.step == step))
}

/// The indexes of `steps`, each step before the steps it depends on (dependents first).
pub(crate) fn reverse_topological(steps: &[(String, StepRecord)]) -> Vec<usize> {
    let index: HashMap<&str, usize> = steps
        .iter()
        .enumerate()
        .map(|(i, (n, _))| (n.as_str(), i))
        .collect();
    let mut dependents = vec![0usize; steps.len()];
    for (_, record) in steps {
        for dep in &record.after {
            if let Some(&d) = index.get(dep.as_str()) {
                dependents[d] += 1;
            }
        }
    }
    // Steps no step waits for go first; a step goes once every step waiting for it went.
    let mut ready: Vec<usize> = (0..steps.len()).filter(|&i| dependents[i] == 0).collect();
    let mut order = Vec::with_capacity(steps.len());
    let mut placed = vec![false; steps.len()];
    while let Some(i) = ready.pop() {
        placed[i] = true;
        order.push(i);
        for dep in &steps[i].1.after {
            if let Some(&d) = index.get(dep.as_str()) {
                dependents[d] -= 1;
                if dependents[d] == 0 {
                    ready.push(d);
                }
            }
        }
    }
    // Stored graphs have no cycle; whatever is left (a damaged record) goes last.
    order.extend((0..steps.len()).filter(|&i| !placed[i]));
    order
}
