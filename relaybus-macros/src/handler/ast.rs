//! The arguments of `#[handler]`, as parsed.

use proc_macro2::TokenStream;
use syn::{LitInt, LitStr, Path, parse::Parser};

use crate::{
    attr::{self, Arg},
    ctxt::Ctxt,
};

/// The longest wait the retry options accept, in milliseconds: a day, as in
/// `RetryPolicy::validate`.
const MAX_BACKOFF_MS: u64 = 86_400_000;

/// `#[handler(id = "...", transactional, unordered, max_attempts = N, initial_backoff_ms = N,
/// max_backoff_ms = N, timeout_ms = N, global_concurrency = N, rate_limit = N,
/// rate_interval_ms = N, batch, max_batch = N, batch_wait_ms = N, crate = path)]`.
pub(super) struct Args {
    /// The handler id, when it was given as a string literal.
    pub(super) id: Option<LitStr>,
    /// Whether `id` was given at all (a non-literal value was reported).
    pub(super) id_given: bool,
    pub(super) transactional: bool,
    /// Whether the handler's deliveries ignore the event's ordering key.
    pub(super) unordered: bool,
    pub(super) max_attempts: Option<(LitInt, u32)>,
    pub(super) initial_backoff_ms: Option<(LitInt, u64)>,
    pub(super) max_backoff_ms: Option<(LitInt, u64)>,
    /// How long one attempt may run.
    pub(super) timeout_ms: Option<(LitInt, u64)>,
    /// At most this many runs at once across every bus.
    pub(super) global_concurrency: Option<(LitInt, u32)>,
    /// At most this many starts per `rate_interval_ms` (1 s unless given).
    pub(super) rate_limit: Option<(LitInt, u32)>,
    pub(super) rate_interval_ms: Option<(LitInt, u64)>,
    /// A batch handler: it takes a `Batch<E>`.
    pub(super) batch: bool,
    pub(super) max_batch: Option<(LitInt, usize)>,
    pub(super) batch_wait_ms: Option<(LitInt, u64)>,
    /// The path of the relaybus crate.
    pub(super) krate: Option<Path>,
}

const KNOWN: &str = "`id`, `transactional`, `unordered`, `max_attempts`, \
                     `initial_backoff_ms`, `max_backoff_ms`, `timeout_ms`, \
                     `global_concurrency`, `rate_limit`, `rate_interval_ms`, `batch`, \
                     `max_batch`, `batch_wait_ms` or `crate`";

impl Args {
    /// Parses the arguments, reporting every problem to `cx`.
    pub(super) fn parse(cx: &Ctxt, tokens: TokenStream) -> Args {
        let mut id = Arg::new("id");
        let mut id_given = false;
        let mut transactional = Arg::new("transactional");
        let mut unordered = Arg::new("unordered");
        let mut max_attempts = Arg::new("max_attempts");
        let mut initial_backoff_ms = Arg::new("initial_backoff_ms");
        let mut max_backoff_ms = Arg::new("max_backoff_ms");
        let mut timeout_ms = Arg::new("timeout_ms");
        let mut global_concurrency = Arg::new("global_concurrency");
        let mut rate_limit = Arg::new("rate_limit");
        let mut rate_interval_ms = Arg::new("rate_interval_ms");
        let mut batch = Arg::new("batch");
        let mut max_batch = Arg::new("max_batch");
        let mut batch_wait_ms = Arg::new("batch_wait_ms");
        let mut krate = Arg::new("crate");
        let parser = syn::meta::parser(|meta| {
            if meta.path.is_ident("id") {
                id_given = true;
                if let Some(lit) = attr::lit_str(cx, &meta, "\"projector\"")? {
                    id.set(cx, &meta, lit);
                }
            } else if meta.path.is_ident("transactional") {
                attr::flag(cx, &meta)?;
                transactional.set(cx, &meta, ());
            } else if meta.path.is_ident("unordered") {
                attr::flag(cx, &meta)?;
                unordered.set(cx, &meta, ());
            } else if meta.path.is_ident("max_attempts") {
                if let Some(value) = attr::lit_int(cx, &meta, "5", 1..=1000)? {
                    max_attempts.set(cx, &meta, value);
                }
            } else if meta.path.is_ident("initial_backoff_ms") {
                if let Some(value) = attr::lit_int(cx, &meta, "500", 1..=MAX_BACKOFF_MS)? {
                    initial_backoff_ms.set(cx, &meta, value);
                }
            } else if meta.path.is_ident("max_backoff_ms") {
                if let Some(value) = attr::lit_int(cx, &meta, "60_000", 1..=MAX_BACKOFF_MS)? {
                    max_backoff_ms.set(cx, &meta, value);
                }
            } else if meta.path.is_ident("timeout_ms") {
                if let Some(value) = attr::lit_int(cx, &meta, "30_000", 1..=MAX_BACKOFF_MS)? {
                    timeout_ms.set(cx, &meta, value);
                }
            } else if meta.path.is_ident("global_concurrency") {
                if let Some(value) = attr::lit_int(cx, &meta, "4", 1..=10_000)? {
                    global_concurrency.set(cx, &meta, value);
                }
            } else if meta.path.is_ident("rate_limit") {
                if let Some(value) = attr::lit_int(cx, &meta, "50", 1..=u32::MAX)? {
                    rate_limit.set(cx, &meta, value);
                }
            } else if meta.path.is_ident("rate_interval_ms") {
                if let Some(value) = attr::lit_int(cx, &meta, "1_000", 1..=MAX_BACKOFF_MS)? {
                    rate_interval_ms.set(cx, &meta, value);
                }
            } else if meta.path.is_ident("batch") {
                attr::flag(cx, &meta)?;
                batch.set(cx, &meta, ());
            } else if meta.path.is_ident("max_batch") {
                if let Some(value) = attr::lit_int(cx, &meta, "100", 1..=1_000)? {
                    max_batch.set(cx, &meta, value);
                }
            } else if meta.path.is_ident("batch_wait_ms") {
                if let Some(value) = attr::lit_int(cx, &meta, "50", 0..=60_000)? {
                    batch_wait_ms.set(cx, &meta, value);
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
            transactional: transactional.get().is_some(),
            unordered: unordered.get().is_some(),
            max_attempts: max_attempts.get(),
            initial_backoff_ms: initial_backoff_ms.get(),
            max_backoff_ms: max_backoff_ms.get(),
            timeout_ms: timeout_ms.get(),
            global_concurrency: global_concurrency.get(),
            rate_limit: rate_limit.get(),
            rate_interval_ms: rate_interval_ms.get(),
            batch: batch.get().is_some(),
            max_batch: max_batch.get(),
            batch_wait_ms: batch_wait_ms.get(),
            krate: krate.get(),
        }
    }
}
