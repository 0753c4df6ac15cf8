//! The derive input as a typed model: the struct, its fields, its attributes. Original tokens are
//! kept for error spans.

use proc_macro2::Span;
use syn::{Data, DeriveInput, Fields, Ident, Type, Visibility};

use crate::attr::{self, ContainerAttrs};

/// Every mistake found, reported together.
#[derive(Default)]
pub struct Errors {
    errors: Vec<syn::Error>,
}

impl Errors {
    pub fn push(&mut self, error: syn::Error) {
        self.errors.push(error);
    }

    /// All errors combined into one, if any.
    pub fn combined(self) -> Option<syn::Error> {
        let mut iter = self.errors.into_iter();
        let mut first = iter.next()?;
        for error in iter {
            first.combine(error);
        }
        Some(first)
    }
}

pub struct Field {
    pub ident: Ident,
    pub ty: Type,
    pub id_attr: Option<Span>,
    /// Inbox roles (`#[tito(group)]`, ...).
    pub roles: Vec<(String, Span)>,
    /// The key serde writes for this field (after `rename` / `rename_all`).
    pub json_name: String,
    /// The field is not serialized (`#[serde(skip)]` or `skip_serializing`).
    pub serde_skip: Option<Span>,
}

pub struct Model {
    pub ident: Ident,
    pub vis: Visibility,
    pub fields: Vec<Field>,
    pub attrs: ContainerAttrs,
}

impl Model {
    pub fn field(&self, name: &str) -> Option<&Field> {
        self.fields.iter().find(|f| f.ident == name)
    }

    /// The table's name: the attribute, or the struct's name in snake case.
    pub fn table(&self) -> String {
        match &self.attrs.table {
            Some(lit) => lit.value(),
            None => snake_case(&self.ident.to_string()),
        }
    }
}

pub fn snake_case(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.extend(c.to_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// serde's `rename_all` rules, for a snake_case Rust field name.
fn apply_rename_rule(rule: &str, name: &str) -> String {
    match rule {
        "lowercase" => name.to_lowercase(),
        "UPPERCASE" => name.to_uppercase(),
        "PascalCase" => pascal_case(name),
        "camelCase" => {
            let pascal = pascal_case(name);
            let mut chars = pascal.chars();
            match chars.next() {
                Some(first) => first.to_lowercase().chain(chars).collect(),
                None => String::new(),
            }
        }
        "SCREAMING_SNAKE_CASE" => name.to_uppercase(),
        "kebab-case" => name.replace('_', "-"),
        "SCREAMING-KEBAB-CASE" => name.replace('_', "-").to_uppercase(),
        _ => name.to_string(),
    }
}

pub fn pascal_case(name: &str) -> String {
    name.split('_')
        .filter(|p| !p.is_empty())
        .map(|part| {
            let mut chars = part.chars();
            match chars.next() {
                Some(first) => first.to_uppercase().chain(chars).collect::<String>(),
                None => String::new(),
            }
        })
        .collect()
}

/// Reads the input; `None` when it cannot be a model at all (the error is recorded).
pub fn parse(input: &DeriveInput, errors: &mut Errors) -> Option<Model> {
    let named = match &input.data {
        Data::Struct(data) => match &data.fields {
            Fields::Named(named) => Some(named),
            Fields::Unnamed(_) | Fields::Unit => {
                errors.push(syn::Error::new_spanned(
                    &input.ident,
                    "`TitoModel` needs a struct with named fields",
                ));
                None
            }
        },
        Data::Enum(data) => {
            errors.push(syn::Error::new(
                data.enum_token.span,
                "`TitoModel` can only be derived for a struct with named fields, not an enum",
            ));
            None
        }
        Data::Union(data) => {
            errors.push(syn::Error::new(
                data.union_token.span,
                "`TitoModel` can only be derived for a struct with named fields, not a union",
            ));
            None
        }
    };
    if !input.generics.params.is_empty() {
        errors.push(syn::Error::new_spanned(
            &input.generics,
            "`TitoModel` does not support generic structs",
        ));
    }
    let attrs = attr::container(&input.attrs, errors);
    let named = named?;
    let rename_all = attr::serde_rename_all(&input.attrs);
    let fields = named
        .named
        .iter()
        .map(|field| {
            let ident = field.ident.clone().expect("named field");
            let serde = attr::serde_field(field);
            let json_name = serde.rename.unwrap_or_else(|| {
                let name = ident.to_string();
                let name = name.strip_prefix("r#").unwrap_or(&name).to_string();
                match &rename_all {
                    Some(rule) => apply_rename_rule(rule, &name),
                    None => name,
                }
            });
            let tito = attr::field_attrs(field, errors);
            Field {
                ident,
                ty: field.ty.clone(),
                id_attr: tito.id,
                roles: tito.roles,
                json_name,
                serde_skip: serde.skip,
            }
        })
        .collect();
    Some(Model {
        ident: input.ident.clone(),
        vis: input.vis.clone(),
        fields,
        attrs,
    })
}

/// The associated constant naming an event's topic: the name in upper snake case, ASCII letters
/// and digits kept, anything else an underscore, with `_EVENT` after it (`user_created` →
/// `USER_CREATED_EVENT`).
pub fn event_const(name: &str) -> String {
    let mut out: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    if out.starts_with(|c: char| c.is_ascii_digit()) {
        out.insert(0, '_');
    }
    out.push_str("_EVENT");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases() {
        assert_eq!(snake_case("UserProfile"), "user_profile");
        assert_eq!(snake_case("User"), "user");
        assert_eq!(pascal_case("by_team_created"), "ByTeamCreated");
        assert_eq!(apply_rename_rule("camelCase", "team_id"), "teamId");
        assert_eq!(apply_rename_rule("kebab-case", "team_id"), "team-id");
    }
}
