//! The storage contract on the SQLite engine.

crate::conformance_suite!(crate::support::SqliteBackend);

use tito::backend::sqlite::Sqlite;
use tito::{TitoEngine, TitoTransaction};

/// A store survives a close and a reopen (data, and versions that keep increasing), refuses a
/// second open in this process while open, and refuses every call once closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_store_reopens_with_its_data_and_clock_and_has_one_owner() {
    let dir = tempfile::tempdir().unwrap();
    let db = Sqlite::open(dir.path()).await.unwrap();
    db.transaction(|tx| async move { tx.put(b"k".to_vec(), b"v".to_vec()).await })
        .await
        .unwrap();
    let before = db.current_version().await.unwrap();
    match Sqlite::open(dir.path()).await {
        Err(err) => assert!(
            err.to_string().contains("already open in this process"),
            "{err}"
        ),
        Ok(_) => panic!("a second open in this process was accepted"),
    }
    db.close().await.unwrap();
    assert!(db.begin().await.is_err(), "a closed store refuses work");
    db.close().await.unwrap();
    drop(db);

    let db = Sqlite::open(dir.path()).await.unwrap();
    let tx = db.begin().await.unwrap();
    assert!(
        tx.start_version() > before,
        "versions continue after a reopen"
    );
    assert_eq!(tx.get(b"k").await.unwrap().as_deref(), Some(&b"v"[..]));
    tx.rollback().await.unwrap();
    assert!(Sqlite::is_store(dir.path()));
    db.close().await.unwrap();
}

/// Deletes conflict like writes while a snapshot older than them is open, also after many
/// tombstones were purged around it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_conflicts_with_an_older_writer_across_tombstone_purges() {
    let db = Sqlite::temporary().await.unwrap();
    db.transaction(|tx| async move { tx.put(b"k".to_vec(), b"1".to_vec()).await })
        .await
        .unwrap();
    let old = db.begin().await.unwrap();
    assert!(old.get(b"k").await.unwrap().is_some());
    db.transaction(|tx| async move { tx.delete(b"k".to_vec()).await })
        .await
        .unwrap();
    // Enough deletes elsewhere to make the store purge the tombstones no snapshot needs.
    for n in 0..1_200u32 {
        let key = format!("other:{n}").into_bytes();
        db.transaction(|tx| {
            let key = key.clone();
            async move {
                tx.put(key.clone(), b"x".to_vec()).await?;
                tx.delete(key).await
            }
        })
        .await
        .unwrap();
    }
    old.put(b"k".to_vec(), b"2".to_vec()).await.unwrap();
    let refused = old.commit().await;
    assert!(
        matches!(refused, Err(tito::TitoError::Conflict { .. })),
        "{refused:?}"
    );
    let tx = db.begin().await.unwrap();
    assert_eq!(tx.get(b"k").await.unwrap(), None, "the delete stands");
}
