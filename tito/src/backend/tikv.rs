//! The TiKV engine: Tito on a TiKV cluster, through the official `tikv-client`.
//!
//! Transactions are optimistic (Percolator two-phase commit with snapshot isolation), which is
//! the contract of [`crate::engine`]. Start versions come from PD's timestamp oracle.
//!
//! - Both gRPC clients decode responses of up to 32 MiB, twice the largest page of valid queue
//!   invocations Tito reads at once.
//! - Errors are classified recursively: a write conflict (possibly wrapped in a list of key
//!   errors) is a retryable [`TitoError::Conflict`]; an undetermined commit, and any commit
//!   failure that is not a per-key error, is [`TitoError::CommitOutcomeUnknown`].
//! - A transaction dropped before commit or rollback is rolled back in the background; it never
//!   panics.
//! - Unknown outcomes can be resolved instead of returned: see
//!   [Unknown outcomes](crate::engine#unknown-outcomes) for why a fenced commit marker proves,
//!   through TiKV's lock resolution and rollback records, that a lost commit can never apply.
//!
//! # How a commit's errors are classified
//!
//! A Percolator transaction is committed exactly when its primary key's commit is; every error
//! `commit` can meet is one of three kinds. Tito replays only what is proven not applied, and
//! reports everything that may have applied as [`TitoError::CommitOutcomeUnknown`] (resolved
//! through the commit marker under [`RetryPolicy::resolve_unknown_outcomes`], otherwise
//! returned).
//!
//! | error from the client | where | kind | Tito reports | why; tested by |
//! |---|---|---|---|---|
//! | a key error with `conflict`, `retryable`, `locked` or `txn_not_found`; `ResolveLockError`; `TxnNotFound` | prewrite | not applied | [`TitoError::Conflict`] (replayed) | this transaction's prewrite did not go through; the conformance and transaction suites |
//! | other key errors only (a key that must not exist, a primary lock already rolled back) | prewrite, primary commit | not applied | [`TitoError::Storage`] "commit rejected" | TiKV refused the keys before anything committed; `classify_commit`'s unit tests |
//! | `UndeterminedError` (a gRPC error at the primary commit) | primary commit | undetermined | `CommitOutcomeUnknown` | the commit may have applied and its reply been lost; `tikv_a_lost_commit_reply_resolves_as_committed`, `tikv_a_commit_that_never_arrived_is_replayed_exactly_once`, `tikv_a_killed_server_leaves_the_outcome_unknown_within_the_bound` |
//! | a region error the client gives up on (`ServerIsBusy` on every try), a timestamp or transport error | prewrite or primary commit | not applied, but the error does not say which phase failed | `CommitOutcomeUnknown` | the safe side: resolution proves it (fences the marker) and the closure is replayed once; `tikv_outcomes_at_the_primary_commit_are_classified` |
//! | `NotLeader`, `EpochNotMatch` | primary commit | retried by the client | the retry's outcome | the client reloads the region; same test |
//! | any error of a secondary key's commit (region error, store unreachable) | after the primary's commit | applied | success | the client logs it; readers roll the secondary forward from the committed primary; `tikv_failures_after_the_primary_commit_leave_it_applied` |
//! | none (`Ok`), but a key read back at the commit's version does not hold the written value, holds a lock that is not this transaction's pending one, or cannot be read | Tito's check after the commit | applied in part, or possibly | [`TitoError::PartialCommit`] naming the keys (never replayed or resolved) | the client defects below; `tikv_a_commit_cut_off_with_the_cluster_is_never_reported_as_applied`, `tikv_a_secondary_left_out_of_the_prewrite_is_never_reported_as_applied`, and the seeded fault mix `tikv_commits_under_a_fault_mix_report_what_is_stored` |
//!
//! # Known defect of `tikv-client` 0.4.0, and what Tito does about it
//!
//! When the client splits a prewrite or a commit into per-region requests, a failed region
//! lookup is dropped instead of returned (`stream::iter(Err(e))` in its `Shardable` impls of
//! `PrewriteRequest` and `CommitRequest` yields no item, and the lookup stream ends at its first
//! error). A lookup goes to PD after a region or transport error has dropped the region from
//! the client's cache; when PD cannot be reached at that moment:
//!
//! - **(a) A false success at the primary.** A commit of the primary key that failed in
//!   transport is retried, the retry has no region to send to, and the client reports the
//!   commit applied. It then commits the secondaries (their regions are cached), while the
//!   primary keeps its lock until a reader rolls it back when its TTL runs out: the
//!   transaction ends applied without its primary key's write.
//! - **(b) A secondary left out of the prewrite.** A secondary region's prewrite that failed in
//!   transport is retried the same way and dropped; the prewrite "succeeds" without those
//!   keys, the primary commits, and the transaction is applied without them.
//!
//! Tito checks every commit the client reports applied before it reports it: each key the
//! transaction put or deleted is read back at the commit's version, through a snapshot that
//! reports locks instead of resolving them (`lock_keys` are handed to the client at the commit
//! so that a written key is the primary); up to 17 keys all at once (one round trip), a larger
//! set the primary first and then the rest in batches. The primary's answer decides first: anything but the written value
//! (this transaction's lock: the commit never reached it; another value; no answer within
//! 5 s) means the transaction may be applied in any part, since the client commits the
//! secondaries regardless. Then the others': each must hold the written value or
//! this transaction's lock (prewritten, committed by the client after its reply); another
//! value, or another transaction's lock below the commit's version (which could not be there
//! had this transaction's prewrite reached the key), means the key was left out. Either way
//! the commit is [`TitoError::PartialCommit`] naming the keys to repair, logged at error level.
//! It is never replayed (the committed part would apply twice) or resolved through the commit
//! marker (the marker is one key of many: it could be committed while the primary is not).
//!
//! Why detection and not prevention: a prewrite left incomplete, or a primary never committed,
//! is decided inside `Transaction::commit`; the public lower-level request API cannot be driven
//! instead (`request::PlanBuilder` and `transaction_lowering` are public in 0.4.0, but a plan
//! needs a `PdClient`, whose trait and implementation live in the private `pd` module, as do
//! the generated protocol types), and resolving regions before the prewrite cannot help (the
//! lookup that fails is the one after a region or transport error during the prewrite).
//! Repairing the keys afterwards is not safe either: another transaction may have written them
//! since, and the client exposes no commit versions to tell.
//!
//! Cost: one `KvGet` per written key, issued at once (a transaction of more than 17 keys reads
//! them in `KvBatchGet`s of 256 keys, one request per region, and key by key for a batch that
//! met a lock). `tests/rpc_counts.rs` counts it per operation: a one-key transaction costs
//! {prewrite 1, commit 1, get 1} (2 requests without the check), four keys in four regions
//! {prewrite 4, commit 4, get 4}. What the check cannot see: a key rewritten with the value it
//! already held (reads find that value either way, and the state is right), and keys only
//! locked with `lock_keys` (a lock leaves no value; a dropped one only weakens conflict
//! detection for that transaction). Read-only transactions write nothing and are not checked.
//! A commit error the client returns (`UndeterminedError` and the rest of the table above) is
//! not checked: there is no commit version to read at, and the error already says the outcome
//! is not known; in the rare case of both defects' conditions with a lost reply, such an
//! outcome can still end applied in part.
//!
//! # Keyspaces
//!
//! [`TiKVOptions::keyspace`] connects to an API v2 keyspace: the client puts the keyspace's
//! prefix (`x` and its 3-byte id) before every key and bounds every range to the keyspace, so
//! rows, schema catalogs, queues, kv values, inbox leases and commit markers of two handles on
//! two keyspaces never meet, and the same table names and queue names can be used in both.
//! What differs: the GC safe point is the cluster's, shared by every keyspace, and
//! `tikv-client` 0.4.0 can only move that one. On a keyspace handle,
//! [`TitoEngine::garbage_collect`] therefore resolves the keyspace's abandoned locks older than
//! the retention and leaves the safe point to the cluster's GC owner; it returns the version
//! up to which it resolved locks, not the cluster's safe point. `tests/keyspaces.rs` checks the
//! isolation, and the conformance, transaction, model and queue suites run on two keyspaces of
//! one test server at once, with the same keys.
//!
//! ```no_run
//! use tito::backend::tikv::TiKV;
//!
//! # async fn run() -> Result<(), tito::TitoError> {
//! let db = TiKV::connect(vec!["127.0.0.1:2379"]).await?;
//! let db = TiKV::connect_with_partitions(vec!["127.0.0.1:2379"], 1024).await?;
//! # Ok(())
//! # }
//! ```

