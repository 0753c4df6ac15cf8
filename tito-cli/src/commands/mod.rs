//! One module per command group, each with its output formatting.

pub(crate) mod graph;
pub(crate) mod inbox;
pub(crate) mod index;
pub(crate) mod kv;
pub(crate) mod moving;
pub(crate) mod queue;
pub(crate) mod store;
pub(crate) mod table;
