//! Rules that span several attributes or fields, one function per rule. Type rules (which field
//! types can be ids, index fields or event times; the signature of a condition) are left to
//! rustc through trait bounds and typed calls that `expand` spans on the user's tokens.

use std::collections::HashSet;

use crate::ast::{Errors, Model};

/// Runs every rule; returns the index of the id field when there is exactly one.
pub fn model(model: &Model, errors: &mut Errors) -> Option<usize> {
    check_index_fields_exist(model, errors);
    check_index_field_types(model, errors);
    check_index_names_unique(model, errors);
    check_condition_versions(model, errors);
    check_event_names(model, errors);
    check_inbox_roles(model, errors);
    model.attrs.shape.check(errors);
    check_id(model, errors)
}

/// The id is the field marked `#[tito(id)]` (exactly one), or else the field named `id`.
fn check_id(model: &Model, errors: &mut Errors) -> Option<usize> {
    let marked: Vec<usize> = model
        .fields
        .iter()
        .enumerate()
        .filter(|(_, f)| f.id_attr.is_some())
        .map(|(i, _)| i)
        .collect();
    match marked.as_slice() {
        [one] => Some(*one),
        [_, rest @ ..] => {
            for &index in rest {
                let span = model.fields[index].id_attr.expect("marked");
                errors.push(syn::Error::new(
                    span,
                    "duplicate `#[tito(id)]`: a model has one id field",
                ));
            }
            None
        }
        [] => match model.fields.iter().position(|f| f.ident == "id") {
            Some(index) => Some(index),
            None => {
                errors.push(syn::Error::new_spanned(
                    &model.ident,
                    "missing `#[tito(id)]`: mark the id field, or name it `id`",
                ));
                None
            }
        },
    }
}

/// Every field an index names exists, once per index.
fn check_index_fields_exist(model: &Model, errors: &mut Errors) {
    for index in &model.attrs.indexes {
        let mut seen = HashSet::new();
        for field in &index.fields {
            if let Some(found) = model.field(field)
                && let Some(span) = found.serde_skip
            {
                errors.push(syn::Error::new(
                    span,
                    format!(
                        "field `{field}` of index `{}` is skipped by serde, so it is never stored",
                        index.name
                    ),
                ));
            }
            if model.field(field).is_none() {
                errors.push(syn::Error::new(
                    index.lit.span(),
                    format!("unknown field `{field}` in index `{}`", index.name),
                ));
            } else if !seen.insert(field) {
                errors.push(syn::Error::new(
                    index.lit.span(),
                    format!("field `{field}` appears twice in index `{}`", index.name),
                ));
            }
        }
    }
}

/// Index names are unique across `index` and `unique_index`.
fn check_index_names_unique(model: &Model, errors: &mut Errors) {
    let mut seen = HashSet::new();
    for index in &model.attrs.indexes {
        if !seen.insert(index.name.as_str()) {
            errors.push(syn::Error::new(
                index.lit.span(),
                format!("duplicate index name `{}`", index.name),
            ));
        }
    }
}

/// A `condition_version` versions a condition: an index without `condition` has none.
fn check_condition_versions(model: &Model, errors: &mut Errors) {
    for index in &model.attrs.indexes {
        if let (Some(version), None) = (&index.condition_version, &index.condition) {
            errors.push(syn::Error::new(
                version.span(),
                format!(
                    "`condition_version` needs a `condition` on index `{}`",
                    index.name
                ),
            ));
        }
    }
}

