//! Tito: a data layer for TiKV.
//!
//! Models with secondary indexes, transactions with safe retry, and a partitioned scheduled
//! queue whose events commit in the same transaction as the data, on an embedded store today
//! and on a TiKV cluster tomorrow.
//!
//! - [`engine`]: the storage contract ([`TitoEngine`], [`TitoTransaction`]), transactions with
//!   replay on conflict, and a fault-injecting wrapper for tests.
//! - [`backend`]: the engines: [`backend::embedded::Embedded`], [`backend::tikv::TiKV`], and
//!   [`backend::memory::Memory`] for unit tests and simulation.
//! - [`model`]: models with sparse, composite and unique indexes, integrity manifests and index
//!   queries with cursors; `#[derive(TitoModel)]` ([`TitoModel`](derive@TitoModel)) writes the impl and typed
//!   queries.
//! - [`queue`]: the partitioned scheduled queue: transactional publication, leased workers
//!   (standalone, transactional or in a cluster), retention, owners.
//! - [`kv`]: versioned, expiring key/value entries that join the same transactions.
//! - [`inbox`]: a model whose rows are the queue (claim, lease, outcomes, dead letters).
//! - [`schema`]: each table's stored index catalog, online index builds and drops, audit and
//!   repair.
//!
//! # Examples
//!
//! ```
//! use tito::backend::embedded::Embedded;
//! use tito::{TitoEngine, TitoError, TitoTransaction};
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), TitoError> {
//! let db = Embedded::temporary().await?;
//! db.transaction(|tx| async move {
//!     tx.put(b"table:user:1".to_vec(), br#"{"id":"1"}"#.to_vec()).await?;
//!     tx.put(b"table:user:2".to_vec(), br#"{"id":"2"}"#.to_vec()).await
//! })
//! .await?;
//!
//! let tx = db.begin().await?;
//! let rows = tx.scan(b"table:user:", b"table:user;", 10).await?;
//! assert_eq!(rows.len(), 2);
//! # Ok(())
//! # }
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

pub mod backend;
mod counters;
pub mod engine;
mod error;
mod event;
pub mod inbox;
pub mod inspect;
/// Storage keys: internal (their layout is in `docs/storage-layout.md`), public with the
/// `test-util` feature for tests that read or damage storage directly.
#[cfg(feature = "test-util")]
pub mod keys;
#[cfg(not(feature = "test-util"))]
#[allow(dead_code)]
pub(crate) mod keys;
pub mod kv;
pub mod model;
pub mod queue;
mod runtime;
pub mod schema;
pub mod store;
pub mod telemetry;
mod util;

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;

pub use engine::{RetryPolicy, TitoEngine, TitoTransaction};
pub use error::{BoxError, TitoError, TitoResult};
#[allow(deprecated)]
pub use keys::{key_after, next_string_lexicographically, prefix_end, prefix_end_bytes};
/// The trait of index field types; derive it with `#[derive(tito::IndexValue)]` for unit enums
/// and newtypes (see [`model::value`]).
pub use model::IndexValue;
pub use model::{
    TitoEventConfig, TitoIndexBlockType, TitoIndexConfig, TitoIndexField, TitoModel,
    TitoModelTrait, TitoOperation, TitoOptions, TitoPage,
};
pub use queue::{
    Published, Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, QueueHandlerResult, QueueOwner,
    QueueStats, Topic, TopicQueue, WorkerConfig, Workers,
};
/// Derives [`TitoModelTrait`] and typed index queries from `#[tito(...)]` attributes; see
/// [`model`].
pub use tito_derive::{IndexValue, TitoModel, TitoShape};

pub use backend::embedded::Embedded;
#[cfg(feature = "tikv")]
pub use backend::tikv::TiKV;
pub use inbox::Inbox;
pub use kv::Kv;

/// What a first program needs, in one import: `use tito::prelude::*;`.
///
/// ```
/// use serde::{Deserialize, Serialize};
/// use tito::prelude::*;
///
/// #[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
/// #[tito(index = "by_team: team")]
/// struct Member { id: String, team: String }
///
/// # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
/// # async fn main() -> Result<(), TitoError> {
/// let db = Embedded::temporary().await?;
/// let members = db.clone().model::<Member>();
/// members.build(Member { id: "1".into(), team: "core".into() }).await?;
/// let page = members.by_team("core").limit(10).execute().await?;
/// assert_eq!(page.items.len(), 1);
/// db.close().await
/// # }
/// ```
pub mod prelude {
    pub use crate::backend::embedded::Embedded;
    #[cfg(feature = "tikv")]
    pub use crate::backend::tikv::TiKV;
    pub use crate::inbox::{
        Inbox, InboxConfig, InboxDelivery, InboxModel, InboxOutcome, run_inbox,
    };
    pub use crate::kv::Kv;
    pub use crate::model::{TitoModelTrait, TitoOperation, TitoOptions, TitoPage};
    pub use crate::queue::{
        ModelEvent, Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, QueueHandlerResult,
        QueueOwner, Topic, TopicQueue, WorkerConfig, Workers, run_transactional_worker, run_worker,
    };
    pub use crate::{IndexValue, TitoEngine, TitoError, TitoModel, TitoResult, TitoTransaction};
}

/// The README's code samples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
