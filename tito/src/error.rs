//! The one error type of the crate.
//!
//! Every fallible call in Tito returns [`TitoError`]. Backend errors are boxed as the
//! [`source`](std::error::Error::source) of a variant and never leak as the backend's own type,
//! so code written against one engine compiles and behaves the same against another.

use std::error::Error as StdError;

/// A boxed error from a storage backend or another library, kept as the source of a variant.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// The result type of every fallible Tito call.
pub type TitoResult<T> = Result<T, TitoError>;

/// Everything that can go wrong in Tito.
///
/// Match on the variants you handle and treat the rest as failures: the enum is
/// `#[non_exhaustive]` so new kinds of error can be added without breaking callers.
/// [`TitoError::is_retryable`] says whether running the same transaction again may succeed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TitoError {
    /// Another transaction committed a write to a key this transaction wrote (or locked) after
    /// this one started. Nothing of this transaction was written; running it again may succeed.
    #[error("transaction conflict: {message}{}", cause(message, .source))]
    Conflict {
        /// What conflicted, as far as the backend says.
        message: String,
        /// The backend's own error, when there is one.
        #[source]
        source: Option<BoxError>,
    },

    /// [`TitoEngine::transaction`](crate::TitoEngine::transaction) replayed a closure as often as
    /// its retry policy allows, and the last commit still conflicted.
    #[error(
        "transaction still conflicted after {attempts} attempts: {source}; other transactions \
         kept writing the keys it wrote: run it again later, or allow more attempts with \
         `transaction_with(RetryPolicy::default().max_attempts(..))`"
    )]
    RetriesExhausted {
        /// How many times the closure ran.
        attempts: u32,
        /// The conflict of the last attempt.
        #[source]
        source: Box<TitoError>,
    },

    /// The commit may or may not have taken effect (for example the connection broke after the
    /// commit request was sent). The closure is never run again after this error: reconcile
    /// against the stored state instead.
    #[error(
        "the outcome of the commit is unknown (it may have applied; the closure is not run \
         again): run the transaction with `RetryPolicy::default().resolve_unknown_outcomes()` \
         to have it decided, or check the stored state before doing the work again: \
         {message}{}",
        cause(message, .source)
    )]
    CommitOutcomeUnknown {
        /// What happened.
        message: String,
        /// The backend's own error, when there is one.
        #[source]
        source: Option<BoxError>,
    },

    /// The commit applied, but not every key it wrote holds the write (or not every key could
    /// be read back to check). Only the TiKV engine reports it: `tikv-client` 0.4.0 can leave
    /// the keys of one region out of a commit's prewrite when that region's lookup fails (PD
    /// unreachable after a region or transport error), and then commit the rest; Tito reads
    /// every written key back after the client reports a commit, and reports this instead of
    /// success. The transaction is committed (its primary key holds the write): it is never
    /// replayed or resolved. Compare [`PartialCommit::keys`](TitoError::PartialCommit) with
    /// what the transaction meant to write and repair them; the error is logged at error level.
    #[error("the commit applied in part: {message}")]
    PartialCommit {
        /// Which transaction, at which version, and which keys.
        message: String,
        /// The keys that do not hold the write, then those that could not be checked.
        keys: Vec<Vec<u8>>,
    },

    /// A query used an index that is not ready: it is being built (older rows are not in it
    /// yet), being dropped, or unknown to the stored catalog. The message carries the build's
    /// progress.
    #[error(
        "index {index:?} of table {table:?} is not ready: {state}{}",
        index_fix(table, index, state)
    )]
    IndexNotReady {
        /// The table.
        table: String,
        /// The index.
        index: String,
        /// Its state and progress, as text (`building (4200 of about 10000 rows)`).
        state: String,
    },

    /// A unique index cannot be built: rows already hold the same values. The build stopped
    /// where it was, the index stays unready and no row was changed.
    #[error(
        "unique index {index:?} of table {table:?} cannot be built: rows hold the same values: {}; \
         give each pair different values (or delete one row), then start the build again with \
         `restart_build({index:?})` or `tito index restart {table} {index}`",
        format_pairs(.rows)
    )]
    DuplicateValues {
        /// The table.
        table: String,
        /// The unique index.
        index: String,
        /// The first pairs of row ids that hold the same values.
        rows: Vec<(String, String)>,
    },

    /// The model's code and the table's stored schema catalog disagree in a way Tito will not
    /// guess about: an index redefined under its old name, a name still being dropped, or a
    /// writer whose code lacks a conditional index the catalog maintains (an older deploy).
    /// Nothing was written. The message names both schema versions.
    #[error("schema mismatch: {0}")]
    SchemaMismatch(String),

    /// The row (or other record) the operation needs does not exist.
    #[error("not found: {0}")]
    NotFound(String),

    /// An insert found a row with the same id. Nothing was written.
    #[error("already exists: {0}")]
    AlreadyExists(String),

    /// A write would give a unique index's values to a second row. Nothing was written.
    #[error(
        "unique index {index:?} already holds these values for row {owner:?}: write other values, \
         or update row {owner:?} instead"
    )]
    UniqueViolation {
        /// The unique index.
        index: String,
        /// The id of the row that holds the values.
        owner: String,
    },

    /// A subscription to this (model, group) inbox already runs in this process.
    #[error("already subscribed: {0}")]
    AlreadySubscribed(String),

    /// A queue worker no longer holds the lease of the partition it was applying an outcome
    /// for. Nothing was applied; the invocation stays pending for the new lease holder.
    #[error("partition lease lost: {0}")]
    LeaseLost(String),

    /// A compare-and-set found another version than the one expected. Nothing was written.
    #[error("version mismatch on {key}: expected {expected}, found {actual}")]
    VersionMismatch {
        /// What was compared.
        key: String,
        /// The version the caller expected (0: absent).
        expected: u64,
        /// The version found (0: absent or expired).
        actual: u64,
    },

    /// An argument was outside what the call accepts. Nothing was read or written.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The transaction was already committed or rolled back.
    #[error("the transaction is already {0}")]
    TransactionFinished(&'static str),

    /// The transaction is aborted: an operation in it failed after part of its writes had been
    /// buffered (an I/O error, a read that failed half way), so committing it would store half
    /// of that operation. Its commit is refused with this error, which names the first failure;
    /// roll it back (dropping it does) and run the work again in a new transaction. This is
    /// PostgreSQL's "current transaction is aborted" rule. Failures that Tito can foresee (a
    /// unique value taken, a row that exists, a key or value over its limit) are checked before
    /// anything is buffered and do not abort the transaction.
    #[error(
        "the transaction is aborted and cannot commit: an operation failed after buffering part \
         of its writes ({0}); roll it back and run the work again in a new transaction"
    )]
    TransactionAborted(String),

    /// A key or value read from storage is not what Tito wrote there: a malformed key, a value
    /// that is not valid JSON, a broken reverse-index manifest. The message names the key.
    #[error("storage integrity error: {0}")]
    Integrity(String),

    /// A stored row's shape version is one this code does not read: newer than the model's
    /// [`VERSION`](crate::model::TitoModelTrait::VERSION) (written by newer code, met after a
    /// rollback), older than every previous shape the model declares, or refused by a
    /// conversion. The row is left as it is; a delete removes it whatever its shape.
    #[error(
        "row {key:?} is shape version {version}, which {model} (version {code_version}) does not read: {reason}"
    )]
    RowShape {
        /// The row's storage key.
        key: String,
        /// The row's stored version.
        version: u32,
        /// The model's type.
        model: &'static str,
        /// The version the model's code reads and writes.
        code_version: u32,
        /// Why it does not read.
        reason: String,
    },

    /// A value could not be encoded or decoded.
    #[error("serialization error: {message}{}", cause(message, .source))]
    Serialization {
        /// What was being encoded or decoded.
        message: String,
        /// The underlying error.
        #[source]
        source: Option<BoxError>,
    },

    /// An application's own failure, returned by a queue or inbox handler (a mail server that
    /// is down, a client library's error, an `anyhow::Error`). Build it with
    /// [`TitoError::handler`]: `send_mail(&to).await.map_err(TitoError::handler)?`. Workers log
    /// and count it as a failed handler; the invocation stays pending.
    #[error("handler error: {source}")]
    Handler {
        /// The application's error.
        #[source]
        source: BoxError,
    },

    /// The store's data moved to another store ([`crate::store::migrate`]): it refuses writes
    /// through Tito, and nothing of this transaction was written. Point the application at
    /// the store named here; [`crate::store::reopen`] takes writes on this one again.
    #[error(
        "this store moved to {to} (at {at_ms} ms) and takes no more writes: point the \
         application at {to}, or reopen this store for writes if the move is abandoned"
    )]
    StoreMoved {
        /// The store the data moved to, as the move named it.
        to: String,
        /// When the switch began, in the store's milliseconds.
        at_ms: u64,
    },

    /// [`crate::Queue::publish_many`] committed the transactions of the first `published` of
    /// `total` events (each of those events is stored, or was answered as a duplicate of an
    /// invocation already there: `published` counts events handled, not rows written), then a
    /// transaction failed with `cause`, whose events may or may not be stored when the failure
    /// was an unknown outcome. Publishing the same events again is safe and publishes only
    /// what is missing (the stored ones are answered as duplicates by their ids).
    #[error(
        "published the first {published} of {total} events, then: {cause}; publishing the same \
         events again publishes only the rest"
    )]
    PartiallyPublished {
        /// How many events, from the first, the committed transactions handled (written or
        /// answered as duplicates).
        published: usize,
        /// How many events the call was given.
        total: usize,
        /// Why the next transaction failed.
        #[source]
        cause: Box<TitoError>,
    },

    /// The storage backend failed for a reason that is not a conflict.
    #[error("storage error: {message}{}", cause(message, .source))]
    Storage {
        /// What the backend was doing.
        message: String,
        /// The backend's own error.
        #[source]
        source: Option<BoxError>,
    },
}

