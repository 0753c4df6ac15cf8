//! From a row's JSON to its index entries: sparse, typed, one entry per array element.

use chrono::{DateTime, Utc};
use serde_json::Value;

use super::config::{TitoIndexBlockType, TitoIndexConfig};
use crate::error::{TitoError, TitoResult};
use crate::keys::{self, KeyValue};

/// At most this many entries per index per row (arrays multiply in composite indexes).
pub const MAX_INDEX_ENTRIES_PER_ROW: usize = 1024;

/// One index entry of a row: the `index:` key and, for a unique index, its claim key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub index: String,
    pub key: String,
    pub claim: Option<String>,
    /// The entry holds only its key (the index's entries are keys, not copies of the row).
    pub key_only: bool,
}

impl Entry {
    /// The value stored under the entry's key for a row serialized as `row`.
    pub fn value(&self, row: &[u8]) -> Vec<u8> {
        if self.key_only {
            Vec::new()
        } else {
            row.to_vec()
        }
    }
}

/// Calls `found` with each value at a dotted path, in document order. An array met on the way
/// is walked element by element, so `comments.author_id` over
/// `comments: [{author_id: 1}, {author_id: 2}]` yields 1 and 2.
fn lookup<'a>(value: &'a Value, path: &str, found: &mut impl FnMut(&'a Value)) {
    let (part, rest) = match path.split_once('.') {
        Some((part, rest)) => (part, Some(rest)),
        None => (path, None),
    };
    let mut step = |item: &'a Value| {
        if let Some(next) = item.get(part) {
            match rest {
                Some(rest) => lookup(next, rest, found),
                None => found(next),
            }
        }
    };
    match value {
        Value::Array(items) => items.iter().for_each(&mut step),
        other => step(other),
    }
}

/// A JSON value as a key value of the type, or `None` when it holds no value of that type
/// (null, an empty string, another type).
pub(crate) fn coerce(value: &Value, kind: TitoIndexBlockType) -> Option<KeyValue> {
    match kind {
        TitoIndexBlockType::String => value
            .as_str()
            .filter(|s| !s.is_empty())
            .map(|s| KeyValue::String(s.to_string())),
        TitoIndexBlockType::Number => value.as_f64().map(KeyValue::F64),
        TitoIndexBlockType::Integer => value.as_i64().map(KeyValue::I64),
        TitoIndexBlockType::Unsigned => value.as_u64().map(KeyValue::U64),
        TitoIndexBlockType::Boolean => value.as_bool().map(KeyValue::Bool),
        // RFC 3339, and chrono's own form of years outside 0000-9999 (`+10000-01-01T..Z`,
        // `-0001-..`), which its serde writes for such a `DateTime<Utc>`.
        TitoIndexBlockType::Timestamp => value
            .as_str()
            .and_then(|s| {
                DateTime::parse_from_rfc3339(s)
                    .map(|t| t.with_timezone(&Utc))
                    .ok()
                    .or_else(|| s.parse::<DateTime<Utc>>().ok())
            })
            .map(KeyValue::Timestamp),
    }
}

/// The distinct values a field contributes: one per value of the type found at its path
/// (arrays, at the end of the path or on the way, contribute each element), or none.
fn field_values(row: &Value, name: &str, kind: TitoIndexBlockType) -> Vec<KeyValue> {
    let mut out: Vec<KeyValue> = Vec::new();
    lookup(row, name, &mut |value| {
        let mut one = |item: &Value| {
            if let Some(value) = coerce(item, kind)
                && !out.contains(&value)
            {
                out.push(value);
            }
        };
        match value {
            Value::Array(items) => items.iter().for_each(&mut one),
            value => one(value),
        }
    });
    out
}