use std::sync::Arc;
use std::time::Duration;

use tikv_client::{
    CheckLevel, Key, Timestamp, TimestampExt, TransactionClient, TransactionOptions,
};

use crate::engine::{
    self, KvPair, LOGICAL_BITS, RetryPolicy, TitoEngine, TitoTransaction, check_retention,
    check_scan,
};
use crate::error::{TitoError, TitoResult};

/// The gRPC decoding budget of both clients.
pub const GRPC_MAX_DECODING_BYTES: usize = 32 * 1024 * 1024;

/// How [`TiKV::connect_with`] connects.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TiKVOptions {
    /// The partition count of this handle's queues and model events.
    pub partitions: u32,
    /// How long one request may take.
    pub request_timeout: Duration,
    /// How long connecting to PD may take before it is an error.
    pub connect_timeout: Duration,
    /// TLS for every connection (PD and TiKV), or plain text.
    pub tls: Option<TlsFiles>,
    /// The API v2 keyspace to work in, or none (API v1: the cluster's whole key space).
    pub keyspace: Option<String>,
    /// The UDP address this handle's nudge socket listens on (the port 0: any free one), or
    /// none to turn nudges off: workers in other processes then see new work at their next
    /// poll. See "Waking workers in other processes" in [`crate::queue`].
    pub nudge_bind: Option<std::net::SocketAddr>,
    /// The address other processes send nudges to (its port is the bound one); by default the
    /// address of the interface this host reaches the first PD endpoint through.
    pub nudge_advertise: Option<std::net::IpAddr>,
}

impl Default for TiKVOptions {
    /// [`engine::DEFAULT_PARTITIONS`], 2 s requests, a 10 s connect, plain text, no keyspace.
    fn default() -> Self {
        TiKVOptions {
            partitions: engine::DEFAULT_PARTITIONS,
            request_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(10),
            tls: None,
            keyspace: None,
            nudge_bind: Some((std::net::Ipv4Addr::UNSPECIFIED, 0).into()),
            nudge_advertise: None,
        }
    }
}

impl TiKVOptions {
    /// The partition count.
    pub fn partitions(mut self, partitions: u32) -> Self {
        self.partitions = partitions;
        self
    }

    /// The per-request timeout.
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// The connect timeout.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Connects over TLS with these files.
    pub fn tls(mut self, files: TlsFiles) -> Self {
        self.tls = Some(files);
        self
    }

    /// Works in the API v2 keyspace `name` (the cluster runs `storage.api-version = 2` and the
    /// keyspace exists: `pd-ctl keyspace create NAME`). Every key Tito reads or writes, its
    /// catalogs, queues, kv values and commit markers included, is then inside that keyspace,
    /// and handles on other keyspaces of the cluster see none of it. See
    /// [Keyspaces](self#keyspaces) for what differs (garbage collection).
    pub fn keyspace(mut self, name: impl Into<String>) -> Self {
        self.keyspace = Some(name.into());
        self
    }

    /// Listens for nudges on `address` (for example a fixed port a firewall lets through).
    pub fn nudge_bind(mut self, address: std::net::SocketAddr) -> Self {
        self.nudge_bind = Some(address);
        self
    }

    /// Tells other processes to send nudges to `ip` (behind NAT, or with several interfaces).
    pub fn nudge_advertise(mut self, ip: std::net::IpAddr) -> Self {
        self.nudge_advertise = Some(ip);
        self
    }

    /// Turns nudges off: workers in other processes see new work at their next poll.
    pub fn no_nudges(mut self) -> Self {
        self.nudge_bind = None;
        self
    }
}

/// PD's rule for keyspace names: 1 to 64 ASCII letters, digits, `_` and `-`.
fn check_keyspace(name: &str) -> TitoResult<()> {
    let valid = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if valid {
        Ok(())
    } else {
        Err(TitoError::invalid_argument(format!(
            "TiKVOptions::keyspace: {name:?} is not a keyspace name (1 to 64 ASCII letters, \
             digits, '_' and '-', as PD requires)"
        )))
    }
}

/// The PEM files of a TLS connection to a cluster: the CA that signed the cluster's
/// certificates, and this client's certificate and private key (TiKV and PD ask clients for a
/// certificate when their `security` section sets one). The client reads the key again for
/// every new connection (to each TiKV store it meets), so the files must stay in place while
/// the handle lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// The CA's certificate.
    pub ca: std::path::PathBuf,
    /// This client's certificate.
    pub cert: std::path::PathBuf,
    /// This client's private key.
    pub key: std::path::PathBuf,
}

impl TlsFiles {
    /// The three files.
    pub fn new(
        ca: impl Into<std::path::PathBuf>,
        cert: impl Into<std::path::PathBuf>,
        key: impl Into<std::path::PathBuf>,
    ) -> Self {
        TlsFiles {
            ca: ca.into(),
            cert: cert.into(),
            key: key.into(),
        }
    }

    /// Each file can be read and holds a PEM block; the error names the first that does not.
    fn check(&self) -> TitoResult<()> {
        for (what, path) in [
            ("CA certificate", &self.ca),
            ("client certificate", &self.cert),
            ("client key", &self.key),
        ] {
            let text = std::fs::read(path).map_err(|err| {
                TitoError::invalid_argument(format!(
                    "TLS {what} {}: cannot read it: {err}",
                    path.display()
                ))
            })?;
            if !text.windows(11).any(|w| w == b"-----BEGIN ") {
                return Err(TitoError::invalid_argument(format!(
                    "TLS {what} {}: not a PEM file (no \"-----BEGIN \" line)",
                    path.display()
                )));
            }
        }
        Ok(())
    }
}

/// A handle to a TiKV cluster. Cheap to clone.
#[derive(Clone)]
pub struct TiKV {
    client: Arc<TransactionClient>,
    partitions: u32,
    retry: RetryPolicy,
    endpoints: Arc<str>,
    keyspace: Option<Arc<str>>,
    extensions: Arc<engine::Extensions>,
}

impl std::fmt::Debug for TiKV {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TiKV")
            .field("endpoints", &self.endpoints)
            .field("keyspace", &self.keyspace)
            .field("partitions", &self.partitions)
            .finish()
    }
}

