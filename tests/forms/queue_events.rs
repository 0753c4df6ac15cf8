//! The forms applications write to build and change a `QueueEvent` compile, outside the crate:
//! struct update syntax (`QueueEvent { payload, ..event }`, natural for a `Reschedule` or an
//! `Advance`), a struct literal naming every field, and the constructors. A relative due time
//! goes along with struct update syntax.

use std::time::Duration;

use tito::backend::memory::Memory;
use tito::queue::RelativeDue;
use tito::{Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, TitoEngine};

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
enum Mail {
    Welcome,
    Tips { day: u32 },
}

/// A handler's outcome built with struct update syntax from the event it was given.
fn next_step(event: QueueEvent<Mail>) -> QueueHandlerOutcome<Mail> {
    QueueHandlerOutcome::Reschedule(QueueEvent {
        payload: Mail::Tips { day: 1 },
        timestamp: event.timestamp + 86_400,
        ..event
    })
}

#[test]
fn struct_update_syntax_and_literals_build_events() {
    let event = QueueEvent::new("user-1", Mail::Welcome, 1_700_000_000);
    match next_step(event.clone()) {
        QueueHandlerOutcome::Reschedule(next) => {
            assert_eq!((next.id, next.key), (event.id.clone(), event.key.clone()));
            assert_eq!(next.payload, Mail::Tips { day: 1 });
            assert_eq!(next.timestamp, 1_700_086_400);
        }
        _ => unreachable!("built as a reschedule"),
    }
    // Every field named: the relative due time is none, so `timestamp` is the due time.
    let literal = QueueEvent {
        id: "mail-7".to_string(),
        key: "user-7".to_string(),
        payload: Mail::Welcome,
        timestamp: 1_700_000_000,
        owner: None,
        attempt: 1,
        urgency: 3,
        max_attempts: None,
        workflow: None,
        batch: None,
        relative: RelativeDue::default(),
    };
    assert_eq!(literal.urgency, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delay_goes_along_with_struct_update_syntax() {
    let db = Memory::new();
    let queue = Queue::new(db.clone(), QueueConfig::new(1, Duration::from_secs(3600)));
    let later = QueueEvent::after("k", Mail::Welcome, Duration::from_secs(120));
    let changed = QueueEvent {
        payload: Mail::Tips { day: 2 },
        ..later
    };
    // The host's estimate is set far off: the delay, counted from the store's clock at
    // publication, is what decides (the estimate only while `timestamp` is left as built).
    let before_s = tito::engine::version_millis(db.current_version().await.unwrap()) / 1000;
    let published = queue.publish(changed).await.unwrap();
    let after_s = tito::engine::version_millis(db.current_version().await.unwrap()) / 1000;
    let due = tito::keys::parse_pending_key(&tito::keys::queue_root(None), &published.key)
        .unwrap()
        .timestamp;
    assert!(
        due >= before_s + 120 && due <= after_s + 121,
        "due {due}, published between {before_s} and {after_s}"
    );
    // Setting `timestamp` makes it the due time.
    let fixed = QueueEvent {
        timestamp: 2_000_000_000,
        ..QueueEvent::after("k", Mail::Welcome, Duration::from_secs(120))
    };
    let published = queue.publish(fixed).await.unwrap();
    let due = tito::keys::parse_pending_key(&tito::keys::queue_root(None), &published.key)
        .unwrap()
        .timestamp;
    assert_eq!(due, 2_000_000_000);
}