/// The entries of one index for a row (none when the row is not in the index).
pub(crate) fn entries(
    config: &TitoIndexConfig,
    unique: bool,
    row: &Value,
    table: &str,
    id: &str,
) -> TitoResult<Vec<Entry>> {
    if !config.condition || config.fields.is_empty() {
        return Ok(Vec::new());
    }
    let mut per_field: Vec<Vec<KeyValue>> = Vec::with_capacity(config.fields.len());
    let mut combinations = 1;
    for field in &config.fields {
        let values = field_values(row, &field.name, field.r#type);
        if values.is_empty() {
            return Ok(Vec::new());
        }
        combinations *= values.len();
        if combinations > MAX_INDEX_ENTRIES_PER_ROW {
            return Err(TitoError::invalid_argument(format!(
                "row {id:?} of table {table:?} would have more than {MAX_INDEX_ENTRIES_PER_ROW} \
                 entries in index {:?}",
                config.name
            )));
        }
        per_field.push(values);
    }
    // Every combination of one value per field, the last field varying fastest.
    let mut out = Vec::with_capacity(combinations);
    let mut chosen = vec![0usize; per_field.len()];
    let mut fields: Vec<(&str, &KeyValue)> = Vec::with_capacity(per_field.len());
    for _ in 0..combinations {
        fields.clear();
        fields.extend(
            config
                .fields
                .iter()
                .zip(&per_field)
                .zip(&chosen)
                .map(|((field, values), &at)| (field.name.as_str(), &values[at])),
        );
        for (at, values) in chosen.iter_mut().zip(&per_field).rev() {
            *at += 1;
            if *at < values.len() {
                break;
            }
            *at = 0;
        }
        let key = keys::index_key(&config.name, &fields, table, id)?;
        let claim = if unique {
            Some(keys::unique_claim_key(table, &config.name, &fields)?)
        } else {
            None
        };
        let entry = Entry {
            index: config.name.clone(),
            key,
            claim,
            key_only: false,
        };
        if !out.contains(&entry) {
            out.push(entry);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::TitoIndexField;
    use serde_json::json;

    fn index(fields: &[(&str, TitoIndexBlockType)]) -> TitoIndexConfig {
        TitoIndexConfig {
            condition: true,
            name: "ix".into(),
            fields: fields
                .iter()
                .map(|(name, kind)| TitoIndexField {
                    name: name.to_string(),
                    r#type: *kind,
                })
                .collect(),
        }
    }

    #[test]
    fn timestamps_of_every_year_chrono_writes_are_indexed() {
        use chrono::TimeZone;
        for year in [-1, 0, 1970, 9999, 10_000, 262_000] {
            let t = Utc.with_ymd_and_hms(year, 1, 1, 0, 0, 0).unwrap();
            let stored = serde_json::to_value(t).unwrap();
            assert_eq!(
                coerce(&stored, TitoIndexBlockType::Timestamp),
                Some(KeyValue::Timestamp(t)),
                "{stored}"
            );
        }
    }

    #[test]
    fn sparse_rules() {
        let by_name = index(&[("name", TitoIndexBlockType::String)]);
        for row in [
            json!({}),
            json!({"name": null}),
            json!({"name": ""}),
            json!({"name": []}),
            json!({"name": 3}),
            json!({"name": {}}),
        ] {
            assert!(
                entries(&by_name, false, &row, "t", "1").unwrap().is_empty(),
                "{row}"
            );
        }
        assert_eq!(
            entries(&by_name, false, &json!({"name": "a"}), "t", "1")
                .unwrap()
                .len(),
            1
        );
        let tags = entries(
            &by_name,
            false,
            &json!({"name": ["a", "b", "a", 7, ""]}),
            "t",
            "1",
        )
        .unwrap();
        assert_eq!(tags.len(), 2);
        let mut off = by_name.clone();
        off.condition = false;
        assert!(
            entries(&off, false, &json!({"name": "a"}), "t", "1")
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn composite_and_nested_fields() {
        let ix = index(&[
            ("team", TitoIndexBlockType::String),
            ("address.zip", TitoIndexBlockType::Integer),
        ]);
        let row = json!({"team": ["x", "y"], "address": {"zip": 75001}});
        let got = entries(&ix, true, &row, "t", "1").unwrap();
        assert_eq!(got.len(), 2);
        assert!(got[0].claim.is_some());
        assert!(
            entries(
                &ix,
                false,
                &json!({"team": "x", "address": {"zip": 1.5}}),
                "t",
                "1"
            )
            .unwrap()
            .is_empty()
        );
    }

    /// Combinations come out in key order of the fields as declared, the last field varying
    /// fastest, each once (manifests list them in this order).
    #[test]
    fn combinations_in_order() {
        let ix = index(&[
            ("team", TitoIndexBlockType::String),
            ("n", TitoIndexBlockType::Integer),
        ]);
        let row = json!({"team": ["x", "y", "x"], "n": [1, 2, 2]});
        let got: Vec<String> = entries(&ix, false, &row, "t", "1")
            .unwrap()
            .into_iter()
            .map(|e| e.key)
            .collect();
        let want: Vec<String> = [("x", 1), ("x", 2), ("y", 1), ("y", 2)]
            .iter()
            .map(|(team, n)| {
                let (team, n) = (KeyValue::String(team.to_string()), KeyValue::I64(*n));
                keys::index_key("ix", &[("team", &team), ("n", &n)], "t", "1").unwrap()
            })
            .collect();
        assert_eq!(got, want);
        let one = entries(&ix, false, &json!({"team": "x", "n": 5}), "t", "1").unwrap();
        assert_eq!(one.len(), 1);
        assert!(one[0].key.ends_with(&keys::row_key("t", "1")));
    }

    /// Defect 9: a dotted path through an array of objects indexes every element's value.
    #[test]
    fn defect_9_paths_through_arrays_of_objects() {
        let ix = index(&[("comments.author_id", TitoIndexBlockType::Integer)]);
        let row = json!({"comments": [
            {"author_id": 1}, {"author_id": 2}, {"author_id": 1}, {"text": "no author"},
            {"author_id": [3, 4]}, "not an object"
        ]});
        let got = entries(&ix, false, &row, "post", "9").unwrap();
        assert_eq!(got.len(), 4, "{got:?}");
        let deep = index(&[("a.b.c", TitoIndexBlockType::String)]);
        let row = json!({"a": [{"b": [{"c": "x"}, {"c": "y"}]}, {"b": {"c": "z"}}]});
        assert_eq!(entries(&deep, false, &row, "t", "1").unwrap().len(), 3);
        assert!(
            entries(&ix, false, &json!({"comments": []}), "post", "9")
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn too_many_entries_is_an_error() {
        let ix = index(&[
            ("a", TitoIndexBlockType::Integer),
            ("b", TitoIndexBlockType::Integer),
        ]);
        let many: Vec<i64> = (0..100).collect();
        let row = json!({"a": many, "b": many});
        assert!(entries(&ix, false, &row, "t", "1").is_err());
    }
}
