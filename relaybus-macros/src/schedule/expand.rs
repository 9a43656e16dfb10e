//! The code `#[schedule]` generates.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;

use super::valid::ScheduleItem;

/// The schedule constructor and the registration, inside an anonymous `const`; the function
/// itself is left as written.
pub(super) fn expand(item: &ScheduleItem<'_>) -> TokenStream {
    let ScheduleItem {
        args,
        id,
        ident,
        output,
        krate,
    } = item;
    let private = quote!(#krate::__private);
    // The constructor carries the span of the return type, where rustc reports a type that is
    // not an `Event`, and of the function's name, where it reports a function that does not
    // take a `Tick`.
    let make = quote_spanned! {ident.span()=> #ident };
    let event = quote_spanned! {output.span()=> #output };
    let schedule = match (&args.cron, &args.every_ms) {
        (Some(cron), _) => quote! {
            #private::Schedule::cron::<#event, _>(#id, #cron, #make)
        },
        (None, Some((_, ms))) => quote! {
            #private::Schedule::every::<#event, _>(
                #id,
                ::core::time::Duration::from_millis(#ms),
                #make,
            )
        },
        (None, None) => panic!("BUG: #[schedule] without a cadence passed validation"),
    };
    let zone = args
        .time_zone
        .as_ref()
        .map(|zone| quote!(.time_zone(#zone)));
    let missed = args
        .each_missed
        .as_ref()
        .map(|(_, max)| quote!(.missed(#private::MissedTicks::Each { max: #max })));
    let catch_up = args
        .catch_up_ms
        .as_ref()
        .map(|(_, ms)| quote!(.catch_up_within(::core::time::Duration::from_millis(#ms))));

    quote! {
        const _: () = {
            fn __relaybus_schedule() -> #private::Schedule {
                #schedule #zone #missed #catch_up
            }

            #private::inventory::submit! {
                #private::ScheduleDescriptor::new(
                    #id,
                    ::core::concat!(::core::module_path!(), "::", ::core::stringify!(#ident)),
                    __relaybus_schedule,
                )
            }
        };
    }
}
