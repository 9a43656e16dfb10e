//! The default store type when the `mongodb` feature is off: a type with no values, which
//! implements the store traits only so that it can be the default type parameter.

use std::time::Duration;

use futures::stream::BoxStream;

use super::{
    Append, AppendRequest, Appended, Buried, ClaimRequest, Claimed, ConsumerPositions,
    DeadLetterGroup, DeliveryQuery, DeliveryRecord, Discarded, EventDetail, HandlerStatistics,
    IdempotentRequests, Inspect, LaneReport, Lead, Leadership, Limits, Operate, PositionKey,
    PurgeOptions, Purged, Queue, RequestKey, RequestKeyState, Requeued, Slot, SlotRequest,
    StartsRequest, Statistics, Store, StoreLease, StoredResponse, Transactions, WakeUp,
};
use crate::{
    error::{ConfigurationError, Result},
    time::Timestamp,
};

/// A store type with no values: the default type parameter when the `mongodb` feature is off,
/// so that the default can never be used by mistake. Its methods cannot be called (there is no
/// value to call them on); were one called, it would fail with [`NoStore::error`].
#[derive(Debug, Clone, Copy)]
pub enum NoStore {}

impl NoStore {
    /// The error of every method: the default store needs the `mongodb` feature.
    pub fn error() -> ConfigurationError {
        ConfigurationError::InvalidOption {
            option: "store",
            reason: "no store type was named, and the default store (MongoDB) needs the \
                     `mongodb` feature; enable it, or name a store type, as in \
                     `RelayBus<MemoryEventStore>`"
                .to_owned(),
        }
    }
}

/// What a method of [`NoStore`] returns: [`NoStore::error`] where it returns a `Result`.
trait Unavailable {
    fn unavailable() -> Self;
}

impl<T> Unavailable for Result<T> {
    fn unavailable() -> Self {
        Err(NoStore::error().into())
    }
}

/// `abort`: there is nothing to abort.
impl Unavailable for () {
    fn unavailable() {}
}

/// `is_transient`: no error comes from a store that is not there.
impl Unavailable for bool {
    fn unavailable() -> Self {
        false
    }
}

/// Implements store traits for [`NoStore`] from their items' signatures alone: every method
/// returns [`Unavailable::unavailable`].
macro_rules! unavailable {
    ($(impl $trait:ident {
        $(const $constant:ident: $constant_type:ty = $value:expr;)*
        $(type $assoc:ident = $assoc_type:ty;)*
        $(async fn $method:ident(&self $(, $arg:ty)*) $(-> $output:ty)?;)*
        $(fn $function:ident($($function_arg:ty),*) -> $function_output:ty;)*
    })*) => {
        $(impl $trait for NoStore {
            $(const $constant: $constant_type = $value;)*
            $(type $assoc = $assoc_type;)*
            $(async fn $method(&self $(, _: $arg)*) $(-> $output)? {
                Unavailable::unavailable()
            })*
            $(fn $function($(_: $function_arg),*) -> $function_output {
                Unavailable::unavailable()
            })*
        })*
    };
}

impl StoreLease for NoStore {
    type DeliveryId = String;

    fn delivery_id(&self) -> String {
        match *self {}
    }
}

unavailable! {
    impl Store {
        const NAME: &'static str = "no";
        async fn setup(&self) -> Result<()>;
    }

    impl Transactions {
        type Session = NoStore;
        async fn session(&self) -> Result<NoStore>;
        async fn begin(&self, &mut NoStore, Option<Duration>) -> Result<()>;
        async fn commit(&self, &mut NoStore) -> Result<()>;
        async fn abort(&self, &mut NoStore);
        async fn ensure_in_transaction(&self, &mut NoStore, &'static str) -> Result<()>;
        fn is_transient(&(dyn std::error::Error + 'static)) -> bool;
    }

    impl Append {
        async fn append(&self, &mut NoStore, &[AppendRequest<'_>], Timestamp)
            -> Result<Vec<Appended>>;
        async fn append_in_transaction(&self, &mut NoStore, &[AppendRequest<'_>], Timestamp)
            -> Result<Vec<Appended>>;
    }

    impl ConsumerPositions {
        async fn consumer_position(&self, &mut NoStore, &PositionKey<'_>) -> Result<Option<i64>>;
        async fn advance_consumer_position(&self, &mut NoStore, &PositionKey<'_>, i64, Timestamp)
            -> Result<()>;
    }

    impl IdempotentRequests {
        async fn take_request_key(&self, &mut NoStore, &RequestKey<'_>, Timestamp)
            -> Result<RequestKeyState>;
        async fn store_response(&self, &mut NoStore, &RequestKey<'_>, &StoredResponse)
            -> Result<()>;
    }

    impl Queue {
        type Lease = NoStore;
        async fn claim(&self, ClaimRequest<'_>) -> Result<Vec<Claimed<NoStore>>>;
        async fn complete(&self, &[NoStore], Timestamp) -> Result<Vec<bool>>;
        async fn complete_in_transaction(&self, &mut NoStore, &NoStore, Timestamp) -> Result<bool>;
        async fn release(&self, &NoStore, Timestamp) -> Result<bool>;
        async fn reschedule(&self, &NoStore, Timestamp, &str, Timestamp) -> Result<bool>;
        async fn bury(&self, &NoStore, &str, Timestamp) -> Result<bool>;
        async fn renew(&self, &[NoStore], Duration, Timestamp) -> Result<usize>;
        async fn relinquish(&self, &str) -> Result<u64>;
        async fn watch(&self, &[String]) -> Result<BoxStream<'static, Result<WakeUp>>>;
    }

    impl Inspect {
        async fn statistics(&self) -> Result<Statistics>;
        async fn handler_statistics(&self) -> Result<Vec<HandlerStatistics>>;
        async fn list_deliveries(&self, &DeliveryQuery) -> Result<Vec<DeliveryRecord>>;
        async fn event_detail(&self, &str) -> Result<Option<EventDetail>>;
        async fn lanes(&self) -> Result<LaneReport>;
        async fn dead_letter_groups(&self, Option<&str>) -> Result<Vec<DeadLetterGroup>>;
    }

    impl Operate {
        async fn purge(&self, &PurgeOptions) -> Result<Purged>;
        async fn discard(&self, &[String], Timestamp) -> Result<Discarded>;
        async fn bury_by_id(&self, &[String], &str, Timestamp) -> Result<Buried>;
        async fn requeue(&self, &[String], Timestamp) -> Result<Requeued>;
    }

    impl Leadership {
        async fn lead(&self, &str, Duration) -> Result<bool>;
        async fn keep_lead(&self, &mut NoStore, &str, Duration) -> Result<bool>;
        async fn leads(&self, &str) -> Result<Vec<Lead>>;
        async fn resign(&self, &str) -> Result<()>;
    }

    impl Limits {
        async fn take_slot(&self, SlotRequest<'_>) -> Result<Option<Slot>>;
        async fn renew_slots(&self, &[Slot], Timestamp) -> Result<usize>;
        async fn give_back_slot(&self, &Slot) -> Result<bool>;
        async fn take_starts(&self, StartsRequest<'_>) -> Result<(u32, Timestamp)>;
    }
}

#[cfg(test)]
mod tests {
    use super::NoStore;

    #[test]
    fn the_error_names_the_missing_feature() {
        let message = crate::Error::from(NoStore::error()).to_string();
        assert!(message.contains("`mongodb` feature"), "{message}");
    }
}
