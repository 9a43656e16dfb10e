//! Appending: the outbox write, events with their deliveries in the caller's transaction.

use std::future::Future;

use super::{AppendRequest, Appended, Transactions};
#[cfg(any(feature = "memory", feature = "mongodb"))]
use crate::{error::EventValidationError, event::EventEnvelope, handler::validate_handler_id};
use crate::{error::Result, time::Timestamp};

/// Appends events with their deliveries, in the caller's transaction: what the bus's publish
/// and the transports' consumers use.
pub trait Append: Transactions {
    /// Appends events with their deliveries in the caller's transaction. An event id the
    /// store holds gets only the deliveries of handlers new to it.
    ///
    /// The requests are validated first, then a session without a started transaction is
    /// refused ([`ConfigurationError::NoTransaction`](crate::ConfigurationError::NoTransaction));
    /// nothing is written in either case.
    fn append(
        &self,
        session: &mut Self::Session,
        requests: &[AppendRequest<'_>],
        now: Timestamp,
    ) -> impl Future<Output = Result<Vec<Appended>>> + Send;

    /// As [`append`](Self::append), in a transaction the caller started with
    /// [`begin`](Transactions::begin), so the session need not be checked: a store whose
    /// check costs a round trip skips it here. By default, [`append`](Self::append).
    fn append_in_transaction(
        &self,
        session: &mut Self::Session,
        requests: &[AppendRequest<'_>],
        now: Timestamp,
    ) -> impl Future<Output = Result<Vec<Appended>>> + Send {
        self.append(session, requests, now)
    }
}

/// An event of an append batch with the handlers its requests ask for.
#[cfg(any(feature = "memory", feature = "mongodb"))]
#[derive(Debug)]
pub(crate) struct Merged<'a> {
    pub(crate) event: &'a EventEnvelope,
    pub(crate) handlers: Vec<&'a str>,
    /// The handlers among them whose deliveries ignore the key: those that every request of
    /// the event named unordered.
    pub(crate) unordered: Vec<&'a str>,
    /// When its new deliveries are due, if not at the append's time: as its first request says.
    pub(crate) due_at: Option<Timestamp>,
}

/// Validates a batch before anything is written: every handler id well-formed, and an id named
/// twice only for one event type. The requests of one id merge into one event: the union of
/// the handlers, unordered only where every request says so.
#[cfg(any(feature = "memory", feature = "mongodb"))]
pub(crate) fn merge<'a>(requests: &[AppendRequest<'a>]) -> Result<Vec<Merged<'a>>> {
    let mut merged: Vec<Merged<'a>> = Vec::with_capacity(requests.len());
    let mut index_of: std::collections::HashMap<&'a str, usize> = std::collections::HashMap::new();
    for request in requests {
        for handler in request.handlers {
            validate_handler_id(handler)?;
        }
        let event = request.event;
        match index_of.get(event.id()).and_then(|at| merged.get_mut(*at)) {
            Some(known) => known.merge(request)?,
            None => {
                index_of.insert(event.id(), merged.len());
                merged.push(Merged::first(request));
            }
        }
    }
    Ok(merged)
}

#[cfg(any(feature = "memory", feature = "mongodb"))]
impl<'a> Merged<'a> {
    /// The event as its first request asks for it, each handler once.
    fn first(request: &AppendRequest<'a>) -> Self {
        let mut handlers: Vec<&str> = Vec::with_capacity(request.handlers.len());
        let mut unordered: Vec<&str> = Vec::new();
        for handler in request.handlers {
            if !handlers.contains(&handler.as_str()) {
                handlers.push(handler);
                if request.unordered.contains(handler) {
                    unordered.push(handler);
                }
            }
        }
        Merged {
            event: request.event,
            handlers,
            unordered,
            due_at: request.due_at,
        }
    }

    /// Adds another request of the same id: refused for another event type.
    fn merge(&mut self, request: &AppendRequest<'a>) -> Result<()> {
        let event = request.event;
        if self.event.event_type() != event.event_type() {
            return Err(EventValidationError::IdReused {
                id: event.id().to_owned(),
                existing_type: self.event.event_type().to_owned(),
                event_type: event.event_type().to_owned(),
            }
            .into());
        }
        for handler in request.handlers {
            let unordered = request.unordered.contains(handler);
            if !self.handlers.contains(&handler.as_str()) {
                self.handlers.push(handler);
                if unordered {
                    self.unordered.push(handler);
                }
            } else if !unordered {
                // Held to the key's order by one request: ordered.
                self.unordered.retain(|h| h != handler);
            }
        }
        Ok(())
    }
}
