//! Code generation: the `TitoModelTrait` impl and the typed query trait with its stages.
//!
//! Everything generated names the runtime by absolute path (`::tito::...`) and reaches helpers
//! only through `::tito::__private`. Type rules are enforced by trait bounds spanned on the
//! user's tokens, so rustc's errors point at the field or the attribute string.

mod inbox;
mod model;
mod queries;
pub mod shape;

use proc_macro2::TokenStream;
use quote::quote;
use syn::{DeriveInput, Ident, LitStr, Type};

use crate::ast::{self, Errors};
use crate::check;

pub fn derive(input: &DeriveInput) -> TokenStream {
    let mut errors = Errors::default();
    let model = ast::parse(input, &mut errors);
    let id = model.as_ref().and_then(|m| check::model(m, &mut errors));
    if let Some(error) = errors.combined() {
        let compile_errors = error.to_compile_error();
        // A stand-in impl keeps uses of the model from failing a second time.
        let stub = match &model {
            Some(model) if input.generics.params.is_empty() => stub(&model.ident),
            _ => TokenStream::new(),
        };
        return quote! { #compile_errors #stub };
    }
    let model = model.expect("no errors means a model");
    let id = id.expect("no errors means an id");
    let mut errors = Errors::default();
    let expanded = model::expand(&model, id, &mut errors);
    match errors.combined() {
        Some(error) => {
            let compile_errors = error.to_compile_error();
            let stub = stub(&model.ident);
            quote! { #compile_errors #stub }
        }
        None => expanded,
    }
}

fn stub(ident: &Ident) -> TokenStream {
    quote! {
        #[automatically_derived]
        impl ::tito::model::TitoModelTrait for #ident {
            fn id(&self) -> ::std::string::String { ::core::unreachable!() }
            fn table(&self) -> ::std::string::String { ::core::unreachable!() }
        }
    }
}

pub(crate) fn lit_ident(lit: &LitStr, errors: &mut Errors, what: &str) -> Option<Ident> {
    let text = lit.value();
    match syn::parse_str::<Ident>(text.trim()) {
        Ok(ident) => Some(Ident::new(&ident.to_string(), lit.span())),
        Err(_) => {
            errors.push(syn::Error::new(
                lit.span(),
                format!("`{text}` is not a {what} name"),
            ));
            None
        }
    }
}

/// `<Type as IndexValue>::KIND`, spanned on the field's type so that an unsupported type
/// is reported there.
pub(crate) fn index_block_type(ty: &Type) -> TokenStream {
    quote! { <#ty as ::tito::model::IndexValue>::KIND }
}

/// The argument type of a typed query binding the field (spanned likewise).
pub(crate) fn index_arg(ty: &Type) -> TokenStream {
    quote! { <#ty as ::tito::model::IndexValue>::Arg }
}

/// The element type of a typed query range over the field (spanned likewise).
pub(crate) fn index_range_arg(ty: &Type) -> TokenStream {
    quote! { <#ty as ::tito::model::IndexValue>::RangeArg<'a> }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand_str(source: &str) -> String {
        let input: DeriveInput = syn::parse_str(source).expect("valid Rust");
        derive(&input).to_string()
    }

    #[test]
    fn generates_the_impl_and_typed_queries() {
        let out = expand_str(
            r#"
            #[tito(index = "by_team_rank: team, rank")]
            #[tito(event = "user")]
            pub struct User { id: String, team: String, rank: i64 }
            "#,
        );
        assert!(
            out.contains("impl :: tito :: model :: TitoModelTrait for User"),
            "{out}"
        );
        assert!(out.contains("pub trait UserQueries"), "{out}");
        assert!(out.contains("fn by_team_rank_range"), "{out}");
        assert!(out.contains("pub struct UserByTeamRankQuery1"), "{out}");
        assert!(out.contains("fn rank_eq"), "{out}");
        assert!(!out.contains("compile_error"), "{out}");
    }

    #[test]
    fn reports_every_mistake_and_a_stub() {
        let out = expand_str(
            r#"
            #[tito(index = "a: nope")]
            #[tito(index = "a: id")]
            #[tito(event = "")]
            struct User { email: String }
            "#,
        );
        // Unknown `nope`, unknown `id`, the duplicate `a`, the empty event, the missing id.
        assert_eq!(out.matches("compile_error").count(), 5, "{out}");
        assert!(
            out.contains("unreachable"),
            "a stub impl stops cascades: {out}"
        );
        assert!(!out.contains("Queries"), "{out}");
    }
}
