//! What every consumer does with a batch of messages: read the events, dead-letter what cannot
//! be read, append the events in one transaction of the local store (with the consumer's
//! position, for a broker that keeps none), and say what becomes of each message.

use std::collections::{HashMap, HashSet};

use futures::future::BoxFuture;

use super::broker::{Broker, LeadLost, Position, Settlement};
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
    /// Behind the stored position: another consumer of that position took it already.
    Behind,
    /// Not a relaybus event, or refused by the store for good: published to the dead-letter
    /// destination.
    DeadLettered,
    /// Could not be read nor dead-lettered: given up.
    Discarded,
    /// The append failed: taken again later.
    Retry,
}

impl Fate {
    pub(crate) fn settlement(&self) -> Settlement {
        match self {
            Fate::Appended(_) | Fate::Behind | Fate::DeadLettered => Settlement::Ack,
            Fate::Discarded => Settlement::Discard,
            Fate::Decoded(_) | Fate::Retry => Settlement::Retry,
        }
    }
}

/// Reads the messages' events and appends them, in order, in one transaction of `bus`'s store
/// (with the broker's position after the batch, if it keeps one there); when the transaction
/// fails, one at a time, in order, up to the first that fails for a reason other than the
/// event itself. Messages that cannot be read, and events the store refuses for good, are
/// dead-lettered before any position moves past them. Returns each message's fate, and the
/// error that stopped the appends, if any.
pub(crate) async fn append<B: Broker, S: Store>(
    broker: &B,
    hold: &mut B::Hold,
    bus: &RelayBus<S>,
    messages: &[B::Message],
) -> (Vec<Fate>, Option<String>) {
    let Some(last) = messages.last() else {
        return (Vec::new(), None);
    };
    let next = B::offset(last) + 1;
    let mut fates = Vec::with_capacity(messages.len());
    for message in messages {
        fates.push(match B::body(message).map(wire::decode) {
            Ok(Ok(decoded)) => Fate::Decoded(decoded.envelope),
            Ok(Err(reason)) => dead_letter(broker, hold, message, &reason).await,
            Err(reason) => dead_letter(broker, hold, message, reason).await,
        });
    }
    let events: Vec<(i64, EventEnvelope)> = messages
        .iter()
        .zip(&fates)
        .filter_map(|(message, fate)| match fate {
            Fate::Decoded(envelope) => Some((B::offset(message), envelope.clone())),
            _ => None,
        })
        .collect();
    if events.is_empty() && broker.position().is_none() {
        return (fates, None);
    }
    match commit(bus, broker.position(), events, next).await {
        Ok(committed) => {
            settle_appended::<B>(messages, &mut fates, committed);
            (fates, None)
        }
        Err(error) if broker.position().is_some_and(Position::lost) => {
            // Another process reads the partition now: nothing more of it is appended here.
            for fate in &mut fates {
                if matches!(fate, Fate::Decoded(_)) {
                    *fate = Fate::Retry;
                }
            }
            (fates, Some(error.to_string()))
        }
        Err(error) => {
            tracing::debug!(%error, "appending the batch failed; appending one by one");
            let last_error = one_by_one(broker, hold, bus, messages, &mut fates, next).await;
            (fates, last_error)
        }
    }
}

/// Dead-letters one message; gives it up when that fails.
async fn dead_letter<B: Broker>(
    broker: &B,
    hold: &mut B::Hold,
    message: &B::Message,
    reason: &str,
) -> Fate {
    match broker.dead_letter(hold, message, reason).await {
        Ok(()) => Fate::DeadLettered,
        Err(error) => {
            tracing::error!(
                source = broker.source(),
                reason,
                %error,
                "a message that cannot be appended could not be dead-lettered; discarding it"
            );
            Fate::Discarded
        }
    }
}

/// Appends the decoded events one at a time, in order, each with the position after it;
/// returns the error that stopped it.
async fn one_by_one<B: Broker, S: Store>(
    broker: &B,
    hold: &mut B::Hold,
    bus: &RelayBus<S>,
    messages: &[B::Message],
    fates: &mut [Fate],
    next: i64,
) -> Option<String> {
    let position = broker.position();
    let mut stopped: Option<String> = None;
    // Where the stored position stands after the last commit, when this pass moved it.
    let mut stored = None;
    for (at, message) in messages.iter().enumerate() {
        let Fate::Decoded(envelope) = &fates[at] else {
            continue;
        };
        if stopped.is_some() {
            fates[at] = Fate::Retry;
            continue;
        }
        let id = envelope.id().to_owned();
        let after = B::offset(message) + 1;
        let one = vec![(B::offset(message), envelope.clone())];
        match commit(bus, position, one, after).await {
            Ok(committed) => {
                settle_appended::<B>(&messages[at..=at], &mut fates[at..=at], committed);
                stored = Some(after);
            }
            Err(error @ (Error::EventValidation(_) | Error::InvalidArgument(_))) => {
                let reason = format!("the local store refuses event {id:?} for good: {error}");
                fates[at] = dead_letter(broker, hold, message, &reason).await;
            }
            Err(error) => {
                fates[at] = Fate::Retry;
                stopped = Some(error.to_string());
            }
        }
    }
    // Past what follows the last event (messages that were dead-lettered or given up), so they
    // are not taken again.
    if stopped.is_none()
        && position.is_some()
        && stored != Some(next)
        && let Err(error) = commit(bus, position, Vec::new(), next).await
    {
        let behind = stored.unwrap_or(i64::MIN);
        for (message, fate) in messages.iter().zip(fates.iter_mut()) {
            if B::offset(message) >= behind {
                *fate = Fate::Retry;
            }
        }
        stopped = Some(error.to_string());
    }
    stopped
}