impl TiKV {
    /// Connects to the cluster whose PD endpoints are given, with the default partition count.
    pub async fn connect<S: Into<String>>(pd_endpoints: Vec<S>) -> TitoResult<Self> {
        Self::connect_with_partitions(pd_endpoints, engine::DEFAULT_PARTITIONS).await
    }

    /// Connects with a partition count for the queues and model events of this handle.
    pub async fn connect_with_partitions<S: Into<String>>(
        pd_endpoints: Vec<S>,
        partitions: u32,
    ) -> TitoResult<Self> {
        Self::connect_with_config(pd_endpoints, partitions, Duration::from_secs(2)).await
    }

    /// Connects with a partition count and a per-request timeout.
    pub async fn connect_with_config<S: Into<String>>(
        pd_endpoints: Vec<S>,
        partitions: u32,
        request_timeout: Duration,
    ) -> TitoResult<Self> {
        let options = TiKVOptions::default()
            .partitions(partitions)
            .request_timeout(request_timeout);
        Self::connect_with(pd_endpoints, options).await
    }

    /// Connects with [`TiKVOptions`]: partitions, timeouts, TLS.
    ///
    /// ```no_run
    /// use tito::backend::tikv::{TiKV, TiKVOptions, TlsFiles};
    ///
    /// # async fn run() -> Result<(), tito::TitoError> {
    /// let tls = TlsFiles::new("/etc/tikv/ca.pem", "/etc/tikv/client.pem", "/etc/tikv/client-key.pem");
    /// let db = TiKV::connect_with(vec!["pd-0.pd:2379"], TiKVOptions::default().tls(tls)).await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// Refused before any connection: no endpoint, a bad partition count, a TLS file that
    /// cannot be read or holds no PEM block (the error names the file). A connection that does
    /// not complete within [`TiKVOptions::connect_timeout`] (a server that accepts the
    /// connection but never answers) is an error, never a hang; a TLS handshake that fails (a
    /// CA that did not sign the server's certificate, an expired certificate, a plain-text
    /// server) fails the connect with the client's error.
    pub async fn connect_with<S: Into<String>>(
        pd_endpoints: Vec<S>,
        options: TiKVOptions,
    ) -> TitoResult<Self> {
        let partitions = engine::check_partitions(options.partitions)?;
        let endpoints: Vec<String> = pd_endpoints.into_iter().map(Into::into).collect();
        if endpoints.is_empty() {
            return Err(TitoError::invalid_argument(
                "at least one PD endpoint is needed",
            ));
        }
        if options.connect_timeout.is_zero() || options.request_timeout.is_zero() {
            return Err(TitoError::invalid_argument(
                "TiKVOptions: the connect and request timeouts must be over zero",
            ));
        }
        let mut config = tikv_client::Config::default().with_timeout(options.request_timeout);
        config.grpc_max_decoding_message_size = GRPC_MAX_DECODING_BYTES;
        if let Some(tls) = &options.tls {
            tls.check()?;
            config = config.with_security(&tls.ca, &tls.cert, &tls.key);
        }
        if let Some(name) = &options.keyspace {
            check_keyspace(name)?;
            config = config.with_keyspace(name);
        }
        let mut sorted = endpoints.clone();
        sorted.sort();
        let joined = sorted.join(",");
        let failed = format!(
            "cannot connect to PD at {joined} over {}",
            if options.tls.is_some() {
                "TLS"
            } else {
                "plain text"
            }
        );
        let client = match tokio::time::timeout(
            options.connect_timeout,
            TransactionClient::new_with_config(endpoints, config),
        )
        .await
        {
            Ok(Ok(client)) => client,
            Ok(Err(tikv_client::Error::KeyspaceNotFound(name))) => {
                return Err(TitoError::invalid_argument(format!(
                    "the cluster of PD {joined} has no keyspace {name:?} (create it with \
                     `pd-ctl keyspace create {name}` on a cluster running \
                     storage.api-version = 2)"
                )));
            }
            Ok(Err(err)) => {
                // The client's error ("PD cluster failed to respond") hides why: ask the first
                // endpoint ourselves.
                let why = probe(&sorted[0], options.tls.as_ref()).await;
                let client = connect_error_text(&err);
                let message = match why {
                    // What the handshake of our own found comes first; the client's words after.
                    Some(why) => {
                        format!("{failed}: {}: {why} (the client says: {client})", sorted[0])
                    }
                    None => format!("{failed}: {client}"),
                };
                return Err(TitoError::storage(message, err));
            }
            Err(_) => {
                let why = format!(
                    "no answer within {:?} (TiKVOptions::connect_timeout): a server that accepts \
                     connections but does not answer, or one that speaks the other of TLS and \
                     plain text",
                    options.connect_timeout
                );
                return Err(TitoError::storage(
                    format!("{failed}: {why}"),
                    std::io::Error::new(std::io::ErrorKind::TimedOut, why),
                ));
            }
        };
        let extensions = engine::Extensions::new();
        if let Some(bind) = options.nudge_bind {
            let advertise = match options.nudge_advertise {
                Some(ip) => ip,
                None => {
                    let probe = match joined.split(',').next() {
                        Some(first) => tokio::net::lookup_host(
                            first
                                .trim()
                                .trim_start_matches("http://")
                                .trim_start_matches("https://"),
                        )
                        .await
                        .ok()
                        .and_then(|mut found| found.next()),
                        None => None,
                    };
                    crate::event::nudge::advertised_ip(probe)
                }
            };
            extensions
                .get::<crate::event::nudge::Nudges>()
                .configure(crate::event::nudge::NudgeConfig { bind, advertise });
        }
        Ok(TiKV {
            client: Arc::new(client),
            partitions,
            retry: RetryPolicy::default(),
            endpoints: joined.into(),
            keyspace: options.keyspace.map(Into::into),
            extensions: Arc::new(extensions),
        })
    }

    /// Stops this handle's reads of the moved marker for an hour (for tests that count the
    /// requests of each operation; a move's refusals then reach this handle late).
    #[cfg(feature = "test-util")]
    pub fn pause_moved_checks(&self) {
        self.extensions
            .get::<engine::gate::Gate>()
            .checked(std::time::Instant::now() + Duration::from_secs(3600), None);
    }

    /// A new handle to the same cluster with another retry policy.
    pub fn with_retry_policy(&self, policy: RetryPolicy) -> Self {
        TiKV {
            retry: policy,
            ..self.clone()
        }
    }

    /// The underlying `tikv-client` client, for what Tito does not cover.
    pub fn client(&self) -> &TransactionClient {
        &self.client
    }

    /// The API v2 keyspace this handle works in, if any.
    pub fn keyspace(&self) -> Option<&str> {
        self.keyspace.as_deref()
    }
}

