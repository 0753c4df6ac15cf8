//! Readers of the rows in model events: the versioned models (version 2 or more) this process
//! made a handle of on one store, by table. A worker whose handler's type does not take an
//! event's row as published (an older shape) reads it through them. Kept on the store's
//! handle, never shared between stores.

use std::any::TypeId;
use std::collections::HashMap;
use std::sync::Mutex;

use serde_json::Value;

use crate::engine::TitoEngine;

/// `(shape version of the row, the row) -> the row in one model's current shape`.
pub(crate) type RowReader = fn(u32, &Value) -> Option<Value>;

/// A model's version, its type, the type of its events (`ModelEvent<Model>`) and its reader.
type Reader = (u32, TypeId, TypeId, RowReader);

#[derive(Default)]
struct Readers {
    by_table: Mutex<HashMap<String, Vec<Reader>>>,
}

/// Records a model (its type, its version and its reader) for `table` on `db`.
pub(crate) fn register<E: TitoEngine>(
    db: &E,
    table: &str,
    version: u32,
    (model, event): (TypeId, TypeId),
    read: RowReader,
) {
    let readers = db.extensions().get::<Readers>();
    let mut by_table = crate::util::lock(&readers.by_table);
    let list = by_table.entry(table.to_string()).or_default();
    if !list.iter().any(|(_, t, _, _)| *t == model) {
        list.push((version, model, event, read));
        list.sort_by_key(|(version, _, _, _)| *version);
    }
}

/// A model event's payload for a handler of type `handler` (`ModelEvent<Model>` of a
/// versioned model this process knows on `db`) whose row is in another shape than the model's:
/// the row read through the model's conversions, by the shape the event says it is in, never
/// decoded as it is (serde would fill a field the conversion sets with its default). `None`
/// when the handler is not such a type or the row is in the model's own shape (it decodes as
/// it is); `Some(None)` when the model's conversions do not read the row.
pub(crate) fn for_handler<E: TitoEngine>(
    db: &E,
    handler: TypeId,
    payload: &Value,
) -> Option<Option<Value>> {
    let table = payload.get("table").and_then(Value::as_str)?;
    let row = payload.get("row")?;
    let shape = shape_of(payload);
    let (version, read) = {
        let readers = db.extensions().get::<Readers>();
        let by_table = crate::util::lock(&readers.by_table);
        by_table
            .get(table)?
            .iter()
            .find(|(_, _, event, _)| *event == handler)
            .map(|(version, _, _, read)| (*version, *read))?
    };
    if version == shape {
        return None;
    }
    Some(read(shape, row).map(|row| {
        let mut out = payload.clone();
        out["row"] = row;
        out["shape"] = Value::from(version);
        out
    }))
}

/// The shape version a model event's payload says its row is in (1 when it says nothing).
fn shape_of(payload: &Value) -> u32 {
    payload
        .get("shape")
        .and_then(Value::as_u64)
        .map_or(1, |v| u32::try_from(v).unwrap_or(u32::MAX))
}

/// A model event's payload with its row read in the newer shape of each model of its table
/// this process knows on `db`, oldest first (none when the payload is not a model event, or no
/// model reads its row).
pub(crate) fn upgraded_payloads<E: TitoEngine>(db: &E, payload: &Value) -> Vec<Value> {
    let (Some(table), Some(row)) = (
        payload.get("table").and_then(Value::as_str),
        payload.get("row"),
    ) else {
        return Vec::new();
    };
    let shape = shape_of(payload);
    let readers: Vec<(u32, RowReader)> = {
        let readers = db.extensions().get::<Readers>();
        let by_table = crate::util::lock(&readers.by_table);
        by_table
            .get(table)
            .map(|list| {
                list.iter()
                    .filter(|(version, _, _, _)| *version > shape)
                    .map(|(version, _, _, read)| (*version, *read))
                    .collect()
            })
            .unwrap_or_default()
    };
    readers
        .into_iter()
        .filter_map(|(version, read)| {
            let row = read(shape, row)?;
            let mut out = payload.clone();
            out["row"] = row;
            out["shape"] = Value::from(version);
            Some(out)
        })
        .collect()
}
