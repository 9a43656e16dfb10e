//! Scanning: reading the due, ready deliveries of lanes in `(dueAt, _id)` order, a page at a
//! time, and picking from each page until the claim is full.
//!
//! The first page of a scan is sized to fill the claim, plus a few deliveries that may be
//! blocked; further pages come in batches. Before picking from a page, a scan looks up the
//! lowest pending delivery of each key the page brings for the first time (one distinct scan
//! per handler and group of keys, in parallel): picking itself reads nothing.

use std::collections::{HashMap, HashSet};

use futures::{TryStreamExt, future};
use mongodb::bson::{DateTime, Document, RawDocument, RawDocumentBuf, doc, oid::ObjectId};

use super::pick::Picking;
use crate::{
    error::Result,
    store::{
        checks::MAX_CLAIM_LIMIT,
        mongo::{
            MongoEventStore,
            lane::{int, int32, string, whole_number},
            schema::{field, index, lane, status},
        },
    },
};

/// Lanes one query reads at most: the query planner merges at most 200 index scans.
pub(super) const LANES_PER_QUERY: usize = 128;
/// Deliveries read per batch once the first page did not yield enough.
const SCAN_BATCH: u32 = 500;
/// The lanes the first round of picking draws from; each further round draws from twice as many.
const FIRST_ROUND_LANES: usize = 4;

/// A due, ready delivery seen by a claim.
#[derive(Debug, Clone)]
pub(super) struct Candidate {
    pub(super) id: ObjectId,
    pub(super) lane: i32,
    pub(super) event_id: String,
    pub(super) handler: String,
    /// The ordering key the per-key rules go by: `None` for a delivery of an unkeyed event,
    /// and for an unordered one (marked `unordered`), which keeps its key for operators only.
    pub(super) key: Option<String>,
    pub(super) sequence: Option<i64>,
    pub(super) attempts: i64,
    pub(super) claims: i64,
    pub(super) due_at: DateTime,
    /// Whether a completion may leave the delivery's event unstamped ([`quick_since`]).
    pub(super) quick_since: Option<Option<DateTime>>,
}

/// Whether a completion may leave a delivery's event unstamped, from what a read found of it:
/// its creation time when it was appended with its new event (`fresh`) and never requeued,
/// `Some(None)` when not, and `None` when the read did not include its creation (nor, then, the
/// rest).
pub(crate) fn quick_since(
    fresh: bool,
    requeued: i64,
    created: Option<DateTime>,
) -> Option<Option<DateTime>> {
    created.map(|created| (fresh && requeued == 0).then_some(created))
}

/// The fields of a delivery document a claim reads, found in one pass over the raw document (a
/// lookup by name walks the document each time, and pages are read on every claim). A field of
/// an unexpected type counts as absent; of two fields of one name, the first counts, as a lookup
/// by name finds it. Parked heads ([`ParkedHead`]) name their handler, key and id apart.
#[derive(Debug, Default)]
pub(crate) struct DeliveryFields<'a> {
    pub(crate) id: Option<ObjectId>,
    pub(crate) lane: Option<i64>,
    pub(crate) event_id: Option<&'a str>,
    pub(crate) handler: Option<&'a str>,
    pub(crate) key: Option<&'a str>,
    pub(crate) unordered: Option<bool>,
    pub(crate) sequence: Option<i64>,
    pub(crate) attempts: Option<i64>,
    pub(crate) claims: Option<i64>,
    pub(crate) due_at: Option<DateTime>,
    fresh: Option<bool>,
    requeued: Option<i64>,
    created_at: Option<DateTime>,
    pub(crate) parked_handler: Option<&'a str>,
    pub(crate) parked_key: Option<&'a str>,
    pub(crate) parked_id: Option<ObjectId>,
}

