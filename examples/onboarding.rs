//! A multi-step job, a daily schedule, and an operator's controls: each new account goes
//! through onboarding steps (`Advance` carries the step), a periodic job publishes a heartbeat,
//! the queue is paused and resumed, and one account's pending work is cancelled.
//!
//! `cargo run --example onboarding` (embedded), or with `TITO_PD_ENDPOINTS` set, on TiKV.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tito::backend::embedded::Embedded;
use tito::backend::tikv::TiKV;
use tito::queue::{PeriodicJob, Schedule};
use tito::{
    Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, QueueOwner, TitoEngine, TitoError,
    WorkerConfig, Workers,
};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
enum Task {
    /// Onboarding of one account, at this step.
    Welcome,
    Tips {
        day: u32,
    },
    /// Published every second by the schedule.
    Heartbeat,
}

#[tokio::main]
async fn main() -> Result<(), TitoError> {
    match std::env::var("TITO_PD_ENDPOINTS") {
        Ok(endpoints) => {
            let endpoints: Vec<String> = endpoints.split(',').map(str::to_string).collect();
            run(TiKV::connect(endpoints).await?).await
        }
        Err(_) => run(Embedded::temporary().await?).await,
    }
}

async fn run<E: TitoEngine>(db: E) -> Result<(), TitoError> {
    let queue = Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(4, Duration::from_secs(3600)).topic("onboarding"),
    ));
    let now = chrono::Utc::now().timestamp();
    let mut ids = Vec::new();
    for account in ["ada", "grace", "linus"] {
        let event = QueueEvent::new(account, Task::Welcome, now)
            .with_owner(QueueOwner::new("account", account));
        ids.push(event.id.clone());
        queue.publish(event).await?;
    }

    // An operator pauses the queue before any worker runs, and cancels linus's onboarding.
    queue.pause(None, "mail templates being fixed").await?;
    let cancelled = queue
        .cancel_owner(&QueueOwner::new("account", "linus"), "account closed")
        .await?;
    println!("paused; cancelled {cancelled} pending job of linus");

    let log = Arc::new(Mutex::new(Vec::new()));
    let seen = log.clone();
    let mut workers = Workers::new();
    workers.spawn_worker(
        queue.clone(),
        WorkerConfig::new(0..4).max_idle_backoff(Duration::from_millis(100)),
        move |event: QueueEvent<Task>| {
            let seen = seen.clone();
            async move {
                seen.lock()
                    .unwrap()
                    .push((event.key.clone(), event.payload.clone()));
                let next = match event.payload {
                    Task::Welcome => Some(Task::Tips { day: 1 }),
                    Task::Tips { day } if day < 2 => Some(Task::Tips { day: day + 1 }),
                    _ => None,
                };
                Ok(match next {
                    // The next step is due at once here; a real one would wait a day.
                    Some(step) => {
                        let due = event.timestamp;
                        QueueHandlerOutcome::Advance(event.advanced(step, due))
                    }
                    None => QueueHandlerOutcome::Acknowledge,
                })
            }
        },
    );
    let heartbeat = Schedule::every("heartbeat", Duration::from_secs(1))?;
    workers.spawn_periodic(
        queue.clone(),
        vec![PeriodicJob::new(heartbeat, Task::Heartbeat)],
    );

    tokio::time::sleep(Duration::from_millis(1500)).await;
    let while_paused = log.lock().unwrap().len();
    println!("while paused: {while_paused} handled");
    assert_eq!(while_paused, 0, "a paused queue starts nothing");
    queue.resume(None).await?;

    // ada and grace go through three steps each; heartbeats arrive once a second.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let steps = log
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, task)| *task != Task::Heartbeat)
            .count();
        let beats = log
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, task)| *task == Task::Heartbeat)
            .count();
        if steps == 6 && beats >= 1 {
            println!("onboarding steps handled: {steps}; heartbeats: {beats}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "steps {steps}, beats {beats}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    workers.shutdown().await?;
    let handled = log.lock().unwrap().clone();
    assert!(
        handled.iter().all(|(account, _)| account != "linus"),
        "linus was cancelled"
    );
    for account in ["ada", "grace"] {
        let steps: Vec<Task> = handled
            .iter()
            .filter(|(a, _)| a == account)
            .map(|(_, task)| task.clone())
            .collect();
        println!("{account}: {steps:?}");
        assert_eq!(
            steps,
            [Task::Welcome, Task::Tips { day: 1 }, Task::Tips { day: 2 }]
        );
    }
    let schedules = tito::queue::schedules(&db, Some("onboarding")).await?;
    println!("schedules: {schedules:?}");
    Ok(())
}
