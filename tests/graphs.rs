//! Job graphs: workflows (steps after their dependencies, results handed on, failure rules,
//! cancellation, erasure) and batches (callbacks exactly once with their counts, fan-in under
//! concurrent completions). Written once, run on every backend.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tito::queue::graph::{Batch, BatchCallback, BatchDone, Graphs, OnFailure, StepName, Workflow};
use tito::queue::{FailurePolicy, Finished, InvocationState, Workers};
use tito::{
    Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, QueueOwner, TitoEngine, TitoError,
    TitoTransaction, WorkerConfig,
};

use crate::support::{Ctx, wait_for};

/// Runs every case of this suite on one backend.
#[macro_export]
macro_rules! graphs_suite {
    ($backend:ty) => {
        $crate::engine_suite!(
            $backend,
            graphs,
            [
                an_order_pipeline_runs_each_step_after_its_dependencies_with_their_results,
                bad_graphs_are_refused_naming_the_problem_and_write_nothing,
                a_dependencys_death_or_cancel_follows_each_steps_rule,
                a_workflow_is_cancelled_whole_by_id_by_owner_and_by_erasure,
                a_workflow_joins_the_callers_transaction_and_publishes_once_per_id,
                a_batch_calls_back_once_with_its_counts,
                a_batch_filled_over_time_calls_back_only_after_its_close,
                concurrent_last_children_start_each_callback_once,
                finished_graphs_expire_and_unfinished_ones_stay,
                a_workers_maintenance_expires_finished_graphs_in_turn_across_a_restart,
                cancel_batch_cancels_only_its_own_children,
                publish_batch_writes_in_bounded_transactions_and_resumes,
                a_periodic_job_starts_a_workflow_once_per_tick,
                graphs_run_on_cluster_nodes_across_a_crash,
                a_step_id_taken_after_retention_is_no_step_of_its_workflow,
                a_batch_published_again_after_retention_adds_no_child_twice,
                a_batch_callbacks_taken_id_is_refused_or_fires_once_under_its_own,
                two_publications_of_one_batch_at_once_both_succeed,
                control_characters_in_graph_names_are_refused,
                a_batch_takes_children_while_its_transactional_workers_complete_earlier_ones,
                dependencies_ending_at_once_in_transactional_handlers_never_conflict,
                ends_whose_folds_were_lost_are_folded_by_the_next_workers_maintenance,
                many_workflows_publish_in_bounded_transactions_and_again_as_duplicates,
                cancel_batch_goes_through_while_its_children_complete,
            ]
        );
    };
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Charge {
    order: String,
    cents: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Receipt {
    charge_id: String,
    cents: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Fulfil {
    Reserve { order: String },
    SendReceipt { order: String },
    Notify { order: String },
}

const CHARGE: StepName<Receipt> = StepName::new("charge");
const RESERVE: StepName<String> = StepName::new("reserve");
const RECEIPT: StepName<String> = StepName::new("receipt");
const NOTIFY: StepName<String> = StepName::new("notify");

fn topic<E: TitoEngine>(db: &E, name: &str, partitions: u32) -> Arc<Queue<E>> {
    Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(partitions, Duration::from_secs(3600)).topic(name),
    ))
}

fn fast(partitions: std::ops::Range<u32>) -> WorkerConfig {
    WorkerConfig::new(partitions).max_idle_backoff(Duration::from_millis(50))
}

/// A fresh id (stores of one TiKV test server may be shared between cases).
fn fresh(what: &str) -> String {
    format!("{what}-{}", QueueEvent::now("k", ()).id)
}

async fn await_finished<E: TitoEngine>(queue: &Queue<E>, id: &str) -> Finished<serde_json::Value> {
    queue
        .await_result::<serde_json::Value>(id, Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("invocation {id} did not finish"))
}

pub async fn an_order_pipeline_runs_each_step_after_its_dependencies_with_their_results<
    E: TitoEngine,
>(
    ctx: Ctx<E>,
) {
    let graphs = Graphs::new(ctx.db.clone());
    let charges = topic(&ctx.db, "charges", 2);
    let fulfil = topic(&ctx.db, "fulfil", 4);
    let order = fresh("order");
    let mut workflow = Workflow::new(order.clone());
    workflow.step(
        &CHARGE,
        &charges,
        QueueEvent::now(
            &order,
            Charge {
                order: order.clone(),
                cents: 4200,
            },
        ),
    );
    workflow
        .step(
            &RESERVE,
            &fulfil,
            QueueEvent::now(
                "stock",
                Fulfil::Reserve {
                    order: order.clone(),
                },
            ),
        )
        .after([&CHARGE]);
    workflow
        .step(
            &RECEIPT,
            &fulfil,
            QueueEvent::now(
                "mail",
                Fulfil::SendReceipt {
                    order: order.clone(),
                },
            ),
        )
        .after([&CHARGE]);
    workflow
        .step(
            &NOTIFY,
            &fulfil,
            QueueEvent::now(
                "mail",
                Fulfil::Notify {
                    order: order.clone(),
                },
            ),
        )
        .after([RESERVE.name(), RECEIPT.name()]);
    let published = graphs.publish_workflow(&workflow).await.unwrap();
    assert!(!published.duplicate);
    assert_eq!(published.steps.len(), 4);
    // Nothing but the charge is due: the other steps wait.
    let state = graphs.workflow(&order).await.unwrap().unwrap();
    assert_eq!(
        state.counts(),
        [
            ("waiting", 3),
            ("pending", 1),
            ("completed", 0),
            ("cancelled", 0),
            ("dead", 0)
        ]
    );
    let notify_id = published.step_id("notify").unwrap().to_string();
    assert_eq!(
        fulfil.invocation_state::<String>(&notify_id).await.unwrap(),
        InvocationState::Waiting {
            on: vec!["reserve".into(), "receipt".into()]
        }
    );
    let order_log: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut workers = Workers::new();
    let log = order_log.clone();
    workers.spawn_worker(
        charges.clone(),
        fast(0..2),
        move |event: QueueEvent<Charge>| {
            let log = log.clone();
            async move {
                assert_eq!(event.workflow.as_ref().unwrap().step, "charge");
                log.lock().unwrap().push("charge".into());
                QueueHandlerOutcome::acknowledge_with(&Receipt {
                    charge_id: format!("ch-{}", event.payload.order),
                    cents: event.payload.cents,
                })
            }
        },
    );
    let (log, reads) = (order_log.clone(), graphs.clone());
    workers.spawn_worker(
        fulfil.clone(),
        fast(0..4),
        move |event: QueueEvent<Fulfil>| {
            let (log, graphs) = (log.clone(), reads.clone());
            async move {
                let step = event.workflow.clone().unwrap().step;
                match &event.payload {
                    Fulfil::Reserve { .. } | Fulfil::SendReceipt { .. } => {
                        // The charge completed before this step ran, and its result is here.
                        let charge = graphs.dependency(&event, &CHARGE).await?;
                        let Finished::Completed(Some(receipt)) = charge else {
                            panic!("step {step} ran before the charge completed: {charge:?}")
                        };
                        assert_eq!(receipt.cents, 4200);
                        // Not a dependency of this step: refused, naming the fix.
                        let err = graphs.dependency(&event, &NOTIFY).await.unwrap_err();
                        assert!(err.to_string().contains(".after([\"notify\"])"), "{err}");
                    }
                    Fulfil::Notify { .. } => {
                        for dep in [&RESERVE, &RECEIPT] {
                            let done = graphs.dependency(&event, dep).await?;
                            assert_eq!(
                                done,
                                Finished::Completed(Some(format!("{} done", dep.name()))),
                                "notify ran before {}",
                                dep.name()
                            );
                        }
                    }
                }
                log.lock().unwrap().push(step.clone());
                QueueHandlerOutcome::acknowledge_with(&format!("{step} done"))
            }
        },
    );
    let finished = await_finished(&fulfil, &notify_id).await;
    assert_eq!(
        finished,
        Finished::Completed(Some(serde_json::json!("notify done")))
    );
    workers.shutdown().await.unwrap();
    let log = order_log.lock().unwrap().clone();
    assert_eq!(log.first().map(String::as_str), Some("charge"), "{log:?}");
    assert_eq!(log.last().map(String::as_str), Some("notify"), "{log:?}");
    assert_eq!(log.len(), 4, "each step ran once: {log:?}");
    let state = graphs.workflow(&order).await.unwrap().unwrap();
    assert!(state.finished());
    assert_eq!(state.counts()[2], ("completed", 4));
    // The edges and waiting rows are gone: only records, steps and completed rows remain.
    let tx = ctx.db.begin().await.unwrap();
    let edges = tx
        .scan(b"workflow-edge:", b"workflow-edge;", 10)
        .await
        .unwrap();
    assert!(
        edges
            .iter()
            .all(|(k, _)| !String::from_utf8_lossy(k).contains(&order))
    );
    tx.rollback().await.unwrap();
}

pub async fn bad_graphs_are_refused_naming_the_problem_and_write_nothing<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let graphs = Graphs::new(ctx.db.clone());
    let queue = topic(&ctx.db, "steps", 2);
    let step = |name: &str| StepName::<()>::named(name);
    let event = |n: u32| QueueEvent::now(format!("k{n}"), n);
    let id = fresh("bad");
    let refused = |wf: Workflow| {
        let graphs = graphs.clone();
        async move {
            let err = graphs.publish_workflow(&wf).await.unwrap_err();
            assert!(matches!(err, TitoError::InvalidArgument(_)), "{err:?}");
            err.to_string()
        }
    };
    // A cycle, named step by step.
    let mut wf = Workflow::new(&id);
    wf.step(&step("a"), &queue, event(1)).after(["c"]);
    wf.step(&step("b"), &queue, event(2)).after(["a"]);
    wf.step(&step("c"), &queue, event(3)).after(["b"]);
    wf.step(&step("d"), &queue, event(4));
    let err = refused(wf).await;
    assert!(err.contains("waits for"), "{err}");
    for name in ["\"a\"", "\"b\"", "\"c\""] {
        assert!(err.contains(name), "{err}");
    }
    assert!(!err.contains("\"d\""), "{err}");
    assert!(err.contains("nothing was published"), "{err}");
    // An unknown dependency, a duplicate name, itself, twice, no step, a bad event.
    let mut wf = Workflow::new(&id);
    wf.step(&step("a"), &queue, event(1)).after(["ghost"]);
    assert!(refused(wf).await.contains("\"ghost\", which is no step"));
    let mut wf = Workflow::new(&id);
    wf.step(&step("a"), &queue, event(1));
    wf.step(&step("a"), &queue, event(2));
    assert!(refused(wf).await.contains("two steps are named \"a\""));
    let mut wf = Workflow::new(&id);
    wf.step(&step("a"), &queue, event(1)).after(["a"]);
    assert!(refused(wf).await.contains("depends on itself"));
    let mut wf = Workflow::new(&id);
    wf.step(&step("a"), &queue, event(1));
    wf.step(&step("b"), &queue, event(2)).after(["a", "a"]);
    assert!(refused(wf).await.contains("names \"a\" twice"));
    assert!(refused(Workflow::new(&id)).await.contains("no step"));
    let mut wf = Workflow::new(&id);
    wf.step(&step("a"), &queue, event(1).with_urgency(200));
    assert!(refused(wf).await.contains("step \"a\": "));
    let mut wf = Workflow::new(&id);
    wf.step(&step(""), &queue, event(1));
    assert!(refused(wf).await.contains("a step name is empty"));
    let mut wf = Workflow::new("x".repeat(257));
    wf.step(&step("a"), &queue, event(1));
    let err = graphs.publish_workflow(&wf).await.unwrap_err().to_string();
    assert!(err.contains("257 bytes; at most 256"), "{err}");
    // Two steps with one event id, and an event id a live invocation holds.
    let mut wf = Workflow::new(&id);
    wf.step(&step("a"), &queue, event(1).with_id("same"));
    wf.step(&step("b"), &queue, event(2).with_id("same"));
    assert!(refused(wf).await.contains("as another step of its queue"));
    let taken = queue.publish(event(9)).await.unwrap().id;
    let mut wf = Workflow::new(&id);
    wf.step(&step("a"), &queue, event(1));
    wf.step(&step("b"), &queue, event(2).with_id(taken))
        .after(["a"]);
    assert!(refused(wf).await.contains("held by a live invocation"));
    // Nothing of them was written.
    assert!(graphs.workflow(&id).await.unwrap().is_none());
    assert_eq!(crate::support::pending_total(&queue).await, 1);
}

