//! `#[derive(TitoModel)]`: generates `tito::TitoModelTrait` for a struct from `#[tito(...)]`
//! attributes, plus a typed query method per index. See the `tito` crate's `model` module for
//! the attribute grammar.

#![forbid(unsafe_code)]
#![warn(missing_docs)]
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

mod ast;
mod attr;
mod check;
mod expand;
mod value;

use proc_macro::TokenStream;

/// Derives `tito::TitoModelTrait` and typed index queries. See `tito::model` for the grammar.
#[proc_macro_derive(TitoModel, attributes(tito))]
pub fn derive_tito_model(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    expand::derive(&input).into()
}

/// Derives `tito::model::TitoShape` for a previous shape of a model's rows: `#[tito(version =
/// N)]`, optionally `from = "Older"` (converted with `From`) and `upgrade = "function"` (a
/// fallible conversion, `fn(Older) -> Result<Self, E: Display>`). See `tito::model::shape`.
#[proc_macro_derive(TitoShape, attributes(tito))]
pub fn derive_tito_shape(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    expand::shape::derive(&input).into()
}

/// Derives `tito::IndexValue` for a unit enum (stored as its serde name, or with
/// `#[tito(index_as = "number")]` as its number) or a newtype over an index value, so that it
/// can be an index field. See `tito::model::value`.
#[proc_macro_derive(IndexValue, attributes(tito))]
pub fn derive_index_value(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    value::derive(&input).into()
}
