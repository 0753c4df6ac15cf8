//! The command line, as clap parses it.

use std::net::SocketAddr;

use clap::{Args, Parser, Subcommand};

/// `--timeout` when not given, in seconds.
pub(crate) const DEFAULT_TIMEOUT: u64 = 5;

/// The longest `--timeout` accepted, in seconds.
pub(crate) const MAX_TIMEOUT: u64 = 3600;

#[derive(Parser)]
#[command(
    name = "tito",
    version,
    about = "Inspect and operate a Tito store (embedded or TiKV)"
)]
pub(crate) struct Cli {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    pub(crate) json: bool,
    /// How long to wait for TiKV to answer, in seconds (1 to 3600: a cluster that has not
    /// answered within an hour is not going to).
    #[arg(long, global = true, default_value_t = DEFAULT_TIMEOUT,
          value_parser = clap::value_parser!(u64).range(1..=MAX_TIMEOUT))]
    pub(crate) timeout: u64,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Args)]
pub(crate) struct StoreArgs {
    /// An embedded store's directory (no other process may hold it open).
    #[arg(long, global = true, conflicts_with_all = ["pd", "keyspace", "tls_ca", "tls_cert", "tls_key", "url"])]
    pub(crate) path: Option<std::path::PathBuf>,
    /// A running application's admin router (`http://HOST:PORT/tito`): the command runs in
    /// that process, on its store (the application enables it with `Admin::commands`).
    #[arg(long, global = true, value_name = "URL", conflicts_with_all = ["pd", "keyspace", "tls_ca", "tls_cert", "tls_key"])]
    pub(crate) url: Option<String>,
    /// With --url: the application's admin token (better: TITO_TOKEN in the environment, which
    /// other users of this machine cannot read from the process list).
    #[arg(long, global = true, value_name = "TOKEN")]
    pub(crate) token: Option<String>,
    /// TiKV: PD endpoints, comma-separated (host:port).
    #[arg(long, global = true, value_delimiter = ',')]
    pub(crate) pd: Option<Vec<String>>,
    /// TiKV: the API v2 keyspace to work in.
    #[arg(long, global = true, value_name = "NAME")]
    pub(crate) keyspace: Option<String>,
    /// TiKV over TLS: the CA certificate (PEM); give --tls-cert and --tls-key with it.
    #[arg(long, global = true, value_name = "FILE")]
    pub(crate) tls_ca: Option<std::path::PathBuf>,
    /// TiKV over TLS: this client's certificate (PEM).
    #[arg(long, global = true, value_name = "FILE")]
    pub(crate) tls_cert: Option<std::path::PathBuf>,
    /// TiKV over TLS: this client's private key (PEM).
    #[arg(long, global = true, value_name = "FILE")]
    pub(crate) tls_key: Option<std::path::PathBuf>,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Queues: list them, see one's backlog, peek at its rows.
    #[command(subcommand)]
    Queue(QueueCommand),
    /// Tables: list them, read a row, page through rows.
    #[command(subcommand)]
    Table(TableCommand),
    /// Indexes: a table's index catalog with states and build progress.
    #[command(subcommand)]
    Index(IndexCommand),
    /// Key/value namespaces: list them, read a key, page through keys.
    #[command(subcommand)]
    Kv(KvCommand),
    /// Inboxes (registered inbox models): counts by state, dead-lettered and bad rows.
    #[command(subcommand)]
    Inbox(InboxCommand),
    /// Workflows: list them, show one's steps with their states, results and errors, cancel one.
    #[command(subcommand)]
    Workflow(WorkflowCommand),
    /// Batches: list them, show one's counts and callbacks, cancel one.
    #[command(subcommand)]
    Batch(BatchCommand),
    /// Checks a table (registered model) against its ready indexes; changes nothing.
    Audit { table: String },
    /// Fixes what an audit finds, in bounded batches.
    Repair { table: String },
    /// Deletes what has expired: completed queue rows past retention, expired kv keys, old
    /// commit markers. Prints what it deleted.
    Gc {
        /// The retention of completed queue rows, in seconds, for every queue of the store
        /// (whatever each queue's own `completed_retention`).
        #[arg(long, default_value_t = 86_400)]
        retention: u64,
        /// The age past which finished workflows and batches are deleted, in seconds (default:
        /// `--retention`).
        #[arg(long)]
        graph_retention: Option<u64>,
    },
    /// Keys: show a storage key as its decoded segments.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Moving a store: copy it into another store (any engine into any engine) and verify two
    /// stores hold the same keys. Stores are named `embedded:DIR`, `sqlite:DIR` or
    /// `tikv:HOST:PORT[,HOST:PORT..]` (with `?keyspace=NAME`, and `ca=FILE&cert=FILE&key=FILE`
    /// for TLS); --path and --pd are not used.
    #[command(subcommand)]
    Store(StoreCommand),
    /// Serves the admin dashboard (tito-admin) for this store.
    Serve {
        /// The address to listen on. Without an authorization hook the dashboard only answers
        /// loopback peers.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
    },
}

