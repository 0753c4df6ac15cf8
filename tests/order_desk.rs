//! The order desk of `examples/order_desk.rs`, tested as its users would: orders placed and paid
//! (twice), the queue drained with the desk's own transactional handler, and the sweep.

#[allow(dead_code)]
#[path = "../examples/order_desk.rs"]
mod desk;

use desk::{
    Customer, Desk, DeskJob, OrderQueries, Status, UNPAID_FOR, desk as declared, pay, place,
};
use tito::queue::testing::drain_transactional;
use tito::{QueueEvent, TitoEngine};

async fn desk_on<E: TitoEngine>(db: E) {
    let queue = declared().unwrap().open(db.clone()).await.unwrap();
    let desk = Desk::new(&db);
    let now = chrono::Utc::now().timestamp();
    desk.customers
        .build(Customer {
            id: "ada".into(),
            email: "ada@example.com".into(),
        })
        .await
        .unwrap();
    place(&desk, "o1", "ada", 4200, now).await.unwrap();
    place(&desk, "o2", "ada", 900, now - 2 * UNPAID_FOR)
        .await
        .unwrap();
    place(&desk, "o3", "ada", 100, now).await.unwrap();
    pay(&db, &queue, "o1").await.unwrap();
    pay(&db, &queue, "o1").await.unwrap();
    queue
        .publish(QueueEvent::now("sweep", DeskJob::Sweep))
        .await
        .unwrap();
    let handler = desk.clone();
    let drained = drain_transactional(&queue, move |event, tx| {
        let desk = handler.clone();
        async move { desk.handle(event, tx).await }
    })
    .await
    .unwrap();
    // One receipt (paid twice), one sweep.
    assert_eq!((drained.acknowledged, drained.dead), (2, 0), "{drained:?}");
    let receipt = desk.receipts.get("o1").await.unwrap().unwrap();
    assert_eq!(receipt.to, "ada@example.com");
    let status = |id: &'static str| {
        let orders = desk.orders.clone();
        async move { orders.get(id).await.unwrap().unwrap().status }
    };
    assert_eq!(status("o1").await, Status::Paid);
    assert_eq!(status("o2").await, Status::Cancelled);
    assert_eq!(status("o3").await, Status::Pending);
    // A cancelled order cannot be paid into a receipt.
    pay(&db, &queue, "o2").await.unwrap();
    assert!(desk.receipts.get("o2").await.unwrap().is_none());
    let pending = desk
        .orders
        .order_by_status(Status::Pending)
        .execute()
        .await
        .unwrap();
    assert_eq!(pending.items.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_order_desk_sends_one_receipt_and_sweeps_unpaid_orders() {
    desk_on(tito::Embedded::temporary().await.unwrap()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_order_desk_runs_on_tikv() {
    let ctx = crate::support::test_server_ctx().await;
    desk_on(ctx.db.clone()).await;
}
