//! What only the embedded engine promises: its options, its directory, its safe point.

use std::time::Duration;

use tito::backend::embedded::{Embedded, EmbeddedOptions};
use tito::{TitoEngine, TitoError, TitoTransaction};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_safe_point_only_moves_forward() {
    let db = Embedded::temporary().await.unwrap();
    let recent = db.garbage_collect(Duration::from_secs(60)).await.unwrap();
    // A longer window asks for an older safe point: the newer one stays in effect.
    let older = db.garbage_collect(Duration::from_secs(3600)).await.unwrap();
    assert_eq!(older, recent);
    // Racing collections never move it back either.
    let mut handles = Vec::new();
    for i in 0..8u64 {
        let db = db.clone();
        handles.push(tokio::spawn(async move {
            db.garbage_collect(Duration::from_secs(1 + i * 600))
                .await
                .unwrap()
        }));
    }
    for handle in handles {
        assert!(handle.await.unwrap() >= recent);
    }
    let last = db.garbage_collect(Duration::from_secs(7200)).await.unwrap();
    assert!(last >= recent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_safe_point_survives_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let db = Embedded::open(dir.path()).await.unwrap();
    let safe = db.garbage_collect(Duration::from_secs(1)).await.unwrap();
    db.close().await.unwrap();
    drop(db);
    let db = Embedded::open(dir.path()).await.unwrap();
    assert_eq!(
        db.garbage_collect(Duration::from_secs(86_400))
            .await
            .unwrap(),
        safe
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_temporary_store_removes_its_directory() {
    let db = Embedded::temporary().await.unwrap();
    let path = db.path().to_path_buf();
    db.transaction(|tx| async move { tx.put(b"k".to_vec(), b"v".to_vec()).await })
        .await
        .unwrap();
    assert!(path.exists());
    db.close().await.unwrap();
    drop(db);
    assert!(!path.exists(), "{} is still there", path.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_options_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for options in [
        EmbeddedOptions::new().partitions(0),
        EmbeddedOptions::new().partitions(10_001),
        EmbeddedOptions::new().memtable_bytes(1024),
        EmbeddedOptions::new().block_cache_bytes(0),
        EmbeddedOptions::new().block_cache_bytes((1 << 20) - 1),
        EmbeddedOptions::new().block_cache_bytes((1 << 40) + 1),
        EmbeddedOptions::new().block_cache_bytes(u64::MAX),
        EmbeddedOptions::new().block_bytes(0),
        EmbeddedOptions::new().block_bytes(1023),
        EmbeddedOptions::new().block_bytes((1 << 20) + 1),
        EmbeddedOptions::new().block_bytes(usize::MAX),
    ] {
        let result = Embedded::open_with(dir.path(), options).await;
        assert!(
            matches!(result, Err(TitoError::InvalidArgument(_))),
            "got {result:?}"
        );
    }
    let db = Embedded::open_with(dir.path(), EmbeddedOptions::new().partitions(1024))
        .await
        .unwrap();
    assert_eq!(db.partitions(), 1024);
    db.close().await.unwrap();
    drop(db);

    // The smallest cache and blocks and the largest blocks work: rows written through them
    // (enough to reach table files) read back after a reopen.
    for options in [
        EmbeddedOptions::new()
            .block_cache_bytes(1 << 20)
            .block_bytes(1 << 10),
        EmbeddedOptions::new()
            .block_cache_bytes(1 << 40)
            .block_bytes(1 << 20),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let options = options.memtable_bytes(64 * 1024);
        let db = Embedded::open_with(dir.path(), options.clone())
            .await
            .unwrap();
        for batch in 0..20u32 {
            let tx = db.begin().await.unwrap();
            for i in 0..100u32 {
                let key = format!("k{:05}", batch * 100 + i).into_bytes();
                tx.put(key, vec![b'v'; 200]).await.unwrap();
            }
            tx.commit().await.unwrap();
        }
        db.close().await.unwrap();
        drop(db);
        let db = Embedded::open_with(dir.path(), options).await.unwrap();
        let tx = db.begin().await.unwrap();
        assert_eq!(tx.get(b"k01234").await.unwrap(), Some(vec![b'v'; 200]));
        let all = tx.scan(b"k", b"l", 1000).await.unwrap();
        assert_eq!(all.len(), 1000);
        let all = tx.scan(b"k01000", b"l", 1000).await.unwrap();
        assert_eq!(all.len(), 1000);
        assert_eq!(all[0].0, b"k01000".to_vec());
    }
}

/// The bytes of the files under the store's write-ahead log directory.
fn wal_bytes(dir: &std::path::Path) -> u64 {
    let wal = dir.join("wal");
    assert!(wal.is_dir(), "no log directory at {}", wal.display());
    std::fs::read_dir(&wal)
        .unwrap()
        .map(|entry| entry.unwrap().metadata().unwrap())
        .filter(|meta| meta.is_file())
        .map(|meta| meta.len())
        .sum()
}

/// With preallocation (the default) the open log holds zeros ahead of its records and a clean
/// close cuts them; without it the log is as long as its records. A store written one way
/// opens and keeps its rows the other way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_preallocates_until_it_closes() {
    let dir = tempfile::tempdir().unwrap();
    let write = |db: Embedded, from: u32| async move {
        for i in from..from + 20 {
            db.transaction(|tx| async move {
                tx.put(format!("k{i:03}").into_bytes(), vec![b'v'; 100])
                    .await
            })
            .await
            .unwrap();
        }
    };
    let db = Embedded::open(dir.path()).await.unwrap();
    write(db.clone(), 0).await;
    let open = wal_bytes(dir.path());
    assert!(open >= 16 << 20, "the open log holds {open} bytes");
    db.close().await.unwrap();
    drop(db);
    let closed = wal_bytes(dir.path());
    assert!(closed < 1 << 20, "the closed log holds {closed} bytes");

    let appending = EmbeddedOptions::new().wal_preallocation(false);
    let db = Embedded::open_with(dir.path(), appending.clone())
        .await
        .unwrap();
    write(db.clone(), 20).await;
    let open = wal_bytes(dir.path());
    assert!(open < 1 << 20, "the appending log holds {open} bytes");
    db.close().await.unwrap();
    drop(db);

    for options in [EmbeddedOptions::new(), appending] {
        let db = Embedded::open_with(dir.path(), options).await.unwrap();
        let tx = db.begin().await.unwrap();
        let rows = tx.scan(b"k", b"l", 100).await.unwrap();
        assert_eq!(rows.len(), 40);
        assert_eq!(rows[39].0, b"k039".to_vec());
        tx.rollback().await.unwrap();
        db.close().await.unwrap();
    }
}