#[derive(Subcommand)]
pub(crate) enum QueueCommand {
    /// Every queue with its partition count.
    Ls,
    /// A queue's backlog: per partition due now and later, oldest due, lateness, leases;
    /// completed rows and throughput; handler runs and failures of the last minutes and the
    /// workers that reported them (process, host, age).
    Stats {
        /// The queue's topic (`default` or `''` names the queue without a topic; `''` only,
        /// when a queue's topic is `default`).
        #[arg(long)]
        topic: Option<String>,
    },
    /// A page of a queue's rows: one partition's pending rows in due order, or the newest
    /// completed ones. Malformed rows are shown raw.
    Peek {
        #[arg(long)]
        topic: Option<String>,
        /// The partition (pending rows).
        #[arg(long, default_value_t = 0)]
        partition: u32,
        /// Completed rows instead of pending ones.
        #[arg(long)]
        completed: bool,
        #[arg(long, default_value_t = 20)]
        limit: usize,
        /// The cursor a previous page printed.
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Moves one pending row aside (out of its partition, kept under the queue's `aside:`
    /// keys): for a row no worker can decode, or one that must not run. Prints whether it was
    /// pending.
    SetAside {
        #[arg(long)]
        topic: Option<String>,
        /// The row's storage key, as `queue peek` prints it.
        key: String,
        /// Why, kept with the row.
        #[arg(long, default_value = "set aside by an operator")]
        why: String,
    },
    /// A page of a queue's dead invocations (a worker's failure policy gave up on them), in
    /// event-id order: attempts, last error, when, payload.
    Dead {
        #[arg(long)]
        topic: Option<String>,
        #[arg(long, default_value_t = 20)]
        limit: usize,
        /// Continue after this event id (the last one a previous page printed).
        #[arg(long)]
        after: Option<String>,
    },
    /// Moves a dead invocation back to pending: attempt 1, due now. Prints whether it was dead.
    RetryDead {
        #[arg(long)]
        topic: Option<String>,
        /// The event id, as `queue dead` prints it.
        id: String,
    },
    /// Deletes a dead invocation (its event id may be published again). Asks for `--yes`.
    DiscardDead {
        #[arg(long)]
        topic: Option<String>,
        /// The event id, as `queue dead` prints it.
        id: String,
        /// Confirms the deletion.
        #[arg(long)]
        yes: bool,
    },
    /// Cancels a pending invocation by event id: it is completed as cancelled and never runs (a
    /// handler running it is told, and its outcome is not applied). Prints whether it was pending.
    Cancel {
        #[arg(long)]
        topic: Option<String>,
        /// The event id.
        id: String,
        /// Why, kept with the completed row.
        #[arg(long, default_value = "cancelled by an operator")]
        why: String,
    },
    /// Cancels every pending invocation of one owner. Prints how many.
    CancelOwner {
        #[arg(long)]
        topic: Option<String>,
        /// The owner's kind, such as `user`.
        kind: String,
        /// The owner's id.
        owner: String,
        #[arg(long, default_value = "cancelled by an operator")]
        why: String,
    },
    /// The periodic schedules that have run on a queue, with the last tick each published.
    Schedules {
        #[arg(long)]
        topic: Option<String>,
    },
    /// Pauses a queue (or one partition): every worker stops starting its invocations within
    /// half a second; running handlers finish. Prints whether it was running.
    Pause {
        #[arg(long)]
        topic: Option<String>,
        /// Only this partition.
        #[arg(long)]
        partition: Option<u32>,
        /// Why, kept with the pause and shown by `queue stats`.
        #[arg(long, default_value = "paused by an operator")]
        why: String,
    },
    /// Sets a queue's limits, enforced over every worker within half a second (each option
    /// replaces the stored one; `--none` lifts them all). Without options, prints them and
    /// how close the queue is to them.
    Limits {
        #[arg(long)]
        topic: Option<String>,
        /// At most this many invocations of the queue running at once.
        #[arg(long)]
        concurrency: Option<u32>,
        /// At most this many running per business key.
        #[arg(long)]
        key_concurrency: Option<u32>,
        /// At most so many starts of the queue per interval, as `STARTS/INTERVAL` (`100/1m`;
        /// the interval in s, m, h or d).
        #[arg(long)]
        rate: Option<String>,
        /// At most so many starts per business key per interval (as --rate).
        #[arg(long)]
        key_rate: Option<String>,
        /// Lifts every limit.
        #[arg(long, conflicts_with_all = ["concurrency", "key_concurrency", "rate", "key_rate"])]
        none: bool,
    },
    /// Resumes a paused queue (or partition: give the same --partition as the pause).
    Resume {
        #[arg(long)]
        topic: Option<String>,
        #[arg(long)]
        partition: Option<u32>,
    },
    /// A page of the rows a queue moved aside.
    Aside {
        #[arg(long)]
        topic: Option<String>,
        #[arg(long, default_value_t = 20)]
        limit: usize,
        #[arg(long)]
        cursor: Option<String>,
    },
}

#[derive(Subcommand)]
pub(crate) enum TableCommand {
    /// Every table with rows, with a bounded row count.
    Ls,
    /// One row by id, as stored.
    Get { table: String, id: String },
    /// A page of rows in id order.
    Scan {
        table: String,
        #[arg(long, default_value_t = 20)]
        limit: usize,
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Rows by shape version (bounded count), and the versions the catalog records: which
    /// ones code declared and which one writers may write.
    Versions {
        table: String,
        /// The most rows read.
        #[arg(long, default_value_t = 100_000)]
        bound: u64,
    },
    /// Lets writers write shape version VERSION (a rolling deploy's last step, once no older
    /// code runs; an older version again for a rollback).
    AllowVersion { table: String, version: u32 },
}

#[derive(Subcommand)]
pub(crate) enum IndexCommand {
    /// A table's catalog: each index's definition, state and progress.
    Status { table: String },
    /// Builds the table's building indexes (registered model) to the end, in bounded,
    /// resumable batches; with an index name, refuses unless that index is building.
    Build {
        table: String,
        index: Option<String>,
    },
    /// Finishes dropping the indexes the code no longer declares (registered model); with an
    /// index name, refuses unless that index is dropping.
    Drop {
        table: String,
        index: Option<String>,
    },
    /// Starts a build that stopped on duplicate values again from the first row.
    Restart { table: String, index: String },
}

#[derive(Subcommand)]
pub(crate) enum InboxCommand {
    /// One group's rows by state (bounded count), with the table's bad rows.
    Stats {
        table: String,
        #[arg(long)]
        group: String,
    },
    /// The rows of a dead-letter group (the group dead letters go to) and the bad rows.
    Dead {
        table: String,
        /// The dead-letter group.
        #[arg(long)]
        group: String,
        #[arg(long, default_value_t = 20)]
        limit: usize,
        #[arg(long)]
        cursor: Option<String>,
    },
}

#[derive(Subcommand)]
pub(crate) enum KvCommand {
    /// Every namespace with a bounded key count.
    Ls,
    /// One live entry.
    Get { namespace: String, key: String },
    /// A page of live entries whose keys start with `--prefix`.
    List {
        namespace: String,
        #[arg(long, default_value = "")]
        prefix: String,
        #[arg(long, default_value_t = 20)]
        limit: usize,
        #[arg(long)]
        cursor: Option<String>,
    },
}

#[derive(Subcommand)]
pub(crate) enum StoreCommand {
    /// Copies every key of FROM into TO, range by range, with a progress bar; refuses a TO that
    /// holds data unless --resume or --overwrite. Run it again with --resume after a kill (it
    /// continues from its cursor) or to copy what changed since (a catch-up pass).
    Copy {
        /// The store to read (it must exist).
        from: String,
        /// The store to write (made when missing).
        to: String,
        /// Continue an interrupted copy, or bring an earlier copy up to date.
        #[arg(long, conflicts_with = "overwrite")]
        resume: bool,
        /// Make TO equal to FROM from its first key, deleting what FROM does not have.
        #[arg(long)]
        overwrite: bool,
        /// Keys per range (one transaction on TO each), 1 to 10000.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=10_000))]
        batch: u64,
        /// Read at most this many keys per second (to spare a store that serves an application).
        #[arg(long, value_name = "KEYS", value_parser = clap::value_parser!(u64).range(1..))]
        rate: Option<u64>,
        /// Do not count FROM's keys first (no total and no time left on the progress bar).
        #[arg(long)]
        no_count: bool,
        /// Copy leases, heartbeats, worker reports, memberships, concurrency slots and inbox
        /// claims too (left out by default, so TO's workers take over at once).
        #[arg(long)]
        holders: bool,
    },
    /// Compares two stores key by key, range by range (counts and hashes), in bounded memory;
    /// names the first differing keys; exit status 1 when they differ.
    Verify {
        a: String,
        b: String,
        /// Keys per compared range, 1 to 10000.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=10_000))]
        batch: u64,
        /// Compare leases, heartbeats, worker reports, memberships, concurrency slots and inbox
        /// claims too (left out by default, as a copy leaves them out).
        #[arg(long)]
        holders: bool,
    },
}

#[derive(Subcommand)]
pub(crate) enum KeysCommand {
    /// Decodes a key, as the other commands print it: its text, or the quoted form of a key
    /// that is not UTF-8 text (`"\xff\u{1}k"`).
    Decode { key: String },
}

#[derive(Subcommand)]
pub(crate) enum WorkflowCommand {
    /// A page of workflows in id order: steps, when published.
    Ls {
        #[arg(long, default_value_t = 20)]
        limit: usize,
        /// Continue after this workflow id (the last one a previous page printed).
        #[arg(long)]
        after: Option<String>,
    },
    /// One workflow: each step's queue, dependencies, state, and result or error.
    Show { id: String },
    /// Cancels every step of a workflow that has not finished. Prints how many.
    Cancel {
        id: String,
        #[arg(long, default_value = "cancelled by an operator")]
        why: String,
    },
}

#[derive(Subcommand)]
pub(crate) enum BatchCommand {
    /// A page of batches in id order: closed or open, when opened.
    Ls {
        #[arg(long, default_value_t = 20)]
        limit: usize,
        /// Continue after this batch id (the last one a previous page printed).
        #[arg(long)]
        after: Option<String>,
    },
    /// One batch: its children by how they ended, its callbacks and whether each fired.
    Show { id: String },
    /// Closes a batch and cancels its open children. Prints how many.
    Cancel {
        id: String,
        #[arg(long, default_value = "cancelled by an operator")]
        why: String,
    },
}
