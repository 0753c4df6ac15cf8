//! A protocol-level TiKV + PD test double, for Tito's development and CI.
//!
//! **This is not a database.** Everything lives in memory and goes away with the process; there
//! is no replication, no persistence and no attempt at TiKV's performance. It exists so that the
//! real `tikv-client` (and Tito's TiKV engine on top of it) can run over real sockets where no
//! TiKV or PD binary can be installed.
//!
//! What it speaks, generated from the `.proto` files `tikv-client` ships, with the same tonic and
//! prost versions:
//!
//! - PD: `GetMembers`, `Tso` (bidirectional stream, TiKV's timestamp layout: milliseconds shifted
//!   by 18 logical bits), `GetRegion`, `GetRegionByID`, `GetStore`, `GetAllStores`,
//!   `GetGCSafePoint`, `UpdateGCSafePoint` (forward only); `LoadKeyspace` for API v2 keyspaces
//!   made with [`TestCluster::create_keyspace`].
//! - TiKV: `KvGet`, `KvBatchGet`, `KvScan` (forward and reverse), `KvPrewrite`, `KvCommit`,
//!   `KvBatchRollback`, `KvCleanup`, `KvCheckTxnStatus`, `KvCheckSecondaryLocks`,
//!   `KvResolveLock`, `KvScanLock`, `KvTxnHeartBeat`, `KvGC`, `KvDeleteRange`,
//!   `UnsafeDestroyRange`. Every other method answers at once with gRPC status `UNIMPLEMENTED`.
//!
//! Semantics: Percolator over a multi-version store (lock and write records per key), snapshot
//! reads at the start timestamp, write conflicts and key-is-locked errors in TiKV's shapes, lock
//! resolution of abandoned transactions, MVCC garbage collection when the safe point moves.
//! The key space can be split into regions at chosen keys; requests carry region epochs and are
//! checked against them as TiKV does.
//!
//! For tests it adds what a real cluster cannot do on demand: [`FaultRule`]s (fail, lose the
//! response after applying, delay), injected region errors ([`RegionFault`]), and
//! [`TestCluster::kill`], which drops every connection like a crashed process.
//!
//! ```no_run
//! # async fn run() -> std::io::Result<()> {
//! let cluster = tito_tikv_test_server::TestCluster::start().await?;
//! cluster.split(b"m");
//! let endpoints = cluster.pd_endpoints(); // e.g. ["127.0.0.1:40123"], for tikv-client
//! # Ok(())
//! # }
//! ```
//!
//! # Where it knowingly differs from TiKV
//!
//! - One store holds every region; a region's only peer is its leader.
//! - No async commit or one-phase commit (prewrites asking for them are served as two-phase
//!   commit, which the client accepts), no pessimistic transactions, no raw API.
//! - A rollback record of another transaction does not count as a write conflict.
//! - Reads below the GC safe point are served from what GC left instead of being refused.
//! - API v1 and API v2 requests are served side by side (a real store runs one API version):
//!   an API v2 request must carry only keys of an existing keyspace, and an API v1 request
//!   none; anything else is refused with `INVALID_ARGUMENT`. The GC safe point stays cluster
//!   wide (`UpdateGCSafePoint`): there is no keyspace-level GC.

#![warn(missing_docs)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The protocol messages, generated from the `.proto` files of `tikv-client`.
#[allow(clippy::all, missing_docs, rustdoc::all)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/all.rs"));
}

mod codec;
mod grpc;
mod kv;
mod mvcc;
mod pd;

pub use mvcc::LOGICAL_BITS;

/// The cluster id PD reports.
pub const CLUSTER_ID: u64 = 0x7469_746f_7465_7374;

/// The id of the one store.
const STORE_ID: u64 = 1;

/// The length of an API v2 transactional key's keyspace prefix.
pub const KEYSPACE_PREFIX_LEN: usize = 4;