impl<'a> DeliveryFields<'a> {
    pub(crate) fn of(doc: &'a RawDocument) -> DeliveryFields<'a> {
        /// Keeps the first value found.
        fn first<T>(slot: &mut Option<T>, value: Option<T>) {
            if slot.is_none() {
                *slot = value;
            }
        }
        let mut read = DeliveryFields::default();
        for (name, value) in doc.iter().filter_map(Result::ok) {
            let text = || value.as_str();
            match name {
                field::ID => first(&mut read.id, value.as_object_id()),
                field::LANE_ID => first(&mut read.lane, whole_number(value)),
                field::EVENT_ID => first(&mut read.event_id, text()),
                field::HANDLER => first(&mut read.handler, text()),
                field::KEY => first(&mut read.key, text()),
                field::UNORDERED => first(&mut read.unordered, value.as_bool()),
                field::SEQUENCE => first(&mut read.sequence, whole_number(value)),
                field::ATTEMPTS => first(&mut read.attempts, whole_number(value)),
                field::CLAIMS => first(&mut read.claims, whole_number(value)),
                field::DUE_AT => first(&mut read.due_at, value.as_datetime()),
                field::FRESH => first(&mut read.fresh, value.as_bool()),
                field::REQUEUED => first(&mut read.requeued, whole_number(value)),
                field::CREATED_AT => first(&mut read.created_at, value.as_datetime()),
                "parkedHandler" => first(&mut read.parked_handler, text()),
                "parkedKey" => first(&mut read.parked_key, text()),
                "id" => first(&mut read.parked_id, value.as_object_id()),
                _ => {}
            }
        }
        read
    }

    /// The lane id, if it fits one.
    pub(crate) fn lane_id(&self) -> Option<i32> {
        self.lane.and_then(|lane| i32::try_from(lane).ok())
    }

    /// Whether a completion may leave the event unstamped ([`quick_since`]).
    pub(crate) fn quick_since(&self) -> Option<Option<DateTime>> {
        quick_since(
            self.fresh == Some(true),
            self.requeued.unwrap_or(0),
            self.created_at,
        )
    }
}

impl Candidate {
    /// A scanned delivery, from its raw document ([`DeliveryFields`]).
    pub(super) fn from_raw(doc: &RawDocument) -> Option<Candidate> {
        let read = DeliveryFields::of(doc);
        Some(Candidate {
            id: read.id?,
            lane: read.lane_id()?,
            event_id: read.event_id?.to_owned(),
            handler: read.handler?.to_owned(),
            key: read
                .key
                .filter(|_| read.unordered != Some(true))
                .map(str::to_owned),
            sequence: read.sequence,
            attempts: read.attempts.unwrap_or(0),
            claims: read.claims.unwrap_or(0),
            due_at: read.due_at?,
            quick_since: read.quick_since(),
        })
    }

