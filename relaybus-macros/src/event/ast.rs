//! The arguments of `#[event]` and the item it is put on, as parsed.

use proc_macro2::{TokenStream, TokenTree};
use syn::{
    Generics, Ident, Item, LitStr, Path, Token,
    ext::IdentExt,
    parse::{ParseStream, Parser},
};

use crate::{
    attr::{self, Arg},
    ctxt::Ctxt,
};

/// `#[event("order.placed.v1", crate = path)]`.
pub(super) struct Args {
    /// The type name, when it was given as a string literal.
    pub(super) name: Option<LitStr>,
    /// Whether anything was given where the type name goes (a non-literal was reported).
    pub(super) name_given: bool,
    /// The path of the relaybus crate.
    pub(super) krate: Option<Path>,
}

const KNOWN: &str = "`crate = path` after the type name";

impl Args {
    /// Parses the arguments, reporting every problem to `cx`.
    pub(super) fn parse(cx: &Ctxt, tokens: TokenStream) -> Args {
        let mut name = None;
        let mut name_given = false;
        let mut krate = Arg::new("crate");
        let parser = |input: ParseStream<'_>| -> syn::Result<()> {
            // The type name comes first, unless the arguments start with a `key = ..` option.
            let option_first = input.peek(Ident::peek_any) && input.peek2(Token![=]);
            if !input.is_empty() && !option_first {
                name_given = true;
                let mut first = TokenStream::new();
                while !input.is_empty() && !input.peek(Token![,]) {
                    first.extend([input.parse::<TokenTree>()?]);
                }
                match syn::parse2::<LitStr>(first.clone()) {
                    Ok(lit) => name = Some(lit),
                    Err(_) => cx.error_spanned_by(
                        first,
                        "the event type name must be a string literal, such as \
                         `#[event(\"order.placed.v1\")]`",
                    ),
                }
                if input.is_empty() {
                    return Ok(());
                }
                input.parse::<Token![,]>()?;
            }
            let options = syn::meta::parser(|meta| {
                if meta.path.is_ident("crate") {
                    if let Some(path) = attr::crate_path(cx, &meta)? {
                        krate.set(cx, &meta, path);
                    }
                    Ok(())
                } else {
                    attr::unknown(cx, &meta, KNOWN)
                }
            });
            options.parse2(input.parse()?)
        };
        if let Err(error) = parser.parse2(tokens) {
            cx.syn_error(error);
        }
        Args {
            name,
            name_given,
            krate: krate.get(),
        }
    }
}

/// The struct or enum the attribute is on.
pub(super) struct Input<'a> {
    pub(super) ident: &'a Ident,
    pub(super) generics: &'a Generics,
}

impl<'a> Input<'a> {
    /// The struct or enum of `item`, or `None` after reporting that it is neither.
    pub(super) fn from_item(cx: &Ctxt, item: &'a Item) -> Option<Self> {
        const MESSAGE: &str = "`#[event]` goes on the struct or enum that is the event's payload";
        match item {
            Item::Struct(s) => Some(Input {
                ident: &s.ident,
                generics: &s.generics,
            }),
            Item::Enum(e) => Some(Input {
                ident: &e.ident,
                generics: &e.generics,
            }),
            Item::Fn(f) => {
                cx.error_spanned_by(f.sig.fn_token, MESSAGE);
                None
            }
            Item::Union(u) => {
                cx.error_spanned_by(u.union_token, MESSAGE);
                None
            }
            Item::Type(t) => {
                cx.error_spanned_by(t.type_token, MESSAGE);
                None
            }
            other => {
                cx.error_spanned_by(other, MESSAGE);
                None
            }
        }
    }
}
