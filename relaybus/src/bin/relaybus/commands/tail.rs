//! `relaybus tail`: new deliveries as they commit, woken by the store's wake-up stream.
//!
//! A wake-up says that deliveries committed, not which: each one (and a poll every five
//! seconds, for when the stream is down or a handler is new) lists the deliveries created
//! lately and prints those not printed before. A delivery that completes and is deleted before
//! it is listed is not shown.

use std::{
    collections::HashMap,
    process::ExitCode,
    time::{Duration, Instant},
};

use futures::{StreamExt, stream::BoxStream};
use relaybus::{DeliveryQuery, DeliveryRecord, Timestamp, store::Administration, store::WakeUp};

use crate::{failure::Failure, output, selection};

/// How long after the last wake-up the deliveries are listed again anyway.
const POLL: Duration = Duration::from_secs(5);
/// How far back each look reaches: a delivery's creation time is its publisher's clock, and
/// its commit comes after it.
const LOOK_BACK: Duration = Duration::from_secs(30);
/// How often the handlers watched are read again, when not named.
const REFRESH: Duration = Duration::from_secs(10);

type WakeUps = BoxStream<'static, relaybus::Result<WakeUp>>;

pub(super) async fn run<S: Administration>(
    store: &S,
    json: bool,
    named: &[String],
) -> Result<ExitCode, Failure> {
    for handler in named {
        relaybus::validate_handler_id(handler)
            .map_err(|e| Failure::BadInput(format!("--handler {handler:?}: {e}")))?;
    }
    let mut handlers = if named.is_empty() {
        store.handler_ids().await?
    } else {
        named.to_vec()
    };
    let mut tail = Tail {
        named: named.to_vec(),
        seen: HashMap::new(),
        json,
    };
    // What is there already is not new.
    tail.look(store, false).await?;
    // Said once the wake-up stream listens: what commits from then on is shown at once.
    let mut wake_ups: Option<WakeUps> = store.watch(&handlers).await.ok();
    eprintln!("relaybus: following new deliveries (Ctrl-C stops)");
    // What committed between the first look and the stream's opening.
    tail.look(store, true).await?;
    let mut refreshed = Instant::now();
    loop {
        match wake_ups.as_mut() {
            Some(stream) => {
                tokio::select! {
                    next = stream.next() => if !matches!(next, Some(Ok(_))) {
                        wake_ups = None;
                    },
                    () = tokio::time::sleep(POLL) => {}
                }
            }
            None => tokio::time::sleep(POLL).await,
        }
        tail.look(store, true).await?;
        if named.is_empty() && refreshed.elapsed() >= REFRESH {
            refreshed = Instant::now();
            let now_known = store.handler_ids().await?;
            if now_known != handlers {
                handlers = now_known;
                wake_ups = None;
            }
        }
        if wake_ups.is_none() {
            wake_ups = store.watch(&handlers).await.ok();
        }
    }
}

struct Tail {
    named: Vec<String>,
    /// The deliveries printed, or there before the tail began, with their creation times.
    seen: HashMap<String, Timestamp>,
    json: bool,
}

impl Tail {
    /// Lists the deliveries created lately and prints those not seen yet, when `print`.
    async fn look<S: Administration>(&mut self, store: &S, print: bool) -> Result<(), Failure> {
        let from = Timestamp::now().saturating_sub(LOOK_BACK);
        let base = DeliveryQuery::new().created_from(from);
        let mut after: Option<String> = None;
        loop {
            let mut page = base.clone().limit(selection::PAGE);
            if let Some(after) = &after {
                page = page.after(after.clone());
            }
            let records = store.list_deliveries(&page).await?;
            let full = records.len() == selection::PAGE as usize;
            after = records.last().map(|r| r.id.clone());
            for record in records {
                if self.seen.contains_key(&record.id) {
                    continue;
                }
                let created = record.created_at.unwrap_or_else(Timestamp::now);
                self.seen.insert(record.id.clone(), created);
                let wanted = self.named.is_empty() || self.named.contains(&record.handler);
                if print && wanted {
                    self.print(&record);
                }
            }
            if !full {
                break;
            }
        }
        // What no look reaches any more cannot come again.
        let oldest = from.saturating_sub(LOOK_BACK);
        self.seen.retain(|_, created| *created >= oldest);
        Ok(())
    }

    fn print(&self, record: &DeliveryRecord) {
        if self.json {
            output::json_line(&output::record_json(record));
        } else {
            println!(
                "{}  {}  event {}  key {}  handler {}  {}",
                output::time(record.created_at),
                record.event_type,
                record.event_id,
                output::text(record.key.as_deref()),
                record.handler,
                output::state(record),
            );
        }
    }
}
