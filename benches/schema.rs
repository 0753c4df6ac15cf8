//! Online index builds on the embedded engine (buffered), side by side:
//!
//! 1. backfill rate: `build_indexes` over a loaded table, beside the raw engine doing the same
//!    reads and writes per batch (scan 256 rows, read their manifests, write an entry, the
//!    manifest and the row again for each), the limit of the schema layer;
//! 2. write throughput of the table (four tasks updating random rows) without a build, and
//!    while a build runs;
//! 3. shape versions: gets of rows of version 1 read by version-2 code (upgraded on read)
//!    beside gets of the same rows by version-1 code and of rewritten version-2 rows, and the
//!    rate of rewriting rows to version 2 with `rewrite_shapes` beside updates in 500-row
//!    transactions on a second store.
//!
//! `cargo bench --bench schema` (`TITO_BENCH_ROWS` sets the table size, default 50 000;
//! `TITO_BENCH_ONLY=shapes` runs the third part alone).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tito::backend::embedded::{Durability, Embedded, EmbeddedOptions};
use tito::model::TitoOptions;
use tito::{TitoEngine, TitoError, TitoModel, TitoShape, TitoTransaction};

#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(table = "member")]
#[tito(index = "by_team: team")]
struct Before {
    id: String,
    team: String,
    name: String,
    bio: String,
}

#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(table = "member")]
#[tito(index = "by_team: team")]
#[tito(index = "by_name: name")]
struct After {
    id: String,
    team: String,
    name: String,
    bio: String,
}

/// `Before` as a previous shape.
#[derive(TitoShape, Serialize, Deserialize)]
#[tito(version = 1)]
struct BeforeShape {
    id: String,
    team: String,
    name: String,
    bio: String,
}

/// Version 2: the name split into words and the bio's length kept beside it.
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(table = "member", version = 2, from = "BeforeShape")]
#[tito(index = "by_team: team")]
struct Reshaped {
    id: String,
    team: String,
    words: Vec<String>,
    bio: String,
    bio_chars: usize,
}

impl From<BeforeShape> for Reshaped {
    fn from(v1: BeforeShape) -> Self {
        Reshaped {
            id: v1.id,
            team: v1.team,
            words: v1.name.split('e').map(str::to_string).collect(),
            bio_chars: v1.bio.chars().count(),
            bio: v1.bio,
        }
    }
}

/// Gets per second of random ids of `n` rows by model `T`, for about `secs` seconds.
async fn gets<T: tito::model::TitoModelTrait>(db: &Embedded, n: u64, secs: f64) -> f64 {
    let model = db.clone().model::<T>();
    let started = Instant::now();
    let mut done = 0u64;
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    while started.elapsed().as_secs_f64() < secs {
        for _ in 0..100 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let id = format!("m{:08}", x % n);
            model.find_by_id(&id, vec![]).await.unwrap();
            done += 1;
        }
    }
    done as f64 / started.elapsed().as_secs_f64()
}

