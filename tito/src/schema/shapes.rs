//! The shape versions of a table's rows: which ones are stored, and which one writers may write.

use std::collections::BTreeMap;

use serde::Serialize;

use super::Shapes;
use crate::engine::{TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::keys;
use crate::model::catalog::parse_catalog;

/// A table's rows counted by shape version, with what its catalog records.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ShapeCounts {
    /// The table.
    pub table: String,
    /// The catalog's record of shapes (`None` without a catalog).
    pub shapes: Option<Shapes>,
    /// Rows by stored version (0: a malformed version header).
    pub rows: BTreeMap<u32, u64>,
    /// Set when the table has more rows than were read (the counts cover those read).
    pub more: bool,
    /// The table's shape rewrite as its last batch stored it, if one ran.
    pub rewrite: Option<super::RewriteProgress>,
}

/// Counts the rows of `table` by stored shape version, reading at most `bound` rows (1 to
/// `u64::MAX`; 0 is refused) in bounded scans (for operators: `tito table versions`).
pub async fn shape_versions<E: TitoEngine>(
    db: &E,
    table: &str,
    bound: u64,
) -> TitoResult<ShapeCounts> {
    if bound == 0 {
        return Err(TitoError::invalid_argument(
            "a bound of 0 counts no row: give at least 1 (it bounds the rows read)",
        ));
    }
    crate::engine::read_only(db, async |tx| {
        let shapes = match tx.get(keys::schema_key(table).as_bytes()).await? {
            Some(bytes) => Some(parse_catalog(table, &bytes)?.shapes),
            None => None,
        };
        let prefix = keys::table_prefix(table);
        let end = keys::prefix_end(prefix.clone());
        let mut start = prefix.into_bytes();
        let mut counts = ShapeCounts {
            table: table.to_string(),
            shapes,
            rewrite: super::rewrite::read_progress(tx, table).await?,
            ..ShapeCounts::default()
        };
        let mut read = 0u64;
        loop {
            // One more than the bound says whether rows are left; any bound up to u64::MAX.
            let page = (bound - read)
                .saturating_add(1)
                .min(crate::engine::MAX_SCAN_LIMIT as u64) as usize;
            let rows = tx.scan(&start, end.as_bytes(), page).await?;
            for (_, value) in &rows {
                if read == bound {
                    counts.more = true;
                    return Ok(counts);
                }
                read += 1;
                let version = crate::model::shape::split(value).map_or(0, |(v, _)| v);
                *counts.rows.entry(version).or_default() += 1;
            }
            match rows.last() {
                Some((last, _)) if rows.len() == page => start = keys::key_after_bytes(last),
                _ => return Ok(counts),
            }
        }
    })
    .await
}

/// Lets writers of `table` write shape `version` from now on: the step of a rolling deploy
/// once no instance of the previous code runs (until then, newer code writes the allowed
/// version through its downgrade, or its writes are refused). `version` must be one some code
/// declared on the table (its first use records it); going back to an older version is
/// allowed (a rollback: newer code then writes the older shape again). Returns the record.
pub async fn allow_shape_version<E: TitoEngine>(
    db: &E,
    table: &str,
    version: u32,
) -> TitoResult<Shapes> {
    let table = table.to_string();
    db.transaction(|tx| {
        let table = table.clone();
        async move {
            let key = keys::schema_key(&table);
            let Some(bytes) = tx.get(key.as_bytes()).await? else {
                return Err(TitoError::NotFound(format!(
                    "table {table:?} has no schema catalog: no model code has used it yet"
                )));
            };
            let mut catalog = parse_catalog(&table, &bytes)?;
            if !catalog.shapes.seen.contains_key(&version) {
                let seen: Vec<String> = catalog.shapes.seen.keys().map(u32::to_string).collect();
                return Err(TitoError::invalid_argument(format!(
                    "no code of shape version {version} has used table {table:?} (versions seen: \
                     {}); deploy it first: its first write or query records it (a get does not; \
                     `TitoModel::schema` does)",
                    if seen.is_empty() {
                        "none".to_string()
                    } else {
                        seen.join(", ")
                    }
                )));
            }
            if catalog.shapes.writable() != version {
                catalog.shapes.writable = version;
                catalog.shapes.changed_ms = crate::engine::version_millis(tx.start_version());
                // A rewrite to another version is over: the next one starts from the first row.
                tx.delete(keys::schema_rewrite_key(&table).into_bytes())
                    .await?;
                tx.put(key.into_bytes(), serde_json::to_vec(&catalog)?)
                    .await?;
                tracing::info!(table = %table, version, "writers may write this shape version");
            }
            Ok(catalog.shapes)
        }
    })
    .await
}