/// `": {source}"` for a Display text that should carry its cause, unless the message already
/// says it (a message built with the source's text).
fn cause(message: &str, source: &Option<BoxError>) -> String {
    match source {
        Some(source) => {
            let text = source.to_string();
            // Some clients lead with the source location they raised it at (`[file:line]: `).
            let core = text
                .strip_prefix('[')
                .and_then(|rest| rest.split_once("]: "))
                .map_or(text.as_str(), |(_, rest)| rest);
            if core.is_empty() || message.contains(core) {
                String::new()
            } else {
                format!(": {text}")
            }
        }
        None => String::new(),
    }
}

/// What to do about an index that is not ready, from its state's text.
fn index_fix(table: &str, index: &str, state: &str) -> String {
    if state.starts_with("building") {
        if state.contains("stopped:") {
            format!(
                "; fix the rows it names, then `restart_build({index:?})` or `tito index restart \
                 {table} {index}`"
            )
        } else {
            format!(
                "; queries on it are refused until it is built: by queue workers' maintenance, \
                 by `build_indexes` on the model, or by `tito index build {table}`"
            )
        }
    } else if state.starts_with("dropping") {
        "; the code that declared it is gone: query an index the code declares".to_string()
    } else {
        String::new()
    }
}

fn format_pairs(rows: &[(String, String)]) -> String {
    let pairs: Vec<String> = rows
        .iter()
        .map(|(a, b)| format!("{a:?} and {b:?}"))
        .collect();
    pairs.join(", ")
}

