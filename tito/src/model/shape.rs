//! Versioned rows: how a row's shape version is stored, and how a row of another version is read.
//!
//! A model's code reads and writes one shape of its rows, its [`TitoModelTrait::VERSION`] (1
//! unless the derive's `#[tito(version = N)]` says otherwise). Its previous shapes are serde
//! types that implement [`TitoShape`] (the derive `#[derive(TitoShape)]`), each with its own
//! version and a conversion to the next shape; a row of an older version is read through that
//! chain, on every read path. A row newer than the code, or one no declared shape reads, is
//! [`TitoError::RowShape`] naming the key and both versions, never misread.
//!
//! Stored form: a row of version 1 is its JSON alone, as rows were before versions existed; a
//! row of version N > 1 is `v{N}:` followed by its JSON (JSON text never begins with `v`). Index
//! entries that hold a copy of the row hold the same bytes.

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::TitoModelTrait;
use crate::error::{TitoError, TitoResult};
use crate::keys;

/// The highest shape version a model may declare (versions are `1..=MAX_VERSION`).
pub const MAX_VERSION: u32 = 1_000_000;

/// A previous shape of a model's rows: a serde type with its version, read from rows of its
/// version and (through its own previous shape, when it declares one) older ones.
///
/// Implemented by `#[derive(TitoShape)]` with `#[tito(version = N)]` and optionally
/// `from = "Older"` (and `upgrade = "function"` for a fallible conversion); by hand:
///
/// ```
/// use serde::{Deserialize, Serialize};
/// use tito::model::{ShapeError, TitoShape};
///
/// #[derive(Serialize, Deserialize)]
/// struct UserV1 {
///     id: String,
///     name: String,
/// }
///
/// impl TitoShape for UserV1 {
///     const VERSION: u32 = 1;
///     fn read_version(version: u32, json: &[u8]) -> Result<Self, ShapeError> {
///         tito::model::read_exact(Self::VERSION, version, json)
///     }
/// }
/// ```
pub trait TitoShape: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// The version rows of this shape are stored under.
    const VERSION: u32;

    /// Reads a stored row of `version` (at most [`Self::VERSION`]) as this shape: its own
    /// version deserializes, older ones go through the shape it declares it comes from.
    fn read_version(version: u32, json: &[u8]) -> Result<Self, ShapeError>;
}

/// Why a stored row could not be read as a shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShapeError {
    /// The row is newer than every shape the code declares.
    Newer {
        /// The newest version the code reads.
        newest: u32,
    },
    /// No declared shape has the row's version (it is older than the oldest declared shape, or
    /// between two declared ones).
    Unknown,
    /// The row did not deserialize as the shape of its version.
    Decode {
        /// The shape's type.
        shape: &'static str,
        /// serde's message.
        message: String,
    },
    /// A conversion from one shape to the next refused the row.
    Conversion {
        /// The version converted from.
        from: u32,
        /// The version converted to.
        to: u32,
        /// The conversion's message.
        message: String,
    },
}

impl std::fmt::Display for ShapeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ShapeError::Newer { newest } => write!(
                f,
                "it is newer than this code, which reads versions up to {newest} (written by \
                 newer code: after a rollback, deploy the code that wrote it again, or convert \
                 it there)"
            ),
            ShapeError::Unknown => write!(f, "no shape this code declares has that version"),
            ShapeError::Decode { shape, message } => {
                write!(f, "it does not deserialize into {shape}: {message}")
            }
            ShapeError::Conversion { from, to, message } => {
                write!(
                    f,
                    "the conversion from version {from} to {to} refused it: {message}"
                )
            }
        }
    }
}

impl ShapeError {
    /// A conversion's refusal (for the derive's `upgrade = "function"`).
    pub fn conversion(from: u32, to: u32, message: impl std::fmt::Display) -> Self {
        ShapeError::Conversion {
            from,
            to,
            message: message.to_string(),
        }
    }
}

/// Deserializes `json` as `S` when `version` is `own` (a shape with no older shape to read).
pub fn read_exact<S: DeserializeOwned>(
    own: u32,
    version: u32,
    json: &[u8],
) -> Result<S, ShapeError> {
    match version.cmp(&own) {
        std::cmp::Ordering::Equal => decode::<S>(json),
        std::cmp::Ordering::Greater => Err(ShapeError::Newer { newest: own }),
        std::cmp::Ordering::Less => Err(ShapeError::Unknown),
    }
}

