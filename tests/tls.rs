//! TiKV over TLS, against the test server serving TLS with certificates made here: a
//! transaction, the queue and the model layer over TLS, and the mistakes (a wrong CA, an
//! expired certificate, a plain-text server, a missing file) refused with clear errors within
//! the connect timeout.

use std::time::{Duration, Instant};

use tito::backend::tikv::{TiKV, TiKVOptions, TlsFiles};
use tito::{TitoEngine, TitoError, TitoTransaction};
use tito_tikv_test_server::TestCluster;

use crate::support::make_pki;

fn options(files: TlsFiles) -> TiKVOptions {
    TiKVOptions::default()
        .tls(files)
        .connect_timeout(Duration::from_secs(5))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tikv_over_tls_commits_and_runs_a_queue() {
    let pki = make_pki(false);
    let cluster = TestCluster::start_tls(&pki.identity()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let db = TiKV::connect_with(cluster.pd_endpoints(), options(pki.files(dir.path())))
        .await
        .unwrap();
    db.transaction(|tx| async move { tx.put(b"t:tls".to_vec(), b"1".to_vec()).await })
        .await
        .unwrap();
    let tx = db.begin().await.unwrap();
    assert_eq!(tx.get(b"t:tls").await.unwrap().as_deref(), Some(&b"1"[..]));
    tx.rollback().await.unwrap();
    // A queue end to end over TLS.
    let queue = std::sync::Arc::new(tito::Queue::new(
        db.clone(),
        tito::QueueConfig::new(2, Duration::from_secs(60)),
    ));
    queue
        .publish(tito::QueueEvent::new("k", 7u32, 0))
        .await
        .unwrap();
    let (seen, mut got) = tokio::sync::mpsc::unbounded_channel();
    let mut workers = tito::Workers::new();
    workers.spawn_worker(
        queue.clone(),
        tito::WorkerConfig::new(0..2),
        move |event: tito::QueueEvent<u32>| {
            let seen = seen.clone();
            async move {
                seen.send(event.payload).unwrap();
                Ok(tito::QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    let payload = tokio::time::timeout(Duration::from_secs(30), got.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(payload, 7);
    workers.shutdown().await.unwrap();
}

/// The connect's error within its timeout (never a hang), as text.
async fn refused(endpoints: Vec<String>, options: TiKVOptions) -> String {
    let started = Instant::now();
    let bound = options.connect_timeout + Duration::from_secs(5);
    let result = tokio::time::timeout(bound, TiKV::connect_with(endpoints, options))
        .await
        .expect("the connect returned within its timeout");
    let err = match result {
        Ok(_) => panic!("connected"),
        Err(err) => err,
    };
    println!("refused in {:?}: {err}", started.elapsed());
    err.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tikv_tls_mistakes_are_clear_errors_never_hangs() {
    let pki = make_pki(false);
    let cluster = TestCluster::start_tls(&pki.identity()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let good = pki.files(dir.path());

    // A CA that did not sign the server's certificate.
    let other = make_pki(false);
    let other_dir = tempfile::tempdir().unwrap();
    let mut wrong_ca = good.clone();
    wrong_ca.ca = other.files(other_dir.path()).ca;
    let err = refused(cluster.pd_endpoints(), options(wrong_ca)).await;
    assert!(err.contains("over TLS"), "{err}");
    assert!(err.contains("not signed by the CA in"), "{err}");

    // A client certificate the server does not accept (signed by another CA): said so, not
    // "PD cluster failed to respond".
    let mut stranger = good.clone();
    let theirs = other.files(other_dir.path());
    (stranger.cert, stranger.key) = (theirs.cert, theirs.key);
    let err = refused(cluster.pd_endpoints(), options(stranger)).await;
    assert!(
        err.contains("the server refused this client's certificate"),
        "{err}"
    );

    // An expired server certificate.
    let expired = make_pki(true);
    let old = TestCluster::start_tls(&expired.identity()).await.unwrap();
    let expired_dir = tempfile::tempdir().unwrap();
    let err = refused(
        old.pd_endpoints(),
        options(expired.files(expired_dir.path())),
    )
    .await;
    assert!(err.contains("has expired"), "{err}");

    // TLS to a plain-text server, and plain text to a TLS server.
    let plain = TestCluster::start().await.unwrap();
    let err = refused(plain.pd_endpoints(), options(good.clone())).await;
    assert!(err.contains("does not speak TLS"), "{err}");
    let err = refused(
        cluster.pd_endpoints(),
        TiKVOptions::default().connect_timeout(Duration::from_secs(5)),
    )
    .await;
    assert!(err.contains("over plain text"), "{err}");
    assert!(
        err.contains("the server speaks TLS: connect with TiKVOptions::tls"),
        "{err}"
    );

    // A server that accepts connections and never answers: an error at the connect timeout.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_address = silent.local_addr().unwrap().to_string();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
        }
    });
    let started = Instant::now();
    let quick = TiKVOptions::default().connect_timeout(Duration::from_secs(1));
    let err = refused(vec![silent_address], quick).await;
    assert!(err.contains("no answer within 1s"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(6));
    holder.abort();

    // Files: missing, or not PEM: refused before any connection, naming the file.
    let mut missing = good.clone();
    missing.key = dir.path().join("nope.pem");
    match TiKV::connect_with(cluster.pd_endpoints(), options(missing)).await {
        Err(TitoError::InvalidArgument(m)) => assert!(m.contains("nope.pem"), "{m}"),
        other => panic!("{other:?}"),
    }
    let not_pem = dir.path().join("ca.txt");
    std::fs::write(&not_pem, "hello").unwrap();
    let mut garbled = good.clone();
    garbled.ca = not_pem;
    match TiKV::connect_with(cluster.pd_endpoints(), options(garbled)).await {
        Err(TitoError::InvalidArgument(m)) => assert!(m.contains("not a PEM file"), "{m}"),
        other => panic!("{other:?}"),
    }
}
