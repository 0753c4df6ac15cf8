//! Storage keys: the one module that builds and parses them.
//!
//! The layout and the encodings (why strings escape more than `:`, why `prefix_end` and
//! `key_after` differ) are written once, in `docs/storage-layout.md`; a change here changes
//! that page in the same commit. Internal: public only with the `test-util` feature, for tests
//! that read or damage storage directly.

use chrono::{DateTime, Utc};

use crate::error::{TitoError, TitoResult};

/// The separator between the segments of a key.
pub const SEPARATOR: char = ':';

const ESCAPE: u8 = b';';
const ESCAPED_SEPARATOR: u8 = b'<';
const ESCAPED_ESCAPE: u8 = b'=';

/// The exclusive end of the range of every key that starts with `prefix`: the least string
/// greater than all of them.
///
/// The last character that can be advanced is advanced and everything after it dropped. An
/// empty result means "no upper bound" (the prefix was empty, or made only of `char::MAX`).
///
/// ```
/// assert_eq!(tito::prefix_end("index:by_store:".to_string()), "index:by_store;");
/// ```
pub fn prefix_end(prefix: String) -> String {
    let mut chars: Vec<char> = prefix.chars().collect();
    while let Some(last) = chars.pop() {
        if let Some(next) = next_char(last) {
            chars.push(next);
            return chars.into_iter().collect();
        }
    }
    String::new()
}

/// The first key after `key` in byte order: `key` followed by a NUL character. Use it to
/// continue a forward scan after an exact key.
///
/// ```
/// assert_eq!(tito::key_after("table:item:a2".to_string()), "table:item:a2\0");
/// ```
pub fn key_after(key: String) -> String {
    let mut key = key;
    key.push('\0');
    key
}

/// An alias of [`prefix_end`], kept for source compatibility.
///
/// Do not use it to continue after an exact key: advancing the last character skips keys such
/// as `a20` after `a2`. Use [`key_after`] for that.
#[deprecated(
    note = "use `prefix_end` for prefix ranges or `key_after` to continue after an exact key"
)]
pub fn next_string_lexicographically(prefix: String) -> String {
    prefix_end(prefix)
}

fn next_char(c: char) -> Option<char> {
    match c {
        char::MAX => None,
        '\u{D7FF}' => Some('\u{E000}'),
        c => char::from_u32(c as u32 + 1),
    }
}

/// [`prefix_end`] on bytes: the exclusive end of every key starting with `prefix`; empty means
/// no upper bound.
pub fn prefix_end_bytes(prefix: &[u8]) -> Vec<u8> {
    let mut out = prefix.to_vec();
    while let Some(last) = out.pop() {
        if last < u8::MAX {
            out.push(last + 1);
            return out;
        }
    }
    Vec::new()
}

/// [`key_after`] on bytes: `key` followed by a zero byte.
pub fn key_after_bytes(key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(key.len() + 1);
    out.extend_from_slice(key);
    out.push(0);
    out
}

/// A key for messages, in quotes: its text as Rust writes a string (`\\`, `\"`, `\n`,
/// `\u{1}` and so on), and each byte that is not part of UTF-8 text as `\xNN` (`ff 01 6b`
/// prints as `"\xff\u{1}k"`). Two different keys never print the same, and
/// [`parse_display_key`] (and `tito keys decode`) reads the printed form back.
pub fn display_key(key: &[u8]) -> String {
    let mut out = String::with_capacity(key.len() + 2);
    out.push('"');
    for chunk in key.utf8_chunks() {
        for c in chunk.valid().chars() {
            // As a string's Debug form writes it (a single quote is left as it is).
            match c {
                '\'' => out.push(c),
                _ => out.extend(c.escape_debug()),
            }
        }
        for byte in chunk.invalid() {
            out.push_str(&format!("\\x{byte:02x}"));
        }
    }
    out.push('"');
    out
}

/// A key as listings show it: a UTF-8 key that does not begin with `"` as its text, any other
/// key in [`display_key`]'s quoted form, so that two keys never show the same. `tito keys
/// decode` takes both forms.
pub fn key_text(key: &[u8]) -> String {
    match std::str::from_utf8(key) {
        Ok(text) if !text.starts_with('"') => text.to_string(),
        _ => display_key(key),
    }
}

/// Reads a key printed by [`display_key`] back into its bytes: a quoted form with Rust's
/// string escapes (`\\`, `\"`, `\'`, `\n`, `\r`, `\t`, `\0`, `\u{...}`) and `\xNN` for
/// any byte. `None` when `text` is not such a form.
pub fn parse_display_key(text: &str) -> Option<Vec<u8>> {
    let inner = text.strip_prefix('"')?.strip_suffix('"')?;
    let mut out = Vec::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next()? {
                '\\' => out.push(b'\\'),
                '"' => out.push(b'"'),
                '\'' => out.push(b'\''),
                'n' => out.push(b'\n'),
                'r' => out.push(b'\r'),
                't' => out.push(b'\t'),
                '0' => out.push(0),
                'x' => {
                    let hex: String = [chars.next()?, chars.next()?].iter().collect();
                    out.push(u8::from_str_radix(&hex, 16).ok()?);
                }
                'u' => {
                    if chars.next()? != '{' {
                        return None;
                    }
                    let mut hex = String::new();
                    loop {
                        match chars.next()? {
                            '}' => break,
                            digit => hex.push(digit),
                        }
                    }
                    let c = char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?;
                    out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
                }
                _ => return None,
            },
            // An unescaped quote cannot be inside the form.
            '"' => return None,
            c => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    Some(out)
}

/// Appends the segment encoding of a string to `out`.
///
/// Bytes below `<` are escaped (`:` as `;<`, `;` as `;=`, the others as `;` and the byte); every
/// other byte, multi-byte characters included, is copied as it is, run by run.
pub fn encode_str(value: &str, out: &mut String) {
    out.reserve(value.len());
    let bytes = value.as_bytes();
    let mut run = 0;
    for (index, &byte) in bytes.iter().enumerate() {
        if byte >= 0x3C {
            continue;
        }
        // An ASCII byte: `index` is a character boundary.
        out.push_str(&value[run..index]);
        match byte {
            b':' => out.push_str(";<"),
            b';' => out.push_str(";="),
            _ => {
                out.push(ESCAPE as char);
                out.push(byte as char);
            }
        }
        run = index + 1;
    }
    out.push_str(&value[run..]);
}

/// The longest key a transaction may write (4 KiB, within TiKV's key limits).
pub const MAX_KEY_BYTES: usize = 4 * 1024;

/// The longest raw value [`encode_bounded`] keeps whole; a longer one is hashed.
pub const MAX_BOUNDED_SEGMENT: usize = 256;

/// Appends `value` as [`encode_str`] does when it is at most [`MAX_BOUNDED_SEGMENT`] bytes;
/// a longer one as its first 128 bytes (encoded), `;>` and the 128-bit FNV-1a hash of the
/// whole value in hex. For keys derived from values a user gave without a length limit (a
/// business key, a worker id): whatever was accepted, the derived key fits the engines' key
/// limit. `;>` is an escape [`encode_str`] never writes, so a hashed segment never equals
/// the encoding of another value (it does not decode: such keys are never parsed back).
pub fn encode_bounded(value: &str, out: &mut String) {
    if value.len() <= MAX_BOUNDED_SEGMENT {
        encode_str(value, out);
        return;
    }
    let mut cut = 128;
    while !value.is_char_boundary(cut) {
        cut -= 1;
    }
    encode_str(&value[..cut], out);
    use std::fmt::Write;
    let _ = write!(out, ";>{:032x}", fnv1a_128(value.as_bytes()));
}

/// FNV-1a, 128-bit.
fn fnv1a_128(bytes: &[u8]) -> u128 {
    let mut hash: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    for byte in bytes {
        hash ^= u128::from(*byte);
        hash = hash.wrapping_mul(0x0000_0000_0100_0000_0000_0000_0000_013b);
    }
    hash
}

/// Checks that `segment` is a string segment [`decode_str`] accepts, without decoding it.
pub fn check_str(segment: &str) -> TitoResult<()> {
    let bytes = segment.as_bytes();
    let mut index = 0;
    while index < bytes.len() {
        let byte = bytes[index];
        if byte == ESCAPE {
            match bytes.get(index + 1) {
                None => return Err(malformed(segment, "ends inside an escape")),
                Some(&(ESCAPED_SEPARATOR | ESCAPED_ESCAPE | 0x00..=0x39)) => index += 2,
                Some(_) => return Err(malformed(segment, "has an unknown escape")),
            }
        } else if byte < 0x3C {
            return Err(malformed(segment, "holds an unescaped byte below `<`"));
        } else {
            index += 1;
        }
    }
    // Escapes stand for ASCII bytes, so a segment of a `str` decodes to valid UTF-8.
    Ok(())
}

