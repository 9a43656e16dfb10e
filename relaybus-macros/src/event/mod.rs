//! `#[event("type.name.v1")]`: parse, validate, expand.

mod ast;
mod expand;
mod valid;

use proc_macro2::TokenStream;

use crate::ctxt::{Ctxt, with_errors};

pub(crate) fn expand(attr: TokenStream, item: TokenStream) -> TokenStream {
    let cx = Ctxt::new();
    let args = ast::Args::parse(&cx, attr);
    let parsed = match syn::parse2::<syn::Item>(item.clone()) {
        Ok(parsed) => parsed,
        Err(error) => return with_errors(item, error, TokenStream::new()),
    };
    let input = ast::Input::from_item(&cx, &parsed);
    let event = valid::check(&cx, &args, input.as_ref());
    match (cx.check(), event) {
        (Ok(()), Some(event)) => {
            let generated = expand::expand(&event);
            quote::quote! {
                #item
                #generated
            }
        }
        (Err(errors), _) => with_errors(item, errors, expand::fallback(&args, input.as_ref())),
        (Ok(()), None) => panic!("BUG: #[event] failed validation without reporting an error"),
    }
}