pub async fn a_dependencys_death_or_cancel_follows_each_steps_rule<E: TitoEngine>(ctx: Ctx<E>) {
    let graphs = Graphs::new(ctx.db.clone());
    let queue = topic(&ctx.db, "rules", 2);
    let step = |name: &str| StepName::<String>::named(name);
    let id = fresh("rules");
    // "a" dies on its first run; "x" is cancelled before it runs (due in an hour).
    let mut wf = Workflow::new(&id);
    wf.step(&step("a"), &queue, QueueEvent::now("a", "a".to_string()));
    wf.step(
        &step("x"),
        &queue,
        QueueEvent::after("x", "x".to_string(), Duration::from_secs(3600)),
    );
    wf.step(
        &step("cancel"),
        &queue,
        QueueEvent::now("b", "cancel".to_string()),
    )
    .after(["a"]);
    wf.step(
        &step("after-cancel"),
        &queue,
        QueueEvent::now("b", "after-cancel".to_string()),
    )
    .after(["cancel"])
    .on_failure(OnFailure::RunAnyway);
    wf.step(
        &step("hold"),
        &queue,
        QueueEvent::now("c", "hold".to_string()),
    )
    .after(["a"])
    .on_failure(OnFailure::Hold);
    wf.step(
        &step("anyway"),
        &queue,
        QueueEvent::now("d", "anyway".to_string()),
    )
    .after(["a", "x"])
    .on_failure(OnFailure::RunAnyway);
    wf.step(
        &step("held-by-x"),
        &queue,
        QueueEvent::now("e", "held-by-x".to_string()),
    )
    .after(["x"])
    .on_failure(OnFailure::Hold);
    let published = graphs.publish_workflow(&wf).await.unwrap();
    let id_of = |name: &str| published.step_id(name).unwrap().to_string();
    assert!(queue.cancel(&id_of("x"), "not needed").await.unwrap());
    let fail_a = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let ran: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut workers = Workers::new();
    let (fail, log, reads, own) = (fail_a.clone(), ran.clone(), graphs.clone(), queue.clone());
    workers.spawn_worker(
        queue.clone(),
        fast(0..2).failure_policy(FailurePolicy::new(1)),
        move |event: QueueEvent<String>| {
            let (fail, log, graphs, own) = (fail.clone(), log.clone(), reads.clone(), own.clone());
            async move {
                log.lock().unwrap().push(event.payload.clone());
                // A handler reads invocation states (its own is pending while it runs).
                let state = own.invocation_state::<String>(&event.id).await?;
                assert!(
                    matches!(state, InvocationState::Pending { .. }),
                    "{state:?}"
                );
                if event.payload == "a" && fail.load(Ordering::SeqCst) {
                    return Err(TitoError::handler("a fails"));
                }
                if event.payload == "anyway" {
                    let a = graphs
                        .dependency(&event, &StepName::<String>::named("a"))
                        .await?;
                    assert!(matches!(a, Finished::Dead { .. }), "{a:?}");
                    let x = graphs
                        .dependency(&event, &StepName::<String>::named("x"))
                        .await?;
                    assert_eq!(x, Finished::Cancelled("not needed".into()));
                }
                QueueHandlerOutcome::acknowledge_with(&event.payload)
            }
        },
    );
    // "anyway" runs although both its dependencies failed.
    let anyway = await_finished(&queue, &id_of("anyway")).await;
    assert_eq!(
        anyway,
        Finished::Completed(Some(serde_json::json!("anyway")))
    );
    let cancelled = await_finished(&queue, &id_of("cancel")).await;
    assert_eq!(
        cancelled,
        Finished::Cancelled("dependency \"a\" died".into())
    );
    // A step that runs anyway after a cancelled one runs.
    let after = await_finished(&queue, &id_of("after-cancel")).await;
    assert_eq!(
        after,
        Finished::Completed(Some(serde_json::json!("after-cancel")))
    );
    // "hold" waits for the dead "a"; "held-by-x" for the cancelled "x": each still names it.
    for (held, on) in [("hold", "a"), ("held-by-x", "x")] {
        let state = queue
            .invocation_state::<String>(&id_of(held))
            .await
            .unwrap();
        assert_eq!(
            state,
            InvocationState::Waiting {
                on: vec![on.into()]
            },
            "{held}"
        );
    }
    // Retried and completed, "a" releases the step that held for it.
    fail_a.store(false, Ordering::SeqCst);
    assert!(queue.retry_dead(&id_of("a")).await.unwrap());
    let hold = await_finished(&queue, &id_of("hold")).await;
    assert_eq!(hold, Finished::Completed(Some(serde_json::json!("hold"))));
    // What holds for a cancelled step ends with its workflow.
    assert_eq!(graphs.cancel_workflow(&id, "done here").await.unwrap(), 1);
    let held = await_finished(&queue, &id_of("held-by-x")).await;
    assert_eq!(held, Finished::Cancelled("done here".into()));
    workers.shutdown().await.unwrap();
    let ran = ran.lock().unwrap().clone();
    for never in ["cancel", "held-by-x", "x"] {
        assert!(!ran.contains(&never.to_string()), "{never} ran: {ran:?}");
    }
    assert_eq!(ran.iter().filter(|s| *s == "hold").count(), 1, "{ran:?}");
    let state = graphs.workflow(&id).await.unwrap().unwrap();
    assert!(state.finished(), "{state:?}");
}

pub async fn a_workflow_is_cancelled_whole_by_id_by_owner_and_by_erasure<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let graphs = Graphs::new(ctx.db.clone());
    let queue = topic(&ctx.db, "cancels", 2);
    let step = |name: &str| StepName::<()>::named(name);
    let later = |key: &str| QueueEvent::after(key, 0u32, Duration::from_secs(3600));
    // A chain of 300 steps (more than one cancel transaction), the first due in an hour.
    let id = fresh("chain");
    let mut wf = Workflow::new(&id);
    wf.step(&step("s0"), &queue, later("k"));
    for n in 1..300 {
        wf.step(&step(&format!("s{n}")), &queue, later("k"))
            .after([format!("s{}", n - 1)]);
    }
    graphs.publish_workflow(&wf).await.unwrap();
    assert_eq!(
        graphs
            .cancel_workflow(&id, "order withdrawn")
            .await
            .unwrap(),
        300
    );
    let state = graphs.workflow(&id).await.unwrap().unwrap();
    assert_eq!(state.counts()[3], ("cancelled", 300));
    assert!(state.finished());
    assert_eq!(graphs.cancel_workflow(&id, "again").await.unwrap(), 0);
    assert_eq!(
        graphs
            .cancel_workflow("no-such-workflow", "x")
            .await
            .unwrap(),
        0
    );
    // By owner: the owner's waiting steps are cancelled too, and their dependents with them.
    let ada = QueueOwner::new("user", fresh("ada"));
    let id = fresh("owned");
    let mut wf = Workflow::new(&id);
    wf.step(&step("first"), &queue, later("k"));
    wf.step(&step("owned"), &queue, later("k").with_owner(ada.clone()))
        .after(["first"]);
    wf.step(&step("after"), &queue, later("k")).after(["owned"]);
    let published = graphs.publish_workflow(&wf).await.unwrap();
    assert_eq!(queue.cancel_owner(&ada, "account closed").await.unwrap(), 1);
    let after = published.step_id("after").unwrap();
    assert_eq!(
        queue.invocation_state::<()>(after).await.unwrap(),
        InvocationState::Finished(Finished::Cancelled(
            "dependency \"owned\" was cancelled".into()
        ))
    );
    // By erasure: the waiting step's row is deleted, its dependents end as after a cancel.
    let bob = QueueOwner::new("user", fresh("bob"));
    let id = fresh("erased");
    let mut wf = Workflow::new(&id);
    wf.step(&step("first"), &queue, later("k"));
    wf.step(&step("owned"), &queue, later("k").with_owner(bob.clone()))
        .after(["first"]);
    wf.step(&step("after"), &queue, later("k")).after(["owned"]);
    let published = graphs.publish_workflow(&wf).await.unwrap();
    let tx = ctx.db.begin().await.unwrap();
    let erased = queue
        .delete_by_owner_matching_in_tx::<u32, _>(&bob, |_| true, &tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(erased, 1);
    assert_eq!(
        queue
            .invocation_state::<()>(published.step_id("owned").unwrap())
            .await
            .unwrap(),
        InvocationState::Unknown
    );
    assert!(matches!(
        queue
            .invocation_state::<()>(published.step_id("after").unwrap())
            .await
            .unwrap(),
        InvocationState::Finished(Finished::Cancelled(_))
    ));
}

