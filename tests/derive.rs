//! `#[derive(TitoModel)]`: the generated impl equals the hand-written one, and the typed query
//! methods return what the untyped builder returns. Run on every backend.

use std::ops::Bound;

use chrono::{DateTime, TimeZone, Utc};
use serde::{Deserialize, Serialize};
use tito::model::{TitoIndexBlockType, TitoIndexConfig, TitoIndexField, TitoModelTrait};
use tito::{TitoEngine, TitoError, TitoModel, TitoTransaction};

use crate::support::Ctx;

/// Runs every case of this suite on one backend.
#[macro_export]
macro_rules! derive_suite {
    ($backend:ty) => {
        $crate::engine_suite!(
            $backend,
            derive,
            [
                typed_queries_match_the_builder,
                unique_and_conditional_indexes_work,
                a_unique_index_looks_up_one_row_or_none,
                serde_renames_are_followed,
                typed_query_arguments_take_what_converts,
                an_empty_string_is_a_range_bound,
                enums_newtypes_and_uuids_are_index_values,
                enums_by_number_sort_by_number,
                an_enum_whose_serde_form_is_not_its_kind_is_refused_at_first_use,
                a_string_field_becomes_an_enum_over_the_same_stored_rows,
                far_timestamps_are_indexed_and_unreadable_floats_refused,
            ]
        );
    };
}

#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(index = "order_by_customer_date: customer, placed_at")]
#[tito(index = "order_by_tags: tags")]
#[tito(index = "open_orders_by_total: total_cents", condition = "is_open")]
#[tito(unique_index = "order_by_number: number")]
#[tito(event = "order")]
#[tito(event = "order_reminder", at = "remind_at")]
#[tito(event = "order_followup", at = "followup_at")]
pub struct Order {
    #[tito(id)]
    pub order_id: u64,
    pub customer: String,
    pub placed_at: DateTime<Utc>,
    pub total_cents: i64,
    pub number: String,
    pub tags: Vec<String>,
    pub open: bool,
    pub note: Option<String>,
    pub remind_at: i64,
}

impl Order {
    fn is_open(&self) -> bool {
        self.open
    }

    fn followup_at(&self) -> i64 {
        self.remind_at + 60
    }
}

fn at(day: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 11, day, 12, 0, 0).unwrap()
}

fn order(id: u64, customer: &str, day: u32, total: i64) -> Order {
    Order {
        order_id: id,
        customer: customer.into(),
        placed_at: at(day),
        total_cents: total,
        number: format!("N-{id}"),
        tags: vec!["gift".into(), format!("t{}", id % 2)],
        open: id % 2 == 1,
        note: None,
        remind_at: 1_000 + id as i64,
    }
}

#[test]
fn the_generated_impl_is_the_hand_written_one() {
    let o = order(7, "ada", 3, 1200);
    assert_eq!(o.id(), "7");
    assert_eq!(o.table(), "order");
    let field = |name: &str, kind| TitoIndexField {
        name: name.into(),
        r#type: kind,
    };
    assert_eq!(
        o.indexes(),
        vec![
            TitoIndexConfig {
                condition: true,
                name: "order_by_customer_date".into(),
                fields: vec![
                    field("customer", TitoIndexBlockType::String),
                    field("placed_at", TitoIndexBlockType::Timestamp),
                ],
            },
            TitoIndexConfig {
                condition: true,
                name: "order_by_tags".into(),
                fields: vec![field("tags", TitoIndexBlockType::String)],
            },
            TitoIndexConfig {
                condition: true,
                name: "open_orders_by_total".into(),
                fields: vec![field("total_cents", TitoIndexBlockType::Integer)],
            },
        ]
    );
    assert_eq!(o.unique_indexes()[0].name, "order_by_number");
    let events = o.events();
    let names: Vec<&str> = events.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["order", "order_reminder", "order_followup"]);
    assert!(events[0].timestamp >= Utc::now().timestamp() - 5);
    assert_eq!(events[1].timestamp, 1_007);
    assert_eq!(events[2].timestamp, 1_067);
    assert!(!order(8, "ada", 3, 1).indexes()[2].condition);
}

