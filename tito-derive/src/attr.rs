//! Parsing of `#[tito(...)]` attributes, keeping the literal tokens for error spans.
//!
//! On the struct: `table = ".."`, `index = "name: field, field"` (optionally with
//! `condition = "method"`, `condition_version = N` and `entries = "keys"` in the same
//! attribute), `unique_index = ".."` (same form), `event =
//! ".."` (optionally with `at = "field_or_method"` and `on = "insert, delete"`), `inbox`, `manual_timestamps`. On a field:
//! `id`.

use syn::spanned::Spanned;
use syn::{Attribute, LitStr};

use crate::ast::Errors;

const TABLE: &str = "table";
const INDEX: &str = "index";
const UNIQUE_INDEX: &str = "unique_index";
const CONDITION: &str = "condition";
const CONDITION_VERSION: &str = "condition_version";
const ENTRIES: &str = "entries";
const EVENT: &str = "event";
const AT: &str = "at";
const ON: &str = "on";

/// The operations `on = ".."` may name, as written and as `TitoOperation` variants.
pub const OPERATIONS: &[(&str, &str)] = &[
    ("insert", "Insert"),
    ("update", "Update"),
    ("delete", "Delete"),
];
const ID: &str = "id";
const VERSION: &str = "version";
const FROM: &str = "from";
const UPGRADE: &str = "upgrade";
const DOWNGRADE: &str = "downgrade";
const INBOX: &str = "inbox";
const MANUAL_TIMESTAMPS: &str = "manual_timestamps";

/// The field roles of an inbox model.
pub const ROLES: &[&str] = &[
    "group",
    "priority",
    "partition_key",
    "retry_after",
    "attempt",
    "processed_at",
    "locked_until",
    "headers",
    "payload",
];

/// An index as written: `name: field, field`.
pub struct IndexSpec {
    pub lit: LitStr,
    pub name: String,
    pub fields: Vec<String>,
    pub unique: bool,
    pub condition: Option<LitStr>,
    /// `condition_version = N`: bumped when the condition's meaning changes (default 1).
    pub condition_version: Option<syn::LitInt>,
    /// `entries = "keys"`: entries hold only their key (`"copies"`, the default: a copy of the
    /// row).
    pub key_only: bool,
    /// The `entries` literal, for errors that concern it.
    pub entries: Option<LitStr>,
}