    pub(super) fn from_document(doc: &Document) -> Option<Candidate> {
        Some(Candidate {
            id: doc.get_object_id(field::ID).ok()?,
            lane: int32(doc, field::LANE_ID)?,
            event_id: string(doc, field::EVENT_ID)?,
            handler: string(doc, field::HANDLER)?,
            key: string(doc, field::KEY).filter(|_| doc.get_bool(field::UNORDERED) != Ok(true)),
            sequence: int(doc, field::SEQUENCE),
            attempts: int(doc, field::ATTEMPTS).unwrap_or(0),
            claims: int(doc, field::CLAIMS).unwrap_or(0),
            due_at: *doc.get_datetime(field::DUE_AT).ok()?,
            quick_since: quick_since(
                doc.get_bool(field::FRESH) == Ok(true),
                int(doc, field::REQUEUED).unwrap_or(0),
                doc.get_datetime(field::CREATED_AT).ok().copied(),
            ),
        })
    }
}

/// The first pages of a scan, one per group of 128 lanes.
#[derive(Debug)]
pub(super) struct FirstPages {
    /// The lanes they were read for.
    lanes: Vec<i32>,
    /// The most deliveries a page could hold.
    window: usize,
    pages: Vec<Vec<RawDocumentBuf>>,
}

/// What one claim gathers as it scans.
#[derive(Debug)]
pub(super) struct Scan {
    /// The per-key rules, with what they picked and what waits.
    pub(super) picking: Picking,
    /// The events read with the deliveries, by event id (none so far: see `events_missing`).
    pub(super) events: HashMap<String, RawDocumentBuf>,
    /// Of the first read of every lane of a full claim: the lanes it found only unkeyed
    /// deliveries due in and did not pick from, the lane of the oldest first.
    pub(super) ranked: Option<Vec<i32>>,
}

impl Scan {
    pub(super) fn new(picking: Picking) -> Scan {
        Scan {
            picking,
            events: HashMap::new(),
            ranked: None,
        }
    }
}

/// The size of the first page of a scan that still needs `need` picks: enough to fill them,
/// plus a few deliveries that may be blocked.
pub(super) fn page_window(need: usize) -> usize {
    (need + 16).min(MAX_CLAIM_LIMIT as usize * 2)
}

/// The fields of a delivery a scan reads (see [`Candidate`]).
pub(super) fn candidate_fields() -> Document {
    doc! {
        field::EVENT_ID: 1, field::HANDLER: 1, field::KEY: 1, field::SEQUENCE: 1,
        field::UNORDERED: 1, field::LANE_ID: 1, field::ATTEMPTS: 1, field::CLAIMS: 1,
        field::DUE_AT: 1, field::FRESH: 1, field::REQUEUED: 1, field::CREATED_AT: 1,
    }
}

/// The filter of a scan of `lanes`.
pub(super) fn scan_filter(lanes: &[i32], handlers: &[&str], now: DateTime) -> Document {
    let mut filter = doc! { field::LANE_ID: { "$in": lanes } };
    filter.extend(due_filter(handlers, now));
    filter
}

/// The filter of a scan, but for the lanes: due, ready deliveries of `handlers`.
fn due_filter(handlers: &[&str], now: DateTime) -> Document {
    doc! {
        field::STATUS: status::PENDING,
        field::LANE: lane::READY,
        field::DUE_AT: { "$lte": now },
        field::HANDLER: { "$in": handlers },
    }
}

impl MongoEventStore {
    /// Reads the due, ready deliveries of `lanes` in `(dueAt, _id)` order and picks from them
    /// until the claim is full or the lanes have nothing more.
    pub(super) async fn scan_lanes(
        &self,
        lanes: &[i32],
        handlers: &[&str],
        now: DateTime,
        scan: &mut Scan,
    ) -> Result<()> {
        self.scan_lanes_from(lanes, handlers, now, scan, None).await
    }

    /// The first pages of a scan of `lanes`, one per group of 128 lanes, read at the same time:
    /// at most `window` deliveries each, leaving out those in `running` (on the index keys).
    pub(super) async fn first_pages(
        &self,
        lanes: &[i32],
        handlers: &[&str],
        now: DateTime,
        window: usize,
        running: &HashSet<ObjectId>,
    ) -> Result<FirstPages> {
        let reads = lanes.chunks(LANES_PER_QUERY).map(|group| {
            let mut filter = scan_filter(group, handlers, now);
            if !running.is_empty() {
                let running: Vec<ObjectId> = running.iter().copied().collect();
                filter.insert(field::ID, doc! { "$nin": running });
            }
            self.page(filter, window)
        });
        Ok(FirstPages {
            lanes: lanes.to_vec(),
            window,
            pages: future::try_join_all(reads).await?,
        })
    }

