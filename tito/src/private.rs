//! Helpers for the code `#[derive(TitoModel)]` generates. Not a stable API: everything here may
//! change between releases. Each item exists so that a type rule of the derive is checked by
//! rustc on the user's own tokens.

use chrono::{DateTime, Utc};

pub use serde_json;

/// A Rust type a model id may have.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be a model id",
    label = "unsupported id type",
    note = "ids are `String` or an integer type"
)]
pub trait IdField {
    /// The id as the row key's last segment holds it.
    fn to_id(&self) -> String;
}

impl IdField for String {
    fn to_id(&self) -> String {
        self.clone()
    }
}

macro_rules! integer_id {
    ($($t:ty),*) => {$(
        impl IdField for $t {
            fn to_id(&self) -> String {
                self.to_string()
            }
        }
    )*};
}

integer_id!(i8, i16, i32, i64, isize, u8, u16, u32, u64, usize);

/// A field type an event's `at` may name: when the event becomes runnable.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot tell when an event runs",
    label = "`at` needs an `i64` of Unix seconds, a `chrono::DateTime<Utc>`, or an `Option` of those",
    note = "or name a method `fn(&self) -> i64`"
)]
pub trait EventTime {
    /// Unix seconds.
    fn event_timestamp(&self) -> i64;
}

impl EventTime for i64 {
    fn event_timestamp(&self) -> i64 {
        *self
    }
}

impl EventTime for DateTime<Utc> {
    fn event_timestamp(&self) -> i64 {
        self.timestamp()
    }
}

impl<T: EventTime> EventTime for Option<T> {
    /// `None` means now.
    fn event_timestamp(&self) -> i64 {
        self.as_ref().map_or_else(now, EventTime::event_timestamp)
    }
}

/// Now, in Unix seconds.
pub fn now() -> i64 {
    Utc::now().timestamp()
}

/// Calls an index condition; its type makes a method of the wrong signature a compile error.
pub fn condition<T>(model: &T, rule: fn(&T) -> bool) -> bool {
    rule(model)
}

/// Calls an event's `at` method; its type makes a method of the wrong signature a compile error.
pub fn event_at<T>(model: &T, at: fn(&T) -> i64) -> i64 {
    at(model)
}

/// A field type an inbox's `processed_at` role may have: whether it is set.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be an inbox `processed_at`",
    label = "`processed_at` needs an `Option<i64>` of Unix milliseconds"
)]
pub trait InboxTime {
    /// Whether the row is processed.
    fn is_set(&self) -> bool;
}

impl InboxTime for Option<i64> {
    fn is_set(&self) -> bool {
        self.is_some()
    }
}
