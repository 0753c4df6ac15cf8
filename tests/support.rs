//! The test harness: how each backend is made, and the macro that runs a generic suite on it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tito::backend::embedded::Embedded;
use tito::backend::memory::Memory;
use tito::backend::tikv::TiKV;
use tito::{TitoEngine, TitoTransaction};
use tito_tikv_test_server::TestCluster;

/// One store for one test, with a key namespace so tests can share a real cluster.
pub struct Ctx<E> {
    pub db: E,
    pub ns: String,
    /// The TiKV test server behind `db`, when the test runs on one (for fault injection).
    #[allow(dead_code)]
    pub cluster: Option<Arc<TestCluster>>,
}

impl<E: TitoEngine> Ctx<E> {
    /// A key inside this test's namespace.
    pub fn key(&self, name: &str) -> Vec<u8> {
        format!("{}{}", self.ns, name).into_bytes()
    }
}

/// Makes a fresh, empty store of one backend.
/// Two stores of one backend.
pub type Pair<E> = (Ctx<E>, Ctx<E>);

pub trait Backend {
    type Engine: TitoEngine;
    /// `None` when the backend is not available here (the reason is printed).
    fn make() -> impl Future<Output = Option<Ctx<Self::Engine>>> + Send;
    /// Two stores to run a suite's case on at once, for a backend whose point is that they do
    /// not see each other (keyspaces of one cluster); `None` for the others.
    fn make_pair() -> impl Future<Output = Option<Pair<Self::Engine>>> + Send {
        async { None }
    }
}

pub struct EmbeddedBackend;

impl Backend for EmbeddedBackend {
    type Engine = Embedded;
    async fn make() -> Option<Ctx<Embedded>> {
        let db = Embedded::temporary()
            .await
            .expect("open a temporary embedded store");
        Some(Ctx {
            db,
            ns: "t:".into(),
            cluster: None,
        })
    }
}

/// The SQLite engine, in a temporary directory.
pub struct SqliteBackend;

impl Backend for SqliteBackend {
    type Engine = tito::backend::sqlite::Sqlite;
    async fn make() -> Option<Ctx<tito::backend::sqlite::Sqlite>> {
        let db = tito::backend::sqlite::Sqlite::temporary()
            .await
            .expect("open a temporary sqlite store");
        Some(Ctx {
            db,
            ns: "t:".into(),
            cluster: None,
        })
    }
}

/// The in-memory engine, on the host clock.
pub struct MemoryBackend;

impl Backend for MemoryBackend {
    type Engine = Memory;
    async fn make() -> Option<Ctx<Memory>> {
        Some(Ctx {
            db: Memory::new(),
            ns: "t:".into(),
            cluster: None,
        })
    }
}

/// TiKV through the real `tikv-client`: the cluster named by `TITO_PD_ENDPOINTS` when it is set,
/// otherwise a fresh protocol-level test server per test, its key space split into several
/// regions so that scans, batch reads and commits cross region boundaries.
pub struct TikvBackend;

/// Where the test server splits the key space, under the test namespace.
pub const TEST_SPLITS: [&str; 4] = ["b", "k05", "r01000", "y"];

impl Backend for TikvBackend {
    type Engine = TiKV;
    async fn make() -> Option<Ctx<TiKV>> {
        let Ok(endpoints) = std::env::var("TITO_PD_ENDPOINTS") else {
            return Some(test_server_ctx().await);
        };
        let endpoints: Vec<String> = endpoints
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        let db = TiKV::connect(endpoints)
            .await
            .expect("connect to the TiKV cluster");
        // A namespace of its own per test, so runs never see each other's keys.
        let version = db.current_version().await.expect("timestamp");
        Some(Ctx {
            db,
            ns: format!("tito-test:{version:020}:"),
            cluster: None,
        })
    }
}

/// TiKV on two API v2 keyspaces of one fresh test server, each split at [`TEST_SPLITS`]
/// inside it: a suite's case runs on both at once, with the same keys, so that anything one
/// handle saw of the other's would fail it.
pub struct TikvKeyspacesBackend;

