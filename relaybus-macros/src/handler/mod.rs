//! `#[handler(id = "...", ...)]`: parse, validate, expand.

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
    let handler = valid::check(&cx, &args, &parsed);
    match (cx.check(), handler) {
        (Ok(()), Some(handler)) => {
            let generated = expand::expand(&handler);
            quote::quote! {
                #item
                #generated
            }
        }
        // The function stays as written, so calls to it (its unit tests) still compile.
        (Err(errors), _) => with_errors(item, errors, TokenStream::new()),
        (Ok(()), None) => panic!("BUG: #[handler] failed validation without reporting an error"),
    }
}