/// Whether code of model `T` reads rows stored in shape `version` (its own, or one its
/// declared previous shapes reach). No row is needed: the chain answers "not declared" before
/// it decodes anything.
pub fn reads_version<T: crate::model::TitoModelTrait>(version: u32) -> bool {
    use crate::model::ShapeError;
    if version == T::VERSION {
        return true;
    }
    if version == 0 || version > T::VERSION {
        return false;
    }
    !matches!(
        T::upgrade(version, b""),
        Err(ShapeError::Unknown | ShapeError::Newer { .. })
    )
}

/// What one shape version of a table is to a model's code ([`check_shapes`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ShapeVerdict {
    /// Whether the code reads rows of this version.
    pub reads: bool,
    /// Rows of this version found (within the bound read).
    pub rows: u64,
    /// Whether some code declared it on the table (the catalog's record).
    pub declared: bool,
    /// Whether rows of this version can be met: some are stored, or writers may write it
    /// (a version declared but above the one allowed is not yet written by anyone).
    pub possible: bool,
}

/// A model's code against the shape versions a table has seen and holds: a check to run in a
/// test before a deploy (the rows of a staging copy, or the catalog a production store
/// recorded), as [`check_shapes`] returns it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ShapeCheck {
    /// The table.
    pub table: String,
    /// The version the code reads and writes.
    pub code_version: u32,
    /// The version writers may write, as the catalog says: 1 for a catalog without a shape
    /// record (a table older than shape versions); without any catalog (a new table), the
    /// code's own version, which its first write or query records.
    pub writable: u32,
    /// Every version the catalog records or a row holds (0: a malformed header), with whether
    /// the code reads it.
    pub versions: BTreeMap<u32, ShapeVerdict>,
    /// Whether the code can write under the catalog: its version is allowed, or it declares a
    /// downgrade to the allowed one.
    pub writes: bool,
    /// Set when the table has more rows than were read.
    pub more: bool,
}

impl ShapeCheck {
    /// The versions the code does not read among those it can meet (stored, or allowed to
    /// writers).
    pub fn unreadable(&self) -> Vec<u32> {
        self.versions
            .iter()
            .filter(|(_, v)| !v.reads && v.possible)
            .map(|(version, _)| *version)
            .collect()
    }

    /// Whether the code reads every version it can meet and can write.
    pub fn is_compatible(&self) -> bool {
        self.writes && self.unreadable().is_empty()
    }
}

/// Checks model `T`'s code against its table on store `db`: which shape versions the catalog
/// recorded and which rows hold (reading at most `bound` rows), whether the code reads each,
/// and whether it can write under the catalog. Changes nothing.
///
/// ```
/// # use serde::{Deserialize, Serialize};
/// # use tito::{TitoEngine, TitoModel};
/// #[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
/// struct Note {
///     id: String,
///     text: String,
/// }
///
/// # #[tokio::main(flavor = "multi_thread")]
/// # async fn main() -> Result<(), tito::TitoError> {
/// let db = tito::Embedded::temporary().await?;
/// db.clone().model::<Note>().build(Note { id: "1".into(), text: "hi".into() }).await?;
/// let check = tito::schema::check_shapes::<_, Note>(&db, 10_000).await?;
/// assert!(check.is_compatible(), "{:?}", check.unreadable());
/// # Ok(())
/// # }
/// ```
pub async fn check_shapes<E: TitoEngine, T: crate::model::TitoModelTrait>(
    db: &E,
    bound: u64,
) -> TitoResult<ShapeCheck> {
    let table = T::default().table();
    let counts = shape_versions(db, &table, bound).await?;
    // Without a catalog, the code's first use records its own version as the one to write.
    let writable = match &counts.shapes {
        Some(shapes) => shapes.writable(),
        None => T::VERSION,
    };
    let shapes = counts.shapes.unwrap_or_default();
    let mut versions: BTreeMap<u32, ShapeVerdict> = BTreeMap::new();
    for version in shapes.seen.keys() {
        versions.entry(*version).or_default().declared = true;
    }
    for (version, rows) in &counts.rows {
        versions.entry(*version).or_default().rows = *rows;
    }
    for (version, verdict) in versions.iter_mut() {
        verdict.reads = reads_version::<T>(*version);
        verdict.possible = verdict.rows > 0 || (verdict.declared && *version <= writable);
    }
    let writes = T::VERSION <= writable || T::downgrades_to(writable);
    Ok(ShapeCheck {
        table,
        code_version: T::VERSION,
        writable,
        versions,
        writes,
        more: counts.more,
    })
}
