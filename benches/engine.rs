//! Raw throughput of the embedded engine, side by side with surrealkv used directly (the limit
//! Tito's engine layer can reach), in buffered and durable modes.
//!
//! `cargo bench --bench engine` (set `TITO_BENCH_SECS` to measure longer than 2 s per row).
//! A second table prices the commit marker of unknown-outcome resolution on the same workload.
//! Later benchmarks quote their figures as ratios to the rows printed here.

use std::time::{Duration, Instant};

use surrealkv::{LSMIterator, TreeBuilder};
use tito::backend::embedded::{Durability, Embedded, EmbeddedOptions};
use tito::{TitoEngine, TitoTransaction};

const PRELOAD: u64 = 10_000;
const SCAN_ROWS: usize = 100;

fn secs() -> Duration {
    let secs = std::env::var("TITO_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0);
    Duration::from_secs_f64(secs)
}

fn key(i: u64) -> Vec<u8> {
    format!("bench:{i:012}").into_bytes()
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

/// Runs `op` with `tasks` concurrent tasks for the measuring time; returns operations per second.
async fn measure<F, Fut>(tasks: usize, op: F) -> f64
where
    F: Fn(u64) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let deadline = Instant::now() + secs();
    let start = Instant::now();
    let mut handles = Vec::new();
    for t in 0..tasks {
        let op = op.clone();
        handles.push(tokio::spawn(async move {
            let mut n = 0u64;
            let mut i = (t as u64) << 40;
            while Instant::now() < deadline {
                op(i).await;
                i += 1;
                n += 1;
            }
            n
        }));
    }
    let mut total = 0;
    for h in handles {
        total += h.await.unwrap();
    }
    total as f64 / start.elapsed().as_secs_f64()
}

async fn tito_db(dir: &std::path::Path, durability: Durability) -> Embedded {
    Embedded::open_with(dir, EmbeddedOptions::new().durability(durability))
        .await
        .unwrap()
}

/// surrealkv with the options the embedded engine gives it by default.
fn raw_tree(dir: &std::path::Path) -> surrealkv::Tree {
    TreeBuilder::with_options(
        surrealkv::Options::new()
            .with_path(dir.to_path_buf())
            .with_max_memtable_size(32 * 1024 * 1024)
            .with_wal_preallocation(true),
    )
    .build()
    .unwrap()
}

fn row(name: &str, tasks: usize, tito: f64, raw: f64) {
    println!(
        "| {name:<34} | {tasks:>5} | {tito:>12.0} | {raw:>12.0} | {:>6.2} |",
        tito / raw
    );
}

/// One 4-key write transaction of 100-byte values, starting at key `i * 4`.
async fn four_key_write(db: &Embedded, policy: tito::RetryPolicy, i: u64) {
    db.transaction_with(policy, |tx| async move {
        for part in 0..4u64 {
            tx.put(key(i * 4 + part), vec![7u8; 100]).await?;
        }
        Ok::<_, tito::TitoError>(())
    })
    .await
    .unwrap();
}

/// Prints a table's header: the operation, tasks, two contenders and their ratio.
fn header(left: &str, right: &str) {
    println!(
        "| {:<34} | {:>5} | {left:>12} | {right:>12} | {:>6} |",
        "operation (ops/s)", "tasks", "ratio"
    );
    println!(
        "|{:-<36}|{:->7}|{:->14}|{:->14}|{:->8}|",
        "", "", "", "", ""
    );
}

async fn writes(durability: Durability, tasks: usize) -> (f64, f64) {
    let dir = tempfile::tempdir().unwrap();
    let db = tito_db(&dir.path().join("tito"), durability).await;
    let tito = measure(tasks, move |i| {
        let db = db.clone();
        async move { four_key_write(&db, tito::RetryPolicy::default(), i).await }
    })
    .await;
    let tree = std::sync::Arc::new(raw_tree(&dir.path().join("raw")));
    let sync = durability == Durability::Immediate;
    let raw = measure(tasks, move |i| {
        let tree = tree.clone();
        async move {
            let mut tx = tree.begin().unwrap();
            if sync {
                tx.set_durability(surrealkv::Durability::Immediate);
            }
            for part in 0..4u64 {
                tx.set(key(i * 4 + part), vec![7u8; 100]).unwrap();
            }
            tx.commit().await.unwrap();
        }
    })
    .await;
    (tito, raw)
}

/// 4-key write transactions on two sides (a store and a retry policy each), the sides taking
/// `turns` turns each, alternating from the first, so that drift of the machine (the syncs of a
/// shared disk vary several times over from minute to minute) falls on both; each side's rate.
async fn in_turns(tasks: usize, turns: u64, sides: [(Embedded, tito::RetryPolicy); 2]) -> [f64; 2] {
    let mut rates = [0.0; 2];
    for round in 0..2 * turns {
        let which = (round % 2) as usize;
        let (db, policy) = sides[which].clone();
        rates[which] += measure(tasks, move |i| {
            let (db, policy) = (db.clone(), policy.clone());
            async move { four_key_write(&db, policy, i + (round << 36)).await }
        })
        .await
            / turns as f64;
    }
    rates
}

/// 4-key write transactions with and without a commit marker (unknown-outcome resolution), on
/// one store, two turns each.
async fn marker_cost(durability: Durability, tasks: usize) -> (f64, f64) {
    let dir = tempfile::tempdir().unwrap();
    let db = tito_db(&dir.path().join("tito"), durability).await;
    let policy = tito::RetryPolicy::default();
    let resolving = policy.clone().resolve_unknown_outcomes();
    let [without, with] = in_turns(tasks, 2, [(db.clone(), policy), (db, resolving)]).await;
    (with, without)
}

/// Durable 4-key write transactions on a store whose log writes zeros ahead of its records (the
/// default) and on one whose log appends, four turns each.
async fn preallocation_cost(tasks: usize) -> (f64, f64) {
    let dir = tempfile::tempdir().unwrap();
    let open = |name: &str, on: bool| {
        let path = dir.path().join(name);
        let options = EmbeddedOptions::new()
            .durability(Durability::Immediate)
            .wal_preallocation(on);
        async move { Embedded::open_with(path, options).await.unwrap() }
    };
    let policy = tito::RetryPolicy::default();
    let sides = [
        (open("preallocated", true).await, policy.clone()),
        (open("appending", false).await, policy),
    ];
    let [on, off] = in_turns(tasks, 4, sides).await;
    (on, off)
}

async fn reads_and_scans() -> [(f64, f64); 3] {
    let dir = tempfile::tempdir().unwrap();
    let db = tito_db(&dir.path().join("tito"), Durability::Buffered).await;
    let tree = std::sync::Arc::new(raw_tree(&dir.path().join("raw")));
    for chunk in 0..(PRELOAD / 1000) {
        let tx = db.begin().await.unwrap();
        let mut raw = tree.begin().unwrap();
        for i in chunk * 1000..(chunk + 1) * 1000 {
            tx.put(key(i), vec![7u8; 100]).await.unwrap();
            raw.set(key(i), vec![7u8; 100]).unwrap();
        }
        tx.commit().await.unwrap();
        raw.commit().await.unwrap();
    }

    // Point reads inside one long read transaction.
    let tx = db.begin().await.unwrap();
    let tito_get = measure(1, move |i| {
        let tx = tx.clone();
        async move {
            let k = key(Rng(i).next() % PRELOAD);
            assert!(tx.get(&k).await.unwrap().is_some());
        }
    })
    .await;
    let snapshot = std::sync::Arc::new(tree.begin_with_mode(surrealkv::Mode::ReadOnly).unwrap());
    let snap = snapshot.clone();
    let raw_get = measure(1, move |i| {
        let snap = snap.clone();
        async move {
            let k = key(Rng(i).next() % PRELOAD);
            assert!(snap.get(k).unwrap().is_some());
        }
    })
    .await;

    // A read on its own: begin, get, roll back.
    let db2 = db.clone();
    let tito_txn_get = measure(1, move |i| {
        let db = db2.clone();
        async move {
            let tx = db.begin().await.unwrap();
            assert!(
                tx.get(&key(Rng(i).next() % PRELOAD))
                    .await
                    .unwrap()
                    .is_some()
            );
            tx.rollback().await.unwrap();
        }
    })
    .await;
    let tree2 = tree.clone();
    let raw_txn_get = measure(1, move |i| {
        let tree = tree2.clone();
        async move {
            let tx = tree.begin_with_mode(surrealkv::Mode::ReadOnly).unwrap();
            assert!(tx.get(key(Rng(i).next() % PRELOAD)).unwrap().is_some());
        }
    })
    .await;

    // 100-row forward scans.
    let tx = db.begin().await.unwrap();
    let tito_scan = measure(1, move |i| {
        let tx = tx.clone();
        async move {
            let from = key(Rng(i).next() % (PRELOAD - SCAN_ROWS as u64));
            let rows = tx.scan(&from, b"bench;", SCAN_ROWS).await.unwrap();
            assert_eq!(rows.len(), SCAN_ROWS);
        }
    })
    .await;
    let raw_scan = measure(1, move |i| {
        let snap = snapshot.clone();
        async move {
            let from = key(Rng(i).next() % (PRELOAD - SCAN_ROWS as u64));
            let mut iter = snap.range(from.as_slice(), b"bench;".as_slice()).unwrap();
            let mut rows = Vec::with_capacity(SCAN_ROWS);
            let mut valid = iter.seek_first().unwrap();
            while valid && rows.len() < SCAN_ROWS {
                rows.push((iter.key().user_key().to_vec(), iter.value().unwrap()));
                valid = iter.next().unwrap();
            }
            assert_eq!(rows.len(), SCAN_ROWS);
        }
    })
    .await;
    [
        (tito_get, raw_get),
        (tito_txn_get, raw_txn_get),
        (tito_scan, raw_scan),
    ]
}

async fn all(flavor: &str) {
    println!(
        "\nruntime: {flavor}, {:.1} s per row\n",
        secs().as_secs_f64()
    );
    header("tito", "surrealkv");
    for (durability, name) in [
        (Durability::Buffered, "buffered"),
        (Durability::Immediate, "durable"),
    ] {
        for tasks in [1, 8] {
            let (tito, raw) = writes(durability, tasks).await;
            row(&format!("4-key write txn, {name}"), tasks, tito, raw);
        }
    }
    let [get, txn_get, scan] = reads_and_scans().await;
    row("point read (open snapshot)", 1, get.0, get.1);
    row("point read (own read txn)", 1, txn_get.0, txn_get.1);
    row(&format!("{SCAN_ROWS}-row scan"), 1, scan.0, scan.1);

    println!(
        "\nthe cost of a commit marker (RetryPolicy::resolve_unknown_outcomes), Tito on both sides\n"
    );
    header("with marker", "without");
    for (durability, name) in [
        (Durability::Buffered, "buffered"),
        (Durability::Immediate, "durable"),
    ] {
        for tasks in [1, 8] {
            let (with, without) = marker_cost(durability, tasks).await;
            row(&format!("4-key write txn, {name}"), tasks, with, without);
        }
    }

    println!(
        "\nthe write-ahead log with zeros written ahead (EmbeddedOptions::wal_preallocation, the \
         default) against an appending one, durable commits, Tito on both sides\n"
    );
    header("preallocated", "appending");
    for tasks in [1, 8] {
        let (on, off) = preallocation_cost(tasks).await;
        row("4-key write txn, durable", tasks, on, off);
    }
}

fn main() {
    // `cargo bench` passes `--bench`; nothing else is accepted.
    for flavor in ["multi_thread", "current_thread"] {
        let runtime = if flavor == "multi_thread" {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
        } else {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
        }
        .unwrap();
        runtime.block_on(all(flavor));
    }
}