pub async fn a_workflow_joins_the_callers_transaction_and_publishes_once_per_id<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let graphs = Graphs::new(ctx.db.clone());
    let queue = topic(&ctx.db, "joined", 2);
    let id = fresh("joined");
    let build = || {
        let mut wf = Workflow::new(&id);
        wf.step(
            &StepName::<()>::new("one"),
            &queue,
            QueueEvent::now("k", 1u32),
        );
        wf.step(
            &StepName::<()>::new("two"),
            &queue,
            QueueEvent::now("k", 2u32),
        )
        .after(["one"]);
        wf
    };
    // Rolled back with the caller's data: nothing.
    let tx = ctx.db.begin().await.unwrap();
    tx.put(ctx.key("order"), b"paid".to_vec()).await.unwrap();
    graphs.publish_workflow_in_tx(&build(), &tx).await.unwrap();
    tx.rollback().await.unwrap();
    assert!(graphs.workflow(&id).await.unwrap().is_none());
    assert_eq!(crate::support::pending_total(&queue).await, 0);
    // Committed with it: there, once.
    let tx = ctx.db.begin().await.unwrap();
    tx.put(ctx.key("order"), b"paid".to_vec()).await.unwrap();
    let first = graphs.publish_workflow_in_tx(&build(), &tx).await.unwrap();
    tx.commit().await.unwrap();
    // Published again (fresh event ids): a duplicate answering the stored steps' ids.
    let again = graphs.publish_workflow(&build()).await.unwrap();
    assert!(again.duplicate);
    assert_eq!(again.steps, first.steps);
    assert_eq!(crate::support::pending_total(&queue).await, 1);
    let listed = graphs.workflows(None, 1000).await.unwrap();
    assert!(listed.iter().any(|w| w.id == id && w.steps == 2));
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Work {
    n: u32,
}

/// Callbacks seen, by batch and callback.
type Calls = Arc<Mutex<HashMap<(String, BatchCallback), Vec<BatchDone<String>>>>>;