    /// [`scan_lanes`](Self::scan_lanes), with the first pages of `lanes` already read when
    /// `first` holds them. The first pages of all groups of lanes are picked from together, in
    /// `(dueAt, _id)` order; then, while the claim is not full, the rest of each group whose
    /// page was full, in batches.
    pub(super) async fn scan_lanes_from(
        &self,
        lanes: &[i32],
        handlers: &[&str],
        now: DateTime,
        scan: &mut Scan,
        first: Option<FirstPages>,
    ) -> Result<()> {
        if lanes.is_empty() || scan.picking.full() {
            return Ok(());
        }
        // The first pages are sized to fill the claim, plus a few blocked ones.
        let first = match first.filter(|first| first.lanes == lanes) {
            Some(first) => first,
            None => {
                let window = page_window(scan.picking.limit - scan.picking.picks.len());
                self.first_pages(lanes, handlers, now, window, &scan.picking.passed_over)
                    .await?
            }
        };
        let mut merged = Vec::new();
        let mut unfinished = Vec::new();
        for (group, raw) in lanes.chunks(LANES_PER_QUERY).zip(&first.pages) {
            let page: Vec<Candidate> = raw
                .iter()
                .filter_map(|doc| Candidate::from_raw(doc))
                .collect();
            if raw.len() >= first.window
                && let Some(last) = page.last()
            {
                unfinished.push((group, last.due_at, last.id));
            }
            merged.extend(page);
        }
        merged.sort_by_key(|candidate| (candidate.due_at, candidate.id));
        let mut seen: HashSet<ObjectId> = merged.iter().map(|candidate| candidate.id).collect();
        self.drain_few_lanes(
            &merged,
            !unfinished.is_empty(),
            handlers,
            now,
            scan,
            &mut seen,
        )
        .await?;
        if scan.ranked.is_none() {
            scan.ranked = Some(unpicked_unkeyed_lanes(&merged, &scan.picking));
        }
        for (group, due, id) in unfinished {
            if scan.picking.full() {
                break;
            }
            // More than one page: go on from where the page ended, in batches.
            let mut rest = scan_filter(group, handlers, now);
            rest.insert(
                "$or",
                vec![
                    doc! { field::DUE_AT: { "$gt": due } },
                    doc! { field::DUE_AT: due, field::ID: { "$gt": id } },
                ],
            );
            let mut cursor = self
                .inner
                .deliveries
                .find(rest)
                .sort(doc! { field::DUE_AT: 1, field::ID: 1 })
                .projection(candidate_fields())
                .hint(index::hint(index::CLAIM))
                .batch_size(SCAN_BATCH)
                .await?;
            let mut batch = Vec::with_capacity(SCAN_BATCH as usize);
            loop {
                let next = cursor.try_next().await?;
                let done = next.is_none();
                if let Some(candidate) = next.as_ref().and_then(Candidate::from_document)
                    && seen.insert(candidate.id)
                {
                    batch.push(candidate);
                }
                if (done && !batch.is_empty()) || batch.len() >= SCAN_BATCH as usize {
                    self.look_up_and_pick(std::mem::take(&mut batch), scan)
                        .await?;
                }
                if done || scan.picking.full() {
                    break;
                }
            }
        }
        Ok(())
    }