pub async fn typed_queries_match_the_builder<E: TitoEngine>(ctx: Ctx<E>) {
    let orders = ctx.db.clone().model::<Order>();
    for (id, customer, day, total) in [
        (1, "ada", 1, 500),
        (2, "ada", 5, 900),
        (3, "bob", 2, 100),
        (4, "ada", 9, 50),
    ] {
        orders.build(order(id, customer, day, total)).await.unwrap();
    }
    let ids = |items: Vec<Order>| items.into_iter().map(|o| o.order_id).collect::<Vec<_>>();

    // A prefix, then a range on the next field.
    let page = orders
        .order_by_customer_date("ada")
        .execute()
        .await
        .unwrap();
    assert_eq!(ids(page.items), [1, 2, 4]);
    let page = orders
        .order_by_customer_date("ada")
        .placed_at(at(2)..at(9))
        .execute()
        .await
        .unwrap();
    assert_eq!(ids(page.items), [2]);
    let page = orders
        .order_by_customer_date("ada")
        .placed_at_eq(at(9))
        .execute()
        .await
        .unwrap();
    assert_eq!(ids(page.items), [4]);
    let untyped = orders
        .query_by_index("order_by_customer_date")
        .value("ada")
        .range(at(2)..at(9))
        .execute()
        .await
        .unwrap();
    assert_eq!(ids(untyped.items), [2]);

    // The typed builder keeps limit, reverse and cursors.
    let page = orders
        .order_by_customer_date("ada")
        .reverse(true)
        .limit(Some(2))
        .execute()
        .await
        .unwrap();
    assert_eq!(ids(page.items), [4, 2]);
    let customer = String::from("bob");
    let page = orders
        .order_by_customer_date(&customer)
        .execute()
        .await
        .unwrap();
    assert_eq!(ids(page.items), [3]);

    // Vec fields: one entry per element.
    let page = orders.order_by_tags("t0").execute().await.unwrap();
    assert_eq!(ids(page.items), [2, 4]);
    // A range over the first field.
    let page = orders
        .open_orders_by_total_range(100..=500)
        .execute()
        .await
        .unwrap();
    assert_eq!(ids(page.items), [3, 1]);
}

pub async fn unique_and_conditional_indexes_work<E: TitoEngine>(ctx: Ctx<E>) {
    let orders = ctx.db.clone().model::<Order>();
    orders.build(order(1, "ada", 1, 10)).await.unwrap();
    let mut twin = order(2, "ada", 1, 10);
    twin.number = "N-1".into();
    let err = orders.build(twin).await.unwrap_err();
    assert!(
        matches!(err, tito::TitoError::UniqueViolation { .. }),
        "{err:?}"
    );
    let page = orders.order_by_number("N-1").execute().await.unwrap();
    assert_eq!(page.items.len(), 1);
    // Order 2 is closed (even id): not in the conditional index.
    orders.build(order(2, "ada", 1, 10)).await.unwrap();
    let page = orders.open_orders_by_total(10).execute().await.unwrap();
    assert_eq!(
        page.items.iter().map(|o| o.order_id).collect::<Vec<_>>(),
        [1]
    );
}

/// A booking: one per room and day (a composite unique index).
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(unique_index = "booking_by_slot: room, day")]
pub struct Booking {
    pub id: String,
    pub room: String,
    pub day: u32,
}