/// Why a connect to `endpoint` fails, found by a handshake of our own (within 2 s): over TLS
/// with `tls`'s files, what the handshake says (a CA that did not sign the server's
/// certificate, an expired one, a server that does not speak TLS); in plain text, whether the
/// server answers in TLS. `None` when nothing more is learned.
async fn probe(endpoint: &str, tls: Option<&TlsFiles>) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls;
    let address = endpoint
        .trim()
        .trim_start_matches("https://")
        .trim_start_matches("http://")
        .to_string();
    let work = async move {
        let mut stream = tokio::net::TcpStream::connect(&address)
            .await
            .map_err(|err| format!("cannot open a connection: {err}"))?;
        let Some(tls) = tls else {
            // An HTTP/2 preface; a TLS server answers with a TLS record (alert or handshake).
            stream
                .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                .await
                .map_err(|err| err.to_string())?;
            let mut first = [0u8; 1];
            return match stream.read(&mut first).await {
                Ok(1) if first[0] == 0x15 || first[0] == 0x16 => {
                    Err("the server speaks TLS: connect with TiKVOptions::tls".to_string())
                }
                _ => Ok(()),
            };
        };
        let read = |path: &std::path::Path| std::fs::read(path).map_err(|err| err.to_string());
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_pemfile::certs(&mut &read(&tls.ca)?[..]).map_err(|e| e.to_string())? {
            roots
                .add(&rustls::Certificate(cert))
                .map_err(|err| format!("CA certificate: {err}"))?;
        }
        let certs: Vec<rustls::Certificate> = rustls_pemfile::certs(&mut &read(&tls.cert)?[..])
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(rustls::Certificate)
            .collect();
        let key = rustls_pemfile::read_all(&mut &read(&tls.key)?[..])
            .map_err(|e| e.to_string())?
            .into_iter()
            .find_map(|item| match item {
                rustls_pemfile::Item::PKCS8Key(key)
                | rustls_pemfile::Item::RSAKey(key)
                | rustls_pemfile::Item::ECKey(key) => Some(rustls::PrivateKey(key)),
                _ => None,
            })
            .ok_or_else(|| format!("no private key in {}", tls.key.display()))?;
        let mut config = rustls::ClientConfig::builder()
            .with_safe_defaults()
            .with_root_certificates(roots)
            .with_client_auth_cert(certs, key)
            .map_err(|err| format!("client certificate: {err}"))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        let host = address
            .rsplit_once(':')
            .map_or(address.as_str(), |(h, _)| h);
        let name = rustls::ServerName::try_from(host.trim_matches(|c| c == '[' || c == ']'))
            .map_err(|err| format!("{host} is not a server name: {err}"))?;
        let mut stream = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
            .connect(name, stream)
            .await
            .map_err(|err| {
                let text = err.to_string();
                if text.contains("UnknownIssuer") || text.contains("BadSignature") {
                    format!(
                        "the server's certificate is not signed by the CA in {} ({text})",
                        tls.ca.display()
                    )
                } else if text.contains("Expired") || text.contains("NotValidYet") {
                    format!("the server's certificate has expired or is not valid yet ({text})")
                } else if text.contains("corrupt message") || text.contains("InvalidContentType") {
                    format!("the server does not speak TLS: a plain-text endpoint? ({text})")
                } else {
                    format!("the TLS handshake failed: {text}")
                }
            })?;
        // Under TLS 1.3 the server judges this client's certificate after the client's side of
        // the handshake is done: its refusal is an alert on the first read.
        stream
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .map_err(|err| match err.to_string() {
                text if text.contains("alert") => client_refused(tls, &text),
                text => format!("the connection failed after the TLS handshake: {text}"),
            })?;
        let mut first = [0u8; 1];
        match stream.read(&mut first).await {
            Err(err) if err.to_string().contains("alert") => {
                Err(client_refused(tls, &err.to_string()))
            }
            _ => Ok(()),
        }
    };
    match tokio::time::timeout(Duration::from_secs(2), work).await {
        Ok(Err(why)) => Some(why),
        Ok(Ok(())) | Err(_) => None,
    }
}

/// The server's refusal of this client's certificate, in words.
fn client_refused(tls: &TlsFiles, text: &str) -> String {
    format!(
        "the server refused this client's certificate {} (not signed by a CA the server \
         trusts for clients, expired, or missing): {text}",
        tls.cert.display()
    )
}

