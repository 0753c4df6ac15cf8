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
pub trait Backend {
    type Engine: TitoEngine;
    /// `None` when the backend is not available here (the reason is printed).
    fn make() -> impl Future<Output = Option<Ctx<Self::Engine>>> + Send;
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
                let Some(ctx) = <$backend>::make().await else { return };
                $crate::$suite::$case(ctx).await;
            }
        )*
    };
}
