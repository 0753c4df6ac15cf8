//! Code generation: the `TitoModelTrait` impl and the typed query trait with its stages.
//!
//! Everything generated names the runtime by absolute path (`::tito::...`) and reaches helpers
//! only through `::tito::__private`. Type rules are enforced by trait bounds spanned on the
//! user's tokens, so rustc's errors point at the field or the attribute string.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{DeriveInput, Ident, LitStr, Type};

use crate::ast::{self, Errors, Model, pascal_case};
use crate::attr::IndexSpec;
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
    let expanded = expand(&model, id, &mut errors);
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

fn lit_ident(lit: &LitStr, errors: &mut Errors, what: &str) -> Option<Ident> {
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

/// `<Type as IndexField>::BLOCK_TYPE`, spanned on the field's type so that an unsupported type
/// is reported there.
fn index_block_type(ty: &Type) -> TokenStream {
    quote! { <#ty as ::tito::__private::IndexField>::BLOCK_TYPE }
}

/// The argument type of a typed query binding the field (spanned likewise).
fn index_arg(ty: &Type) -> TokenStream {
    quote! { <#ty as ::tito::__private::IndexField>::Arg }
}

/// The element type of a typed query range over the field (spanned likewise).
fn index_range_arg(ty: &Type) -> TokenStream {
    quote! { <#ty as ::tito::__private::IndexField>::RangeArg<'a> }
}

fn expand(model: &Model, id: usize, errors: &mut Errors) -> TokenStream {
    let ident = &model.ident;
    let table = model.table();
    let id_field = &model.fields[id];
    let id_ident = &id_field.ident;
    let id_ty = &id_field.ty;
    let id_expr = quote_spanned! {id_ty.span()=>
        <#id_ty as ::tito::__private::IdField>::to_id(&self.#id_ident)
    };

    let mut plain = Vec::new();
    let mut unique = Vec::new();
    let mut conditions = Vec::new();
    let mut key_only = Vec::new();
    for index in &model.attrs.indexes {
        let name = &index.name;
        if index.key_only {
            key_only.push(quote!(::std::string::String::from(#name)));
        }
        if let Some(lit) = &index.condition {
            let method = lit.value();
            let version = index
                .condition_version
                .as_ref()
                .and_then(|v| v.base10_parse::<u32>().ok())
                .unwrap_or(1);
            conditions.push(quote! {
                ::tito::model::TitoCondition {
                    index: ::std::string::String::from(#name),
                    name: ::std::string::String::from(#method),
                    version: #version,
                }
            });
        }
        let condition = match &index.condition {
            None => quote!(true),
            Some(lit) => match lit_ident(lit, errors, "method") {
                Some(method) => quote_spanned! {lit.span()=>
                    ::tito::__private::condition(self, Self::#method)
                },
                None => quote!(true),
            },
        };
        let fields = index.fields.iter().map(|field_name| {
            let field = model.field(field_name).expect("checked");
            let ty = &field.ty;
            let json_name = &field.json_name;
            let kind = index_block_type(ty);
            quote! {
                ::tito::model::TitoIndexField {
                    name: ::std::string::String::from(#json_name),
                    r#type: #kind,
                }
            }
        });
        let config = quote! {
            ::tito::model::TitoIndexConfig {
                condition: #condition,
                name: ::std::string::String::from(#name),
                fields: ::std::vec![#(#fields),*],
            }
        };
        if index.unique {
            unique.push(config);
        } else {
            plain.push(config);
        }
    }

    let events = model.attrs.events.iter().map(|event| {
        let name = event.lit.value();
        let timestamp = match &event.at {
            None => quote!(::tito::__private::now()),
            Some(at) => match model.field(at.value().trim()) {
                Some(field) => {
                    let field_ident = &field.ident;
                    let ty = &field.ty;
                    quote_spanned! {ty.span()=>
                        <#ty as ::tito::__private::EventTime>::event_timestamp(&self.#field_ident)
                    }
                }
                None => match lit_ident(at, errors, "field or method") {
                    Some(method) => quote_spanned! {at.span()=>
                        ::tito::__private::event_at(self, Self::#method)
                    },
                    None => quote!(0),
                },
            },
        };
        quote! {
            ::tito::model::TitoEventConfig {
                name: ::std::string::String::from(#name),
                timestamp: #timestamp,
            }
        }
    });

    let queries = queries(model);
    let (claim_index, inbox_impl) = inbox(model, &table);
    if model.attrs.inbox.is_some() {
        // The claim index holds unprocessed rows only: a condition of its own.
        conditions.push(quote! {
            ::tito::model::TitoCondition {
                index: ::tito::inbox::InboxSpec::claim_index_name(#table),
                name: ::std::string::String::from("inbox_unprocessed"),
                version: 1,
            }
        });
    }
    let key_only_indexes = if key_only.is_empty() {
        TokenStream::new()
    } else {
        quote! {
            fn key_only_indexes(&self) -> ::std::vec::Vec<::std::string::String> {
                ::std::vec![#(#key_only),*]
            }
        }
    };
    let timestamps = if model.attrs.manual_timestamps.is_some() {
        quote! {
            fn managed_timestamps(&self) -> bool {
                false
            }
        }
    } else {
        TokenStream::new()
    };

    quote! {
        #[automatically_derived]
        impl ::tito::model::TitoModelTrait for #ident {
            fn id(&self) -> ::std::string::String {
                #id_expr
            }

            fn table(&self) -> ::std::string::String {
                ::std::string::String::from(#table)
            }

            fn indexes(&self) -> ::std::vec::Vec<::tito::model::TitoIndexConfig> {
                #[allow(unused_mut)]
                let mut indexes = ::std::vec![#(#plain),*];
                #claim_index
                indexes
            }

            fn unique_indexes(&self) -> ::std::vec::Vec<::tito::model::TitoIndexConfig> {
                ::std::vec![#(#unique),*]
            }

            fn events(&self) -> ::std::vec::Vec<::tito::model::TitoEventConfig> {
                ::std::vec![#(#events),*]
            }

            fn conditions(&self) -> ::std::vec::Vec<::tito::model::TitoCondition> {
                ::std::vec![#(#conditions),*]
            }

            #key_only_indexes

            #timestamps
        }

        #inbox_impl

        #queries
    }
}

/// With `#[tito(inbox)]`: the `InboxModel` impl, and the claim index appended to `indexes()`.
fn inbox(model: &Model, table: &str) -> (TokenStream, TokenStream) {
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

/// The typed query trait, its impl for `TitoModel<E, Model>`, and one stage struct per bound
/// prefix of each composite index.
fn queries(model: &Model) -> TokenStream {
    let ident = &model.ident;
    let vis = &model.vis;
    let trait_ident = format_ident!("{}Queries", ident);
    let mut trait_methods = Vec::new();
    let mut impl_methods = Vec::new();
    let mut stages = Vec::new();
    for index in &model.attrs.indexes {
        let (methods, bodies, structs) = index_queries(model, index);
        trait_methods.extend(methods);
        impl_methods.extend(bodies);
        stages.extend(structs);
    }
    let trait_doc = format!(
        "Typed queries over the indexes of [`{ident}`], one method per index (generated by \
         `#[derive(TitoModel)]`). Import this trait to call them on `TitoModel<E, {ident}>`."
    );
    quote! {
        #[doc = #trait_doc]
        #vis trait #trait_ident<E: ::tito::TitoEngine> {
            #(#trait_methods)*
        }

        #[automatically_derived]
        impl<E: ::tito::TitoEngine> #trait_ident<E> for ::tito::model::TitoModel<E, #ident> {
            #(#impl_methods)*
        }

        #(#stages)*
    }
}

struct FieldInfo<'a> {
    ident: &'a Ident,
    ty: &'a Type,
}

fn index_queries(
    model: &Model,
    index: &IndexSpec,
) -> (Vec<TokenStream>, Vec<TokenStream>, Vec<TokenStream>) {
    let ident = &model.ident;
    let vis = &model.vis;
    let name = &index.name;
    let method = Ident::new(name, index.lit.span());
    let range_method = format_ident!("{}_range", method);
    let fields: Vec<FieldInfo<'_>> = index
        .fields
        .iter()
        .map(|f| {
            let field = model.field(f).expect("checked");
            FieldInfo {
                ident: &field.ident,
                ty: &field.ty,
            }
        })
        .collect();
    let query_ty = quote!(::tito::model::IndexQuery<E, #ident>);
    let stage_ident = |bound: usize| {
        format_ident!(
            "{}{}Query{}",
            ident,
            pascal_case(name),
            bound,
            span = Span::call_site()
        )
    };
    // What binding `bound` fields returns: a stage while fields remain, else the query.
    let returns = |bound: usize| -> TokenStream {
        if bound < fields.len() {
            let stage = stage_ident(bound);
            quote!(#stage<E>)
        } else {
            query_ty.clone()
        }
    };
    let wrap = |bound: usize, query: TokenStream| -> TokenStream {
        if bound < fields.len() {
            let stage = stage_ident(bound);
            quote!(#stage { query: #query })
        } else {
            query
        }
    };

    let first = &fields[0];
    let first_ident = first.ident;
    let (first_arg, first_range) = (index_arg(first.ty), index_range_arg(first.ty));
    let ret1 = returns(1);
    let body1 = wrap(1, quote!(query));
    let unique_note = if index.unique { " (unique)" } else { "" };
    let doc_eq = format!(
        "Rows of [`{ident}`] whose `{first_ident}` is `value`, through index `{name}`{unique_note}."
    );
    let doc_range = format!(
        "Rows of [`{ident}`] whose `{first_ident}` lies in `range`, through index `{name}`, in key order."
    );
    let methods = vec![quote! {
        #[doc = #doc_eq]
        fn #method(&self, value: &#first_arg) -> #ret1;
        #[doc = #doc_range]
        fn #range_method<'a, R: ::std::ops::RangeBounds<#first_range>>(&self, range: R) -> #query_ty;
    }];
    let bodies = vec![quote! {
        fn #method(&self, value: &#first_arg) -> #ret1 {
            let mut query = self.query_by_index(#name);
            query.value(value);
            #body1
        }
        fn #range_method<'a, R: ::std::ops::RangeBounds<#first_range>>(&self, range: R) -> #query_ty {
            let mut query = self.query_by_index(#name);
            query.range(range);
            query
        }
    }];

    let mut structs = Vec::new();
    for bound in 1..fields.len() {
        let stage = stage_ident(bound);
        let next = &fields[bound];
        let next_ident = next.ident;
        let eq_method = format_ident!("{}_eq", next_ident);
        let (next_arg, next_range) = (index_arg(next.ty), index_range_arg(next.ty));
        let ret = returns(bound + 1);
        let body = wrap(bound + 1, quote!(self.query));
        let bound_names = fields[..bound]
            .iter()
            .map(|f| format!("`{}`", f.ident))
            .collect::<Vec<_>>()
            .join(", ");
        let stage_doc = format!(
            "A query on index `{name}` of [`{ident}`] with {bound_names} bound. Bind `{next_ident}` \
             next, or use it as the query (limit, cursor, reverse, execute) through `Deref`."
        );
        let doc_eq = format!("Binds `{next_ident}` to `value`.");
        let doc_range =
            format!("Restricts `{next_ident}` to `range`; no further field can be bound.");
        structs.push(quote! {
            #[doc = #stage_doc]
            #vis struct #stage<E> {
                query: #query_ty,
            }

            impl<E: ::tito::TitoEngine> #stage<E> {
                #[doc = #doc_eq]
                pub fn #eq_method(mut self, value: &#next_arg) -> #ret {
                    self.query.value(value);
                    #body
                }

                #[doc = #doc_range]
                pub fn #next_ident<'a, R: ::std::ops::RangeBounds<#next_range>>(mut self, range: R) -> #query_ty {
                    self.query.range(range);
                    self.query
                }

                /// The query as built so far.
                pub fn into_query(self) -> #query_ty {
                    self.query
                }
            }

            impl<E> ::std::ops::Deref for #stage<E> {
                type Target = #query_ty;
                fn deref(&self) -> &Self::Target {
                    &self.query
                }
            }

            impl<E> ::std::ops::DerefMut for #stage<E> {
                fn deref_mut(&mut self) -> &mut Self::Target {
                    &mut self.query
                }
            }
        });
    }
    (methods, bodies, structs)
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
