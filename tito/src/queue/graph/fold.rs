//! Folding graph ends: the transactions that apply the end records of a batch's children and a
//! workflow's steps to their graph (see the module above), run one graph at a time per process
//! right after the end's commit, and found again by the workers' maintenance when that did not
//! happen.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::Duration;

use crate::engine::{TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::keys;

use super::Wake;

/// A graph whose end records wait to be folded.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct GraphRef {
    /// `b` for a batch, `w` for a workflow (the kind segment of its end keys).
    pub kind: char,
    pub id: String,
}

impl GraphRef {
    /// A batch's.
    pub fn batch(id: &str) -> Self {
        GraphRef {
            kind: BATCH,
            id: id.to_string(),
        }
    }

    /// A workflow's.
    pub fn workflow(id: &str) -> Self {
        GraphRef {
            kind: WORKFLOW,
            id: id.to_string(),
        }
    }
}

/// The kind segment of a batch's end keys.
pub(crate) const BATCH: char = 'b';
/// The kind segment of a workflow's end keys.
pub(crate) const WORKFLOW: char = 'w';

/// End records one fold applies at most, per graph (a graph with more is folded again at once).
pub(crate) const FOLD_ENDS: usize = 512;

/// Graphs one fold transaction takes at most.
const FOLD_GRAPHS: usize = 32;

/// End records the maintenance sweep reads per pass.
pub(crate) const SWEEP_ENDS: usize = 1000;

/// One process's folds of one store: the graphs waiting, and whether a task folds them.
#[derive(Debug, Default)]
pub(crate) struct Folder {
    state: Mutex<FolderState>,
}

#[derive(Debug, Default)]
struct FolderState {
    waiting: BTreeSet<GraphRef>,
    running: bool,
}

/// Folds `graphs` in the background (one task per store at a time, which goes on while graphs
/// wait). Called once the transaction that wrote their end records has committed.
pub(crate) fn request<E: TitoEngine>(db: &E, graphs: Vec<GraphRef>) {
    let folder = db.extensions().get::<Folder>();
    {
        let mut state = crate::util::lock(&folder.state);
        state.waiting.extend(graphs);
        if state.running {
            return;
        }
        state.running = true;
    }
    let db = db.clone();
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        // No runtime (a commit outside one): the maintenance sweep folds them.
        crate::util::lock(&folder.state).running = false;
        return;
    };
    runtime.spawn(async move {
        let folder = db.extensions().get::<Folder>();
        let mut failures = 0u32;
        loop {
            let graphs: Vec<GraphRef> = {
                let mut state = crate::util::lock(&folder.state);
                let taken: Vec<GraphRef> =
                    state.waiting.iter().take(FOLD_GRAPHS).cloned().collect();
                if taken.is_empty() {
                    state.running = false;
                    return;
                }
                for graph in &taken {
                    state.waiting.remove(graph);
                }
                taken
            };
            match fold(&db, &graphs).await {
                Ok(more) => {
                    failures = 0;
                    crate::util::lock(&folder.state).waiting.extend(more);
                }
                Err(err) => {
                    failures += 1;
                    tracing::warn!(error = %err, graphs = graphs.len(), "folding graph ends failed; the workers' maintenance folds them");
                    // A store that keeps failing (closed, unreachable) is left to the sweep.
                    if failures < 3 {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        crate::util::lock(&folder.state).waiting.extend(graphs);
                    }
                }
            }
        }
    });
}

/// Folds `graphs` in one transaction (one at a time when that fails other than by a
/// conflict, so that one damaged graph does not hold the others); returns the graphs that have
/// more end records than one fold takes.
pub(crate) async fn fold<E: TitoEngine>(db: &E, graphs: &[GraphRef]) -> TitoResult<Vec<GraphRef>> {
    match fold_in_one(db, graphs).await {
        Ok(more) => Ok(more),
        Err(err) if graphs.len() > 1 && !err.is_retryable() => {
            let mut more = Vec::new();
            let mut last = Ok(());
            for graph in graphs {
                match fold_in_one(db, std::slice::from_ref(graph)).await {
                    Ok(rest) => more.extend(rest),
                    Err(err) => {
                        tracing::warn!(kind = %graph.kind, id = graph.id, error = %err, "a graph's ends could not be folded");
                        last = Err(err);
                    }
                }
            }
            last.map(|()| more)
        }
        Err(err) => Err(err),
    }
}

