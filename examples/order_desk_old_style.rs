//! The order desk of `examples/order_desk.rs`, written as it had to be before index values of
//! your own types, transactions taking async closures and `Workers::start`: the status a
//! string, every transaction's captures cloned by hand, the worker's partitions and the
//! periodic runner restated from the declaration. Kept to compare the two (and run in CI).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tito::backend::{embedded::Embedded, tikv::TiKV};
use tito::queue::{FailurePolicy, PeriodicJob, QueueSpec, Schedule, Topic, TopicQueue};
use tito::{
    QueueEvent, QueueHandlerOutcome, TitoEngine, TitoError, TitoModel, TitoOptions, TitoResult,
    WorkerConfig, Workers,
};

/// Where an order is: "pending", "paid" or "cancelled".
pub const PENDING: &str = "pending";
pub const PAID: &str = "paid";
pub const CANCELLED: &str = "cancelled";

#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(table = "old_desk_customer")]
#[tito(unique_index = "customer_by_email: email")]
pub struct Customer {
    pub id: String,
    pub email: String,
}

#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(table = "old_desk_order")]
#[tito(index = "order_by_status: status, placed_at")]
#[tito(index = "order_by_customer: customer")]
pub struct Order {
    pub id: String,
    pub customer: String,
    pub status: String,
    pub cents: i64,
    pub placed_at: i64,
}

/// A receipt sent: one row per paid order, written with the handler's outcome.
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(table = "old_desk_receipt")]
pub struct Receipt {
    pub id: String,
    pub to: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum DeskJob {
    SendReceipt { order: String },
    Sweep,
}

pub const DESK: Topic<DeskJob> = Topic::new("desk_old_style");

/// An order unpaid this long is cancelled by the sweep.
pub const UNPAID_FOR: i64 = 3600;

/// The desk's queue, declared once: partitions, retention, failures, the sweep.
pub fn desk() -> TitoResult<QueueSpec<DeskJob>> {
    Ok(DESK
        .spec(4, Duration::from_secs(7 * 86_400))
        .failure_policy(FailurePolicy::new(5))
        .periodic(PeriodicJob::new(
            Schedule::every("sweep", Duration::from_secs(60))?,
            DeskJob::Sweep,
        )))
}

/// Marks order `id` paid and queues its receipt in the same transaction: paying twice sends
/// one receipt.
pub async fn pay<E: TitoEngine>(db: &E, desk: &TopicQueue<E, DeskJob>, id: &str) -> TitoResult<()> {
    let orders = db.clone().model::<Order>();
    let id = id.to_string();
    db.transaction(|tx| {
        let (orders, desk, id) = (orders.clone(), desk.clone(), id.clone());
        async move {
            let mut order = orders.find_by_id_in_tx(&id, &tx).await?;
            if order.status != PENDING {
                return Ok(());
            }
            order.status = PAID.to_string();
            orders
                .update_with_options(order, TitoOptions::default(), &tx)
                .await?;
            let receipt = DeskJob::SendReceipt { order: id.clone() };
            desk.publish_in_tx(&QueueEvent::now(&id, receipt), &tx)
                .await?;
            Ok(())
        }
    })
    .await
}

/// What the desk's handler works with (cheap to clone: handles on one store).
#[derive(Clone)]
pub struct Desk<E: TitoEngine> {
    pub orders: tito::TitoModel<E, Order>,
    pub customers: tito::TitoModel<E, Customer>,
    pub receipts: tito::TitoModel<E, Receipt>,
}

impl<E: TitoEngine> Desk<E> {
    pub fn new(db: &E) -> Self {
        Desk {
            orders: db.clone().model::<Order>(),
            customers: db.clone().model::<Customer>(),
            receipts: db.clone().model::<Receipt>(),
        }
    }

