//! Metrics and spans: what Tito reports to the application's recorder and subscriber.
//!
//! # Metrics
//!
//! Tito records through the [`metrics`](https://docs.rs/metrics) facade: nothing is kept or
//! exported until the application installs a recorder (a Prometheus exporter, say); with none
//! installed a recording builds its key (copying its label values) and drops it. Names and
//! labels follow the Prometheus conventions: counters end in `_total`, durations are
//! histograms in seconds. Install the recorder before the first store handle is used; the
//! facade's global recorder can be set once per process.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `tito_transactions_begun_total` | counter | | transaction attempts begun by [`TitoEngine::transaction`](crate::TitoEngine::transaction) (each replay is one more) |
//! | `tito_transactions_committed_total` | counter | | attempts that committed |
//! | `tito_transactions_conflicted_total` | counter | | attempts whose commit conflicted (retryable) |
//! | `tito_transactions_replayed_total` | counter | | replays after a conflict or a commit proven not applied |
//! | `tito_transactions_unknown_outcomes_total` | counter | `resolution` (`committed`, `not_committed`, `undecided`, `unresolved`) | commits whose outcome the engine could not tell, and how each was settled |
//! | `tito_transaction_commit_seconds` | histogram | | time of each commit call |
//! | `tito_queue_published_total` | counter | `queue` | invocations written by `publish` / `publish_in_tx` (duplicates not counted) |
//! | `tito_queue_duplicates_total` | counter | `queue` | publications of an event id that was already live |
//! | `tito_queue_delivered_total` | counter | `queue` | invocations handed to handlers |
//! | `tito_queue_acknowledged_total` | counter | `queue` | invocations completed without a replacement |
//! | `tito_queue_rescheduled_total` | counter | `queue` | invocations completed with a replacement |
//! | `tito_queue_failed_total` | counter | `queue` | handler errors, panics and timeouts |
//! | `tito_queue_retried_total` | counter | `queue` | failed attempts a failure policy scheduled again |
//! | `tito_queue_dead_total` | counter | `queue` | invocations a failure policy moved to the dead state |
//! | `tito_queue_limited_total` | counter | `queue` | runnable invocations that waited for a concurrency slot |
//! | `tito_queue_rate_limited_total` | counter | `queue` | invocations a rate limit moved to a later due time |
//! | `tito_queue_outcome_failures_total` | counter | `queue` | outcomes not applied (transaction not committed, lease lost, row cancelled or erased meanwhile) |
//! | `tito_queue_replayed_total` | counter | `queue` | transactional handler calls run again: their transaction conflicted (with another transaction's write of a key it read or wrote) or its unknown outcome was resolved as not applied |
//! | `tito_queue_malformed_total` | counter | `queue` | pending rows that do not decode (left in place) |
//! | `tito_queue_expired_total` | counter | `queue` | completed rows deleted by retention |
//! | `tito_queue_handler_seconds` | histogram | `queue` | handler run time, to its report |
//! | `tito_queue_lateness_seconds` | histogram | `queue` | delivery time minus due time (host clock; 0 when early) |
//! | `tito_queue_outcome_batch_size` | histogram | `queue` | outcomes per outcome transaction |
//! | `tito_queue_leases_held` | gauge | `queue`, `worker` | partition leases the worker holds |
//! | `tito_queue_leases_lost_total` | counter | `queue` | leases lost to another worker or to expiry |
//! | `tito_inbox_claimed_total` | counter | `table`, `group` | rows claimed and handed to handlers |
//! | `tito_inbox_outcomes_total` | counter | `table`, `group`, `outcome` (`ack`, `drop`, `retry`, `failed`, `lease_lost`) | outcomes of deliveries |
//! | `tito_inbox_dead_lettered_total` | counter | `table`, `group` | rows out of attempts, moved to the dead letter |
//! | `tito_inbox_bad_rows_total` | counter | `table` | rows set aside because they do not decode |
//! | `tito_kv_operations_total` | counter | `operation` (`get`, `put`, `put_if_absent`, `incr`, `delete`, `list`, `sweep`) | key/value calls |
//! | `tito_schema_rows_total` | counter | `table`, `index`, `work` (`build`, `drop`) | rows handled by index builds and drops |
//! | `tito_schema_finished_total` | counter | `table`, `index`, `work` | builds and drops finished |
//! | `tito_shape_rewritten_total` | counter | `table` | rows a shape rewrite wrote in the allowed version |
//!
//! # Spans
//!
//! Units of work run inside [`tracing`] spans whose field names are shared across modules:
//!
//! | span | fields |
//! |---|---|
//! | `tito.transaction` | `attempt`, `outcome` (`committed`, `conflict`, `unknown`, `error`, `closure_error`) |
//! | `tito.model` | `table`, `operation` (`insert`, `update`, `upsert`, `delete`, `get`), `id` |
//! | `tito.queue.handler` | `queue`, `partition`, `event_id`, `due` (the invocation's due time, Unix s) |
//! | `tito.inbox.delivery` | `table`, `group`, `id`, `attempt` |
//! | `tito.maintenance` | `queue`, `worker` |
//!
//! Spans are at the `debug` level except the handler and delivery spans (`info`), so a
//! subscriber at `info` sees one span per unit of work an operator reasons about. A queue
//! handler span has no attempt number: a failed invocation stays pending unchanged (nothing
//! is written on failure), so no count of earlier runs exists to report; an inbox row counts
//! its claims when the model has an `attempt` role (`attempt` is 0 without one).

