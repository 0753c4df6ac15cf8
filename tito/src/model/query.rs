//! Index queries and table scans: bounded pages with opaque, range-checked cursors.
//!
//! A forward page continues from the exact last key plus a NUL byte; a reverse page uses the
//! exact last key as the exclusive upper bound. A cursor from another range is refused.

use std::marker::PhantomData;
use std::ops::Bound;

use serde::Serialize;
use serde_json::Value;

use super::config::{TitoIndexBlockType, TitoModelTrait};
use super::{decode_model, index, index_configs, read_only};
use crate::engine::{TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::keys::{self, KeyValue};

/// The page size when a query sets no limit.
pub const DEFAULT_PAGE_LIMIT: usize = 100;

/// The largest page a query may ask for.
pub const MAX_PAGE_LIMIT: usize = 1000;

/// One page of results.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TitoPage<T> {
    /// The rows, in key order (reversed for reverse queries).
    pub items: Vec<T>,
    /// Pass to the same query's `cursor` to get the next page; `None` on the last page.
    pub cursor: Option<String>,
}

const CURSOR_TAG: &str = "c1.";

pub(crate) fn encode_cursor(key: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(CURSOR_TAG.len() + key.len() * 2);
    out.push_str(CURSOR_TAG);
    for byte in key {
        out.push(HEX[usize::from(byte >> 4)] as char);
        out.push(HEX[usize::from(byte & 0xf)] as char);
    }
    out
}

pub(crate) fn decode_cursor(cursor: &str) -> TitoResult<Vec<u8>> {
    let bad = || TitoError::invalid_argument(format!("malformed cursor {cursor:?}"));
    let hex = cursor.strip_prefix(CURSOR_TAG).ok_or_else(bad)?;
    if hex.len() % 2 != 0 {
        return Err(bad());
    }
    // Pairs of bytes, never string slices: a forged cursor may hold multi-byte characters.
    hex.as_bytes()
        .chunks(2)
        .map(|pair| {
            let digit = |b: u8| (b as char).to_digit(16).ok_or_else(bad);
            Ok((digit(pair[0])? * 16 + digit(pair[1])?) as u8)
        })
        .collect()
}

/// Narrows `[start, end)` to what follows the page that returned `cursor` (before it, for a
/// reverse page). A cursor outside the range is refused.
pub(crate) fn narrow_to_cursor(
    start: &mut Vec<u8>,
    end: &mut Vec<u8>,
    reverse: bool,
    cursor: Option<&str>,
) -> TitoResult<()> {
    let Some(cursor) = cursor else {
        return Ok(());
    };
    let key = decode_cursor(cursor)?;
    if key < *start || key >= *end {
        return Err(TitoError::invalid_argument(
            "the cursor is outside the requested range",
        ));
    }
    if reverse {
        *end = key;
    } else {
        *start = keys::key_after_bytes(&key);
    }
    Ok(())
}

fn check_limit(limit: Option<usize>) -> TitoResult<usize> {
    match limit {
        None => Ok(DEFAULT_PAGE_LIMIT),
        Some(0) => Err(TitoError::invalid_argument(
            "a page limit of zero is invalid",
        )),
        Some(n) if n > MAX_PAGE_LIMIT => Err(TitoError::invalid_argument(format!(
            "a page limit of {n} is over the maximum of {MAX_PAGE_LIMIT}"
        ))),
        Some(n) => Ok(n),
    }
}

/// Reads one page of `[start, end)` (empty `end`: unbounded is never used here); `decode`
/// validates each key and decodes its value. Corrupt rows fail the page instead of shortening
/// it.
async fn read_page<X, I>(
    tx: &X,
    mut start: Vec<u8>,
    mut end: Vec<u8>,
    reverse: bool,
    limit: usize,
    cursor: Option<&str>,
    decode: impl Fn(&str, &[u8]) -> TitoResult<I>,
) -> TitoResult<TitoPage<I>>
where
    X: TitoTransaction,
{
    narrow_to_cursor(&mut start, &mut end, reverse, cursor)?;
    if start >= end {
        return Ok(TitoPage {
            items: Vec::new(),
            cursor: None,
        });
    }
    // One row more than the page tells whether another page exists.
    let rows = if reverse {
        tx.scan_reverse(&start, &end, limit + 1).await?
    } else {
        tx.scan(&start, &end, limit + 1).await?
    };
    let more = rows.len() > limit;
    let mut items = Vec::with_capacity(limit.min(rows.len()));
    let mut last = None;
    for (key, value) in rows.into_iter().take(limit) {
        items.push(decode(keys::key_str(&key)?, &value)?);
        last = Some(key);
    }
    Ok(TitoPage {
        items,
        cursor: if more {
            last.map(|k| encode_cursor(&k))
        } else {
            None
        },
    })
}

