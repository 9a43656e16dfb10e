//! What every relay's subscription does first: take the event as stored, payload untouched,
//! and rebuild its envelope from the delivery's context.

use std::marker::PhantomData;

use serde::{Deserialize, Serialize};

use crate::{
    event::{Event, EventEnvelope},
    handler::HandlerContext,
    store::Store,
};

/// The payload of an event of type `E` as stored, forwarded without going through `E`, so that
/// fields `E` does not know survive the relay.
#[derive(Serialize, Deserialize)]
#[serde(transparent, bound = "")]
pub(crate) struct Forwarded<E> {
    payload: serde_json::Map<String, serde_json::Value>,
    #[serde(skip)]
    event: PhantomData<fn() -> E>,
}

impl<E: Event> Event for Forwarded<E> {
    const TYPE: &'static str = E::TYPE;
}

impl<E> Forwarded<E> {
    /// The event's envelope as it was published: its id, type, payload, key, correlation and
    /// causation ids, headers and creation time.
    pub(crate) fn envelope<S: Store>(self, context: &HandlerContext<S>) -> EventEnvelope {
        EventEnvelope {
            id: context.event_id().to_owned(),
            event_type: context.event_type().to_owned(),
            payload: self.payload,
            key: context.key().map(str::to_owned),
            correlation_id: context.correlation_id().map(str::to_owned),
            causation_id: context.causation_id().map(str::to_owned),
            headers: context.headers().clone(),
            created_at: context.created_at(),
        }
    }
}
