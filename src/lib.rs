//! The workspace's root package holds the integration tests, examples and benches. Its library
//! holds nothing but the guide (`docs/guide/`): each chapter's examples are compiled and run as
//! doc tests by `cargo test --workspace`.

/// `docs/guide/models.md`
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/models.md")]
pub struct Models;

/// `docs/guide/transactions.md`
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/transactions.md")]
pub struct Transactions;

/// `docs/guide/errors/not-an-index-field.md`
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/errors/not-an-index-field.md")]
pub struct ErrorNotAnIndexField;

/// `docs/guide/errors/index-value-form.md`
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/errors/index-value-form.md")]
pub struct ErrorIndexValueForm;

/// `docs/guide/events-and-workers.md`
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/events-and-workers.md")]
pub struct EventsAndWorkers;

/// `docs/guide/testing.md`
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/testing.md")]
pub struct Testing;

/// `docs/guide/kv.md`
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/kv.md")]
pub struct Kv;

/// `docs/guide/inboxes.md`
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/inboxes.md")]
pub struct Inboxes;

/// `docs/guide/changing.md`
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/changing.md")]
pub struct Changing;

/// `docs/guide/queues.md`
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/queues.md")]
pub struct Queues;

/// `docs/guide/operating.md`
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/operating.md")]
pub struct Operating;

/// `docs/guide/tikv.md`
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/tikv.md")]
pub struct Tikv;

/// `docs/guide/guarantees.md`
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/guarantees.md")]
pub struct Guarantees;

/// `docs/guide/errors/index-not-ready.md`
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/errors/index-not-ready.md")]
pub struct ErrorIndexNotReady;

/// `docs/guide/errors/unique-values.md`
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/errors/unique-values.md")]
pub struct ErrorUniqueValues;

/// `docs/guide/errors/retries-exhausted.md`
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/errors/retries-exhausted.md")]
pub struct ErrorRetriesExhausted;

/// `docs/guide/errors/commit-outcome-unknown.md`
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/errors/commit-outcome-unknown.md")]
pub struct ErrorCommitOutcomeUnknown;

/// `docs/guide/errors/transaction-aborted.md`
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/errors/transaction-aborted.md")]
pub struct ErrorTransactionAborted;

/// `docs/guide/errors/row-shape-not-read.md`
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/errors/row-shape-not-read.md")]
pub struct ErrorRowShapeNotRead;
