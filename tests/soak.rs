//! Many processes, for real: several OS processes (this test binary, started with `soak_child`
//! selected) publish and handle on one TiKV store (the test server), with a queue-wide
//! concurrency limit, unique jobs, cancels across processes, a failure policy, a periodic
//! schedule run by cluster-mode workers and nudges between processes, and job graphs
//! (workflows with a fan-in published in the publisher's transaction, batches published while
//! their workers run, all of them transactional handlers); they are SIGKILLed and restarted in
//! a loop, and in the middle the store moves to another cluster (`tito::store::migrate`) while
//! they run. At the end: nothing acknowledged is lost, no transactional effect committed twice,
//! no start after a committed cancel, the limit never exceeded, each unique key published once,
//! each tick run once unless its runner was killed, every workflow's steps run once each and
//! its last step after both its dependencies, every batch called back once with every child
//! counted.
//!
//! `TITO_SOAK_SECS` sets the run's length (20 s by default; the move happens halfway),
//! `TITO_SOAK_PROCS` the processes (3).

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tito::backend::tikv::TiKV;
use tito::queue::{
    ClusterConfig, FailurePolicy, Finished, Limits, PeriodicJob, Schedule, Unique, UniqueStates,
};
use tito::{
    Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, TitoEngine, TitoError, TitoTransaction,
    WorkerConfig, Workers,
};
use tito_tikv_test_server::TestCluster;

const DIR_VAR: &str = "TITO_SOAK_CHILD_DIR";
const PD_VAR: &str = "TITO_SOAK_CHILD_PD";
const NAME_VAR: &str = "TITO_SOAK_CHILD_NAME";

/// The queue-wide concurrency limit the soak sets.
const LIMIT: usize = 3;

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Job {
    /// The first attempt fails (the failure policy retries it).
    fail_first: bool,
}

fn now_us() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros()
}

fn soak_queue<E: TitoEngine>(db: &E) -> Arc<Queue<E>> {
    Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(4, Duration::from_secs(3600)).topic("soak"),
    ))
}

/// The job graphs' work: workflow steps and batch children.
#[derive(Clone, Debug, Serialize, Deserialize)]
enum GraphJob {
    Step(String),
    Child(u32),
}

fn graph_queue<E: TitoEngine>(db: &E) -> Arc<Queue<E>> {
    Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(2, Duration::from_secs(3600)).topic("soak-graph"),
    ))
}

fn callback_queue<E: TitoEngine>(db: &E) -> Arc<Queue<E>> {
    Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(1, Duration::from_secs(3600)).topic("soak-graph-cb"),
    ))
}

/// Children of each soak batch.
const BATCH_CHILDREN: u32 = 30;

fn tick_queue<E: TitoEngine>(db: &E) -> Arc<Queue<E>> {
    Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(2, Duration::from_secs(3600)).topic("ticks"),
    ))
}

/// A child's log: one line per event, each written with one `write` on a file opened for
/// appending, so what a killed process wrote is there whole.
#[derive(Clone)]
struct Log(Arc<std::sync::Mutex<std::fs::File>>);

impl Log {
    /// The append-only log at `path`, created when missing.
    fn open(path: &Path) -> Log {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        Log(Arc::new(std::sync::Mutex::new(file)))
    }

    fn line(&self, text: String) {
        let mut file = self.0.lock().unwrap();
        file.write_all(format!("{text} {}\n", now_us()).as_bytes())
            .unwrap();
    }
}

