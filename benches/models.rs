//! Models at scale, side by side at equal durability: Tito on the embedded engine, the raw
//! engine doing the same key reads and writes (the limit of the model layer), and SQLite through
//! rusqlite (WAL, the same two secondary indexes, the team's ending in the id so that SQLite
//! reads a team's newest in index order as Tito does: the peer a Rust user would pick instead).
//!
//! The table: users with a unique email and a (team, created) index, 20 users per team. Three
//! operations, one task: insert of a new user (one transaction each), read by id, and the 10
//! newest users of a team (a reverse query over the composite index). Every contender
//! serializes and parses the same JSON rows.
//!
//! For each size the three stores are loaded in batches of 1,000 rows per transaction; the reads
//! are measured right after the load, then again once the stores settled (no file of the
//! embedded stores' directories changed for 3 s: the flushes and compactions of the load are
//! done), where inserts are measured too. Every cell runs in four turns per store, the stores
//! taking turns, so that a slow minute of the disk or another store's compaction falls on all.
//!
//! `TITO_BENCH_ONLY=burst`: the load a service gives a new table instead, one row per
//! transaction (20,000 users, `TITO_BENCH_ROWS` sets how many), then 20,000 gets and 2,000
//! "team's 10 newest" queries at once, and the same reads again after 15 s idle
//! (`TITO_BENCH_IDLE_SECS`), Tito beside SQLite at equal durability.
//!
//! `cargo bench --bench models`. `TITO_BENCH_SECS` sets the seconds per cell (default 2),
//! `TITO_BENCH_RAW=0` leaves the raw engine out (Tito and SQLite alone in the process),
//! `TITO_BENCH_ROWS` the sizes (default `20000,200000,1000000`), `TITO_BENCH_NAME_BYTES` the
//! display name's length (default 200 characters). `--features bench-tito-sqlite` runs Tito and
//! the raw columns on the SQLite engine instead of the embedded one. Two more columns, beside
//! the raw engine:
//! the raw engine with key-only index entries (the entry holds the row's id; a query reads the
//! rows in one batch after the entries), and a candidate replacement engine doing the raw
//! engine's reads and writes in the same run: fjall 3 with `--features bench-fjall`, redb 2 (a
//! B-tree) with `--features bench-redb` (one at a time).

use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use rusqlite::{Connection, params};
use serde::{Deserialize, Serialize};
use tito::backend::embedded::Durability;
#[cfg(not(feature = "bench-tito-sqlite"))]
use tito::backend::embedded::{Embedded, EmbeddedOptions};

/// The engine under Tito's and the raw columns: the embedded engine, or with
/// `--features bench-tito-sqlite` the SQLite engine (`tito::backend::sqlite`).
#[cfg(not(feature = "bench-tito-sqlite"))]
type Db = Embedded;
#[cfg(feature = "bench-tito-sqlite")]
type Db = tito::backend::sqlite::Sqlite;

/// The engine's name in the printed lines.
const ENGINE: &str = if cfg!(feature = "bench-tito-sqlite") {
    "sqlite engine"
} else {
    "embedded engine (surrealkv)"
};
use tito::keys::{self, KeyValue};
use tito::model::TitoOptions;
use tito::{TitoEngine, TitoModel, TitoTransaction};

const PER_TEAM: u64 = 20;
const LOAD_BATCH: u64 = 1_000;

#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize, PartialEq)]
#[tito(table = "users")]
#[tito(unique_index = "user_by_email: email")]
#[tito(index = "user_by_team_created: team, created")]
struct User {
    id: String,
    email: String,
    team: String,
    name: String,
    created: i64,
}

fn user(i: u64, teams: u64) -> User {
    let mut name = format!("User number {i}, of a reasonably sized display name");
    let wanted = padding();
    while name.len() < wanted {
        name.push_str(" and more");
    }
    User {
        id: format!("u{i:09}"),
        email: format!("user{i}@example.com"),
        team: format!("team-{:07}", i % teams),
        name,
        created: 1_700_000_000 + i as i64,
    }
}

/// `TITO_BENCH_NAME_BYTES`: the display name's length at least (default 200 characters; 0 keeps
/// the name as it is, about 50 bytes).
fn padding() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| {
        std::env::var("TITO_BENCH_NAME_BYTES")
            .map(|s| s.parse().expect("TITO_BENCH_NAME_BYTES: a byte count"))
            .unwrap_or(200)
    })
}

fn secs() -> Duration {
    let secs = std::env::var("TITO_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0);
    Duration::from_secs_f64(secs)
}

/// `TITO_BENCH_RAW=0` leaves the raw engine's two columns out: Tito and SQLite are then the only
/// stores loaded in the process (with the peer, if one is built in), so no other LSM tree's
/// flushes and compactions share the two cores with Tito's.
fn with_raw() -> bool {
    std::env::var("TITO_BENCH_RAW").map_or(true, |v| v != "0")
}

fn sizes() -> Vec<u64> {
    std::env::var("TITO_BENCH_ROWS")
        .unwrap_or_else(|_| "20000,200000,1000000".into())
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .expect("TITO_BENCH_ROWS: comma-separated row counts")
        })
        .collect()
}

/// Runs `op(i)` for i = 0, 1, .. for the measuring time; returns operations per second.
async fn measure<F, Fut>(op: F) -> f64
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    measure_for(secs(), op).await.rate()
}

/// Operations done and seconds taken.
#[derive(Clone, Copy, Default)]
struct Count(u64, f64);

impl Count {
    fn add(&mut self, other: Count) {
        self.0 += other.0;
        self.1 += other.1;
    }

    /// Operations per second; 0 for a store that was not measured.
    fn rate(self) -> f64 {
        if self.1 > 0.0 {
            self.0 as f64 / self.1
        } else {
            0.0
        }
    }
}

