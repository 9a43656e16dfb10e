//! What every consumer does with a batch of message bodies: read the events, append them in
//! one transaction of the local store, and say what becomes of each message.

use std::collections::{HashMap, HashSet};

use crate::{
    bus::RelayBus,
    error::Error,
    event::EventEnvelope,
    store::{Appended, Store},
    transport::wire,
};

/// What becomes of one message of a batch.
#[derive(Debug)]
pub(crate) enum Fate {
    /// Read, to be appended.
    Decoded(EventEnvelope),
    /// Appended (or held already): acknowledge.
    Appended(Appended),
    /// Not a relaybus event: dead-letter with this reason.
    Unreadable(String),
    /// The append failed: give it back to the broker, to be redelivered.
    Retry,
}

/// Reads the bodies' events and appends them, in order, in one transaction of `bus`'s store;
/// when the transaction fails, one at a time, in order, up to the first that fails for a
/// reason other than the event itself. Returns each body's fate, and the error that stopped
/// the appends, if any.
pub(crate) async fn append<'a, S: Store>(
    bus: &RelayBus<S>,
    bodies: impl Iterator<Item = &'a [u8]>,
) -> (Vec<Fate>, Option<String>) {
    let mut fates: Vec<Fate> = bodies
        .map(|body| match wire::decode(body) {
            Ok(decoded) => Fate::Decoded(decoded.envelope),
            Err(reason) => Fate::Unreadable(reason),
        })
        .collect();
    // A batch may hold one event twice (the relay sent it twice): append it once; the later
    // copy is a duplicate of it.
    let mut ids = HashSet::new();
    let envelopes: Vec<EventEnvelope> = fates
        .iter()
        .filter_map(|fate| match fate {
            Fate::Decoded(envelope) if ids.insert(envelope.id().to_owned()) => {
                Some(envelope.clone())
            }
            _ => None,
        })
        .collect();
    let mut last_error = None;
    if !envelopes.is_empty() {
        match bus.publish_all(envelopes).await {
            Ok(appended) => {
                let mut first: HashMap<String, Appended> = appended
                    .into_iter()
                    .map(|appended| (appended.event_id.clone(), appended))
                    .collect();
                let mut repeats: HashMap<String, Appended> = HashMap::new();
                for fate in &mut fates {
                    let Fate::Decoded(envelope) = fate else {
                        continue;
                    };
                    let id = envelope.id();
                    *fate = if let Some(appended) = first.remove(id) {
                        let repeat = Appended {
                            created: false,
                            new_deliveries: Vec::new(),
                            ..appended.clone()
                        };
                        repeats.insert(id.to_owned(), repeat);
                        Fate::Appended(appended)
                    } else {
                        repeats.get(id).cloned().map_or(Fate::Retry, Fate::Appended)
                    };
                }
            }
            Err(error) => {
                tracing::debug!(%error, "appending the batch failed; appending one by one");
                last_error = append_one_by_one(bus, &mut fates).await;
            }
        }
    }
    (fates, last_error)
}

/// Appends the decoded events one at a time, in order; returns the error that stopped it.
async fn append_one_by_one<S: Store>(bus: &RelayBus<S>, fates: &mut [Fate]) -> Option<String> {
    let mut stopped: Option<String> = None;
    for fate in fates.iter_mut() {
        let Fate::Decoded(envelope) = fate else {
            continue;
        };
        if stopped.is_some() {
            *fate = Fate::Retry;
            continue;
        }
        let id = envelope.id().to_owned();
        match bus.publish_envelope(envelope.clone()).await {
            Ok(appended) => *fate = Fate::Appended(appended),
            Err(error @ (Error::EventValidation(_) | Error::InvalidArgument(_))) => {
                *fate = Fate::Unreadable(format!(
                    "the local store refuses event {id:?} for good: {error}"
                ));
            }
            Err(error) => {
                *fate = Fate::Retry;
                stopped = Some(error.to_string());
            }
        }
    }
    stopped
}
