//! Limits across buses: the slots of a handler's global concurrency and the start counters of
//! its rate limit, kept in the store so that every bus of the database shares them.

use std::{future::Future, time::Duration};

use crate::{error::Result, time::Timestamp};

/// The most slots a handler's global concurrency may have.
pub const MAX_GLOBAL_CONCURRENCY: u32 = 10_000;

/// What the dispatcher asks of a store to hold a handler's limits across every bus of the
/// database: slots for [`Subscription::global_concurrency`](crate::Subscription::global_concurrency)
/// and start counters for [`Subscription::rate_limit`](crate::Subscription::rate_limit).
///
/// # Slots
///
/// A handler limited to `n` runs at once has `n` slots, numbered `0..n`. A bus takes one
/// before it runs a delivery of the handler and gives it back after; a slot it holds is a
/// lease that ends at `expires_at` unless renewed, so a bus that dies holding slots gives them
/// back within its lease duration. Each slot is one document or row, taken only when it is
/// free (never taken, given back, or expired) by a conditional write: two buses never hold
/// one slot at once, whatever the timing.
///
/// # Start counters
///
/// A handler limited to `r` starts per `interval` has one counter, for the current window of
/// `interval` (windows start at multiples of `interval` since the Unix epoch). A bus takes
/// starts in one write, as many as it has deliveries waiting, while the window's count stays
/// at most `r`; a bus that gets none learns when the window ends. See
/// [`take_starts`](Self::take_starts).
///
/// Every time is the caller's (`now`), like the queue's: every bus of a database should run
/// on clocks that agree to well within a lease.
pub trait Limits {
    /// Takes a free slot of `request.handler`, one of `0..request.limit`, for
    /// `request.lease_duration` from `request.now`. `None` when every one of them is held.
    ///
    /// # Errors
    ///
    /// [`Error::Database`](crate::Error::Database) when the store cannot be reached.
    fn take_slot(
        &self,
        request: SlotRequest<'_>,
    ) -> impl Future<Output = Result<Option<Slot>>> + Send;

    /// Extends the slots' leases to `until`; how many of them were still held by their holder
    /// (the others expired and may have been taken by another bus).
    fn renew_slots(
        &self,
        slots: &[Slot],
        until: Timestamp,
    ) -> impl Future<Output = Result<usize>> + Send;

    /// Gives a slot back; `false` when its holder no longer held it.
    fn give_back_slot(&self, slot: &Slot) -> impl Future<Output = Result<bool>> + Send;

    /// Takes up to `request.wanted` starts of `request.handler` in the window of
    /// `request.interval` that holds `request.now`, of the `request.rate` the window allows: how
    /// many it got (0 when the window is full), and the end of the window, when the next one
    /// opens. Starts taken and not used are lost.
    fn take_starts(
        &self,
        request: StartsRequest<'_>,
    ) -> impl Future<Output = Result<(u32, Timestamp)>> + Send;
}

/// What one [`Limits::take_starts`] asks for.
#[derive(Debug, Clone, Copy)]
pub struct StartsRequest<'a> {
    /// The handler whose starts they are.
    pub handler: &'a str,
    /// How many starts the bus would use now.
    pub wanted: u32,
    /// How many starts a window allows in all.
    pub rate: u32,
    /// The length of a window.
    pub interval: Duration,
    /// The current time.
    pub now: Timestamp,
}

/// What one [`Limits::take_slot`] asks for.
#[derive(Debug, Clone, Copy)]
pub struct SlotRequest<'a> {
    /// The handler whose slot it is.
    pub handler: &'a str,
    /// How many slots the handler has.
    pub limit: u32,
    /// Who holds it: the bus's owner name, for operators.
    pub owner: &'a str,
    /// How long it holds the slot without renewal.
    pub lease_duration: Duration,
    /// The current time.
    pub now: Timestamp,
}

/// A slot held: renew it with [`Limits::renew_slots`], give it back with
/// [`Limits::give_back_slot`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Slot {
    /// The handler.
    pub handler: String,
    /// Which of its slots, from 0.
    pub index: u32,
    /// What this taking of the slot wrote as its holder: the proof that it still holds it.
    pub holder: String,
}

impl Slot {
    /// A slot taken now by `owner`, with a fresh holder token.
    #[cfg(any(feature = "mongodb", feature = "postgres", feature = "memory"))]
    pub(crate) fn taken(handler: &str, index: u32, owner: &str) -> Self {
        Slot {
            handler: handler.to_owned(),
            index,
            holder: format!("{owner}/{:016x}", rand::random::<u64>()),
        }
    }

    /// The slot's id in stores that keep it as one document: `slot:<handler>#<index>` (`#`
    /// is not allowed in handler ids).
    #[cfg(feature = "mongodb")]
    pub(crate) fn document_id(handler: &str, index: u32) -> String {
        format!("slot:{handler}#{index}")
    }
}

/// The start of the window of `interval` holding `now`, and its end.
#[cfg(any(feature = "mongodb", feature = "postgres", feature = "memory"))]
pub(crate) fn rate_window(interval: Duration, now: Timestamp) -> (i64, Timestamp) {
    let length = i64::try_from(interval.as_millis())
        .unwrap_or(i64::MAX)
        .max(1);
    let at = now.timestamp_millis();
    let start = at - at.rem_euclid(length);
    (start, Timestamp::from_millis(start.saturating_add(length)))
}

#[cfg(all(
    test,
    any(feature = "mongodb", feature = "postgres", feature = "memory")
))]
mod tests {
    use super::*;

    #[test]
    fn windows_start_at_multiples_of_the_interval() {
        let (start, end) = rate_window(Duration::from_secs(1), Timestamp::from_millis(12_345));
        assert_eq!(start, 12_000);
        assert_eq!(end, Timestamp::from_millis(13_000));
        let (start, _) = rate_window(Duration::from_secs(1), Timestamp::from_millis(13_000));
        assert_eq!(start, 13_000);
    }
}