impl TitoError {
    /// Whether the failed transaction may succeed if it runs again from the start.
    ///
    /// Only [`TitoError::Conflict`] is retryable. [`TitoError::CommitOutcomeUnknown`] is not:
    /// running the transaction again could apply its effects twice.
    pub fn is_retryable(&self) -> bool {
        matches!(self, TitoError::Conflict { .. })
    }

    /// A [`TitoError::Conflict`] with a message and no source.
    pub fn conflict(message: impl Into<String>) -> Self {
        TitoError::Conflict {
            message: message.into(),
            source: None,
        }
    }

    /// A [`TitoError::CommitOutcomeUnknown`] with a message and no source.
    pub fn commit_outcome_unknown(message: impl Into<String>) -> Self {
        TitoError::CommitOutcomeUnknown {
            message: message.into(),
            source: None,
        }
    }

    /// A [`TitoError::InvalidArgument`].
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        TitoError::InvalidArgument(message.into())
    }

    /// A [`TitoError::Handler`] carrying an application's error: anything that converts into a
    /// boxed error (every `std::error::Error + Send + Sync`, `anyhow::Error`, a `String`).
    ///
    /// ```
    /// use tito::TitoError;
    ///
    /// fn deliver() -> Result<(), std::io::Error> {
    ///     Err(std::io::Error::other("mail server unavailable"))
    /// }
    ///
    /// fn handle() -> Result<(), TitoError> {
    ///     deliver().map_err(TitoError::handler)?;
    ///     Ok(())
    /// }
    ///
    /// let err = handle().unwrap_err();
    /// assert!(matches!(err, TitoError::Handler { .. }));
    /// assert_eq!(err.to_string(), "handler error: mail server unavailable");
    /// assert!(std::error::Error::source(&err).is_some());
    /// ```
    pub fn handler(source: impl Into<BoxError>) -> Self {
        TitoError::Handler {
            source: source.into(),
        }
    }

    /// A [`TitoError::Storage`] wrapping a backend error.
    pub fn storage(message: impl Into<String>, source: impl Into<BoxError>) -> Self {
        TitoError::Storage {
            message: message.into(),
            source: Some(source.into()),
        }
    }
}

