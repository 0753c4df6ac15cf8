//! The versioned models (version 2 or more) this process made a handle of on one store, by
//! table: the shape rewriters queue workers' maintenance runs ([`crate::schema`]'s rewrites).
//! Function pointers, never the store itself (no cycle keeps a store open).

use std::any::TypeId;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;

use super::{TitoModel, TitoModelTrait};
use crate::engine::TitoEngine;
use crate::error::TitoResult;

/// One maintenance batch of a versioned model's rewrite on a store: `None` when the model
/// cannot write the allowed version, else whether the batch did work.
pub(crate) type StepFn<E> = fn(E) -> Pin<Box<dyn Future<Output = TitoResult<Option<bool>>> + Send>>;

/// A model's version, its type and its batch.
type Rewriter<E> = (u32, TypeId, StepFn<E>);

struct Rewriters<E> {
    by_table: Mutex<HashMap<String, Vec<Rewriter<E>>>>,
}

impl<E> Default for Rewriters<E> {
    fn default() -> Self {
        Rewriters {
            by_table: Mutex::default(),
        }
    }
}

/// Records versioned model `T` on `db` as a rewriter of its table (nothing for an unversioned
/// one).
pub(crate) fn register<E: TitoEngine, T: TitoModelTrait>(db: &E) {
    if T::VERSION < 2 {
        return;
    }
    let rewriters = db.extensions().get::<Rewriters<E>>();
    let mut by_table = crate::util::lock(&rewriters.by_table);
    let list = by_table.entry(T::default().table()).or_default();
    let id = TypeId::of::<T>();
    if !list.iter().any(|(_, t, _)| *t == id) {
        list.push((T::VERSION, id, step::<E, T>));
        // The newest code first: it reads the most versions.
        list.sort_by_key(|(version, _, _)| std::cmp::Reverse(*version));
    }
}

fn step<E: TitoEngine, T: TitoModelTrait>(
    db: E,
) -> Pin<Box<dyn Future<Output = TitoResult<Option<bool>>> + Send>> {
    Box::pin(async move { TitoModel::<E, T>::new(db).maintenance_rewrite().await })
}

/// Each table's rewriters on `db`, newest model first.
pub(crate) fn by_table<E: TitoEngine>(db: &E) -> Vec<(String, Vec<StepFn<E>>)> {
    let rewriters = db.extensions().get::<Rewriters<E>>();
    let by_table = crate::util::lock(&rewriters.by_table);
    by_table
        .iter()
        .map(|(table, list)| (table.clone(), list.iter().map(|(_, _, f)| *f).collect()))
        .collect()
}