/// Decodes a string segment written by [`encode_str`].
pub fn decode_str(segment: &str) -> TitoResult<String> {
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        let byte = bytes[index];
        if byte == ESCAPE {
            let Some(&next) = bytes.get(index + 1) else {
                return Err(malformed(segment, "ends inside an escape"));
            };
            out.push(match next {
                ESCAPED_SEPARATOR => b':',
                ESCAPED_ESCAPE => b';',
                0x00..=0x39 => next,
                _ => return Err(malformed(segment, "has an unknown escape")),
            });
            index += 2;
        } else if byte < 0x3C {
            return Err(malformed(segment, "holds an unescaped byte below `<`"));
        } else {
            out.push(byte);
            index += 1;
        }
    }
    String::from_utf8(out).map_err(|_| malformed(segment, "is not UTF-8"))
}

fn malformed(segment: &str, why: &str) -> TitoError {
    TitoError::Integrity(format!("key segment {segment:?} {why}"))
}

/// Appends the segment encoding of a `u64` (20 digits).
pub fn encode_u64(value: u64, out: &mut String) {
    use std::fmt::Write;
    let _ = write!(out, "{value:020}");
}

/// Decodes a `u64` segment.
pub fn decode_u64(segment: &str) -> TitoResult<u64> {
    if segment.len() != 20 || !segment.bytes().all(|b| b.is_ascii_digit()) {
        return Err(malformed(segment, "is not a 20-digit unsigned integer"));
    }
    segment
        .parse()
        .map_err(|_| malformed(segment, "is out of range for u64"))
}

const SIGN: u64 = 1 << 63;

/// Appends the segment encoding of an `i64`.
pub fn encode_i64(value: i64, out: &mut String) {
    encode_u64((value as u64) ^ SIGN, out);
}

/// Decodes an `i64` segment.
pub fn decode_i64(segment: &str) -> TitoResult<i64> {
    Ok((decode_u64(segment)? ^ SIGN) as i64)
}

/// Appends the segment encoding of an `f64`. NaN has no place in an order and is rejected;
/// `-0.0` is written as `0.0` so that equal numbers have one key.
pub fn encode_f64(value: f64, out: &mut String) -> TitoResult<()> {
    if value.is_nan() {
        return Err(TitoError::invalid_argument("NaN cannot be stored in a key"));
    }
    let value = if value == 0.0 { 0.0 } else { value };
    let bits = value.to_bits();
    let ordered = if bits & SIGN != 0 { !bits } else { bits | SIGN };
    encode_u64(ordered, out);
    Ok(())
}

/// Decodes an `f64` segment.
pub fn decode_f64(segment: &str) -> TitoResult<f64> {
    let ordered = decode_u64(segment)?;
    let bits = if ordered & SIGN != 0 {
        ordered & !SIGN
    } else {
        !ordered
    };
    let value = f64::from_bits(bits);
    if value.is_nan() {
        return Err(malformed(segment, "encodes NaN"));
    }
    Ok(value)
}

/// Appends the segment encoding of a `bool`.
pub fn encode_bool(value: bool, out: &mut String) {
    out.push_str(if value { "true" } else { "false" });
}

/// Decodes a `bool` segment.
pub fn decode_bool(segment: &str) -> TitoResult<bool> {
    match segment {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(malformed(segment, "is not a boolean")),
    }
}

/// Appends the segment encoding of a timestamp: seconds (as an `i64` segment), `.`, and the
/// nanoseconds as nine digits.
pub fn encode_timestamp(value: &DateTime<Utc>, out: &mut String) {
    use std::fmt::Write;
    encode_i64(value.timestamp(), out);
    let _ = write!(out, ".{:09}", value.timestamp_subsec_nanos());
}

/// Decodes a timestamp segment.
pub fn decode_timestamp(segment: &str) -> TitoResult<DateTime<Utc>> {
    let (secs, nanos) = segment
        .split_once('.')
        .ok_or_else(|| malformed(segment, "is not a timestamp"))?;
    let secs = decode_i64(secs)?;
    if nanos.len() != 9 || !nanos.bytes().all(|b| b.is_ascii_digit()) {
        return Err(malformed(segment, "has malformed nanoseconds"));
    }
    let nanos: u32 = nanos
        .parse()
        .map_err(|_| malformed(segment, "has malformed nanoseconds"))?;
    DateTime::from_timestamp(secs, nanos).ok_or_else(|| malformed(segment, "is out of range"))
}

/// One typed value in a key segment.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum KeyValue {
    /// A string.
    String(String),
    /// An unsigned integer.
    U64(u64),
    /// A signed integer.
    I64(i64),
    /// A float (never NaN).
    F64(f64),
    /// A boolean.
    Bool(bool),
    /// A point in time.
    Timestamp(DateTime<Utc>),
}

impl KeyValue {
    /// Appends the segment encoding of this value.
    pub fn encode(&self, out: &mut String) -> TitoResult<()> {
        match self {
            KeyValue::String(value) => encode_str(value, out),
            KeyValue::U64(value) => encode_u64(*value, out),
            KeyValue::I64(value) => encode_i64(*value, out),
            KeyValue::F64(value) => encode_f64(*value, out)?,
            KeyValue::Bool(value) => encode_bool(*value, out),
            KeyValue::Timestamp(value) => encode_timestamp(value, out),
        }
        Ok(())
    }
}

/// Builds a key segment by segment.
///
#[cfg_attr(feature = "test-util", doc = "```")]
#[cfg_attr(not(feature = "test-util"), doc = "```ignore")]
/// use tito::keys::KeyBuilder;
///
/// let key = KeyBuilder::new().raw("table").raw("user").string("a:b").finish();
/// assert_eq!(key, "table:user:a;<b");
/// ```
#[derive(Clone, Debug, Default)]
pub struct KeyBuilder {
    key: String,
    first: bool,
}

impl KeyBuilder {
    /// An empty key.
    pub fn new() -> Self {
        KeyBuilder {
            key: String::with_capacity(64),
            first: true,
        }
    }

    fn separate(&mut self) {
        if !self.first {
            self.key.push(SEPARATOR);
        }
        self.first = false;
    }

    /// Appends a literal segment (a keyword such as `table`). It must not contain `:`.
    pub fn raw(mut self, literal: &str) -> Self {
        debug_assert!(
            !literal.contains(SEPARATOR),
            "literal segment {literal:?} holds a separator"
        );
        self.separate();
        self.key.push_str(literal);
        self
    }

    /// Appends an encoded string segment.
    pub fn string(mut self, value: &str) -> Self {
        self.separate();
        encode_str(value, &mut self.key);
        self
    }

    /// Appends the segments of a row key, `table:{table}:{id}` ([`row_key`]).
    pub fn row(self, table: &str, id: &str) -> Self {
        self.raw("table").string(table).string(id)
    }

    /// Appends an encoded `u64` segment.
    pub fn u64(mut self, value: u64) -> Self {
        self.separate();
        encode_u64(value, &mut self.key);
        self
    }

    /// Appends an encoded typed value.
    pub fn value(mut self, value: &KeyValue) -> TitoResult<Self> {
        self.separate();
        value.encode(&mut self.key)?;
        Ok(self)
    }

    /// Ends the key with a separator, making it a prefix of every key with more segments.
    pub fn prefix(mut self) -> String {
        self.key.push(SEPARATOR);
        self.key
    }

    /// The key.
    pub fn finish(self) -> String {
        self.key
    }
}

/// Splits a key into its segments. The segments are still encoded.
pub fn segments(key: &str) -> std::str::Split<'_, char> {
    key.split(SEPARATOR)
}

/// A key as text, or an integrity error naming it when it is not UTF-8.
pub fn key_str(key: &[u8]) -> TitoResult<&str> {
    std::str::from_utf8(key)
        .map_err(|_| TitoError::Integrity(format!("key {} is not UTF-8", display_key(key))))
}

// ---------------------------------------------------------------------------------------------
// Model keys
//
// table:{table}:{id}                                        the row (JSON)
// index:{table}:{index}:{field}:{value}[:{field}:{value}..]:table:{table}:{id}   an index entry
// unique:{table}:{index}:{field}:{value}[:{field}:{value}..]  a unique index's claim (value: the id)
// reverse-index:table:{table}:{id}                            the row's manifest: its index keys
//                                                             and claims
//
// Index names belong to their table: the table leads every index and claim key, so two tables
// that both declare `by_email` never see (or release) each other's entries and claims.
// ---------------------------------------------------------------------------------------------

/// The key of a model row: `table:{table}:{id}`.
pub fn row_key(table: &str, id: &str) -> String {
    KeyBuilder::new().row(table, id).finish()
}

