//! Which fields of a model play which inbox role, and the claim index they imply.

use crate::model::{TitoIndexBlockType, TitoIndexConfig, TitoIndexField, TitoModelTrait};

/// Which fields of a model play which inbox role. Build with [`InboxSpec::new`] and the setters
/// (each takes the field's name in the row's JSON).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboxSpec {
    /// The group field.
    pub group: Option<String>,
    /// The priority field.
    pub priority: Option<String>,
    /// The partition key field.
    pub partition_key: Option<String>,
    /// The retry-after field (Unix ms).
    pub retry_after: Option<String>,
    /// The attempt counter field.
    pub attempt: Option<String>,
    /// The processed-at field (Unix ms or null).
    pub processed_at: Option<String>,
    /// The lease field (Unix ms or null).
    pub locked_until: Option<String>,
    /// The headers field (a string map).
    pub headers: Option<String>,
    /// The payload field.
    pub payload: Option<String>,
}

macro_rules! role_setters {
    ($($role:ident),*) => {$(
        #[doc = concat!("Names the `", stringify!($role), "` field.")]
        pub fn $role(mut self, field: &str) -> Self {
            self.$role = Some(field.to_string());
            self
        }
    )*};
}

impl InboxSpec {
    /// No roles but the id.
    pub fn new() -> Self {
        InboxSpec::default()
    }

    role_setters!(
        group,
        priority,
        partition_key,
        retry_after,
        attempt,
        processed_at,
        locked_until,
        headers,
        payload
    );

    /// The name of the claim index of `table`.
    pub fn claim_index_name(table: &str) -> String {
        format!("{table}_inbox_claim")
    }

    /// The claim index a model with these roles must declare in `indexes()`: group, priority and
    /// retry_after (those that exist), holding only unprocessed rows. `processed` is whether
    /// this row is processed. `None` when no ordering role exists (claims then walk the table in
    /// id order, its primary index).
    pub fn claim_index(&self, table: &str, processed: bool) -> Option<TitoIndexConfig> {
        let mut fields = Vec::new();
        if let Some(group) = &self.group {
            fields.push(TitoIndexField {
                name: group.clone(),
                r#type: TitoIndexBlockType::String,
            });
        }
        if let Some(priority) = &self.priority {
            fields.push(TitoIndexField {
                name: priority.clone(),
                r#type: TitoIndexBlockType::Integer,
            });
        }
        if let Some(retry_after) = &self.retry_after {
            fields.push(TitoIndexField {
                name: retry_after.clone(),
                r#type: TitoIndexBlockType::Integer,
            });
        }
        (!fields.is_empty()).then(|| TitoIndexConfig {
            condition: !processed,
            name: Self::claim_index_name(table),
            fields,
        })
    }
}

/// A model whose rows are an inbox. `#[derive(TitoModel)]` with `#[tito(inbox)]` implements it;
/// by hand, return the spec and declare [`InboxSpec::claim_index`] in `indexes()`.
pub trait InboxModel: TitoModelTrait {
    /// The roles of the model's fields.
    fn inbox_spec() -> InboxSpec;
}
