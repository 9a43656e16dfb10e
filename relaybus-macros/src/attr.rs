//! Helpers for the arguments of both attributes, on top of `syn::meta::parser`.

use proc_macro2::TokenTree;
use syn::{Expr, Lit, LitInt, LitStr, Path, Token, meta::ParseNestedMeta, parse::ParseStream};

use crate::ctxt::Ctxt;

/// One argument that may be given at most once. Remembers the key it was given with, so that a
/// repetition can point at both.
pub(crate) struct Arg<T> {
    name: &'static str,
    value: Option<T>,
}

impl<T> Arg<T> {
    pub(crate) fn new(name: &'static str) -> Self {
        Arg { name, value: None }
    }

    /// Stores the value, or reports a repetition at the repeated key.
    pub(crate) fn set(&mut self, cx: &Ctxt, meta: &ParseNestedMeta<'_>, value: T) {
        if self.value.is_some() {
            cx.error_spanned_by(
                &meta.path,
                format_args!("`{}` is given twice; keep one", self.name),
            );
        } else {
            self.value = Some(value);
        }
    }

    pub(crate) fn get(self) -> Option<T> {
        self.value
    }
}

/// Consumes the rest of one argument (up to the next `,`), after an error about it, so that
/// parsing goes on with the next argument.
pub(crate) fn skip_rest(input: ParseStream<'_>) -> syn::Result<()> {
    while !input.is_empty() && !input.peek(Token![,]) {
        input.parse::<TokenTree>()?;
    }
    Ok(())
}

/// The value of `key = <value>` as an expression, or `None` after reporting that the `=` is
/// missing (a key written as a flag).
pub(crate) fn value_expr(
    cx: &Ctxt,
    meta: &ParseNestedMeta<'_>,
    hint: &str,
) -> syn::Result<Option<Expr>> {
    if !meta.input.peek(Token![=]) {
        cx.error_spanned_by(
            &meta.path,
            format_args!(
                "`{0}` needs a value: write `{0} = {hint}`",
                path_name(&meta.path)
            ),
        );
        skip_rest(meta.input)?;
        return Ok(None);
    }
    let expr: Expr = meta.value()?.parse()?;
    Ok(Some(expr))
}

/// The string literal of `key = "..."`, or `None` after reporting what was given instead.
pub(crate) fn lit_str(
    cx: &Ctxt,
    meta: &ParseNestedMeta<'_>,
    hint: &str,
) -> syn::Result<Option<LitStr>> {
    Ok(match value_expr(cx, meta, hint)? {
        Some(Expr::Lit(syn::ExprLit {
            lit: Lit::Str(lit), ..
        })) => Some(lit),
        Some(other) => {
            cx.error_spanned_by(
                &other,
                format_args!(
                    "`{}` must be a string literal, such as `{hint}`",
                    path_name(&meta.path)
                ),
            );
            None
        }
        None => None,
    })
}

/// The integer literal of `key = N`, within `range`, or `None` after reporting what is wrong.
pub(crate) fn lit_int<N>(
    cx: &Ctxt,
    meta: &ParseNestedMeta<'_>,
    hint: &str,
    range: std::ops::RangeInclusive<N>,
) -> syn::Result<Option<(LitInt, N)>>
where
    N: std::str::FromStr + PartialOrd + std::fmt::Display,
    N::Err: std::fmt::Display,
{
    let name = path_name(&meta.path);
    let lit = match value_expr(cx, meta, hint)? {
        Some(Expr::Lit(syn::ExprLit {
            lit: Lit::Int(lit), ..
        })) => lit,
        Some(other) => {
            cx.error_spanned_by(
                &other,
                format_args!("`{name}` must be an integer literal, such as `{hint}`"),
            );
            return Ok(None);
        }
        None => return Ok(None),
    };
    match lit.base10_parse::<N>() {
        Ok(n) if range.contains(&n) => Ok(Some((lit, n))),
        Ok(_) | Err(_) => {
            cx.error_spanned_by(
                &lit,
                format_args!(
                    "`{name}` is out of range; use {} to {}",
                    range.start(),
                    range.end()
                ),
            );
            Ok(None)
        }
    }
}

/// Reports a flag written with a value (`transactional = true`).
pub(crate) fn flag(cx: &Ctxt, meta: &ParseNestedMeta<'_>) -> syn::Result<()> {
    if !meta.input.is_empty() && !meta.input.peek(Token![,]) {
        cx.error_spanned_by(
            &meta.path,
            format_args!(
                "`{0}` is a flag and takes no value: write `{0}` alone, or leave it out",
                path_name(&meta.path)
            ),
        );
        skip_rest(meta.input)?;
    }
    Ok(())
}

const CRATE_MESSAGE: &str = "`crate` must be the path of the relaybus crate, such as `::relaybus` or `::my_reexport::relaybus`";

/// The path of `crate = path` (or `crate = "path"`, as serde writes it).
pub(crate) fn crate_path(cx: &Ctxt, meta: &ParseNestedMeta<'_>) -> syn::Result<Option<Path>> {
    const HINT: &str = "::relaybus";
    if !meta.input.peek(Token![=]) {
        cx.error_spanned_by(
            &meta.path,
            format_args!("`crate` needs a value: write `crate = {HINT}`"),
        );
        skip_rest(meta.input)?;
        return Ok(None);
    }
    let input = meta.value()?;
    if input.peek(LitStr) {
        let lit: LitStr = input.parse()?;
        return match lit.parse::<Path>() {
            Ok(path) => Ok(Some(path)),
            Err(_) => {
                cx.error_spanned_by(&lit, CRATE_MESSAGE);
                Ok(None)
            }
        };
    }
    let start = input.fork();
    match Path::parse_mod_style(input) {
        Ok(path) if input.is_empty() || input.peek(Token![,]) => Ok(Some(path)),
        Ok(_) | Err(_) => {
            skip_rest(input)?;
            let mut given = proc_macro2::TokenStream::new();
            while !start.is_empty() && !start.peek(Token![,]) {
                given.extend([start.parse::<TokenTree>()?]);
            }
            cx.error_spanned_by(given, CRATE_MESSAGE);
            Ok(None)
        }
    }
}

/// An unknown key, reported at the key with the list of the known ones.
pub(crate) fn unknown(cx: &Ctxt, meta: &ParseNestedMeta<'_>, known: &str) -> syn::Result<()> {
    cx.error_spanned_by(
        &meta.path,
        format_args!(
            "unknown option `{}`; expected {known}",
            path_name(&meta.path)
        ),
    );
    skip_rest(meta.input)
}

/// A key as written, for messages.
pub(crate) fn path_name(path: &Path) -> String {
    quote::ToTokens::to_token_stream(path)
        .to_string()
        .replace(' ', "")
}

/// `::relaybus`, the default path of the runtime crate.
pub(crate) fn default_crate() -> Path {
    syn::parse_quote!(::relaybus)
}
