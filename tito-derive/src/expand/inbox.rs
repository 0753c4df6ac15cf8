//! With `#[tito(inbox)]`: the `InboxModel` impl built from the field roles.

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::Ident;
use syn::spanned::Spanned;

use crate::ast::Model;

/// With `#[tito(inbox)]`: the `InboxModel` impl, and the claim index appended to `indexes()`.
pub(super) fn inbox(model: &Model, table: &str) -> (TokenStream, TokenStream) {
    if model.attrs.inbox.is_none() {
        return (TokenStream::new(), TokenStream::new());
    }
    let ident = &model.ident;
    let mut setters = Vec::new();
    let mut processed = quote!(false);
    for field in &model.fields {
        for (role, _) in &field.roles {
            let setter = Ident::new(role, Span::call_site());
            let json = &field.json_name;
            setters.push(quote!(.#setter(#json)));
            if role == "processed_at" {
                let field_ident = &field.ident;
                let ty = &field.ty;
                processed = quote_spanned! {ty.span()=>
                    <#ty as ::tito::__private::InboxTime>::is_set(&self.#field_ident)
                };
            }
        }
    }
    let claim_index = quote! {
        indexes.extend(
            <Self as ::tito::inbox::InboxModel>::inbox_spec().claim_index(#table, #processed),
        );
    };
    let inbox_impl = quote! {
        #[automatically_derived]
        impl ::tito::inbox::InboxModel for #ident {
            fn inbox_spec() -> ::tito::inbox::InboxSpec {
                ::tito::inbox::InboxSpec::new() #(#setters)*
            }
        }
    };
    (claim_index, inbox_impl)
}