async fn shapes(n: u64) {
    let db = open().await;
    load(&db, n).await;
    let v1_native = gets::<Before>(&db, n, 2.0).await;
    let v1_upgraded = gets::<Reshaped>(&db, n, 2.0).await;
    // Rewrite every row by version-2 code (once version 2 is allowed).
    let reshaped = db.clone().model::<Reshaped>();
    reshaped
        .query_by_index("by_team")
        .value("team0")
        .execute()
        .await
        .unwrap();
    tito::schema::allow_shape_version(&db, "member", 2)
        .await
        .unwrap();
    // The rewrite's batches (the machinery a worker's maintenance runs).
    let started = Instant::now();
    let done = reshaped
        .rewrite_shapes(tito::schema::RewriteOptions::default(), |_| {})
        .await
        .unwrap();
    assert_eq!(done.rewritten, n);
    let rewrite = n as f64 / started.elapsed().as_secs_f64();
    // Beside it, the same rows of a second store rewritten by updates in 500-row transactions.
    let peer = open().await;
    load(&peer, n).await;
    let updated = peer.clone().model::<Reshaped>();
    updated.schema().await.unwrap();
    tito::schema::allow_shape_version(&peer, "member", 2)
        .await
        .unwrap();
    let started = Instant::now();
    for start in (0..n).step_by(500) {
        let model = updated.clone();
        peer.transaction(|tx| async move {
            for i in start..(start + 500).min(n) {
                let row = model.find_by_id_in_tx(&format!("m{i:08}"), &tx).await?;
                model
                    .update_with_options(row, TitoOptions::default(), &tx)
                    .await?;
            }
            Ok::<_, TitoError>(())
        })
        .await
        .unwrap();
    }
    let by_updates = n as f64 / started.elapsed().as_secs_f64();
    peer.close().await.unwrap();
    let v2_native = gets::<Reshaped>(&db, n, 2.0).await;
    println!(
        "\n| {:<40} | {:>12} | {:>12} | {:>6} |",
        "gets/s, one task", "rate", "beside", "ratio"
    );
    println!("|{:-<42}|{:->14}|{:->14}|{:->8}|", "", "", "", "");
    println!(
        "| {:<40} | {v1_upgraded:>12.0} | {v1_native:>12.0} | {:>6.2} |",
        "v1 rows by v2 code / by v1 code",
        v1_upgraded / v1_native
    );
    println!(
        "| {:<40} | {v1_upgraded:>12.0} | {v2_native:>12.0} | {:>6.2} |",
        "v1 rows by v2 code / v2 rows by v2 code",
        v1_upgraded / v2_native
    );
    println!(
        "\nrewriting {n} rows to version 2: rewrite_shapes (256-row batches) {rewrite:.0} rows/s, \
         beside updates in 500-row transactions {by_updates:.0} rows/s ({:.2})",
        rewrite / by_updates
    );
}