/// The prefix API v2 puts before every transactional key of keyspace `id`: `x` and the id's
/// three low bytes, big-endian.
pub fn keyspace_prefix(id: u32) -> [u8; KEYSPACE_PREFIX_LEN] {
    let [_, a, b, c] = id.to_be_bytes();
    [b'x', a, b, c]
}

/// What a [`FaultRule`] does to a matching call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Fail before anything is applied, with gRPC status `UNAVAILABLE` (what the client sees
    /// when a connection drops before the request arrives).
    Unavailable,
    /// Apply the request, then fail with `UNAVAILABLE` instead of answering: the effect happened
    /// but the client cannot know it (a connection lost after the server acted).
    LoseResponse,
    /// Wait this long before serving the call.
    Delay(Duration),
    /// Answer with this region error instead of serving the call (nothing is applied).
    Region(RegionFault),
}

/// A fault injected into calls of one gRPC method (its name without the service, such as
/// `"KvCommit"` or `"GetRegion"`), optionally only when a key of the request starts with a
/// prefix. By default the rule fires once.
#[derive(Clone, Debug)]
pub struct FaultRule {
    method: String,
    fault: Fault,
    key_prefix: Option<Vec<u8>>,
    skip: u32,
    times: Option<u32>,
}

impl FaultRule {
    /// A rule that fires on the next matching call of `method`.
    pub fn new(method: &str, fault: Fault) -> Self {
        FaultRule {
            method: method.to_string(),
            fault,
            key_prefix: None,
            skip: 0,
            times: Some(1),
        }
    }

    /// Lets the first `calls` matching calls through untouched.
    pub fn skip(mut self, calls: u32) -> Self {
        self.skip = calls;
        self
    }

    /// Fires on `calls` matching calls, then never again.
    pub fn times(mut self, calls: u32) -> Self {
        self.times = Some(calls);
        self
    }

    /// Fires on every matching call until the rules are cleared.
    pub fn always(mut self) -> Self {
        self.times = None;
        self
    }

    /// Matches only calls with a key (or range start) that starts with `prefix`.
    pub fn when_key_starts_with(mut self, prefix: impl Into<Vec<u8>>) -> Self {
        self.key_prefix = Some(prefix.into());
        self
    }
}

/// What a TLS test cluster presents: its certificate chain and key (PEM), and optionally the CA
/// (PEM) whose certificates clients must present.
#[derive(Clone, Debug)]
pub struct TlsIdentity {
    /// The server's certificate chain (valid for 127.0.0.1), PEM.
    pub cert_pem: Vec<u8>,
    /// The server's private key, PEM.
    pub key_pem: Vec<u8>,
    /// Clients must present a certificate this CA signed, when set.
    pub client_ca_pem: Option<Vec<u8>>,
}

/// A region error to answer a TiKV call with instead of serving it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegionFault {
    /// `NotLeader`, naming the (unchanged) leader: the client updates its cache and retries.
    NotLeader,
    /// `EpochNotMatch` with the current regions: the client reloads the region and retries.
    EpochNotMatch,
    /// `ServerIsBusy`: the client gives up on the request with a region error.
    ServerIsBusy,
}

/// A region as PD describes it, with raw (unencoded) boundaries; an empty end is unbounded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionInfo {
    /// The region id.
    pub id: u64,
    /// The first key of the region.
    pub start_key: Vec<u8>,
    /// The first key after the region; empty for the last region.
    pub end_key: Vec<u8>,
    /// The epoch version, bumped by every split.
    pub version: u64,
}

pub(crate) struct State {
    pub mvcc: mvcc::Mvcc,
    /// Sorted by start key, covering the key space without gaps.
    pub regions: Vec<RegionInfo>,
    next_id: u64,
    pub safe_point: u64,
    /// API v2 keyspaces by name (`DEFAULT` is id 0).
    pub keyspaces: std::collections::BTreeMap<String, u32>,
    tso_physical: u64,
    tso_logical: u64,
}