/// The metric names, one constant each (see the [module documentation](self)).
pub mod names {
    /// See the table in [`crate::telemetry`].
    pub const TRANSACTIONS_BEGUN: &str = "tito_transactions_begun_total";
    /// See the table in [`crate::telemetry`].
    pub const TRANSACTIONS_COMMITTED: &str = "tito_transactions_committed_total";
    /// See the table in [`crate::telemetry`].
    pub const TRANSACTIONS_CONFLICTED: &str = "tito_transactions_conflicted_total";
    /// See the table in [`crate::telemetry`].
    pub const TRANSACTIONS_REPLAYED: &str = "tito_transactions_replayed_total";
    /// See the table in [`crate::telemetry`].
    pub const TRANSACTIONS_UNKNOWN: &str = "tito_transactions_unknown_outcomes_total";
    /// See the table in [`crate::telemetry`].
    pub const COMMIT_SECONDS: &str = "tito_transaction_commit_seconds";
    /// See the table in [`crate::telemetry`].
    pub const QUEUE_PUBLISHED: &str = "tito_queue_published_total";
    /// See the table in [`crate::telemetry`].
    pub const QUEUE_DUPLICATES: &str = "tito_queue_duplicates_total";
    /// See the table in [`crate::telemetry`].
    pub const QUEUE_DELIVERED: &str = "tito_queue_delivered_total";
    /// See the table in [`crate::telemetry`].
    pub const QUEUE_ACKNOWLEDGED: &str = "tito_queue_acknowledged_total";
    /// See the table in [`crate::telemetry`].
    pub const QUEUE_RESCHEDULED: &str = "tito_queue_rescheduled_total";
    /// See the table in [`crate::telemetry`].
    pub const QUEUE_FAILED: &str = "tito_queue_failed_total";
    /// Failed attempts a failure policy scheduled again.
    pub const QUEUE_RETRIED: &str = "tito_queue_retried_total";
    /// Invocations a failure policy moved to the dead state.
    pub const QUEUE_DEAD: &str = "tito_queue_dead_total";
    /// Runnable invocations that waited for a concurrency slot.
    pub const QUEUE_LIMITED: &str = "tito_queue_limited_total";
    /// Invocations a rate limit moved to a later due time.
    pub const QUEUE_RATE_LIMITED: &str = "tito_queue_rate_limited_total";
    /// See the table in [`crate::telemetry`].
    pub const QUEUE_OUTCOME_FAILURES: &str = "tito_queue_outcome_failures_total";
    /// Transactional handler calls run again because their transaction did not commit.
    pub const QUEUE_REPLAYED: &str = "tito_queue_replayed_total";
    /// See the table in [`crate::telemetry`].
    pub const QUEUE_MALFORMED: &str = "tito_queue_malformed_total";
    /// See the table in [`crate::telemetry`].
    pub const QUEUE_EXPIRED: &str = "tito_queue_expired_total";
    /// See the table in [`crate::telemetry`].
    pub const QUEUE_HANDLER_SECONDS: &str = "tito_queue_handler_seconds";
    /// See the table in [`crate::telemetry`].
    pub const QUEUE_LATENESS_SECONDS: &str = "tito_queue_lateness_seconds";
    /// See the table in [`crate::telemetry`].
    pub const QUEUE_OUTCOME_BATCH: &str = "tito_queue_outcome_batch_size";
    /// See the table in [`crate::telemetry`].
    pub const QUEUE_LEASES_HELD: &str = "tito_queue_leases_held";
    /// See the table in [`crate::telemetry`].
    pub const QUEUE_LEASES_LOST: &str = "tito_queue_leases_lost_total";
    /// See the table in [`crate::telemetry`].
    pub const INBOX_CLAIMED: &str = "tito_inbox_claimed_total";
    /// See the table in [`crate::telemetry`].
    pub const INBOX_OUTCOMES: &str = "tito_inbox_outcomes_total";
    /// See the table in [`crate::telemetry`].
    pub const INBOX_DEAD_LETTERED: &str = "tito_inbox_dead_lettered_total";
    /// See the table in [`crate::telemetry`].
    pub const INBOX_BAD_ROWS: &str = "tito_inbox_bad_rows_total";
    /// See the table in [`crate::telemetry`].
    pub const KV_OPERATIONS: &str = "tito_kv_operations_total";
    /// See the table in [`crate::telemetry`].
    pub const SCHEMA_ROWS: &str = "tito_schema_rows_total";
    /// See the table in [`crate::telemetry`].
    pub const SCHEMA_FINISHED: &str = "tito_schema_finished_total";
    /// See the table in [`crate::telemetry`].
    pub const SHAPE_REWRITTEN: &str = "tito_shape_rewritten_total";