/// A connect error with its causes, one after another (tonic's transport error says
/// "transport error" and keeps the TLS reason in its sources).
fn connect_error_text(err: &tikv_client::Error) -> String {
    let mut text = err.to_string();
    // The client's internal errors lead with the source file and line it raised them at.
    if text.starts_with('[')
        && let Some((_, rest)) = text.split_once("]: ")
    {
        text = rest.to_string();
    }
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

fn range(start: &[u8], end: &[u8]) -> tikv_client::BoundRange {
    if end.is_empty() {
        (Key::from(start.to_vec())..).into()
    } else {
        (Key::from(start.to_vec())..Key::from(end.to_vec())).into()
    }
}

impl TitoEngine for TiKV {
    type Transaction = TiKVTransaction;

    async fn begin(&self) -> TitoResult<TiKVTransaction> {
        let options = TransactionOptions::new_optimistic().drop_check(CheckLevel::None);
        let tx = self
            .client
            .begin_with_options(options)
            .await
            .map_err(|err| classify_read(err, "begin"))?;
        let start_version = tx.start_timestamp().version();
        Ok(TiKVTransaction {
            inner: Arc::new(TxInner {
                start_version,
                client: self.client.clone(),
                written: std::sync::Mutex::new(Written::default()),
                deferred_locks: std::sync::Mutex::new(Vec::new()),
                tx: tokio::sync::Mutex::new(Some(tx)),
                gate: self.extensions.get::<engine::gate::Gate>(),
                failed: crate::engine::FirstFailure::default(),
                hooks: crate::engine::AfterCommit::default(),
            }),
        })
    }

    async fn current_version(&self) -> TitoResult<u64> {
        let ts = self
            .client
            .current_timestamp()
            .await
            .map_err(|err| classify_read(err, "timestamp"))?;
        Ok(ts.version())
    }

    async fn garbage_collect(&self, retention: Duration) -> TitoResult<u64> {
        let retention_ms = check_retention(retention)?;
        let now = self.current_version().await?;
        let safe_ms = engine::version_millis(now).saturating_sub(retention_ms);
        if safe_ms == 0 {
            return Ok(0);
        }
        let safe_point = Timestamp::from_version(safe_ms << LOGICAL_BITS);
        if self.keyspace.is_some() {
            // The safe point is the cluster's, shared by every keyspace: resolve this
            // keyspace's abandoned locks only, and leave the safe point to the cluster's GC
            // owner (see "Keyspaces" in the module docs).
            let options = tikv_client::transaction::ResolveLocksOptions {
                batch_size: 1024,
                ..Default::default()
            };
            self.client
                .cleanup_locks(.., &safe_point, options)
                .await
                .map_err(|err| TitoError::storage("resolving the keyspace's old locks", err))?;
            return Ok(safe_ms << LOGICAL_BITS);
        }
        // `false` means PD already holds a newer safe point: still a success.
        let applied = self
            .client
            .gc(safe_point)
            .await
            .map_err(|err| TitoError::storage("garbage collection", err))?;
        if !applied {
            tracing::info!("PD already holds a newer GC safe point");
        }
        Ok(safe_ms << LOGICAL_BITS)
    }

    async fn delete_range(&self, start: &[u8], end: &[u8]) -> TitoResult<()> {
        crate::engine::check_destroy_range(start, end)?;
        self.client
            .unsafe_destroy_range(range(start, end))
            .await
            .map_err(|err| TitoError::storage("unsafe range destruction", err))
    }

    fn partitions(&self) -> u32 {
        self.partitions
    }

    fn extensions(&self) -> &engine::Extensions {
        &self.extensions
    }

    fn retry_policy(&self) -> RetryPolicy {
        self.retry.clone()
    }
}

/// A transaction of the [`TiKV`] engine.
#[derive(Clone)]
pub struct TiKVTransaction {
    inner: Arc<TxInner>,
}

struct TxInner {
    start_version: u64,
    client: Arc<TransactionClient>,
    /// Every key this transaction put or deleted and what it holds once committed, the first
    /// being the client's primary key (`lock_keys` are deferred to the commit so that a write
    /// leads). Read back at the commit's version to check the client's report.
    written: std::sync::Mutex<Written>,
    /// Keys given to `lock_keys`, handed to the client just before the commit (an optimistic
    /// transaction only buffers them, so deferring changes nothing but the primary's choice).
    deferred_locks: std::sync::Mutex<Vec<Vec<u8>>>,
    tx: tokio::sync::Mutex<Option<tikv_client::Transaction>>,
    /// The store's write gate (a moved store refuses writes).
    gate: Arc<engine::gate::Gate>,
    failed: crate::engine::FirstFailure,
    /// Run after a successful commit.
    hooks: crate::engine::AfterCommit,
}

/// What a key holds once its transaction commits: the length and FNV-1a digest of the value
/// written, or `None` for a delete.
type Expected = Option<(usize, u64)>;

fn expected(value: Option<&[u8]>) -> Expected {
    value.map(|value| (value.len(), crate::keys::fnv1a(value)))
}

/// The keys a transaction wrote, in the order first written (the first is the primary).
#[derive(Default)]
struct Written {
    order: Vec<Vec<u8>>,
    holds: std::collections::HashMap<Vec<u8>, Expected>,
}

/// Up to this many keys besides the primary are read back one `KvGet` each (concurrently); a
/// larger write set is read in `KvBatchGet`s of [`VERIFY_BATCH`] keys.
const VERIFY_ONE_BY_ONE: usize = 16;
/// The keys of one batched read-back.
const VERIFY_BATCH: usize = 256;
/// How long reading a key back may keep failing in passing (a region moving, a timeout, PD
/// unreachable) before the key counts as unchecked.
const VERIFY_PATIENCE: Duration = Duration::from_secs(5);

/// A key and what reading it back found.
type KeyRead = (Vec<u8>, ReadBack);

/// A key read back at the commit's version.
enum ReadBack {
    /// It holds what the transaction wrote.
    Holds,
    /// It holds something else: the transaction's write is not there.
    Differs,
    /// A lock at or below the commit's version: this transaction's own (`true`: it was
    /// prewritten, its commit not yet applied) or another's (`false`: this transaction's write
    /// cannot be there, or that transaction could not have locked it).
    Locked(bool),
    /// It could not be read within [`VERIFY_PATIENCE`].
    Unreadable(String),
}

impl TxInner {
    /// Lets a commit of `keys` through the store's write gate, reading the moved marker first
    /// when this process's last read of it is older than [`engine::gate::MOVED_CHECK_INTERVAL`].
    async fn pass_gate(&self, keys: &[Vec<u8>]) -> TitoResult<engine::gate::Pass> {
        if self.gate.needs_check() {
            let at = std::time::Instant::now();
            let ts = self
                .client
                .current_timestamp()
                .await
                .map_err(|err| classify_read(err, "timestamp"))?;
            let value = self
                .client
                .snapshot(ts, TransactionOptions::new_optimistic().read_only())
                .get(engine::gate::MOVED_KEY.to_vec())
                .await
                .map_err(|err| classify_read(err, "reading the moved marker"))?;
            let moved = value.as_deref().map(engine::gate::decode).transpose()?;
            self.gate.checked(at, moved);
        }
        self.gate.enter(keys.iter().map(Vec::as_slice))
    }

    /// Notes a put (`Some`) or delete (`None`) of `key`: the first one names the primary, and a
    /// later write of a key changes what it must hold.
    fn track(&self, key: &[u8], value: Option<&[u8]>) {
        let mut written = crate::util::lock(&self.written);
        if written
            .holds
            .insert(key.to_vec(), expected(value))
            .is_none()
        {
            written.order.push(key.to_vec());
        }
    }

    /// A snapshot at `ts` whose reads report locks instead of resolving them.
    fn checking_snapshot(&self, ts: &Timestamp) -> tikv_client::Snapshot {
        self.client.snapshot(
            ts.clone(),
            TransactionOptions::new_optimistic()
                .read_only()
                .no_resolve_locks(),
        )
    }

    /// Reads `key` at `ts` and compares it with `expected`, reading again after passing
    /// failures for up to [`VERIFY_PATIENCE`].
    async fn read_back(&self, ts: &Timestamp, key: &[u8], expected: Expected) -> ReadBack {
        let started = std::time::Instant::now();
        let mut pause = Duration::from_millis(25);
        loop {
            match self.checking_snapshot(ts).get(key.to_vec()).await {
                Ok(found) => return compare(found.as_deref(), expected),
                Err(err) => {
                    if let Some(ours) = lock_owner(&err, self.start_version) {
                        return ReadBack::Locked(ours);
                    }
                    if started.elapsed() + pause > VERIFY_PATIENCE {
                        return ReadBack::Unreadable(err.to_string());
                    }
                    tracing::debug!(error = %err, "reading a committed key back failed; again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(400));
                }
            }
        }
    }

    /// Reads `keys` back at `ts`: in one `KvBatchGet` per region, and one by one for the keys
    /// of a batch that met a lock (the batch's other answers are lost with the error) or failed.
    async fn read_back_batch(
        &self,
        ts: &Timestamp,
        keys: &[(Vec<u8>, Expected)],
    ) -> Vec<(Vec<u8>, ReadBack)> {
        let batch = self
            .checking_snapshot(ts)
            .batch_get(keys.iter().map(|(key, _)| key.clone()).collect::<Vec<_>>())
            .await;
        match batch {
            Ok(pairs) => {
                let found: std::collections::HashMap<Vec<u8>, Vec<u8>> = pairs
                    .map(|pair| {
                        let (key, value): (Key, Vec<u8>) = pair.into();
                        (Vec::from(key), value)
                    })
                    .collect();
                keys.iter()
                    .map(|(key, expected)| {
                        let read = compare(found.get(key).map(Vec::as_slice), *expected);
                        (key.clone(), read)
                    })
                    .collect()
            }
            Err(_) => {
                futures::future::join_all(keys.iter().map(|(key, expected)| async move {
                    (key.clone(), self.read_back(ts, key, *expected).await)
                }))
                .await
            }
        }
    }

    /// Checks a commit the client reported applied by reading every written key back at the
    /// commit's version (see the module docs for why, and what each answer proves).
    ///
    /// Up to 17 keys are read at once (one round trip), a larger set the primary first and the
    /// rest in batches after it; the primary's answer decides first: a
    /// commit that never reached it leaves this transaction's lock there
    /// (its TTL has not run out this soon), another value, or no answer, and the commit is
    /// [`TitoError::PartialCommit`] naming every key (any of them may hold the write). Then
    /// every other key: each must hold what was
    /// written or this transaction's lock (prewritten; the client commits secondaries after
    /// its reply); a key that holds something else, or another transaction's lock, was left out
    /// of the prewrite and the commit is [`TitoError::PartialCommit`], as it is when a key
    /// cannot be read within [`VERIFY_PATIENCE`].
    async fn verify(&self, commit_ts: Timestamp, written: Written) -> TitoResult<()> {
        let version = commit_ts.version();
        let Some(primary) = written.order.first() else {
            return Ok(());
        };
        let shown = crate::keys::display_key(primary);
        let others: Vec<(Vec<u8>, Expected)> = written.order[1..]
            .iter()
            .map(|key| (key.clone(), written.holds[key]))
            .collect();
        // Up to VERIFY_ONE_BY_ONE other keys are read together with the primary (one round trip
        // for the whole check; their answers count only once the primary holds the write). A
        // larger set is read in batches after the primary's answer: by then the client has
        // mostly committed the secondaries, and a batch that meets this transaction's locks
        // falls back to one read per key.
        let one_by_one = async {
            futures::future::join_all(others.iter().map(|(key, expected)| async {
                (
                    key.clone(),
                    self.read_back(&commit_ts, key, *expected).await,
                )
            }))
            .await
        };
        let expected = written.holds[primary];
        let (primary_read, early): (ReadBack, Option<Vec<KeyRead>>) =
            if others.len() <= VERIFY_ONE_BY_ONE {
                let (primary, others) =
                    futures::join!(self.read_back(&commit_ts, primary, expected), one_by_one);
                (primary, Some(others))
            } else {
                (self.read_back(&commit_ts, primary, expected).await, None)
            };
        // The primary decides the transaction. When it does not hold the write, the commit
        // never reached it (its lock is rolled back once its TTL runs out), yet the client
        // commits the other keys after its reply: any key may end up holding the write.
        let primary_failed = match primary_read {
            ReadBack::Holds => None,
            ReadBack::Differs => Some("does not hold the write at that version".to_string()),
            ReadBack::Locked(ours) => Some(format!(
                "is still locked at that version by {}",
                if ours {
                    "this transaction"
                } else {
                    "another transaction"
                }
            )),
            ReadBack::Unreadable(err) => Some(format!("could not be read back to check ({err})")),
        };
        if let Some(why) = primary_failed {
            let message = format!(
                "TiKV reported the commit of transaction {} applied at version {version}, but its \
                 primary key {shown} {why}; the client commits the other keys after reporting, \
                 so any of the {} keys may or may not hold the write",
                self.start_version,
                written.order.len()
            );
            tracing::error!(
                start_version = self.start_version,
                commit_version = version,
                "{message}"
            );
            return Err(TitoError::PartialCommit {
                message,
                keys: written.order,
            });
        }
        let reads = match early {
            Some(reads) => reads,
            None => {
                let mut reads = Vec::with_capacity(others.len());
                for chunk in others.chunks(VERIFY_BATCH) {
                    reads.extend(self.read_back_batch(&commit_ts, chunk).await);
                }
                reads
            }
        };
        let mut missing = Vec::new();
        let mut unchecked = Vec::new();
        for (key, read) in reads {
            match read {
                ReadBack::Holds | ReadBack::Locked(true) => {}
                ReadBack::Differs | ReadBack::Locked(false) => missing.push(key),
                ReadBack::Unreadable(err) => unchecked.push((key, err)),
            }
        }
        if missing.is_empty() && unchecked.is_empty() {
            return Ok(());
        }
        let total = written.order.len() - 1;
        let list = |keys: &[Vec<u8>]| {
            keys.iter()
                .take(10)
                .map(|key| crate::keys::display_key(key))
                .collect::<Vec<_>>()
                .join(", ")
                + if keys.len() > 10 { ", ..." } else { "" }
        };
        let mut why = Vec::new();
        if !missing.is_empty() {
            why.push(format!(
                "{} of its {total} other keys do not hold the write at that version ({})",
                missing.len(),
                list(&missing)
            ));
        }
        if !unchecked.is_empty() {
            let keys: Vec<Vec<u8>> = unchecked.iter().map(|(key, _)| key.clone()).collect();
            why.push(format!(
                "{} of its {total} other keys could not be read back to check ({}: {})",
                unchecked.len(),
                list(&keys),
                unchecked[0].1
            ));
        }
        let message = format!(
            "the commit of transaction {} applied at version {version} (its primary key {shown} \
             holds the write), but {}",
            self.start_version,
            why.join("; ")
        );
        tracing::error!(
            start_version = self.start_version,
            commit_version = version,
            "{message}"
        );
        let keys = missing
            .into_iter()
            .chain(unchecked.into_iter().map(|(key, _)| key))
            .collect();
        Err(TitoError::PartialCommit { message, keys })
    }
}

/// Compares a value read back with what the transaction wrote.
fn compare(found: Option<&[u8]>, wanted: Expected) -> ReadBack {
    if expected(found) == wanted {
        ReadBack::Holds
    } else {
        ReadBack::Differs
    }
}

/// When `err` reports a lock met by a read that does not resolve locks: whether it is the
/// transaction `start_version`'s own.
fn lock_owner(err: &tikv_client::Error, start_version: u64) -> Option<bool> {
    use tikv_client::Error as E;
    match err {
        E::ResolveLockError(locks) if !locks.is_empty() => {
            Some(locks.iter().all(|lock| lock.lock_version == start_version))
        }
        E::KeyError(key_error) => key_error
            .locked
            .as_ref()
            .map(|lock| lock.lock_version == start_version),
        E::ExtractedErrors(errors) | E::MultipleKeyErrors(errors) => {
            errors.iter().find_map(|err| lock_owner(err, start_version))
        }
        _ => None,
    }
}

impl std::fmt::Debug for TiKVTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TiKVTransaction")
            .field("start_version", &self.inner.start_version)
            .finish()
    }
}

