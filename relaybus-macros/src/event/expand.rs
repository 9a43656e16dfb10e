//! The code `#[event]` generates.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};

use super::{
    ast::{Args, Input},
    valid::Event,
};
use crate::attr;

/// The `Event` impl, a compile-time check of the name by relaybus's own rule, and the
/// registration, all inside an anonymous `const`.
pub(super) fn expand(event: &Event<'_>) -> TokenStream {
    let Event { name, input, krate } = event;
    let ident = input.ident;
    let private = quote!(#krate::__private);
    // The impl carries the span of the type's name, so that a missing `Serialize`,
    // `Deserialize`, `Send` or `Sync` is reported at the type.
    let event_impl = quote_spanned! {ident.span()=>
        #[automatically_derived]
        impl #private::Event for #ident {
            const TYPE: &'static str = #name;
        }
    };
    quote! {
        const _: () = {
            #event_impl

            const _: () = ::core::assert!(
                #private::check_type_name(#name).is_ok(),
                "relaybus-macros and relaybus disagree on the event type name rule; use the same version of both"
            );

            #private::inventory::submit! {
                #private::EventDescriptor::new(
                    #name,
                    ::core::concat!(::core::module_path!(), "::", ::core::stringify!(#ident)),
                )
            }
        };
    }
}

/// What is emitted next to the errors: the `Event` impl alone, when there is a type to put it
/// on, so that code using the type as an event does not fail as well.
pub(super) fn fallback(args: &Args, input: Option<&Input<'_>>) -> TokenStream {
    let Some(input) = input else {
        return TokenStream::new();
    };
    if input.generics.lt_token.is_some() {
        return TokenStream::new();
    }
    let krate = args.krate.clone().unwrap_or_else(attr::default_crate);
    let ident = input.ident;
    let name = args
        .name
        .as_ref()
        .map(syn::LitStr::value)
        .unwrap_or_default();
    quote! {
        const _: () = {
            impl #krate::__private::Event for #ident {
                const TYPE: &'static str = #name;
            }
        };
    }
}
