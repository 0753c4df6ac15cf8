//! Models side by side, at equal durability: Tito on the embedded engine, the raw engine doing
//! the same key writes and reads (the limit of the model layer), and SQLite through rusqlite
//! with the same two secondary indexes (the peer a Rust user would pick instead).
//!
//! Three operations: insert of a row with two secondary indexes (one transaction each), read by
//! id, and a query returning 10 rows through an index. Every contender serializes and parses the
//! same JSON rows. One task, so SQLite's single connection is not at a disadvantage.
//!
//! `cargo bench --bench models` (`TITO_BENCH_SECS` sets the seconds per row, default 2).

use std::time::{Duration, Instant};

use rusqlite::{Connection, params};
use serde::{Deserialize, Serialize};
use tito::backend::embedded::{Durability, Embedded, EmbeddedOptions};
use tito::model::{TitoIndexBlockType, TitoIndexConfig, TitoIndexField, TitoModelTrait};
use tito::{TitoEngine, TitoTransaction};

/// Rows preloaded before reads; 10 share each team.
const ROWS: u64 = 5_000;

#[derive(Default, Clone, Debug, Serialize, Deserialize)]
struct Item {
    id: String,
    team: String,
    email: String,
    title: String,
    price: i64,
}

impl TitoModelTrait for Item {
    fn id(&self) -> String {
        self.id.clone()
    }
    fn table(&self) -> String {
        "item".into()
    }
    fn indexes(&self) -> Vec<TitoIndexConfig> {
        let field = |name: &str| TitoIndexField {
            name: name.into(),
            r#type: TitoIndexBlockType::String,
        };
        vec![
            TitoIndexConfig {
                condition: true,
                name: "item_by_team".into(),
                fields: vec![field("team")],
            },
            TitoIndexConfig {
                condition: true,
                name: "item_by_email".into(),
                fields: vec![field("email")],
            },
        ]
    }
}

fn item(i: u64) -> Item {
    Item {
        id: format!("{i:08}"),
        team: format!("team-{:06}", i / 10),
        email: format!("user{i}@example.com"),
        title: format!("a reasonably sized title for item number {i}"),
        price: (i * 37 % 10_000) as i64,
    }
}

