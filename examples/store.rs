//! A small store written with `#[derive(TitoModel)]`: customers with a unique email, orders with
//! an index by customer and date, an index of open orders, and order events. Each order is
//! placed in one transaction with the customer's running total, so the two never disagree.
//!
//! `cargo run --example store` (embedded), or with `TITO_PD_ENDPOINTS` set, on TiKV.

use chrono::{DateTime, Duration, TimeZone, Utc};
use serde::{Deserialize, Serialize};
use tito::backend::embedded::Embedded;
use tito::backend::tikv::TiKV;
use tito::model::{TitoOperation, TitoOptions};
use tito::{TitoEngine, TitoError, TitoModel};

/// A customer; no two share an email.
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(unique_index = "customer_by_email: email")]
struct Customer {
    id: String,
    name: String,
    email: String,
    orders_placed: u32,
    spent_cents: i64,
}

/// An order, findable by customer and date, and (while open) by total.
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(table = "order")]
#[tito(index = "order_by_customer_date: customer_id, placed_at")]
#[tito(index = "open_order_by_total: total_cents", condition = "is_open")]
#[tito(index = "order_by_item: items")]
#[tito(event = "order_placed")]
#[tito(event = "order_review_reminder", at = "review_at")]
struct Order {
    #[tito(id)]
    number: u64,
    customer_id: String,
    placed_at: DateTime<Utc>,
    items: Vec<String>,
    total_cents: i64,
    shipped: bool,
    created_at: i64,
}

impl Order {
    fn is_open(&self) -> bool {
        !self.shipped
    }

    /// Ask for a review a week after the order.
    fn review_at(&self) -> i64 {
        (self.placed_at + Duration::days(7)).timestamp()
    }
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

fn day(d: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 11, d, 10, 0, 0).unwrap()
}

async fn run(db: impl TitoEngine) -> Result<(), TitoError> {
    let customers = db.clone().model::<Customer>();
    let orders = db.clone().model::<Order>();

    for (id, name) in [("c1", "Ada"), ("c2", "Grace")] {
        customers
            .build(Customer {
                id: id.into(),
                name: name.into(),
                email: format!("{}@example.com", name.to_lowercase()),
                ..Default::default()
            })
            .await?;
    }
    // The email is taken: nothing is written.
    let duplicate = Customer {
        id: "c3".into(),
        name: "Ada again".into(),
        email: "ada@example.com".into(),
        ..Default::default()
    };
    match customers.build(duplicate).await {
        Err(TitoError::UniqueViolation { index, owner }) => {
            println!("refused a second customer: {index} already used by {owner}")
        }
        other => panic!("expected a unique violation, got {other:?}"),
    }

    // Each order and its customer's totals commit together (replayed on conflicts).
    let placed = [
        (1, "c1", 2, vec!["tea"], 1_200),
        (2, "c1", 5, vec!["tea", "cups"], 4_500),
        (3, "c2", 6, vec!["cups"], 3_000),
        (4, "c1", 9, vec!["kettle"], 8_900),
        (5, "c1", 12, vec!["tea"], 1_200),
    ];
    for (number, customer_id, d, items, total) in placed {
        let order = Order {
            number,
            customer_id: customer_id.into(),
            placed_at: day(d),
            items: items.into_iter().map(String::from).collect(),
            total_cents: total,
            shipped: number <= 2,
            created_at: 0,
        };
        let (customers, orders) = (customers.clone(), orders.clone());
        db.transaction(|tx| async move {
            let mut customer = customers.find_by_id_in_tx(&order.customer_id, &tx).await?;
            customer.orders_placed += 1;
            customer.spent_cents += order.total_cents;
            customers
                .update_with_options(customer, TitoOptions::default(), &tx)
                .await?;
            orders
                .build_with_options(order, TitoOptions::with_events(TitoOperation::Insert), &tx)
                .await
        })
        .await?;
    }

    let ada = customers.find_by_id("c1", vec![]).await?;
    println!(
        "{} placed {} orders for {:.2}",
        ada.name,
        ada.orders_placed,
        ada.spent_cents as f64 / 100.0
    );

    // Ada's orders from the 3rd to the 10th, two per page.
    let mut cursor = None;
    let mut page_number = 1;
    loop {
        let page = orders
            .order_by_customer_date("c1")
            .placed_at(day(3)..day(10))
            .limit(Some(2))
            .cursor(cursor)
            .execute()
            .await?;
        let numbers: Vec<u64> = page.items.iter().map(|o| o.number).collect();
        println!("page {page_number} of Ada's orders, 3rd to 10th: {numbers:?}");
        cursor = page.cursor;
        page_number += 1;
        if cursor.is_none() {
            break;
        }
    }

    let tea = orders.order_by_item("tea").execute().await?;
    let tea: Vec<u64> = tea.items.iter().map(|o| o.number).collect();
    println!("orders with tea: {tea:?}");

    let big_open = orders
        .open_order_by_total_range(2_000..)
        .reverse(true)
        .execute()
        .await?;
    let big_open: Vec<(u64, i64)> = big_open
        .items
        .iter()
        .map(|o| (o.number, o.total_cents))
        .collect();
    println!("open orders of 20.00 or more, largest first: {big_open:?}");

    // Shipping order 4 takes it out of the open-orders index.
    let mut four = orders.find_by_id("4", vec![]).await?;
    four.shipped = true;
    let four = orders.update(four).await?;
    let open: Vec<u64> = orders
        .open_order_by_total_range(0..)
        .execute()
        .await?
        .items
        .iter()
        .map(|o| o.number)
        .collect();
    println!(
        "after shipping order 4 (created at {}): open orders {open:?}",
        four.created_at
    );
    Ok(())
}
