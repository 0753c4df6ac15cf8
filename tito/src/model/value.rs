//! Index values: the Rust types a model's index fields may have.
//!
//! An index entry's key holds a field's value as the row's JSON holds it, encoded so that keys
//! sort as the values do. [`IndexValue`] says which kind of key a type is stored as (its
//! [`TitoIndexBlockType`]) and what the typed query methods take. Built in: `String`, the
//! integers up to 64 bits, `f32`/`f64`, `bool`, `chrono::DateTime<Utc>`, `uuid::Uuid` (feature
//! `uuid`), and `Option<T>` (sparse: `None` is in no entry) and `Vec<T>` (an entry per element)
//! of those.
//!
//! Your own types: `#[derive(tito::IndexValue)]` on
//! - **a unit enum**, stored as its serde name (a string key; keys and ranges sort by the
//!   names' bytes, not by declaration order), or with `#[tito(index_as = "number")]` as its
//!   number (serialize it as one, with `serde_repr`; an integer key in numeric order; the enum
//!   needs a `#[repr(..)]` of an integer type, which says whether the key is signed);
//! - **a newtype** `struct OrderId(String)` (or a one-field struct under `#[serde(transparent)]`)
//!   over any index value, stored and ordered as what it wraps.
//!
//! A type that serializes as another kind than it declares (an enum whose serde attributes make
//! it an object, a renamed variant named `""`, two variants of one name) is refused when the
//! model is first used, naming the variant, not indexed wrongly.
//!
//! ```
//! use serde::{Deserialize, Serialize};
//! use tito::{IndexValue, TitoEngine, TitoModel};
//!
//! #[derive(IndexValue, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
//! #[serde(rename_all = "snake_case")]
//! enum Status { #[default] Pending, Paid, Shipped }
//!
//! #[derive(IndexValue, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
//! struct CustomerId(String);
//!
//! #[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
//! #[tito(index = "by_status: status")]
//! #[tito(index = "by_customer: customer, status")]
//! struct Order { id: String, customer: CustomerId, status: Status }
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), tito::TitoError> {
//! let db = tito::Embedded::temporary().await?;
//! let orders = db.clone().model::<Order>();
//! let customer = CustomerId("c1".into());
//! orders.build(Order { id: "1".into(), customer: customer.clone(), status: Status::Paid }).await?;
//! assert_eq!(orders.by_status(Status::Paid).execute().await?.items.len(), 1);
//! let paid = orders.by_customer(&customer).status_eq(Status::Paid).execute().await?;
//! assert_eq!(paid.items[0].id, "1");
//! # db.close().await
//! # }
//! ```

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::config::TitoIndexBlockType;

/// A Rust type an index field may have: the kind of key it is stored as and what the typed
/// query methods take. Derive it (`#[derive(tito::IndexValue)]`) for unit enums and newtypes;
/// see [`crate::model::value`].
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be an index field",
    label = "not an index value",
    note = "if `{Self}` is your unit enum or a newtype over an index value (`struct OrderId(String)`), add `#[derive(tito::IndexValue)]` to it; a struct of several fields is not one value: index a field of the model that holds what you query by",
    note = "built-in index values are `String`, integers up to 64 bits, floats, `bool`, `chrono::DateTime<Utc>`, `uuid::Uuid` (feature `uuid`), and `Option` or `Vec` of those"
)]
pub trait IndexValue {
    /// The kind of key the value is stored as.
    const KIND: TitoIndexBlockType;
    /// What a typed query binds the field to (by value or by reference).
    type Arg: ?Sized + Serialize;
    /// What a typed query's range is made of.
    type RangeArg<'a>: Serialize;

    /// Why this type's values would not be stored as a [`Self::KIND`] key, if they would not:
    /// a derived enum checks every variant's serde form. Called once per model, on its first
    /// use; the built-in types answer `None`.
    fn stored_form_problem() -> Option<String> {
        None
    }
}

/// An index value that is a single value (what a `Vec` field may hold): every [`IndexValue`]
/// but `Vec` itself. The derive implements it for the types it derives for.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a single index value",
    label = "a list of lists",
    note = "a `Vec` index field has an entry per element, and each element must be one value: index a `Vec` of a single value type (or of your own `#[derive(tito::IndexValue)]` type), not a `Vec` of `Vec`s"
)]
pub trait ScalarIndexValue: IndexValue {}