/// Runs `op(0)`, `op(1)`, ... for `time`.
async fn measure_for<F, Fut>(time: Duration, mut op: F) -> Count
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let start = Instant::now();
    let deadline = start + time;
    let mut n = 0;
    while Instant::now() < deadline {
        op(n).await;
        n += 1;
    }
    Count(n, start.elapsed().as_secs_f64())
}

/// Every cell runs in this many turns per store, the stores taking turns, so that a minute of
/// slow disk syncs, or of another store's compaction, falls on all of them.
const TURNS: u64 = 4;

/// A deterministic pseudo-random sequence below `n`.
struct Pick(u64);

impl Pick {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

#[cfg(feature = "bench-tito-sqlite")]
async fn open(dir: &Path, durability: Durability) -> Db {
    let mut options = tito::backend::sqlite::SqliteOptions::new().durability(durability);
    if let Ok(mb) = std::env::var("TITO_BENCH_CACHE_MB") {
        options = options.cache_bytes(mb.parse::<u64>().unwrap() << 20);
    }
    tito::backend::sqlite::Sqlite::open_with(dir, options)
        .await
        .unwrap()
}

#[cfg(not(feature = "bench-tito-sqlite"))]
async fn open(dir: &Path, durability: Durability) -> Db {
    let mut options = EmbeddedOptions::new().durability(durability);
    if let Ok(mb) = std::env::var("TITO_BENCH_CACHE_MB") {
        options = options.block_cache_bytes(mb.parse::<u64>().unwrap() << 20);
    }
    if let Ok(kb) = std::env::var("TITO_BENCH_BLOCK_KB") {
        options = options.block_bytes(kb.parse::<usize>().unwrap() << 10);
    }
    if let Ok(on) = std::env::var("TITO_BENCH_WAL_PREALLOCATION") {
        options = options.wal_preallocation(on == "1");
    }
    if let Ok(mb) = std::env::var("TITO_BENCH_MEMTABLE_MB") {
        options = options.memtable_bytes(mb.parse::<usize>().unwrap() << 20);
    }
    Embedded::open_with(dir, options).await.unwrap()
}

fn sqlite(dir: &Path, durable: bool) -> Connection {
    let conn = Connection::open(dir.join("bench.sqlite")).unwrap();
    conn.pragma_update(None, "journal_mode", "WAL").unwrap();
    conn.pragma_update(None, "synchronous", if durable { "FULL" } else { "NORMAL" })
        .unwrap();
    conn.execute_batch(
        "CREATE TABLE users (id TEXT PRIMARY KEY, email TEXT NOT NULL UNIQUE, team TEXT NOT NULL,
                             created INTEGER NOT NULL, body TEXT NOT NULL);
         CREATE INDEX user_by_team_created ON users (team, created, id);",
    )
    .unwrap();
    conn
}

fn sqlite_insert(conn: &Connection, rows: &[User]) {
    let tx = conn.unchecked_transaction().unwrap();
    {
        let mut stmt = tx
            .prepare_cached(
                "INSERT INTO users (id, email, team, created, body) VALUES (?1, ?2, ?3, ?4, ?5)",
            )
            .unwrap();
        for row in rows {
            stmt.execute(params![
                row.id,
                row.email,
                row.team,
                row.created,
                serde_json::to_string(row).unwrap()
            ])
            .unwrap();
        }
    }
    tx.commit().unwrap();
}

fn sqlite_get(conn: &Connection, id: &str) -> User {
    let body: String = conn
        .prepare_cached("SELECT body FROM users WHERE id = ?1")
        .unwrap()
        .query_row(params![id], |row| row.get(0))
        .unwrap();
    serde_json::from_str(&body).unwrap()
}

fn sqlite_newest(conn: &Connection, team: &str) -> Vec<User> {
    let mut stmt = conn
        .prepare_cached(
            "SELECT body FROM users WHERE team = ?1 ORDER BY created DESC, id DESC LIMIT 10",
        )
        .unwrap();
    stmt.query_map(params![team], |row| row.get::<_, String>(0))
        .unwrap()
        .map(|body| serde_json::from_str(&body.unwrap()).unwrap())
        .collect()
}

/// The keys Tito's layout gives a user: row, manifest, the email claim, the two index entries.
struct UserKeys {
    row: String,
    manifest: String,
    claim: String,
    email: String,
    team: String,
}

fn user_keys(row: &User) -> UserKeys {
    let email = KeyValue::String(row.email.clone());
    let team = KeyValue::String(row.team.clone());
    let created = KeyValue::I64(row.created);
    UserKeys {
        row: keys::row_key("users", &row.id),
        manifest: keys::manifest_key("users", &row.id),
        claim: keys::unique_claim_key("users", "user_by_email", &[("email", &email)]).unwrap(),
        email: keys::index_key("user_by_email", &[("email", &email)], "users", &row.id).unwrap(),
        team: keys::index_key(
            "user_by_team_created",
            &[("team", &team), ("created", &created)],
            "users",
            &row.id,
        )
        .unwrap(),
    }
}

/// What an index entry holds in the raw engine's layout.
#[derive(Clone, Copy, PartialEq)]
enum Entries {
    /// A copy of the row (Tito's layout): a query reads the entries only.
    Clones,
    /// The row's id only: a query reads the entries, then the rows in one batch.
    Keys,
}

/// What the model layer's insert of `row` reads and writes, in the raw layout: the keys read
/// (the row, manifest, catalog and claim; all but the catalog must be absent) and the pairs
/// written (the claim, two entries, the manifest and the row), in that order.
struct RawInsert {
    reads: [Vec<u8>; 4],
    writes: [(Vec<u8>, Vec<u8>); 5],
}

impl RawInsert {
    /// Where the catalog, which may be present, is among the reads.
    const CATALOG: usize = 2;