pub async fn a_unique_index_looks_up_one_row_or_none<E: TitoEngine>(ctx: Ctx<E>) {
    let orders = ctx.db.clone().model::<Order>();
    orders.build(order(1, "ada", 1, 10)).await.unwrap();
    let found = orders.get_order_by_number("N-1").await.unwrap();
    assert_eq!(found.map(|o| o.order_id), Some(1));
    assert_eq!(orders.get_order_by_number("N-404").await.unwrap(), None);

    let bookings = ctx.db.clone().model::<Booking>();
    for (id, room, day) in [("b1", "blue", 3), ("b2", "blue", 4), ("b3", "red", 3)] {
        bookings
            .build(Booking {
                id: id.into(),
                room: room.into(),
                day,
            })
            .await
            .unwrap();
    }
    let slot = bookings.get_booking_by_slot("blue", &4).await.unwrap();
    assert_eq!(slot.map(|b| b.id), Some("b2".to_string()));
    assert_eq!(bookings.get_booking_by_slot("red", &4).await.unwrap(), None);
    // A value that only prefixes a stored one names no row.
    assert_eq!(bookings.get_booking_by_slot("blu", &4).await.unwrap(), None);
    // In a transaction: what it sees, its own writes included.
    let tx = ctx.db.begin().await.unwrap();
    bookings
        .build_with_options(
            Booking {
                id: "b4".into(),
                room: "green".into(),
                day: 1,
            },
            tito::TitoOptions::default(),
            &tx,
        )
        .await
        .unwrap();
    let own = bookings
        .get_booking_by_slot_in_tx("green", 1, &tx)
        .await
        .unwrap();
    assert_eq!(own.map(|b| b.id), Some("b4".to_string()));
    let b2 = bookings
        .get_booking_by_slot_in_tx("blue", &4, &tx)
        .await
        .unwrap();
    assert_eq!(b2.map(|b| b.id), Some("b2".to_string()));
    assert_eq!(
        bookings.get_booking_by_slot("green", 1).await.unwrap(),
        None,
        "not committed"
    );
    tx.rollback().await.unwrap();
}

/// Typed query methods take text as anything `AsRef<str>` and other values by value or by
/// reference: every form binds the same value (the seed's `&str` and `&value` calls included).
#[allow(clippy::needless_borrows_for_generic_args)] // the borrowed forms are what is tested
pub async fn typed_query_arguments_take_what_converts<E: TitoEngine>(ctx: Ctx<E>) {
    let orders = ctx.db.clone().model::<Order>();
    for (id, customer, day, total) in [(1, "ada", 1, 500), (3, "bob", 2, 100), (5, "ada", 7, 300)] {
        orders.build(order(id, customer, day, total)).await.unwrap();
    }
    let ids = |items: Vec<Order>| items.into_iter().map(|o| o.order_id).collect::<Vec<_>>();
    let owned = String::from("ada");
    let shared: std::sync::Arc<str> = "ada".into();
    let cow = std::borrow::Cow::Borrowed("ada");
    let mut pages = Vec::new();
    pages.push(
        orders
            .order_by_customer_date("ada")
            .execute()
            .await
            .unwrap(),
    );
    pages.push(
        orders
            .order_by_customer_date(&owned)
            .execute()
            .await
            .unwrap(),
    );
    pages.push(
        orders
            .order_by_customer_date(owned.clone())
            .execute()
            .await
            .unwrap(),
    );
    pages.push(
        orders
            .order_by_customer_date(format!("a{}", "da"))
            .execute()
            .await
            .unwrap(),
    );
    pages.push(
        orders
            .order_by_customer_date(&format!("{}a", &owned[..2]))
            .execute()
            .await
            .unwrap(),
    );
    pages.push(
        orders
            .order_by_customer_date(shared)
            .execute()
            .await
            .unwrap(),
    );
    pages.push(orders.order_by_customer_date(cow).execute().await.unwrap());
    for page in pages {
        assert_eq!(ids(page.items), [1, 5]);
    }
    // Numbers and timestamps: by value or by reference.
    let by_value = orders.open_orders_by_total(500).execute().await.unwrap();
    let by_ref = orders.open_orders_by_total(&500).execute().await.unwrap();
    assert_eq!(ids(by_value.items), [1]);
    assert_eq!(ids(by_ref.items), [1]);
    let day = at(7);
    let page = orders
        .order_by_customer_date(&owned)
        .placed_at_eq(day)
        .execute()
        .await
        .unwrap();
    assert_eq!(ids(page.items), [5]);
    // Unique lookups take the same forms, one per field.
    let bookings = ctx.db.clone().model::<Booking>();
    bookings
        .build(Booking {
            id: "b1".into(),
            room: "blue".into(),
            day: 3,
        })
        .await
        .unwrap();
    let room = String::from("blue");
    for found in [
        bookings.get_booking_by_slot(&room, 3).await.unwrap(),
        bookings
            .get_booking_by_slot(room.clone(), &3)
            .await
            .unwrap(),
        bookings.get_booking_by_slot("blue", 3u32).await.unwrap(),
    ] {
        assert_eq!(found.map(|b| b.id), Some("b1".to_string()));
    }
    assert_eq!(bookings.get_booking_by_slot(room, 4).await.unwrap(), None);
    // An empty string is accepted on write and makes no entry (indexes are sparse): a query or
    // a unique lookup for it says so rather than that "" is not a string.
    let mut blank = order(7, "", 3, 100);
    blank.number = String::new();
    orders.build(blank).await.unwrap();
    bookings
        .build(Booking {
            id: "b2".into(),
            room: String::new(),
            day: 3,
        })
        .await
        .unwrap();
    for refused in [
        orders.order_by_customer_date("").execute().await.err(),
        orders.get_order_by_number(String::new()).await.err(),
        bookings.get_booking_by_slot("", 3).await.err(),
    ] {
        match refused {
            Some(TitoError::InvalidArgument(why)) => {
                assert!(why.contains("empty string never matches"), "{why}")
            }
            other => panic!("refused with a clear error: {other:?}"),
        }
    }
}