    /// The handler: a receipt row per paid order (written with the outcome, so a replay or a
    /// second delivery writes the same row), and the sweep's cancellations.
    pub async fn handle(
        &self,
        event: QueueEvent<DeskJob>,
        tx: E::Transaction,
    ) -> tito::QueueHandlerResult<DeskJob> {
        match event.payload {
            DeskJob::SendReceipt { order } => {
                let order = self.orders.find_by_id_in_tx(&order, &tx).await?;
                let customer = self
                    .customers
                    .find_by_id_in_tx(&order.customer, &tx)
                    .await?;
                let receipt = Receipt {
                    id: order.id,
                    to: customer.email,
                };
                self.receipts
                    .upsert_with_options(receipt, TitoOptions::default(), &tx)
                    .await?;
            }
            DeskJob::Sweep => {
                let cutoff = chrono::Utc::now().timestamp() - UNPAID_FOR;
                let stale = self
                    .orders
                    .order_by_status(PENDING)
                    .placed_at(..cutoff)
                    .execute_in_tx(&tx)
                    .await?;
                for mut order in stale.items {
                    order.status = CANCELLED.to_string();
                    self.orders
                        .update_with_options(order, TitoOptions::default(), &tx)
                        .await?;
                }
            }
        }
        Ok(QueueHandlerOutcome::Acknowledge)
    }
}

/// Places an order for a customer.
pub async fn place<E: TitoEngine>(
    desk: &Desk<E>,
    id: &str,
    customer: &str,
    cents: i64,
    placed_at: i64,
) -> TitoResult<Order> {
    let order = Order {
        id: id.into(),
        customer: customer.into(),
        status: PENDING.to_string(),
        cents,
        placed_at,
    };
    desk.orders.build(order).await
}

#[tokio::main]
async fn main() -> Result<(), TitoError> {
    match std::env::var("TITO_PD_ENDPOINTS") {
        Ok(pd) => run(TiKV::connect(pd.split(',').map(str::to_string).collect()).await?).await,
        Err(_) => run(Embedded::temporary().await?).await,
    }
}

async fn run<E: TitoEngine>(db: E) -> Result<(), TitoError> {
    let queue = desk()?.open(db.clone()).await?;
    let desk = Desk::new(&db);
    let run = format!("{}", chrono::Utc::now().timestamp_micros());
    let (ada, now) = (format!("ada-{run}"), chrono::Utc::now().timestamp());
    desk.customers
        .build(Customer {
            id: ada.clone(),
            email: format!("{ada}@example.com"),
        })
        .await?;
    let (fresh, stale) = (format!("o1-{run}"), format!("o2-{run}"));
    place(&desk, &fresh, &ada, 4200, now).await?;
    place(&desk, &stale, &ada, 900, now - 2 * UNPAID_FOR).await?;
    pay(&db, &queue, &fresh).await?;
    pay(&db, &queue, &fresh).await?; // paid already: no second receipt
    // A sweep now (the schedule runs one every minute).
    queue
        .publish(QueueEvent::now("sweep", DeskJob::Sweep))
        .await?;

    // The worker over every partition, and the sweep's runner, each restated.
    let mut workers = Workers::new();
    let handler = desk.clone();
    workers.spawn_transactional_worker(
        &queue,
        WorkerConfig::new(0..queue.config().partitions),
        move |event, tx| {
            let desk = handler.clone();
            async move { desk.handle(event, tx).await }
        },
    );
    workers.spawn_periodic(&queue, queue.periodic_jobs());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let receipt = desk.receipts.get(&fresh).await?;
        let swept = desk.orders.get(&stale).await?.map(|o| o.status);
        if let Some(receipt) = &receipt
            && swept.as_deref() == Some(CANCELLED)
        {
            println!("receipt to {}; the unpaid order was cancelled", receipt.to);
            break;
        }
        if tokio::time::Instant::now() > deadline {
            return Err(TitoError::handler("the desk did not settle in 120 s"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    workers.shutdown().await?;
    let paid = desk.orders.order_by_status(PAID).execute().await?;
    println!("paid orders: {}", paid.items.len());
    Ok(())
}