/// One soak process: a publisher (transactions that publish an event, some unique, with a
/// `soak:pub:` row), cancels of its own earlier events, a transactional worker whose effect is
/// a `soak:run:` row, a cluster-mode worker of the periodic `ticks` queue and its schedule.
/// Does nothing unless started by the soak.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "started as a child process by the soak"]
async fn soak_child() {
    let (Ok(dir), Ok(pd), Ok(name)) = (
        std::env::var(DIR_VAR),
        std::env::var(PD_VAR),
        std::env::var(NAME_VAR),
    ) else {
        return;
    };
    let dir = PathBuf::from(dir);
    let log = Log::open(&dir.join(format!("{name}.log")));
    let db = TiKV::connect(vec![pd]).await.unwrap();
    let queue = soak_queue(&db);
    let ticks = tick_queue(&db);
    let mut workers = Workers::new();
    let runs = Arc::new(AtomicU64::new(0));
    let (handler_log, handler_name) = (log.clone(), name.clone());
    workers.spawn_transactional_worker(
        queue.clone(),
        WorkerConfig::new(0..4)
            .max_idle_backoff(Duration::from_millis(500))
            .failure_policy(FailurePolicy::new(5)),
        move |event: QueueEvent<Job>, tx| {
            handler_log.line(format!("start {} {}", event.id, event.attempt));
            let (log, name, runs) = (handler_log.clone(), handler_name.clone(), runs.clone());
            async move {
                tokio::time::sleep(Duration::from_millis(3 + event.id.len() as u64 % 7)).await;
                if event.payload.fail_first && event.attempt == 1 {
                    log.line(format!("end {}", event.id));
                    return Err(TitoError::handler("the first attempt fails"));
                }
                let run = runs.fetch_add(1, Ordering::Relaxed);
                tx.put(
                    format!("soak:run:{}:{name}:{run}", event.id).into_bytes(),
                    Vec::new(),
                )
                .await?;
                log.line(format!("end {}", event.id));
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    // Job graphs: every step and child writes its effect in its handler's transaction, the
    // batch callback too; a step's effect names its workflow and step.
    let graphs_queue = graph_queue(&db);
    let callbacks = callback_queue(&db);
    let graph_runs = Arc::new(AtomicU64::new(0));
    let (effect_name, effect_runs) = (name.clone(), graph_runs.clone());
    workers.spawn_transactional_worker(
        graphs_queue.clone(),
        WorkerConfig::new(0..2).max_idle_backoff(Duration::from_millis(500)),
        move |event: QueueEvent<GraphJob>, tx| {
            let (name, runs) = (effect_name.clone(), effect_runs.clone());
            async move {
                let run = runs.fetch_add(1, Ordering::Relaxed);
                let what = match &event.payload {
                    GraphJob::Step(step) => format!("step:{}:{step}", event.key),
                    GraphJob::Child(n) => format!("child:{}:{n}", event.key),
                };
                tx.put(
                    format!("soak:graph:{what}:{name}:{run}").into_bytes(),
                    Vec::new(),
                )
                .await?;
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    let (cb_name, cb_runs) = (name.clone(), graph_runs.clone());
    workers.spawn_transactional_worker(
        callbacks.clone(),
        WorkerConfig::new(0..1).max_idle_backoff(Duration::from_millis(500)),
        move |event: QueueEvent<tito::queue::graph::BatchDone<String>>, tx| {
            let (name, runs) = (cb_name.clone(), cb_runs.clone());
            async move {
                let run = runs.fetch_add(1, Ordering::Relaxed);
                let done = event.payload;
                tx.put(
                    format!(
                        "soak:graph:cb:{}:{}:{}:{name}:{run}",
                        done.batch, done.counts.added, done.counts.completed
                    )
                    .into_bytes(),
                    Vec::new(),
                )
                .await?;
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    let graphs = tito::queue::graph::Graphs::new(db.clone());
    let tick_log = log.clone();
    workers.spawn_cluster_worker(
        ticks.clone(),
        WorkerConfig::new(0..2).max_idle_backoff(Duration::from_millis(500)),
        ClusterConfig::new().node_id(name.clone()),
        move |event: QueueEvent<u32>| {
            tick_log.line(format!("tick {}", event.id));
            let log = tick_log.clone();
            async move {
                log.line(format!("tickend {}", event.id));
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    workers.spawn_periodic(
        ticks.clone(),
        vec![PeriodicJob::new(
            Schedule::every("second", Duration::from_secs(1)).unwrap(),
            0u32,
        )],
    );
    let mut n = 0u64;
    while !dir.join("stop").exists() {
        n += 1;
        let id = format!("{name}-{n}");
        let unique = n
            .is_multiple_of(4)
            .then(|| format!("u{}", (n * 7 + name.len() as u64) % 40));
        let event = QueueEvent::now(
            format!("k{}", n % 13),
            Job {
                fail_first: n.is_multiple_of(7),
            },
        )
        .with_id(id.clone());
        let q = queue.clone();
        let published = db
            .transaction(|tx| {
                let (q, event, unique, id) = (q.clone(), event.clone(), unique.clone(), id.clone());
                async move {
                    let published = match &unique {
                        Some(key) => {
                            let rule = Unique::key(key.clone(), Duration::from_secs(3600))
                                .covering(UniqueStates::Any);
                            q.publish_unique_in_tx(&event, &rule, &tx).await?
                        }
                        None => q.publish_in_tx(&event, &tx).await?,
                    };
                    if !published.duplicate {
                        tx.put(
                            format!("soak:pub:{id}").into_bytes(),
                            unique.unwrap_or_default().into_bytes(),
                        )
                        .await?;
                    }
                    Ok::<_, TitoError>(())
                }
            })
            .await;
        match published {
            Ok(()) => {}
            Err(TitoError::StoreMoved { .. }) => {
                log.line("moved".into());
                std::process::exit(3);
            }
            Err(err) => log.line(format!(
                "publish-failed {id} {}",
                err.to_string().replace(' ', "_")
            )),
        }
        // Every sixth: a workflow with a fan-in, published with a row in one transaction.
        if n % 6 == 1 {
            let wf_id = format!("wf-{name}-{n}");
            let mut wf = tito::queue::graph::Workflow::new(&wf_id);
            let step = |s: &str| {
                QueueEvent::now(wf_id.clone(), GraphJob::Step(s.to_string()))
                    .with_id(format!("{wf_id}.{s}"))
            };
            use tito::queue::graph::StepName;
            wf.step(&StepName::<()>::new("a"), &*graphs_queue, step("a"));
            wf.step(&StepName::<()>::new("b"), &*graphs_queue, step("b"))
                .after(["a"]);
            wf.step(&StepName::<()>::new("c"), &*graphs_queue, step("c"))
                .after(["a"]);
            wf.step(&StepName::<()>::new("d"), &*graphs_queue, step("d"))
                .after(["b", "c"]);
            let (g, wf) = (graphs.clone(), Arc::new(wf));
            let done = db
                .transaction(|tx| {
                    let (g, wf, id) = (g.clone(), wf.clone(), wf_id.clone());
                    async move {
                        g.publish_workflow_in_tx(&wf, &tx).await?;
                        tx.put(format!("soak:wf:{id}").into_bytes(), Vec::new())
                            .await?;
                        Ok::<_, TitoError>(())
                    }
                })
                .await;
            if let Err(TitoError::StoreMoved { .. }) = done {
                log.line("moved".into());
                std::process::exit(3);
            }
        }
        // Every 25th: a batch, published while the workers run (its record is written once
        // it is published whole).
        if n % 25 == 5 {
            let batch_id = format!("batch-{name}-{n}");
            let batch = tito::queue::graph::Batch::new(&batch_id)
                .numbered()
                .on_complete(&*callbacks, QueueEvent::now("cb", batch_id.clone()));
            let children: Vec<QueueEvent<GraphJob>> = (0..BATCH_CHILDREN)
                .map(|c| QueueEvent::now(batch_id.clone(), GraphJob::Child(c)))
                .collect();
            match graphs
                .publish_batch(&batch, &*graphs_queue, &children)
                .await
            {
                Ok(_) => {
                    let _ = db
                        .transaction(|tx| {
                            let key = format!("soak:batch:{batch_id}").into_bytes();
                            async move { tx.put(key, Vec::new()).await }
                        })
                        .await;
                }
                Err(TitoError::StoreMoved { .. }) => {
                    log.line("moved".into());
                    std::process::exit(3);
                }
                Err(err) => log.line(format!(
                    "batch-failed {batch_id} {}",
                    err.to_string().replace(' ', "_")
                )),
            }
        }
        // Every tenth event cancels one published two before (often run by another process).
        if n % 10 == 3 {
            let victim = format!("{name}-{}", n - 2);
            if let Ok(true) = queue.cancel(&victim, "soak").await {
                log.line(format!("cancelled {victim}"));
            }
        }
        // About as fast as the processes handle on the test server, so the backlog stays short.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Publishing stopped: handle until killed.
    std::future::pending::<()>().await;
}

/// A running child, its log and when it was killed.
struct Proc {
    name: String,
    child: Child,
}

fn spawn_child(dir: &Path, pd: &str, name: &str) -> Proc {
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "soak::soak_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(DIR_VAR, dir)
        .env(PD_VAR, pd)
        .env(NAME_VAR, name)
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Proc {
        name: name.to_string(),
        child,
    }
}

/// Kills `proc` with SIGKILL; returns the time of the kill (µs), for its open intervals.
fn kill(proc: &mut Proc, killed: &mut BTreeMap<String, u128>) {
    let _ = proc.child.kill();
    let _ = proc.child.wait();
    killed.insert(proc.name.clone(), now_us());
}

/// Every key of `db` under `prefix`.
async fn keys_under<E: TitoEngine>(db: &E, prefix: &str) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut from = prefix.as_bytes().to_vec();
    let end = tito::keys::prefix_end(prefix.to_string());
    loop {
        let tx = db.begin().await.unwrap();
        let rows = tx.scan(&from, end.as_bytes(), 1000).await.unwrap();
        let _ = tx.rollback().await;
        let done = rows.len() < 1000;
        for (key, value) in rows {
            from = key.clone();
            from.push(0);
            out.push((String::from_utf8(key).unwrap(), value));
        }
        if done {
            return out;
        }
    }
}

/// A child's log lines: (what, id, attempt or 0, µs).
type Lines = Vec<(String, String, u32, u128)>;

fn parse_logs(dir: &Path) -> BTreeMap<String, Lines> {
    let mut logs = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let Some(name) = path
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .strip_suffix(".log")
            .map(str::to_string)
        else {
            continue;
        };
        let mut lines = Vec::new();
        for line in std::io::BufReader::new(std::fs::File::open(&path).unwrap()).lines() {
            let line = line.unwrap();
            let words: Vec<&str> = line.split(' ').collect();
            // A line cut by the kill has no time at its end: it is not counted.
            let Some(at) = words.last().and_then(|w| w.parse::<u128>().ok()) else {
                continue;
            };
            let what = words[0].to_string();
            let id = if words.len() > 2 {
                words[1].to_string()
            } else {
                String::new()
            };
            let attempt = if words.len() > 3 {
                words[2].parse().unwrap_or(0)
            } else {
                0
            };
            lines.push((what, id, attempt, at));
        }
        logs.insert(name, lines);
    }
    logs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_processes_publish_handle_get_killed_and_move_stores() {
    let secs: u64 = std::env::var("TITO_SOAK_SECS").map_or(20, |v| v.parse().unwrap());
    let procs: usize = std::env::var("TITO_SOAK_PROCS").map_or(3, |v| v.parse().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let first = TestCluster::start().await.unwrap();
    let second = TestCluster::start().await.unwrap();
    let a = TiKV::connect(first.pd_endpoints()).await.unwrap();
    let b = TiKV::connect(second.pd_endpoints()).await.unwrap();
    // Declared with its limit before anything is published, as a service's first boot does.
    const SOAK: tito::queue::Topic<Job> = tito::queue::Topic::new("soak");
    SOAK.spec(4, Duration::from_secs(3600))
        .limits(Limits::none().concurrency(LIMIT as u32))
        .open(a.clone())
        .await
        .unwrap();
    let mut pd = first.pd_endpoints()[0].clone();
    let mut generation = 0u64;
    let mut running: Vec<Proc> = (0..procs)
        .map(|slot| spawn_child(dir.path(), &pd, &format!("p{slot}g0")))
        .collect();
    let mut killed: BTreeMap<String, u128> = BTreeMap::new();
    let mut kills = 0u64;
    let started = Instant::now();
    let mut moved = None;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    while started.elapsed() < Duration::from_secs(secs) {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        tokio::time::sleep(Duration::from_millis(1500 + seed % 2500)).await;
        if moved.is_none() && started.elapsed() >= Duration::from_secs(secs / 2) {
            // The move, while every process writes: then each is killed and started on the
            // new store (its publisher already stopped at the refusal).
            let report = tito::store::migrate(
                &a,
                &b,
                tito::store::MigrateOptions::new("the second cluster"),
                |_| {},
            )
            .await
            .unwrap();
            pd = second.pd_endpoints()[0].clone();
            generation += 1;
            for (slot, proc) in running.iter_mut().enumerate() {
                kill(proc, &mut killed);
                *proc = spawn_child(dir.path(), &pd, &format!("p{slot}g{generation}"));
            }
            moved = Some(report);
            continue;
        }
        let slot = (seed % procs as u64) as usize;
        kill(&mut running[slot], &mut killed);
        kills += 1;
        generation += 1;
        running[slot] = spawn_child(dir.path(), &pd, &format!("p{slot}g{generation}"));
    }
    let moved = moved.expect("the store moved halfway");
    // Publishing stops; every acknowledged publication settles (run, or cancelled).
    std::fs::write(dir.path().join("stop"), b"").unwrap();
    let queue = soak_queue(&b);
    // Settling may take long after a long run (the backlog drains at the limit's pace): it
    // fails only when a minute passes without progress.
    let mut deadline = Instant::now() + Duration::from_secs(60);
    let mut least_pending = usize::MAX;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut pending = 0;
        for p in 0..4 {
            pending += queue.pending_count(p).await.unwrap();
        }
        if pending == 0 {
            break;
        }
        if pending < least_pending {
            least_pending = pending;
            deadline = Instant::now() + Duration::from_secs(60);
        }
        assert!(
            Instant::now() < deadline,
            "{pending} invocations still pending, and none settled for a minute"
        );
    }
    // The periodic ticks run too (a new one comes every second: wait for a moment with none
    // pending).
    let ticks_queue = tick_queue(&b);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let pending = ticks_queue.pending_count(0).await.unwrap()
            + ticks_queue.pending_count(1).await.unwrap();
        if pending == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{pending} ticks pending for two minutes"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Every workflow published runs to its end and every batch published calls back, also
    // those whose ends a kill left unfolded (a restarted worker's maintenance folds them):
    // waited for with the same no-progress rule.
    let graphs = tito::queue::graph::Graphs::new(b.clone());
    let workflows: Vec<String> = keys_under(&b, "soak:wf:")
        .await
        .into_iter()
        .map(|(k, _)| k["soak:wf:".len()..].to_string())
        .collect();
    let batches: Vec<String> = keys_under(&b, "soak:batch:")
        .await
        .into_iter()
        .map(|(k, _)| k["soak:batch:".len()..].to_string())
        .collect();
    let mut deadline = Instant::now() + Duration::from_secs(60);
    let mut least_open = usize::MAX;
    loop {
        let mut open = 0;
        for id in &workflows {
            if !graphs.workflow(id).await.unwrap().unwrap().finished() {
                open += 1;
            }
        }
        let cb = keys_under(&b, "soak:graph:cb:").await;
        for id in &batches {
            if !cb
                .iter()
                .any(|(k, _)| k.starts_with(&format!("soak:graph:cb:{id}:")))
            {
                open += 1;
            }
        }
        if open == 0 {
            break;
        }
        if open < least_open {
            least_open = open;
            deadline = Instant::now() + Duration::from_secs(60);
        }
        assert!(
            Instant::now() < deadline,
            "{open} workflows or batches unfinished, and none finished for a minute"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let published = keys_under(&b, "soak:pub:").await;
    for proc in &mut running {
        kill(proc, &mut killed);
    }
    // Each step, child and callback's effect committed once; the fan-in ran after both its
    // dependencies (it is released only by their ends, folded).
    let mut effects: BTreeMap<String, usize> = BTreeMap::new();
    for (key, _) in keys_under(&b, "soak:graph:").await {
        // soak:graph:{what...}:{process}:{run}
        let mut parts: Vec<&str> = key.split(':').collect();
        parts.truncate(parts.len() - 2);
        *effects.entry(parts[2..].join(":")).or_default() += 1;
    }
    for id in &workflows {
        for step in ["a", "b", "c", "d"] {
            let what = format!("step:{id}:{step}");
            assert_eq!(effects.get(&what), Some(&1), "{what}");
        }
    }
    for id in &batches {
        for c in 0..BATCH_CHILDREN {
            let what = format!("child:{id}:{c}");
            assert_eq!(effects.get(&what), Some(&1), "{what}");
        }
        let what = format!("cb:{id}:{BATCH_CHILDREN}:{BATCH_CHILDREN}");
        assert_eq!(effects.get(&what), Some(&1), "{what}: {effects:?}");
    }
    // Nothing lost and no effect twice: each acknowledged publication ran exactly once or
    // was cancelled (and then never ran).
    let mut runs: BTreeMap<String, usize> = BTreeMap::new();
    for (key, _) in keys_under(&b, "soak:run:").await {
        *runs.entry(run_id(&key)).or_default() += 1;
    }
    let logs = parse_logs(dir.path());
    let mut cancelled_at: BTreeMap<String, u128> = BTreeMap::new();
    for lines in logs.values() {
        for (what, id, _, at) in lines {
            if what == "cancelled" {
                cancelled_at.insert(id.clone(), *at);
            }
        }
    }
    let mut unique_keys: BTreeMap<String, usize> = BTreeMap::new();
    let mut cancelled = 0;
    for (key, unique) in &published {
        let id = &key["soak:pub:".len()..];
        let ran = runs.get(id).copied().unwrap_or(0);
        if cancelled_in_store(&b, id).await {
            cancelled += 1;
            assert_eq!(ran, 0, "{id} was cancelled and its effect committed");
        } else {
            assert_eq!(ran, 1, "{id}: its effect committed {ran} times");
        }
        if !unique.is_empty() {
            *unique_keys
                .entry(String::from_utf8(unique.clone()).unwrap())
                .or_default() += 1;
        }
    }
    for (key, count) in &unique_keys {
        assert_eq!(*count, 1, "unique key {key} was published {count} times");
    }
    for id in runs.keys() {
        assert!(
            published.iter().any(|(k, _)| &k["soak:pub:".len()..] == id),
            "{id} ran but its publication was not acknowledged"
        );
    }
    // No start after a cancel returned, in any process: a start later than the cancel is
    // allowed only as the replay of a delivery (same process, same attempt) that started
    // before it (a transactional handler is replayed after a conflict; the cancel is that
    // conflict, and the replay finds the invocation gone).
    let mut starts = 0;
    let mut late = Vec::new();
    let mut intervals: Vec<(u128, i32)> = Vec::new();
    let mut ticks: BTreeMap<String, Vec<(u128, String)>> = BTreeMap::new();
    for (name, lines) in &logs {
        let mut open: BTreeMap<&str, u128> = BTreeMap::new();
        let mut first_start: BTreeMap<(&str, u32), u128> = BTreeMap::new();
        for (what, id, attempt, at) in lines {
            match what.as_str() {
                "start" => {
                    starts += 1;
                    let first = *first_start.entry((id.as_str(), *attempt)).or_insert(*at);
                    if cancelled_at.get(id).is_some_and(|c| first > *c) {
                        late.push(format!("{id} (attempt {attempt}, {name})"));
                    }
                    open.insert(id, *at);
                }
                "end" => {
                    if let Some(from) = open.remove(id.as_str()) {
                        intervals.push((from, 1));
                        intervals.push((*at, -1));
                    }
                }
                "tick" => ticks
                    .entry(id.clone())
                    .or_default()
                    .push((*at, name.clone())),
                _ => {}
            }
        }
        // A handler that was running when its process was killed ran until the kill.
        let end = killed.get(name).copied().unwrap_or_else(now_us);
        for from in open.values() {
            intervals.push((*from, 1));
            intervals.push((end, -1));
        }
    }
    assert!(
        late.is_empty(),
        "started after their cancel returned: {late:?}"
    );
    // The queue-wide limit over every process.
    intervals.sort();
    let (mut now_running, mut most) = (0i32, 0i32);
    for (_, delta) in &intervals {
        now_running += delta;
        most = most.max(now_running);
    }
    assert!(
        most as usize <= LIMIT,
        "{most} handlers ran at once across processes, over the limit of {LIMIT}"
    );
    // Ticks: one invocation per period by construction (its id is the period's); handlers
    // are at least once, so a tick runs again after its runner was killed or lost its
    // partition to a rebalance: counted, not refused.
    let mut reruns = 0;
    let mut reruns_after_kill = 0;
    for (_, mut runs) in ticks.clone() {
        runs.sort();
        for (_, name) in &runs[..runs.len() - 1] {
            reruns += 1;
            if killed.contains_key(name) {
                reruns_after_kill += 1;
            }
        }
    }
    // Every tick published (completed now) ran; the schedule kept ticking through kills and
    // the move (no tick while the move switches: the source refuses writes).
    let ticks_completed = ticks_queue.completed_count().await.unwrap();
    assert!(
        ticks.len() >= ticks_completed,
        "{ticks_completed} ticks completed, {} seen running",
        ticks.len()
    );
    assert!(
        ticks_completed as u64 >= secs / 4,
        "only {ticks_completed} ticks in {secs} s"
    );
    println!(
        "soak: {procs} processes, {secs} s, {} processes started, {kills} kills (plus {procs} \
         at the move), {} publications acknowledged ({cancelled} cancelled), {} effects \
         checked, {starts} handler starts checked, at most {most} running at once (limit \
         {LIMIT}), {} unique keys, {} ticks ({reruns} run again, {reruns_after_kill} of them after their \
         runner was killed), {} workflows and {} batches run to their ends; move: {} keys in {} \
         passes, downtime {} ms",
        logs.len(),
        published.len(),
        runs.len(),
        unique_keys.len(),
        ticks.len(),
        workflows.len(),
        batches.len(),
        moved.progress.keys_read,
        moved.progress.pass,
        moved.downtime_ms,
    );
    assert!(published.len() > 50, "the processes published too little");
    assert!(
        workflows.len() > 5 && !batches.is_empty(),
        "too few graphs: {} workflows, {} batches",
        workflows.len(),
        batches.len()
    );
    assert!(starts > 50, "the processes handled too little");
}

/// The event id of a `soak:run:{id}:{process}:{n}` key.
fn run_id(key: &str) -> String {
    let rest = &key["soak:run:".len()..];
    let mut parts: Vec<&str> = rest.rsplitn(3, ':').collect();
    parts.pop().unwrap().to_string()
}

/// Whether the invocation of `id` completed as cancelled.
async fn cancelled_in_store<E: TitoEngine>(db: &E, id: &str) -> bool {
    tito::inspect::queue_find(db, Some("soak"), id, 10)
        .await
        .unwrap()
        .iter()
        .any(|row| {
            row.event
                .as_ref()
                .is_some_and(|e| e.id == id && e.cancelled.is_some())
        })
}

const WAKE_DIR_VAR: &str = "TITO_WAKE_CHILD_DIR";

/// The wake measurement's worker process: an idle worker whose polls back off to 60 s, logging
/// each start's payload (the publisher's clock before its commit, µs) and its own clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "started as a child process by the wake measurement"]
async fn wake_child() {
    let (Ok(dir), Ok(pd)) = (std::env::var(WAKE_DIR_VAR), std::env::var(PD_VAR)) else {
        return;
    };
    let log = Log::open(&Path::new(&dir).join("wake.log"));
    let db = TiKV::connect(vec![pd]).await.unwrap();
    let queue = wake_queue(&db);
    let mut workers = Workers::new();
    workers.spawn_worker(
        queue,
        WorkerConfig::new(0..2).max_idle_backoff(Duration::from_secs(60)),
        move |event: QueueEvent<u64>| {
            log.line(format!("woke {}", event.payload));
            async { Ok(QueueHandlerOutcome::Acknowledge) }
        },
    );
    std::future::pending::<()>().await;
}

fn wake_queue<E: TitoEngine>(db: &E) -> Arc<Queue<E>> {
    Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(2, Duration::from_secs(3600)).topic("wake"),
    ))
}

fn percentiles(mut values: Vec<f64>) -> (f64, f64, f64) {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let at = |q: f64| values[((values.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99), values[values.len() - 1])
}

/// Publish-to-start latency (the commit included) on the TiKV engine (the test server), from a commit in this process
/// to an idle worker in another OS process (woken by a nudge: its polls back off to 60 s) and
/// to one in this process. `TITO_WAKE_EVENTS` events (300), one every 20 ms. Prints p50, p99
/// and the worst, in ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement; prints figures"]
async fn cross_process_wake_latency() {
    let events: u64 = std::env::var("TITO_WAKE_EVENTS").map_or(300, |v| v.parse().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let cluster = TestCluster::start().await.unwrap();
    let db = TiKV::connect(cluster.pd_endpoints()).await.unwrap();
    let queue = wake_queue(&db);
    queue.publish(QueueEvent::now("warm", 0u64)).await.unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "soak::wake_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(WAKE_DIR_VAR, dir.path())
        .env(PD_VAR, &cluster.pd_endpoints()[0])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Once the other process's worker ran the first event, it is idle and registered.
    let log = dir.path().join("wake.log");
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::fs::read_to_string(&log).map_or(true, |t| t.is_empty()) {
        assert!(
            Instant::now() < deadline,
            "the worker process never started"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    // When each publish call returned (its commit acknowledged), by its payload.
    let mut returned = std::collections::HashMap::new();
    for _ in 0..events {
        let sent = now_us();
        queue
            .publish(QueueEvent::now("e", sent as u64))
            .await
            .unwrap();
        returned.insert(sent, now_us());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let across = loop {
        let text = std::fs::read_to_string(&log).unwrap();
        let lat: Vec<(f64, f64)> = text
            .lines()
            .filter_map(|l| {
                let w: Vec<&str> = l.split(' ').collect();
                let (sent, at) = (
                    w.get(1)?.parse::<u128>().ok()?,
                    w.get(2)?.parse::<u128>().ok()?,
                );
                let done = returned.get(&sent)?;
                // From the commit's acknowledgement; a start before it counts as 0.
                Some((
                    (at - sent) as f64 / 1000.0,
                    at.saturating_sub(*done) as f64 / 1000.0,
                ))
            })
            .collect();
        if lat.len() as u64 >= events {
            break lat;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {events} events started in the other process",
            lat.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let _ = child.kill();
    let _ = child.wait();
    // The same, with the worker in this process.
    let local = wake_queue(&db);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut workers = Workers::new();
    workers.spawn_worker(
        local.clone(),
        WorkerConfig::new(0..2).max_idle_backoff(Duration::from_secs(60)),
        move |event: QueueEvent<u64>| {
            let _ = tx.send((event.payload, now_us()));
            async { Ok(QueueHandlerOutcome::Acknowledge) }
        },
    );
    // Once this worker runs an event, the killed process's leases are gone.
    local.publish(QueueEvent::now("warm", 0u64)).await.unwrap();
    while rx.recv().await.unwrap().0 != 0 {}
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut within = Vec::new();
    let mut calls = Vec::new();
    for _ in 0..events {
        let sent = now_us();
        local
            .publish(QueueEvent::now("e", sent as u64))
            .await
            .unwrap();
        calls.push((now_us() - sent) as f64 / 1000.0);
        let done = now_us();
        let (sent, at) = rx.recv().await.unwrap();
        within.push((
            (at - sent as u128) as f64 / 1000.0,
            at.saturating_sub(done) as f64 / 1000.0,
        ));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    workers.shutdown().await.unwrap();
    let (a50, a99, amax) = percentiles(across.iter().map(|l| l.0).collect());
    let (w50, w99, wmax) = percentiles(within.iter().map(|l| l.0).collect());
    let (ac50, ac99, acmax) = percentiles(across.iter().map(|l| l.1).collect());
    let (wc50, wc99, wcmax) = percentiles(within.iter().map(|l| l.1).collect());
    let (c50, c99, cmax) = percentiles(calls);
    println!(
        "wake latency on the TiKV test server, {events} events, idle polls backed off to 60 s \
         (from the publish call, its commit included | from the commit's acknowledgement):\n  \
         another OS process (nudged): p50 {a50:.2} | {ac50:.2} ms, p99 {a99:.2} | {ac99:.2} \
         ms, max {amax:.2} | {acmax:.2} ms\n  this process:                p50 {w50:.2} | \
         {wc50:.2} ms, p99 {w99:.2} | {wc99:.2} ms, max {wmax:.2} | {wcmax:.2} ms\n  the \
         publish call itself:     p50 {c50:.2} ms, p99 {c99:.2} ms, max {cmax:.2} ms"
    );
}

const AWAIT_DIR_VAR: &str = "TITO_AWAIT_CHILD_DIR";

fn await_queue<E: TitoEngine>(db: &E) -> Arc<Queue<E>> {
    Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(2, Duration::from_secs(3600)).topic("awaited"),
    ))
}

const FIRST: tito::queue::graph::StepName<u64> = tito::queue::graph::StepName::new("first");
const SECOND: tito::queue::graph::StepName<u64> = tito::queue::graph::StepName::new("second");

/// The awaited results' worker process: answers `n` with `2n`, and a workflow's `second` step
/// with its `first` step's result plus one; idle polls back off to 60 s (nudges wake it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "started as a child process by the awaited results' test"]
async fn await_child() {
    let (Ok(dir), Ok(pd)) = (std::env::var(AWAIT_DIR_VAR), std::env::var(PD_VAR)) else {
        return;
    };
    let log = Log::open(&Path::new(&dir).join("await.log"));
    let db = TiKV::connect(vec![pd]).await.unwrap();
    let graphs = tito::queue::graph::Graphs::new(db.clone());
    let mut workers = Workers::new();
    workers.spawn_worker(
        await_queue(&db),
        WorkerConfig::new(0..2).max_idle_backoff(Duration::from_secs(60)),
        move |event: QueueEvent<u64>| {
            let (graphs, log) = (graphs.clone(), log.clone());
            async move {
                log.line(format!("ran {}", event.id));
                match &event.workflow {
                    Some(of) if of.step == SECOND.name() => {
                        let Finished::Completed(Some(first)) =
                            graphs.dependency(&event, &FIRST).await?
                        else {
                            return Err(TitoError::invalid_argument("first did not complete"));
                        };
                        QueueHandlerOutcome::acknowledge_with(&(first + 1))
                    }
                    _ => QueueHandlerOutcome::acknowledge_with(&(event.payload * 2)),
                }
            }
        },
    );
    std::future::pending::<()>().await;
}

/// Results awaited in this process from handlers that ran in another OS process (the TiKV test
/// server between them): each event's result, and a workflow's second step's result computed
/// from its first's in that process. `TITO_AWAIT_EVENTS` events (20; 300 for figures), one every
/// 20 ms; prints p50, p99 and the worst from the end of the publish call to `await_result`'s
/// return, beside the same with the worker in this process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_are_awaited_across_processes() {
    use tito::queue::graph::{Graphs, Workflow};
    let events: u64 = std::env::var("TITO_AWAIT_EVENTS").map_or(20, |v| v.parse().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let cluster = TestCluster::start().await.unwrap();
    let db = TiKV::connect(cluster.pd_endpoints()).await.unwrap();
    let queue = await_queue(&db);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "soak::await_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(AWAIT_DIR_VAR, dir.path())
        .env(PD_VAR, &cluster.pd_endpoints()[0])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The first result tells the other process is up (its start is not measured).
    let warm = queue.publish(QueueEvent::now("warm", 0u64)).await.unwrap();
    let first = queue
        .await_result::<u64>(&warm.id, Duration::from_secs(120))
        .await;
    assert_eq!(first.unwrap(), Some(Finished::Completed(Some(0))));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let across = awaited(&queue, events, 1).await;
    // A workflow whose steps run over there: the second reads the first's result.
    let graphs = Graphs::new(db.clone());
    let mut workflow = Workflow::new(format!("across-{}", warm.id));
    workflow.step(&FIRST, &queue, QueueEvent::now("a", 20u64));
    workflow
        .step(&SECOND, &queue, QueueEvent::now("b", 0u64))
        .after([&FIRST]);
    let published = graphs.publish_workflow(&workflow).await.unwrap();
    let second = queue
        .await_result::<u64>(
            published.step_id(SECOND.name()).unwrap(),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert_eq!(second, Some(Finished::Completed(Some(41))));
    let _ = child.kill();
    let _ = child.wait();
    let ran = std::fs::read_to_string(dir.path().join("await.log")).unwrap();
    assert!(
        ran.lines().count() as u64 >= events + 3,
        "every handler ran in the other process: {ran}"
    );
    // The same with the worker in this process.
    let local = await_queue(&db);
    let mut workers = Workers::new();
    workers.spawn_worker(
        local.clone(),
        WorkerConfig::new(0..2).max_idle_backoff(Duration::from_secs(60)),
        |event: QueueEvent<u64>| async move {
            QueueHandlerOutcome::acknowledge_with(&(event.payload * 2))
        },
    );
    // Once this worker answers, the killed process's leases are gone.
    let warm = local.publish(QueueEvent::now("warm", 1u64)).await.unwrap();
    let done = local
        .await_result::<u64>(&warm.id, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done, Some(Finished::Completed(Some(2))));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let within = awaited(&local, events, 1_000_000).await;
    workers.shutdown().await.unwrap();
    let (a50, a99, amax) = percentiles(across);
    let (w50, w99, wmax) = percentiles(within);
    println!(
        "publish to awaited result on the TiKV test server, {events} events, idle polls backed \
         off to 60 s (nudged), awaited here:\n  handler in another OS process: p50 {a50:.2} ms, \
         p99 {a99:.2} ms, max {amax:.2} ms\n  handler in this process:       p50 {w50:.2} ms, \
         p99 {w99:.2} ms, max {wmax:.2} ms"
    );
}

/// Publishes `events` events one after another (payloads from `from`), awaits each one's
/// result, checks it, and answers the latencies (ms) from the end of each publish call.
async fn awaited<E: TitoEngine>(queue: &Queue<E>, events: u64, from: u64) -> Vec<f64> {
    let mut took = Vec::new();
    for n in from..from + events {
        let published = queue.publish(QueueEvent::now("e", n)).await.unwrap();
        let start = Instant::now();
        let done = queue
            .await_result::<u64>(&published.id, Duration::from_secs(60))
            .await
            .unwrap();
        took.push(start.elapsed().as_secs_f64() * 1e3);
        assert_eq!(done, Some(Finished::Completed(Some(n * 2))), "event {n}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    took
}