/// serde renames the stored keys; the indexes follow them.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[tito(index = "member_by_team: team_id")]
#[tito(index = "member_by_mail: email")]
pub struct Member {
    pub id: String,
    pub team_id: String,
    #[serde(rename = "mail", default)]
    pub email: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nickname: Option<String>,
}

pub async fn serde_renames_are_followed<E: TitoEngine>(ctx: Ctx<E>) {
    let names: Vec<String> = Member::default()
        .indexes()
        .into_iter()
        .map(|i| i.fields[0].name.clone())
        .collect();
    assert_eq!(names, ["teamId", "mail"]);
    let members = ctx.db.clone().model::<Member>();
    let ada = Member {
        id: "1".into(),
        team_id: "core".into(),
        email: "ada@x".into(),
        nickname: None,
    };
    members.build(ada.clone()).await.unwrap();
    assert_eq!(
        members
            .member_by_team("core")
            .execute()
            .await
            .unwrap()
            .items,
        vec![ada.clone()]
    );
    assert_eq!(
        members
            .member_by_mail("ada@x")
            .execute()
            .await
            .unwrap()
            .items,
        [ada]
    );
}

/// Contacts: a string index, and a composite index whose second field is a string.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(index = "contact_by_name: name")]
#[tito(index = "contact_by_team_city: team, city")]
pub struct Contact {
    pub id: String,
    pub name: String,
    pub team: String,
    pub city: String,
}

/// Names that sort around the bounds `""` and `"m"`, in byte order: below and at the key
/// separator (`:`) and the escape (`;`), upper case, and just past `"m"`.
const NAMES: [&str; 11] = [
    " ", "!bang", "0zero", ":colon", ";semi", "Zed", "alpha", "m", "m\u{1}", "ma", "zulu",
];

