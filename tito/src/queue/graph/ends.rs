//! Graph end records: what a transaction that ends a batch child or a workflow step writes
//! (a key no other transaction writes), and what a fold reads (see the module above).

use crate::engine::TitoTransaction;
use crate::error::TitoResult;
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