/// The prefix of every row of a table: `table:{table}:`.
pub fn table_prefix(table: &str) -> String {
    KeyBuilder::new().raw("table").string(table).prefix()
}

/// The key of a row's reverse-index manifest: `reverse-index:table:{table}:{id}`.
pub fn manifest_key(table: &str, id: &str) -> String {
    KeyBuilder::new()
        .raw("reverse-index")
        .row(table, id)
        .finish()
}

/// The prefix of an index's entries with the given leading fields bound:
/// `index:{table}:{index}:{field}:{value}:...:`.
pub fn index_prefix(table: &str, index: &str, bound: &[(&str, &KeyValue)]) -> TitoResult<String> {
    Ok(bound_fields("index", table, index, bound)?.prefix())
}

/// `{kind}:{table}:{index}:{field}:{value}..` for the fields in `bound`, still open.
fn bound_fields(
    kind: &str,
    table: &str,
    index: &str,
    bound: &[(&str, &KeyValue)],
) -> TitoResult<KeyBuilder> {
    let mut builder = KeyBuilder::new().raw(kind).string(table).string(index);
    for (field, value) in bound {
        builder = builder.string(field).value(value)?;
    }
    Ok(builder)
}

/// The key of one index entry: the index prefix with every field bound, then the row key.
pub fn index_key(
    index: &str,
    fields: &[(&str, &KeyValue)],
    table: &str,
    id: &str,
) -> TitoResult<String> {
    Ok(bound_fields("index", table, index, fields)?
        .row(table, id)
        .finish())
}

/// The key a unique index of `table` claims for one combination of values; its value is the
/// owning id: `unique:{table}:{index}:{field}:{value}..`.
pub fn unique_claim_key(
    table: &str,
    index: &str,
    fields: &[(&str, &KeyValue)],
) -> TitoResult<String> {
    Ok(bound_fields("unique", table, index, fields)?.finish())
}

/// Whether `key` is an index entry of the row `table:{table}:{id}`: it starts with
/// `index:{table}:` and ends with `:` and that exact row key.
pub fn is_index_key_of(key: &str, table: &str, id: &str) -> bool {
    let row = row_key(table, id);
    let head = KeyBuilder::new().raw("index").string(table).prefix();
    key.starts_with(&head)
        && key.len() > row.len() + head.len()
        && key.ends_with(&row)
        && key.as_bytes()[key.len() - row.len() - 1] == SEPARATOR as u8
}

/// Whether `key` is a unique claim of one of `table`'s indexes (`unique:{table}:...`), the
/// other kind of key a manifest may name.
pub fn is_claim_key_of(key: &str, table: &str) -> bool {
    let head = KeyBuilder::new().raw("unique").string(table).prefix();
    key.len() > head.len() && key.starts_with(&head)
}

/// The `(table, id)` of the row an index entry points at, decoded from its last segments.
pub fn index_key_row(key: &str) -> TitoResult<(String, String)> {
    let malformed = || TitoError::Integrity(format!("index key {key:?} does not end in a row key"));
    let mut parts = key.rsplitn(4, SEPARATOR);
    let id = parts.next().ok_or_else(malformed)?;
    let table = parts.next().ok_or_else(malformed)?;
    if parts.next() != Some("table") || parts.next().is_none() {
        return Err(malformed());
    }
    Ok((decode_str(table)?, decode_str(id)?))
}

/// Checks, without allocating, that `key` is an index entry ending in a row key of the table
/// whose [`table_prefix`] is `table_prefix`: what [`index_key_row`] decodes, compared with the
/// table. Returns the entry's id segment (still encoded).
pub fn check_index_key_in<'k>(key: &'k str, table_prefix: &str) -> TitoResult<&'k str> {
    let malformed = || TitoError::Integrity(format!("index key {key:?} does not end in a row key"));
    let (head, id) = key.rsplit_once(SEPARATOR).ok_or_else(malformed)?;
    // `head` + ':' must end in `table:{table}:`, preceded by at least one segment.
    let row_head = &table_prefix[..table_prefix.len() - 1];
    let at = head.len().checked_sub(row_head.len());
    match at {
        Some(at)
            if head.ends_with(row_head) && at > 0 && head.as_bytes()[at - 1] == SEPARATOR as u8 =>
        {
            check_str(id)?;
            Ok(id)
        }
        _ => {
            // Not this table's: say which table it points into, as the decoding check did.
            let (table, _) = index_key_row(key)?;
            Err(TitoError::Integrity(format!(
                "index entry {key:?} points into table {table:?}, not the queried one"
            )))
        }
    }
}

/// `unique:{table}:{index}:`, every claim of one unique index.
pub fn unique_prefix(table: &str, index: &str) -> String {
    KeyBuilder::new()
        .raw("unique")
        .string(table)
        .string(index)
        .prefix()
}

/// The index an index entry or a unique claim of `table` belongs to (its third segment), or
/// `None` when `key` is neither.
pub fn index_name_of(key: &str, table: &str) -> Option<String> {
    let index_head = KeyBuilder::new().raw("index").string(table).prefix();
    let claim_head = KeyBuilder::new().raw("unique").string(table).prefix();
    let rest = key
        .strip_prefix(&index_head)
        .or_else(|| key.strip_prefix(&claim_head))?;
    let segment = rest.split(SEPARATOR).next()?;
    decode_str(segment).ok()
}

// ---------------------------------------------------------------------------------------------
// Schema keys (`crate::schema`)
//
// schema:{table}                     the table's index catalog (JSON: version, indexes, states)
// schema-progress:{table}:{index}    a build's or a drop's progress (JSON: cursor, rows, failure)
// schema-audit:{table}               a running audit's or repair's progress and findings (JSON)
//
// Writers read the catalog key with the row in one request. Progress lives under its own keys
// so that a build batch rewrites the catalog only when an index changes state.
// ---------------------------------------------------------------------------------------------

/// `schema:{table}`.
pub fn schema_key(table: &str) -> String {
    KeyBuilder::new().raw("schema").string(table).finish()
}

/// `schema-progress:{table}:{index}`.
pub fn schema_progress_key(table: &str, index: &str) -> String {
    KeyBuilder::new()
        .raw("schema-progress")
        .string(table)
        .string(index)
        .finish()
}

/// `schema-rewrite:{table}`.
pub fn schema_rewrite_key(table: &str) -> String {
    KeyBuilder::new()
        .raw("schema-rewrite")
        .string(table)
        .finish()
}

/// `schema-audit:{table}`.
pub fn schema_audit_key(table: &str) -> String {
    KeyBuilder::new().raw("schema-audit").string(table).finish()
}

/// The id of a row key of `table`, or `None` when `key` is not one.
pub fn row_key_id(key: &str, table: &str) -> Option<String> {
    let rest = key.strip_prefix(&table_prefix(table))?;
    if rest.contains(SEPARATOR) {
        return None;
    }
    decode_str(rest).ok()
}

/// FNV-1a (64-bit) of `bytes`: stable across processes, platforms and Rust releases.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in bytes {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

// ---------------------------------------------------------------------------------------------
// Queue keys
//
// The default queue keeps the seed's layout under `queue:`; a named queue (topic) `t` uses the
// same layout under `queue@{t}:` with `t` encoded as a string segment. No prefix of one queue is
// a prefix of another's: the topic segment ends at `:`, and `queue:` differs from `queue@` at
// its sixth byte.
//
// {queue}:pending:{partition:04}:{timestamp:020}:{enqueue_version:020}:{event_id}
// {queue}:completed:{processed_at:020}:{event_timestamp:020}:{event_id}
// {queue}:owner:{b64url(kind)}:{b64url(id)}:{state}:{b64url(queue_storage_key)}
// {queue}:lease:{partition:04}                   a partition lease's holder (JSON)
// {queue}:lease-expiry:{partition:04}            a standalone lease's expiry (a version)
// {queue}:lease-fence:{partition:04}:{slot:04}    a lease's fence slot: an outcome locks its
//                                                own, a takeover writes every one its holder
//                                                may use (the generation that took it)
// {queue}:event:{event_id}                       the live invocation of an event id
// {queue}:meta                                   the queue's partition count (JSON)
// {queue}:undecodable:{partition:04}:{timestamp:020}:{enqueue_version:020}:{event_id}
//                                                a worker could not decode that pending row
//                                                as its handler's type (JSON: type, error)
// {queue}:aside:{partition:04}:{timestamp:020}:{enqueue_version:020}:{event_id}
//                                                a pending row moved aside (JSON: why, row)
// {queue}:node:{id} / :coordinator / :members     cluster mode (see `queue::cluster`)
//
// `processed_at` is the version of the transaction that completed the invocation (unique per
// transaction, so two invocations of one event never share a completed key).
// ---------------------------------------------------------------------------------------------

