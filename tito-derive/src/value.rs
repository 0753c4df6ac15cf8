//! `#[derive(IndexValue)]`: unit enums (by serde name, or by number with
//! `#[tito(index_as = "number")]`) and newtypes over an index value.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Data, DeriveInput, Fields, LitStr, Type};

const INDEX_AS: &str = "index_as";
const SIGNED: &[&str] = &["i8", "i16", "i32", "i64", "isize"];
const UNSIGNED: &[&str] = &["u8", "u16", "u32", "u64", "usize"];

/// The expansion, or the errors at the tokens that are wrong.
pub fn derive(input: &DeriveInput) -> TokenStream {
    match expand(input) {
        Ok(tokens) => tokens,
        Err(error) => error.to_compile_error(),
    }
}

fn expand(input: &DeriveInput) -> syn::Result<TokenStream> {
    let ident = &input.ident;
    if !input.generics.params.is_empty() {
        return Err(syn::Error::new(
            input.generics.span(),
            format!(
                "`IndexValue` cannot be derived for a generic type: derive it for `{ident}` \
                 without type or lifetime parameters"
            ),
        ));
    }
    let index_as = index_as(&input.attrs)?;
    let body = match &input.data {
        Data::Enum(data) => {
            if data.variants.is_empty() {
                return Err(syn::Error::new(
                    ident.span(),
                    format!("`{ident}` has no variants: it has no value to index"),
                ));
            }
            for variant in &data.variants {
                if !matches!(variant.fields, Fields::Unit) {
                    return Err(syn::Error::new(
                        variant.fields.span(),
                        format!(
                            "variant `{}` has fields: only unit enums can be index values; \
                             index the field that holds what you query by instead",
                            variant.ident
                        ),
                    ));
                }
            }
            let kind = match &index_as {
                None => quote!(::tito::model::TitoIndexBlockType::String),
                Some(lit) if lit.value() == "name" => {
                    quote!(::tito::model::TitoIndexBlockType::String)
                }
                Some(lit) if lit.value() == "number" => match repr(&input.attrs) {
                    Some(r) if SIGNED.contains(&r.as_str()) => {
                        quote!(::tito::model::TitoIndexBlockType::Integer)
                    }
                    Some(r) if UNSIGNED.contains(&r.as_str()) => {
                        quote!(::tito::model::TitoIndexBlockType::Unsigned)
                    }
                    _ => {
                        return Err(syn::Error::new(
                            lit.span(),
                            format!(
                                "`index_as = \"number\"` needs the enum's integer type: add \
                                 `#[repr(u8)]` (or another integer type up to 64 bits) to \
                                 `{ident}`, and serialize it as that number with serde_repr's \
                                 `Serialize_repr`/`Deserialize_repr`"
                            ),
                        ));
                    }
                },
                Some(lit) => {
                    return Err(syn::Error::new(
                        lit.span(),
                        format!(
                            "`index_as` is \"name\" (the serde name, the default) or \
                             \"number\", not {:?}",
                            lit.value()
                        ),
                    ));
                }
            };
            let name = ident.to_string();
            let variants = data.variants.iter().map(|v| {
                let v_ident = &v.ident;
                let v_name = v_ident.to_string();
                quote! {
                    (#v_name, ::tito::__private::serde_json::to_value(&#ident::#v_ident))
                }
            });
            quote! {
                const KIND: ::tito::model::TitoIndexBlockType = #kind;
                type Arg = #ident;
                type RangeArg<'a> = #ident;
                fn stored_form_problem() -> ::std::option::Option<::std::string::String> {
                    ::tito::model::value::enum_stored_form_problem(
                        #name,
                        <Self as ::tito::model::IndexValue>::KIND,
                        ::std::vec![#(#variants),*],
                    )
                }
            }
        }
        Data::Struct(data) => {
            if let Some(lit) = &index_as {
                return Err(syn::Error::new(
                    lit.span(),
                    "`index_as` is for unit enums: a newtype is stored as the value it wraps",
                ));
            }
            let one = data.fields.iter().next().filter(|_| data.fields.len() == 1);
            let inner = match (&data.fields, one) {
                (Fields::Unnamed(_), Some(field)) => &field.ty,
                (Fields::Named(_), Some(field)) if serde_transparent(&input.attrs) => &field.ty,
                (Fields::Named(_), Some(_)) => {
                    return Err(syn::Error::new(
                        data.fields.span(),
                        format!(
                            "`{ident}` serializes as an object: write it as a newtype \
                             (`struct {ident}(T)`) or add `#[serde(transparent)]`"
                        ),
                    ));
                }
                _ => {
                    return Err(syn::Error::new(
                        ident.span(),
                        format!(
                            "`{ident}` is not a newtype: only unit enums and structs of one \
                             field (`struct {ident}(String)`) can derive `IndexValue`; index \
                             each field instead"
                        ),
                    ));
                }
            };
            if last_segment_is(inner, "Vec") {
                return Err(syn::Error::new(
                    inner.span(),
                    format!(
                        "`{ident}` wraps a `Vec`, several values, not one: derive `IndexValue` \
                         for a newtype of the element instead and make the field a `Vec` of \
                         it (an index has an entry per element)"
                    ),
                ));
            }
            let bound = quote_spanned! {inner.span()=> <#inner as ::tito::model::IndexValue> };
            quote! {
                const KIND: ::tito::model::TitoIndexBlockType = #bound::KIND;
                type Arg = #ident;
                type RangeArg<'a> = #ident;
                fn stored_form_problem() -> ::std::option::Option<::std::string::String> {
                    #bound::stored_form_problem()
                }
            }
        }
        Data::Union(data) => {
            return Err(syn::Error::new(
                data.union_token.span(),
                "a union cannot be an index value",
            ));
        }
    };
    // Every derived type is a single value (a newtype over a `Vec` was refused above).
    let scalar = quote! {
        #[automatically_derived]
        impl ::tito::model::ScalarIndexValue for #ident {}
    };
    Ok(quote! {
        #[automatically_derived]
        impl ::tito::model::IndexValue for #ident {
            #body
        }
        #scalar
        #[automatically_derived]
        impl ::tito::model::QueryArg<#ident> for #ident {
            fn query_arg(&self) -> &#ident {
                self
            }
        }
        #[automatically_derived]
        impl ::tito::model::QueryArg<#ident> for &#ident {
            fn query_arg(&self) -> &#ident {
                self
            }
        }
    })
}