/// One end of a range, its value already turned into JSON (or the error doing so).
type QueryBound = Bound<TitoResult<Value>>;

/// A query over one secondary index: bind a prefix of its fields with [`Self::value`], then
/// optionally a range over the next field, and execute.
///
/// Mistakes (an unknown index, more values than fields, a value of the wrong type) are reported
/// by `execute` as [`TitoError::InvalidArgument`].
pub struct IndexQuery<E, T> {
    model: super::TitoModel<E, T>,
    index: String,
    values: Vec<TitoResult<Value>>,
    range: Option<(QueryBound, QueryBound)>,
    limit: Option<usize>,
    cursor: Option<String>,
    reverse: bool,
    _model: PhantomData<fn() -> T>,
}

fn to_json<V: Serialize + ?Sized>(value: &V) -> TitoResult<Value> {
    serde_json::to_value(value).map_err(TitoError::from)
}

fn map_bound<V: Serialize>(bound: Bound<&V>) -> Bound<TitoResult<Value>> {
    match bound {
        Bound::Included(v) => Bound::Included(to_json(v)),
        Bound::Excluded(v) => Bound::Excluded(to_json(v)),
        Bound::Unbounded => Bound::Unbounded,
    }
}

fn typed(value: &Value, field: &str, kind: TitoIndexBlockType) -> TitoResult<KeyValue> {
    index::coerce(value, kind).ok_or_else(|| {
        TitoError::invalid_argument(format!(
            "value {value} does not fit field {field:?} of type {kind:?}"
        ))
    })
}

impl<E: TitoEngine, T: TitoModelTrait> IndexQuery<E, T> {
    pub(crate) fn new(model: super::TitoModel<E, T>, index: &str) -> Self {
        IndexQuery {
            model,
            index: index.to_string(),
            values: Vec::new(),
            range: None,
            limit: None,
            cursor: None,
            reverse: false,
            _model: PhantomData,
        }
    }

    /// Binds the next field of the index to `value`.
    pub fn value<V: Serialize + ?Sized>(&mut self, value: &V) -> &mut Self {
        self.values.push(to_json(value));
        self
    }

    /// Restricts the first field not bound by [`Self::value`] to a range:
    /// `.range(10..20)`, `.range("a".."n")`, `.range(..=5)`.
    pub fn range<V: Serialize, R: std::ops::RangeBounds<V>>(&mut self, range: R) -> &mut Self {
        self.range = Some((map_bound(range.start_bound()), map_bound(range.end_bound())));
        self
    }

    /// At most this many rows per page (default [`DEFAULT_PAGE_LIMIT`], at most
    /// [`MAX_PAGE_LIMIT`]; zero is invalid): `limit(10)`, or `limit(Some(10))` as the seed
    /// writes it (`None::<usize>` for the default).
    pub fn limit(&mut self, limit: impl Into<Option<usize>>) -> &mut Self {
        self.limit = limit.into();
        self
    }

    /// Continues after the page that returned this cursor.
    pub fn cursor(&mut self, cursor: Option<String>) -> &mut Self {
        self.cursor = cursor;
        self
    }

    /// Returns rows in descending key order.
    pub fn reverse(&mut self, reverse: bool) -> &mut Self {
        self.reverse = reverse;
        self
    }

    /// Runs the query in a transaction of its own.
    pub async fn execute(&self) -> TitoResult<TitoPage<T>> {
        read_only(self.model.engine(), async |tx| self.execute_tx(tx).await).await
    }