impl State {
    /// Hands out `count` timestamps; returns the last one (the layout of PD's answer).
    pub fn timestamps(&mut self, count: u32) -> (u64, u64) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        if now > self.tso_physical {
            self.tso_physical = now;
            self.tso_logical = 0;
        }
        if self.tso_logical + u64::from(count) >= 1 << LOGICAL_BITS {
            self.tso_physical += 1;
            self.tso_logical = 0;
        }
        self.tso_logical += u64::from(count);
        (self.tso_physical, self.tso_logical)
    }

    /// Whether `key` lies in a keyspace's transactional key space (`x` and its 3-byte id).
    pub fn in_a_keyspace(&self, key: &[u8]) -> bool {
        key.len() >= KEYSPACE_PREFIX_LEN
            && key[0] == b'x'
            && self
                .keyspaces
                .values()
                .any(|id| key.starts_with(&keyspace_prefix(*id)))
    }

    /// Whether `key` is the exclusive end of a keyspace's key space (the next id's prefix),
    /// which API v2 sends as the upper bound of a scan to the end of a keyspace.
    pub fn is_a_keyspace_end(&self, key: &[u8]) -> bool {
        self.keyspaces
            .values()
            .any(|id| key == keyspace_prefix(id + 1).as_slice())
    }

    pub fn region_by_id(&self, id: u64) -> Option<&RegionInfo> {
        self.regions.iter().find(|r| r.id == id)
    }

    /// The region holding `key`, compared with the regions' encoded boundaries (PD's view).
    pub fn region_for_encoded_key(&self, key: &[u8]) -> &RegionInfo {
        self.regions
            .iter()
            .find(|r| {
                codec::encode_boundary(&r.start_key).as_slice() <= key
                    && (r.end_key.is_empty() || key < codec::encode(&r.end_key).as_slice())
            })
            .expect("regions cover the key space")
    }

    fn split(&mut self, key: &[u8]) -> bool {
        let index = self
            .regions
            .iter()
            .position(|r| {
                r.start_key.as_slice() <= key
                    && (r.end_key.is_empty() || key < r.end_key.as_slice())
            })
            .expect("regions cover the key space");
        if self.regions[index].start_key == key {
            return false;
        }
        let id = self.next_id;
        self.next_id += 1;
        let left = &mut self.regions[index];
        left.version += 1;
        let right = RegionInfo {
            id,
            start_key: key.to_vec(),
            end_key: std::mem::replace(&mut left.end_key, key.to_vec()),
            version: left.version,
        };
        self.regions.insert(index + 1, right);
        true
    }
}

struct ArmedFault {
    rule: FaultRule,
}

pub(crate) struct Shared {
    state: Mutex<State>,
    faults: Mutex<Vec<ArmedFault>>,
    region_faults: Mutex<Vec<(String, RegionFault, u32)>>,
    calls: Mutex<HashMap<String, u64>>,
    /// Calls of a method about one key (a `KvGet`), by method and key.
    key_calls: Mutex<HashMap<(String, Vec<u8>), u64>>,
    /// Added to every request before it is served (see [`TestCluster::set_latency`]).
    latency: Mutex<Duration>,
    pub tikv_address: Mutex<String>,
    pub pd_address: Mutex<String>,
}

impl Shared {
    pub fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits the latency set for every request, if any: on a thread of the blocking pool, whose
    /// sleep keeps sub-millisecond delays (tokio's timers count whole milliseconds).
    pub async fn delay(&self) {
        let latency = *self.latency.lock().unwrap_or_else(|e| e.into_inner());
        if !latency.is_zero() {
            let _ = tokio::task::spawn_blocking(move || std::thread::sleep(latency)).await;
        }
    }