    /// Every name above, for exporters that describe them up front.
    pub const ALL: &[&str] = &[
        TRANSACTIONS_BEGUN,
        TRANSACTIONS_COMMITTED,
        TRANSACTIONS_CONFLICTED,
        TRANSACTIONS_REPLAYED,
        TRANSACTIONS_UNKNOWN,
        COMMIT_SECONDS,
        QUEUE_PUBLISHED,
        QUEUE_DUPLICATES,
        QUEUE_DELIVERED,
        QUEUE_ACKNOWLEDGED,
        QUEUE_RESCHEDULED,
        QUEUE_FAILED,
        QUEUE_RETRIED,
        QUEUE_DEAD,
        QUEUE_LIMITED,
        QUEUE_RATE_LIMITED,
        QUEUE_OUTCOME_FAILURES,
        QUEUE_REPLAYED,
        QUEUE_MALFORMED,
        QUEUE_EXPIRED,
        QUEUE_HANDLER_SECONDS,
        QUEUE_LATENESS_SECONDS,
        QUEUE_OUTCOME_BATCH,
        QUEUE_LEASES_HELD,
        QUEUE_LEASES_LOST,
        INBOX_CLAIMED,
        INBOX_OUTCOMES,
        INBOX_DEAD_LETTERED,
        INBOX_BAD_ROWS,
        KV_OPERATIONS,
        SCHEMA_ROWS,
        SCHEMA_FINISHED,
        SHAPE_REWRITTEN,
    ];
}