    /// Runs the query inside `tx`.
    pub async fn execute_tx(&self, tx: &E::Transaction) -> TitoResult<TitoPage<T>> {
        let limit = check_limit(self.limit)?;
        let model = T::default();
        let table = model.table();
        let configs = index_configs(&model)?;
        let Some((config, _)) = configs.iter().find(|(c, _)| c.name == self.index) else {
            return Err(TitoError::invalid_argument(format!(
                "table {table:?} has no index {:?}",
                self.index
            )));
        };
        let key_only = self
            .model
            .schema_handle()
            .await?
            .check_queryable(tx, &config.name)
            .await?;
        let bound_fields = self.values.len() + usize::from(self.range.is_some());
        if bound_fields > config.fields.len() {
            return Err(TitoError::invalid_argument(format!(
                "index {:?} has {} field(s); the query binds {}",
                config.name,
                config.fields.len(),
                bound_fields
            )));
        }
        let mut bound = Vec::with_capacity(self.values.len());
        for (value, field) in self.values.iter().zip(&config.fields) {
            let value = value.as_ref().map_err(clone_error)?;
            bound.push(typed(value, &field.name, field.r#type)?);
        }
        let pairs: Vec<(&str, &KeyValue)> = config
            .fields
            .iter()
            .map(|f| f.name.as_str())
            .zip(bound.iter())
            .collect();
        let prefix = keys::index_prefix(&table, &config.name, &pairs)?;
        let (start, end) = match &self.range {
            None => (prefix.clone(), keys::prefix_end(prefix.clone())),
            Some((lower, upper)) => {
                let field = &config.fields[self.values.len()];
                let mut head = prefix.clone();
                keys::encode_str(&field.name, &mut head);
                head.push(keys::SEPARATOR);
                let encode = |value: &TitoResult<Value>| -> TitoResult<String> {
                    let value = value.as_ref().map_err(clone_error)?;
                    let mut out = head.clone();
                    typed(value, &field.name, field.r#type)?.encode(&mut out)?;
                    Ok(out)
                };
                // `{value}:` starts the entries of one value; `{value};` is just past them.
                let start = match lower {
                    Bound::Included(v) => format!("{}:", encode(v)?),
                    Bound::Excluded(v) => format!("{};", encode(v)?),
                    Bound::Unbounded => head.clone(),
                };
                let end = match upper {
                    Bound::Included(v) => format!("{};", encode(v)?),
                    Bound::Excluded(v) => format!("{}:", encode(v)?),
                    Bound::Unbounded => keys::prefix_end(head.clone()),
                };
                (start, end)
            }
        };
        let row_prefix = keys::table_prefix(&table);
        let (start, end) = (start.into_bytes(), end.into_bytes());
        let cursor = self.cursor.as_deref();
        if !key_only {
            let decode = |key: &str, value: &[u8]| {
                keys::check_index_key_in(key, &row_prefix)?;
                decode_model::<T>(key, value)
            };
            return read_page(tx, start, end, self.reverse, limit, cursor, decode).await;
        }
        // Entries of keys: the page's entries (their values are not read), then their rows in
        // one batched read.
        let row_key = |key: &str, _: &[u8]| {
            let id = keys::check_index_key_in(key, &row_prefix)?;
            Ok((key.to_string(), format!("{row_prefix}{id}")))
        };
        let entries = read_page(tx, start, end, self.reverse, limit, cursor, row_key).await?;
        let wanted: Vec<Vec<u8>> = entries
            .items
            .iter()
            .map(|(_, row)| row.clone().into_bytes())
            .collect();
        let rows = tx.batch_get(&wanted).await?;
        let mut items = Vec::with_capacity(rows.len());
        for ((entry, row_key), row) in entries.items.iter().zip(rows) {
            let Some(row) = row else {
                return Err(TitoError::Integrity(format!(
                    "index entry {entry:?} names row {row_key:?}, which does not exist"
                )));
            };
            items.push(decode_model::<T>(row_key, &row)?);
        }
        Ok(TitoPage {
            items,
            cursor: entries.cursor,
        })
    }
}

fn clone_error(err: &TitoError) -> TitoError {
    TitoError::invalid_argument(format!("a query value cannot be serialized: {err}"))
}

/// A scan of a model's table in id order, optionally from a start id (inclusive) to an end id
/// (exclusive), both compared as encoded key suffixes.
pub struct TableQuery<E, T> {
    db: E,
    start: Option<String>,
    end: Option<String>,
    limit: Option<usize>,
    cursor: Option<String>,
    reverse: bool,
    _model: PhantomData<fn() -> T>,
}

impl<E: TitoEngine, T: TitoModelTrait> TableQuery<E, T> {
    pub(crate) fn new(db: E) -> Self {
        TableQuery {
            db,
            start: None,
            end: None,
            limit: None,
            cursor: None,
            reverse: false,
            _model: PhantomData,
        }
    }

    /// Starts at this id (inclusive).
    pub fn start(&mut self, id: impl Into<String>) -> &mut Self {
        self.start = Some(id.into());
        self
    }

    /// Ends before this id (exclusive).
    pub fn end(&mut self, id: impl Into<String>) -> &mut Self {
        self.end = Some(id.into());
        self
    }

    /// At most this many rows per page (zero is invalid): `limit(10)` or `limit(Some(10))`.
    pub fn limit(&mut self, limit: impl Into<Option<usize>>) -> &mut Self {
        self.limit = limit.into();
        self
    }

    /// Continues after the page that returned this cursor.
    pub fn cursor(&mut self, cursor: Option<String>) -> &mut Self {
        self.cursor = cursor;
        self
    }

    /// Returns rows in descending id order.
    pub fn reverse(&mut self, reverse: bool) -> &mut Self {
        self.reverse = reverse;
        self
    }

    /// Runs the scan in a transaction of its own.
    pub async fn execute(&self) -> TitoResult<TitoPage<T>> {
        read_only(&self.db, async |tx| self.execute_tx(tx).await).await
    }

    /// Runs the scan inside `tx`.
    pub async fn execute_tx(&self, tx: &E::Transaction) -> TitoResult<TitoPage<T>> {
        let limit = check_limit(self.limit)?;
        let table = T::default().table();
        let prefix = keys::table_prefix(&table);
        let suffix = |id: &str| {
            let mut out = prefix.clone();
            keys::encode_str(id, &mut out);
            out
        };
        let start = self
            .start
            .as_deref()
            .map(suffix)
            .unwrap_or_else(|| prefix.clone());
        let end = match self.end.as_deref() {
            Some(id) => suffix(id),
            None => keys::prefix_end(prefix.clone()),
        };
        if let (Some(first), Some(last)) = (&self.start, &self.end)
            && start >= end
        {
            return Err(TitoError::invalid_argument(format!(
                "a table scan's start id {first:?} must sort before its end id {last:?}"
            )));
        }
        read_page(
            tx,
            start.into_bytes(),
            end.into_bytes(),
            self.reverse,
            limit,
            self.cursor.as_deref(),
            |key, value| {
                // A row key has exactly one segment after the table prefix.
                if key[prefix.len()..].contains(keys::SEPARATOR) {
                    return Err(TitoError::Integrity(format!(
                        "key {key:?} in table {table:?} is not a row key"
                    )));
                }
                decode_model::<T>(key, value)
            },
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_reject_garbage() {
        let key = b"index:x:\x00\xff".to_vec();
        assert_eq!(decode_cursor(&encode_cursor(&key)).unwrap(), key);
        assert!(decode_cursor("nope").is_err());
        assert!(decode_cursor("c1.abc").is_err());
        assert!(decode_cursor("c1.zz").is_err());
        // Item 10 of the defects issue: multi-byte characters are an error, not a panic.
        assert!(decode_cursor("c1.a€").is_err());
        assert!(decode_cursor("c1.€€").is_err());
        assert!(decode_cursor("c1.+1").is_err());
    }

    proptest::proptest! {
        #[test]
        fn any_cursor_string_decodes_or_errs(text in ".*") {
            let _ = decode_cursor(&text);
            let _ = decode_cursor(&format!("{CURSOR_TAG}{text}"));
        }

        #[test]
        fn cursors_round_trip(key in proptest::collection::vec(proptest::num::u8::ANY, 0..64)) {
            proptest::prop_assert_eq!(decode_cursor(&encode_cursor(&key)).unwrap(), key);
        }
    }
}