impl Drop for TxInner {
    fn drop(&mut self) {
        let Some(mut tx) = self.tx.get_mut().take() else {
            return;
        };
        // An unfinished transaction: roll it back in the background so its locks (if a commit
        // was under way) do not wait for their TTL. Without a runtime the locks expire on their own.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                if let Err(err) = tx.rollback().await {
                    tracing::debug!(error = %err, "background rollback of a dropped transaction failed");
                }
            });
        }
    }
}

macro_rules! active {
    ($self:ident, $tx:ident) => {
        let mut guard = $self.inner.tx.lock().await;
        let Some($tx) = guard.as_mut() else {
            return Err(TitoError::TransactionFinished("finished"));
        };
    };
}

impl TitoTransaction for TiKVTransaction {
    fn start_version(&self) -> u64 {
        self.inner.start_version
    }

    async fn get(&self, key: &[u8]) -> TitoResult<Option<Vec<u8>>> {
        active!(self, tx);
        let mut waited = LockWait::new();
        loop {
            match tx.get(key.to_vec()).await {
                Err(err) if waited.again(&err).await => continue,
                result => return result.map_err(|err| classify_read(err, "get")),
            }
        }
    }

    async fn batch_get(&self, keys: &[Vec<u8>]) -> TitoResult<Vec<Option<Vec<u8>>>> {
        active!(self, tx);
        let mut waited = LockWait::new();
        let pairs = loop {
            match tx.batch_get(keys.to_vec()).await {
                Err(err) if waited.again(&err).await => continue,
                result => break result.map_err(|err| classify_read(err, "batch_get"))?,
            }
        };
        let found: std::collections::HashMap<Vec<u8>, Vec<u8>> = pairs
            .map(|pair| {
                let (key, value): (Key, Vec<u8>) = pair.into();
                (Vec::from(key), value)
            })
            .collect();
        Ok(keys.iter().map(|key| found.get(key).cloned()).collect())
    }