impl Backend for TikvKeyspacesBackend {
    type Engine = TiKV;
    async fn make() -> Option<Ctx<TiKV>> {
        Self::make_pair().await.map(|(one, _)| one)
    }
    async fn make_pair() -> Option<Pair<TiKV>> {
        let cluster = Arc::new(
            TestCluster::start()
                .await
                .expect("start the TiKV test server"),
        );
        let ns = "t:".to_string();
        let mut pair = Vec::new();
        for name in ["one", "two"] {
            let prefix = tito_tikv_test_server::keyspace_prefix(cluster.create_keyspace(name));
            for split in TEST_SPLITS {
                cluster.split([&prefix[..], format!("{ns}{split}").as_bytes()].concat());
            }
            let db = TiKV::connect_with(
                cluster.pd_endpoints(),
                TiKVOptions::default().keyspace(name),
            )
            .await
            .expect("connect to a keyspace of the TiKV test server");
            pair.push(Ctx {
                db,
                ns: ns.clone(),
                cluster: Some(cluster.clone()),
            });
        }
        let two = pair.pop()?;
        let one = pair.pop()?;
        Some((one, two))
    }
}

/// A TiKV engine on a fresh test server, split at [`TEST_SPLITS`].
pub async fn test_server_ctx() -> Ctx<TiKV> {
    let cluster = TestCluster::start()
        .await
        .expect("start the TiKV test server");
    let ns = "t:".to_string();
    for split in TEST_SPLITS {
        cluster.split(format!("{ns}{split}"));
    }
    let db = TiKV::connect(cluster.pd_endpoints())
        .await
        .expect("connect to the TiKV test server");
    Ctx {
        db,
        ns,
        cluster: Some(Arc::new(cluster)),
    }
}

// ---------------------------------------------------------------------------------------------
// TLS: certificates made here, a test server serving TLS.
// ---------------------------------------------------------------------------------------------

use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, SanType};
use std::path::{Path, PathBuf};
use tito::backend::tikv::{TiKVOptions, TlsFiles};
use tito_tikv_test_server::TlsIdentity;

/// A CA, and certificates it signed for the server (127.0.0.1) and a client, as PEM.
pub struct Pki {
    ca_pem: String,
    server_pem: String,
    server_key: String,
    client_pem: String,
    client_key: String,
}

fn ca() -> (rcgen::Certificate, KeyPair) {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let key = KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    (cert, key)
}

/// Certificates signed by a fresh CA; `expired`: the server's ran out in 2001.
pub fn make_pki(expired: bool) -> Pki {
    let (ca, ca_key) = ca();
    let mut server = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    server
        .subject_alt_names
        .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
    if expired {
        server.not_before = rcgen::date_time_ymd(2000, 1, 1);
        server.not_after = rcgen::date_time_ymd(2001, 1, 1);
    }
    let server_key = KeyPair::generate().unwrap();
    let server_cert = server.signed_by(&server_key, &ca, &ca_key).unwrap();
    let client = CertificateParams::new(vec!["tito-client".to_string()]).unwrap();
    let client_key = KeyPair::generate().unwrap();
    let client_cert = client.signed_by(&client_key, &ca, &ca_key).unwrap();
    Pki {
        ca_pem: ca.pem(),
        server_pem: server_cert.pem(),
        server_key: server_key.serialize_pem(),
        client_pem: client_cert.pem(),
        client_key: client_key.serialize_pem(),
    }
}

impl Pki {
    pub fn identity(&self) -> TlsIdentity {
        TlsIdentity {
            cert_pem: self.server_pem.clone().into_bytes(),
            key_pem: self.server_key.clone().into_bytes(),
            client_ca_pem: Some(self.ca_pem.clone().into_bytes()),
        }
    }