pub async fn an_empty_string_is_a_range_bound<E: TitoEngine>(ctx: Ctx<E>) {
    let contacts = ctx.db.clone().model::<Contact>();
    let mut rows = vec![Contact {
        id: "blank".into(),
        ..Contact::default()
    }];
    for (n, name) in NAMES.iter().enumerate() {
        rows.push(Contact {
            id: format!("n{n:02}"),
            name: name.to_string(),
            ..Contact::default()
        });
        // The same cities in team "core", and in teams whose names share its prefix.
        for team in ["cor", "core", "cores"] {
            rows.push(Contact {
                id: format!("{team}-{n:02}"),
                team: team.into(),
                city: name.to_string(),
                ..Contact::default()
            });
        }
    }
    for team in ["cor", "core", "cores"] {
        rows.push(Contact {
            id: format!("{team}-blank"),
            team: team.into(),
            ..Contact::default()
        });
    }
    for row in rows {
        contacts.build(row).await.unwrap();
    }
    let names = |items: Vec<Contact>| items.into_iter().map(|c| c.name).collect::<Vec<_>>();
    let cities = |items: Vec<Contact>| items.into_iter().map(|c| c.city).collect::<Vec<_>>();
    let up_to_m: Vec<&str> = NAMES[..8].to_vec();

    // From "" to "m": every name up to "m", in key order (the empty name has no entry).
    let page = contacts
        .contact_by_name_range(""..="m")
        .execute()
        .await
        .unwrap();
    assert_eq!(names(page.items), up_to_m);
    let page = contacts
        .contact_by_name_range(""..="m")
        .reverse(true)
        .execute()
        .await
        .unwrap();
    let mut down = up_to_m.clone();
    down.reverse();
    assert_eq!(names(page.items), down);
    // In pages, continued with cursors.
    let mut paged = Vec::new();
    let mut cursor = None;
    loop {
        let page = contacts
            .contact_by_name_range(""..="m")
            .limit(3)
            .cursor(cursor)
            .execute()
            .await
            .unwrap();
        paged.extend(names(page.items));
        cursor = page.cursor;
        if cursor.is_none() {
            break;
        }
    }
    assert_eq!(paged, up_to_m);
    // "" as either bound, included or not.
    let all = NAMES.to_vec();
    for (range, expected) in [
        ((Bound::Included(""), Bound::Unbounded), all.clone()),
        ((Bound::Excluded(""), Bound::Unbounded), all.clone()),
        (
            (Bound::Included(""), Bound::Excluded("m")),
            NAMES[..7].to_vec(),
        ),
        ((Bound::Unbounded, Bound::Included("")), vec![]),
        ((Bound::Unbounded, Bound::Excluded("")), vec![]),
        ((Bound::Included(""), Bound::Included("")), vec![]),
    ] {
        let page = contacts
            .contact_by_name_range(range)
            .execute()
            .await
            .unwrap();
        assert_eq!(names(page.items), expected, "{range:?}");
    }

    // A string as the second field of a composite index: only team "core"'s rows.
    let page = contacts
        .contact_by_team_city("core")
        .city(""..="m")
        .execute()
        .await
        .unwrap();
    assert_eq!(cities(page.items), up_to_m);
    let page = contacts
        .contact_by_team_city("core")
        .city(""..)
        .reverse(true)
        .execute()
        .await
        .unwrap();
    let mut every = all.clone();
    every.reverse();
    assert_eq!(cities(page.items), every);
    // A team from "" on reaches every team with a city.
    let page = contacts
        .contact_by_team_city_range(""..)
        .limit(1000)
        .execute()
        .await
        .unwrap();
    assert_eq!(page.items.len(), 3 * NAMES.len());

    // Equality with "" keeps its rule: it never matches, and says so.
    for refused in [
        contacts.contact_by_name("").execute().await.err(),
        contacts
            .contact_by_team_city("core")
            .city_eq("")
            .execute()
            .await
            .err(),
    ] {
        match refused {
            Some(TitoError::InvalidArgument(why)) => {
                assert!(why.contains("empty string never matches"), "{why}")
            }
            other => panic!("equality with \"\" is refused: {other:?}"),
        }
    }
}

/// A unit enum indexed by its serde name.
#[derive(tito::IndexValue, Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    #[default]
    Pending,
    Paid,
    Shipped,
    Cancelled,
}

/// A newtype over a string.
#[derive(tito::IndexValue, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CustomerId(pub String);

/// A newtype over a signed integer (negative amounts sort first).
#[derive(tito::IndexValue, Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Cents(pub i64);

/// A one-field struct made transparent.
#[derive(tito::IndexValue, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Sku {
    pub code: String,
}

#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "desk_order")]
#[tito(index = "desk_by_status: status")]
#[tito(index = "desk_by_customer_status: customer, status")]
#[tito(index = "desk_by_total: total")]
#[tito(index = "desk_by_flag: flag")]
#[tito(index = "desk_by_history: history")]
#[tito(index = "desk_by_sku: sku")]
#[tito(unique_index = "desk_by_reference: reference")]
pub struct DeskOrder {
    pub id: String,
    pub customer: CustomerId,
    pub status: Status,
    pub total: Cents,
    /// Sparse: `None` is in no entry.
    pub flag: Option<Status>,
    /// An entry per element.
    pub history: Vec<Status>,
    pub sku: Sku,
    pub reference: uuid::Uuid,
}

