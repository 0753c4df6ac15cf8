//! The key/value store beside the raw engine doing the same reads and writes (the limit):
//! put (read the current row, write the new one), get, incr (read, parse, write), at equal
//! durability, one task.
//!
//! `cargo bench --bench kv` (`TITO_BENCH_SECS` sets the seconds per cell, default 2).

use std::time::{Duration, Instant};

use tito::backend::embedded::{Durability, Embedded, EmbeddedOptions};
use tito::kv::Kv;
use tito::{TitoEngine, TitoTransaction};

const KEYS: u64 = 10_000;

fn secs() -> Duration {
    let secs = std::env::var("TITO_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0);
    Duration::from_secs_f64(secs)
}

async fn measure<F, Fut>(mut op: F) -> f64
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let start = Instant::now();
    let deadline = start + secs();
    let mut n = 0;
    while Instant::now() < deadline {
        op(n).await;
        n += 1;
    }
    n as f64 / start.elapsed().as_secs_f64()
}

fn value(i: u64) -> serde_json::Value {
    serde_json::json!({"user": i, "plan": "pro", "seats": i % 50})
}

async fn open(durability: Durability) -> (tempfile::TempDir, Embedded) {
    let dir = tempfile::tempdir().unwrap();
    let db = Embedded::open_with(dir.path(), EmbeddedOptions::new().durability(durability))
        .await
        .unwrap();
    (dir, db)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    println!(
        "kv: operations per second, one task ({:?} per cell)",
        secs()
    );
    println!(
        "{:<10} {:<10} {:>12} {:>12} {:>10}",
        "durability", "operation", "tito kv", "raw engine", "kv/raw"
    );
    for (label, durability) in [
        ("buffered", Durability::Buffered),
        ("durable", Durability::Immediate),
    ] {
        let (_dir, db) = open(durability).await;
        let (_raw_dir, raw) = open(durability).await;
        let kv = Kv::new(db.clone());

        let kv_put = measure(|i| {
            let kv = kv.clone();
            async move {
                kv.put("bench", &format!("k{:06}", i % KEYS), &value(i), None, None)
                    .await
                    .unwrap();
            }
        })
        .await;
        let raw_put = measure(|i| {
            let raw = raw.clone();
            async move {
                let key = format!("kv:bench:k{:06}", i % KEYS).into_bytes();
                let tx = raw.begin().await.unwrap();
                let _ = tx.get(&key).await.unwrap();
                let row = serde_json::json!({"v": value(i), "ver": tx.start_version()});
                tx.put(key, serde_json::to_vec(&row).unwrap())
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
            }
        })
        .await;
        let kv_get = measure(|i| {
            let kv = kv.clone();
            async move {
                let found = kv
                    .get("bench", &format!("k{:06}", i % KEYS.min(1000)))
                    .await
                    .unwrap();
                assert!(found.is_some());
            }
        })
        .await;
        let raw_get = measure(|i| {
            let raw = raw.clone();
            async move {
                let tx = raw.begin().await.unwrap();
                let bytes = tx
                    .get(format!("kv:bench:k{:06}", i % KEYS.min(1000)).as_bytes())
                    .await
                    .unwrap()
                    .unwrap();
                tx.rollback().await.unwrap();
                let _: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            }
        })
        .await;
        let kv_incr = measure(|i| {
            let kv = kv.clone();
            async move {
                kv.incr("bench", &format!("c{}", i % 100), 1, None)
                    .await
                    .unwrap();
            }
        })
        .await;
        let raw_incr = measure(|i| {
            let raw = raw.clone();
            async move {
                let key = format!("kv:bench:c{}", i % 100).into_bytes();
                let tx = raw.begin().await.unwrap();
                let current = match tx.get(&key).await.unwrap() {
                    Some(bytes) => {
                        serde_json::from_slice::<serde_json::Value>(&bytes).unwrap()["v"]
                            .as_i64()
                            .unwrap()
                    }
                    None => 0,
                };
                let row = serde_json::json!({"v": current + 1, "ver": tx.start_version()});
                tx.put(key, serde_json::to_vec(&row).unwrap())
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
            }
        })
        .await;
        for (name, tito, limit) in [
            ("put", kv_put, raw_put),
            ("get", kv_get, raw_get),
            ("incr", kv_incr, raw_incr),
        ] {
            println!(
                "{label:<10} {name:<10} {tito:>12.0} {limit:>12.0} {:>10.2}",
                tito / limit
            );
        }
        db.close().await.unwrap();
        raw.close().await.unwrap();
    }
}
