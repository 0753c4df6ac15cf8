//! A process that is killed with SIGKILL loses nothing it committed and leaves nothing it did
//! not commit. The child is this test binary itself, started with `crash_child` selected.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tito::backend::embedded::{Durability, Embedded, EmbeddedOptions};
use tito::{TitoEngine, TitoError, TitoTransaction};

const DIR_VAR: &str = "TITO_CRASH_CHILD_DIR";
const MODE_VAR: &str = "TITO_CRASH_CHILD_MODE";
const KEYS_PER_TX: usize = 4;

fn options(mode: &str) -> EmbeddedOptions {
    let durability = if mode == "buffered" {
        Durability::Buffered
    } else {
        Durability::Immediate
    };
    EmbeddedOptions::new()
        .durability(durability)
        .memtable_bytes(1024 * 1024)
}

fn row_key(i: u64, part: usize) -> Vec<u8> {
    format!("k:{i:08}:{part}").into_bytes()
}

/// The child: commits four-key transactions forever, reporting each after it returned, while
/// holding a transaction that never commits. Does nothing unless started by `crash_run`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "started as a child process by the crash tests"]
async fn crash_child() {
    let (Ok(dir), Ok(mode)) = (std::env::var(DIR_VAR), std::env::var(MODE_VAR)) else {
        return;
    };
    let db = Embedded::open_with(&dir, options(&mode)).await.unwrap();
    let open = db.begin().await.unwrap();
    for i in 0u64.. {
        if i % 16 == 0 {
            open.put(
                format!("uncommitted:{i:08}").into_bytes(),
                b"never".to_vec(),
            )
            .await
            .unwrap();
        }
        let version = db
            .transaction(|tx| async move {
                for part in 0..KEYS_PER_TX {
                    tx.put(row_key(i, part), i.to_string().into_bytes()).await?;
                }
                Ok::<_, TitoError>(tx.start_version())
            })
            .await
            .unwrap();
        println!("committed {i} {version}");
    }
}

async fn crash_run(mode: &str, commits_before_kill: u64) {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "crash::crash_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(DIR_VAR, dir.path())
        .env(MODE_VAR, mode)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut reported: Vec<(u64, u64)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix("committed ") {
            let mut parts = rest.split(' ').map(|p| p.parse::<u64>().unwrap());
            reported.push((parts.next().unwrap(), parts.next().unwrap()));
            if reported.len() as u64 >= commits_before_kill {
                break;
            }
        }
        assert!(Instant::now() < deadline, "the child committed too slowly");
    }
    assert_eq!(
        reported.len() as u64,
        commits_before_kill,
        "the child stopped early"
    );
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();

    let db = Embedded::open_with(dir.path(), options(mode))
        .await
        .unwrap();
    let tx = db.begin().await.unwrap();

    // Every reported commit is there, whole.
    for (i, _) in &reported {
        for part in 0..KEYS_PER_TX {
            let value = tx.get(&row_key(*i, part)).await.unwrap();
            assert_eq!(
                value,
                Some(i.to_string().into_bytes()),
                "commit {i} lost key {part} ({mode})"
            );
        }
    }
    // Whatever else is there (commits that finished before the kill but were not reported yet)
    // is whole too: no transaction is half applied.
    let mut from = b"k:".to_vec();
    let mut per_tx = std::collections::BTreeMap::<String, usize>::new();
    loop {
        let page = tx.scan(&from, b"k;", 1000).await.unwrap();
        let Some((last, _)) = page.last() else { break };
        from = tito::keys::key_after_bytes(last);
        for (key, _) in page {
            let key = String::from_utf8(key).unwrap();
            *per_tx.entry(key[..10].to_string()).or_default() += 1;
        }
    }
    assert!(per_tx.len() >= reported.len());
    assert!(
        per_tx.values().all(|n| *n == KEYS_PER_TX),
        "a transaction was half applied"
    );
    // Nothing of the transaction that never committed.
    assert!(
        tx.scan(b"uncommitted:", b"uncommitted;", 10)
            .await
            .unwrap()
            .is_empty()
    );

    // Versions go on increasing after the restart.
    let last_version = reported.iter().map(|(_, v)| *v).max().unwrap();
    assert!(tx.start_version() > last_version);
    tx.rollback().await.unwrap();

    // And the store takes writes again.
    db.transaction(|tx| async move { tx.put(b"after".to_vec(), b"1".to_vec()).await })
        .await
        .unwrap();
    db.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_commits_survive_sigkill() {
    crash_run("durable", 150).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_commits_survive_a_process_crash() {
    crash_run("buffered", 400).await;
}