fn desk(id: &str, customer: &str, status: Status, total: i64, n: u128) -> DeskOrder {
    DeskOrder {
        id: id.into(),
        customer: CustomerId(customer.into()),
        status,
        total: Cents(total),
        flag: (status == Status::Cancelled).then_some(Status::Cancelled),
        history: vec![Status::Pending, status],
        sku: Sku {
            code: format!("sku-{id}"),
        },
        // Version-7-like: the time in the high bits, so references sort as they were made.
        reference: uuid::Uuid::from_u128((n << 80) | 0x7000_0000_0000_8000_0000_0000_0000),
    }
}

fn desk_ids(page: &tito::TitoPage<DeskOrder>) -> Vec<&str> {
    page.items.iter().map(|o| o.id.as_str()).collect()
}

// Queries take the value or a reference to it: both forms are written here on purpose.
#[allow(clippy::needless_borrows_for_generic_args)]
pub async fn enums_newtypes_and_uuids_are_index_values<E: TitoEngine>(ctx: Ctx<E>) {
    let orders = ctx.db.clone().model::<DeskOrder>();
    for order in [
        desk("1", "ada", Status::Paid, 4200, 1),
        desk("2", "ada", Status::Shipped, -100, 2),
        desk("3", "bob", Status::Paid, 0, 3),
        desk("4", "bob", Status::Cancelled, 99, 4),
    ] {
        orders.build(order).await.unwrap();
    }
    // By value and by reference; the stored key is the serde name.
    let paid = orders.desk_by_status(Status::Paid).execute().await.unwrap();
    assert_eq!(desk_ids(&paid), ["1", "3"]);
    let shipped = orders
        .desk_by_status(&Status::Shipped)
        .execute()
        .await
        .unwrap();
    assert_eq!(desk_ids(&shipped), ["2"]);
    // The untyped builder takes the serde name: the same entries.
    let by_name = orders
        .query_by_index("desk_by_status")
        .value("paid")
        .execute()
        .await
        .unwrap();
    assert_eq!(by_name.items, paid.items);
    // A range over an enum is in its names' byte order: cancelled < paid < pending < shipped.
    let upto_paid = orders
        .desk_by_status_range(..=Status::Paid)
        .execute()
        .await
        .unwrap();
    assert_eq!(desk_ids(&upto_paid), ["4", "1", "3"]);
    // Composite: a newtype then an enum.
    let ada_paid = orders
        .desk_by_customer_status(&CustomerId("ada".into()))
        .status_eq(Status::Paid)
        .execute()
        .await
        .unwrap();
    assert_eq!(desk_ids(&ada_paid), ["1"]);
    // A newtype over i64 sorts as numbers, negatives first.
    let totals = orders
        .desk_by_total_range(Cents(-1_000)..Cents(100))
        .execute()
        .await
        .unwrap();
    assert_eq!(desk_ids(&totals), ["2", "3", "4"]);
    // Option is sparse; Vec is an entry per element.
    let flagged = orders.desk_by_flag_range(..).execute().await.unwrap();
    assert_eq!(desk_ids(&flagged), ["4"]);
    let ever_pending = orders
        .desk_by_history(Status::Pending)
        .execute()
        .await
        .unwrap();
    assert_eq!(ever_pending.items.len(), 4);
    let sku = orders
        .desk_by_sku(Sku {
            code: "sku-3".into(),
        })
        .execute()
        .await
        .unwrap();
    assert_eq!(desk_ids(&sku), ["3"]);
    // A UUID: unique, looked up, and ranged in the order the references were made.
    let third = desk("3", "bob", Status::Paid, 0, 3).reference;
    let one = orders.desk_by_reference(third).execute().await.unwrap();
    assert_eq!(desk_ids(&one), ["3"]);
    let later = orders
        .desk_by_reference_range(desk("", "", Status::Paid, 0, 2).reference..)
        .execute()
        .await
        .unwrap();
    assert_eq!(desk_ids(&later), ["2", "3", "4"]);
    let mut taken = desk("5", "eve", Status::Pending, 1, 3);
    taken.reference = third;
    assert!(matches!(
        orders.build(taken).await,
        Err(TitoError::UniqueViolation { .. })
    ));
    // An update moves the entries; the old value's are gone.
    let mut one = orders.find_by_id("1", vec![]).await.unwrap();
    one.status = Status::Shipped;
    orders.update(one).await.unwrap();
    let paid = orders.desk_by_status(Status::Paid).execute().await.unwrap();
    assert_eq!(desk_ids(&paid), ["3"]);
}