    /// Picks from the first pages (`merged`, in `(dueAt, _id)` order) a few lanes at a time:
    /// the lanes of the oldest deliveries first, 4, then 8, 16, ... a round. When the pages did
    /// not hold every due delivery of their lanes (`more`), the first round's lanes whose picks
    /// were all unkeyed, and of which nothing waited, are read deeper before the next round: a
    /// batch then comes from a few lanes, so the record writes a few lanes and the completions
    /// fence against a few. `seen` gathers what was read.
    async fn drain_few_lanes(
        &self,
        merged: &[Candidate],
        more: bool,
        handlers: &[&str],
        now: DateTime,
        scan: &mut Scan,
        seen: &mut HashSet<ObjectId>,
    ) -> Result<()> {
        let mut order: Vec<i32> = Vec::new();
        for candidate in merged {
            if !order.contains(&candidate.lane) {
                order.push(candidate.lane);
            }
        }
        let mut round = FIRST_ROUND_LANES;
        let mut next = 0;
        while next < order.len() && !scan.picking.full() {
            let chosen = &order[next..(next + round).min(order.len())];
            let first = next == 0;
            next += chosen.len();
            round *= 2;
            let page: Vec<Candidate> = merged
                .iter()
                .filter(|candidate| chosen.contains(&candidate.lane))
                .cloned()
                .collect();
            self.look_up_and_pick(page, scan).await?;
            let open: Vec<i32> = chosen
                .iter()
                .copied()
                .filter(|lane| scan.picking.drains_unkeyed(*lane))
                .collect();
            if !first || !more || open.is_empty() || scan.picking.full() {
                continue;
            }
            let need = scan.picking.limit - scan.picking.picks.len();
            let mut filter = scan_filter(&open, handlers, now);
            let known: Vec<ObjectId> = seen
                .iter()
                .chain(&scan.picking.passed_over)
                .copied()
                .collect();
            filter.insert(field::ID, doc! { "$nin": known });
            let deeper: Vec<Candidate> = self
                .page(filter, page_window(need))
                .await?
                .iter()
                .filter_map(|doc| Candidate::from_raw(doc))
                .filter(|candidate| seen.insert(candidate.id))
                .collect();
            self.look_up_and_pick(deeper, scan).await?;
        }
        Ok(())
    }

    /// Picks from first pages read ahead, in `(dueAt, _id)` order, and passes over what they
    /// held in any later scan of the claim, which reads their lanes again.
    pub(super) async fn pick_from_pages(&self, first: FirstPages, scan: &mut Scan) -> Result<()> {
        let mut page: Vec<Candidate> = first
            .pages
            .iter()
            .flatten()
            .filter_map(|doc| Candidate::from_raw(doc))
            .collect();
        page.sort_by_key(|candidate| (candidate.due_at, candidate.id));
        let read: Vec<ObjectId> = page.iter().map(|candidate| candidate.id).collect();
        self.look_up_and_pick(page, scan).await?;
        scan.picking.passed_over.extend(read);
        Ok(())
    }

    /// At most `window` due, ready deliveries matching `filter`, in `(dueAt, _id)` order.
    pub(super) async fn page(
        &self,
        filter: Document,
        window: usize,
    ) -> Result<Vec<RawDocumentBuf>> {
        Ok(self
            .inner
            .deliveries
            .clone_with_type::<RawDocumentBuf>()
            .find(filter)
            .sort(doc! { field::DUE_AT: 1, field::ID: 1 })
            .projection(candidate_fields())
            .hint(index::hint(index::CLAIM))
            .limit(window as i64)
            // One more than the page holds, so that the first batch ends the cursor.
            .batch_size(window as u32 + 1)
            .await?
            .try_collect()
            .await?)
    }