/// `#[tito(index_as = "..")]`, if written (anything else in `#[tito(..)]` is an error).
fn index_as(attrs: &[syn::Attribute]) -> syn::Result<Option<LitStr>> {
    let mut found = None;
    for attr in attrs.iter().filter(|a| a.path().is_ident("tito")) {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident(INDEX_AS) {
                if found.is_some() {
                    return Err(meta.error("`index_as` is written twice"));
                }
                found = Some(meta.value()?.parse::<LitStr>()?);
                Ok(())
            } else {
                Err(meta
                    .error("an index value takes only `#[tito(index_as = \"name\" | \"number\")]`"))
            }
        })?;
    }
    Ok(found)
}

/// The integer type of `#[repr(..)]`, if any.
fn repr(attrs: &[syn::Attribute]) -> Option<String> {
    let mut found = None;
    for attr in attrs.iter().filter(|a| a.path().is_ident("repr")) {
        let _ = attr.parse_nested_meta(|meta| {
            if let Some(ident) = meta.path.get_ident() {
                let name = ident.to_string();
                if SIGNED.contains(&name.as_str()) || UNSIGNED.contains(&name.as_str()) {
                    found = Some(name);
                }
            }
            Ok(())
        });
    }
    found
}

/// Whether `#[serde(transparent)]` is among the attributes.
fn serde_transparent(attrs: &[syn::Attribute]) -> bool {
    let mut found = false;
    for attr in attrs.iter().filter(|a| a.path().is_ident("serde")) {
        let _ = attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("transparent") {
                found = true;
            } else if meta.input.peek(syn::Token![=]) {
                // Skip `key = "value"` of other serde options.
                let _: syn::Lit = meta.value()?.parse()?;
            } else if meta.input.peek(syn::token::Paren) {
                let _ = meta.parse_nested_meta(|_| Ok(()));
            }
            Ok(())
        });
    }
    found
}

fn last_segment_is(ty: &Type, name: &str) -> bool {
    match ty {
        Type::Path(path) => path.path.segments.last().is_some_and(|s| s.ident == name),
        _ => false,
    }
}
