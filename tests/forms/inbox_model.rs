//! An inbox model with every role compiles, implements `InboxModel`, declares its claim index,
//! and documents everything it generates.
#![deny(missing_docs)]

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tito::TitoModel;
use tito::inbox::InboxModel;
use tito::model::TitoModelTrait;

/// What an email job sends.
#[derive(Default, Clone, Debug, Serialize, Deserialize)]
pub struct Email {
    /// Recipient.
    pub to: String,
}

/// An email job.
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(inbox)]
#[serde(rename_all = "camelCase")]
pub struct EmailJob {
    /// Id.
    pub id: String,
    /// Group.
    #[tito(group)]
    pub queue_name: String,
    /// Priority.
    #[tito(priority)]
    pub priority: i64,
    /// Partition key.
    #[tito(partition_key)]
    pub tenant: String,
    /// Retry after (Unix ms).
    #[tito(retry_after)]
    pub retry_after: i64,
    /// Attempt.
    #[tito(attempt)]
    pub attempt: i64,
    /// Processed at (Unix ms).
    #[tito(processed_at)]
    pub processed_at: Option<i64>,
    /// Lease (Unix ms).
    #[tito(locked_until)]
    pub locked_until: Option<i64>,
    /// Headers.
    #[tito(headers)]
    pub headers: BTreeMap<String, String>,
    /// Payload.
    #[tito(payload)]
    pub payload: Email,
}

#[test]
fn an_inbox_models_roles_and_claim_index() {
    let spec = EmailJob::inbox_spec();
    assert_eq!(spec.group.as_deref(), Some("queueName"));
    assert_eq!(spec.retry_after.as_deref(), Some("retryAfter"));
    let indexes = EmailJob::default().indexes();
    assert_eq!(indexes[0].name, "email_job_inbox_claim");
    assert!(indexes[0].condition);
    let done = EmailJob {
        processed_at: Some(1),
        ..Default::default()
    };
    assert!(!done.indexes()[0].condition);
}