/// The key prefix of a queue: `queue` for the default queue, `queue@{topic}` for a named one.
pub fn queue_root(topic: Option<&str>) -> String {
    match topic {
        None => "queue".to_string(),
        Some(topic) => {
            let mut out = "queue@".to_string();
            encode_str(topic, &mut out);
            out
        }
    }
}

/// The queue a root names, as its user wrote it (for messages): its topic, or `default`.
pub fn queue_name(root: &str) -> String {
    match root.strip_prefix("queue@") {
        None => "default".to_string(),
        Some(encoded) => decode_str(encoded).unwrap_or_else(|_| encoded.to_string()),
    }
}

/// `{queue}:pending:{partition:04}:`, the prefix of one partition's pending rows.
pub fn pending_partition_prefix(root: &str, partition: u32) -> String {
    format!("{root}:pending:{partition:04}:")
}

/// `{queue}:pending:{partition:04}:{timestamp:020}:`, one due-time bucket of a partition.
pub fn pending_bucket_prefix(root: &str, partition: u32, timestamp: u64) -> String {
    format!("{root}:pending:{partition:04}:{timestamp:020}:")
}

/// The key of a pending invocation.
pub fn pending_key(
    root: &str,
    partition: u32,
    timestamp: u64,
    version: u64,
    event_id: &str,
) -> String {
    let mut key = format!("{root}:pending:{partition:04}:{timestamp:020}:{version:020}:");
    encode_str(event_id, &mut key);
    key
}

/// A pending key's parts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingKey {
    /// The partition.
    pub partition: u32,
    /// When the invocation becomes runnable (Unix seconds).
    pub timestamp: u64,
    /// The version of the transaction that enqueued it.
    pub version: u64,
    /// The logical event id.
    pub event_id: String,
}

/// Parses a pending key of the queue `root`.
pub fn parse_pending_key(root: &str, key: &str) -> TitoResult<PendingKey> {
    let malformed = |why: &str| TitoError::Integrity(format!("pending key {key:?} {why}"));
    let rest = key
        .strip_prefix(root)
        .and_then(|r| r.strip_prefix(":pending:"))
        .ok_or_else(|| malformed("is not in this queue"))?;
    let mut parts = rest.splitn(4, SEPARATOR);
    let number = |part: Option<&str>, width: usize, what: &str| -> TitoResult<u64> {
        let part = part.ok_or_else(|| malformed(&format!("has no {what}")))?;
        if part.len() != width || !part.bytes().all(|b| b.is_ascii_digit()) {
            return Err(malformed(&format!("has a malformed {what}")));
        }
        part.parse()
            .map_err(|_| malformed(&format!("has a malformed {what}")))
    };
    let partition = number(parts.next(), 4, "partition")? as u32;
    let timestamp = number(parts.next(), 20, "timestamp")?;
    let version = number(parts.next(), 20, "version")?;
    let event_id = decode_str(parts.next().ok_or_else(|| malformed("has no event id"))?)?;
    Ok(PendingKey {
        partition,
        timestamp,
        version,
        event_id,
    })
}

/// The key of a completed invocation.
pub fn completed_key(
    root: &str,
    processed_at: u64,
    event_timestamp: u64,
    event_id: &str,
) -> String {
    let mut key = format!("{root}:completed:{processed_at:020}:{event_timestamp:020}:");
    encode_str(event_id, &mut key);
    key
}

/// `{queue}:completed:`, the prefix of every completed invocation.
pub fn completed_prefix(root: &str) -> String {
    format!("{root}:completed:")
}

/// `{queue}:completed:{processed_at:020}:`: completed rows processed before `processed_at` sort
/// below it.
pub fn completed_before(root: &str, processed_at: u64) -> String {
    format!("{root}:completed:{processed_at:020}:")
}

/// The state segment of an owner key.
pub const OWNER_PENDING: &str = "pending";
/// The state segment of an owner key.
pub const OWNER_COMPLETED: &str = "completed";
/// The owner-key state of a dead invocation.
pub const OWNER_DEAD: &str = "dead";

/// The key of a dead invocation: `{queue}:dead:{event id}` (one per id: the event-id key points
/// at it while it is dead).
pub fn dead_key(root: &str, event_id: &str) -> String {
    let mut key = dead_prefix(root);
    encode_str(event_id, &mut key);
    key
}

/// `{queue}:dead:`, the prefix of every dead invocation.
pub fn dead_prefix(root: &str) -> String {
    format!("{root}:dead:")
}

/// `{queue}:owner:{b64url(kind)}:{b64url(id)}:`, every key of one owner.
pub fn owner_prefix(root: &str, kind: &str, id: &str) -> String {
    format!(
        "{root}:owner:{}:{}:",
        base64url(kind.as_bytes()),
        base64url(id.as_bytes())
    )
}

/// The owner key of one queue row in one state.
pub fn owner_key(root: &str, kind: &str, id: &str, state: &str, queue_key: &str) -> String {
    format!(
        "{}{state}:{}",
        owner_prefix(root, kind, id),
        base64url(queue_key.as_bytes())
    )
}

/// The queue row an owner key points at.
pub fn owner_key_target(key: &str) -> TitoResult<String> {
    let encoded = key
        .rsplit(SEPARATOR)
        .next()
        .ok_or_else(|| TitoError::Integrity(format!("owner key {key:?} is malformed")))?;
    let bytes = base64url_decode(encoded)
        .ok_or_else(|| TitoError::Integrity(format!("owner key {key:?} is malformed")))?;
    String::from_utf8(bytes)
        .map_err(|_| TitoError::Integrity(format!("owner key {key:?} is malformed")))
}

/// The owner key state of a workflow step waiting for its dependencies.
pub const OWNER_WAITING: &str = "waiting";

/// `{queue}:waiting:`, the prefix of the workflow steps of a queue that wait for their
/// dependencies.
pub fn waiting_prefix(root: &str) -> String {
    format!("{root}:waiting:")
}

/// `{queue}:waiting:{workflow}:{step}`: a workflow step waiting for its dependencies (the row,
/// with what it waits for in its link).
pub fn waiting_key(root: &str, workflow: &str, step: &str) -> String {
    let mut key = waiting_prefix(root);
    encode_str(workflow, &mut key);
    key.push(SEPARATOR);
    encode_str(step, &mut key);
    key
}

/// `workflow:`, the prefix of every workflow's record.
pub fn workflow_prefix() -> String {
    "workflow:".to_string()
}

/// `workflow:{id}`: a workflow's record (JSON: when it was published, how many steps).
pub fn workflow_key(id: &str) -> String {
    let mut key = workflow_prefix();
    encode_str(id, &mut key);
    key
}

/// `workflow-step:{id}:`, the prefix of a workflow's step records.
pub fn workflow_step_prefix(id: &str) -> String {
    let mut key = "workflow-step:".to_string();
    encode_str(id, &mut key);
    key.push(SEPARATOR);
    key
}

/// `workflow-step:{id}:{step}`: a step's record (JSON: its queue, event id, dependencies and
/// failure rule).
pub fn workflow_step_key(id: &str, step: &str) -> String {
    let mut key = workflow_step_prefix(id);
    encode_str(step, &mut key);
    key
}

/// `workflow-edge:{id}:`, the prefix of every edge of a workflow.
pub fn workflow_edges_prefix(id: &str) -> String {
    let mut key = "workflow-edge:".to_string();
    encode_str(id, &mut key);
    key.push(SEPARATOR);
    key
}

/// `workflow-edge:{id}:{dependency}:`, the prefix of the edges from one step to the steps
/// that wait for it.
pub fn workflow_edge_prefix(id: &str, dependency: &str) -> String {
    let mut key = workflow_edges_prefix(id);
    encode_str(dependency, &mut key);
    key.push(SEPARATOR);
    key
}

/// `workflow-edge:{id}:{dependency}:{step}`: `step` waits for `dependency` (JSON: the waiting
/// row's key, its queue and partition count); deleted when the dependency's end was applied.
pub fn workflow_edge_key(id: &str, dependency: &str, step: &str) -> String {
    let mut key = workflow_edge_prefix(id, dependency);
    encode_str(step, &mut key);
    key
}

/// `batch:`, the prefix of every batch's record.
pub fn batch_prefix() -> String {
    "batch:".to_string()
}

/// `batch:{id}`: a batch's record (JSON: closed, how many shards have open children, the
/// callbacks and which fired).
pub fn batch_key(id: &str) -> String {
    let mut key = batch_prefix();
    encode_str(id, &mut key);
    key
}

/// `batch-shard:{id}:`, the prefix of a batch's shard counters.
pub fn batch_shard_prefix(id: &str) -> String {
    let mut key = "batch-shard:".to_string();
    encode_str(id, &mut key);
    key.push(SEPARATOR);
    key
}