    fn new(row: &User, entries: Entries) -> RawInsert {
        let k = user_keys(row);
        let body = serde_json::to_vec(row).unwrap();
        let manifest = serde_json::to_vec(&serde_json::json!({
            "v": 1,
            "keys": [&k.email, &k.team, &k.claim],
        }))
        .unwrap();
        let entry = match entries {
            Entries::Clones => body.clone(),
            Entries::Keys => row.id.clone().into_bytes(),
        };
        RawInsert {
            reads: [
                k.row.clone().into_bytes(),
                k.manifest.clone().into_bytes(),
                keys::schema_key("users").into_bytes(),
                k.claim.clone().into_bytes(),
            ],
            writes: [
                (k.claim.into_bytes(), row.id.clone().into_bytes()),
                (k.email.into_bytes(), entry.clone()),
                (k.team.into_bytes(), entry),
                (k.manifest.into_bytes(), manifest),
                (k.row.into_bytes(), body),
            ],
        }
    }

    /// Checks what the reads found: nothing but the catalog.
    fn check_reads<T>(found: impl IntoIterator<Item = Option<T>>) {
        for (i, value) in found.into_iter().enumerate() {
            assert!(
                i == Self::CATALOG || value.is_none(),
                "read {i} found a value"
            );
        }
    }
}

/// The raw engine doing the model layer's reads and writes of an insert: the row, manifest,
/// catalog and claim in one read, then the row, claim, two entries and the manifest.
async fn raw_insert<X: TitoTransaction>(tx: &X, row: &User, entries: Entries) {
    let insert = RawInsert::new(row, entries);
    RawInsert::check_reads(tx.batch_get(&insert.reads).await.unwrap());
    for (key, value) in insert.writes {
        tx.put(key, value).await.unwrap();
    }
}

/// Tito's 10 newest users of a team, checked.
async fn tito_newest(users: &TitoModel<Db, User>, team: &str) {
    let page = users
        .user_by_team_created(team)
        .reverse(true)
        .limit(Some(10))
        .execute()
        .await
        .unwrap();
    assert_eq!(page.items.len(), 10);
    assert!(page.items[0].created > page.items[9].created);
}

async fn raw_get(db: &Db, id: &str) -> User {
    let tx = db.begin().await.unwrap();
    let bytes = tx
        .get(keys::row_key("users", id).as_bytes())
        .await
        .unwrap()
        .unwrap();
    tx.rollback().await.unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

async fn raw_newest(db: &Db, team: &str, entries: Entries) -> Vec<User> {
    let team = KeyValue::String(team.to_string());
    let prefix = keys::index_prefix("users", "user_by_team_created", &[("team", &team)]).unwrap();
    let end = tito::prefix_end(prefix.clone());
    let tx = db.begin().await.unwrap();
    let found = tx
        .scan_reverse(prefix.as_bytes(), end.as_bytes(), 11)
        .await
        .unwrap();
    let found = &found[..found.len().min(10)];
    let rows = match entries {
        Entries::Clones => found.iter().map(|(_, v)| v.clone()).collect(),
        Entries::Keys => {
            let ids: Vec<Vec<u8>> = found
                .iter()
                .map(|(_, id)| {
                    keys::row_key("users", std::str::from_utf8(id).unwrap()).into_bytes()
                })
                .collect();
            let rows = tx.batch_get(&ids).await.unwrap();
            rows.into_iter().map(|row| row.unwrap()).collect::<Vec<_>>()
        }
    };
    tx.rollback().await.unwrap();
    rows.iter()
        .map(|v| serde_json::from_slice(v).unwrap())
        .collect()
}

/// fjall 3 (`OptimisticTxDatabase`, one keyspace, its defaults but a block cache as large as
/// the embedded engine's) doing the raw engine's reads and writes with the same keys, rows and
/// clones (`--features bench-fjall`).
#[cfg(all(feature = "bench-fjall", not(feature = "bench-redb")))]
mod peer {
    use super::*;
    use fjall::Readable;
    use fjall::{KeyspaceCreateOptions, OptimisticTxDatabase, OptimisticTxKeyspace, PersistMode};

    pub const NAME: &str = "fjall";

    pub struct Peer {
        db: OptimisticTxDatabase,
        ks: OptimisticTxKeyspace,
        durable: bool,
    }

    impl Peer {
        pub fn open(dir: &Path, durable: bool) -> Peer {
            let db = OptimisticTxDatabase::builder(dir)
                .cache_size(tito::backend::embedded::DEFAULT_BLOCK_CACHE_BYTES)
                .open()
                .unwrap();
            let ks = db.keyspace("tito", KeyspaceCreateOptions::default).unwrap();
            Peer { db, ks, durable }
        }

        fn write_tx(&self) -> fjall::OptimisticWriteTx {
            let mode = self.durable.then_some(PersistMode::SyncAll);
            self.db.write_tx().unwrap().durability(mode)
        }

        /// The raw insert's reads (row, manifest, catalog, claim) and writes, one transaction
        /// per `rows` slice.
        pub fn insert(&self, rows: &[User]) {
            let mut tx = self.write_tx();
            for row in rows {
                let insert = RawInsert::new(row, Entries::Clones);
                RawInsert::check_reads(
                    insert
                        .reads
                        .iter()
                        .map(|key| tx.get(&self.ks, key).unwrap()),
                );
                for (key, value) in insert.writes {
                    tx.insert(&self.ks, key, value);
                }
            }
            tx.commit().unwrap().unwrap();
        }

        pub fn get(&self, id: &str) -> User {
            let snapshot = self.db.read_tx();
            let bytes = snapshot
                .get(&self.ks, keys::row_key("users", id).as_bytes())
                .unwrap()
                .unwrap();
            serde_json::from_slice(&bytes).unwrap()
        }

        pub fn newest(&self, team: &str) -> Vec<User> {
            let team = KeyValue::String(team.to_string());
            let prefix =
                keys::index_prefix("users", "user_by_team_created", &[("team", &team)]).unwrap();
            let end = tito::prefix_end(prefix.clone());
            let snapshot = self.db.read_tx();
            snapshot
                .range(&self.ks, prefix.into_bytes()..end.into_bytes())
                .rev()
                .take(10)
                .map(|guard| serde_json::from_slice(&guard.into_inner().unwrap().1).unwrap())
                .collect()
        }
    }
}

#[cfg(all(feature = "bench-fjall", feature = "bench-redb"))]
compile_error!("the models benchmark takes one peer store: bench-fjall or bench-redb");

/// redb 2 (a copy-on-write B-tree, one table, a cache as large as the embedded engine's) doing
/// the raw engine's reads and writes with the same keys, rows and clones, one write transaction
/// per insert (`--features bench-redb`). redb has one writer at a time and no conflict check: this
/// column is the B-tree's cost without the optimistic layer Tito would need on top.
#[cfg(feature = "bench-redb")]
mod peer {
    use super::*;
    use redb::{ReadableTable, TableDefinition};

    pub const NAME: &str = "redb";
    const TABLE: TableDefinition<&[u8], &[u8]> = TableDefinition::new("tito");

    pub struct Peer {
        db: redb::Database,
        durable: bool,
    }

    impl Peer {
        pub fn open(dir: &Path, durable: bool) -> Peer {
            let db = redb::Builder::new()
                .set_cache_size(tito::backend::embedded::DEFAULT_BLOCK_CACHE_BYTES as usize)
                .create(dir.join("redb"))
                .unwrap();
            Peer { db, durable }
        }

        /// The raw insert's reads (row, manifest, catalog, claim) and writes, one transaction
        /// per `rows` slice.
        pub fn insert(&self, rows: &[User]) {
            let mut tx = self.db.begin_write().unwrap();
            tx.set_durability(if self.durable {
                redb::Durability::Immediate
            } else {
                redb::Durability::Eventual
            });
            {
                let mut table = tx.open_table(TABLE).unwrap();
                for row in rows {
                    let insert = RawInsert::new(row, Entries::Clones);
                    RawInsert::check_reads(
                        insert
                            .reads
                            .iter()
                            .map(|key| table.get(key.as_slice()).unwrap()),
                    );
                    for (key, value) in &insert.writes {
                        table.insert(key.as_slice(), value.as_slice()).unwrap();
                    }
                }
            }
            tx.commit().unwrap();
        }

        pub fn get(&self, id: &str) -> User {
            let tx = self.db.begin_read().unwrap();
            let table = tx.open_table(TABLE).unwrap();
            let found = table
                .get(keys::row_key("users", id).as_bytes())
                .unwrap()
                .unwrap();
            serde_json::from_slice(found.value()).unwrap()
        }

        pub fn newest(&self, team: &str) -> Vec<User> {
            let team = KeyValue::String(team.to_string());
            let prefix =
                keys::index_prefix("users", "user_by_team_created", &[("team", &team)]).unwrap();
            let end = tito::prefix_end(prefix.clone());
            let tx = self.db.begin_read().unwrap();
            let table = tx.open_table(TABLE).unwrap();
            table
                .range(prefix.as_bytes()..end.as_bytes())
                .unwrap()
                .rev()
                .take(10)
                .map(|entry| serde_json::from_slice(entry.unwrap().1.value()).unwrap())
                .collect()
        }
    }
}

/// Without `--features bench-fjall` or `bench-redb`: no peer column.
#[cfg(not(any(feature = "bench-fjall", feature = "bench-redb")))]
mod peer {
    use super::*;

    pub const NAME: &str = "";

    pub struct Peer;

    impl Peer {
        pub fn open(_: &Path, _: bool) -> Peer {
            Peer
        }
        pub fn insert(&self, _: &[User]) {}
        pub fn get(&self, _: &str) -> User {
            User::default()
        }
        pub fn newest(&self, _: &str) -> Vec<User> {
            Vec::new()
        }
    }
}

/// `a / b` with two decimals, or empty when `b` was not measured.
fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.2}", a / b)
    } else {
        String::new()
    }
}

