//! The storage backends: [`embedded`] (a local durable store, no server), [`tikv`] (a TiKV
//! cluster) and [`memory`] (in memory: unit tests and simulation). All implement
//! [`TitoEngine`](crate::TitoEngine); code written against the trait runs on any of them.

pub mod embedded;
pub mod memory;
#[cfg(feature = "sqlite")]
pub mod sqlite;
#[cfg(feature = "tikv")]
pub mod tikv;
