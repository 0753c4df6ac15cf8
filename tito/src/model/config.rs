//! What a model says about itself: its id and table, its indexes, its events.

pub use crate::event::TitoOperation;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// A type stored as rows of one table, with secondary indexes and events.
///
/// Write the impl by hand, as below, or let `#[derive(TitoModel)]` generate the same one.
///
/// ```
/// use serde::{Deserialize, Serialize};
/// use tito::model::{TitoEventConfig, TitoIndexBlockType, TitoIndexConfig, TitoIndexField, TitoModelTrait};
///
/// #[derive(Default, Clone, Serialize, Deserialize)]
/// struct User {
///     id: String,
///     name: String,
///     email: String,
/// }
///
/// impl TitoModelTrait for User {
///     fn id(&self) -> String {
///         self.id.clone()
///     }
///
///     fn table(&self) -> String {
///         "user".to_string()
///     }
///
///     fn indexes(&self) -> Vec<TitoIndexConfig> {
///         vec![TitoIndexConfig {
///             condition: true,
///             name: "by_email".to_string(),
///             fields: vec![TitoIndexField {
///                 name: "email".to_string(),
///                 r#type: TitoIndexBlockType::String,
///             }],
///         }]
///     }
///
///     fn events(&self) -> Vec<TitoEventConfig> {
///         vec![]
///     }
/// }
/// ```
///
/// `table` and the names and fields of the indexes must not depend on the row: queries read them
/// from `Self::default()`. `condition` may depend on the row.
pub trait TitoModelTrait:
    Default + Clone + Serialize + DeserializeOwned + Send + Sync + 'static
{
    /// The version of the rows' shape this code reads and writes (the derive's
    /// `#[tito(version = N)]`; 1 when not declared). Rows of version 1 are stored as their JSON
    /// alone, rows of a later version with a header that says it (see [`crate::model::shape`]).
    const VERSION: u32 = 1;

    /// Reads a stored row of an older `version` than [`Self::VERSION`] through the model's
    /// previous shapes (the derive's `from = "Previous"`, a [`TitoShape`](crate::model::TitoShape)
    /// converted with `From` or the `upgrade = "function"` it names). Without previous shapes
    /// no older row reads.
    fn upgrade(version: u32, json: &[u8]) -> Result<Self, crate::model::ShapeError> {
        let _ = json;
        let _ = version;
        Err(crate::model::ShapeError::Unknown)
    }

    /// This row as JSON of an older shape `version`, for writes while the table's catalog lets
    /// writers write no newer shape than that (a rolling deploy: the previous deploy's
    /// instances must be able to read every row). The derive's `downgrade = "function"`
    /// (`fn(&Self) -> Previous`) converts to the shape `from` names; `None` (the default): this
    /// code cannot write that version, and its writes are refused until the newer one is
    /// allowed ([`crate::schema::allow_shape_version`]).
    fn downgrade(&self, version: u32) -> Option<Result<Vec<u8>, crate::model::ShapeError>> {
        let _ = version;
        None
    }

    /// Whether [`downgrade`](Self::downgrade) converts to shape `version` (answered without a
    /// row: the derive's `downgrade` converts to the version of the shape `from` names).
    fn downgrades_to(version: u32) -> bool {
        let _ = version;
        false
    }

    /// The name of the field that holds the id in the row's JSON (the derive's id field;
    /// `"id"` when not given). Writes through a [`downgrade`](Self::downgrade) check that the
    /// older shape keeps the id there.
    const ID_FIELD: &'static str = "id";

    /// The row's id, unique within the table.
    fn id(&self) -> String;

    /// The table's name.
    fn table(&self) -> String;

    /// The secondary indexes. An entry is written for a row only where `condition` holds and
    /// every field holds a value of its type (indexes are sparse).
    fn indexes(&self) -> Vec<TitoIndexConfig> {
        Vec::new()
    }

    /// Indexes whose combination of values may belong to one row only. They are queried like
    /// the others; a second row with the same values fails with
    /// [`TitoError::UniqueViolation`](crate::TitoError::UniqueViolation). Names share one space
    /// with [`Self::indexes`].
    fn unique_indexes(&self) -> Vec<TitoIndexConfig> {
        Vec::new()
    }

    /// The identity of each row-dependent index condition: the index it belongs to, a name for
    /// the code that decides it, and a version to bump whenever its meaning changes (the
    /// derive's `condition = "method"` with `condition_version = N`, default 1). The stored
    /// schema catalog ([`crate::schema`]) compares identities, never code: an index whose
    /// condition changed meaning under the same identity keeps entries decided by the old one.
    /// Indexes not listed here are taken to have no condition (every row with values of the
    /// field types is in them), which lets writers of an older deploy maintain them too.
    fn conditions(&self) -> Vec<TitoCondition> {
        Vec::new()
    }

    /// The indexes whose entries hold only the row's key instead of a copy of the row (the
    /// derive's `entries = "keys"` beside an `index` or `unique_index`).
    ///
    /// A query over such an index reads its entries, then their rows in one batched read (on
    /// TiKV one more round trip); a write stores only the entry's key, and an update that
    /// leaves an entry's key as it was does not rewrite the entry. Copies (the default) answer
    /// a query from the entries alone, at the cost of writing the row once more per index.
    /// Copies suit narrow rows and read-heavy indexes; keys suit wide rows, many indexes and
    /// write-heavy tables (`cargo bench --bench models` measures both). The layout is part of
    /// the index's definition in the schema catalog: switching an index from one to the other is
    /// a new definition (give it a new name). Names that are not indexes of the model are
    /// refused as [`TitoError::InvalidArgument`](crate::TitoError::InvalidArgument).
    fn key_only_indexes(&self) -> Vec<String> {
        Vec::new()
    }

    /// The events a write of this row publishes, in the write's transaction: every write
    /// (insert, update, upsert, delete) publishes each of them for which
    /// [`publishes_on`](Self::publishes_on) holds, unless its options switch events off
    /// ([`TitoOptions::without_events`]).
    fn events(&self) -> Vec<TitoEventConfig> {
        Vec::new()
    }

    /// Whether the event `name` is published by a write reporting `operation` (every operation,
    /// unless this says otherwise; the derive's `#[tito(event = "..", on = "insert, delete")]`
    /// limits it).
    fn publishes_on(&self, name: &str, operation: TitoOperation) -> bool {
        let _ = (name, operation);
        true
    }

    /// Whether Tito sets the row's `created_at` (on insert) and `updated_at` (on every write)
    /// from the transaction's time, where the model serializes them. `false` (the derive's
    /// `#[tito(manual_timestamps)]`) stores the values the model holds, always. One write can
    /// also keep them with [`TitoOptions::keeping_timestamps`] (for imports and migrations).
    fn managed_timestamps(&self) -> bool {
        true
    }

    /// Why an index field's type would not be stored as the kind of key its index declares,
    /// if it would not (the derive asks each field's [`IndexValue`](crate::model::IndexValue):
    /// an enum whose serde form is not its declared kind). Checked when the model is first
    /// used; the error names the index, the field and the variant.
    fn index_value_problem(&self) -> Option<String> {
        None
    }
}