/// A peer cell: empty without a peer feature.
fn peer_cell(value: f64, decimals: usize) -> String {
    if WITH_PEER {
        format!("{value:.decimals$}")
    } else {
        String::new()
    }
}

/// Whether the run has a peer column (fjall or redb): the peer has a name.
const WITH_PEER: bool = !peer::NAME.is_empty();

/// The total size and latest modification of the files under `dir`, and how many there are.
fn footprint(dir: &Path) -> (u64, Option<SystemTime>, usize) {
    files_under(dir, false)
}

/// [`footprint`] without the embedded engine's write-ahead log (its directory `wal`), whose
/// active segment keeps up to 32 MiB of zeros written ahead while the store is open.
fn data_footprint(dir: &Path) -> (u64, Option<SystemTime>, usize) {
    files_under(dir, true)
}

fn files_under(dir: &Path, skip_log: bool) -> (u64, Option<SystemTime>, usize) {
    let mut bytes = 0;
    let mut latest = None;
    let mut files = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(meta) = entry.metadata() else { continue };
            if meta.is_dir() {
                if !(skip_log && entry.file_name() == "wal") {
                    stack.push(entry.path());
                }
            } else {
                files += 1;
                bytes += meta.len();
                latest = latest.max(meta.modified().ok());
            }
        }
    }
    (bytes, latest, files)
}

