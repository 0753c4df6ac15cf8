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

pub(crate) use super::ends::{BATCH, GraphRef, WORKFLOW};

/// Graphs one fold transaction takes at most.
const FOLD_GRAPHS: usize = 32;

/// End records the maintenance sweep reads per pass.
pub(crate) const SWEEP_ENDS: usize = 1000;

/// One process's folds of one store: the graphs waiting, and whether a task folds them.
#[derive(Debug, Default)]
pub(crate) struct Folder {
    state: Mutex<FolderState>,
    /// Set by [`drop_fold_requests`]: requests are dropped, as a process that crashed right
    /// after its commits would drop them.
    dropping: std::sync::atomic::AtomicBool,
}

/// Test support: while `on`, this process folds nothing on `db`, as a process that crashed
/// right after each commit would not: it drops the folds its commits ask for, and its workers'
/// maintenance passes skip the end records left behind. The end records stay for the next
/// process (or this one once it is off) to fold.
#[cfg(feature = "test-util")]
pub fn drop_fold_requests<E: TitoEngine>(db: &E, on: bool) {
    let folder = db.extensions().get::<Folder>();
    folder
        .dropping
        .store(on, std::sync::atomic::Ordering::SeqCst);
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
    if folder.dropping.load(std::sync::atomic::Ordering::SeqCst) {
        return;
    }
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
    let folder = db.extensions().get::<Folder>();
    if folder.dropping.load(std::sync::atomic::Ordering::SeqCst) {
        return Ok(0);
    }
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