impl IndexValue for String {
    const KIND: TitoIndexBlockType = TitoIndexBlockType::String;
    type Arg = str;
    type RangeArg<'a> = &'a str;
}
impl ScalarIndexValue for String {}

macro_rules! scalar {
    ($kind:ident: $($t:ty),*) => {$(
        impl IndexValue for $t {
            const KIND: TitoIndexBlockType = TitoIndexBlockType::$kind;
            type Arg = $t;
            type RangeArg<'a> = $t;
        }
        impl ScalarIndexValue for $t {}
    )*};
}

scalar!(Integer: i8, i16, i32, i64, isize);
scalar!(Unsigned: u8, u16, u32, u64, usize);
scalar!(Number: f32, f64);
scalar!(Boolean: bool);
scalar!(Timestamp: DateTime<Utc>);

/// Stored as its hyphenated lowercase form (a string key; keys sort as the UUIDs' bytes do, so
/// version 7 UUIDs sort by time).
#[cfg(feature = "uuid")]
impl IndexValue for uuid::Uuid {
    const KIND: TitoIndexBlockType = TitoIndexBlockType::String;
    type Arg = uuid::Uuid;
    type RangeArg<'a> = uuid::Uuid;
}
#[cfg(feature = "uuid")]
impl ScalarIndexValue for uuid::Uuid {}

impl<T: IndexValue> IndexValue for Option<T> {
    const KIND: TitoIndexBlockType = T::KIND;
    type Arg = T::Arg;
    type RangeArg<'a> = T::RangeArg<'a>;
    fn stored_form_problem() -> Option<String> {
        T::stored_form_problem()
    }
}
impl<T: ScalarIndexValue> ScalarIndexValue for Option<T> {}

impl<T: ScalarIndexValue> IndexValue for Vec<T> {
    const KIND: TitoIndexBlockType = T::KIND;
    type Arg = T::Arg;
    type RangeArg<'a> = T::RangeArg<'a>;
    fn stored_form_problem() -> Option<String> {
        T::stored_form_problem()
    }
}

/// Why the serde forms of a derived unit enum's variants would not be stored as `kind` keys:
/// each must be a value of that kind (a non-empty string, or an integer that fits), and no two
/// alike. Used by `#[derive(IndexValue)]`; `variants` are each variant's name and serde form.
#[doc(hidden)]
pub fn enum_stored_form_problem(
    ty: &str,
    kind: TitoIndexBlockType,
    variants: Vec<(&str, Result<serde_json::Value, serde_json::Error>)>,
) -> Option<String> {
    let mut seen: Vec<(&str, serde_json::Value)> = Vec::new();
    for (variant, form) in variants {
        let form = match form {
            Ok(form) => form,
            Err(e) => return Some(format!("`{ty}::{variant}` does not serialize: {e}")),
        };
        let fits = match kind {
            TitoIndexBlockType::String => form.as_str().is_some_and(|s| !s.is_empty()),
            TitoIndexBlockType::Integer => form.as_i64().is_some(),
            TitoIndexBlockType::Unsigned => form.as_u64().is_some(),
            _ => false,
        };
        if !fits {
            let wanted = match kind {
                TitoIndexBlockType::String => {
                    "a non-empty string (its serde name): remove the serde attribute that makes \
                     it another form (`tag`, `content`, `untagged`, a `rename` to \"\")"
                }
                _ => {
                    "a number: serialize the enum as its discriminant (`serde_repr`'s \
                     `Serialize_repr`/`Deserialize_repr`), or index it by name (drop \
                     `index_as = \"number\"`)"
                }
            };
            return Some(format!(
                "`{ty}::{variant}` serializes as {form}, but `{ty}` is indexed as {wanted}"
            ));
        }
        if let Some((other, _)) = seen.iter().find(|(_, f)| *f == form) {
            return Some(format!(
                "`{ty}::{other}` and `{ty}::{variant}` both serialize as {form}: an index could \
                 not tell them apart; rename one"
            ));
        }
        seen.push((variant, form));
    }
    None
}