/// Waits until no file under `dirs` changed for 3 s (at most 5 min); returns how long it took.
async fn settle(dirs: &[&Path]) -> Duration {
    let start = Instant::now();
    let mut last = Vec::new();
    let mut quiet_since = Instant::now();
    loop {
        let now: Vec<_> = dirs.iter().map(|d| footprint(d)).collect();
        if now != last {
            last = now;
            quiet_since = Instant::now();
        } else if quiet_since.elapsed() >= Duration::from_secs(3) {
            return quiet_since.duration_since(start);
        }
        if start.elapsed() > Duration::from_secs(300) {
            return start.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[derive(Default)]
struct Rates {
    tito: f64,
    raw: f64,
    /// The raw engine with key-only index entries.
    keys: f64,
    /// The peer store with the raw engine's layout (`--features bench-fjall` or `bench-redb`;
    /// 0 without).
    peer: f64,
    sqlite: f64,
}

impl Rates {
    /// Tito, raw, raw with keys, the peer (left at 0 without one) and SQLite, from their counts.
    fn of([tito, raw, keys, peer, sqlite]: [Count; 5]) -> Rates {
        Rates {
            tito: tito.rate(),
            raw: raw.rate(),
            keys: keys.rate(),
            peer: if WITH_PEER { peer.rate() } else { 0.0 },
            sqlite: sqlite.rate(),
        }
    }
}

struct Line {
    rows: u64,
    operation: &'static str,
    rates: Rates,
}

struct Reads {
    get: Rates,
    newest: Rates,
}

struct Stores {
    db: Db,
    users: TitoModel<Db, User>,
    raw: Db,
    /// The raw engine with key-only index entries.
    keys: Db,
    peer: peer::Peer,
    /// Behind a mutex only so the stores can be shared with a spawned task (never contended).
    conn: std::sync::Mutex<Connection>,
    rows: u64,
    teams: u64,
}

impl Stores {
    /// Tito, the raw engine (clones, key-only entries), SQLite and the peer store in `dirs` (in that
    /// order), empty, for `rows` rows.
    async fn open(dirs: &[tempfile::TempDir; 5], durability: Durability, rows: u64) -> Stores {
        let db = open(dirs[0].path(), durability).await;
        Stores {
            users: db.clone().model::<User>(),
            db,
            raw: open(dirs[1].path(), durability).await,
            keys: open(dirs[2].path(), durability).await,
            peer: peer::Peer::open(dirs[4].path(), durability == Durability::Immediate),
            conn: std::sync::Mutex::new(sqlite(
                dirs[3].path(),
                durability == Durability::Immediate,
            )),
            rows,
            teams: (rows / PER_TEAM).max(1),
        }
    }

    /// Gets and team queries on every store, in [`TURNS`] turns per store, the stores taking
    /// turns.
    async fn reads(&self, pick: &mut Pick) -> Reads {
        let (rows, teams) = (self.rows, self.teams);
        let slice = secs() / TURNS as u32;
        let [mut get, mut newest] = [[Count::default(); 5]; 2];
        for _ in 0..TURNS {
            get[0].add(
                measure_for(slice, |_| {
                    let id = user(pick.below(rows), teams).id;
                    async move {
                        assert_eq!(self.users.find_by_id(&id, vec![]).await.unwrap().id, id);
                    }
                })
                .await,
            );
            for (at, db) in [(1, &self.raw), (2, &self.keys)]
                .into_iter()
                .filter(|_| with_raw())
            {
                get[at].add(
                    measure_for(slice, |_| {
                        let id = user(pick.below(rows), teams).id;
                        async move { assert_eq!(raw_get(db, &id).await.id, id) }
                    })
                    .await,
                );
            }
            if WITH_PEER {
                get[3].add(
                    measure_for(slice, |_| {
                        let id = user(pick.below(rows), teams).id;
                        assert_eq!(self.peer.get(&id).id, id);
                        async {}
                    })
                    .await,
                );
            }
            get[4].add(
                measure_for(slice, |_| {
                    let id = user(pick.below(rows), teams).id;
                    assert_eq!(sqlite_get(&self.conn.lock().unwrap(), &id).id, id);
                    async {}
                })
                .await,
            );
        }
        for _ in 0..TURNS {
            newest[0].add(
                measure_for(slice, |_| {
                    let team = user(pick.below(teams), teams).team;
                    async move { tito_newest(&self.users, &team).await }
                })
                .await,
            );
            let raw = [
                (1, &self.raw, Entries::Clones),
                (2, &self.keys, Entries::Keys),
            ];
            for (at, db, entries) in raw.into_iter().filter(|_| with_raw()) {
                newest[at].add(
                    measure_for(slice, |_| {
                        let team = user(pick.below(teams), teams).team;
                        async move { assert_eq!(raw_newest(db, &team, entries).await.len(), 10) }
                    })
                    .await,
                );
            }
            if WITH_PEER {
                newest[3].add(
                    measure_for(slice, |_| {
                        let team = user(pick.below(teams), teams).team;
                        assert_eq!(self.peer.newest(&team).len(), 10);
                        async {}
                    })
                    .await,
                );
            }
            newest[4].add(
                measure_for(slice, |_| {
                    let team = user(pick.below(teams), teams).team;
                    assert_eq!(sqlite_newest(&self.conn.lock().unwrap(), &team).len(), 10);
                    async {}
                })
                .await,
            );
        }
        Reads {
            get: Rates::of(get),
            newest: Rates::of(newest),
        }
    }

    async fn inserts(&self) -> Rates {
        // Fresh ids past the loaded rows, in teams that exist, a million apart per turn.
        let (rows, teams) = (self.rows, self.teams);
        let slice = secs() / TURNS as u32;
        let [mut tito, mut raw, mut keys, mut peer, mut sqlite] = [Count::default(); 5];
        for turn in 0..TURNS {
            let from = rows + turn * 1_000_000;
            tito.add(
                measure_for(slice, |i| async move {
                    self.users.build(user(from + i, teams)).await.unwrap();
                })
                .await,
            );
            let base = from + 10_000_000;
            if with_raw() {
                raw.add(raw_inserts(slice, &self.raw, Entries::Clones, base, teams).await);
                keys.add(raw_inserts(slice, &self.keys, Entries::Keys, base, teams).await);
            }
            if WITH_PEER {
                let base = from + 30_000_000;
                peer.add(
                    measure_for(slice, |i| {
                        self.peer.insert(&[user(base + i, teams)]);
                        async {}
                    })
                    .await,
                );
            }
            let base = from + 20_000_000;
            sqlite.add(
                measure_for(slice, |i| {
                    sqlite_insert(&self.conn.lock().unwrap(), &[user(base + i, teams)]);
                    async {}
                })
                .await,
            );
        }
        Rates::of([tito, raw, keys, peer, sqlite])
    }
}

/// The raw engine's inserts for `time`, ids from `base` on.
async fn raw_inserts(time: Duration, db: &Db, entries: Entries, base: u64, teams: u64) -> Count {
    measure_for(time, |i| async move {
        let row = user(base + i, teams);
        db.transaction(|tx| {
            let row = row.clone();
            async move {
                raw_insert(&tx, &row, entries).await;
                Ok::<(), tito::TitoError>(())
            }
        })
        .await
        .unwrap();
    })
    .await
}

/// Loads the rows into every store (only Tito's with `only_tito`); the load rates.
/// The process's resident memory (KiB, from `/proc/self/status`; 0 where there is none).
fn resident_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

async fn load(stores: &Stores, only_tito: bool) -> Rates {
    let (rows, teams) = (stores.rows, stores.teams);
    let resident_before = resident_kib();
    let batches = rows.div_ceil(LOAD_BATCH);
    let batch = |b: u64| -> Vec<User> {
        (b * LOAD_BATCH..((b + 1) * LOAD_BATCH).min(rows))
            .map(|i| user(i, teams))
            .collect()
    };
    let start = Instant::now();
    for b in 0..batches {
        let rows = batch(b);
        let users = stores.users.clone();
        stores
            .db
            .transaction(|tx| {
                let (rows, users) = (rows.clone(), users.clone());
                async move {
                    for row in rows {
                        users
                            .build_with_options(row, TitoOptions::default(), &tx)
                            .await?;
                    }
                    Ok::<(), tito::TitoError>(())
                }
            })
            .await
            .unwrap();
    }
    let tito = rows as f64 / start.elapsed().as_secs_f64();
    let tito_grew = resident_kib().saturating_sub(resident_before);
    if only_tito {
        return Rates {
            tito,
            ..Rates::default()
        };
    }
    let mut raw_rates = [0.0; 2];
    let raw = [
        (&stores.raw, Entries::Clones),
        (&stores.keys, Entries::Keys),
    ];
    for (rate, (db, entries)) in raw_rates.iter_mut().zip(raw).filter(|_| with_raw()) {
        let start = Instant::now();
        for b in 0..batches {
            let rows = batch(b);
            db.transaction(|tx| {
                let rows = rows.clone();
                async move {
                    for row in &rows {
                        raw_insert(&tx, row, entries).await;
                    }
                    Ok::<(), tito::TitoError>(())
                }
            })
            .await
            .unwrap();
        }
        *rate = rows as f64 / start.elapsed().as_secs_f64();
    }
    let (start, sqlite_before) = (Instant::now(), resident_kib());
    for b in 0..batches {
        sqlite_insert(&stores.conn.lock().unwrap(), &batch(b));
    }
    let sqlite = rows as f64 / start.elapsed().as_secs_f64();
    // The resident memory each load added to the process: a store's caches and buffers as it
    // filled. Indicative only: the allocator hands a later load what an earlier one freed, so
    // the later store's figure can be low.
    println!(
        "  resident memory added by the load: tito {:.1} MiB, sqlite {:.1} MiB",
        tito_grew as f64 / 1024.0,
        resident_kib().saturating_sub(sqlite_before) as f64 / 1024.0
    );
    let mut peer = 0.0;
    if WITH_PEER {
        let start = Instant::now();
        for b in 0..batches {
            stores.peer.insert(&batch(b));
        }
        peer = rows as f64 / start.elapsed().as_secs_f64();
    }
    Rates {
        tito,
        raw: raw_rates[0],
        keys: raw_rates[1],
        peer,
        sqlite,
    }
}

async fn run(durability: Durability, rows: u64, lines: &mut Vec<Line>) {
    let label = match durability {
        Durability::Immediate => "durable",
        _ => "buffered",
    };
    let dirs = [(); 5].map(|_| tempfile::tempdir().unwrap());
    let stores = Stores::open(&dirs, durability, rows).await;
    let loaded = load(&stores, false).await;
    println!(
        "  {label} {rows} rows loaded (rows/s, batches of {LOAD_BATCH}): tito {:.0}, raw {:.0}, raw key-only {:.0}, sqlite {:.0}, {} {:.0}",
        loaded.tito,
        loaded.raw,
        loaded.keys,
        loaded.sqlite,
        peer::NAME,
        loaded.peer
    );
    let mut pick = Pick(rows);
    let fresh = stores.reads(&mut pick).await;
    let took = settle(&[
        dirs[0].path(),
        dirs[1].path(),
        dirs[2].path(),
        dirs[4].path(),
    ])
    .await;
    let (tito_bytes, _, tito_files) = data_footprint(dirs[0].path());
    let (raw_bytes, _, _) = data_footprint(dirs[1].path());
    let (keys_bytes, _, _) = data_footprint(dirs[2].path());
    let (sqlite_bytes, _, _) = footprint(dirs[3].path());
    let (peer_bytes, _, _) = footprint(dirs[4].path());
    println!(
        "  {label} {rows} rows settled in {:.1} s; on disk (the embedded stores' logs left out): tito {:.1} MiB in {tito_files} files ({} bytes per user; sqlite {}), raw {:.1} MiB, raw key-only {:.1} MiB, sqlite {:.1} MiB, {} {:.1} MiB",
        took.as_secs_f64(),
        tito_bytes as f64 / 1048576.0,
        tito_bytes / rows,
        sqlite_bytes / rows,
        raw_bytes as f64 / 1048576.0,
        keys_bytes as f64 / 1048576.0,
        sqlite_bytes as f64 / 1048576.0,
        peer::NAME,
        peer_bytes as f64 / 1048576.0,
    );
    let settled = stores.reads(&mut pick).await;
    let inserts = stores.inserts().await;
    lines.extend([
        Line {
            rows,
            operation: "insert",
            rates: inserts,
        },
        Line {
            rows,
            operation: "get by id, after load",
            rates: fresh.get,
        },
        Line {
            rows,
            operation: "get by id, settled",
            rates: settled.get,
        },
        Line {
            rows,
            operation: "team's 10 newest, after load",
            rates: fresh.newest,
        },
        Line {
            rows,
            operation: "team's 10 newest, settled",
            rates: settled.newest,
        },
    ]);
    stores.db.close().await.unwrap();
    stores.raw.close().await.unwrap();
    stores.keys.close().await.unwrap();
}

/// `TITO_BENCH_PROFILE=insert|get|newest|get-raw|newest-raw|oldest-raw`: runs only that
/// operation on Tito (the `-raw` ones: the raw engine's reads on Tito's store; `oldest-raw` the
/// team's entries read forward) over
/// `TITO_BENCH_ROWS`'s first size (`TITO_BENCH_DURABLE=1` for durable commits) for the measuring
/// time, for a profiler. Only Tito's store is loaded, unless `TITO_BENCH_PROFILE_ALL=1` loads
/// every store first, as the measured run does.
async fn profile(what: &str) {
    let rows = sizes()[0];
    let durability = match std::env::var("TITO_BENCH_DURABLE").as_deref() {
        Ok("1") => Durability::Immediate,
        _ => Durability::Buffered,
    };
    let dirs = [(); 5].map(|_| tempfile::tempdir().unwrap());
    let stores = Stores::open(&dirs, durability, rows).await;
    load(&stores, std::env::var("TITO_BENCH_PROFILE_ALL").is_err()).await;
    eprintln!("loaded");
    settle(&[dirs[0].path(), dirs[1].path(), dirs[2].path()]).await;
    let mut pick = Pick(1);
    let (teams, users) = (stores.teams, &stores.users);
    let rate =
        match what {
            "insert" => {
                measure(|i| async move {
                    users.build(user(rows + i, teams)).await.unwrap();
                })
                .await
            }
            "get" => {
                measure(|_| {
                    let id = user(pick.below(rows), teams).id;
                    async move { assert_eq!(users.find_by_id(&id, vec![]).await.unwrap().id, id) }
                })
                .await
            }
            "newest" => {
                measure(|_| {
                    let team = user(pick.below(teams), teams).team;
                    async move { tito_newest(users, &team).await }
                })
                .await
            }
            // The raw engine's reads on Tito's own store: Tito's overhead without the spread
            // between two stores.
            "get-raw" => {
                measure(|_| {
                    let id = user(pick.below(rows), teams).id;
                    let db = &stores.db;
                    async move { assert_eq!(raw_get(db, &id).await.id, id) }
                })
                .await
            }
            "newest-raw" => measure(|_| {
                let team = user(pick.below(teams), teams).team;
                let db = &stores.db;
                async move { assert_eq!(raw_newest(db, &team, Entries::Clones).await.len(), 10) }
            })
            .await,
            // The same entries read forward: what the reverse direction costs the engine.
            "oldest-raw" => {
                measure(|_| {
                    let team = user(pick.below(teams), teams).team;
                    let db = &stores.db;
                    async move {
                        let team = KeyValue::String(team);
                        let prefix =
                            keys::index_prefix("users", "user_by_team_created", &[("team", &team)])
                                .unwrap();
                        let end = tito::prefix_end(prefix.clone());
                        let tx = db.begin().await.unwrap();
                        let found = tx
                            .scan(prefix.as_bytes(), end.as_bytes(), 11)
                            .await
                            .unwrap();
                        tx.rollback().await.unwrap();
                        let rows: Vec<User> = found[..10]
                            .iter()
                            .map(|(_, v)| serde_json::from_slice(v).unwrap())
                            .collect();
                        assert_eq!(rows.len(), 10);
                    }
                })
                .await
            }
            other => panic!("TITO_BENCH_PROFILE: unknown operation {other:?}"),
        };
    println!("{what}: {rate:.0} per second");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // Everything runs in a task of the runtime, as the handlers of a server do: a commit of the
    // embedded engine wakes its group-commit task, and from a thread outside the runtime (this
    // main function's own) each wake-up crosses threads (about half the insert rate here).
    // `TITO_BENCH_ONLY=burst TITO_BENCH_IN_MAIN=1`: the burst from the main function's own
    // thread, as a `#[tokio::main]` body without a spawned task runs it.
    if std::env::var("TITO_BENCH_IN_MAIN").is_ok() {
        return burst().await;
    }
    tokio::spawn(bench()).await.unwrap();
}

async fn bench() {
    if let Ok(what) = std::env::var("TITO_BENCH_PROFILE") {
        return profile(&what).await;
    }
    if std::env::var("TITO_BENCH_ONLY").as_deref() == Ok("burst") {
        return burst().await;
    }
    println!(
        "models on the {ENGINE}: users with a unique email and a (team, created) index, \
         {PER_TEAM} per team, names of {} characters; operations per second, one task, {:?} per \
         cell",
        padding(),
        secs()
    );
    let sizes = sizes();
    for (label, durability) in [
        ("buffered", Durability::Buffered),
        ("durable", Durability::Immediate),
    ] {
        let mut lines = Vec::new();
        for &rows in &sizes {
            run(durability, rows, &mut lines).await;
        }
        println!(
            "{:<9} {:>8} {:<30} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9} {:>11} {:>9} {:>9}",
            "",
            "rows",
            "operation",
            "tito",
            "raw",
            "raw keys",
            "sqlite",
            "/raw",
            "/sqlite",
            "/smallest",
            "keys/clones",
            peer::NAME,
            if WITH_PEER {
                format!("{}/raw", peer::NAME)
            } else {
                String::new()
            },
        );
        for line in &lines {
            let smallest = lines
                .iter()
                .find(|l| l.operation == line.operation)
                .map(|l| line.rates.tito / l.rates.tito)
                .unwrap_or(1.0);
            println!(
                "{:<9} {:>8} {:<30} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>8} {:>8.2} {:>9.2} {:>11} {:>9} {:>9}",
                label,
                line.rows,
                line.operation,
                line.rates.tito,
                line.rates.raw,
                line.rates.keys,
                line.rates.sqlite,
                ratio(line.rates.tito, line.rates.raw),
                line.rates.tito / line.rates.sqlite,
                smallest,
                ratio(line.rates.keys, line.rates.raw),
                peer_cell(line.rates.peer, 0),
                peer_cell(line.rates.peer / line.rates.raw, 2),
            );
        }
    }
    println!(
        "(durable: every commit synced, SQLite WAL with synchronous=FULL; buffered: commits reach \
         the OS, SQLite WAL with synchronous=NORMAL. /smallest: Tito's rate over its rate at the \
         smallest size. raw keys: the raw engine with key-only index entries, a query reading \
         the rows in one batch after the entries; keys/clones: its rate over the raw engine's \
         with the row copied into each entry, Tito's layout. The last columns: fjall 3 \
         (--features bench-fjall) or redb 2 (--features bench-redb) with the raw engine's keys \
         and clones.)"
    );
}

/// One-row transactions as a service writes a new table, then reads right after the burst and
/// after an idle pause; Tito and SQLite at equal durability, rates in operations per second.
async fn burst() {
    let rows: u64 = std::env::var("TITO_BENCH_ROWS")
        .ok()
        .and_then(|s| s.split(',').next().and_then(|n| n.parse().ok()))
        .unwrap_or(20_000);
    let idle = Duration::from_secs(
        std::env::var("TITO_BENCH_IDLE_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(15),
    );
    let teams = (rows / PER_TEAM).max(1);
    let gets = rows;
    let queries = (rows / 10).max(1);
    println!(
        "burst on the {ENGINE}: {rows} users inserted one per transaction, then {gets} gets and \
         {queries} team queries at once and after {idle:?} idle; operations per second"
    );
    println!(
        "{:<9} {:<28} {:>10} {:>10} {:>8}",
        "", "operation", "tito", "sqlite", "ratio"
    );
    for (label, durability) in [
        ("buffered", Durability::Buffered),
        ("durable", Durability::Immediate),
    ] {
        let (tito_dir, sql_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let db = open(tito_dir.path(), durability).await;
        let users = db.clone().model::<User>();
        let conn = sqlite(sql_dir.path(), durability == Durability::Immediate);
        let all: Vec<User> = (0..rows).map(|i| user(i, teams)).collect();
        let start = Instant::now();
        for row in &all {
            users.build(row.clone()).await.unwrap();
        }
        let tito_insert = rows as f64 / start.elapsed().as_secs_f64();
        let start = Instant::now();
        for row in &all {
            sqlite_insert(&conn, std::slice::from_ref(row));
        }
        let sql_insert = rows as f64 / start.elapsed().as_secs_f64();
        println!(
            "{label:<9} {:<28} {tito_insert:>10.0} {sql_insert:>10.0} {:>8}",
            "insert (1 row per tx)",
            ratio(tito_insert, sql_insert)
        );
        for when in ["right after", "after idle"] {
            if when == "after idle" {
                tokio::time::sleep(idle).await;
            }
            let mut rng = 0x2545_f491_4f6c_dd1du64;
            let mut next = move |n: u64| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng % n
            };
            let ids: Vec<String> = (0..gets).map(|_| format!("u{:09}", next(rows))).collect();
            let team_names: Vec<String> = (0..queries)
                .map(|_| format!("team-{:07}", next(teams)))
                .collect();
            let start = Instant::now();
            for id in &ids {
                let found = users.find_by_id(id, vec![]).await.unwrap();
                assert_eq!(&found.id, id);
            }
            let tito_get = gets as f64 / start.elapsed().as_secs_f64();
            let start = Instant::now();
            for id in &ids {
                assert_eq!(&sqlite_get(&conn, id).id, id);
            }
            let sql_get = gets as f64 / start.elapsed().as_secs_f64();
            let start = Instant::now();
            for team in &team_names {
                tito_newest(&users, team).await;
            }
            let tito_team = queries as f64 / start.elapsed().as_secs_f64();
            // The same queries all issued together from one task (a server answering a burst
            // of requests).
            let start = Instant::now();
            futures::future::join_all(team_names.iter().map(|team| tito_newest(&users, team)))
                .await;
            let tito_team_together = queries as f64 / start.elapsed().as_secs_f64();
            let start = Instant::now();
            let users_ref = &users;
            futures::future::join_all(ids.iter().map(|id| async move {
                let found = users_ref.find_by_id(id, vec![]).await.unwrap();
                assert_eq!(&found.id, id);
            }))
            .await;
            let tito_get_together = gets as f64 / start.elapsed().as_secs_f64();
            let start = Instant::now();
            for team in &team_names {
                assert_eq!(sqlite_newest(&conn, team).len(), 10);
            }
            let sql_team = queries as f64 / start.elapsed().as_secs_f64();
            println!(
                "{label:<9} {:<28} {tito_get:>10.0} {sql_get:>10.0} {:>8}",
                format!("get, {when}"),
                ratio(tito_get, sql_get)
            );
            println!(
                "{label:<9} {:<28} {tito_team:>10.0} {sql_team:>10.0} {:>8}",
                format!("team's 10 newest, {when}"),
                ratio(tito_team, sql_team)
            );
            println!(
                "{label:<9} {:<28} {tito_get_together:>10.0} {sql_get:>10.0} {:>8}",
                format!("get together, {when}"),
                ratio(tito_get_together, sql_get)
            );
            println!(
                "{label:<9} {:<28} {tito_team_together:>10.0} {sql_team:>10.0} {:>8}",
                format!("team together, {when}"),
                ratio(tito_team_together, sql_team)
            );
        }
        db.close().await.unwrap();
    }
}