/// An event as written.
pub struct EventSpec {
    pub lit: LitStr,
    pub at: Option<LitStr>,
    /// `on = "insert, delete"`: the operations that publish the event (every one when absent),
    /// as `TitoOperation` variant names.
    pub on: Option<(LitStr, Vec<&'static str>)>,
}

/// Everything the struct's attributes say.
#[derive(Default)]
pub struct ContainerAttrs {
    /// `#[tito(inbox)]`: the model's rows are an inbox.
    pub inbox: Option<proc_macro2::Span>,
    /// `#[tito(manual_timestamps)]`: Tito never sets `created_at` / `updated_at`.
    pub manual_timestamps: Option<proc_macro2::Span>,
    pub table: Option<LitStr>,
    pub indexes: Vec<IndexSpec>,
    pub events: Vec<EventSpec>,
    pub shape: ShapeAttrs,
}

/// `version = N`, `from = "Previous"` and `upgrade = "function"`: a row shape's version and
/// where older rows come from (on a model, and on a `TitoShape`).
#[derive(Default)]
pub struct ShapeAttrs {
    pub version: Option<syn::LitInt>,
    pub from: Option<LitStr>,
    pub upgrade: Option<LitStr>,
    /// `downgrade = "function"`, on a model only: `fn(&Model) -> Previous`.
    pub downgrade: Option<LitStr>,
}

/// The highest shape version (the runtime's `tito::model::MAX_VERSION`).
const MAX_VERSION: u32 = 1_000_000;

impl ShapeAttrs {
    /// Reads `version`, `from`, `upgrade` or `downgrade` if `key` is one of them (`Ok(false)`
    /// otherwise).
    fn parse(
        &mut self,
        key: &str,
        meta: &syn::meta::ParseNestedMeta<'_>,
        errors: &mut Errors,
    ) -> syn::Result<bool> {
        match key {
            VERSION => {
                let lit = match meta.value()?.parse::<syn::Lit>()? {
                    syn::Lit::Int(lit) => lit,
                    other => {
                        // Said once, here: the version counts as given (so no "declare a
                        // version" follows), and this error stops the expansion.
                        errors.push(syn::Error::new(
                            other.span(),
                            format!(
                                "`version` is a whole number from 1 to {MAX_VERSION}, written \
                                 without quotes: `version = 2`"
                            ),
                        ));
                        syn::LitInt::new("1", other.span())
                    }
                };
                match lit.base10_parse::<u32>() {
                    Ok(v) if (1..=MAX_VERSION).contains(&v) => {}
                    _ => errors.push(syn::Error::new(
                        lit.span(),
                        format!("`version` is a whole number from 1 to {MAX_VERSION}"),
                    )),
                }
                if self.version.is_some() {
                    errors.push(syn::Error::new(lit.span(), "duplicate `version`"));
                }
                self.version = Some(lit);
            }
            FROM | UPGRADE | DOWNGRADE => {
                let lit: LitStr = meta.value()?.parse()?;
                let slot = match key {
                    FROM => &mut self.from,
                    UPGRADE => &mut self.upgrade,
                    _ => &mut self.downgrade,
                };
                if slot.is_some() {
                    errors.push(syn::Error::new(lit.span(), format!("duplicate `{key}`")));
                }
                *slot = Some(lit);
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The declared version (1 when absent or malformed).
    pub fn version_number(&self) -> u32 {
        self.version
            .as_ref()
            .and_then(|v| v.base10_parse().ok())
            .unwrap_or(1)
    }

    /// Checks how the three go together: `from` needs a version from 2, `upgrade` needs `from`,
    /// and the type and function parse.
    pub fn check(&self, errors: &mut Errors) {
        if let Some(from) = &self.from {
            if self.version_number() < 2 {
                errors.push(syn::Error::new(
                    from.span(),
                    "`from` names the previous shape of rows: declare this shape's `version = N` \
                     (2 or more) beside it",
                ));
            }
            if syn::parse_str::<syn::Type>(&from.value()).is_err() {
                errors.push(syn::Error::new(
                    from.span(),
                    format!("`{}` is not a type", from.value()),
                ));
            }
        }
        for (lit, what) in [
            (
                &self.downgrade,
                "`downgrade` converts a row into the shape `from` names",
            ),
            (&self.upgrade, "`upgrade` converts the shape `from` names"),
        ] {
            let Some(lit) = lit else { continue };
            if self.from.is_none() {
                errors.push(syn::Error::new(
                    lit.span(),
                    format!("{what}: add `from = \"Previous\"`"),
                ));
            }
            if syn::parse_str::<syn::Path>(&lit.value()).is_err() {
                errors.push(syn::Error::new(
                    lit.span(),
                    format!("`{}` is not a function path", lit.value()),
                ));
            }
        }
    }
}

/// The attributes of a `#[derive(TitoShape)]`: only `version`, `from` and `upgrade`.
pub fn shape(attrs: &[Attribute], errors: &mut Errors) -> ShapeAttrs {
    let mut out = ShapeAttrs::default();
    for attr in attrs.iter().filter(|a| is_tito(a)) {
        let result = attr.parse_nested_meta(|meta| {
            let key = meta
                .path
                .get_ident()
                .map(ToString::to_string)
                .unwrap_or_default();
            // `downgrade` is the model's: a shape is never written.
            if key != DOWNGRADE && out.parse(&key, &meta, errors)? {
                return Ok(());
            }
            Err(meta.error(format!(
                "unknown attribute `{}` of a row shape; expected `version`, `from` or `upgrade` \
                 (indexes, events and the table belong to the model)",
                path_text(&meta.path)
            )))
        });
        if let Err(err) = result {
            errors.push(err);
        }
    }
    out
}

fn is_tito(attr: &Attribute) -> bool {
    attr.path().is_ident("tito")
}

/// What the last item of one attribute was, for the modifiers that follow it.
enum Last {
    None,
    Index,
    Event,
}

pub fn container(attrs: &[Attribute], errors: &mut Errors) -> ContainerAttrs {
    let mut out = ContainerAttrs::default();
    for attr in attrs.iter().filter(|a| is_tito(a)) {
        let mut last = Last::None;
        let result = attr.parse_nested_meta(|meta| {
            let key = meta
                .path
                .get_ident()
                .map(ToString::to_string)
                .unwrap_or_default();
            match key.as_str() {
                TABLE => {
                    let lit: LitStr = meta.value()?.parse()?;
                    if lit.value().is_empty() {
                        errors.push(syn::Error::new(lit.span(), "the table name is empty"));
                    }
                    if out.table.is_some() {
                        errors.push(syn::Error::new(lit.span(), "duplicate `table`"));
                    }
                    out.table = Some(lit);
                    last = Last::None;
                }
                INDEX | UNIQUE_INDEX => {
                    if !matches!(last, Last::None) {
                        return Err(meta.error(format!(
                            "one `index`, `unique_index` or `event` per `#[tito(...)]`; put `{key}` in an attribute of its own"
                        )));
                    }
                    let lit: LitStr = meta.value()?.parse()?;
                    if let Some(spec) = parse_index(&lit, key == UNIQUE_INDEX, errors) {
                        out.indexes.push(spec);
                        last = Last::Index;
                    }
                }
                CONDITION => {
                    let lit: LitStr = meta.value()?.parse()?;
                    match (&last, out.indexes.last_mut()) {
                        (Last::Index, Some(index)) => index.condition = Some(lit),
                        _ => {
                            return Err(syn::Error::new(
                                lit.span(),
                                "`condition` belongs to an `index` or `unique_index` in the same attribute",
                            ));
                        }
                    }
                }
                CONDITION_VERSION => {
                    let lit: syn::LitInt = meta.value()?.parse()?;
                    match (&last, out.indexes.last_mut()) {
                        (Last::Index, Some(index)) => {
                            match lit.base10_parse::<u32>() {
                                Ok(0) | Err(_) => errors.push(syn::Error::new(
                                    lit.span(),
                                    "`condition_version` is a whole number from 1",
                                )),
                                Ok(_) => {}
                            }
                            index.condition_version = Some(lit);
                        }
                        _ => {
                            return Err(syn::Error::new(
                                lit.span(),
                                "`condition_version` belongs to an `index` or `unique_index` in the same attribute",
                            ));
                        }
                    }
                }
                ENTRIES => {
                    let lit: LitStr = meta.value()?.parse()?;
                    match (&last, out.indexes.last_mut()) {
                        (Last::Index, Some(index)) => {
                            if index.entries.is_some() {
                                errors.push(syn::Error::new(lit.span(), "duplicate `entries`"));
                            }
                            match lit.value().as_str() {
                                "keys" => index.key_only = true,
                                "copies" => index.key_only = false,
                                other => errors.push(syn::Error::new(
                                    lit.span(),
                                    format!(
                                        "unknown `entries = \"{other}\"`; expected \"copies\" (the \
                                         default: each entry holds a copy of the row) or \"keys\" \
                                         (entries hold only the row's key; a query reads the rows \
                                         after the entries)"
                                    ),
                                )),
                            }
                            index.entries = Some(lit);
                        }
                        _ => {
                            return Err(syn::Error::new(
                                lit.span(),
                                "`entries` belongs to an `index` or `unique_index` in the same attribute",
                            ));
                        }
                    }
                }
                EVENT => {
                    if !matches!(last, Last::None) {
                        return Err(meta.error(
                            "one `index`, `unique_index` or `event` per `#[tito(...)]`; put `event` in an attribute of its own",
                        ));
                    }
                    let lit: LitStr = meta.value()?.parse()?;
                    if lit.value().is_empty() {
                        errors.push(syn::Error::new(lit.span(), "the event name is empty"));
                    }
                    out.events.push(EventSpec {
                        lit,
                        at: None,
                        on: None,
                    });
                    last = Last::Event;
                }
                AT => {
                    let lit: LitStr = meta.value()?.parse()?;
                    match (&last, out.events.last_mut()) {
                        (Last::Event, Some(event)) => event.at = Some(lit),
                        _ => {
                            return Err(syn::Error::new(
                                lit.span(),
                                "`at` belongs to an `event` in the same attribute",
                            ));
                        }
                    }
                }
                ON => {
                    let lit: LitStr = meta.value()?.parse()?;
                    match (&last, out.events.last_mut()) {
                        (Last::Event, Some(event)) => {
                            if event.on.is_some() {
                                errors.push(syn::Error::new(lit.span(), "duplicate `on`"));
                            }
                            let operations = parse_operations(&lit, errors);
                            event.on = Some((lit, operations));
                        }
                        _ => {
                            return Err(syn::Error::new(
                                lit.span(),
                                "`on` belongs to an `event` in the same attribute",
                            ));
                        }
                    }
                }
                ID => {
                    return Err(meta.error("`id` goes on a field: `#[tito(id)] id: String`"));
                }
                VERSION | FROM | UPGRADE | DOWNGRADE => {
                    out.shape.parse(&key, &meta, errors)?;
                    last = Last::None;
                }

                INBOX => {
                    out.inbox = Some(meta.path.span());
                    last = Last::None;
                }
                MANUAL_TIMESTAMPS => {
                    out.manual_timestamps = Some(meta.path.span());
                    last = Last::None;
                }
                _ => {
                    return Err(meta.error(format!(
                        "unknown tito attribute `{}`; expected `table`, `index`, `unique_index`, `condition`, `condition_version`, `entries`, `event`, `at`, `on`, `inbox`, `manual_timestamps`, `version`, `from`, `upgrade` or `downgrade`",
                        path_text(&meta.path)
                    )));
                }
            }
            Ok(())
        });
        if let Err(err) = result {
            errors.push(err);
        }
    }
    out
}

/// The operations of `on = "insert, delete"`: a comma-separated, non-empty list of distinct
/// operation names.
fn parse_operations(lit: &LitStr, errors: &mut Errors) -> Vec<&'static str> {
    let mut out = Vec::new();
    let text = lit.value();
    for word in text.split(',').map(str::trim) {
        match OPERATIONS.iter().find(|(name, _)| *name == word) {
            Some((_, variant)) if out.contains(variant) => {
                errors.push(syn::Error::new(
                    lit.span(),
                    format!("`on` names `{word}` twice"),
                ));
            }
            Some((_, variant)) => out.push(*variant),
            None if word == "upsert" => errors.push(syn::Error::new(
                lit.span(),
                "an upsert publishes as `insert` or `update`, as its row was absent or present; \
                 list those in `on`",
            )),
            None if word.is_empty() => {
                errors.push(syn::Error::new(
                    lit.span(),
                    "`on` lists the operations that publish the event, separated by commas, e.g. \
                     `on = \"insert, delete\"`; an empty name is not one",
                ));
                return out;
            }
            None => errors.push(syn::Error::new(
                lit.span(),
                format!(
                    "unknown operation `{word}` in `on`; expected `insert`, `update` or `delete`"
                ),
            )),
        }
    }
    out
}

fn path_text(path: &syn::Path) -> String {
    path.segments
        .iter()
        .map(|s| s.ident.to_string())
        .collect::<Vec<_>>()
        .join("::")
}

fn is_identifier(text: &str) -> bool {
    let mut chars = text.chars();
    matches!(chars.next(), Some(c) if c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric())
}

/// `name: field, field`.
fn parse_index(lit: &LitStr, unique: bool, errors: &mut Errors) -> Option<IndexSpec> {
    let text = lit.value();
    let Some((name, fields)) = text.split_once(':') else {
        errors.push(syn::Error::new(
            lit.span(),
            format!("malformed index `{text}`: expected `name: field, field`"),
        ));
        return None;
    };
    let name = name.trim().to_string();
    if !is_identifier(&name) {
        errors.push(syn::Error::new(
            lit.span(),
            format!("index name `{name}` is not an identifier"),
        ));
        return None;
    }
    let fields: Vec<String> = fields
        .split(',')
        .map(|f| f.trim().to_string())
        .filter(|f| !f.is_empty())
        .collect();
    if fields.is_empty() {
        errors.push(syn::Error::new(
            lit.span(),
            format!("index `{name}` has no fields"),
        ));
        return None;
    }
    if let Some(bad) = fields.iter().find(|f| !is_identifier(f)) {
        errors.push(syn::Error::new(
            lit.span(),
            format!("malformed field `{bad}` in index `{name}`"),
        ));
        return None;
    }
    Some(IndexSpec {
        lit: lit.clone(),
        name,
        fields,
        unique,
        condition: None,
        condition_version: None,
        key_only: false,
        entries: None,
    })
}

/// What a field's `#[tito(...)]` says: `id`, and inbox roles; unknown keys are errors.
#[derive(Default)]
pub struct FieldAttrs {
    pub id: Option<proc_macro2::Span>,
    pub roles: Vec<(String, proc_macro2::Span)>,
}

pub fn field_attrs(field: &syn::Field, errors: &mut Errors) -> FieldAttrs {
    let mut found = FieldAttrs::default();
    for attr in field.attrs.iter().filter(|a| is_tito(a)) {
        let result = attr.parse_nested_meta(|meta| {
            let key = meta
                .path
                .get_ident()
                .map(ToString::to_string)
                .unwrap_or_default();
            if key == ID {
                found.id = Some(meta.path.span());
                Ok(())
            } else if ROLES.contains(&key.as_str()) {
                found.roles.push((key, meta.path.span()));
                Ok(())
            } else {
                Err(meta.error(format!(
                    "unknown tito field attribute `{}`; expected `id` or an inbox role ({})",
                    path_text(&meta.path),
                    ROLES.join(", ")
                )))
            }
        });
        if let Err(err) = result {
            errors.push(err);
        }
    }
    found
}

/// What serde's attributes say about a field, as far as the stored JSON is concerned.
#[derive(Default)]
pub struct SerdeField {
    pub rename: Option<String>,
    pub skip: Option<proc_macro2::Span>,
}

/// Reads `#[serde(rename = "..")]` (or `rename(serialize = "..")`) and `skip` /
/// `skip_serializing` on a field. Other serde keys are serde's business and are ignored.
pub fn serde_field(field: &syn::Field) -> SerdeField {
    let mut out = SerdeField::default();
    for attr in field.attrs.iter().filter(|a| a.path().is_ident("serde")) {
        let _ = attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("rename") {
                if meta.input.peek(syn::Token![=]) {
                    let lit: LitStr = meta.value()?.parse()?;
                    out.rename = Some(lit.value());
                } else {
                    meta.parse_nested_meta(|inner| {
                        if inner.path.is_ident("serialize") {
                            let lit: LitStr = inner.value()?.parse()?;
                            out.rename = Some(lit.value());
                        } else {
                            skip_value(&inner)?;
                        }
                        Ok(())
                    })?;
                }
            } else if meta.path.is_ident("skip") || meta.path.is_ident("skip_serializing") {
                out.skip = Some(meta.path.span());
            } else {
                skip_value(&meta)?;
            }
            Ok(())
        });
    }
    out
}

/// `#[serde(rename_all = "..")]` (or its `serialize` form) on the struct.
pub fn serde_rename_all(attrs: &[Attribute]) -> Option<String> {
    let mut out = None;
    for attr in attrs.iter().filter(|a| a.path().is_ident("serde")) {
        let _ = attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("rename_all") {
                if meta.input.peek(syn::Token![=]) {
                    let lit: LitStr = meta.value()?.parse()?;
                    out = Some(lit.value());
                } else {
                    meta.parse_nested_meta(|inner| {
                        if inner.path.is_ident("serialize") {
                            let lit: LitStr = inner.value()?.parse()?;
                            out = Some(lit.value());
                        } else {
                            skip_value(&inner)?;
                        }
                        Ok(())
                    })?;
                }
            } else {
                skip_value(&meta)?;
            }
            Ok(())
        });
    }
    out
}

/// Consumes whatever follows a serde key we do not read (`= value` or `(...)`).
fn skip_value(meta: &syn::meta::ParseNestedMeta<'_>) -> syn::Result<()> {
    if meta.input.peek(syn::Token![=]) {
        let _: syn::Expr = meta.value()?.parse()?;
    } else if meta.input.peek(syn::token::Paren) {
        let content;
        syn::parenthesized!(content in meta.input);
        let _: proc_macro2::TokenStream = content.parse()?;
    }
    Ok(())
}