/// Deserializes `json` as `S`, a decode error naming `S`.
pub fn decode<S: DeserializeOwned>(json: &[u8]) -> Result<S, ShapeError> {
    serde_json::from_slice(json).map_err(|err| ShapeError::Decode {
        shape: std::any::type_name::<S>(),
        message: err.to_string(),
    })
}

/// `shape` as JSON (for a model's downgrade); an error says what failed to serialize.
pub fn to_json<S: Serialize>(shape: &S) -> Result<Vec<u8>, ShapeError> {
    serde_json::to_vec(shape).map_err(|err| ShapeError::Decode {
        shape: std::any::type_name::<S>(),
        message: format!("it does not serialize: {err}"),
    })
}

/// Splits a stored row into its version and its JSON. `None`: a `v` header that is not
/// `v{N}:` with `N` in `2..=MAX_VERSION`.
pub(crate) fn split(bytes: &[u8]) -> Option<(u32, &[u8])> {
    let Some(rest) = bytes.strip_prefix(b"v") else {
        return Some((1, bytes));
    };
    let colon = rest.iter().take(8).position(|b| *b == b':')?;
    let digits = &rest[..colon];
    if digits.is_empty() || digits[0] == b'0' || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let version: u32 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    (2..=MAX_VERSION)
        .contains(&version)
        .then_some((version, &rest[colon + 1..]))
}

/// The stored form of a row of `version` whose JSON is `json`.
pub(crate) fn encode(version: u32, json: Vec<u8>) -> Vec<u8> {
    if version <= 1 {
        return json;
    }
    let mut out = format!("v{version}:").into_bytes();
    out.extend_from_slice(&json);
    out
}

/// A stored row as `T`: its own version deserializes (or is [`TitoError::Integrity`]), an older
/// one is upgraded through `T`'s declared shapes, anything else is [`TitoError::RowShape`]
/// naming `key`.
pub(crate) fn decode_row<T: TitoModelTrait>(key: &str, bytes: &[u8]) -> TitoResult<T> {
    let (version, json) = split_or_refuse::<T>(key, bytes)?;
    // A row of the code's own version that does not deserialize is not a shape question: it
    // is not what this code writes (corrupt, or changed without a version).
    let read = if version == T::VERSION {
        return serde_json::from_slice(json).map_err(|err| {
            TitoError::Integrity(format!(
                "value of {key:?} does not deserialize into {}: {err}",
                std::any::type_name::<T>()
            ))
        });
    } else if version > T::VERSION {
        Err(ShapeError::Newer { newest: T::VERSION })
    } else {
        guarded(version, T::VERSION, || T::upgrade(version, json)).and_then(|model| {
            keeps_id(key, &model)
                .map(|()| model)
                .map_err(|message| ShapeError::conversion(version, T::VERSION, message))
        })
    };
    read.map_err(|reason| match reason {
        // A row that does not deserialize as the shape of its own version is not a shape
        // question either: it is not what the code of that version writes.
        ShapeError::Decode { shape, message } => TitoError::Integrity(format!(
            "value of {key:?} does not deserialize into {shape}, the shape of its version \
             {version}: {message}"
        )),
        reason => row_shape::<T>(key, version, reason),
    })
}

/// Whether a row converted from another shape kept the id its storage key names: a conversion
/// that returned another id would read a row as another one (and a rewrite would overwrite that
/// one). `key` is the row's key or an index entry ending in it; for anything else (an event's
/// row, which has no key) nothing is compared.
pub(crate) fn keeps_id<T: TitoModelTrait>(key: &str, model: &T) -> Result<(), String> {
    let table = model.table();
    if !key.contains(&keys::table_prefix(&table)) {
        return Ok(());
    }
    let id = model.id();
    if key.ends_with(&keys::row_key(&table, &id)) {
        return Ok(());
    }
    Err(format!(
        "it returned the id {id:?} for a row stored under another id (a conversion must keep \
         the row's id)"
    ))
}