    async fn scan(&self, start: &[u8], end: &[u8], limit: usize) -> TitoResult<Vec<KvPair>> {
        check_scan(start, end, limit)?;
        active!(self, tx);
        let mut waited = LockWait::new();
        let pairs = loop {
            match tx.scan(range(start, end), limit as u32).await {
                Err(err) if waited.again(&err).await => continue,
                result => break result.map_err(|err| classify_read(err, "scan"))?,
            }
        };
        Ok(pairs.map(into_pair).collect())
    }

    async fn scan_reverse(
        &self,
        start: &[u8],
        end: &[u8],
        limit: usize,
    ) -> TitoResult<Vec<KvPair>> {
        check_scan(start, end, limit)?;
        active!(self, tx);
        let mut waited = LockWait::new();
        let pairs = loop {
            match tx.scan_reverse(range(start, end), limit as u32).await {
                Err(err) if waited.again(&err).await => continue,
                result => break result.map_err(|err| classify_read(err, "scan_reverse"))?,
            }
        };
        Ok(pairs.map(into_pair).collect())
    }

    async fn put(&self, key: Vec<u8>, value: Vec<u8>) -> TitoResult<()> {
        crate::engine::check_write(&key, &value)?;
        active!(self, tx);
        self.inner.track(&key, Some(&value));
        tx.put(key, value)
            .await
            .map_err(|err| classify_read(err, "put"))
    }

    async fn delete(&self, key: Vec<u8>) -> TitoResult<()> {
        active!(self, tx);
        self.inner.track(&key, None);
        tx.delete(key)
            .await
            .map_err(|err| classify_read(err, "delete"))
    }

    async fn lock_keys(&self, keys: &[Vec<u8>]) -> TitoResult<()> {
        // Refused after the end like every other call; buffered until the commit.
        active!(self, _tx);
        crate::util::lock(&self.inner.deferred_locks).extend(keys.iter().cloned());
        Ok(())
    }

    fn fail(&self, cause: &TitoError) {
        self.inner.failed.record(cause);
    }

    async fn commit(&self) -> TitoResult<()> {
        if let Some(refusal) = self.inner.failed.refusal() {
            self.rollback().await?;
            return Err(refusal);
        }
        let mut guard = self.inner.tx.lock().await;
        let Some(mut tx) = guard.take() else {
            return Err(TitoError::TransactionFinished("finished"));
        };
        let locks = std::mem::take(&mut *crate::util::lock(&self.inner.deferred_locks));
        if !locks.is_empty()
            && let Err(err) = tx.lock_keys(locks).await
        {
            let _ = tx.rollback().await;
            self.inner.hooks.finish(false);
            return Err(classify_read(err, "lock_keys"));
        }
        let keys = crate::util::lock(&self.inner.written).order.clone();
        // Held until the commit returned (a move waits for it).
        let _pass = if keys.is_empty() {
            None
        } else {
            match self.inner.pass_gate(&keys).await {
                Ok(pass) => Some(pass),
                Err(refused) => {
                    let _ = tx.rollback().await;
                    self.inner.hooks.finish(false);
                    return Err(refused);
                }
            }
        };
        let committed =
            match tokio::time::timeout(engine::gate::MOVED_COMMIT_DEADLINE, tx.commit()).await {
                Ok(committed) => committed,
                Err(_) => {
                    // Abandoned: a commit must get its version within the deadline of passing the
                    // gate, or a move's last pass could miss it (see `engine::gate`).
                    self.inner.hooks.finish(false);
                    return Err(TitoError::commit_outcome_unknown(format!(
                        "the commit did not finish within {} s; it was abandoned and may or may \
                     not have taken effect",
                        engine::gate::MOVED_COMMIT_DEADLINE.as_secs()
                    )));
                }
            };
        match committed {
            Ok(commit_ts) => {
                let written = std::mem::take(&mut *crate::util::lock(&self.inner.written));
                if let Some(commit_ts) = commit_ts
                    && let Err(err) = self.inner.verify(commit_ts, written).await
                {
                    // A partial commit did commit (its primary holds the write): what it
                    // wrote and published is there in part, and after-commit work may find it.
                    let applied = matches!(err, TitoError::PartialCommit { .. });
                    self.inner.hooks.finish(applied);
                    return Err(err);
                }
                self.inner.hooks.finish(true);
                Ok(())
            }
            Err(err) => {
                self.inner.hooks.finish(false);
                let classified = classify_commit(err);
                if classified.is_retryable() {
                    // Prewrite failed: clean up whatever locks it left, best effort.
                    if let Err(err) = tx.rollback().await {
                        tracing::debug!(error = %err, "rollback after a conflicting prewrite failed");
                    }
                }
                Err(classified)
            }
        }
    }

    fn after_commit(&self, hook: crate::engine::AfterCommitHook) {
        self.inner.hooks.push(hook);
    }

    async fn rollback(&self) -> TitoResult<()> {
        let mut guard = self.inner.tx.lock().await;
        let Some(mut tx) = guard.take() else {
            return Err(TitoError::TransactionFinished("finished"));
        };
        tx.rollback()
            .await
            .map_err(|err| TitoError::storage("rollback", err))
    }
}

/// How long a read waits, in all, for locks of concurrent transactions to be decided. The
/// client's own lock backoff gives up after about 1.5 s, before the 3 s TTL of an abandoned or
/// stuck transaction's locks runs out; waiting past the TTL lets the client roll them back.
const READ_LOCK_WAIT: Duration = Duration::from_secs(10);

/// Re-runs a read that met locks it could not resolve yet, with a growing pause, up to
/// [`READ_LOCK_WAIT`].
struct LockWait {
    started: std::time::Instant,
    pause: Duration,
}

impl LockWait {
    fn new() -> Self {
        LockWait {
            started: std::time::Instant::now(),
            pause: Duration::from_millis(5),
        }
    }

    /// Whether to read again after `err` (having paused).
    async fn again(&mut self, err: &tikv_client::Error) -> bool {
        if !is_lock_wait(err) || self.started.elapsed() >= READ_LOCK_WAIT {
            return false;
        }
        tokio::time::sleep(self.pause).await;
        self.pause = (self.pause * 2).min(Duration::from_millis(250));
        true
    }
}

/// Whether an error means "a concurrent transaction's lock is still undecided".
fn is_lock_wait(err: &tikv_client::Error) -> bool {
    use tikv_client::Error as E;
    match err {
        E::KeyError(key_error) => key_error.locked.is_some() || key_error.txn_not_found.is_some(),
        E::ResolveLockError(_) | E::TxnNotFound(_) => true,
        E::ExtractedErrors(errors) | E::MultipleKeyErrors(errors) => {
            !errors.is_empty() && errors.iter().all(is_lock_wait)
        }
        _ => false,
    }
}

fn into_pair(pair: tikv_client::KvPair) -> KvPair {
    let (key, value): (Key, Vec<u8>) = pair.into();
    (Vec::from(key), value)
}