/// A unit enum indexed by its number (serialized as one by serde_repr).
#[derive(
    tito::IndexValue,
    serde_repr::Serialize_repr,
    serde_repr::Deserialize_repr,
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
)]
#[repr(i8)]
#[tito(index_as = "number")]
pub enum Priority {
    Backlog = -1,
    #[default]
    Normal = 0,
    High = 5,
    Urgent = 10,
}

#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "ticket")]
#[tito(index = "ticket_by_priority: priority")]
pub struct Ticket {
    pub id: String,
    pub priority: Priority,
}

pub async fn enums_by_number_sort_by_number<E: TitoEngine>(ctx: Ctx<E>) {
    let tickets = ctx.db.clone().model::<Ticket>();
    for (id, priority) in [
        ("u", Priority::Urgent),
        ("b", Priority::Backlog),
        ("h", Priority::High),
        ("n", Priority::Normal),
    ] {
        tickets
            .build(Ticket {
                id: id.into(),
                priority,
            })
            .await
            .unwrap();
    }
    // Declared numbers' order, the negative one first (by name it would be b, h, n, u).
    let all = tickets
        .ticket_by_priority_range(..)
        .execute()
        .await
        .unwrap();
    let ids: Vec<&str> = all.items.iter().map(|t| t.id.as_str()).collect();
    assert_eq!(ids, ["b", "n", "h", "u"]);
    let pressing = tickets
        .ticket_by_priority_range(Priority::High..)
        .reverse(true)
        .execute()
        .await
        .unwrap();
    let ids: Vec<&str> = pressing.items.iter().map(|t| t.id.as_str()).collect();
    assert_eq!(ids, ["u", "h"]);
    assert_eq!(
        tickets
            .query_by_index("ticket_by_priority")
            .value(&5)
            .execute()
            .await
            .unwrap()
            .items[0]
            .id,
        "h"
    );
}

/// Indexed by name, but serde makes each variant an object.
#[derive(tito::IndexValue, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind")]
pub enum Tagged {
    #[default]
    First,
    Second,
}

/// Two variants of one serde name (written by hand: serde's derive would warn of it).
#[derive(tito::IndexValue, Clone, Debug, Default, PartialEq)]
pub enum Twins {
    #[default]
    One,
    Two,
}

impl Serialize for Twins {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("One")
    }
}

impl<'de> Deserialize<'de> for Twins {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(|_| Twins::One)
    }
}

/// Indexed by number, serialized by name.
#[derive(tito::IndexValue, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[repr(u8)]
#[tito(index_as = "number")]
pub enum NamedNotNumbered {
    #[default]
    Low = 1,
    High = 2,
}

#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "bad_tagged")]
#[tito(index = "bad_by_tag: tag")]
pub struct BadTagged {
    pub id: String,
    pub tag: Tagged,
}

#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "bad_twins")]
#[tito(index = "bad_by_twin: twin")]
pub struct BadTwins {
    pub id: String,
    pub twin: Option<Twins>,
}

#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "bad_numbered")]
#[tito(index = "bad_by_level: level")]
pub struct BadNumbered {
    pub id: String,
    pub level: Vec<NamedNotNumbered>,
}

pub async fn an_enum_whose_serde_form_is_not_its_kind_is_refused_at_first_use<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let tagged = ctx.db.clone().model::<BadTagged>();
    let err = tagged.build(BadTagged::default()).await.unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err:?}");
    assert!(
        text.contains("field `tag` of index `bad_by_tag`")
            && text.contains("`Tagged::First` serializes as {\"kind\":\"First\"}")
            && text.contains("remove the serde attribute"),
        "{text}"
    );
    // A query is refused the same way, and nothing was written.
    let err = tagged
        .bad_by_tag(Tagged::First)
        .execute()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("`Tagged::First`"), "{err}");
    assert!(
        crate::support::read(&ctx.db, tito::keys::row_key("bad_tagged", "").as_bytes())
            .await
            .is_none()
    );
    let twins = ctx.db.clone().model::<BadTwins>();
    let text = twins
        .build(BadTwins::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("`Twins::One` and `Twins::Two` both serialize as \"One\""),
        "{text}"
    );
    let numbered = ctx.db.clone().model::<BadNumbered>();
    let text = numbered
        .build(BadNumbered::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("`NamedNotNumbered::Low` serializes as \"Low\"")
            && text.contains("serde_repr"),
        "{text}"
    );
}

