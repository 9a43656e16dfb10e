//! Collects the errors of one macro expansion, so that all of them are reported in one pass.

use std::cell::RefCell;

use proc_macro2::TokenStream;

/// An error accumulator: validation pushes errors as it finds them and carries on, and
/// [`Ctxt::check`] merges them into one `syn::Error` (one `compile_error!` per error).
#[derive(Default)]
pub(crate) struct Ctxt {
    errors: RefCell<Vec<syn::Error>>,
}

impl Ctxt {
    pub(crate) fn new() -> Self {
        Ctxt::default()
    }

    /// Records an error pointing at `tokens`.
    pub(crate) fn error_spanned_by<T: quote::ToTokens, M: std::fmt::Display>(
        &self,
        tokens: T,
        message: M,
    ) {
        self.errors
            .borrow_mut()
            .push(syn::Error::new_spanned(tokens.into_token_stream(), message));
    }

    /// Records an error at `span`.
    pub(crate) fn error_at<M: std::fmt::Display>(&self, span: proc_macro2::Span, message: M) {
        self.errors
            .borrow_mut()
            .push(syn::Error::new(span, message));
    }

    /// Records an error of syn's, such as a parse error.
    pub(crate) fn syn_error(&self, error: syn::Error) {
        self.errors.borrow_mut().push(error);
    }

    /// How many errors were recorded so far.
    pub(crate) fn len(&self) -> usize {
        self.errors.borrow().len()
    }

    /// All the errors recorded, combined, or `Ok` when there were none.
    pub(crate) fn check(self) -> syn::Result<()> {
        let mut errors = self.errors.into_inner().into_iter();
        let Some(mut combined) = errors.next() else {
            return Ok(());
        };
        for error in errors {
            combined.combine(error);
        }
        Err(combined)
    }
}

/// The user's item, unchanged, next to the errors and whatever `extra` keeps downstream code
/// compiling, so that one mistake in an attribute does not turn into errors everywhere the item
/// is used.
pub(crate) fn with_errors(
    item: TokenStream,
    errors: syn::Error,
    extra: TokenStream,
) -> TokenStream {
    let errors = errors.to_compile_error();
    quote::quote! {
        #item
        #extra
        #errors
    }
}
