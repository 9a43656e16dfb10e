//! `#[schedule(id = "...", cron = "..." | every_ms = N, ...)]`: parse, validate, expand.

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
    let schedule = valid::check(&cx, &args, &parsed);
    match (cx.check(), schedule) {
        (Ok(()), Some(schedule)) => {
            let generated = expand::expand(&schedule);
            quote::quote! {
                #item
                #generated
            }
        }
        // The function stays as written, so calls to it (its unit tests) still compile.
        (Err(errors), _) => with_errors(item, errors, TokenStream::new()),
        (Ok(()), None) => panic!("BUG: #[schedule] failed validation without reporting an error"),
    }
}