/// One secondary index.
#[derive(Clone, Debug, PartialEq)]
pub struct TitoIndexConfig {
    /// Whether this row belongs in the index at all (a model-specific inclusion rule).
    pub condition: bool,
    /// The index's name, unique within its table (index and claim keys carry the table).
    pub name: String,
    /// The indexed fields, in key order. A query binds a prefix of them.
    pub fields: Vec<TitoIndexField>,
}

/// The identity of an index's row-dependent condition (see [`TitoModelTrait::conditions`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize, Serialize)]
pub struct TitoCondition {
    /// The index the condition belongs to.
    pub index: String,
    /// A name for the code that decides it (the derive uses the method's name).
    pub name: String,
    /// Bumped whenever the condition's meaning changes (1 for the first).
    pub version: u32,
}

/// One field of an index.
#[derive(Clone, Debug, PartialEq)]
pub struct TitoIndexField {
    /// The field's name in the row's JSON. A dotted name (`address.city`) reaches into objects.
    pub name: String,
    /// The type a value must have to be indexed.
    pub r#type: TitoIndexBlockType,
}

/// The type of an indexed field, which decides its key encoding (and so its order).
///
/// A JSON array in the field yields one entry per element of the type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TitoIndexBlockType {
    /// A non-empty JSON string.
    String,
    /// Any JSON number, ordered as an `f64` (integers beyond 2^53 lose precision: use
    /// [`Self::Integer`] or [`Self::Unsigned`] for them).
    Number,
    /// A JSON number that is an `i64`.
    Integer,
    /// A JSON number that is a `u64`.
    Unsigned,
    /// A JSON boolean.
    Boolean,
    /// An RFC 3339 string (chrono's serde format), ordered by instant.
    Timestamp,
}

/// An event a model publishes when written with events enabled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TitoEventConfig {
    /// The queue (topic) the event goes to.
    pub name: String,
    /// When the event becomes runnable, in Unix seconds (never negative).
    pub timestamp: i64,
}

/// Options of one write.
///
/// By default a write publishes the model's declared events ([`TitoModelTrait::events`]) in its
/// transaction, reporting the operation it performed: [`TitoOperation::Insert`] for `build`,
/// `Update` for `update`, `Delete` for `delete_by_id`, and for `upsert` `Insert` or `Update` as
/// the row was absent or present.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TitoOptions {
    /// The operation the caller states its events report ([`TitoOptions::with_events`]). A
    /// statement that contradicts the write is refused with
    /// [`TitoError::InvalidArgument`](crate::TitoError::InvalidArgument) before anything is
    /// written; `None` reports what the write did.
    pub events: Option<TitoOperation>,
    /// Publish nothing for this write ([`TitoOptions::without_events`]): bulk imports, repairs.
    pub skip_events: bool,
    /// Store `created_at` / `updated_at` as the model holds them, instead of the transaction's
    /// time (importing or migrating rows with their original times).
    pub keep_timestamps: bool,
}

impl TitoOptions {
    /// Publishes the model's events, stating that the write is `operation`: `Insert` for
    /// `build`, `Update` for `update`, `Delete` for a delete, and for an upsert `Upsert` (then
    /// the events report `Upsert`) or the operation the upsert turns out to be. Any other
    /// statement is refused before anything is written.
    pub fn with_events(operation: TitoOperation) -> Self {
        TitoOptions {
            events: Some(operation),
            ..TitoOptions::default()
        }
    }

    /// The same options, storing `created_at` / `updated_at` as given for this write.
    pub fn keeping_timestamps(mut self) -> Self {
        self.keep_timestamps = true;
        self
    }

    /// Publishes none of the model's events for this write.
    pub fn without_events() -> Self {
        TitoOptions {
            skip_events: true,
            ..TitoOptions::default()
        }
    }
}