async fn fold_in_one<E: TitoEngine>(db: &E, graphs: &[GraphRef]) -> TitoResult<Vec<GraphRef>> {
    let (db2, graphs) = (db.clone(), graphs.to_vec());
    db.transaction(|tx| {
        let (db, graphs) = (db2.clone(), graphs.clone());
        async move {
            let mut wakes = Vec::new();
            let mut more = Vec::new();
            for graph in &graphs {
                let full = match graph.kind {
                    BATCH => super::batch::fold_batch(&tx, &graph.id, &mut wakes).await?,
                    WORKFLOW => super::workflow::fold_workflow(&tx, &graph.id, &mut wakes).await?,
                    other => {
                        return Err(TitoError::Integrity(format!(
                            "a graph end of unknown kind {other:?}"
                        )));
                    }
                };
                if full {
                    more.push(graph.clone());
                }
            }
            super::wake_after_commit(&db, &tx, wakes);
            Ok::<_, TitoError>(more)
        }
    })
    .await
}

/// The end records of graph `kind`/`id` not folded yet (at most [`FOLD_ENDS`]), read in `tx`.
pub(crate) async fn ends_of<X: TitoTransaction>(
    tx: &X,
    kind: char,
    id: &str,
) -> TitoResult<Vec<(Vec<u8>, Vec<u8>)>> {
    let start = keys::graph_end_prefix(kind, id).into_bytes();
    let end = keys::prefix_end_bytes(&start);
    tx.scan(&start, &end, FOLD_ENDS).await
}

/// Whether any end record waits to be folded in the store.
pub(crate) async fn pending<E: TitoEngine>(db: &E) -> TitoResult<bool> {
    let start = keys::graph_ends_prefix().into_bytes();
    let end = keys::prefix_end_bytes(&start);
    crate::engine::read_only(db, async |tx| {
        Ok::<_, TitoError>(!tx.scan(&start, &end, 1).await?.is_empty())
    })
    .await
}

/// Folds the graphs of end records left behind (a process that crashed after an end's commit,
/// a commit whose outcome was unknown): reads up to [`SWEEP_ENDS`] of them from the first and
/// folds their graphs. Returns how many graphs it folded.
pub(crate) async fn sweep<E: TitoEngine>(db: &E) -> TitoResult<usize> {
    let start = keys::graph_ends_prefix().into_bytes();
    let end = keys::prefix_end_bytes(&start);
    let graphs: BTreeSet<GraphRef> = crate::engine::read_only(db, async |tx| {
        Ok::<_, TitoError>(
            tx.scan(&start, &end, SWEEP_ENDS)
                .await?
                .iter()
                .filter_map(|(key, _)| keys::graph_of_end_key(key))
                .map(|(kind, id)| GraphRef { kind, id })
                .collect(),
        )
    })
    .await?;
    let graphs: Vec<GraphRef> = graphs.into_iter().collect();
    let mut pending = graphs.clone();
    while !pending.is_empty() {
        let chunk: Vec<GraphRef> = pending.drain(..pending.len().min(FOLD_GRAPHS)).collect();
        pending.extend(fold(db, &chunk).await?);
    }
    Ok(graphs.len())
}

/// Writes an end record of graph `graph` inside `tx` (value: `value`), and asks for its fold
/// once `tx` commits.
pub(crate) async fn write_end<X: TitoTransaction>(
    tx: &X,
    graph: GraphRef,
    member: &[&str],
    value: Vec<u8>,
    wakes: &mut Vec<Wake>,
) -> TitoResult<()> {
    let key = keys::graph_end_key(graph.kind, &graph.id, tx.start_version(), member);
    tx.put(key.into_bytes(), value).await?;
    let wake = Wake::Fold(graph);
    if !wakes.contains(&wake) {
        wakes.push(wake);
    }
    Ok(())
}