/// Describes every metric to the installed recorder (units and help texts), for exporters that
/// print them. Call it once after installing the recorder; recording works without it.
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    use names::*;
    describe_counter!(TRANSACTIONS_BEGUN, "Transaction attempts begun");
    describe_counter!(TRANSACTIONS_COMMITTED, "Transaction attempts committed");
    describe_counter!(
        TRANSACTIONS_CONFLICTED,
        "Transaction attempts whose commit conflicted"
    );
    describe_counter!(TRANSACTIONS_REPLAYED, "Transaction replays");
    describe_counter!(TRANSACTIONS_UNKNOWN, "Commits with an unknown outcome");
    describe_histogram!(COMMIT_SECONDS, Unit::Seconds, "Commit call time");
    describe_counter!(QUEUE_PUBLISHED, "Queue invocations published");
    describe_counter!(QUEUE_DUPLICATES, "Publications of a live event id");
    describe_counter!(
        QUEUE_LIMITED,
        "Runnable invocations that waited for a concurrency slot"
    );
    describe_counter!(QUEUE_RATE_LIMITED, "Invocations a rate limit moved later");
    describe_counter!(QUEUE_DELIVERED, "Queue invocations handed to handlers");
    describe_counter!(QUEUE_ACKNOWLEDGED, "Queue invocations acknowledged");
    describe_counter!(QUEUE_RESCHEDULED, "Queue invocations rescheduled");
    describe_counter!(QUEUE_FAILED, "Queue handler failures");
    describe_counter!(
        QUEUE_RETRIED,
        "Queue failed attempts scheduled again by a failure policy"
    );
    describe_counter!(QUEUE_DEAD, "Queue invocations moved to the dead state");
    describe_counter!(QUEUE_OUTCOME_FAILURES, "Queue outcomes not applied");
    describe_counter!(
        QUEUE_REPLAYED,
        "Transactional handler calls run again after their transaction conflicted"
    );
    describe_counter!(QUEUE_MALFORMED, "Pending rows that do not decode");
    describe_counter!(QUEUE_EXPIRED, "Completed rows deleted by retention");
    describe_histogram!(QUEUE_HANDLER_SECONDS, Unit::Seconds, "Handler run time");
    describe_histogram!(
        QUEUE_LATENESS_SECONDS,
        Unit::Seconds,
        "Delivery time minus due time"
    );
    describe_histogram!(
        QUEUE_OUTCOME_BATCH,
        Unit::Count,
        "Outcomes per outcome transaction"
    );
    describe_gauge!(QUEUE_LEASES_HELD, Unit::Count, "Partition leases held");
    describe_counter!(QUEUE_LEASES_LOST, "Partition leases lost");
    describe_counter!(INBOX_CLAIMED, "Inbox rows claimed");
    describe_counter!(INBOX_OUTCOMES, "Inbox delivery outcomes");
    describe_counter!(INBOX_DEAD_LETTERED, "Inbox rows dead-lettered");
    describe_counter!(INBOX_BAD_ROWS, "Inbox rows set aside as undecodable");
    describe_counter!(KV_OPERATIONS, "Key/value operations");
    describe_counter!(SCHEMA_ROWS, "Rows handled by index builds and drops");
    describe_counter!(SCHEMA_FINISHED, "Index builds and drops finished");
    describe_counter!(
        SHAPE_REWRITTEN,
        "Rows a shape rewrite wrote in the allowed version"
    );
}

/// The `queue` label of a queue: its topic, or `default`.
pub(crate) fn queue_label(topic: Option<&str>) -> String {
    topic.unwrap_or("default").to_string()
}

/// The `queue` label of the queue whose keys start with `root` (`queue:` or `queue@{name}:`).
pub(crate) fn queue_label_of_root(root: &str) -> String {
    match root.strip_prefix("queue@") {
        Some(topic) => crate::keys::decode_str(topic).unwrap_or_else(|_| topic.to_string()),
        None => queue_label(None),
    }
}