    /// Counts a call of `method` and returns the fault it must suffer, if any.
    pub fn on_call(&self, method: &str, keys: &[&[u8]]) -> Option<Fault> {
        *self
            .calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(method.to_string())
            .or_default() += 1;
        if let [key] = keys {
            *self
                .key_calls
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry((method.to_string(), key.to_vec()))
                .or_default() += 1;
        }
        let mut faults = self.faults.lock().unwrap_or_else(|e| e.into_inner());
        for armed in faults.iter_mut() {
            let rule = &mut armed.rule;
            if rule.method != method || rule.times == Some(0) {
                continue;
            }
            if let Some(prefix) = &rule.key_prefix
                && !keys.iter().any(|key| key.starts_with(prefix))
            {
                continue;
            }
            if rule.skip > 0 {
                rule.skip -= 1;
                continue;
            }
            if let Some(times) = &mut rule.times {
                *times -= 1;
            }
            return Some(rule.fault.clone());
        }
        None
    }

    /// The region error `method` must answer with next, if one was injected.
    pub fn take_region_fault(&self, method: &str) -> Option<RegionFault> {
        let mut faults = self.region_faults.lock().unwrap_or_else(|e| e.into_inner());
        let index = faults
            .iter()
            .position(|(m, _, left)| m == method && *left > 0)?;
        faults[index].2 -= 1;
        let fault = faults[index].1;
        if faults[index].2 == 0 {
            faults.remove(index);
        }
        Some(fault)
    }
}

/// A running PD + TiKV pair on loopback ports. Dropping it kills both servers.
pub struct TestCluster {
    shared: Arc<Shared>,
    pd: grpc::Server,
    tikv: grpc::Server,
}

impl std::fmt::Debug for TestCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCluster")
            .field("pd", &self.pd.addr)
            .field("tikv", &self.tikv.addr)
            .finish()
    }
}

impl TestCluster {
    /// Starts PD and TiKV on ports the system picks, with one region covering every key. Must
    /// run inside a Tokio runtime, which serves the connections.
    pub async fn start() -> std::io::Result<TestCluster> {
        Self::start_with(None).await
    }

    /// [`TestCluster::start`], both servers speaking TLS with `tls`'s certificate.
    pub async fn start_tls(tls: &TlsIdentity) -> std::io::Result<TestCluster> {
        let acceptor =
            grpc::tls_acceptor(&tls.cert_pem, &tls.key_pem, tls.client_ca_pem.as_deref())?;
        Self::start_with(Some(acceptor)).await
    }

