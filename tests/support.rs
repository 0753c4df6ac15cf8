//! The test harness: how each backend is made, and the macro that runs a generic suite on it.

use std::future::Future;
use std::time::Duration;

use tito::backend::embedded::Embedded;
use tito::backend::tikv::TiKV;
use tito::{TitoEngine, TitoTransaction};

/// One store for one test, with a key namespace so tests can share a real cluster.
pub struct Ctx<E> {
    pub db: E,
    pub ns: String,
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
        })
    }
}

pub struct TikvBackend;

impl Backend for TikvBackend {
    type Engine = TiKV;
    async fn make() -> Option<Ctx<TiKV>> {
        let Ok(endpoints) = std::env::var("TITO_PD_ENDPOINTS") else {
            skipped(
                "TiKV",
                "TITO_PD_ENDPOINTS is not set, so no TiKV cluster is reachable",
            );
            return None;
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

/// Says once per process, past the test harness's output capture, that a backend's tests were
/// skipped and why.
fn skipped(backend: &str, why: &str) {
    use std::io::Write;
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED: the {backend} tests did not run: {why}"
        );
    });
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