/// Event names are unique (empty ones were refused while parsing); `at` names something.
fn check_event_names(model: &Model, errors: &mut Errors) {
    let mut seen = HashSet::new();
    let mut consts: Vec<(String, String)> = Vec::new();
    for event in &model.attrs.events {
        let name = event.lit.value();
        if !name.is_empty() && !seen.insert(name.clone()) {
            errors.push(syn::Error::new(
                event.lit.span(),
                format!("duplicate event `{name}`"),
            ));
        } else if !name.is_empty() {
            let constant = crate::ast::event_const(&name);
            if let Some((other, _)) = consts.iter().find(|(_, c)| *c == constant) {
                errors.push(syn::Error::new(
                    event.lit.span(),
                    format!(
                        "events `{other}` and `{name}` would both be named `{}::{constant}`; \
                         rename one",
                        model.ident
                    ),
                ));
            }
            consts.push((name.clone(), constant));
        }
        if let Some(at) = &event.at
            && at.value().trim().is_empty()
        {
            errors.push(syn::Error::new(
                at.span(),
                "`at` is empty: name a field or a method `fn(&self) -> i64`",
            ));
        }
    }
}

/// Index fields of a type that can never be indexed (maps, sets, tuples, references...) are
/// reported here, once, at the field's type. Other types go through the `IndexValue` bound that
/// `expand` generates, so type aliases and newer supported types keep working.
fn check_index_field_types(model: &Model, errors: &mut Errors) {
    let mut reported = HashSet::new();
    for index in &model.attrs.indexes {
        for name in &index.fields {
            let Some(field) = model.field(name) else {
                continue;
            };
            if let Some(why) = never_indexable(&field.ty)
                && reported.insert(name.clone())
            {
                errors.push(syn::Error::new_spanned(
                    &field.ty,
                    format!(
                        "field `{name}` cannot be indexed: {why}; index fields are `String`, integers up to 64 bits, floats, `bool`, `chrono::DateTime<Utc>`, `uuid::Uuid`, unit enums and newtypes with `#[derive(tito::IndexValue)]`, or an `Option` or `Vec` of those"
                    ),
                ));
            }
        }
    }
}

/// Why a type can never be an index field, when that is clear from its syntax.
fn never_indexable(ty: &syn::Type) -> Option<String> {
    match ty {
        syn::Type::Path(path) => {
            let last = path.path.segments.last()?;
            let name = last.ident.to_string();
            const NEVER: &[&str] = &[
                "HashMap",
                "BTreeMap",
                "HashSet",
                "BTreeSet",
                "VecDeque",
                "LinkedList",
                "BinaryHeap",
                "Box",
                "Rc",
                "Arc",
                "Cell",
                "RefCell",
                "Mutex",
                "Value",
                "char",
                "i128",
                "u128",
            ];
            if NEVER.contains(&name.as_str()) {
                return Some(format!("`{name}` is not a supported type"));
            }
            if (name == "Option" || name == "Vec")
                && let syn::PathArguments::AngleBracketed(args) = &last.arguments
                && let Some(syn::GenericArgument::Type(inner)) = args.args.first()
            {
                return never_indexable(inner);
            }
            None
        }
        syn::Type::Paren(inner) => never_indexable(&inner.elem),
        syn::Type::Group(inner) => never_indexable(&inner.elem),
        syn::Type::Tuple(_) => Some("a tuple is not a supported type".into()),
        syn::Type::Array(_) | syn::Type::Slice(_) => {
            Some("arrays and slices are not supported; use `Vec`".into())
        }
        syn::Type::Reference(_) | syn::Type::Ptr(_) => {
            Some("references are not supported; use an owned type".into())
        }
        _ => Some("this kind of type is not supported".into()),
    }
}

/// Field roles need `#[tito(inbox)]`; each role belongs to one field.
fn check_inbox_roles(model: &Model, errors: &mut Errors) {
    let mut seen = HashSet::new();
    for field in &model.fields {
        for (role, span) in &field.roles {
            if model.attrs.inbox.is_none() {
                errors.push(syn::Error::new(
                    *span,
                    format!("the inbox role `{role}` needs `#[tito(inbox)]` on the struct"),
                ));
            } else if !seen.insert(role.clone()) {
                errors.push(syn::Error::new(
                    *span,
                    format!("duplicate inbox role `{role}`"),
                ));
            }
        }
    }
}
