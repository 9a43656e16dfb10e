//! The arguments of `#[schedule]`, as parsed.

use proc_macro2::TokenStream;
use syn::{LitInt, LitStr, Path, parse::Parser};

use crate::{
    attr::{self, Arg},
    ctxt::Ctxt,
};

/// `#[schedule(id = "...", cron = "...", time_zone = "...", every_ms = N, each_missed = N,
/// catch_up_ms = N, crate = path)]`.
pub(super) struct Args {
    /// The schedule id, when it was given as a string literal.
    pub(super) id: Option<LitStr>,
    /// Whether `id` was given at all (a non-literal value was reported).
    pub(super) id_given: bool,
    pub(super) cron: Option<LitStr>,
    pub(super) time_zone: Option<LitStr>,
    pub(super) every_ms: Option<(LitInt, u64)>,
    /// Publish each missed tick, at most this many.
    pub(super) each_missed: Option<(LitInt, u32)>,
    pub(super) catch_up_ms: Option<(LitInt, u64)>,
    /// The path of the relaybus crate.
    pub(super) krate: Option<Path>,
}

const KNOWN: &str =
    "`id`, `cron`, `time_zone`, `every_ms`, `each_missed`, `catch_up_ms` or `crate`";

/// 366 days, the longest interval.
const MAX_INTERVAL_MS: u64 = 366 * 86_400_000;
/// 30 days, the longest catch-up window.
const MAX_CATCH_UP_MS: u64 = 30 * 86_400_000;

impl Args {
    /// Parses the arguments, reporting every problem to `cx`.
    pub(super) fn parse(cx: &Ctxt, tokens: TokenStream) -> Args {
        let mut id = Arg::new("id");
        let mut id_given = false;
        let mut cron = Arg::new("cron");
        let mut time_zone = Arg::new("time_zone");
        let mut every_ms = Arg::new("every_ms");
        let mut each_missed = Arg::new("each_missed");
        let mut catch_up_ms = Arg::new("catch_up_ms");
        let mut krate = Arg::new("crate");
        let parser = syn::meta::parser(|meta| {
            if meta.path.is_ident("id") {
                id_given = true;
                if let Some(lit) = attr::lit_str(cx, &meta, "\"daily-report\"")? {
                    id.set(cx, &meta, lit);
                }
            } else if meta.path.is_ident("cron") {
                if let Some(lit) = attr::lit_str(cx, &meta, "\"0 0 9 * * MON-FRI\"")? {
                    cron.set(cx, &meta, lit);
                }
            } else if meta.path.is_ident("time_zone") {
                if let Some(lit) = attr::lit_str(cx, &meta, "\"Europe/Paris\"")? {
                    time_zone.set(cx, &meta, lit);
                }
            } else if meta.path.is_ident("every_ms") {
                if let Some(value) = attr::lit_int(cx, &meta, "60_000", 1_000..=MAX_INTERVAL_MS)? {
                    every_ms.set(cx, &meta, value);
                }
            } else if meta.path.is_ident("each_missed") {
                if let Some(value) = attr::lit_int(cx, &meta, "10", 1..=1_000)? {
                    each_missed.set(cx, &meta, value);
                }
            } else if meta.path.is_ident("catch_up_ms") {
                if let Some(value) = attr::lit_int(cx, &meta, "3_600_000", 1_000..=MAX_CATCH_UP_MS)?
                {
                    catch_up_ms.set(cx, &meta, value);
                }
            } else if meta.path.is_ident("crate") {
                if let Some(path) = attr::crate_path(cx, &meta)? {
                    krate.set(cx, &meta, path);
                }
            } else {
                attr::unknown(cx, &meta, KNOWN)?;
            }
            Ok(())
        });
        if let Err(error) = parser.parse2(tokens) {
            cx.syn_error(error);
        }
        Args {
            id: id.get(),
            id_given,
            cron: cron.get(),
            time_zone: time_zone.get(),
            every_ms: every_ms.get(),
            each_missed: each_missed.get(),
            catch_up_ms: catch_up_ms.get(),
            krate: krate.get(),
        }
    }
}
