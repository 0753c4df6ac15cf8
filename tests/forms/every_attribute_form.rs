//! Every attribute form of `#[derive(TitoModel)]` compiles, and every public item it generates
//! is documented (this crate denies missing docs).
#![deny(missing_docs)]
// clippy reads two `condition = ..` (or `at = ..`) of different attributes as one attribute
// given twice (rust-clippy#12923).
#![allow(clippy::duplicated_attributes)]
// The query methods take values and references alike; these calls pass references on purpose.
#![allow(clippy::needless_borrows_for_generic_args)]

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tito::backend::embedded::Embedded;
use tito::model::TitoModelTrait;
use tito::{TitoEngine, TitoModel};

/// A model using every attribute form.
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(table = "people")]
#[tito(index = "by_email: email")]
#[tito(index = "by_team_created: team_id, created_at")]
#[tito(index = "active_by_team: team_id", condition = "is_active")]
#[tito(unique_index = "by_handle: handle")]
#[tito(
    unique_index = "active_by_handle: handle",
    condition = "is_active",
    condition_version = 2
)]
#[tito(index = "by_tag: tags")]
#[tito(index = "by_nickname: nickname", entries = "keys")]
#[tito(index = "by_score_joined: score, joined, verified")]
#[tito(event = "user")]
#[tito(event = "reminder", at = "remind_at")]
#[tito(event = "followup", at = "followup_at")]
#[tito(event = "maybe", at = "maybe_at")]
#[tito(event = "user.removed", on = "delete")]
#[tito(event = "changed", at = "remind_at", on = "insert, update")]
pub struct User {
    /// Id.
    #[tito(id)]
    pub key: u32,
    /// Email.
    pub email: String,
    /// Team.
    pub team_id: String,
    /// Creation time, Unix seconds.
    pub created_at: i64,
    /// Handle.
    pub handle: String,
    /// Tags.
    pub tags: Vec<String>,
    /// Nickname.
    pub nickname: Option<String>,
    /// Score.
    pub score: f64,
    /// Join time.
    pub joined: DateTime<Utc>,
    /// Verified.
    pub verified: bool,
    /// Reminder time.
    pub remind_at: i64,
    /// Maybe time.
    pub maybe_at: Option<DateTime<Utc>>,
    /// Active.
    pub active: bool,
}

impl User {
    fn is_active(&self) -> bool {
        self.active
    }

    fn followup_at(&self) -> i64 {
        self.remind_at + 3600
    }
}

/// A model with the defaults: id field named `id`, table from the struct name.
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
pub struct AuditEntry {
    /// Id.
    pub id: String,
}

/// Rows imported with their own times: Tito never sets them.
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(manual_timestamps)]
pub struct Imported {
    /// Id.
    pub id: String,
    /// Kept as given.
    pub created_at: i64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_attribute_form_compiles_and_behaves() {
    assert_eq!(AuditEntry::default().table(), "audit_entry");
    assert_eq!(User::default().table(), "people");
    assert!(User::default().managed_timestamps());
    assert!(!Imported::default().managed_timestamps());
    // Conditions are identified by method name and version (default 1).
    let conditions = User::default().conditions();
    assert_eq!(conditions.len(), 2);
    assert_eq!(
        (
            conditions[0].index.as_str(),
            conditions[0].name.as_str(),
            conditions[0].version
        ),
        ("active_by_team", "is_active", 1)
    );
    assert_eq!(
        (conditions[1].index.as_str(), conditions[1].version),
        ("active_by_handle", 2)
    );
    // `entries = "keys"`: the index's entries hold only keys.
    assert_eq!(User::default().key_only_indexes(), ["by_nickname"]);
    // Each event has a typed topic, named after it; `on` limits the operations that publish.
    use tito::model::TitoOperation;
    let topic: tito::queue::Topic<tito::queue::ModelEvent<User>> = User::USER_REMOVED_EVENT;
    assert_eq!(topic.name(), "user.removed");
    assert_eq!(User::CHANGED_EVENT.name(), "changed");
    assert_eq!(User::USER_EVENT.name(), "user");
    let user = User::default();
    assert!(user.publishes_on("user.removed", TitoOperation::Delete));
    assert!(!user.publishes_on("user.removed", TitoOperation::Insert));
    assert!(user.publishes_on("changed", TitoOperation::Upsert));
    assert!(!user.publishes_on("changed", TitoOperation::Delete));
    assert!(user.publishes_on("user", TitoOperation::Delete));
    let db = Embedded::temporary().await.unwrap();
    let users = db.model::<User>();
    let joined = DateTime::<Utc>::from_timestamp(0, 0).unwrap();
    let _ = users
        .by_email("a@b")
        .limit(Some(5))
        .execute()
        .await
        .unwrap();
    let _ = users
        .by_team_created("t")
        .created_at(0..10)
        .execute()
        .await
        .unwrap();
    let _ = users
        .by_team_created("t")
        .created_at_eq(&3)
        .execute()
        .await
        .unwrap();
    let _ = users
        .by_team_created_range("a".."b")
        .execute()
        .await
        .unwrap();
    let _ = users.active_by_team("t").execute().await.unwrap();
    let _ = users.by_handle("h").execute().await.unwrap();
    let _ = users.by_tag("x").cursor(None).execute().await.unwrap();
    let _ = users
        .by_nickname("n")
        .reverse(true)
        .execute()
        .await
        .unwrap();
    let _ = users
        .by_score_joined(&1.5)
        .joined_eq(&joined)
        .verified(..=true)
        .execute()
        .await
        .unwrap();
    let query = users.by_score_joined(&1.5).into_query();
    let _ = query.execute().await.unwrap();
}