fn rows() -> u64 {
    std::env::var("TITO_BENCH_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000)
}

fn row(n: u64) -> Before {
    Before {
        id: format!("m{n:08}"),
        team: format!("team{}", n % 50),
        name: format!("name{}", n % 997),
        bio: "x".repeat(120),
    }
}

async fn open() -> Embedded {
    let db = Embedded::temporary_with(EmbeddedOptions::new().durability(Durability::Buffered))
        .await
        .unwrap();
    tito::schema::set_write_grace(&db, Duration::ZERO).unwrap();
    db
}

async fn load(db: &Embedded, n: u64) {
    let model = db.clone().model::<Before>();
    for start in (0..n).step_by(500) {
        let model = model.clone();
        db.transaction(|tx| async move {
            for i in start..(start + 500).min(n) {
                model
                    .build_with_options(row(i), TitoOptions::default(), &tx)
                    .await?;
            }
            Ok::<_, TitoError>(())
        })
        .await
        .unwrap();
    }
}

/// The raw engine doing a build's reads and writes over `table:` rows of a plain key space.
async fn raw_backfill(db: &Embedded, n: u64) -> Duration {
    // The same rows, manifests and sizes under a table the schema layer never sees.
    for start in (0..n).step_by(500) {
        db.transaction(|tx| async move {
            for i in start..(start + 500).min(n) {
                let bytes = serde_json::to_vec(&row(i)).unwrap();
                tx.put(format!("raw:row:{i:08}").into_bytes(), bytes)
                    .await?;
                tx.put(format!("raw:manifest:{i:08}").into_bytes(), b"[]".to_vec())
                    .await?;
            }
            Ok::<_, TitoError>(())
        })
        .await
        .unwrap();
    }
    let started = Instant::now();
    let mut cursor = b"raw:row:".to_vec();
    loop {
        let from = cursor.clone();
        let next = db
            .transaction(|tx| async move {
                let rows = tx.scan(&from, b"raw:row;", 256).await?;
                let manifests: Vec<Vec<u8>> = rows
                    .iter()
                    .map(|(k, _)| [b"raw:manifest:".as_slice(), &k[8..]].concat())
                    .collect();
                let _ = tx.batch_get(&manifests).await?;
                for ((key, value), manifest) in rows.iter().zip(manifests) {
                    let parsed: serde_json::Value = serde_json::from_slice(value)?;
                    let name = parsed["name"].as_str().unwrap_or_default().to_string();
                    let entry = format!("raw:index:{name}:{}", String::from_utf8_lossy(key));
                    tx.put(entry.clone().into_bytes(), value.clone()).await?;
                    tx.put(manifest, serde_json::to_vec(&[entry])?).await?;
                    tx.put(key.clone(), value.clone()).await?;
                }
                Ok::<_, TitoError>(rows.last().map(|(k, _)| tito::keys::key_after_bytes(k)))
            })
            .await
            .unwrap();
        match next {
            Some(next) => cursor = next,
            None => return started.elapsed(),
        }
    }
}

/// Four tasks updating random rows until `stop`; returns updates per second.
async fn updaters(db: &Embedded, n: u64, stop: Arc<AtomicBool>) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..4u64 {
        let (db, stop, done) = (db.clone(), stop.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let model = db.model::<Before>();
            let mut x = t * 7919 + 17;
            while !stop.load(Ordering::Relaxed) {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let mut r = row((x >> 33) % n);
                r.bio = format!("updated {x}");
                if model.upsert(r).await.is_ok() {
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n = rows();
    if std::env::var("TITO_BENCH_ONLY").as_deref() == Ok("shapes") {
        println!("\nshape versions, embedded engine (buffered), {n} rows");
        return shapes(n).await;
    }
    println!("\nonline index builds, embedded engine (buffered), {n} rows\n");

    // 1. Backfill against the raw engine.
    let db = open().await;
    load(&db, n).await;
    let after = db.clone().model::<After>();
    let started = Instant::now();
    after.build_indexes(|_| {}).await.unwrap();
    let tito = n as f64 / started.elapsed().as_secs_f64();
    let raw = n as f64 / raw_backfill(&db, n).await.as_secs_f64();
    println!(
        "| {:<40} | {:>12} | {:>12} | {:>6} |",
        "backfill (rows/s)", "tito", "raw engine", "ratio"
    );
    println!("|{:-<42}|{:->14}|{:->14}|{:->8}|", "", "", "", "");
    println!(
        "| {:<40} | {tito:>12.0} | {raw:>12.0} | {:>6.2} |",
        "build_indexes, idle table",
        tito / raw
    );

    // 2. Writes without and during a build, on a fresh table.
    let db = open().await;
    load(&db, n).await;
    let stop = Arc::new(AtomicBool::new(false));
    let quiet = {
        let (db, flag) = (db.clone(), stop.clone());
        let run = tokio::spawn(async move { updaters(&db, n, flag).await });
        tokio::time::sleep(Duration::from_secs(2)).await;
        stop.store(true, Ordering::Relaxed);
        run.await.unwrap()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let run = {
        let (db, stop) = (db.clone(), stop.clone());
        tokio::spawn(async move { updaters(&db, n, stop).await })
    };
    let after = db.clone().model::<After>();
    let started = Instant::now();
    after.build_indexes(|_| {}).await.unwrap();
    let build = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let busy = run.await.unwrap();
    println!(
        "\n| {:<40} | {:>12} | {:>12} | {:>6} |",
        "updates/s, 4 tasks", "during build", "no build", "ratio"
    );
    println!("|{:-<42}|{:->14}|{:->14}|{:->8}|", "", "", "", "");
    println!(
        "| {:<40} | {busy:>12.0} | {quiet:>12.0} | {:>6.2} |",
        "upsert of a random row",
        busy / quiet
    );
    println!(
        "\nthe build under that load took {:.2} s ({:.0} rows/s)",
        build.as_secs_f64(),
        n as f64 / build.as_secs_f64()
    );

    println!("\nshape versions, same engine, {n} rows");
    shapes(n).await;
}