/// `batch-shard:{id}:{shard:04}`: the counts of a batch's children in one shard (a child's
/// shard is its partition, so children of one shard end under one worker's lease and their
/// counts never contend across workers).
pub fn batch_shard_key(id: &str, shard: u32) -> String {
    format!("{}{shard:04}", batch_shard_prefix(id))
}

/// `graph-end:`, the prefix of every graph end not folded yet.
pub fn graph_ends_prefix() -> String {
    "graph-end:".to_string()
}

/// `graph-end:{kind}:{id}:`, the prefix of the ends of one graph not folded yet (`kind`: `b`
/// for a batch, `w` for a workflow).
pub fn graph_end_prefix(kind: char, id: &str) -> String {
    let mut key = graph_ends_prefix();
    key.push(kind);
    key.push(SEPARATOR);
    encode_str(id, &mut key);
    key.push(SEPARATOR);
    key
}

/// `graph-end:{kind}:{id}:{version:020}:{member}`: a batch child's or a workflow step's end,
/// written by the transaction that ended it (`version` its start version), deleted by the
/// transaction that folds it into its graph (`member`: a batch child's queue and event id, a
/// workflow step's name).
pub fn graph_end_key(kind: char, id: &str, version: u64, member: &[&str]) -> String {
    let mut key = graph_end_prefix(kind, id);
    key.push_str(&format!("{version:020}"));
    for segment in member {
        key.push(SEPARATOR);
        encode_bounded(segment, &mut key);
    }
    key
}

/// The graph a `graph-end:` key belongs to: its kind and id.
pub fn graph_of_end_key(key: &[u8]) -> Option<(char, String)> {
    let rest = std::str::from_utf8(key).ok()?.strip_prefix("graph-end:")?;
    let mut chars = rest.chars();
    let kind = chars.next()?;
    let rest = chars.as_str().strip_prefix(SEPARATOR)?;
    let (id, _) = rest.split_once(SEPARATOR)?;
    Some((kind, decode_str(id).ok()?))
}

/// `batch-closed:{id}`: written by the close of a batch (empty value); additions lock it.
pub fn batch_closed_key(id: &str) -> String {
    let mut key = "batch-closed:".to_string();
    encode_str(id, &mut key);
    key
}

/// `batch-child:{id}:`, the prefix of a batch's children.
pub fn batch_child_prefix(id: &str) -> String {
    let mut key = "batch-child:".to_string();
    encode_str(id, &mut key);
    key.push(SEPARATOR);
    key
}

/// `batch-child:{id}:{queue}:{event id}`: a child of a batch, kept until the batch expires
/// (JSON: its queue and event id; the event id segment is bounded, see [`encode_bounded`]).
pub fn batch_child_key(id: &str, root: &str, event_id: &str) -> String {
    let mut key = batch_child_prefix(id);
    encode_str(root, &mut key);
    key.push(SEPARATOR);
    encode_bounded(event_id, &mut key);
    key
}

/// The lease key of a partition.
pub fn lease_key(root: &str, partition: u32) -> String {
    format!("{root}:lease:{partition:04}")
}

/// A partition lease's fence slot `slot`: each transaction of the holder that applies outcomes
/// locks a slot no other transaction of the holder has at that time, and a takeover or a
/// release writes every slot the holder may use (see `queue::lease`).
pub fn lease_fence_key(root: &str, partition: u32, slot: u32) -> String {
    format!("{root}:lease-fence:{partition:04}:{slot:04}")
}

/// The expiry key of a standalone partition lease: renewals write it, never the holder key.
pub fn lease_expiry_key(root: &str, partition: u32) -> String {
    format!("{root}:lease-expiry:{partition:04}")
}

/// `{queue}:node:{id}`, a cluster node's record.
pub fn node_key(root: &str, id: &str) -> String {
    let mut key = node_prefix(root);
    encode_str(id, &mut key);
    key
}

/// `{queue}:node:`, every node record of a queue's cluster.
pub fn node_prefix(root: &str) -> String {
    format!("{root}:node:")
}

/// `{queue}:coordinator`, the cluster coordinator's lease.
pub fn coordinator_key(root: &str) -> String {
    format!("{root}:coordinator")
}

/// `{queue}:members`, the member list the coordinator publishes.
pub fn members_key(root: &str) -> String {
    format!("{root}:members")
}

/// `{queue}:event:{id}`: names the live invocation (its storage key) of one event id.
pub fn event_id_key(root: &str, id: &str) -> String {
    let mut key = format!("{root}:event:");
    encode_str(id, &mut key);
    key
}

/// `{queue}:moved:{id}`: the invocation of this event id was moved later by a rate limit (its
/// row keeps its own due time); when the limits change, moved rows return to it.
pub fn moved_key(root: &str, id: &str) -> String {
    let mut key = moved_prefix(root);
    encode_str(id, &mut key);
    key
}

/// `{queue}:moved:`, every row a rate limit moved.
pub fn moved_prefix(root: &str) -> String {
    format!("{root}:moved:")
}

/// The key holding a queue's partition count.
pub fn queue_meta_key(root: &str) -> String {
    format!("{root}:meta")
}

/// A pending key's suffix (partition, due time, version, event id) under another state of the
/// same queue: `{queue}:{state}:{suffix}`.
fn pending_twin(root: &str, state: &str, pending_key: &str) -> TitoResult<String> {
    let suffix = pending_key
        .strip_prefix(root)
        .and_then(|r| r.strip_prefix(":pending:"))
        .ok_or_else(|| {
            TitoError::invalid_argument(format!(
                "{pending_key:?} is not a pending key of queue {root:?}"
            ))
        })?;
    Ok(format!("{root}:{state}:{suffix}"))
}

/// `{queue}:undecodable:{partition:04}:{timestamp:020}:{version:020}:{event_id}`: a worker's
/// note that the pending row `pending_key` does not decode as its handler's type. A pending key
/// within a few bytes of the key limit has its note under `{queue}:undecodable:;>{hash}`
/// instead (the note's value then names the row: see [`undecodable_target`]).
pub fn undecodable_key(root: &str, pending_key: &str) -> TitoResult<String> {
    let twin = pending_twin(root, "undecodable", pending_key)?;
    if twin.len() <= MAX_KEY_BYTES {
        return Ok(twin);
    }
    Ok(format!(
        "{}{HASHED_NOTE}{:032x}",
        undecodable_prefix(root),
        fnv1a_128(pending_key.as_bytes())
    ))
}

/// What stands after the prefix of an undecodable note whose key is hashed.
const HASHED_NOTE: &str = ";>";

/// Whether an undecodable note's key is hashed (its value names the row).
pub fn undecodable_key_is_hashed(root: &str, note_key: &str) -> bool {
    note_key
        .strip_prefix(&undecodable_prefix(root))
        .is_some_and(|rest| rest.starts_with(HASHED_NOTE))
}

/// `{queue}:undecodable:`, every undecodable note of a queue.
pub fn undecodable_prefix(root: &str) -> String {
    format!("{root}:undecodable:")
}

/// The pending key an undecodable note is about.
pub fn undecodable_target(root: &str, note_key: &str) -> TitoResult<String> {
    let suffix = note_key
        .strip_prefix(&undecodable_prefix(root))
        .ok_or_else(|| {
            TitoError::Integrity(format!(
                "{note_key:?} is not an undecodable note of queue {root:?}"
            ))
        })?;
    Ok(format!("{root}:pending:{suffix}"))
}

/// `{queue}:aside:{partition:04}:{timestamp:020}:{version:020}:{event_id}`: a pending row moved
/// aside by an operator.
pub fn aside_key(root: &str, pending_key: &str) -> TitoResult<String> {
    pending_twin(root, "aside", pending_key)
}

/// `{queue}:paused:all` (the whole queue) or `{queue}:paused:{partition:04}`: a pause record.
pub fn paused_key(root: &str, partition: Option<u32>) -> String {
    match partition {
        None => format!("{root}:paused:all"),
        Some(partition) => format!("{root}:paused:{partition:04}"),
    }
}

/// `{queue}:periodic:{name}`: a periodic schedule's cursor (the last tick published).
pub fn periodic_key(root: &str, schedule: &str) -> String {
    let mut key = format!("{root}:periodic:");
    encode_str(schedule, &mut key);
    key
}

/// `{queue}:limits`: the queue's stored limits (JSON).
pub fn limits_key(root: &str) -> String {
    format!("{root}:limits")
}

/// `{queue}:running:all:{slot:04}`: one of the queue-wide concurrency slots.
pub fn queue_slot_key(root: &str, slot: u32) -> String {
    format!("{root}:running:all:{slot:04}")
}