    /// Looks up, in parallel, the lowest pending delivery of the keys of `page` that the per-key
    /// rules need and do not know yet, then picks from the page.
    async fn look_up_and_pick(&self, page: Vec<Candidate>, scan: &mut Scan) -> Result<()> {
        let unknown = scan.picking.unknown_keys(&page);
        if !unknown.is_empty() {
            let lowest = self.lowest_pending(&unknown).await?;
            scan.picking.learn_heads(unknown, &lowest);
        }
        scan.picking.pick(page);
        Ok(())
    }
}

/// The lanes of `merged` (in `(dueAt, _id)` order) with only unkeyed deliveries and no picks,
/// in the order of their first delivery; none when the claim is not full.
fn unpicked_unkeyed_lanes(merged: &[Candidate], picking: &Picking) -> Vec<i32> {
    if !picking.full() {
        return Vec::new();
    }
    let keyed: HashSet<i32> = merged
        .iter()
        .filter(|candidate| candidate.key.is_some())
        .map(|candidate| candidate.lane)
        .collect();
    let picked: HashSet<i32> = picking.picks.iter().map(|pick| pick.lane).collect();
    let mut lanes: Vec<i32> = Vec::new();
    for candidate in merged {
        let lane = candidate.lane;
        if !keyed.contains(&lane) && !picked.contains(&lane) && !lanes.contains(&lane) {
            lanes.push(lane);
        }
    }
    lanes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_candidate_notes_its_creation_only_when_a_completion_may_leave_it_unstamped() {
        let created = DateTime::from_millis(5_000);
        let read = |extra: Document| {
            let mut doc = doc! {
                "_id": ObjectId::new(), "laneId": 3, "eventId": "e", "handler": "h",
                "dueAt": created, "createdAt": created,
            };
            doc.extend(extra);
            let raw = RawDocumentBuf::from_document(&doc).unwrap();
            let (from_raw, from_document) = (
                Candidate::from_raw(&raw).unwrap(),
                Candidate::from_document(&doc).unwrap(),
            );
            assert_eq!(from_raw.quick_since, from_document.quick_since);
            from_raw.quick_since
        };
        assert_eq!(read(doc! { "fresh": true }), Some(Some(created)));
        assert_eq!(read(doc! { "fresh": true, "requeued": 1 }), Some(None));
        assert_eq!(read(doc! { "fresh": false }), Some(None));
        assert_eq!(read(doc! {}), Some(None));
        // Read without its creation time: nothing is known.
        let mut unread = doc! {
            "_id": ObjectId::new(), "laneId": 3, "eventId": "e", "handler": "h",
            "dueAt": created, "fresh": true,
        };
        assert_eq!(Candidate::from_document(&unread).unwrap().quick_since, None);
        unread.remove("fresh");
        let raw = RawDocumentBuf::from_document(&unread).unwrap();
        assert_eq!(Candidate::from_raw(&raw).unwrap().quick_since, None);
        let projected = candidate_fields();
        for field in ["fresh", "requeued", "createdAt"] {
            assert!(projected.contains_key(field), "{field} is not read");
        }
    }

    /// The raw reading, one pass over the fields, finds what the decoded one finds.
    #[test]
    fn a_candidate_reads_the_same_raw_or_decoded() {
        let due = DateTime::from_millis(7_000);
        let fields = |doc: &Candidate| {
            (
                doc.id,
                doc.lane,
                doc.event_id.clone(),
                doc.handler.clone(),
                doc.key.clone(),
                doc.sequence,
                doc.attempts,
                doc.claims,
                doc.due_at,
                doc.quick_since,
            )
        };
        let id = ObjectId::new();
        let base = doc! {
            "_id": id, "laneId": 3_i64, "eventId": "e-1", "handler": "h", "key": "k",
            "sequence": 4.0, "attempts": 2, "claims": 5_i64, "dueAt": due,
        };
        let variants = [
            doc! {},
            doc! { "unordered": true },
            doc! { "unordered": false, "fresh": true, "createdAt": due },
            doc! { "key": 7, "sequence": "x", "attempts": 1.5 },
        ];
        for extra in variants {
            let mut doc = base.clone();
            doc.extend(extra.clone());
            let raw = RawDocumentBuf::from_document(&doc).unwrap();
            let (from_raw, from_document) = (
                Candidate::from_raw(&raw).unwrap(),
                Candidate::from_document(&doc).unwrap(),
            );
            assert_eq!(fields(&from_raw), fields(&from_document), "{extra}");
        }
        let unordered = doc! { "unordered": true };
        let mut doc = base.clone();
        doc.extend(unordered);
        let raw = RawDocumentBuf::from_document(&doc).unwrap();
        let read = Candidate::from_raw(&raw).unwrap();
        assert_eq!((read.key, read.sequence, read.lane), (None, Some(4), 3));
        // Without what a claim needs, no candidate.
        for missing in ["_id", "laneId", "eventId", "handler", "dueAt"] {
            let mut doc = base.clone();
            doc.remove(missing);
            let raw = RawDocumentBuf::from_document(&doc).unwrap();
            assert!(Candidate::from_raw(&raw).is_none(), "{missing}");
        }
    }
}