/// A stored row as JSON of `T`'s current shape (upgraded through `T` when it is older).
pub(crate) fn row_value<T: TitoModelTrait>(key: &str, bytes: &[u8]) -> TitoResult<Value> {
    let (version, json) = split_or_refuse::<T>(key, bytes)?;
    if version == T::VERSION {
        return serde_json::from_slice(json)
            .map_err(|err| TitoError::Integrity(format!("row {key:?} is not valid JSON: {err}")));
    }
    let row = decode_row::<T>(key, bytes)?;
    Ok(serde_json::to_value(&row)?)
}

/// Runs a conversion of the model's code (an upgrade chain or a downgrade from `from` to
/// `to`), turning a panic in it into [`ShapeError::Conversion`]: a row whose conversion panics
/// is refused like one it refuses (and stays deletable), it never takes a reader, a delete, a
/// rewrite or a worker's maintenance down.
pub(crate) fn guarded<R>(
    from: u32,
    to: u32,
    convert: impl FnOnce() -> Result<R, ShapeError>,
) -> Result<R, ShapeError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(convert)) {
        Ok(result) => result,
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_string());
            Err(ShapeError::conversion(
                from,
                to,
                format!("the conversion panicked: {message}"),
            ))
        }
    }
}

/// A stored row's version and JSON as stored, not converted (operators' tools, the schema's
/// builds and audits, deletes).
pub(crate) fn stored_value(key: &str, bytes: &[u8]) -> TitoResult<(u32, Value)> {
    let (version, json) = split(bytes).ok_or_else(|| {
        TitoError::Integrity(format!("row {key:?} has a malformed version header"))
    })?;
    let row = serde_json::from_slice(json)
        .map_err(|err| TitoError::Integrity(format!("row {key:?} is not valid JSON: {err}")))?;
    Ok((version, row))
}

fn split_or_refuse<'a, T: TitoModelTrait>(
    key: &str,
    bytes: &'a [u8],
) -> TitoResult<(u32, &'a [u8])> {
    split(bytes).ok_or_else(|| {
        TitoError::Integrity(format!(
            "row {key:?} of {} has a malformed version header",
            std::any::type_name::<T>()
        ))
    })
}

fn row_shape<T: TitoModelTrait>(key: &str, version: u32, reason: ShapeError) -> TitoError {
    TitoError::RowShape {
        key: key.to_string(),
        version,
        model: std::any::type_name::<T>(),
        code_version: T::VERSION,
        reason: reason.to_string(),
    }
}

/// Records model `T` on `db` as a reader of the rows in its table's model events and as its
/// table's rewriter (nothing for an unversioned one): see [`crate::event::readers`].
pub(crate) fn register<E: crate::engine::TitoEngine, T: TitoModelTrait>(db: &E) {
    super::rewriters::register::<E, T>(db);
    if T::VERSION > 1 {
        crate::event::readers::register(
            db,
            &T::default().table(),
            T::VERSION,
            (
                std::any::TypeId::of::<T>(),
                std::any::TypeId::of::<crate::event::ModelEvent<T>>(),
            ),
            event_row::<T>,
        );
    }
}

/// A model event's row stored in shape `version`, as JSON of `T`'s current shape.
fn event_row<T: TitoModelTrait>(version: u32, row: &Value) -> Option<Value> {
    let bytes = encode(version, serde_json::to_vec(row).ok()?);
    row_value::<T>("a model event's row", &bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_odd_ones_are_refused() {
        assert_eq!(split(b"{\"a\":1}"), Some((1, &b"{\"a\":1}"[..])));
        assert_eq!(encode(1, b"{}".to_vec()), b"{}");
        assert_eq!(encode(3, b"{}".to_vec()), b"v3:{}");
        assert_eq!(split(b"v3:{}"), Some((3, &b"{}"[..])));
        let top = encode(MAX_VERSION, b"[]".to_vec());
        assert_eq!(split(&top), Some((MAX_VERSION, &b"[]"[..])));
        for bad in [
            &b"v"[..],
            b"v:",
            b"v1:{}",
            b"v0:{}",
            b"v03:{}",
            b"v-3:{}",
            b"vx:{}",
            b"v1000001:{}",
            b"v99999999999:{}",
            b"v3{}",
        ] {
            assert_eq!(split(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
        // An empty row is version 1 (and not JSON, which the reader says).
        assert_eq!(split(b""), Some((1, &b""[..])));
    }
}
