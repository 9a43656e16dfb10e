//! Handing out: the events of the picks, read before anything is recorded, and the claimed
//! deliveries with their leases, remembered as this instance's claims.

use std::collections::HashMap;

use futures::TryStreamExt;
use mongodb::bson::{DateTime, RawDocumentBuf, doc};

use super::{ClaimedDelivery, scan::Candidate};
use crate::{
    error::Result,
    event::EventEnvelope,
    store::mongo::{
        MongoEventStore,
        bson_json::{raw_document_to_json, raw_to_json},
        lane::Lane,
        lease::{Facts, Lease},
        schema::field,
    },
    time::Timestamp,
};

impl MongoEventStore {
    /// The events of `picks` the scans did not bring along (`events`), read in one query. It
    /// runs beside the record: a pick whose event is missing is recorded all the same, and
    /// [`hand_out`](Self::hand_out) gives it back.
    pub(super) async fn events_missing(
        &self,
        picks: &[Candidate],
        events: &HashMap<String, RawDocumentBuf>,
    ) -> Result<HashMap<String, RawDocumentBuf>> {
        let missing: Vec<&Candidate> = picks
            .iter()
            .filter(|pick| !events.contains_key(&pick.event_id))
            .collect();
        if missing.is_empty() {
            return Ok(HashMap::new());
        }
        self.read_events(&missing).await
    }