fn secs() -> Duration {
    let secs = std::env::var("TITO_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0);
    Duration::from_secs_f64(secs)
}

/// Runs `op(i)` for i = 0, 1, .. for the measuring time; returns operations per second.
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

async fn open(dir: &std::path::Path, durability: Durability) -> Embedded {
    Embedded::open_with(dir, EmbeddedOptions::new().durability(durability))
        .await
        .unwrap()
}

fn sqlite(dir: &std::path::Path, durable: bool) -> Connection {
    let conn = Connection::open(dir.join("bench.sqlite")).unwrap();
    conn.pragma_update(None, "journal_mode", "WAL").unwrap();
    conn.pragma_update(None, "synchronous", if durable { "FULL" } else { "OFF" })
        .unwrap();
    conn.execute_batch(
        "CREATE TABLE item (id TEXT PRIMARY KEY, team TEXT, email TEXT, body TEXT NOT NULL);
         CREATE INDEX item_by_team ON item (team, id);
         CREATE INDEX item_by_email ON item (email, id);",
    )
    .unwrap();
    conn
}

fn sqlite_insert(conn: &Connection, row: &Item) {
    let tx = conn.unchecked_transaction().unwrap();
    tx.prepare_cached("INSERT INTO item (id, team, email, body) VALUES (?1, ?2, ?3, ?4)")
        .unwrap()
        .execute(params![
            row.id,
            row.team,
            row.email,
            serde_json::to_string(row).unwrap()
        ])
        .unwrap();
    tx.commit().unwrap();
}

/// The raw engine doing the model layer's writes: row, two index entries, manifest.
async fn raw_insert(db: &Embedded, row: &Item) {
    let body = serde_json::to_vec(row).unwrap();
    let team = format!("index:item_by_team:team:{}:table:item:{}", row.team, row.id);
    let email = format!(
        "index:item_by_email:email:{}:table:item:{}",
        row.email, row.id
    );
    let manifest = serde_json::to_vec(&[&team, &email]).unwrap();
    let tx = db.begin().await.unwrap();
    let existing = tx
        .batch_get(&[
            format!("table:item:{}", row.id).into_bytes(),
            format!("reverse-index:table:item:{}", row.id).into_bytes(),
        ])
        .await
        .unwrap();
    assert!(existing.iter().all(Option::is_none));
    tx.put(format!("table:item:{}", row.id).into_bytes(), body.clone())
        .await
        .unwrap();
    tx.put(team.into_bytes(), body.clone()).await.unwrap();
    tx.put(email.into_bytes(), body).await.unwrap();
    tx.put(
        format!("reverse-index:table:item:{}", row.id).into_bytes(),
        manifest,
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

struct Row {
    name: &'static str,
    tito: f64,
    raw: f64,
    sqlite: f64,
}

async fn run(durability: Durability) -> Vec<Row> {
    let durable = durability == Durability::Immediate;
    let (tito_dir, raw_dir, sql_dir) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let db = open(tito_dir.path(), durability).await;
    let items = db.clone().model::<Item>();
    let raw = open(raw_dir.path(), durability).await;
    let conn = sqlite(sql_dir.path(), durable);

    // Inserts of fresh rows, continuing ids past the preload.
    let offset = 1_000_000;
    let tito_insert = measure(|i| {
        let items = items.clone();
        async move {
            items.build(item(offset + i)).await.unwrap();
        }
    })
    .await;
    let raw_insert_rate = measure(|i| {
        let raw = raw.clone();
        async move { raw_insert(&raw, &item(offset + i)).await }
    })
    .await;
    let sqlite_insert_rate = measure(|i| {
        sqlite_insert(&conn, &item(offset + i));
        async {}
    })
    .await;

    // Preload for the reads.
    for i in 0..ROWS {
        let row = item(i);
        items.build(row.clone()).await.unwrap();
        raw_insert(&raw, &row).await;
        sqlite_insert(&conn, &row);
    }

    let mut next = 7u64;
    let mut pick = move || {
        next = next
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (next >> 33) % ROWS
    };

    let tito_read = measure(|_| {
        let items = items.clone();
        let id = item(pick()).id;
        async move {
            let found = items.find_by_id(&id, vec![]).await.unwrap();
            assert_eq!(found.id, id);
        }
    })
    .await;
    let raw_read = measure(|_| {
        let raw = raw.clone();
        let id = item(pick()).id;
        async move {
            let tx = raw.begin().await.unwrap();
            let bytes = tx
                .get(format!("table:item:{id}").as_bytes())
                .await
                .unwrap()
                .unwrap();
            tx.rollback().await.unwrap();
            let found: Item = serde_json::from_slice(&bytes).unwrap();
            assert_eq!(found.id, id);
        }
    })
    .await;
    let sqlite_read = measure(|_| {
        let id = item(pick()).id;
        let body: String = conn
            .prepare_cached("SELECT body FROM item WHERE id = ?1")
            .unwrap()
            .query_row(params![id], |row| row.get(0))
            .unwrap();
        let found: Item = serde_json::from_str(&body).unwrap();
        assert_eq!(found.id, id);
        async {}
    })
    .await;

    let tito_query = measure(|_| {
        let items = items.clone();
        let team = item(pick() / 10 * 10).team;
        async move {
            let page = items
                .query_by_index("item_by_team")
                .value(&team)
                .limit(Some(10))
                .execute()
                .await
                .unwrap();
            assert_eq!(page.items.len(), 10);
        }
    })
    .await;
    let raw_query = measure(|_| {
        let raw = raw.clone();
        let team = item(pick() / 10 * 10).team;
        async move {
            let prefix = format!("index:item_by_team:team:{team}:");
            let end = tito::prefix_end(prefix.clone());
            let tx = raw.begin().await.unwrap();
            let rows = tx
                .scan(prefix.as_bytes(), end.as_bytes(), 11)
                .await
                .unwrap();
            tx.rollback().await.unwrap();
            let found: Vec<Item> = rows
                .iter()
                .map(|(_, v)| serde_json::from_slice(v).unwrap())
                .collect();
            assert_eq!(found.len(), 10);
        }
    })
    .await;
    let sqlite_query = measure(|_| {
        let team = item(pick() / 10 * 10).team;
        let mut stmt = conn
            .prepare_cached("SELECT body FROM item WHERE team = ?1 ORDER BY id LIMIT 10")
            .unwrap();
        let found: Vec<Item> = stmt
            .query_map(params![team], |row| row.get::<_, String>(0))
            .unwrap()
            .map(|body| serde_json::from_str(&body.unwrap()).unwrap())
            .collect();
        assert_eq!(found.len(), 10);
        async {}
    })
    .await;

    db.close().await.unwrap();
    raw.close().await.unwrap();
    vec![
        Row {
            name: "insert (2 indexes)",
            tito: tito_insert,
            raw: raw_insert_rate,
            sqlite: sqlite_insert_rate,
        },
        Row {
            name: "read by id",
            tito: tito_read,
            raw: raw_read,
            sqlite: sqlite_read,
        },
        Row {
            name: "10-row index query",
            tito: tito_query,
            raw: raw_query,
            sqlite: sqlite_query,
        },
    ]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    println!(
        "models: operations per second, one task ({:?} per cell)",
        secs()
    );
    println!(
        "{:<10} {:<20} {:>12} {:>12} {:>12} {:>10} {:>10}",
        "durability", "operation", "tito", "raw engine", "sqlite", "tito/raw", "tito/sqlite"
    );
    for (label, durability) in [
        ("buffered", Durability::Buffered),
        ("durable", Durability::Immediate),
    ] {
        for row in run(durability).await {
            println!(
                "{:<10} {:<20} {:>12.0} {:>12.0} {:>12.0} {:>10.2} {:>10.2}",
                label,
                row.name,
                row.tito,
                row.raw,
                row.sqlite,
                row.tito / row.raw,
                row.tito / row.sqlite
            );
        }
    }
    println!(
        "(durable: every commit synced, SQLite WAL with synchronous=FULL; buffered: SQLite synchronous=OFF)"
    );
}