/// The first deploy: the status is a string.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "shipment")]
#[tito(index = "shipment_by_status: status")]
pub struct ShipmentV1 {
    pub id: String,
    pub status: String,
}

/// The next deploy: the same rows, the status an enum of the same serde form.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "shipment")]
#[tito(index = "shipment_by_status: status")]
pub struct Shipment {
    pub id: String,
    pub status: Status,
}

pub async fn a_string_field_becomes_an_enum_over_the_same_stored_rows<E: TitoEngine>(ctx: Ctx<E>) {
    let old = ctx.db.clone().model::<ShipmentV1>();
    for (id, status) in [("1", "paid"), ("2", "shipped"), ("3", "paid")] {
        old.build(ShipmentV1 {
            id: id.into(),
            status: status.into(),
        })
        .await
        .unwrap();
    }
    // The index's definition is the same (a string key), so the catalog takes the new code's
    // declaration as it is: no new name, no rebuild, and the old entries answer.
    let new = ctx.db.clone().model::<Shipment>();
    let paid = new
        .shipment_by_status(Status::Paid)
        .execute()
        .await
        .unwrap();
    let ids: Vec<&str> = paid.items.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(ids, ["1", "3"]);
    new.build(Shipment {
        id: "4".into(),
        status: Status::Paid,
    })
    .await
    .unwrap();
    // The old code reads what the new one wrote, through the same index.
    let paid = old.shipment_by_status("paid").execute().await.unwrap();
    assert_eq!(paid.items.len(), 3);
    let report = new.audit(|_| {}).await.unwrap();
    assert!(report.is_clean(), "{report:?}");
}

#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "far_event")]
#[tito(index = "far_by_at: at")]
#[tito(unique_index = "far_by_slot: slot")]
pub struct FarEvent {
    pub id: String,
    pub at: DateTime<Utc>,
    pub slot: DateTime<Utc>,
    pub reading: f64,
}

pub async fn far_timestamps_are_indexed_and_unreadable_floats_refused<E: TitoEngine>(ctx: Ctx<E>) {
    // Years chrono writes with a sign (before 0000, after 9999) are indexed in order, and a
    // unique index holds over them.
    let events = ctx.db.clone().model::<FarEvent>();
    let year = |y: i32| Utc.with_ymd_and_hms(y, 1, 1, 0, 0, 0).unwrap();
    for (id, y) in [("a", 2024), ("b", 10_000), ("c", -1)] {
        events
            .build(FarEvent {
                id: id.into(),
                at: year(y),
                slot: year(y),
                reading: 1.0,
            })
            .await
            .unwrap();
    }
    let all = events.far_by_at_range(..).execute().await.unwrap();
    let ids: Vec<&str> = all.items.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, ["c", "a", "b"]);
    let far = events.far_by_at(year(10_000)).execute().await.unwrap();
    assert_eq!(far.items.len(), 1);
    let taken = events
        .build(FarEvent {
            id: "d".into(),
            at: year(1),
            slot: year(10_000),
            reading: 1.0,
        })
        .await;
    assert!(
        matches!(taken, Err(TitoError::UniqueViolation { .. })),
        "{taken:?}"
    );
    // A NaN or infinite float would be written as null and never read back: refused, nothing
    // written.
    for reading in [f64::NAN, f64::INFINITY] {
        let err = events
            .build(FarEvent {
                id: "nan".into(),
                at: year(2000),
                slot: year(2000),
                reading,
            })
            .await
            .unwrap_err();
        assert!(
            matches!(err, TitoError::InvalidArgument(_)) && err.to_string().contains("NaN"),
            "{err}"
        );
    }
    assert!(events.get("nan").await.unwrap().is_none());
}
