//! The storage backends: [`embedded`] (a local durable store, no server) and [`tikv`] (a TiKV
//! cluster). Both implement [`TitoEngine`](crate::TitoEngine); code written against the trait
//! runs on either.

pub mod embedded;
#[cfg(feature = "tikv")]
pub mod tikv;
