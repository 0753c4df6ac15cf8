//! Whole-store operations: `tito gc` and `tito serve` (the dashboard).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tito::inspect;
use tito::schema::AuditReport;
use tito::{TitoEngine, TitoResult};

use crate::typing::{ModelOps, Typing};
use crate::{Failure, Outcome, print, say, until_short};

pub(crate) async fn gc<E: TitoEngine>(
    db: &E,
    retention: Duration,
    graph_retention: Duration,
    json: bool,
) -> Outcome {
    let started = Instant::now();
    let mut report = serde_json::Map::new();
    for info in inspect::queues(db, 1000).await? {
        let Some(partitions) = info.partitions else {
            continue;
        };
        let mut config = tito::QueueConfig::new(partitions, retention);
        config.topic = info.topic.clone();
        let queue = tito::Queue::new(db.clone(), config);
        let full = tito::queue::RETENTION_BATCH;
        let deleted = until_short(full, async || queue.expire_completed().await).await?;
        report.insert(format!("queue {}", info.label), deleted.into());
        let unique = until_short(full, async || queue.sweep_unique().await).await?;
        report.insert(format!("queue {} unique keys", info.label), unique.into());
    }
    // Workflows and batches that finished before their retention.
    let graphs = tito::queue::graph::Graphs::new(db.clone())
        .expire(graph_retention)
        .await?;
    report.insert("finished workflows".into(), graphs.workflows.into());
    report.insert("finished batches".into(), graphs.batches.into());
    let kv = tito::kv::Kv::new(db.clone());
    let full = tito::kv::SWEEP_BATCH;
    let expired = until_short(full, async || kv.sweep(full).await).await?;
    report.insert("kv expired".into(), expired.into());
    let full = tito::engine::COMMIT_MARKER_SWEEP_BATCH;
    let sweep = async || tito::engine::sweep_commit_markers(db, full).await;
    report.insert(
        "commit markers".into(),
        until_short(full, sweep).await?.into(),
    );
    report.insert(
        "seconds".into(),
        serde_json::json!(started.elapsed().as_secs_f64()),
    );
    print(json, &report, || {
        report
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect::<Vec<_>>()
            .join("\n")
    })
}

pub(crate) async fn serve<E: TitoEngine>(db: E, typed: &Typing, listen: SocketAddr) -> Outcome {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| Failure(format!("cannot listen on {listen}: {e}")))?;
    let local = listener
        .local_addr()
        .map_err(|e| Failure(format!("cannot listen on {listen}: {e}")))?;
    if !local.ip().is_loopback() {
        eprintln!(
            "tito: listening on {local}, not loopback: without an authorization hook the dashboard \
             refuses every peer but loopback ones (mount tito_admin::Admin with Admin::authorize in \
             your own server to serve others)"
        );
    }
    say(&format!(
        "serving the Tito admin on http://{local}/ (Ctrl-C stops)"
    ));
    let mut admin = tito_admin::Admin::new(db);
    for (table, model) in &typed.models {
        admin = admin.auditor(table.clone(), Arc::new(ModelAuditor(model.clone())));
    }
    let router = admin.router();
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    tito_admin::serve(listener, router, shutdown)
        .await
        .map_err(|e| Failure(format!("serving failed: {e}")))?;
    Ok(String::new())
}

/// A registered model as the dashboard's auditor.
pub(crate) struct ModelAuditor(Arc<dyn ModelOps>);

impl tito_admin::Auditor for ModelAuditor {
    fn audit(&self) -> BoxFuture<'_, TitoResult<AuditReport>> {
        self.0.audit(false, Box::new(|_| {}))
    }
}