/// `{queue}:running:key:{key}:{slot:04}`: one of a business key's concurrency slots.
pub fn key_slot_key(root: &str, key: &str, slot: u32) -> String {
    let mut out = format!("{root}:running:key:");
    encode_bounded(key, &mut out);
    out.push_str(&format!(":{slot:04}"));
    out
}

/// `{queue}:running:`, every concurrency slot of a queue.
pub fn slots_prefix(root: &str) -> String {
    format!("{root}:running:")
}

/// `{queue}:rate:all`: the queue-wide rate limit's log of recent starts.
pub fn queue_rate_key(root: &str) -> String {
    format!("{root}:rate:all")
}

/// `{queue}:rate:key:{key}`: a business key's log of recent starts.
pub fn key_rate_key(root: &str, key: &str) -> String {
    let mut out = format!("{root}:rate:key:");
    encode_bounded(key, &mut out);
    out
}

/// `{queue}:worker:{id}`: a standalone worker's heartbeat (the version it expires at), which
/// keeps the concurrency slots it holds.
pub fn worker_heartbeat_key(root: &str, worker: &str) -> String {
    let mut out = format!("{root}:worker:");
    encode_bounded(worker, &mut out);
    out
}

/// `{queue}:unique:{key}`: the publication that holds a unique key (JSON: id, until).
pub fn unique_key(root: &str, key: &str) -> String {
    let mut out = format!("{root}:unique:");
    encode_str(key, &mut out);
    out
}

/// `{queue}:unique-exp:`, the expiry index of a queue's unique keys.
pub fn unique_exp_prefix(root: &str) -> String {
    format!("{root}:unique-exp:")
}

/// `{queue}:unique-exp:{until_ms:020}:{key}`: a unique key's record expires at `until_ms`.
pub fn unique_exp_key(root: &str, until_ms: u64, key: &str) -> String {
    let mut out = format!("{root}:unique-exp:{until_ms:020}:");
    encode_str(key, &mut out);
    out
}

/// The expiry and the unique key of an expiry index key (`None`: not one).
pub fn parse_unique_exp_key(root: &str, key: &str) -> Option<(u64, String)> {
    let rest = key.strip_prefix(&unique_exp_prefix(root))?;
    let (until, key) = rest.split_once(':')?;
    if until.len() != 20 {
        return None;
    }
    Some((until.parse().ok()?, decode_str(key).ok()?))
}

/// `{queue}:paused:`, every pause record of a queue.
pub fn paused_prefix(root: &str) -> String {
    format!("{root}:paused:")
}

/// The partition a pause record names (`None`: the whole queue).
pub fn parse_paused_key(root: &str, key: &[u8]) -> TitoResult<Option<u32>> {
    let bad = || TitoError::Integrity(format!("{} is not a pause record's key", display_key(key)));
    let rest = key_str(key)
        .ok()
        .and_then(|text| text.strip_prefix(&paused_prefix(root)))
        .ok_or_else(bad)?;
    if rest == "all" {
        return Ok(None);
    }
    if rest.len() != 4 || !rest.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    rest.parse().map(Some).map_err(|_| bad())
}

