//! The checks of `#[handler]`: its arguments together, and the function's signature.
//!
//! Only what can be seen in the tokens is checked here. Whether the event type implements
//! `Event`, whether the second argument is a `HandlerContext` and whether the error type
//! converts into a `BoxError` is left to rustc, on code that carries the user's spans.

use proc_macro2::Span;
use syn::{FnArg, Ident, Item, ItemFn, LitStr, Path, ReturnType, Type, spanned::Spanned};

use super::ast::Args;
use crate::{attr, ctxt::Ctxt, rules};

/// A checked `#[handler]`, ready to expand.
pub(super) struct Handler<'a> {
    pub(super) args: &'a Args,
    pub(super) id: &'a LitStr,
    pub(super) ident: &'a Ident,
    pub(super) event_ty: &'a Type,
    /// The types of the arguments after the event.
    pub(super) arg_tys: Vec<&'a Type>,
    pub(super) output: &'a Type,
    pub(super) krate: Path,
}

const SHAPE: &str = "a handler takes the event by value, then any of a `HandlerContext` and \
                     `State<T>` values: `async fn handle(event: OrderPlaced, context: \
                     HandlerContext) -> Result<(), BoxError>`";

/// The most arguments a handler takes after the event.
const MAX_ARGUMENTS: usize = 4;

/// Checks the arguments and the function, reporting every problem to `cx`; `Some` when nothing
/// is wrong with what was parsed.
pub(super) fn check<'a>(cx: &Ctxt, args: &'a Args, item: &'a Item) -> Option<Handler<'a>> {
    let id = check_args(cx, args);
    let Item::Fn(func) = item else {
        cx.error_at(
            item_keyword(item),
            "`#[handler]` goes on an `async fn` that takes the event",
        );
        return None;
    };
    let signature = check_signature(cx, func);
    let (id, (event_ty, arg_tys, output)) = (id?, signature?);
    Some(Handler {
        args,
        id,
        ident: &func.sig.ident,
        event_ty,
        arg_tys,
        output,
        krate: args.krate.clone().unwrap_or_else(attr::default_crate),
    })
}

fn check_args<'a>(cx: &Ctxt, args: &'a Args) -> Option<&'a LitStr> {
    let mut ok = true;
    if let (Some((_, initial)), Some((max_lit, max))) =
        (&args.initial_backoff_ms, &args.max_backoff_ms)
        && max < initial
    {
        cx.error_spanned_by(
            max_lit,
            format_args!(
                "`max_backoff_ms` ({max}) is shorter than `initial_backoff_ms` ({initial})"
            ),
        );
        ok = false;
    }
    if let (Some((lit, _)), None) = (&args.rate_interval_ms, &args.rate_limit) {
        cx.error_spanned_by(
            lit,
            "`rate_interval_ms` sets the interval of a rate limit; add `rate_limit = N`, the \
             starts allowed per interval",
        );
        ok = false;
    }
    for (given, name) in [
        (args.max_batch.as_ref().map(|(lit, _)| lit), "max_batch"),
        (
            args.batch_wait_ms.as_ref().map(|(lit, _)| lit),
            "batch_wait_ms",
        ),
    ] {
        if let Some(lit) = given
            && !args.batch
        {
            cx.error_spanned_by(
                lit,
                format_args!(
                    "`{name}` sets the batches of a batch handler; add `batch`, and take a \
                     `Batch<E>`"
                ),
            );
            ok = false;
        }
    }
    let id = match &args.id {
        Some(id) => match rules::check_handler_id(&id.value()) {
            Ok(()) => Some(id),
            Err(reason) => {
                cx.error_spanned_by(
                    id,
                    format_args!(
                        "invalid handler id {:?}: {reason}; use 1 to 128 characters of ASCII letters, \
                         digits, `_`, `-`, `.` and `:`",
                        id.value()
                    ),
                );
                None
            }
        },
        None if args.id_given => None,
        None => {
            cx.error_at(
                Span::call_site(),
                "missing the handler id: write `#[handler(id = \"projector\")]`; the id keys the \
                 handler's deliveries in the store, so keep it stable",
            );
            None
        }
    };
    id.filter(|_| ok)
}

