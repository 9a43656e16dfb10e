//! The checks of `#[schedule]`: its arguments together, and the function's signature.
//!
//! The cron expression and the time zone are checked when the bus is built
//! (`ConfigurationError::InvalidSchedule` names the schedule); whether the function returns an
//! `Event` and takes a `Tick` is left to rustc, on code that carries the user's spans.

use proc_macro2::Span;
use syn::{FnArg, Ident, Item, LitStr, Path, ReturnType, Type, spanned::Spanned};

use super::ast::Args;
use crate::{attr, ctxt::Ctxt, rules};

/// A checked `#[schedule]`, ready to expand.
pub(super) struct ScheduleItem<'a> {
    pub(super) args: &'a Args,
    pub(super) id: &'a LitStr,
    pub(super) ident: &'a Ident,
    pub(super) output: &'a Type,
    pub(super) krate: Path,
}

const SHAPE: &str = "a schedule is a plain `fn` that takes the tick and returns the event to \
                     publish: `fn report_due(tick: Tick) -> ReportDue`";

/// Checks the arguments and the function, reporting every problem to `cx`; `Some` when nothing
/// is wrong with what was parsed.
pub(super) fn check<'a>(cx: &Ctxt, args: &'a Args, item: &'a Item) -> Option<ScheduleItem<'a>> {
    let id = check_args(cx, args);
    let Item::Fn(func) = item else {
        cx.error_at(
            item.span(),
            "`#[schedule]` goes on a `fn` that takes the tick",
        );
        return None;
    };
    let sig = &func.sig;
    let errors_before = cx.len();
    if let Some(asyncness) = &sig.asyncness {
        cx.error_spanned_by(
            asyncness,
            "a schedule's function is not `async`: it only makes the event of a tick, which the \
             bus publishes",
        );
    }
    if let Some(unsafety) = &sig.unsafety {
        cx.error_spanned_by(unsafety, "a schedule's function cannot be `unsafe`");
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        cx.error_spanned_by(
            &sig.generics,
            "a schedule's function cannot be generic: name the event type it returns",
        );
    }
    let typed: Vec<&FnArg> = sig.inputs.iter().collect();
    if typed.len() != 1 || matches!(typed.first(), Some(FnArg::Receiver(_))) {
        cx.error_at(sig.paren_token.span.join(), SHAPE);
    }
    let output = match &sig.output {
        ReturnType::Type(_, ty) => Some(&**ty),
        ReturnType::Default => {
            cx.error_at(sig.paren_token.span.close(), SHAPE);
            None
        }
    };
    let (id, output) = (id?, output?);
    (cx.len() == errors_before).then(|| ScheduleItem {
        args,
        id,
        ident: &sig.ident,
        output,
        krate: args.krate.clone().unwrap_or_else(attr::default_crate),
    })
}

fn check_args<'a>(cx: &Ctxt, args: &'a Args) -> Option<&'a LitStr> {
    let mut ok = true;
    match (&args.cron, &args.every_ms) {
        (Some(cron), Some((every, _))) => {
            cx.error_spanned_by(
                quote::quote!(#cron #every),
                "give one of `cron` and `every_ms`: a schedule ticks on a cron expression or at \
                 a fixed interval",
            );
            ok = false;
        }
        (None, None) => {
            cx.error_at(
                Span::call_site(),
                "say when the schedule ticks: `cron = \"0 */5 * * * *\"` (with the seconds \
                 first) or `every_ms = 60_000`",
            );
            ok = false;
        }
        _ => {}
    }
    if let (Some(zone), None) = (&args.time_zone, &args.cron) {
        cx.error_spanned_by(
            zone,
            "`time_zone` applies to a cron expression; an interval counts real time, so leave \
             it out",
        );
        ok = false;
    }
    let id = match &args.id {
        Some(id) => match rules::check_handler_id(&id.value()) {
            Ok(()) => Some(id),
            Err(reason) => {
                cx.error_spanned_by(
                    id,
                    format_args!(
                        "invalid schedule id {:?}: {reason}; use 1 to 128 characters of ASCII \
                         letters, digits, `_`, `-`, `.` and `:`",
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
                "missing the schedule id: write `#[schedule(id = \"daily-report\", ..)]`; the id \
                 names the ticks' events, so keep it stable",
            );
            None
        }
    };
    id.filter(|_| ok)
}
