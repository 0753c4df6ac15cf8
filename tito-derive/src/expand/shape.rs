//! Row shape versions: a model's `VERSION` and `upgrade`, and `#[derive(TitoShape)]` for its
//! previous shapes. Each conversion is a call spanned on the attribute that asks for it, so a
//! missing `From` impl or a version that does not go down is reported there.

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::{DeriveInput, LitInt, Type};

use crate::ast::Errors;
use crate::attr::{self, ShapeAttrs};

/// The items of a model's `TitoModelTrait` impl for its shape (nothing for an undeclared
/// version 1 without a previous shape).
pub(super) fn model_items(shape: &ShapeAttrs) -> TokenStream {
    let Some(version) = &shape.version else {
        return TokenStream::new();
    };
    let older = match older(shape, version) {
        Some(older) => older,
        None => quote! {
            let _ = (version, json);
            ::core::result::Result::Err(::tito::model::ShapeError::Unknown)
        },
    };
    let downgrade = downgrade(shape);
    quote! {
        const VERSION: u32 = #version;

        #downgrade

        fn upgrade(
            version: u32,
            json: &[u8],
        ) -> ::core::result::Result<Self, ::tito::model::ShapeError> {
            #older
        }
    }
}

/// A model's `downgrade`: the row as the shape `from` names, through the function
/// `downgrade = ".."` names (nothing without one).
fn downgrade(shape: &ShapeAttrs) -> TokenStream {
    let (Some(from_lit), Some(down_lit)) = (&shape.from, &shape.downgrade) else {
        return TokenStream::new();
    };
    let (Ok(from), Ok(down)) = (from_lit.parse::<Type>(), down_lit.parse::<syn::Path>()) else {
        return TokenStream::new();
    };
    let call = quote_spanned! {down_lit.span()=>
        let previous: #from = #down(self);
    };
    quote! {
        fn downgrade(
            &self,
            version: u32,
        ) -> ::core::option::Option<::core::result::Result<::std::vec::Vec<u8>, ::tito::model::ShapeError>> {
            if version != <#from as ::tito::model::TitoShape>::VERSION {
                return ::core::option::Option::None;
            }
            #call
            ::core::option::Option::Some(::tito::model::shape::to_json(&previous))
        }

        fn downgrades_to(version: u32) -> bool {
            version == <#from as ::tito::model::TitoShape>::VERSION
        }
    }
}

/// Reading a row older than `version` through the shape `from` names (`None` without one).
fn older(shape: &ShapeAttrs, version: &LitInt) -> Option<TokenStream> {
    let from_lit = shape.from.as_ref()?;
    let from: Type = from_lit.parse().ok()?;
    let span = from_lit.span();
    let check = quote_spanned! {span=>
        const _: () = ::core::assert!(
            <#from as ::tito::model::TitoShape>::VERSION < #version,
            "the shape `from` names must have a lower `version` than this one (versions go down along `from`, so no chain of shapes loops)"
        );
    };
    let convert = match &shape.upgrade {
        Some(upgrade_lit) => {
            let upgrade: syn::Path = upgrade_lit.parse().ok()?;
            quote_spanned! {upgrade_lit.span()=>
                #upgrade(previous).map_err(|err| {
                    ::tito::model::ShapeError::conversion(
                        <#from as ::tito::model::TitoShape>::VERSION,
                        #version,
                        err,
                    )
                })
            }
        }
        None => quote_spanned! {span=>
            ::core::result::Result::Ok(<Self as ::core::convert::From<#from>>::from(previous))
        },
    };
    Some(quote! {
        #check
        if version > <#from as ::tito::model::TitoShape>::VERSION {
            return ::core::result::Result::Err(::tito::model::ShapeError::Unknown);
        }
        let previous = <#from as ::tito::model::TitoShape>::read_version(version, json)?;
        #convert
    })
}

/// `#[derive(TitoShape)]`: a previous shape of a model's rows.
pub fn derive(input: &DeriveInput) -> TokenStream {
    let mut errors = Errors::default();
    let shape = attr::shape(&input.attrs, &mut errors);
    shape.check(&mut errors);
    if !input.generics.params.is_empty() {
        errors.push(syn::Error::new_spanned(
            &input.generics,
            "a row shape has no generic parameters",
        ));
    }
    let version = match &shape.version {
        Some(version) => Some(version.clone()),
        None => {
            errors.push(syn::Error::new(
                Span::call_site(),
                "a row shape declares its version: `#[tito(version = N)]`",
            ));
            None
        }
    };
    if let Some(error) = errors.combined() {
        return error.to_compile_error();
    }
    let version = version.expect("no errors means a version");
    let ident = &input.ident;
    let older = older(&shape, &version).unwrap_or_else(|| {
        quote! { ::core::result::Result::Err(::tito::model::ShapeError::Unknown) }
    });
    quote! {
        #[automatically_derived]
        impl ::tito::model::TitoShape for #ident {
            const VERSION: u32 = #version;

            fn read_version(
                version: u32,
                json: &[u8],
            ) -> ::core::result::Result<Self, ::tito::model::ShapeError> {
                if version == #version {
                    return ::tito::model::shape::decode::<Self>(json);
                }
                if version > #version {
                    return ::core::result::Result::Err(::tito::model::ShapeError::Newer {
                        newest: #version,
                    });
                }
                #older
            }
        }
    }
}