/// `{queue}:aside:`, every row a queue moved aside.
pub fn aside_prefix(root: &str) -> String {
    format!("{root}:aside:")
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

/// Unpadded base64url (RFC 4648 section 5).
pub fn base64url(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, b)| acc | (u32::from(*b) << (16 - 8 * i)));
        let chars = chunk.len() + 1;
        for i in 0..chars {
            out.push(B64[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

/// Decodes unpadded base64url; `None` on anything else.
pub fn base64url_decode(text: &str) -> Option<Vec<u8>> {
    let value = |c: u8| B64.iter().position(|&b| b == c).map(|v| v as u32);
    let bytes = text.as_bytes();
    if bytes.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= value(c)? << (18 - 6 * i);
        }
        for i in 0..chunk.len() - 1 {
            out.push((n >> (16 - 8 * i)) as u8);
        }
    }
    Some(out)
}

// ---------------------------------------------------------------------------------------------
// Inbox keys: outside every model's key range (never under `table:`, `index:` or `unique:`).
//
// inbox-bad:{table}:{id}       a row set aside because it does not decode (value: why)
// inbox-lease:{table}:{id}     a claim's lease, for models without a `locked_until` role
//                              (value: the lease's end, Unix ms, as decimal text)
// ---------------------------------------------------------------------------------------------

/// `inbox-bad:{table}:`, the set-aside markers of one inbox.
pub fn inbox_bad_prefix(table: &str) -> String {
    KeyBuilder::new().raw("inbox-bad").string(table).prefix()
}

/// `inbox-bad:{table}:{id}`.
pub fn inbox_bad_key(table: &str, id: &str) -> String {
    KeyBuilder::new()
        .raw("inbox-bad")
        .string(table)
        .string(id)
        .finish()
}

/// `inbox-lease:{table}:{id}`.
pub fn inbox_lease_key(table: &str, id: &str) -> String {
    KeyBuilder::new()
        .raw("inbox-lease")
        .string(table)
        .string(id)
        .finish()
}

// ---------------------------------------------------------------------------------------------
// Key/value store keys
//
// kv:{namespace}:{key}                          a value (JSON with its version and expiry)
// kv-exp:{expires_ms:020}:{namespace}:{key}     the expiry index the sweeper reads
// ---------------------------------------------------------------------------------------------

/// `kv:{namespace}:`, every key of a namespace.
pub fn kv_namespace_prefix(namespace: &str) -> String {
    KeyBuilder::new().raw("kv").string(namespace).prefix()
}

/// The storage key of a kv entry. The encoding keeps byte order and prefixes: the storage keys
/// of keys starting with `p` start with `kv_key(namespace, p)`.
pub fn kv_key(namespace: &str, key: &str) -> String {
    let mut out = kv_namespace_prefix(namespace);
    encode_str(key, &mut out);
    out
}

/// The kv key stored at a storage key of `namespace`.
pub fn kv_key_name(namespace: &str, storage_key: &str) -> TitoResult<String> {
    let prefix = kv_namespace_prefix(namespace);
    let encoded = storage_key.strip_prefix(&prefix).ok_or_else(|| {
        TitoError::Integrity(format!("{storage_key:?} is not a kv key of {namespace:?}"))
    })?;
    decode_str(encoded)
}

/// The expiry index entry of a kv key.
pub fn kv_expiry_key(expires_ms: u64, namespace: &str, key: &str) -> String {
    KeyBuilder::new()
        .raw("kv-exp")
        .u64(expires_ms)
        .string(namespace)
        .string(key)
        .finish()
}

/// `kv-exp:`, the whole expiry index.
pub fn kv_expiry_prefix() -> String {
    "kv-exp:".to_string()
}

/// Expiry index entries of keys expiring before `ms` sort below this.
pub fn kv_expiry_before(ms: u64) -> String {
    KeyBuilder::new().raw("kv-exp").u64(ms).prefix()
}

/// `(expires_ms, namespace, key)` of an expiry index entry.
pub fn parse_kv_expiry_key(key: &str) -> TitoResult<(u64, String, String)> {
    let malformed = || TitoError::Integrity(format!("kv expiry key {key:?} is malformed"));
    let mut parts = key.splitn(4, SEPARATOR);
    if parts.next() != Some("kv-exp") {
        return Err(malformed());
    }
    let exp = decode_u64(parts.next().ok_or_else(malformed)?)?;
    let namespace = decode_str(parts.next().ok_or_else(malformed)?)?;
    let name = decode_str(parts.next().ok_or_else(malformed)?)?;
    Ok((exp, namespace, name))
}

// ---------------------------------------------------------------------------------------------
// Commit markers: transactions that resolve unknown commit outcomes (`engine` module docs)
//
// commit-marker:{bucket:02}:{start_version:020}:{nonce:016x}
//     written by the transaction itself, value `committed`, or by a resolution that proved the
//     transaction can no longer commit, value `fenced`. The bucket (nonce mod 16) spreads the
//     markers of concurrent transactions over 16 ranges instead of one hot tail of the key
//     space (on TiKV, one region); the start version orders a bucket by time for the sweep.
// ---------------------------------------------------------------------------------------------

/// How many ranges commit markers are spread over.
pub const COMMIT_MARKER_BUCKETS: u32 = 16;

/// The marker of the transaction with this start version and nonce.
pub fn commit_marker_key(start_version: u64, nonce: u64) -> String {
    let bucket = (nonce % u64::from(COMMIT_MARKER_BUCKETS)) as u32;
    format!("commit-marker:{bucket:02}:{start_version:020}:{nonce:016x}")
}

/// `commit-marker:{bucket:02}:`, every marker of one bucket.
pub fn commit_marker_bucket_prefix(bucket: u32) -> String {
    format!("commit-marker:{bucket:02}:")
}

/// Markers of `bucket` written by transactions that started before `version` sort below this.
pub fn commit_marker_before(bucket: u32, version: u64) -> String {
    format!("commit-marker:{bucket:02}:{version:020}:")
}

/// `(bucket, start_version, nonce)` of a commit marker key.
pub fn parse_commit_marker_key(key: &str) -> TitoResult<(u32, u64, u64)> {
    let malformed = || TitoError::Integrity(format!("commit marker key {key:?} is malformed"));
    let mut parts = key.split(SEPARATOR);
    if parts.next() != Some("commit-marker") {
        return Err(malformed());
    }
    let bucket = parts
        .next()
        .filter(|s| s.len() == 2 && s.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|s| s.parse::<u32>().ok())
        .filter(|b| *b < COMMIT_MARKER_BUCKETS)
        .ok_or_else(malformed)?;
    let version = decode_u64(parts.next().ok_or_else(malformed)?)?;
    let nonce = parts
        .next()
        .filter(|s| s.len() == 16 && s.bytes().all(|b| b.is_ascii_hexdigit()))
        .and_then(|s| u64::from_str_radix(s, 16).ok())
        .ok_or_else(malformed)?;
    if parts.next().is_some() || u64::from(bucket) != nonce % u64::from(COMMIT_MARKER_BUCKETS) {
        return Err(malformed());
    }
    Ok((bucket, version, nonce))
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_root_names_its_queue_as_written() {
        assert_eq!(queue_name(&queue_root(None)), "default");
        assert_eq!(queue_name(&queue_root(Some("mail:out"))), "mail:out");
        assert_eq!(queue_name(&queue_root(Some("é;x"))), "é;x");
    }
    use super::*;
    use proptest::prelude::*;

    fn s(value: &str) -> String {
        let mut out = String::new();
        encode_str(value, &mut out);
        out
    }

    #[test]
    fn prefix_end_advances_the_last_character() {
        assert_eq!(prefix_end("abc:".into()), "abc;");
        assert_eq!(prefix_end("a".into()), "b");
        assert_eq!(prefix_end("".into()), "");
        assert_eq!(prefix_end(format!("a{}", char::MAX)), "b");
        assert_eq!(prefix_end("\u{D7FF}".into()), "\u{E000}");
        #[allow(deprecated)]
        let alias = next_string_lexicographically("abc:".into());
        assert_eq!(alias, "abc;");
    }

    #[test]
    fn printed_keys_tell_invalid_bytes_apart() {
        let (a, b) = (
            display_key(&[0xff, 0x01, b'k']),
            display_key(&[0xfe, 0x01, b'k']),
        );
        assert_eq!(a, "\"\\xff\\u{1}k\"");
        assert_ne!(a, b);
        // UTF-8 keys print as before: as Rust writes a string.
        assert_eq!(display_key(b"queue:lease:0000"), "\"queue:lease:0000\"");
        assert_eq!(
            display_key("a\"b\\c'é\n".as_bytes()),
            format!("{:?}", "a\"b\\c'é\n")
        );
        assert_eq!(
            parse_display_key("\"\\xff\\u{1}k\""),
            Some(vec![0xff, 0x01, b'k'])
        );
        assert_eq!(parse_display_key("no quotes"), None);
        assert_eq!(parse_display_key("\"a\"b\""), None);
    }

    #[test]
    fn key_after_does_not_skip_longer_keys() {
        // Continuing after `a2` must still see `a20`: key_after does, prefix_end does not.
        let keys = ["a2", "a20", "a3"];
        let after = key_after("a2".into());
        let visible: Vec<_> = keys.iter().filter(|k| **k >= after.as_str()).collect();
        assert_eq!(visible, [&"a20", &"a3"]);
        let wrong = prefix_end("a2".into());
        let skipped: Vec<_> = keys.iter().filter(|k| **k >= wrong.as_str()).collect();
        assert_eq!(skipped, [&"a3"], "prefix_end jumps over a20");
    }

    #[test]
    fn string_escapes_keep_values_apart() {
        assert_eq!(s("ab"), "ab");
        assert_eq!(s("a:b"), "a;<b");
        assert_eq!(s("a;b"), "a;=b");
        assert_eq!(s("a-1"), "a;-;1");
        assert_eq!(s("é"), "é");
        // The prefix of `ab` never matches `ab:c`.
        let prefix = format!("{}:", s("ab"));
        assert!(!format!("{}:", s("ab:c")).starts_with(&prefix));
        assert!(decode_str("a;").is_err());
        assert!(decode_str("a:b").is_err());
        assert!(decode_str("a;zb").is_err());
    }

    #[test]
    fn numbers_have_fixed_width() {
        let mut out = String::new();
        encode_i64(-1, &mut out);
        assert_eq!(out, "09223372036854775807");
        assert!(decode_u64("12").is_err());
        assert!(encode_f64(f64::NAN, &mut String::new()).is_err());
    }

    fn terminated(encoded: String) -> String {
        format!("{encoded}:tail")
    }

    proptest! {
        /// Defect 10: every key parser returns an error on arbitrary text, never panics.
        #[test]
        fn key_parsers_never_panic(text in ".{0,80}", bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..80)) {
            for candidate in [text.clone(), format!("queue:pending:{text}"), format!("kv-exp:{text}"),
                              format!("queue:owner:{text}"), format!("index:{text}:table:{text}"),
                              format!("commit-marker:{text}")] {
                let _ = decode_str(&candidate);
                let _ = decode_u64(&candidate);
                let _ = decode_i64(&candidate);
                let _ = decode_f64(&candidate);
                let _ = decode_bool(&candidate);
                let _ = decode_timestamp(&candidate);
                let _ = parse_pending_key("queue", &candidate);
                let _ = owner_key_target(&candidate);
                let _ = kv_key_name("ns", &candidate);
                let _ = parse_kv_expiry_key(&candidate);
                let _ = index_key_row(&candidate);
                let _ = is_index_key_of(&candidate, "t", "1");
                let _ = is_claim_key_of(&candidate, "t");
                let _ = parse_commit_marker_key(&candidate);
                let _ = index_name_of(&candidate, "t");
                let _ = row_key_id(&candidate, "t");
            }
            let _ = key_str(&bytes);
            let _ = base64url_decode(&text);
            let _ = display_key(&bytes);
        }

        /// Round-six defect 3: a printed key reads back as its bytes, so two keys never print
        /// the same.
        #[test]
        fn printed_keys_read_back_as_their_bytes(
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..40),
            text in ".{0,40}",
        ) {
            prop_assert_eq!(parse_display_key(&display_key(&bytes)), Some(bytes.clone()));
            prop_assert_eq!(parse_display_key(&display_key(text.as_bytes())), Some(text.as_bytes().to_vec()));
            let _ = parse_display_key(&text);
        }

        #[test]
        fn commit_markers_round_trip_and_sort_by_version(a: u64, b: u64, nonce: u64) {
            let key = commit_marker_key(a, nonce);
            let bucket = (nonce % u64::from(COMMIT_MARKER_BUCKETS)) as u32;
            prop_assert_eq!(parse_commit_marker_key(&key).unwrap(), (bucket, a, nonce));
            prop_assert!(key.starts_with(&commit_marker_bucket_prefix(bucket)));
            // The sweep's bound: below it exactly when the marker's version is older.
            prop_assert_eq!(key < commit_marker_before(bucket, b), a < b);
        }

        #[test]
        fn string_round_trip_and_order(a in ".*", b in ".*") {
            prop_assert_eq!(decode_str(&s(&a)).unwrap(), a.clone());
            prop_assert!(!s(&a).contains(':'));
            prop_assert_eq!(a.cmp(&b), terminated(s(&a)).cmp(&terminated(s(&b))));
        }

        #[test]
        fn ascii_string_order(a in "[ -~]{0,6}", b in "[ -~]{0,6}") {
            // Printable ASCII around the separator and escape bytes, where order is hardest.
            prop_assert_eq!(a.cmp(&b), terminated(s(&a)).cmp(&terminated(s(&b))));
        }

        #[test]
        fn u64_round_trip_and_order(a: u64, b: u64) {
            let (mut x, mut y) = (String::new(), String::new());
            encode_u64(a, &mut x);
            encode_u64(b, &mut y);
            prop_assert_eq!(decode_u64(&x).unwrap(), a);
            prop_assert_eq!(a.cmp(&b), x.cmp(&y));
        }

        #[test]
        fn i64_round_trip_and_order(a: i64, b: i64) {
            let (mut x, mut y) = (String::new(), String::new());
            encode_i64(a, &mut x);
            encode_i64(b, &mut y);
            prop_assert_eq!(decode_i64(&x).unwrap(), a);
            prop_assert_eq!(a.cmp(&b), x.cmp(&y));
        }

        #[test]
        fn f64_round_trip_and_order(a in proptest::num::f64::ANY, b in proptest::num::f64::ANY) {
            prop_assume!(!a.is_nan() && !b.is_nan());
            let (mut x, mut y) = (String::new(), String::new());
            encode_f64(a, &mut x).unwrap();
            encode_f64(b, &mut y).unwrap();
            prop_assert_eq!(decode_f64(&x).unwrap(), a);
            prop_assert_eq!(a.partial_cmp(&b).unwrap(), x.cmp(&y));
        }

        #[test]
        fn bool_order(a: bool, b: bool) {
            let (mut x, mut y) = (String::new(), String::new());
            encode_bool(a, &mut x);
            encode_bool(b, &mut y);
            prop_assert_eq!(decode_bool(&x).unwrap(), a);
            prop_assert_eq!(a.cmp(&b), terminated(x).cmp(&terminated(y)));
        }

        #[test]
        fn timestamp_round_trip_and_order(
            a_secs in -62_135_596_800i64..253_402_300_799i64, a_nanos in 0u32..1_000_000_000,
            b_secs in -62_135_596_800i64..253_402_300_799i64, b_nanos in 0u32..1_000_000_000,
        ) {
            let a = DateTime::from_timestamp(a_secs, a_nanos).unwrap();
            let b = DateTime::from_timestamp(b_secs, b_nanos).unwrap();
            let (mut x, mut y) = (String::new(), String::new());
            encode_timestamp(&a, &mut x);
            encode_timestamp(&b, &mut y);
            prop_assert_eq!(decode_timestamp(&x).unwrap(), a);
            prop_assert_eq!(a.cmp(&b), x.cmp(&y));
        }

        /// The allocation-free check of an index entry agrees with decoding it.
        #[test]
        fn index_entry_check_agrees_with_decoding(
            table in "[a-z:;1]{1,6}",
            other in "[a-z:;1]{1,6}",
            id in ".{0,8}",
            tail in "[a-z:;<=0-9]{0,12}",
        ) {
            let prefix = table_prefix(&table);
            let mut candidates = vec![
                index_key("ix", &[("f", &KeyValue::Bool(true))], &table, &id).unwrap(),
                index_key("ix", &[("f", &KeyValue::Bool(true))], &other, &id).unwrap(),
                format!("index:{tail}"),
                format!("{tail}:table:{tail}"),
                format!("table:{}:{tail}", {
                    let mut t = String::new();
                    encode_str(&table, &mut t);
                    t
                }),
            ];
            candidates.push(format!("x:{}{tail}", prefix));
            for candidate in candidates {
                let decoded = index_key_row(&candidate);
                let checked = check_index_key_in(&candidate, &prefix);
                let expected = matches!(&decoded, Ok((t, _)) if *t == table);
                prop_assert_eq!(checked.is_ok(), expected, "{:?}: {:?}", candidate, decoded);
                if let Ok(segment) = checked {
                    prop_assert_eq!(decode_str(segment).unwrap(), decoded.unwrap().1);
                }
            }
        }

        #[test]
        fn check_str_agrees_with_decode_str(text in "[a-z:;<=0-9\\x00-\\x3b]{0,10}") {
            prop_assert_eq!(check_str(&text).is_ok(), decode_str(&text).is_ok());
        }

        #[test]
        fn prefix_end_bounds_every_extension(prefix in ".{0,8}", rest in ".{0,8}") {
            let end = prefix_end(prefix.clone());
            let key = format!("{prefix}{rest}");
            prop_assert!(end.is_empty() || key < end);
        }
    }

    #[test]
    fn model_keys_follow_the_layout() {
        assert_eq!(row_key("user", "a:1"), "table:user:a;<;1");
        assert_eq!(table_prefix("user"), "table:user:");
        assert_eq!(manifest_key("user", "7"), "reverse-index:table:user:;7");
        let email = KeyValue::String("x@y".into());
        let key = index_key("by_email", &[("email", &email)], "user", "7").unwrap();
        assert_eq!(key, "index:user:by_email:email:x@y:table:user:;7");
        assert!(key.starts_with(&index_prefix("user", "by_email", &[("email", &email)]).unwrap()));
        assert!(is_index_key_of(&key, "user", "7"));
        assert!(!is_index_key_of(&key, "user", "17"));
        // Defect 8: another table's index of the same name is not this row's.
        let other = index_key("by_email", &[("email", &email)], "admin", "7").unwrap();
        assert!(!other.starts_with(&index_prefix("user", "by_email", &[]).unwrap()));
        assert!(!is_index_key_of(&other, "user", "7"));
        assert!(is_claim_key_of("unique:user:by_email:email:x@y", "user"));
        assert!(!is_claim_key_of("unique:user:by_email:email:x@y", "admin"));
        assert!(!is_claim_key_of("unique:user:", "user"));
        assert!(!is_index_key_of(&row_key("user", "7"), "user", "7"));
        assert_eq!(index_key_row(&key).unwrap(), ("user".into(), "7".into()));
        assert!(index_key_row("index:x").is_err());
        assert_eq!(
            unique_claim_key("user", "by_email", &[("email", &email)]).unwrap(),
            "unique:user:by_email:email:x@y"
        );
    }

    #[test]
    fn queue_keys_follow_the_layout() {
        let root = queue_root(None);
        assert_eq!(root, "queue");
        assert_eq!(queue_root(Some("user")), "queue@user");
        let key = pending_key(&root, 3, 1700000000, 42, "e:1");
        assert_eq!(
            key,
            "queue:pending:0003:00000000001700000000:00000000000000000042:e;<;1"
        );
        let parsed = parse_pending_key(&root, &key).unwrap();
        assert_eq!(
            (
                parsed.partition,
                parsed.timestamp,
                parsed.version,
                parsed.event_id.as_str()
            ),
            (3, 1700000000, 42, "e:1")
        );
        assert!(key.starts_with(&pending_bucket_prefix(&root, 3, 1700000000)));
        assert!(parse_pending_key(&root, "queue:pending:0003:17:1:x").is_err());
        assert!(parse_pending_key("queue@a", &key).is_err());
        assert_eq!(
            completed_key(&root, 9, 8, "x"),
            "queue:completed:00000000000000000009:00000000000000000008:x"
        );
        let note = undecodable_key(&root, &key).unwrap();
        assert_eq!(
            note,
            "queue:undecodable:0003:00000000001700000000:00000000000000000042:e;<;1"
        );
        assert!(note.starts_with(&undecodable_prefix(&root)));
        assert_eq!(undecodable_target(&root, &note).unwrap(), key);
        assert!(
            aside_key(&root, &key)
                .unwrap()
                .starts_with(&aside_prefix(&root))
        );
        assert!(undecodable_key("queue@a", &key).is_err());
        let owner = owner_key(&root, "user", "42", OWNER_PENDING, &key);
        assert!(owner.starts_with(&owner_prefix(&root, "user", "42")));
        assert_eq!(owner_key_target(&owner).unwrap(), key);
        // Named queues never share a prefix with each other or the default queue.
        // (every queue key is its root, `:`, and more).
        assert!(
            !pending_partition_prefix(&queue_root(Some("ab")), 0)
                .starts_with(&format!("{}:", queue_root(Some("a"))))
        );
        assert!(!queue_root(Some("pending")).starts_with("queue:"));
    }

    #[test]
    fn base64url_round_trips() {
        for input in [
            &b""[..],
            b"f",
            b"fo",
            b"foo",
            b"foob",
            b"fooba",
            b"foobar",
            &[0xff, 0xfe, 0x00],
        ] {
            assert_eq!(base64url_decode(&base64url(input)).unwrap(), input);
        }
        assert_eq!(base64url(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64url(&[0xfb, 0xff]), "-_8");
        assert!(base64url_decode("a").is_none());
        assert!(base64url_decode("a=").is_none());
    }

    #[test]
    fn kv_keys_follow_the_layout() {
        assert_eq!(kv_key("ns", "a:b"), "kv:ns:a;<b");
        assert!(kv_key("ns", "ab").starts_with(&kv_key("ns", "a")));
        assert!(!kv_key("ns2", "a").starts_with(&kv_namespace_prefix("ns")));
        assert_eq!(kv_key_name("ns", &kv_key("ns", "a:b")).unwrap(), "a:b");
        let exp = kv_expiry_key(42, "n:s", "k");
        assert_eq!(
            parse_kv_expiry_key(&exp).unwrap(),
            (42, "n:s".into(), "k".into())
        );
        assert!(exp < kv_expiry_before(43));
        assert!(exp >= kv_expiry_before(42));
    }
}