/// Whether an error is (or wraps) a write conflict, another per-key error TiKV marks as
/// retryable, or a lock of a concurrent transaction that could not be resolved in time. None of
/// them leaves this transaction committed: they come from reads or the prewrite phase (a
/// primary commit that meets a lock has not been applied either).
pub(crate) fn is_conflict(err: &tikv_client::Error) -> bool {
    use tikv_client::Error as E;
    match err {
        E::KeyError(key_error) => {
            key_error.conflict.is_some()
                || !key_error.retryable.is_empty()
                || key_error.locked.is_some()
                // Another transaction's lock whose owner could not be decided in time: this
                // transaction's prewrite did not go through.
                || key_error.txn_not_found.is_some()
        }
        // Locks of live transactions still in the way after the client's lock backoff.
        E::ResolveLockError(_) | E::TxnNotFound(_) => true,
        E::ExtractedErrors(errors) | E::MultipleKeyErrors(errors) => errors.iter().any(is_conflict),
        E::PessimisticLockError { inner, .. } => is_conflict(inner),
        _ => false,
    }
}

/// Whether an error consists only of per-key errors (a determined failure of a prewrite).
fn only_key_errors(err: &tikv_client::Error) -> bool {
    use tikv_client::Error as E;
    match err {
        E::KeyError(_) | E::DuplicateKeyInsertion => true,
        E::ExtractedErrors(errors) | E::MultipleKeyErrors(errors) => {
            !errors.is_empty() && errors.iter().all(only_key_errors)
        }
        _ => false,
    }
}

/// An error's text with the keys it names printed as Tito prints keys
/// ([`crate::keys::display_key`], which `tito keys decode` reads), not as the client's arrays
/// of decimal bytes: a write conflict, another transaction's lock, and the errors that wrap
/// them. Any other error as the client words it.
pub(crate) fn describe(err: &tikv_client::Error) -> String {
    use tikv_client::Error as E;
    let key = |key: &[u8]| crate::keys::display_key(key);
    match err {
        E::KeyError(key_error) => {
            if let Some(conflict) = &key_error.conflict {
                format!(
                    "write conflict on key {} (this transaction started at ts {}, a \
                     transaction started at ts {} committed it at ts {}; primary {})",
                    key(&conflict.key),
                    conflict.start_ts,
                    conflict.conflict_ts,
                    conflict.conflict_commit_ts,
                    key(&conflict.primary)
                )
            } else if let Some(lock) = &key_error.locked {
                format!(
                    "key {} is locked by the transaction started at ts {} (primary {}, TTL {} ms)",
                    key(&lock.key),
                    lock.lock_version,
                    key(&lock.primary_lock),
                    lock.lock_ttl
                )
            } else {
                err.to_string()
            }
        }
        E::ExtractedErrors(errors) | E::MultipleKeyErrors(errors) => {
            let mut shown: Vec<String> = errors.iter().take(5).map(describe).collect();
            if errors.len() > 5 {
                shown.push(format!("and {} more", errors.len() - 5));
            }
            shown.join("; ")
        }
        E::PessimisticLockError { inner, .. } => describe(inner),
        E::UndeterminedError(inner) => format!("undetermined commit: {}", describe(inner)),
        _ => err.to_string(),
    }
}

/// A client error as [`describe`] words it, the client's own error as its source: a message
/// that shows it prints the keys as Tito does, and code that walks the chain still finds the
/// client's error.
#[derive(Debug)]
struct Described {
    text: String,
    inner: tikv_client::Error,
}

impl Described {
    fn boxed(inner: tikv_client::Error) -> (String, Option<crate::error::BoxError>) {
        let text = describe(&inner);
        (text.clone(), Some(Box::new(Described { text, inner })))
    }
}

impl std::fmt::Display for Described {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::error::Error for Described {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.inner)
    }
}

/// Classifies an error of `commit()`.
pub(crate) fn classify_commit(err: tikv_client::Error) -> TitoError {
    if matches!(err, tikv_client::Error::UndeterminedError(_)) {
        let (message, source) = Described::boxed(err);
        return TitoError::CommitOutcomeUnknown { message, source };
    }
    if is_conflict(&err) {
        let (message, source) = Described::boxed(err);
        return TitoError::Conflict { message, source };
    }
    if only_key_errors(&err) {
        return TitoError::storage("commit rejected", err);
    }
    TitoError::CommitOutcomeUnknown {
        message: err.to_string(),
        source: Some(Box::new(err)),
    }
}

/// Classifies an error of a read or a buffered write.
fn classify_read(err: tikv_client::Error, what: &str) -> TitoError {
    if is_conflict(&err) {
        let (text, source) = Described::boxed(err);
        return TitoError::Conflict {
            message: format!("{what}: {text}"),
            source,
        };
    }
    TitoError::storage(format!("TiKV {what}"), err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tikv_client::{Error, ProtoKeyError};

    fn conflict() -> Error {
        Error::KeyError(Box::new(ProtoKeyError {
            conflict: Some(Default::default()),
            ..Default::default()
        }))
    }

    fn aborted() -> Error {
        Error::KeyError(Box::new(ProtoKeyError {
            abort: "txn not found".into(),
            ..Default::default()
        }))
    }

    #[test]
    fn wrapped_write_conflicts_are_retryable() {
        for err in [
            conflict(),
            Error::ExtractedErrors(vec![conflict()]),
            Error::MultipleKeyErrors(vec![aborted(), conflict()]),
            Error::ExtractedErrors(vec![Error::MultipleKeyErrors(vec![conflict()])]),
            Error::PessimisticLockError {
                inner: Box::new(conflict()),
                success_keys: vec![],
            },
        ] {
            let classified = classify_commit(err);
            assert!(classified.is_retryable(), "{classified:?}");
        }
    }

    #[test]
    fn a_conflict_names_its_key_as_tito_prints_keys() {
        let mut key_error = ProtoKeyError::default();
        let conflict = key_error.conflict.get_or_insert_with(Default::default);
        conflict.key = b"queue@pipeline:lease:0000".to_vec();
        conflict.primary = vec![0xff, 1];
        let err = Error::ExtractedErrors(vec![Error::KeyError(Box::new(key_error))]);
        let shown = classify_commit(err).to_string();
        assert!(
            shown.contains("write conflict on key \"queue@pipeline:lease:0000\"")
                && shown.contains("primary \"\\xff\\u{1}\"")
                && !shown.contains("[113, 117"),
            "{shown}"
        );
    }

    #[test]
    fn undetermined_commits_are_unknown_even_around_a_conflict() {
        let classified = classify_commit(Error::UndeterminedError(Box::new(conflict())));
        assert!(
            matches!(classified, TitoError::CommitOutcomeUnknown { .. }),
            "{classified:?}"
        );
    }

    #[test]
    fn transport_failures_at_commit_are_unknown() {
        for err in [
            transport_error(),
            Error::StringError("connection reset".into()),
        ] {
            let classified = classify_commit(err);
            assert!(
                matches!(classified, TitoError::CommitOutcomeUnknown { .. }),
                "{classified:?}"
            );
            assert!(!classified.is_retryable());
        }
    }

    #[test]
    fn other_key_errors_are_determined_failures() {
        let classified = classify_commit(Error::ExtractedErrors(vec![aborted()]));
        assert!(
            matches!(classified, TitoError::Storage { .. }),
            "{classified:?}"
        );
    }

    fn transport_error() -> tikv_client::Error {
        // A gRPC failure as the client reports it, built through the public conversion.
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        tikv_client::Error::Io(io)
    }
}