/// What one transaction did: the stored position it found (events behind it were left out)
/// and the appends, by event id.
struct Committed {
    stored: Option<i64>,
    appended: HashMap<String, Appended>,
}

/// Sets the fates of the decoded messages from what their transaction appended. A batch may
/// hold one event twice (the relay sent it twice): it was appended once, and the later copy
/// is a duplicate of it.
fn settle_appended<B: Broker>(messages: &[B::Message], fates: &mut [Fate], committed: Committed) {
    let Committed {
        stored,
        appended: mut first,
    } = committed;
    let mut repeats: HashMap<String, Appended> = HashMap::new();
    for (message, fate) in messages.iter().zip(fates.iter_mut()) {
        let Fate::Decoded(envelope) = fate else {
            continue;
        };
        if stored.is_some_and(|stored| B::offset(message) < stored) {
            *fate = Fate::Behind;
            continue;
        }
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

/// Appends `events` (each with its message's offset) in one transaction. With a position, the
/// transaction reads it first, leaves out the events behind it, and moves it to `next`; with a
/// fence too, it first keeps the reader's lead, and writes nothing when that was lost.
async fn commit<S: Store>(
    bus: &RelayBus<S>,
    position: Option<&Position>,
    events: Vec<(i64, EventEnvelope)>,
    next: i64,
) -> crate::Result<Committed> {
    let Some(position) = position else {
        let appended = bus.publish_all(unique(&events, i64::MIN)).await?;
        return Ok(Committed {
            stored: None,
            appended: by_id(appended),
        });
    };
    let owned_bus = bus.clone();
    let position = position.clone();
    let (stored, appended) = bus
        .transaction(owned_work::<S, _, _>(move |session| {
            let bus = owned_bus.clone();
            let position = position.clone();
            let events = events.clone();
            Box::pin(async move {
                let key = position.key();
                let store = bus.store();
                if let Some(fence) = &position.fence
                    && !store.keep_lead(session, &fence.role, fence.period).await?
                {
                    fence.lost.cancel();
                    return Err(Error::custom(LeadLost {
                        role: fence.role.clone(),
                    }));
                }
                let stored = store.consumer_position(session, &key).await?.unwrap_or(0);
                let envelopes = unique(&events, stored);
                let appended = if envelopes.is_empty() {
                    Vec::new()
                } else {
                    bus.publish_all(envelopes).session(session).await?
                };
                store
                    .advance_consumer_position(session, &key, next, bus.now())
                    .await?;
                Ok((stored, appended))
            })
        }))
        .await?;
    Ok(Committed {
        stored: Some(stored),
        appended: by_id(appended),
    })
}

/// The events at or past `stored`, each id once.
fn unique(events: &[(i64, EventEnvelope)], stored: i64) -> Vec<EventEnvelope> {
    let mut ids = HashSet::new();
    events
        .iter()
        .filter(|(offset, envelope)| *offset >= stored && ids.insert(envelope.id()))
        .map(|(_, envelope)| envelope.clone())
        .collect()
}

fn by_id(appended: Vec<Appended>) -> HashMap<String, Appended> {
    appended
        .into_iter()
        .map(|appended| (appended.event_id.clone(), appended))
        .collect()
}

/// The body of a transaction whose futures own what they use (besides the session), so that
/// they are `Send` and a consumer's tasks can be spawned.
pub(crate) fn owned_work<S, R, F>(work: F) -> F
where
    S: Store,
    F: for<'s> FnMut(&'s mut S::Session) -> BoxFuture<'s, crate::Result<R>>,
{
    work
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use std::{
        sync::{Arc, Mutex},
        time::Duration,
    };

    use super::*;
    use crate::{
        error::BoxError,
        store::{ConsumerPositions, memory::MemoryEventStore},
        transport::wire,
    };

    /// A broker whose messages are `(offset, body)`, recording what it dead-letters.
    #[derive(Debug, Clone, Default)]
    struct Recorded {
        position: Option<Position>,
        dead_letters: Arc<Mutex<Vec<i64>>>,
    }

    type Message = (i64, Option<Vec<u8>>);

    impl Broker for Recorded {
        type Message = Message;
        type Hold = ();
        type Error = std::io::Error;

        const FETCH_STOPS_ON_SHUTDOWN: bool = true;

        async fn fetch(&self) -> Result<(Vec<Message>, ()), std::io::Error> {
            Ok((Vec::new(), ()))
        }

        fn body(message: &Message) -> Result<&[u8], &'static str> {
            message.1.as_deref().ok_or("no body")
        }

        fn redelivered(_message: &Message) -> bool {
            false
        }

        fn position(&self) -> Option<&Position> {
            self.position.as_ref()
        }

        fn offset(message: &Message) -> i64 {
            message.0
        }

        async fn dead_letter(
            &self,
            _hold: &mut (),
            message: &Message,
            _reason: &str,
        ) -> Result<(), BoxError> {
            self.dead_letters.lock().unwrap().push(message.0);
            Ok(())
        }

        async fn settle(
            &self,
            _hold: (),
            _messages: Vec<(Message, Settlement)>,
        ) -> Result<(), std::io::Error> {
            Ok(())
        }

        fn pause_after_failure(&self) -> Duration {
            Duration::ZERO
        }

        fn pause_after_retry(&self) -> Duration {
            Duration::ZERO
        }

        fn source(&self) -> &str {
            "recorded"
        }
    }

    fn positioned() -> Recorded {
        Recorded {
            position: Some(Position {
                consumer: "shipping".to_owned(),
                source: "orders".to_owned(),
                partition: 0,
                fence: None,
            }),
            ..Recorded::default()
        }
    }

    fn bus() -> RelayBus<MemoryEventStore> {
        RelayBus::builder(MemoryEventStore::new())
            .without_registered_handlers()
            .build()
            .unwrap()
    }

    fn event(offset: i64, key: &str) -> (Message, EventEnvelope) {
        let envelope = EventEnvelope::from_json("order.placed.v1", serde_json::json!({}))
            .unwrap()
            .with_key(key)
            .unwrap();
        ((offset, Some(wire::encode(&envelope, None))), envelope)
    }

    async fn stored(bus: &RelayBus<MemoryEventStore>, broker: &Recorded) -> Option<i64> {
        let key = broker.position.as_ref().unwrap().key();
        let store = bus.store();
        bus.transaction(async |session| store.consumer_position(session, &key).await)
            .await
            .unwrap()
    }

    fn created(fates: &[Fate]) -> Vec<Option<bool>> {
        fates
            .iter()
            .map(|fate| match fate {
                Fate::Appended(appended) => Some(appended.created),
                _ => None,
            })
            .collect()
    }

    #[tokio::test]
    async fn the_position_moves_past_the_batch_once_its_dead_letters_are_out() {
        let bus = bus();
        let broker = positioned();
        let (first, _) = event(0, "k");
        let (second, _) = event(2, "k");
        let messages = vec![first, (1, Some(b"not json".to_vec())), second, (3, None)];
        let (fates, error) = append(&broker, &mut (), &bus, &messages).await;
        assert_eq!(error, None);
        assert_eq!(created(&fates), [Some(true), None, Some(true), None]);
        assert!(matches!(fates[1], Fate::DeadLettered));
        assert!(matches!(fates[3], Fate::DeadLettered));
        assert_eq!(*broker.dead_letters.lock().unwrap(), [1, 3]);
        assert_eq!(stored(&bus, &broker).await, Some(4));
    }

    #[tokio::test]
    async fn events_behind_the_stored_position_are_left_out() {
        let bus = bus();
        let broker = positioned();
        let (first, _) = event(0, "k");
        append(&broker, &mut (), &bus, std::slice::from_ref(&first)).await;
        let (second, _) = event(1, "k");
        let (fates, _) = append(&broker, &mut (), &bus, &[first, second]).await;
        assert!(matches!(fates[0], Fate::Behind), "{fates:?}");
        assert_eq!(created(&fates)[1], Some(true));
        assert_eq!(stored(&bus, &broker).await, Some(2));
    }

    #[tokio::test]
    async fn an_event_sent_twice_in_a_batch_is_appended_once() {
        let bus = bus();
        let broker = Recorded::default();
        let (message, _) = event(0, "k");
        let (fates, _) = append(&broker, &mut (), &bus, &[message.clone(), message]).await;
        assert_eq!(created(&fates), [Some(true), Some(false)]);
        assert!(broker.dead_letters.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_batch_without_events_still_moves_the_position() {
        let bus = bus();
        let broker = positioned();
        let (fates, _) = append(&broker, &mut (), &bus, &[(5, None)]).await;
        assert!(matches!(fates[0], Fate::DeadLettered));
        assert_eq!(stored(&bus, &broker).await, Some(6));
    }
}