    async fn start_with(tls: Option<tokio_rustls::TlsAcceptor>) -> std::io::Result<TestCluster> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                mvcc: mvcc::Mvcc::default(),
                regions: vec![RegionInfo {
                    id: 2,
                    start_key: Vec::new(),
                    end_key: Vec::new(),
                    version: 1,
                }],
                next_id: 3,
                safe_point: 0,
                keyspaces: [("DEFAULT".to_string(), 0)].into_iter().collect(),
                tso_physical: 0,
                tso_logical: 0,
            }),
            faults: Mutex::default(),
            region_faults: Mutex::default(),
            calls: Mutex::default(),
            key_calls: Mutex::default(),
            latency: Mutex::default(),
            tikv_address: Mutex::default(),
            pd_address: Mutex::default(),
        });
        let tikv = grpc::Server::start(kv::router(shared.clone()), tls.clone()).await?;
        *shared
            .tikv_address
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = tikv.addr.to_string();
        let pd = grpc::Server::start(pd::router(shared.clone()), tls).await?;
        *shared.pd_address.lock().unwrap_or_else(|e| e.into_inner()) = pd.addr.to_string();
        Ok(TestCluster { shared, pd, tikv })
    }

    /// The PD endpoints to give `tikv-client` (or `TITO_PD_ENDPOINTS`, comma-separated).
    pub fn pd_endpoints(&self) -> Vec<String> {
        vec![self.pd.addr.to_string()]
    }

    /// PD's socket address.
    pub fn pd_address(&self) -> SocketAddr {
        self.pd.addr
    }

    /// TiKV's socket address.
    pub fn tikv_address(&self) -> SocketAddr {
        self.tikv.addr
    }

    /// Splits the region holding `key` so that a new region starts at `key`. Returns false when
    /// a region already starts there. Clients holding the old region in cache get
    /// `EpochNotMatch` on their next request to it, as with a real split.
    pub fn split(&self, key: impl AsRef<[u8]>) -> bool {
        self.shared.state().split(key.as_ref())
    }

    /// Creates an API v2 keyspace named `name` (PD's `LoadKeyspace` then finds it) and returns
    /// its id; a name already taken returns the existing id. Like PD, it splits regions at the
    /// keyspace's boundaries, so that no region holds keys of two keyspaces.
    pub fn create_keyspace(&self, name: &str) -> u32 {
        let mut state = self.shared.state();
        if let Some(id) = state.keyspaces.get(name) {
            return *id;
        }
        let id = state.keyspaces.values().max().map_or(0, |id| id + 1);
        state.keyspaces.insert(name.to_string(), id);
        state.split(&keyspace_prefix(id));
        state.split(&keyspace_prefix(id + 1));
        id
    }

    /// Every key that holds a lock or a write record, in order (with a keyspace's prefix, for
    /// keys written through one).
    pub fn stored_keys(&self) -> Vec<Vec<u8>> {
        self.shared.state().mvcc.keys()
    }

    /// The regions, in key order.
    pub fn regions(&self) -> Vec<RegionInfo> {
        self.shared.state().regions.clone()
    }

    /// Arms a fault rule. Rules are tried in the order they were added.
    pub fn add_fault(&self, rule: FaultRule) {
        self.shared
            .faults
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(ArmedFault { rule });
    }

    /// Disarms every fault rule and pending region error.
    pub fn clear_faults(&self) {
        self.shared
            .faults
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.shared
            .region_faults
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// Answers the next `times` calls of the TiKV `method` with a region error.
    pub fn inject_region_error(&self, method: &str, fault: RegionFault, times: u32) {
        self.shared
            .region_faults
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((method.to_string(), fault, times));
    }

    /// Delays every request (TiKV's and PD's, timestamps included) by `latency` before it is
    /// served, as a network between the client and the cluster would: 0.5 ms is about a LAN,
    /// 2 ms a zone apart. Zero (the default) serves at once.
    pub fn set_latency(&self, latency: Duration) {
        *self
            .shared
            .latency
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = latency;
    }

    /// How many calls of each method (PD and TiKV) the servers received, by method name.
    pub fn all_calls(&self) -> std::collections::BTreeMap<String, u64> {
        self.shared
            .calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(method, count)| (method.clone(), *count))
            .collect()
    }

    /// How many calls of `method` (PD or TiKV) the servers received.
    pub fn calls(&self, method: &str) -> u64 {
        self.shared
            .calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(method)
            .copied()
            .unwrap_or(0)
    }

    /// How many calls of `method` about `key` alone (a `KvGet` of it) the servers received.
    pub fn calls_for(&self, method: &str, key: &[u8]) -> u64 {
        self.shared
            .key_calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(method.to_string(), key.to_vec()))
            .copied()
            .unwrap_or(0)
    }

    /// Kills both servers: stops accepting and drops every open connection, the TSO stream
    /// included. Irreversible; the stored data stays readable through [`Self::lock_count`] and
    /// friends.
    pub fn kill(&self) {
        self.pd.kill();
        self.tikv.kill();
    }

    /// The GC safe point PD holds.
    pub fn gc_safe_point(&self) -> u64 {
        self.shared.state().safe_point
    }

    /// How many Percolator locks are held (abandoned transactions included).
    pub fn lock_count(&self) -> usize {
        self.shared.state().mvcc.lock_count()
    }

    /// How many write records (versions, deletions, lock and rollback records) are stored.
    pub fn version_count(&self) -> usize {
        self.shared.state().mvcc.version_count()
    }
}