    /// The client's files in `dir`.
    pub fn files(&self, dir: &Path) -> TlsFiles {
        let write = |name: &str, text: &str| -> PathBuf {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        TlsFiles::new(
            write("ca.pem", &self.ca_pem),
            write("client.pem", &self.client_pem),
            write("client-key.pem", &self.client_key),
        )
    }
}

/// TiKV over TLS on a fresh test server serving TLS, split like [`test_server_ctx`]'s. One CA
/// and pair of certificates per process, their files under the tests' temporary directory
/// (the client reads its key again for each new connection, so they stay in place).
pub struct TikvTlsBackend;

impl Backend for TikvTlsBackend {
    type Engine = TiKV;
    async fn make() -> Option<Ctx<TiKV>> {
        static PKI: std::sync::OnceLock<(Pki, TlsFiles)> = std::sync::OnceLock::new();
        let (pki, files) = PKI.get_or_init(|| {
            let pki = make_pki(false);
            let dir =
                Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("tls-{}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("a directory for the TLS files");
            let files = pki.files(&dir);
            (pki, files)
        });
        let cluster = TestCluster::start_tls(&pki.identity())
            .await
            .expect("start the TLS test server");
        let ns = "t:".to_string();
        for split in TEST_SPLITS {
            cluster.split(format!("{ns}{split}"));
        }
        let db = TiKV::connect_with(
            cluster.pd_endpoints(),
            TiKVOptions::default().tls(files.clone()),
        )
        .await
        .expect("connect to the TLS test server");
        Some(Ctx {
            db,
            ns,
            cluster: Some(Arc::new(cluster)),
        })
    }
}

/// Reads one key in a transaction of its own.
pub async fn read<E: TitoEngine>(db: &E, key: &[u8]) -> Option<Vec<u8>> {
    let tx = db.begin().await.expect("begin");
    let value = tx.get(key).await.expect("get");
    tx.rollback().await.expect("rollback");
    value
}

/// The host's time in Unix seconds (a queue event's timestamp for "now").
#[allow(dead_code)]
pub fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

/// A queue with `partitions` partitions that keeps completed rows an hour.
#[allow(dead_code)]
pub fn queue<E: TitoEngine>(db: &E, partitions: u32) -> Arc<tito::Queue<E>> {
    Arc::new(tito::Queue::new(
        db.clone(),
        tito::QueueConfig::new(partitions, Duration::from_secs(3600)),
    ))
}

/// Pending invocations over every partition of a queue.
#[allow(dead_code)]
pub async fn pending_total<E: TitoEngine>(queue: &tito::Queue<E>) -> usize {
    let mut total = 0;
    for p in 0..queue.config().partitions {
        total += queue.pending_count(p).await.unwrap();
    }
    total
}

/// Waits for a condition, polling, up to a bound; panics with `what` when it never holds.
#[allow(dead_code)]
pub async fn wait_for<F, Fut>(what: &str, bound: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + bound;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Instantiates the named generic test functions of a suite module (a module at the root of
/// this crate) for one backend: `engine_suite!(Backend, suite_module, [case_a, case_b]);`
/// Suites wrap this in a macro of their own that lists their cases, so a backend runs a whole
/// suite with one line.
#[macro_export]
macro_rules! engine_suite {
    ($backend:ty, $suite:ident, [$($case:ident),* $(,)?]) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                use $crate::support::Backend as _;
                if let Some((one, two)) = <$backend>::make_pair().await {
                    tokio::join!($crate::$suite::$case(one), $crate::$suite::$case(two));
                    return;
                }
                let Some(ctx) = <$backend>::make().await else { return };
                $crate::$suite::$case(ctx).await;
            }
        )*
    };
}

/// Every key of `db`, read in one snapshot by plain paging: an oracle for store moves that
/// shares no code with the copy's ranges (how a range ends, what it skips).
pub async fn every_key<E: TitoEngine>(db: &E) -> std::collections::BTreeMap<Vec<u8>, Vec<u8>> {
    let tx = db.begin().await.unwrap();
    let mut out = std::collections::BTreeMap::new();
    let mut from = Vec::new();
    loop {
        let page = tx.scan(&from, &[], 100).await.unwrap();
        let full = page.len() == 100;
        for (key, value) in page {
            from = key.clone();
            from.push(0);
            out.insert(key, value);
        }
        if !full {
            break;
        }
    }
    let _ = tx.rollback().await;
    out
}

/// The keys a copy must carry of `keys`: all but the copy's own record, a moved marker and
/// (unless `holders`) the keys that say who runs what now.
pub fn carried(
    keys: &std::collections::BTreeMap<Vec<u8>, Vec<u8>>,
    holders: bool,
) -> std::collections::BTreeMap<Vec<u8>, Vec<u8>> {
    keys.iter()
        .filter(|(key, _)| {
            key.as_slice() != b"store-copy"
                && key.as_slice() != b"store-moved"
                && (holders || !tito::store::is_holder_key(key))
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Writes `pairs` into `db`, 500 keys a transaction.
pub async fn put_all<E: TitoEngine>(db: &E, pairs: &[(Vec<u8>, Vec<u8>)]) {
    for chunk in pairs.chunks(500) {
        let chunk = chunk.to_vec();
        db.transaction(|tx| {
            let chunk = chunk.clone();
            async move {
                for (k, v) in chunk {
                    tx.put(k, v).await?;
                }
                Ok::<_, tito::TitoError>(())
            }
        })
        .await
        .unwrap();
    }
}