    /// The events of the picks, as raw documents (payloads are never decoded as extended JSON).
    async fn read_events(&self, picks: &[&Candidate]) -> Result<HashMap<String, RawDocumentBuf>> {
        let mut ids: Vec<&str> = picks.iter().map(|p| p.event_id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        if ids.is_empty() {
            return Ok(HashMap::new());
        }
        let events = self.inner.events.clone_with_type::<RawDocumentBuf>();
        let mut cursor = events
            .find(doc! { field::ID: { "$in": &ids } })
            .projection(doc! { field::HANDLERS: 0 })
            .limit(ids.len() as i64)
            .batch_size(u32::try_from(ids.len()).unwrap_or(u32::MAX))
            .await?;
        let mut found = HashMap::with_capacity(ids.len());
        while let Some(event) = cursor.try_next().await? {
            if let Ok(id) = event.get_str(field::ID) {
                found.insert(id.to_owned(), event);
            }
        }
        Ok(found)
    }

    /// The claimed deliveries of the recorded `picks`, each with the lease of its lane's epoch,
    /// remembered as claims this instance handed out; and the leases of the picks whose event
    /// is missing, issued too, for the caller to give back, with the picks of the same key that
    /// come after one (the rest of its run: none may run before it).
    pub(super) fn hand_out(
        &self,
        picks: Vec<Candidate>,
        lanes: &[Lane],
        events: &HashMap<String, RawDocumentBuf>,
        expires_at: DateTime,
    ) -> (Vec<ClaimedDelivery>, Vec<Lease>) {
        let lane_expiry: HashMap<i32, DateTime> = lanes
            .iter()
            .map(|lane| {
                let current = lane.lease_expires_at.unwrap_or(expires_at);
                (lane.id, current.max(expires_at))
            })
            .collect();
        let mut claimed = Vec::with_capacity(picks.len());
        let mut orphaned = Vec::new();
        let mut facts = Vec::with_capacity(picks.len());
        // Keys a pick of which is given back: the rest of their runs goes back with it.
        let mut broken: Vec<(String, String)> = Vec::new();
        for pick in picks {
            let lane = lanes
                .iter()
                .find(|lane| lane.id == pick.lane)
                .map(|lane| lane.epoch)
                .unwrap_or_default();
            let lease = Lease::new(pick.id, pick.lane as u32, lane, pick.claims);
            let run_broken = pick.key.as_ref().is_some_and(|key| {
                broken
                    .iter()
                    .any(|(handler, k)| *handler == pick.handler && k == key)
            });
            let event = match events.get(&pick.event_id) {
                Some(raw) if !run_broken => envelope(&pick.event_id, raw),
                Some(_) => {
                    orphaned.push(lease);
                    continue;
                }
                None => {
                    tracing::warn!(
                        delivery = %pick.id,
                        event = %pick.event_id,
                        "relaybus: a pending delivery has no event; it is given back"
                    );
                    if let Some(key) = &pick.key {
                        broken.push((pick.handler.clone(), key.clone()));
                    }
                    orphaned.push(lease);
                    continue;
                }
            };
            if let Some(quick_since) = pick.quick_since {
                facts.push((
                    pick.id,
                    Facts {
                        event_id: pick.event_id,
                        quick_since,
                    },
                ));
            }
            claimed.push(ClaimedDelivery {
                lease,
                lease_expires_at: lane_expiry.get(&pick.lane).copied().unwrap_or(expires_at),
                handler: pick.handler,
                attempt: u32::try_from(pick.attempts.max(0).saturating_add(1)).unwrap_or(u32::MAX),
                sequence: pick.sequence,
                ordered: pick.key.is_some(),
                event,
            });
        }
        self.inner.claims.issue(
            claimed
                .iter()
                .map(|c| c.lease)
                .chain(orphaned.iter().copied()),
        );
        self.inner.claims.issue_facts(facts);
        (claimed, orphaned)
    }
}

/// An event, from its raw stored document.
pub(crate) fn envelope(event_id: &str, raw: &RawDocumentBuf) -> EventEnvelope {
    let text = |name: &str| raw.get_str(name).ok().map(str::to_owned);
    let payload = match raw.get_document(field::PAYLOAD) {
        Ok(payload) => raw_document_to_json(payload),
        _ => serde_json::Map::new(),
    };
    let headers = match raw.get_document(field::HEADERS) {
        Ok(headers) => headers
            .into_iter()
            .filter_map(Result::ok)
            // Another writer may store any JSON value, as the specification allows: a value
            // that is not a string reaches the handler as its JSON text rather than vanishing.
            .map(|(name, value)| {
                let value = match raw_to_json(value) {
                    serde_json::Value::String(value) => value,
                    other => other.to_string(),
                };
                (name.to_owned(), value)
            })
            .collect(),
        _ => Default::default(),
    };
    let created_at = raw
        .get_datetime(field::CREATED_AT)
        .map_or(Timestamp::EPOCH, |at| {
            Timestamp::from_millis(at.timestamp_millis())
        });
    EventEnvelope {
        id: event_id.to_owned(),
        event_type: text(field::TYPE).unwrap_or_default(),
        payload,
        key: text(field::KEY),
        correlation_id: text(field::CORRELATION_ID),
        causation_id: text(field::CAUSATION_ID),
        headers,
        created_at,
    }
}

#[cfg(test)]
mod tests {
    use mongodb::bson::oid::ObjectId;

    use super::*;

    #[test]
    fn envelopes_are_read_raw() {
        let pick = Candidate {
            id: ObjectId::new(),
            lane: 1,
            event_id: "e-1".into(),
            handler: "h".into(),
            key: None,
            sequence: None,
            attempts: 0,
            claims: 0,
            due_at: DateTime::from_millis(0),
            quick_since: None,
        };
        let raw = RawDocumentBuf::from_document(&doc! {
            "_id": "e-1",
            "type": "a.b",
            "payload": { "id": { "$oid": "not an id" }, "n": 1 },
            "headers": { "$date": "x" },
            "createdAt": DateTime::from_millis(7),
        })
        .unwrap();
        let event = envelope(&pick.event_id, &raw);
        assert_eq!(
            serde_json::Value::Object(event.payload),
            serde_json::json!({ "id": { "$oid": "not an id" }, "n": 1 })
        );
        assert_eq!(event.headers.get("$date").map(String::as_str), Some("x"));
        assert_eq!(event.created_at, Timestamp::from_millis(7));
    }
}
