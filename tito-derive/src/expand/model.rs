//! The `TitoModelTrait` impl: id, table, indexes (plain, unique, key-only, with conditions),
//! events and timestamps, with the inbox and query items added beside it.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;

use super::{index_block_type, lit_ident};
use crate::ast::{Errors, Model};

/// Everything the derive generates for a checked model (`id` is the index of its id field).
pub(super) fn expand(model: &Model, id: usize, errors: &mut Errors) -> TokenStream {
    let ident = &model.ident;
    let table = model.table();
    let id_field = &model.fields[id];
    let id_ident = &id_field.ident;
    let id_ty = &id_field.ty;
    let id_name = id_ident.to_string();
    let id_name = id_name.strip_prefix("r#").unwrap_or(&id_name);
    let id_expr = quote_spanned! {id_ty.span()=>
        <#id_ty as ::tito::__private::IdField>::to_id(&self.#id_ident)
    };

    let Indexes {
        plain,
        unique,
        mut conditions,
        key_only,
    } = indexes(model, errors);
    let value_checks = index_value_checks(model);
    let events = events(model, errors);
    let publishes_on = publishes_on(model);
    let topics = topics(model);

    let queries = super::queries::queries(model);
    let shape_items = super::shape::model_items(&model.attrs.shape);
    let (claim_index, inbox_impl) = super::inbox::inbox(model, &table);
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
        #topics

        #[automatically_derived]
        impl ::tito::model::TitoModelTrait for #ident {
            #shape_items

            const ID_FIELD: &'static str = #id_name;

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

            #publishes_on

            fn conditions(&self) -> ::std::vec::Vec<::tito::model::TitoCondition> {
                ::std::vec![#(#conditions),*]
            }

            #key_only_indexes

            #timestamps

            #value_checks
        }

        #inbox_impl

        #queries
    }
}

/// `index_value_problem`: each index field's type asked whether its serde form is its declared
/// kind of key (only derived enums can answer no), once per field.
fn index_value_checks(model: &Model) -> TokenStream {
    let mut seen = std::collections::HashSet::new();
    let checks: Vec<TokenStream> = model
        .attrs
        .indexes
        .iter()
        .flat_map(|index| index.fields.iter().map(move |f| (index, f)))
        .filter(|(_, f)| seen.insert((*f).clone()))
        .filter_map(|(index, name)| {
            let field = model.field(name)?;
            let ty = &field.ty;
            let index_name = &index.name;
            Some(quote! {
                if let ::std::option::Option::Some(problem) =
                    <#ty as ::tito::model::IndexValue>::stored_form_problem()
                {
                    return ::std::option::Option::Some(::std::format!(
                        "field `{}` of index `{}`: {}", #name, #index_name, problem
                    ));
                }
            })
        })
        .collect();
    if checks.is_empty() {
        return TokenStream::new();
    }
    quote! {
        fn index_value_problem(&self) -> ::std::option::Option<::std::string::String> {
            #(#checks)*
            ::std::option::Option::None
        }
    }
}

/// The index configs of a model, by kind: plain, unique, their conditions, the key-only ones.
struct Indexes {
    plain: Vec<TokenStream>,
    unique: Vec<TokenStream>,
    conditions: Vec<TokenStream>,
    key_only: Vec<TokenStream>,
}

/// The `TitoIndexConfig`s (and conditions) of every `index` / `unique_index` attribute.
fn indexes(model: &Model, errors: &mut Errors) -> Indexes {
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
    Indexes {
        plain,
        unique,
        conditions,
        key_only,
    }
}

/// One associated constant per event: its topic, `Topic<ModelEvent<Model>>`, named by
/// [`crate::ast::event_const`].
fn topics(model: &Model) -> TokenStream {
    let ident = &model.ident;
    let vis = &model.vis;
    let consts: Vec<TokenStream> = model
        .attrs
        .events
        .iter()
        .filter(|event| !event.lit.value().is_empty())
        .map(|event| {
            let name = event.lit.value();
            let constant = syn::Ident::new(&crate::ast::event_const(&name), event.lit.span());
            let doc = format!(
                "The `{name}` event's topic: the queue it is published to and its payload type, \
                 [`ModelEvent<{ident}>`](::tito::queue::ModelEvent). Open its queue with \
                 `{ident}::{constant}.queue(db, config)` and start workers on that; a handler \
                 of another payload type does not compile."
            );
            quote! {
                #[doc = #doc]
                #vis const #constant: ::tito::queue::Topic<::tito::queue::ModelEvent<#ident>> =
                    ::tito::queue::Topic::model_events(#name);
            }
        })
        .collect();
    if consts.is_empty() {
        return TokenStream::new();
    }
    quote! {
        #[automatically_derived]
        impl #ident {
            #(#consts)*
        }
    }
}

/// `publishes_on`, when an event limits its operations with `on = ".."`: an upsert stated as
/// `Upsert` publishes where an insert or an update would.
fn publishes_on(model: &Model) -> TokenStream {
    let arms: Vec<TokenStream> = model
        .attrs
        .events
        .iter()
        .filter_map(|event| {
            let (_, operations) = event.on.as_ref().filter(|(_, ops)| !ops.is_empty())?;
            let name = event.lit.value();
            let variants = operations
                .iter()
                .map(|v| syn::Ident::new(v, proc_macro2::Span::call_site()));
            let upsert = operations.iter().any(|v| *v == "Insert" || *v == "Update");
            Some(quote! {
                #name => ::std::matches!(operation, #(::tito::model::TitoOperation::#variants)|*)
                    || (#upsert && operation == ::tito::model::TitoOperation::Upsert),
            })
        })
        .collect();
    if arms.is_empty() {
        return TokenStream::new();
    }
    quote! {
        fn publishes_on(&self, name: &str, operation: ::tito::model::TitoOperation) -> bool {
            match name {
                #(#arms)*
                _ => true,
            }
        }
    }
}

/// The `TitoEventConfig`s of every `event` attribute, each with its timestamp expression.
fn events(model: &Model, errors: &mut Errors) -> Vec<TokenStream> {
    model.attrs.events.iter().map(|event| {
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
    }).collect()
}
