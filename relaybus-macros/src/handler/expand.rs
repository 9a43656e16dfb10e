//! The code `#[handler]` generates.

use proc_macro2::{Ident, TokenStream};
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;

use super::valid::Handler;

/// The subscription constructor and the registration, inside an anonymous `const`; the function
/// itself is left as written.
pub(super) fn expand(handler: &Handler<'_>) -> TokenStream {
    let Handler {
        args,
        id,
        ident,
        event_ty,
        arg_tys,
        output,
        krate,
    } = handler;
    let private = quote!(#krate::__private);

    // The glue's variables carry the spans of the user's argument types, so that rustc reports
    // a second argument that is not a `HandlerContext` at its type.
    let event = Ident::new("__relaybus_event", event_ty.span());
    // The result carries the span of the return type, so that rustc reports a return type that
    // is not a `Result<(), E: Into<BoxError>>` there.
    let result = Ident::new("__relaybus_result", output.span());
    // `Subscription::new` carries the span of the function's name, where rustc reports a future
    // that is not `Send`. Each argument's variable and check carry the span of its type, where
    // rustc reports a type that cannot be a handler argument. A context's type, as the user
    // wrote it, names the handler's store; a handler without one runs on any store.
    let vars: Vec<Ident> = arg_tys
        .iter()
        .enumerate()
        .map(|(at, ty)| Ident::new(&format!("__relaybus_arg{at}"), ty.span()))
        .collect();
    let checks = arg_tys.iter().map(|ty| {
        quote_spanned! {ty.span()=>
            #private::handler_argument::<#ty>();
        }
    });
    let call = quote_spanned! {output.span()=>
        let #result = #ident(#event #(, #vars)*).await;
        #private::HandlerResult::into_handler_result(#result)
    };
    let subscribe = if args.batch {
        let call = quote_spanned! {output.span()=>
            let #result = #ident(#event #(, #vars)*).await;
            #private::BatchResult::into_batch_result(#result)
        };
        let max_batch = args.max_batch.as_ref().map(|(_, n)| quote!(.max_batch(#n)));
        let batch_wait = args
            .batch_wait_ms
            .as_ref()
            .map(|(_, ms)| quote!(.batch_wait(::core::time::Duration::from_millis(#ms))));
        quote_spanned! {ident.span()=>
            #private::Subscription::batch::<
                <#event_ty as #private::BatchOf>::Event,
                (#(#arg_tys,)*),
                _,
            >(
                #id,
                |#event: #event_ty #(, #vars: #arg_tys)*| async move { #call },
            )
            #max_batch
            #batch_wait
        }
    } else {
        quote_spanned! {ident.span()=>
            #private::Subscription::new::<#event_ty, (#(#arg_tys,)*), _>(
                #id,
                |#event: #event_ty #(, #vars: #arg_tys)*| async move { #call },
            )
        }
    };
    let event_type = if args.batch {
        quote!(<<#event_ty as #private::BatchOf>::Event as #private::Event>::TYPE)
    } else {
        quote!(<#event_ty as #private::Event>::TYPE)
    };
    let subscribe = quote! {
        #(#checks)*
        #subscribe
    };

    let transactional = args.transactional.then(|| quote!(.with_transactional()));
    let unordered = args.unordered.then(|| quote!(.with_unordered()));
    let max_attempts = args
        .max_attempts
        .as_ref()
        .map(|(_, n)| quote!(.with_max_attempts(#n)));
    let initial_backoff = args
        .initial_backoff_ms
        .as_ref()
        .map(|(_, ms)| quote!(.with_initial_backoff(::core::time::Duration::from_millis(#ms))));
    let max_backoff = args
        .max_backoff_ms
        .as_ref()
        .map(|(_, ms)| quote!(.with_max_backoff(::core::time::Duration::from_millis(#ms))));

    let timeout = args
        .timeout_ms
        .as_ref()
        .map(|(_, ms)| quote!(.with_timeout(::core::time::Duration::from_millis(#ms))));

    let global_concurrency = args
        .global_concurrency
        .as_ref()
        .map(|(_, n)| quote!(.with_global_concurrency(#n)));
    let rate_limit = args.rate_limit.as_ref().map(|(_, rate)| {
        let ms = args.rate_interval_ms.as_ref().map_or(1_000, |(_, ms)| *ms);
        quote!(.with_rate_limit(#rate, ::core::time::Duration::from_millis(#ms)))
    });

    quote! {
        const _: () = {
            fn __relaybus_subscription() -> #private::Subscription {
                #subscribe
            }

            #private::inventory::submit! {
                #private::HandlerDescriptor::new(
                    #id,
                    #event_type,
                    ::core::concat!(::core::module_path!(), "::", ::core::stringify!(#ident)),
                    __relaybus_subscription,
                )
                #transactional
                #unordered
                #max_attempts
                #initial_backoff
                #max_backoff
                #timeout
                #global_concurrency
                #rate_limit
            }
        };
    }
}