fn callback_worker<E: TitoEngine>(workers: &mut Workers, queue: &Arc<Queue<E>>, calls: &Calls) {
    let calls = calls.clone();
    workers.spawn_worker(
        queue.clone(),
        fast(0..2),
        move |event: QueueEvent<BatchDone<String>>| {
            let calls = calls.clone();
            async move {
                let done = event.payload;
                calls
                    .lock()
                    .unwrap()
                    .entry((done.batch.clone(), done.callback))
                    .or_default()
                    .push(done);
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
}

pub async fn a_batch_calls_back_once_with_its_counts<E: TitoEngine>(ctx: Ctx<E>) {
    let graphs = Graphs::new(ctx.db.clone());
    let jobs = topic(&ctx.db, "batch-jobs", 4);
    let callbacks = topic(&ctx.db, "batch-callbacks", 2);
    let id = fresh("batch");
    let batch = Batch::new(&id)
        .on_complete(&callbacks, QueueEvent::now("cb", "all ended".to_string()))
        .on_success(
            &callbacks,
            QueueEvent::now("cb", "all completed".to_string()),
        )
        .on_death(&callbacks, QueueEvent::now("cb", "one died".to_string()));
    // 60 children: n % 10 == 3 dies (two of them at least), n == 7 is cancelled.
    let events: Vec<QueueEvent<Work>> = (0..60)
        .map(|n| QueueEvent::now(format!("k{n}"), Work { n }))
        .collect();
    let cancel_id = events[7].id.clone();
    let published = graphs
        .publish_batch(&batch, &jobs, &events)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(published.len(), 60);
    assert!(jobs.cancel(&cancel_id, "not needed").await.unwrap());
    // Published again: nothing new.
    assert!(
        graphs
            .publish_batch(&batch, &jobs, &events)
            .await
            .unwrap()
            .is_none()
    );
    let calls: Calls = Arc::default();
    let mut workers = Workers::new();
    callback_worker(&mut workers, &callbacks, &calls);
    workers.spawn_worker(
        jobs.clone(),
        fast(0..4).failure_policy(FailurePolicy::new(1)),
        |event: QueueEvent<Work>| async move {
            assert!(event.batch.is_some());
            if event.payload.n % 10 == 3 {
                return Err(TitoError::handler("it fails"));
            }
            Ok(QueueHandlerOutcome::Acknowledge)
        },
    );
    let seen = calls.clone();
    let key = id.clone();
    wait_for(
        "the complete callback",
        Duration::from_secs(30),
        move || {
            let seen = seen.clone();
            let key = key.clone();
            async move {
                seen.lock()
                    .unwrap()
                    .contains_key(&(key, BatchCallback::Complete))
            }
        },
    )
    .await;
    // Let anything doubled show up before counting.
    tokio::time::sleep(Duration::from_millis(300)).await;
    workers.shutdown().await.unwrap();
    let calls = calls.lock().unwrap().clone();
    let complete = &calls[&(id.clone(), BatchCallback::Complete)];
    assert_eq!(complete.len(), 1, "{complete:?}");
    assert_eq!(complete[0].context, "all ended");
    let counts = complete[0].counts;
    assert_eq!(
        (
            counts.added,
            counts.completed,
            counts.cancelled,
            counts.dead
        ),
        (60, 53, 1, 6)
    );
    let death = &calls[&(id.clone(), BatchCallback::Death)];
    assert_eq!(
        death.len(),
        1,
        "one death callback for six deaths: {death:?}"
    );
    assert!(death[0].counts.dead >= 1);
    assert!(!calls.contains_key(&(id.clone(), BatchCallback::Success)));
    let state = graphs.batch(&id).await.unwrap().unwrap();
    assert!(state.finished());
    assert_eq!(state.counts, counts);
    assert_eq!(
        state.callbacks,
        vec![
            (BatchCallback::Complete, true),
            (BatchCallback::Success, false),
            (BatchCallback::Death, true)
        ]
    );
    // A child retried from the dead state runs again outside the batch: the counts stay.
    let dead_id = &published[3].id;
    assert!(jobs.retry_dead(dead_id).await.unwrap());
    assert_eq!(graphs.batch(&id).await.unwrap().unwrap().counts, counts);
    // An empty batch calls back at its close.
    let empty = fresh("empty");
    let batch = Batch::new(&empty).on_success(
        &callbacks,
        QueueEvent::now("cb", "nothing to do".to_string()),
    );
    graphs
        .publish_batch::<Work>(&batch, &jobs, &[])
        .await
        .unwrap()
        .unwrap();
    let state = graphs.batch(&empty).await.unwrap().unwrap();
    assert_eq!(state.callbacks, vec![(BatchCallback::Success, true)]);
}

pub async fn a_batch_filled_over_time_calls_back_only_after_its_close<E: TitoEngine>(ctx: Ctx<E>) {
    let graphs = Graphs::new(ctx.db.clone());
    let jobs = topic(&ctx.db, "filled-jobs", 2);
    let callbacks = topic(&ctx.db, "filled-callbacks", 2);
    let id = fresh("filled");
    let batch = Batch::new(&id).on_success(&callbacks, QueueEvent::now("cb", "done".to_string()));
    // Not open yet: refused.
    let err = graphs
        .add_to_batch(&id, &jobs, &[QueueEvent::now("k", Work { n: 0 })])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("open it first"), "{err}");
    assert!(graphs.open_batch(&batch).await.unwrap());
    assert!(!graphs.open_batch(&batch).await.unwrap());
    let calls: Calls = Arc::default();
    let ran = Arc::new(AtomicUsize::new(0));
    let mut workers = Workers::new();
    callback_worker(&mut workers, &callbacks, &calls);
    let counter = ran.clone();
    workers.spawn_worker(jobs.clone(), fast(0..2), move |_: QueueEvent<Work>| {
        let counter = counter.clone();
        async move {
            counter.fetch_add(1, Ordering::SeqCst);
            Ok(QueueHandlerOutcome::Acknowledge)
        }
    });
    for round in 0..3u32 {
        let events: Vec<_> = (0..5)
            .map(|n| QueueEvent::now(format!("k{n}"), Work { n: round * 10 + n }))
            .collect();
        graphs.add_to_batch(&id, &jobs, &events).await.unwrap();
        let counter = ran.clone();
        let want = (round as usize + 1) * 5;
        wait_for("the children", Duration::from_secs(30), move || {
            let counter = counter.clone();
            async move { counter.load(Ordering::SeqCst) == want }
        })
        .await;
        // Every child so far ended, the batch is open: no callback.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            calls.lock().unwrap().is_empty(),
            "called back before the close"
        );
    }
    assert!(graphs.close_batch(&id).await.unwrap());
    assert!(!graphs.close_batch(&id).await.unwrap());
    let err = graphs
        .add_to_batch(&id, &jobs, &[QueueEvent::now("k", Work { n: 0 })])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("is closed"), "{err}");
    let seen = calls.clone();
    wait_for("the success callback", Duration::from_secs(30), move || {
        let seen = seen.clone();
        async move { !seen.lock().unwrap().is_empty() }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    workers.shutdown().await.unwrap();
    let calls = calls.lock().unwrap().clone();
    let success = &calls[&(id.clone(), BatchCallback::Success)];
    assert_eq!(success.len(), 1);
    assert_eq!(success[0].counts.completed, 15);
    // Cancelling a finished batch cancels nothing.
    assert_eq!(graphs.cancel_batch(&id, "late").await.unwrap(), 0);
}

pub async fn concurrent_last_children_start_each_callback_once<E: TitoEngine>(ctx: Ctx<E>) {
    // Two workers on two handles (as two processes would be), each holding half the
    // partitions: the children of a batch end in both at once, and its callback must start
    // once. Many small batches make the race of the last two children common.
    let graphs = Graphs::new(ctx.db.clone());
    let jobs_a = topic(&ctx.db, "race-jobs", 4);
    let jobs_b = topic(&ctx.db, "race-jobs", 4);
    let callbacks = topic(&ctx.db, "race-callbacks", 2);
    let calls: Calls = Arc::default();
    let mut workers = Workers::new();
    callback_worker(&mut workers, &callbacks, &calls);
    for (jobs, partitions) in [(&jobs_a, 0..2), (&jobs_b, 2..4)] {
        workers.spawn_worker(
            jobs.clone(),
            fast(partitions).concurrency(4),
            |_: QueueEvent<Work>| async move { Ok(QueueHandlerOutcome::Acknowledge) },
        );
    }
    let mut ids = Vec::new();
    for b in 0..20 {
        let id = fresh(&format!("race{b}"));
        let batch = Batch::new(&id).on_complete(&callbacks, QueueEvent::now("cb", format!("{b}")));
        let events: Vec<_> = (0..8)
            .map(|n| QueueEvent::now(format!("k{n}"), Work { n }))
            .collect();
        graphs
            .publish_batch(&batch, &jobs_a, &events)
            .await
            .unwrap()
            .unwrap();
        ids.push(id);
    }
    let seen = calls.clone();
    wait_for("every callback", Duration::from_secs(60), move || {
        let seen = seen.clone();
        async move { seen.lock().unwrap().len() == 20 }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    workers.shutdown().await.unwrap();
    let calls = calls.lock().unwrap().clone();
    for id in &ids {
        let complete = &calls[&(id.clone(), BatchCallback::Complete)];
        assert_eq!(complete.len(), 1, "batch {id}: {complete:?}");
        assert_eq!(complete[0].counts.completed, 8);
    }
}

/// Publishes workflow `id` on `queue`: step a (due after `a_after`), then b after it.
async fn two_steps<E: TitoEngine>(
    graphs: &Graphs<E>,
    queue: &Arc<Queue<E>>,
    id: &str,
    a_after: Duration,
) {
    let step = |name: &str| StepName::<()>::named(name);
    let mut wf = Workflow::new(id);
    wf.step(&step("a"), queue, QueueEvent::after("k", 1u32, a_after));
    wf.step(&step("b"), queue, QueueEvent::now("k", 2u32))
        .after(["a"]);
    graphs.publish_workflow(&wf).await.unwrap();
}

pub async fn finished_graphs_expire_and_unfinished_ones_stay<E: TitoEngine>(ctx: Ctx<E>) {
    // A sweep of the whole store: on a cluster shared by concurrent tests (TITO_PD_ENDPOINTS)
    // it would delete their finished graphs under them. Every store here is the test's own.
    if std::env::var("TITO_PD_ENDPOINTS").is_ok() {
        return;
    }
    let graphs = Graphs::new(ctx.db.clone());
    let queue = topic(&ctx.db, "expiring", 2);
    // "done" finishes (its one step is cancelled); "open" waits for a step due in an hour.
    let (done, open) = (fresh("done"), fresh("open"));
    two_steps(&graphs, &queue, &done, Duration::ZERO).await;
    assert_eq!(graphs.cancel_workflow(&done, "finished").await.unwrap(), 2);
    two_steps(&graphs, &queue, &open, Duration::from_secs(3600)).await;
    // An empty closed batch has finished; one still open has not.
    let (ended, filling) = (fresh("ended"), fresh("filling"));
    graphs
        .publish_batch::<u32>(&Batch::new(&ended), &queue, &[])
        .await
        .unwrap();
    graphs.open_batch(&Batch::new(&filling)).await.unwrap();
    // Not old enough yet: nothing goes.
    let kept = graphs.expire(Duration::from_secs(3600)).await.unwrap();
    assert_eq!((kept.workflows, kept.batches), (0, 0));
    tokio::time::sleep(Duration::from_millis(20)).await;
    let expired = graphs.expire(Duration::ZERO).await.unwrap();
    assert!(
        expired.workflows >= 1 && expired.batches >= 1,
        "{expired:?}"
    );
    assert!(graphs.workflow(&done).await.unwrap().is_none());
    assert!(graphs.batch(&ended).await.unwrap().is_none());
    assert!(graphs.workflow(&open).await.unwrap().is_some());
    assert!(graphs.batch(&filling).await.unwrap().is_some());
    // Nothing of the finished workflow is left behind.
    let tx = ctx.db.begin().await.unwrap();
    for prefix in ["workflow-step:", "workflow-edge:"] {
        let end = format!("{}~", prefix);
        let rows = tx
            .scan(prefix.as_bytes(), end.as_bytes(), 10_000)
            .await
            .unwrap();
        assert!(
            rows.iter()
                .all(|(k, _)| !String::from_utf8_lossy(k).contains(&done)),
            "{prefix}"
        );
    }
    tx.rollback().await.unwrap();
    // The open workflow still runs to its end.
    let state = graphs.workflow(&open).await.unwrap().unwrap();
    assert_eq!(state.counts()[0], ("waiting", 1));
}

pub async fn a_workers_maintenance_expires_finished_graphs_in_turn_across_a_restart<
    E: TitoEngine,
>(
    ctx: Ctx<E>,
) {
    // A sweep of the whole store (see finished_graphs_expire_and_unfinished_ones_stay).
    if std::env::var("TITO_PD_ENDPOINTS").is_ok() {
        return;
    }
    let graphs = Graphs::new(ctx.db.clone());
    let queue = topic(&ctx.db, "graph-sweep", 2);
    // More finished batches than one pass looks at (256), an open one, a workflow the worker
    // runs to its end and one that waits an hour.
    let ended: Vec<String> = (0..300).map(|i| fresh(&format!("ended{i}"))).collect();
    for id in &ended {
        graphs
            .publish_batch::<u32>(&Batch::new(id), &queue, &[])
            .await
            .unwrap();
    }
    let filling = fresh("filling");
    graphs.open_batch(&Batch::new(&filling)).await.unwrap();
    let (runs, waits) = (fresh("runs"), fresh("waits"));
    two_steps(&graphs, &queue, &runs, Duration::ZERO).await;
    two_steps(&graphs, &queue, &waits, Duration::from_secs(3600)).await;
    let handler = |_event: QueueEvent<u32>| async move { Ok(QueueHandlerOutcome::Acknowledge) };
    let config = || fast(0..2).maintenance_interval(Duration::from_millis(50));

    // A worker that keeps finished graphs for an hour runs the workflow to its end and
    // deletes nothing.
    let mut workers = Workers::new();
    workers.spawn_worker(
        queue.clone(),
        config().expire_graphs(Duration::from_secs(3600)),
        handler,
    );
    let (g, id) = (graphs.clone(), runs.clone());
    wait_for(
        "the workflow to finish",
        Duration::from_secs(30),
        move || {
            let (g, id) = (g.clone(), id.clone());
            async move { g.workflow(&id).await.unwrap().unwrap().finished() }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    workers.shutdown().await.unwrap();
    for id in &ended {
        assert!(graphs.batch(id).await.unwrap().is_some(), "{id} is young");
    }

    // Restarted with no retention: every finished graph goes, in passes of 256, and the
    // unfinished ones stay.
    let mut workers = Workers::new();
    workers.spawn_worker(
        queue.clone(),
        config().expire_graphs(Duration::ZERO),
        handler,
    );
    let (g, all) = (graphs.clone(), ended.clone());
    wait_for(
        "the finished graphs to expire",
        Duration::from_secs(30),
        move || {
            let (g, all) = (g.clone(), all.clone());
            async move {
                for id in &all {
                    if g.batch(id).await.unwrap().is_some() {
                        return false;
                    }
                }
                true
            }
        },
    )
    .await;
    let (g, id) = (graphs.clone(), runs.clone());
    wait_for(
        "the workflow to expire",
        Duration::from_secs(30),
        move || {
            let (g, id) = (g.clone(), id.clone());
            async move { g.workflow(&id).await.unwrap().is_none() }
        },
    )
    .await;
    workers.shutdown().await.unwrap();
    assert!(graphs.batch(&filling).await.unwrap().is_some());
    let state = graphs.workflow(&waits).await.unwrap().unwrap();
    assert_eq!(state.counts()[0], ("waiting", 1));
}

pub async fn cancel_batch_cancels_only_its_own_children<E: TitoEngine>(ctx: Ctx<E>) {
    let graphs = Graphs::new(ctx.db.clone());
    let jobs = topic(&ctx.db, "own-children", 2);
    let id = fresh("own");
    // "x" dies at once; "y" waits an hour.
    let (x, y) = (fresh("x"), fresh("y"));
    let children = vec![
        QueueEvent::now("k", Work { n: 1 }).with_id(&x),
        QueueEvent::after("k", Work { n: 2 }, Duration::from_secs(3600)).with_id(&y),
    ];
    graphs
        .publish_batch(&Batch::new(&id), &jobs, &children)
        .await
        .unwrap();
    let mut workers = Workers::new();
    workers.spawn_worker(
        jobs.clone(),
        fast(0..2).failure_policy(FailurePolicy::new(1)),
        |_: QueueEvent<Work>| async move {
            Err::<QueueHandlerOutcome<Work>, _>(TitoError::handler("dies"))
        },
    );
    assert!(matches!(
        await_finished(&jobs, &x).await,
        Finished::Dead { .. }
    ));
    workers.shutdown().await.unwrap();
    // Its id freed and published again outside the batch: no child of it.
    assert!(jobs.discard_dead(&x).await.unwrap());
    let again = QueueEvent::after("k", Work { n: 3 }, Duration::from_secs(3600)).with_id(&x);
    assert!(!jobs.publish(again).await.unwrap().duplicate);
    assert_eq!(graphs.cancel_batch(&id, "stop").await.unwrap(), 1);
    assert_eq!(
        jobs.invocation_state::<Work>(&x).await.unwrap(),
        InvocationState::Pending { attempt: 1 }
    );
    assert_eq!(
        jobs.invocation_state::<Work>(&y).await.unwrap(),
        InvocationState::Finished(Finished::Cancelled("stop".into()))
    );
    let state = graphs.batch(&id).await.unwrap().unwrap();
    assert_eq!((state.counts.dead, state.counts.cancelled), (1, 1));
    assert!(state.finished());
}

pub async fn publish_batch_writes_in_bounded_transactions_and_resumes<E: TitoEngine>(ctx: Ctx<E>) {
    let graphs = Graphs::new(ctx.db.clone());
    let jobs = topic(&ctx.db, "resumed", 4);
    let id = fresh("resumed");
    let batch = Batch::new(&id);
    // 2,500 children (three transactions); a first attempt got 300 of them in and failed.
    let events: Vec<QueueEvent<Work>> = (0..2_500)
        .map(|n| QueueEvent::after(format!("k{n}"), Work { n }, Duration::from_secs(3600)))
        .collect();
    assert!(graphs.open_batch(&batch).await.unwrap());
    graphs
        .add_to_batch(&id, &jobs, &events[..300])
        .await
        .unwrap();
    // Published again: the rest is added, the first 300 are duplicates, and it is closed.
    let answers = graphs
        .publish_batch(&batch, &jobs, &events)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(answers.len(), 2_500);
    assert_eq!(answers.iter().filter(|a| a.duplicate).count(), 300);
    let state = graphs.batch(&id).await.unwrap().unwrap();
    assert!(state.closed);
    assert_eq!((state.counts.added, state.counts.open()), (2_500, 2_500));
    // Closed: published again, nothing.
    assert!(
        graphs
            .publish_batch(&batch, &jobs, &events)
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(crate::support::pending_total(&jobs).await, 2_500);
}

pub async fn a_periodic_job_starts_a_workflow_once_per_tick<E: TitoEngine>(ctx: Ctx<E>) {
    use tito::queue::{PeriodicJob, Schedule};
    let graphs = Graphs::new(ctx.db.clone());
    let nightly = topic(&ctx.db, "nightly", 1);
    let steps = topic(&ctx.db, "nightly-steps", 2);
    let prefix = fresh("nightly");
    let mut workers = Workers::new();
    let every = Schedule::every("nightly", Duration::from_secs(1)).unwrap();
    workers.spawn_periodic(nightly.clone(), vec![PeriodicJob::new(every, 0u32)]);
    // Each tick's handler publishes a workflow in its own outcome transaction: a workflow per
    // tick, and none for a tick whose outcome did not commit.
    let (reads, into, tag) = (graphs.clone(), steps.clone(), prefix.clone());
    workers.spawn_transactional_worker(
        nightly.clone(),
        fast(0..1),
        move |event: QueueEvent<u32>, tx| {
            let (graphs, steps, tag) = (reads.clone(), into.clone(), tag.clone());
            async move {
                let mut workflow = Workflow::new(format!("{tag}-{}", event.id));
                workflow.step(
                    &StepName::<()>::new("export"),
                    &steps,
                    QueueEvent::now("k", 1u32),
                );
                workflow
                    .step(
                        &StepName::<()>::new("report"),
                        &steps,
                        QueueEvent::now("k", 2u32),
                    )
                    .after(["export"]);
                graphs.publish_workflow_in_tx(&workflow, &tx).await?;
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    workers.spawn_worker(steps.clone(), fast(0..2), |_: QueueEvent<u32>| async move {
        Ok(QueueHandlerOutcome::Acknowledge)
    });
    let watch = (graphs.clone(), prefix.clone());
    wait_for(
        "two finished nightly workflows",
        Duration::from_secs(30),
        move || {
            let (graphs, prefix) = watch.clone();
            async move {
                let mut finished = 0;
                for w in graphs.workflows(None, 1000).await.unwrap() {
                    if w.id.starts_with(&prefix)
                        && graphs.workflow(&w.id).await.unwrap().unwrap().finished()
                    {
                        finished += 1;
                    }
                }
                finished >= 2
            }
        },
    )
    .await;
    workers.shutdown().await.unwrap();
    // One workflow per tick completed by the nightly queue, each finished or still running.
    let ours: Vec<_> = graphs
        .workflows(None, 1000)
        .await
        .unwrap()
        .into_iter()
        .filter(|w| w.id.starts_with(&prefix))
        .collect();
    assert_eq!(ours.len() as u64, nightly.stats().acknowledged, "{ours:?}");
    for w in &ours {
        assert_eq!(w.steps, 2);
    }
}

/// The work of [`graphs_run_on_cluster_nodes_across_a_crash`]: a workflow's step (its layer and
/// place) or a batch's child.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Layered {
    Step { layer: u32, i: u32 },
    Child(u32),
}

const LAYERS: u32 = 5;
const WIDTH: u32 = 3;

fn layer_step(layer: u32, i: u32) -> StepName<u64> {
    StepName::named(format!("l{layer}-{i}"))
}

pub async fn graphs_run_on_cluster_nodes_across_a_crash<E: TitoEngine>(ctx: Ctx<E>) {
    use tito::queue::{ClusterConfig, cluster_state, run_cluster_worker};
    // A workflow of five layers of three steps (each step after every step of the layer
    // before, its result one more than the sum of theirs) and a 120-child batch, run by cluster
    // nodes on their own handles; one node crashes part way and another joins. Each step reads
    // its dependencies' results (completed, or the step is a violation); the batch calls back
    // once with every child completed. Node a's handlers never finish: what it started must be
    // run again by the others once its leases lapse.
    let graphs = Graphs::new(ctx.db.clone());
    let handle = || topic(&ctx.db, "cl-graph", 4);
    let callbacks = topic(&ctx.db, "cl-graph-callbacks", 1);
    let calls: Calls = Arc::default();
    let violations: Arc<Mutex<Vec<String>>> = Arc::default();
    let children_run: Arc<Mutex<std::collections::BTreeSet<u32>>> = Arc::default();
    let hung = Arc::new(AtomicUsize::new(0));
    let node = |name: &str| {
        let queue = handle();
        let (reads, violations, run) = (
            Graphs::new(ctx.db.clone()),
            violations.clone(),
            children_run.clone(),
        );
        let (hangs, hung) = (name == "a", hung.clone());
        let (stop, rx) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(run_cluster_worker(
            queue,
            fast(0..0).concurrency(2),
            ClusterConfig::new()
                .node_id(name)
                .node_ttl(Duration::from_secs(2))
                .coordinator_ttl(Duration::from_secs(2))
                .drop_after(Duration::from_millis(600)),
            move |event: QueueEvent<Layered>| {
                let (graphs, violations, run) = (reads.clone(), violations.clone(), run.clone());
                let hung = hung.clone();
                async move {
                    if hangs {
                        hung.fetch_add(1, Ordering::SeqCst);
                        std::future::pending::<()>().await;
                    }
                    tokio::time::sleep(Duration::from_millis(3)).await;
                    match event.payload {
                        Layered::Child(n) => {
                            run.lock().unwrap().insert(n);
                            Ok(QueueHandlerOutcome::Acknowledge)
                        }
                        Layered::Step { layer: 0, .. } => {
                            QueueHandlerOutcome::acknowledge_with(&1u64)
                        }
                        Layered::Step { layer, i } => {
                            let mut sum = 0u64;
                            for d in 0..WIDTH {
                                match graphs.dependency(&event, &layer_step(layer - 1, d)).await? {
                                    Finished::Completed(Some(v)) => sum += v,
                                    other => violations.lock().unwrap().push(format!(
                                        "l{layer}-{i} ran with l{}-{d} {other:?}",
                                        layer - 1
                                    )),
                                }
                            }
                            QueueHandlerOutcome::acknowledge_with(&(sum + 1))
                        }
                    }
                }
            },
            rx,
        ));
        (stop, task)
    };
    let mut callback_workers = Workers::new();
    callback_worker(&mut callback_workers, &callbacks, &calls);
    let (a, b) = (node("a"), node("b"));
    let publisher = handle();
    let watch = publisher.clone();
    wait_for(
        "nodes a and b to share the partitions",
        Duration::from_secs(30),
        move || {
            let q = watch.clone();
            async move {
                let s = cluster_state(&q).await.unwrap();
                s.members.len() == 2 && s.assignment.len() == 4 && s.leases == s.assignment
            }
        },
    )
    .await;
    let id = fresh("cl-wf");
    let mut workflow = Workflow::new(&id);
    for layer in 0..LAYERS {
        for i in 0..WIDTH {
            let step = workflow.step(
                &layer_step(layer, i),
                &publisher,
                QueueEvent::now(format!("s{i}"), Layered::Step { layer, i }),
            );
            if layer > 0 {
                step.after((0..WIDTH).map(|d| layer_step(layer - 1, d).name().to_string()));
            }
        }
    }
    let published = graphs.publish_workflow(&workflow).await.unwrap();
    let batch_id = fresh("cl-batch");
    let batch =
        Batch::new(&batch_id).on_complete(&callbacks, QueueEvent::now("cb", "done".to_string()));
    let children: Vec<_> = (0..120)
        .map(|n| QueueEvent::now(format!("c{}", n % 7), Layered::Child(n)))
        .collect();
    graphs
        .publish_batch(&batch, &publisher, &children)
        .await
        .unwrap()
        .unwrap();
    // Node a crashes with both its handlers in flight; node c joins.
    reaches("node a to start two handlers", &hung, 2).await;
    a.1.abort();
    let c = node("c");
    let last = published
        .step_id(layer_step(LAYERS - 1, 0).name())
        .unwrap()
        .to_string();
    let done = publisher
        .await_result::<u64>(&last, Duration::from_secs(120))
        .await
        .unwrap();
    // Each layer's result is WIDTH times the last one's, plus one: 1, 4, 13, 40, 121.
    let want = (0..LAYERS).fold(0u64, |r, _| r * WIDTH as u64 + 1);
    assert_eq!(done, Some(Finished::Completed(Some(want))));
    let key = (batch_id.clone(), BatchCallback::Complete);
    called_back(&calls, &key).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for (stop, task) in [b, c] {
        stop.send(true).unwrap();
        task.await.unwrap().unwrap();
    }
    callback_workers.shutdown().await.unwrap();
    assert_eq!(violations.lock().unwrap().clone(), Vec::<String>::new());
    let complete = calls.lock().unwrap()[&key].clone();
    assert_eq!(complete.len(), 1, "{complete:?}");
    assert_eq!(
        (complete[0].counts.completed, complete[0].counts.dead),
        (120, 0)
    );
    // Every child ran to its end on b or c, those a held included.
    assert_eq!(children_run.lock().unwrap().len(), 120);
    let state = graphs.workflow(&id).await.unwrap().unwrap();
    assert!(state.finished(), "{state:?}");
}

/// Waits until `calls` holds callback `key` (a batch and a callback).
async fn called_back(calls: &Calls, key: &(String, BatchCallback)) {
    let (seen, key) = (calls.clone(), key.clone());
    wait_for("a batch's callback", Duration::from_secs(60), move || {
        let (seen, key) = (seen.clone(), key.clone());
        async move { seen.lock().unwrap().contains_key(&key) }
    })
    .await;
}

/// Waits until `counter` is at least `n`.
async fn reaches(what: &str, counter: &Arc<AtomicUsize>, n: usize) {
    let counter = counter.clone();
    wait_for(what, Duration::from_secs(60), move || {
        let reached = counter.load(Ordering::SeqCst) >= n;
        async move { reached }
    })
    .await;
}

/// A queue whose completed rows `expire_completed` deletes at once.
fn forgetful<E: TitoEngine>(db: &E, name: &str) -> Arc<Queue<E>> {
    Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(2, Duration::ZERO).topic(name),
    ))
}

/// Expires `queue`'s completed rows until the invocation of `id` is gone (a row is past a zero
/// retention once the clock moved past its commit).
async fn forget<E: TitoEngine>(queue: &Arc<Queue<E>>, id: &str) {
    let (queue, id) = (queue.clone(), id.to_string());
    wait_for(
        "the completed row to expire",
        Duration::from_secs(30),
        move || {
            let (queue, id) = (queue.clone(), id.clone());
            async move {
                queue.expire_completed().await.unwrap();
                matches!(
                    queue
                        .invocation_state::<serde_json::Value>(&id)
                        .await
                        .unwrap(),
                    InvocationState::Unknown
                )
            }
        },
    )
    .await;
}

pub async fn a_step_id_taken_after_retention_is_no_step_of_its_workflow<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    // Steps a → b, b held (a far due time, then a gate). a completes, retention deletes its row, and an
    // unrelated job takes a's event id and completes with another result. b must read a as
    // gone (NotFound), never the other job's result; the workflow must not count the other
    // job as its step, and cancelling the workflow must not touch it.
    let graphs = Graphs::new(ctx.db.clone());
    // The worker keeps completed rows for an hour (its maintenance runs retention at its
    // start, and a zero retention there could delete a's row before the test reads it);
    // retention is run by the test, through a handle that keeps nothing.
    let steps = topic(&ctx.db, "reused-steps", 2);
    let forgetting = forgetful(&ctx.db, "reused-steps");
    let wf = fresh("reused");
    const A: StepName<String> = StepName::new("a");
    const B: StepName<String> = StepName::new("b");
    let mut workflow = Workflow::new(&wf);
    workflow.step(&A, &steps, QueueEvent::now("a", "mine".to_string()));
    workflow
        .step(
            &B,
            &steps,
            QueueEvent::after("b", "reader".to_string(), Duration::from_secs(3600)),
        )
        .after([&A]);
    let published = graphs.publish_workflow(&workflow).await.unwrap();
    let a_id = published.step_id("a").unwrap().to_string();
    let read: Arc<Mutex<Vec<String>>> = Arc::default();
    let gate = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (reads, seen, open) = (graphs.clone(), read.clone(), gate.clone());
    let mut workers = Workers::new();
    workers.spawn_worker(
        steps.clone(),
        fast(0..2).concurrency(4),
        move |event: QueueEvent<String>| {
            let (graphs, seen, open) = (reads.clone(), seen.clone(), open.clone());
            async move {
                while event.payload == "gate" && !open.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                if event.payload == "reader" {
                    let got = graphs.dependency(&event, &A).await;
                    seen.lock().unwrap().push(format!("{got:?}"));
                }
                QueueHandlerOutcome::acknowledge_with(&format!("result of {}", event.payload))
            }
        },
    );
    assert_eq!(
        await_finished(&steps, &a_id).await,
        Finished::Completed(Some(serde_json::json!("result of mine")))
    );
    forget(&forgetting, &a_id).await;
    // The unrelated job, under a's id, held pending until it is cancelled or run.
    let other = steps
        .publish(
            QueueEvent::after("x", "other".to_string(), Duration::from_secs(3600)).with_id(&a_id),
        )
        .await
        .unwrap();
    assert!(!other.duplicate);
    let state = graphs.workflow(&wf).await.unwrap().unwrap();
    assert_eq!(state.steps[0].state, InvocationState::Unknown, "{state:?}");
    // Cancelling the workflow cancels b (still waiting for its time) and not the other job.
    let b_id = published.step_id("b").unwrap().to_string();
    assert_eq!(
        graphs
            .cancel_workflow(&wf, "no longer needed")
            .await
            .unwrap(),
        1
    );
    assert!(matches!(
        steps.invocation_state::<String>(&a_id).await.unwrap(),
        InvocationState::Pending { .. }
    ));
    assert!(matches!(
        steps.invocation_state::<String>(&b_id).await.unwrap(),
        InvocationState::Finished(Finished::Cancelled(_))
    ));
    // Another workflow the same way, whose b runs once a gate step ends: it reads a as past
    // retention.
    const GATE: StepName<String> = StepName::new("gate");
    let wf2 = fresh("reused2");
    let mut workflow = Workflow::new(&wf2);
    workflow.step(&A, &steps, QueueEvent::now("a", "mine".to_string()));
    workflow.step(&GATE, &steps, QueueEvent::now("g", "gate".to_string()));
    workflow
        .step(&B, &steps, QueueEvent::now("b", "reader".to_string()))
        .after([&A, &GATE]);
    let published = graphs.publish_workflow(&workflow).await.unwrap();
    let a2 = published.step_id("a").unwrap().to_string();
    await_finished(&steps, &a2).await;
    forget(&forgetting, &a2).await;
    let other = steps
        .publish(QueueEvent::now("x", "other".to_string()).with_id(&a2))
        .await
        .unwrap();
    assert!(!other.duplicate);
    gate.store(true, Ordering::SeqCst);
    let b2 = published.step_id("b").unwrap().to_string();
    await_finished(&steps, &b2).await;
    workers.shutdown().await.unwrap();
    let read = read.lock().unwrap().clone();
    assert_eq!(read.len(), 1, "{read:?}");
    assert!(
        read[0].contains("NotFound") && read[0].contains("completed_retention"),
        "{read:?}"
    );
}

pub async fn a_batch_published_again_after_retention_adds_no_child_twice<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    // A publication got 300 of 1,500 children in and failed; those ran and retention deleted
    // their rows. Published again, the batch adds the other 1,200 only, and calls back once
    // with 1,500.
    let graphs = Graphs::new(ctx.db.clone());
    let jobs = forgetful(&ctx.db, "resumed-late");
    let callbacks = topic(&ctx.db, "resumed-late-callbacks", 1);
    let calls: Calls = Arc::default();
    let id = fresh("late");
    let batch = Batch::new(&id).on_complete(&callbacks, QueueEvent::now("cb", "done".to_string()));
    let events: Vec<QueueEvent<Work>> = (0..1_500)
        .map(|n| QueueEvent::now(format!("k{}", n % 16), Work { n }))
        .collect();
    assert!(graphs.open_batch(&batch).await.unwrap());
    graphs
        .add_to_batch(&id, &jobs, &events[..300])
        .await
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let mut workers = Workers::new();
    callback_worker(&mut workers, &callbacks, &calls);
    let counted = runs.clone();
    workers.spawn_worker(
        jobs.clone(),
        fast(0..2).concurrency(8),
        move |_: QueueEvent<Work>| {
            let counted = counted.clone();
            async move {
                counted.fetch_add(1, Ordering::SeqCst);
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    reaches("the first 300 children", &runs, 300).await;
    for event in &events[..300] {
        forget(&jobs, &event.id).await;
    }
    let answers = graphs
        .publish_batch(&batch, &jobs, &events)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(answers.len(), 1_500);
    assert_eq!(answers.iter().filter(|a| a.duplicate).count(), 300);
    let key = (id.clone(), BatchCallback::Complete);
    called_back(&calls, &key).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    workers.shutdown().await.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1_500);
    let complete = calls.lock().unwrap()[&key].clone();
    assert_eq!(complete.len(), 1);
    assert_eq!(
        (complete[0].counts.added, complete[0].counts.completed),
        (1_500, 1_500)
    );
}

pub async fn two_publications_of_one_batch_at_once_both_succeed<E: TitoEngine>(ctx: Ctx<E>) {
    // Two replicas of one job publish the same 3,500-child batch at once: each answers `Ok`
    // (the one that finds it closed by the other, `None`), and the batch has each child once.
    for round in 0..3 {
        let (a, b) = (Graphs::new(ctx.db.clone()), Graphs::new(ctx.db.clone()));
        let jobs = topic(&ctx.db, "twice", 4);
        let id = fresh(&format!("twice{round}"));
        let batch = Batch::new(&id);
        let events: Vec<QueueEvent<Work>> = (0..3_500)
            .map(|n| QueueEvent::after(format!("k{n}"), Work { n }, Duration::from_secs(3600)))
            .collect();
        let (x, y) = tokio::join!(
            a.publish_batch(&batch, &jobs, &events),
            b.publish_batch(&batch, &jobs, &events)
        );
        let (x, y) = (x.unwrap(), y.unwrap());
        assert!(x.is_some() || y.is_some(), "round {round}");
        let state = a.batch(&id).await.unwrap().unwrap();
        assert!(state.closed);
        assert_eq!(state.counts.added, 3_500, "round {round}");
    }
}

pub async fn control_characters_in_graph_names_are_refused<E: TitoEngine>(ctx: Ctx<E>) {
    let graphs = Graphs::new(ctx.db.clone());
    let jobs = topic(&ctx.db, "names", 1);
    for id in ["line\nbreak", "tab\there", "bell\u{7}"] {
        let err = graphs
            .publish_batch(
                &Batch::new(id),
                &jobs,
                &[QueueEvent::now("k", Work { n: 1 })],
            )
            .await
            .unwrap_err();
        assert!(err.to_string().contains("control character"), "{err}");
        let mut workflow = Workflow::new(id);
        workflow.step(
            &StepName::<()>::new("s"),
            &jobs,
            QueueEvent::now("k", Work { n: 1 }),
        );
        let err = graphs.publish_workflow(&workflow).await.unwrap_err();
        assert!(err.to_string().contains("control character"), "{err}");
        let mut workflow = Workflow::new(fresh("named"));
        workflow.step(
            &StepName::<()>::named(id),
            &jobs,
            QueueEvent::now("k", Work { n: 1 }),
        );
        let err = graphs.publish_workflow(&workflow).await.unwrap_err();
        assert!(err.to_string().contains("control character"), "{err}");
    }
    assert_eq!(crate::support::pending_total(&jobs).await, 0);
}

/// Round-six defect 4 (G-BAT-1): a callback whose event id a pending invocation holds is refused
/// at publication (nothing written); the same `Batch` value published again after its batch
/// expired calls back again; and a callback whose id was taken after the batch opened still
/// fires, once, under an id of its own.
pub async fn a_batch_callbacks_taken_id_is_refused_or_fires_once_under_its_own<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    // The expiry below sweeps the whole store (see finished_graphs_expire_and_unfinished_ones_stay).
    if std::env::var("TITO_PD_ENDPOINTS").is_ok() {
        return;
    }
    let graphs = Graphs::new(ctx.db.clone());
    let jobs = topic(&ctx.db, "taken-jobs", 2);
    let callbacks = topic(&ctx.db, "taken-callbacks", 2);
    let calls: Calls = Arc::default();
    let mut workers = Workers::new();
    callback_worker(&mut workers, &callbacks, &calls);
    workers.spawn_worker(jobs.clone(), fast(0..2), |_: QueueEvent<Work>| async {
        Ok(QueueHandlerOutcome::Acknowledge)
    });
    let children = |n: u32| -> Vec<QueueEvent<Work>> {
        (0..n)
            .map(|n| QueueEvent::now(format!("k{n}"), Work { n }))
            .collect()
    };
    let count = |id: &str, calls: &Calls| {
        calls
            .lock()
            .unwrap()
            .get(&(id.to_string(), BatchCallback::Complete))
            .map_or(0, Vec::len)
    };

    // Held by a pending invocation: refused, nothing written.
    let pending = QueueEvent::after("cb", "later".to_string(), Duration::from_secs(3600));
    callbacks.publish(pending.clone()).await.unwrap();
    let refused_id = fresh("refused");
    let refused = Batch::new(&refused_id).on_complete(
        &callbacks,
        QueueEvent::now("cb", "never".to_string()).with_id(&pending.id),
    );
    let err = graphs
        .publish_batch(&refused, &jobs, &children(2))
        .await
        .unwrap_err();
    assert!(
        matches!(err, TitoError::InvalidArgument(_))
            && err.to_string().contains("is held by a pending invocation"),
        "{err}"
    );
    assert!(graphs.batch(&refused_id).await.unwrap().is_none());

    // One value published, expired, and published again: two callbacks.
    let id = fresh("reused");
    let batch = Batch::new(&id).on_complete(&callbacks, QueueEvent::now("cb", "done".to_string()));
    graphs
        .publish_batch(&batch, &jobs, &children(3))
        .await
        .unwrap()
        .unwrap();
    called_back(&calls, &(id.clone(), BatchCallback::Complete)).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    graphs.expire(Duration::ZERO).await.unwrap();
    assert!(graphs.batch(&id).await.unwrap().is_none());
    graphs
        .publish_batch(&batch, &jobs, &children(3))
        .await
        .unwrap()
        .expect("a new batch under the same id");
    let (seen, key) = (calls.clone(), id.clone());
    wait_for(
        "the second batch's callback",
        Duration::from_secs(30),
        move || {
            let n = count(&key, &seen);
            async move { n >= 2 }
        },
    )
    .await;

    // Taken after the batch opened (a job published under the callback's id): fires once,
    // under an id of its own.
    let raced = fresh("raced");
    let taken = format!("{raced}-cb");
    let batch = Batch::new(&raced).on_complete(
        &callbacks,
        QueueEvent::now("cb", "raced".to_string()).with_id(&taken),
    );
    assert!(graphs.open_batch(&batch).await.unwrap());
    callbacks
        .publish(
            QueueEvent::after("cb", "first".to_string(), Duration::from_secs(3600)).with_id(&taken),
        )
        .await
        .unwrap();
    graphs
        .add_to_batch(&raced, &jobs, &children(2))
        .await
        .unwrap();
    graphs.close_batch(&raced).await.unwrap();
    called_back(&calls, &(raced.clone(), BatchCallback::Complete)).await;
    // Let anything doubled show up before counting.
    tokio::time::sleep(Duration::from_millis(300)).await;
    workers.shutdown().await.unwrap();
    assert_eq!(
        count(&id, &calls),
        2,
        "one callback per batch of the reused value"
    );
    assert_eq!(count(&raced, &calls), 1);
    assert_eq!(count(&refused_id, &calls), 0);
    assert!(matches!(
        callbacks
            .invocation_state::<serde_json::Value>(&taken)
            .await
            .unwrap(),
        InvocationState::Pending { .. }
    ));
}

/// Round-six defect 10: a `numbered()` batch whose children are built anew by each run (fresh
/// ids from `QueueEvent::now`) and whose first publication failed part way gets exactly the
/// missing children from the second; without `numbered()` the children need ids of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_numbered_batch_published_again_after_a_failure_adds_only_what_is_missing() {
    use tito::engine::{Fault, FaultPoint, FaultRule, FaultyEngine};
    let db = FaultyEngine::new(tito::backend::memory::Memory::new());
    let graphs = Graphs::new(db.clone());
    let jobs = topic(&db, "numbered", 4);
    let batch = Batch::new("nightly").numbered();
    // Each run of the job builds its list anew: every child a fresh id.
    let build = || -> Vec<QueueEvent<Work>> {
        (0..2_500)
            .map(|n| QueueEvent::now(format!("doc-{n}"), Work { n }))
            .collect()
    };
    // The open and the first 1,000 children commit; the next transaction fails.
    db.faults().add(
        FaultRule::new(FaultPoint::Commit, Fault::Storage)
            .skip(2)
            .times(1),
    );
    let failed = graphs.publish_batch(&batch, &jobs, &build()).await;
    assert!(failed.is_err(), "{failed:?}");
    let state = graphs.batch("nightly").await.unwrap().unwrap();
    assert!(!state.closed);
    assert_eq!(state.counts.added, 1_000);
    let answers = graphs
        .publish_batch(&batch, &jobs, &build())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(answers.len(), 2_500);
    assert_eq!(answers.iter().filter(|a| a.duplicate).count(), 1_000);
    assert_eq!(answers[7].id, "nightly.7");
    let state = graphs.batch("nightly").await.unwrap().unwrap();
    assert!(state.closed);
    assert_eq!(state.counts.added, 2_500);
    assert_eq!(crate::support::pending_total(&jobs).await, 2_500);
}

/// Issue 60: a batch published while the transactional workers of its queue already complete
/// its earlier children: the additions and the completions write no key in common (a child's
/// end is an end record, folded after its commit), so the publication goes through at once,
/// no handler is replayed, and the callback fires once with every child counted.
pub async fn a_batch_takes_children_while_its_transactional_workers_complete_earlier_ones<
    E: TitoEngine,
>(
    ctx: Ctx<E>,
) {
    const CHILDREN: u32 = 1_500;
    let graphs = Graphs::new(ctx.db.clone());
    let jobs = topic(&ctx.db, "growing-jobs", 2);
    let callbacks = topic(&ctx.db, "growing-callbacks", 1);
    let calls: Calls = Arc::default();
    let mut workers = Workers::new();
    callback_worker(&mut workers, &callbacks, &calls);
    let prefix = ctx.key("growing:");
    workers.spawn_transactional_worker(
        jobs.clone(),
        fast(0..2),
        move |event: QueueEvent<Work>, tx: E::Transaction| {
            let mut key = prefix.clone();
            async move {
                key.extend_from_slice(event.payload.n.to_string().as_bytes());
                tx.put(key, b"done".to_vec()).await?;
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    let id = fresh("growing");
    let batch = Batch::new(&id)
        .numbered()
        .on_complete(&callbacks, QueueEvent::now("cb", "all ended".to_string()));
    let events: Vec<QueueEvent<Work>> = (0..CHILDREN)
        .map(|n| QueueEvent::now(format!("k{n}"), Work { n }))
        .collect();
    // The first children, published alone, are being completed while the rest are added.
    let first = 300;
    graphs.open_batch(&batch).await.unwrap();
    let early: Vec<QueueEvent<Work>> = events[..first]
        .iter()
        .enumerate()
        .map(|(n, e)| e.clone().with_id(format!("{id}.{n}")))
        .collect();
    graphs.add_to_batch(&id, &jobs, &early).await.unwrap();
    let published = graphs
        .publish_batch(&batch, &jobs, &events)
        .await
        .expect("a batch publication while its workers run goes through")
        .expect("the batch was open");
    assert_eq!(published.len(), CHILDREN as usize);
    assert_eq!(
        published.iter().filter(|p| p.duplicate).count(),
        first,
        "the children added first are duplicates"
    );
    let key = (id.clone(), BatchCallback::Complete);
    called_back(&calls, &key).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    workers.shutdown().await.unwrap();
    let complete = calls.lock().unwrap()[&key].clone();
    assert_eq!(complete.len(), 1, "{complete:?}");
    let counts = complete[0].counts;
    assert_eq!(
        (counts.added, counts.completed),
        (u64::from(CHILDREN), u64::from(CHILDREN))
    );
    assert_eq!(jobs.stats().replayed, 0, "{:?}", jobs.stats());
    assert_eq!(jobs.stats().acknowledged, u64::from(CHILDREN));
    let state = graphs.batch(&id).await.unwrap().unwrap();
    assert!(state.finished());
    assert_eq!(state.counts, counts);
}

/// Issue 60: a fan-in step's two dependencies end at once in transactional handlers (their
/// transactions overlap): each end writes an end record of its own, so neither handler is
/// replayed, and the step after both runs once.
pub async fn dependencies_ending_at_once_in_transactional_handlers_never_conflict<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    const DOCS: u32 = 12;
    let graphs = Graphs::new(ctx.db.clone());
    let pipeline = topic(&ctx.db, "fan-in", 1);
    let runs: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let mut workers = Workers::new();
    let seen = runs.clone();
    workers.spawn_transactional_worker(
        pipeline.clone(),
        fast(0..1),
        move |event: QueueEvent<String>, tx: E::Transaction| {
            let seen = seen.clone();
            async move {
                let step = event.payload.clone();
                tx.put(format!("fan-in:{}:{step}", event.key).into_bytes(), vec![1])
                    .await?;
                if step == "classify" || step == "thumbnail" {
                    // The two dependencies' transactions overlap.
                    tokio::time::sleep(Duration::from_millis(30)).await;
                }
                *seen
                    .lock()
                    .unwrap()
                    .entry(format!("{}:{step}", event.key))
                    .or_default() += 1;
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    let mut last = Vec::new();
    for doc in 0..DOCS {
        let mut wf = Workflow::new(fresh(&format!("doc{doc}")));
        let key = format!("doc{doc}");
        let at = |step: &str| QueueEvent::now(key.clone(), step.to_string());
        wf.step(&StepName::<()>::new("extract"), &pipeline, at("extract"));
        wf.step(&StepName::<()>::new("classify"), &pipeline, at("classify"))
            .after(["extract"]);
        wf.step(
            &StepName::<()>::new("thumbnail"),
            &pipeline,
            at("thumbnail"),
        )
        .after(["extract"]);
        wf.step(&StepName::<()>::new("index"), &pipeline, at("index"))
            .after(["classify", "thumbnail"]);
        let published = graphs.publish_workflow(&wf).await.unwrap();
        last.push(published.step_id("index").unwrap().to_string());
    }
    for id in &last {
        assert_eq!(
            await_finished(&pipeline, id).await,
            Finished::Completed(None)
        );
    }
    workers.shutdown().await.unwrap();
    assert_eq!(pipeline.stats().replayed, 0, "{:?}", pipeline.stats());
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), DOCS as usize * 4, "{runs:?}");
    assert!(runs.values().all(|n| *n == 1), "{runs:?}");
}

/// Issue 60: ends whose folds a crash lost (the process died right after each commit) stay as
/// end records: readers count them (a batch's counts are exact, its callback not fired yet, a
/// dependent still waiting), and the next worker's maintenance folds them, once.
pub async fn ends_whose_folds_were_lost_are_folded_by_the_next_workers_maintenance<
    E: TitoEngine,
>(
    ctx: Ctx<E>,
) {
    let graphs = Graphs::new(ctx.db.clone());
    let jobs = topic(&ctx.db, "lost-folds", 2);
    let callbacks = topic(&ctx.db, "lost-folds-callbacks", 1);
    let id = fresh("lost-folds");
    let batch =
        Batch::new(&id).on_complete(&callbacks, QueueEvent::now("cb", "all ended".to_string()));
    let events: Vec<QueueEvent<Work>> = (0..6)
        .map(|n| QueueEvent::now(format!("k{n}"), Work { n }))
        .collect();
    graphs.publish_batch(&batch, &jobs, &events).await.unwrap();
    let flow = fresh("lost-flow");
    let mut wf = Workflow::new(&flow);
    wf.step(
        &StepName::<()>::new("first"),
        &jobs,
        QueueEvent::now("w", Work { n: 100 }),
    );
    wf.step(
        &StepName::<()>::new("second"),
        &jobs,
        QueueEvent::now("w", Work { n: 101 }),
    )
    .after(["first"]);
    let second = graphs
        .publish_workflow(&wf)
        .await
        .unwrap()
        .step_id("second")
        .unwrap()
        .to_string();
    tito::queue::graph::fold::drop_fold_requests(&ctx.db, true);
    let ran = Arc::new(AtomicUsize::new(0));
    let handler = {
        let ran = ran.clone();
        move |_event: QueueEvent<Work>| {
            let ran = ran.clone();
            async move {
                ran.fetch_add(1, Ordering::SeqCst);
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        }
    };
    // A worker runs the children and the first step; this process folds nothing meanwhile
    // (its worker's maintenance pass included), as a process killed after each commit.
    let mut workers = Workers::new();
    workers.spawn_worker(
        jobs.clone(),
        fast(0..2).maintenance_interval(Duration::from_secs(3600)),
        handler.clone(),
    );
    reaches("the children and the first step", &ran, 7).await;
    workers.shutdown().await.unwrap();
    // Exact counts before any fold; nothing fired, the second step still waits.
    let state = graphs.batch(&id).await.unwrap().unwrap();
    assert_eq!((state.counts.added, state.counts.completed), (6, 6));
    assert!(state.finished());
    assert_eq!(state.callbacks, vec![(BatchCallback::Complete, false)]);
    assert!(matches!(
        jobs.invocation_state::<()>(&second).await.unwrap(),
        InvocationState::Waiting { .. }
    ));
    // The next worker's first maintenance pass folds them: the callback fires once, the second
    // step runs.
    tito::queue::graph::fold::drop_fold_requests(&ctx.db, false);
    let calls: Calls = Arc::default();
    let mut workers = Workers::new();
    callback_worker(&mut workers, &callbacks, &calls);
    workers.spawn_worker(jobs.clone(), fast(0..2), handler);
    let key = (id.clone(), BatchCallback::Complete);
    called_back(&calls, &key).await;
    assert_eq!(
        await_finished(&jobs, &second).await,
        Finished::Completed(None)
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    workers.shutdown().await.unwrap();
    assert_eq!(calls.lock().unwrap()[&key].len(), 1);
    assert_eq!(ran.load(Ordering::SeqCst), 8);
    let state = graphs.batch(&id).await.unwrap().unwrap();
    assert_eq!(state.callbacks, vec![(BatchCallback::Complete, true)]);
    assert_eq!(state.counts.completed, 6);
}

/// Issue 60: many workflows at once, in bounded transactions (whole workflows of at most 1,000
/// steps together); every one checked before anything is written; published again, each is a
/// duplicate that writes nothing.
pub async fn many_workflows_publish_in_bounded_transactions_and_again_as_duplicates<
    E: TitoEngine,
>(
    ctx: Ctx<E>,
) {
    let graphs = Graphs::new(ctx.db.clone());
    let steps = topic(&ctx.db, "many-flows", 2);
    let prefix = fresh("many");
    let build = |n: u32| {
        let mut wf = Workflow::new(format!("{prefix}-{n}"));
        wf.step(&StepName::<()>::new("a"), &steps, QueueEvent::now("k", n));
        wf.step(&StepName::<()>::new("b"), &steps, QueueEvent::now("k", n))
            .after(["a"]);
        wf
    };
    // 700 workflows of 2 steps: two transactions of whole workflows.
    let list: Vec<Workflow> = (0..700).map(build).collect();
    // A bad workflow anywhere, or one id twice: nothing is written.
    let mut bad = list.clone();
    let mut cycle = Workflow::new(format!("{prefix}-bad"));
    cycle
        .step(
            &StepName::<()>::new("x"),
            &steps,
            QueueEvent::now("k", 0u32),
        )
        .after(["y"]);
    cycle
        .step(
            &StepName::<()>::new("y"),
            &steps,
            QueueEvent::now("k", 0u32),
        )
        .after(["x"]);
    bad.push(cycle);
    let err = graphs.publish_workflows(&bad).await.unwrap_err();
    assert!(
        matches!(&err, TitoError::InvalidArgument(why) if why.contains("workflow 700 of 701")),
        "{err}"
    );
    let mut twice = list[..2].to_vec();
    twice.push(build(0));
    let err = graphs.publish_workflows(&twice).await.unwrap_err();
    assert!(err.to_string().contains("appears twice"), "{err}");
    assert!(
        graphs
            .workflow(&format!("{prefix}-0"))
            .await
            .unwrap()
            .is_none()
    );
    let published = graphs.publish_workflows(&list).await.unwrap();
    assert_eq!(published.len(), 700);
    assert!(published.iter().all(|p| !p.duplicate));
    assert_eq!(published[699].id, format!("{prefix}-699"));
    let again = graphs.publish_workflows(&list).await.unwrap();
    assert!(again.iter().all(|p| p.duplicate));
    assert_eq!(again[5].steps, published[5].steps);
    // They run: the second step of each after its first.
    let mut workers = Workers::new();
    workers.spawn_worker(steps.clone(), fast(0..2), |_e: QueueEvent<u32>| async {
        Ok(QueueHandlerOutcome::Acknowledge)
    });
    for p in [&published[0], &published[699]] {
        let b = p.step_id("b").unwrap();
        assert_eq!(await_finished(&steps, b).await, Finished::Completed(None));
    }
    workers.shutdown().await.unwrap();
}

/// Issue 60: `cancel_batch` while the batch's transactional workers complete its children: the
/// cancel's transactions write end records, not the batch's record that the folds write, so
/// the call goes through (before, on TiKV it ran out of retries on `batch:{id}` or cancelled
/// nothing), every child ends once, and the callback fires once with them all counted.
pub async fn cancel_batch_goes_through_while_its_children_complete<E: TitoEngine>(ctx: Ctx<E>) {
    const CHILDREN: u32 = 800;
    let graphs = Graphs::new(ctx.db.clone());
    let jobs = topic(&ctx.db, "cancelled-batch-jobs", 4);
    let callbacks = topic(&ctx.db, "cancelled-batch-callbacks", 1);
    let calls: Calls = Arc::default();
    let mut workers = Workers::new();
    callback_worker(&mut workers, &callbacks, &calls);
    workers.spawn_transactional_worker(
        jobs.clone(),
        fast(0..4),
        move |event: QueueEvent<Work>, tx: E::Transaction| async move {
            tx.put(
                format!("cancelled-batch:{}", event.payload.n).into_bytes(),
                vec![1],
            )
            .await?;
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok(QueueHandlerOutcome::Acknowledge)
        },
    );
    let id = fresh("cancelled-batch");
    let batch = Batch::new(&id)
        .numbered()
        .on_complete(&callbacks, QueueEvent::now("cb", "ended".to_string()));
    let events: Vec<QueueEvent<Work>> = (0..CHILDREN)
        .map(|n| QueueEvent::now(format!("k{n}"), Work { n }))
        .collect();
    graphs.publish_batch(&batch, &jobs, &events).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let cancelled = graphs
        .cancel_batch(&id, "not needed")
        .await
        .expect("cancel_batch goes through while children complete");
    let key = (id.clone(), BatchCallback::Complete);
    called_back(&calls, &key).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    workers.shutdown().await.unwrap();
    let complete = calls.lock().unwrap()[&key].clone();
    assert_eq!(complete.len(), 1, "{complete:?}");
    let counts = complete[0].counts;
    assert_eq!(counts.added, u64::from(CHILDREN));
    assert_eq!(
        counts.completed + counts.cancelled,
        u64::from(CHILDREN),
        "{counts:?}"
    );
    assert_eq!(counts.cancelled, cancelled as u64, "{counts:?}");
    let state = graphs.batch(&id).await.unwrap().unwrap();
    assert!(state.finished());
    assert_eq!(state.counts, counts);
}