/// The event type, the types of the arguments after it and the return type of a handler's
/// signature.
type Parts<'a> = (&'a Type, Vec<&'a Type>, &'a Type);

fn check_signature<'a>(cx: &Ctxt, func: &'a ItemFn) -> Option<Parts<'a>> {
    let sig = &func.sig;
    let name = &sig.ident;
    let errors_before = cx.len();
    if let Some(constness) = &sig.constness {
        cx.error_spanned_by(constness, "a handler cannot be a `const fn`");
    }
    if sig.asyncness.is_none() {
        cx.error_spanned_by(
            sig.fn_token,
            format_args!("a handler must be an `async fn`: write `async fn {name}(..)`"),
        );
    }
    if let Some(unsafety) = &sig.unsafety {
        cx.error_spanned_by(
            unsafety,
            "a handler cannot be `unsafe`: the bus calls it with no way to uphold its contract",
        );
    }
    if let Some(abi) = &sig.abi {
        cx.error_spanned_by(abi, "a handler cannot have an `extern` ABI");
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        cx.error_spanned_by(
            &sig.generics,
            "a handler cannot be generic: it is subscribed to one event type, so name the \
             concrete type",
        );
    }
    if let Some(variadic) = &sig.variadic {
        cx.error_spanned_by(variadic, SHAPE);
    }

    let mut typed = Vec::new();
    for input in &sig.inputs {
        match input {
            FnArg::Receiver(receiver) => cx.error_spanned_by(
                receiver,
                "a handler cannot take `self`: declare it as a free function, outside any \
                 `impl` block, taking the event by value",
            ),
            FnArg::Typed(arg) => typed.push(&*arg.ty),
        }
    }
    let event_ty = typed.first().copied();
    match event_ty {
        Some(event_ty) => check_by_value(cx, event_ty, "the event", "OrderPlaced"),
        // A `self` alone was reported already.
        None if sig.receiver().is_some() => {}
        None => cx.error_at(sig.paren_token.span.join(), SHAPE),
    }
    let arg_tys: Vec<&Type> = typed.iter().skip(1).copied().collect();
    for ty in &arg_tys {
        check_by_value(cx, ty, "a handler argument", "State<Database>");
    }
    if arg_tys.len() > MAX_ARGUMENTS {
        let extra_args: Vec<_> = sig.inputs.iter().skip(1 + MAX_ARGUMENTS).collect();
        cx.error_spanned_by(
            quote::quote!(#(#extra_args),*),
            format_args!(
                "a handler takes at most {MAX_ARGUMENTS} arguments after the event, and `{name}` \
                 takes {}; gather state values into one type",
                arg_tys.len()
            ),
        );
    }
    let output = match &sig.output {
        ReturnType::Type(_, ty) => Some(&**ty),
        ReturnType::Default => {
            cx.error_at(
                sig.paren_token.span.close(),
                "a handler returns `Result<(), E>` with `E: Into<BoxError>`, so that a failure is \
                 retried: add `-> Result<(), BoxError>`",
            );
            None
        }
    };
    match (cx.len() == errors_before, event_ty, output) {
        (true, Some(event_ty), Some(output)) => Some((event_ty, arg_tys, output)),
        _ => None,
    }
}

/// Reports an argument taken by reference or as `impl Trait`.
fn check_by_value(cx: &Ctxt, ty: &Type, what: &str, example: &str) {
    match ty {
        Type::Reference(reference) => cx.error_spanned_by(
            reference,
            format_args!("take {what} by value (`{example}`), not by reference"),
        ),
        Type::ImplTrait(_) => cx.error_spanned_by(
            ty,
            format_args!("{what} must be a concrete type, such as `{example}`, not `impl Trait`"),
        ),
        _ => {}
    }
}

/// The first token of an item, where "this is the wrong kind of item" is reported.
fn item_keyword(item: &Item) -> Span {
    match item {
        Item::Struct(s) => s.struct_token.span,
        Item::Enum(e) => e.enum_token.span,
        Item::Impl(i) => i.impl_token.span,
        Item::Trait(t) => t.trait_token.span,
        Item::Mod(m) => m.mod_token.span,
        Item::Const(c) => c.const_token.span,
        Item::Static(s) => s.static_token.span,
        other => other.span(),
    }
}