/// A boxed application error becomes [`TitoError::Handler`], so `?` works in a handler on
/// calls that return `Result<_, Box<dyn Error + Send + Sync>>`.
impl From<BoxError> for TitoError {
    fn from(source: BoxError) -> Self {
        TitoError::Handler { source }
    }
}

impl From<serde_json::Error> for TitoError {
    fn from(err: serde_json::Error) -> Self {
        TitoError::Serialization {
            message: err.to_string(),
            source: Some(Box::new(err)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_a_user_meets_say_what_to_do() {
        let not_ready = |state: &str| {
            TitoError::IndexNotReady {
                table: "user".into(),
                index: "user_by_email".into(),
                state: state.into(),
            }
            .to_string()
        };
        assert_eq!(
            not_ready("building (4200 of about 10000 rows)"),
            "index \"user_by_email\" of table \"user\" is not ready: building (4200 of about \
             10000 rows); queries on it are refused until it is built: by queue workers' \
             maintenance, by `build_indexes` on the model, or by `tito index build user`"
        );
        assert!(
            not_ready("building (3 rows; stopped: duplicates)").ends_with(
                "fix the rows it names, then `restart_build(\"user_by_email\")` or `tito index \
                 restart user user_by_email`"
            )
        );
        assert!(not_ready("dropping").ends_with("query an index the code declares"));
        assert!(not_ready("the catalog (version 2) does not list it").ends_with("list it"));
        let duplicates = TitoError::DuplicateValues {
            table: "member".into(),
            index: "member_by_email".into(),
            rows: vec![("1".into(), "2".into())],
        };
        assert!(
            duplicates
                .to_string()
                .ends_with("`tito index restart member member_by_email`"),
            "{duplicates}"
        );
        let taken = TitoError::UniqueViolation {
            index: "member_by_email".into(),
            owner: "7".into(),
        };
        assert!(taken.to_string().ends_with("or update row \"7\" instead"));
        let exhausted = TitoError::RetriesExhausted {
            attempts: 10,
            source: Box::new(TitoError::conflict("key k")),
        };
        assert!(
            exhausted
                .to_string()
                .contains("allow more attempts with `transaction_with(RetryPolicy::default().max_attempts(..))`"),
            "{exhausted}"
        );
    }

    #[test]
    fn storage_errors_say_their_cause() {
        let io = std::io::Error::new(std::io::ErrorKind::PermissionDenied, "permission denied");
        let err = TitoError::storage("cannot create directory /x", io);
        assert_eq!(
            err.to_string(),
            "storage error: cannot create directory /x: permission denied"
        );
        // A message that already names its cause does not repeat it.
        let err = TitoError::storage("open failed: disk full", "disk full");
        assert_eq!(err.to_string(), "storage error: open failed: disk full");
        let err = TitoError::Conflict {
            message: "key k".into(),
            source: Some("write conflict".into()),
        };
        assert_eq!(
            err.to_string(),
            "transaction conflict: key k: write conflict"
        );
        let exhausted = TitoError::RetriesExhausted {
            attempts: 3,
            source: Box::new(err),
        };
        assert_eq!(
            exhausted.to_string(),
            "transaction still conflicted after 3 attempts: transaction conflict: key k: write \
             conflict; other transactions kept writing the keys it wrote: run it again later, or \
             allow more attempts with `transaction_with(RetryPolicy::default().max_attempts(..))`"
        );
        let err = TitoError::storage(
            "cannot connect: PD cluster failed to respond",
            "[src/pd/cluster.rs:209]: PD cluster failed to respond",
        );
        assert_eq!(
            err.to_string(),
            "storage error: cannot connect: PD cluster failed to respond"
        );
        let err = TitoError::Storage {
            message: "no cause".into(),
            source: None,
        };
        assert_eq!(err.to_string(), "storage error: no cause");
    }
}
