//! Reading the lanes: the claim's first read, one aggregation over the lanes collection, and what
//! the claim settles with it before it scans anything.
//!
//! The read finds which lanes are free, which this owner holds on this store instance and which
//! deliveries those list, and the lowest parked delivery of each key of the claim's handlers.
//! Then, at the same time: the parked keys whose predecessors finished are unparked, and what
//! runs in the held lanes is known (after charging the claims earlier holders lost there, if
//! any). Held lanes that list a claim this instance did not hand out send the claim to
//! reconciliation first.
//!
//! A claim after an idle wait reads the documents of its held and reported lanes and of the
//! lanes other live owners hold, no other: it picks from the reported lanes only, so it needs no
//! other free lane.

use std::collections::{HashMap, HashSet};

use futures::TryStreamExt;
use mongodb::bson::{
    Bson, DateTime, Document, RawBsonRef, RawDocument, RawDocumentBuf, doc, oid::ObjectId,
};

use super::{
    pick::KeyOf,
    scan::{LANES_PER_QUERY, candidate_fields, page_with_events, scan_filter},
    share::Sharing,
};
use crate::{
    error::Result,
    store::mongo::{
        MongoEventStore,
        lane::{Lane, int, string, whole_number},
        lease::{ClaimRegistry, Issued, ParkedLookup, Vouched},
        park::{LowestPending, ParkedHead, lowest_of_parked_stages, parked_heads_stages},
        schema::{field, index, path, status},
    },
};

/// Handlers whose parked keys the claim's first read looks up itself; a claim for more
/// handlers unparks with one aggregation per handler.
const PARKED_IN_LANE_READ: usize = 32;

/// The field of the lane read's document that lists the deliveries the held lanes run.
const RUNNING: &str = "running";

/// The fields that mark the documents of a lane read other than the lanes' and the held lanes'
/// page's: what the held lanes run, and the documents the deliveries collection adds.
const MARKERS: [&str; 4] = ["prescanned", "parkedKey", "lowestHandler", RUNNING];

/// Which of [`MARKERS`] a document of the lane read has: one pass over its fields.
fn marker(raw: &RawDocument) -> Option<&'static str> {
    raw.iter()
        .filter_map(Result::ok)
        .find_map(|(name, _)| MARKERS.into_iter().find(|marker| *marker == name))
}

/// What the claim's first read finds.
#[derive(Debug, Default)]
pub(super) struct LaneView {
    /// The lanes this owner holds on this instance, with their in-flight and lost lists.
    pub(super) held: Vec<Lane>,
    /// The documents of the deliveries those lanes list: `_id`, `handler`, `key`, `claims`.
    pub(super) running_docs: Vec<Document>,
    pub(super) free: Vec<FreeLane>,
    pub(super) taken_by_others: HashSet<i32>,
    /// Who else holds lanes, for sharing them with claimers that found nothing.
    pub(super) sharing: Sharing,
    /// The other live holders, by owner and store instance.
    pub(super) holders: Vec<(String, Option<ObjectId>)>,
    /// The lowest parked delivery of each key and the lowest pending delivery of those keys,
    /// when the read looked them up.
    pub(super) parked: Option<ParkedKeys>,
    /// The first page of a scan of the lanes the read was asked to look into, with events.
    pub(super) prescanned: Vec<Document>,
    /// The first page of a scan of the held lanes, when the read was asked for it and found
    /// lanes held.
    pub(super) held_page: Option<HeldPage>,
}

/// The first page of a scan the lane read brings along, at most `window` deliveries.
#[derive(Debug, Clone, Copy)]
pub(super) enum FirstPage<'a> {
    /// Of the lanes where new deliveries were reported, with their events.
    Reported(&'a [i32], usize),
    /// Of the lanes the owner held when its last claim ended ([`HeldPage`]), leaving out every
    /// delivery in `issued` (the claims this instance handed out and has not seen settled) that
    /// was handed out in one of those lanes.
    Held {
        lanes: &'a [i32],
        window: usize,
        issued: &'a HashMap<ObjectId, Issued>,
    },
}

/// The first page of a scan of the held lanes, read with the lanes: their due, ready
/// deliveries in `(dueAt, _id)` order, without those this instance handed out there and has not
/// seen settled.
#[derive(Debug)]
pub(super) struct HeldPage {
    /// The lanes the page was read for: those the owner held when its last claim ended. The
    /// page holds only if the lanes read after it show the owner holding the same ones.
    pub(super) lanes: HashSet<i32>,
    /// The page, at most `window` deliveries ([`candidate_fields`]).
    pub(super) page: Vec<RawDocumentBuf>,
    pub(super) window: usize,
}

/// What the claim's first read found of the parked keys.
#[derive(Debug, Default)]
pub(super) struct ParkedKeys {
    /// The lowest parked delivery of each key.
    pub(super) heads: Vec<ParkedHead>,
    /// The lowest pending delivery of those keys (of up to 500 per handler).
    pub(super) lowest: LowestPending,
}

/// A lane no live holder has.
#[derive(Debug, Clone)]
pub(super) struct FreeLane {
    pub(super) lane: Lane,
    /// Nothing in flight and nothing lost: there is nothing to charge before reading it.
    pub(super) clean: bool,
    /// The epoch as stored (`Null` when absent).
    pub(super) stored_epoch: Bson,
}

impl FreeLane {
    /// A lane document found free, from its fields, without decoding its lists: a lane that
    /// lists anything is taken with a write that reads them.
    fn from_fields(fields: &LaneFields<'_>) -> Option<FreeLane> {
        let value = |found: Option<RawBsonRef<'_>>| {
            found
                .and_then(|value| Bson::try_from(value).ok())
                .unwrap_or(Bson::Null)
        };
        Some(FreeLane {
            lane: Lane {
                id: fields.id?,
                epoch: fields.epoch.and_then(whole_number).unwrap_or(0),
                lease_expires_at: fields.lease_expires_at,
                in_flight: Vec::new(),
                lost: Vec::new(),
                requeues: value(fields.requeues),
            },
            clean: !fields.lists,
            stored_epoch: value(fields.epoch),
        })
    }
}

/// The fields of a lane document the read looks at, found in one pass over the document.
#[derive(Debug, Default)]
struct LaneFields<'a> {
    id: Option<i32>,
    owner: Option<&'a str>,
    instance: Option<ObjectId>,
    lease_expires_at: Option<DateTime>,
    epoch: Option<RawBsonRef<'a>>,
    requeues: Option<RawBsonRef<'a>>,
    /// Something in flight or lost.
    lists: bool,
}

impl<'a> LaneFields<'a> {
    fn of(raw: &'a RawDocument) -> LaneFields<'a> {
        let mut fields = LaneFields::default();
        for (name, value) in raw.iter().filter_map(Result::ok) {
            match name {
                field::ID => fields.id = whole_number(value).and_then(|id| i32::try_from(id).ok()),
                field::OWNER => fields.owner = value.as_str(),
                field::INSTANCE => fields.instance = value.as_object_id(),
                field::LEASE_EXPIRES_AT => fields.lease_expires_at = value.as_datetime(),
                field::EPOCH => fields.epoch = Some(value),
                field::REQUEUES => fields.requeues = Some(value),
                field::IN_FLIGHT | field::LOST => {
                    fields.lists |= match value {
                        RawBsonRef::Null => false,
                        RawBsonRef::Array(items) => items.into_iter().next().is_some(),
                        _ => true,
                    }
                }
                _ => {}
            }
        }
        fields
    }
}

/// Whether a document of the lane read is a lane's: the only ones whose first field is a
/// numeric `_id`.
fn is_lane(raw: &RawDocument) -> bool {
    matches!(
        raw.iter().next(),
        Some(Ok((field::ID, value))) if whole_number(value).is_some()
    )
}

/// Whether a document of the lane read without a marker is a delivery of the held lanes' page:
/// the only ones whose first field is an `ObjectId` `_id` (the page's projection keeps only
/// plain fields, so that the server applies it as it reads).
fn is_page_delivery(raw: &RawDocument) -> bool {
    matches!(
        raw.iter().next(),
        Some(Ok((field::ID, RawBsonRef::ObjectId(_))))
    )
}

/// What runs in the lanes this owner holds.
#[derive(Debug, Default)]
pub(super) struct Running {
    /// The deliveries the lanes list whose documents exist.
    pub(super) ids: HashSet<ObjectId>,
    /// Their handlers and keys.
    pub(super) keys: HashSet<KeyOf>,
    /// Their claim generations.
    pub(super) generations: HashMap<ObjectId, i64>,
}

impl Running {
    /// Counts as running the keys of deliveries this instance handed out, held to their key's
    /// order, that a held lane still lists although they are gone, and returns those
    /// deliveries. Each has just completed, and the worker that ran it may be claiming its
    /// key's next delivery (see `claim_next_of_key`), which waits for this claim to end: taking
    /// that delivery here would make the worker's claim find nothing and leave the key to the
    /// worker's regular claims. Only this claim leaves the key alone: the deliveries are still
    /// taken off their lanes and forgotten as gone, so a key whose worker never claims its next
    /// delivery waits one claim at most; their lanes are kept, as if they ran.
    pub(super) fn handing_over(
        &mut self,
        held: &[Lane],
        issued: &HashMap<ObjectId, Issued>,
        registry: &ClaimRegistry,
    ) -> HashSet<ObjectId> {
        let mut handing_over = HashSet::new();
        for id in held.iter().flat_map(|lane| &lane.in_flight) {
            if self.ids.contains(id) || !issued.contains_key(id) {
                continue;
            }
            if let Some(key) = registry.key_of(id) {
                handing_over.insert(*id);
                self.keys.insert(key);
            }
        }
        handing_over
    }
}

/// What unparking did for a claim.
#[derive(Debug, Default)]
pub(super) struct Unparking {
    /// The lowest pending delivery (`None`: nothing pending) of each key it looked up whose
    /// head is in one of the held lanes, for the per-key rules: the claim need not look them
    /// up again. The held lanes' records are conditioned on the requeue count the first read
    /// found, so a requeue that would make an older delivery pending meanwhile voids them.
    pub(super) heads: HashMap<KeyOf, Option<ObjectId>>,
    /// The lanes it sends parked deliveries back to, `None` when it cannot tell.
    pub(super) unparked: Option<HashSet<i32>>,
    /// Heads free to go back to their held lanes whose update was left to the claim: none of
    /// their keys has a lower pending delivery, and none runs.
    pub(super) deferred: Vec<ParkedHead>,
}

/// What runs, from the documents of the deliveries the lanes list.
fn running_of(docs: &[Document]) -> Running {
    let mut ids = HashSet::new();
    let mut keys = HashSet::new();
    let mut generations = HashMap::new();
    for doc in docs {
        let Ok(id) = doc.get_object_id(field::ID) else {
            continue;
        };
        generations.insert(id, int(doc, field::CLAIMS).unwrap_or(0));
        ids.insert(id);
        if let Some(key_of) = ordered_key_of(doc) {
            keys.insert(key_of);
        }
    }
    Running {
        ids,
        keys,
        generations,
    }
}

/// The handler and ordering key of a delivery document, if it is held to its key's order: a
/// delivery marked `unordered` keeps its key for operators only.
fn ordered_key_of(doc: &Document) -> Option<KeyOf> {
    if doc.get_bool(field::UNORDERED) == Ok(true) {
        return None;
    }
    Some((string(doc, field::HANDLER)?, string(doc, field::KEY)?))
}

/// What a claim reads of a delivery its held lanes list, to judge it by: handler, key,
/// `unordered`, claim generation and status.
fn listed_fields() -> Document {
    doc! {
        field::HANDLER: 1, field::KEY: 1, field::UNORDERED: 1, field::CLAIMS: 1,
        field::STATUS: 1,
    }
}

/// Whether a held lane lists a delivery whose current claim this instance did not hand out.
///
/// Everything a lane of this instance lists was handed out by this instance, unless a claim
/// failed or was dropped after its record reached the database. It is judged against the claims
/// outstanding when the read began (`issued`): one completed meanwhile may still show in the
/// read. A listed delivery that no longer exists (not in `generations`) counts as settled.
pub(super) fn lists_foreign_claims(
    held: &[Lane],
    generations: &HashMap<ObjectId, i64>,
    issued: &HashMap<ObjectId, Issued>,
) -> bool {
    held.iter().any(|lane| {
        lane.in_flight.iter().any(|id| {
            generations.get(id).is_some_and(|&claims| {
                issued.get(id).copied()
                    != Some(Issued {
                        lane: lane.id,
                        epoch: lane.epoch,
                        claims,
                    })
            })
        })
    })
}

/// The stages that read the held lanes' first page ([`FirstPage::Held`]): the due, ready deliveries
/// of `handlers` in `lanes`, in `(dueAt, _id)` order, at most `window` of them, their first field
/// the `_id` ([`is_page_delivery`]). Every delivery in `issued` handed out in one of `lanes` is
/// left out (on the claim index's keys), those whose completion was sent too: read before the
/// lanes, the page then holds nothing that was running from this instance when it was read,
/// although a delivery the page holds may complete before the lanes are read and no longer be
/// listed there.
fn held_page_stages(
    lanes: &[i32],
    handlers: &[&str],
    now: DateTime,
    window: usize,
    issued: &HashMap<ObjectId, Issued>,
) -> [Document; 4] {
    let mut filter = scan_filter(lanes, handlers, now);
    // Only the claims handed out in these lanes can be in the page: the other buses of this
    // store instance have theirs in the registry too.
    let in_lanes: HashSet<i32> = lanes.iter().copied().collect();
    let handed_out: Vec<ObjectId> = issued
        .iter()
        .filter(|(_, claim)| in_lanes.contains(&claim.lane))
        .map(|(id, _)| *id)
        .collect();
    filter.insert(field::ID, doc! { "$nin": handed_out });
    [
        doc! { "$match": filter },
        doc! { "$sort": { field::DUE_AT: 1, field::ID: 1 } },
        doc! { "$limit": i64::try_from(window).unwrap_or(i64::MAX) },
        doc! { "$project": candidate_fields() },
    ]
}

impl MongoEventStore {
    /// The claim's first read, one aggregation: every lane document; the documents of the
    /// deliveries listed by the lanes `owner` holds on this instance that the claim cannot
    /// account for without them (with `vouched`, only those whose completion was sent, by
    /// `_id`; then those neither vouched for nor completed by this instance, in a second
    /// command after the aggregation); for up to 32 handlers, the
    /// lowest parked delivery of each of their keys, and the lowest pending delivery of those
    /// keys for each handler whose parked deliveries this instance's last such read found
    /// (unparking looks up the others' itself); and the first page of a scan, of the
    /// reported lanes or of the held ones ([`FirstPage`]). The lanes are read as stored, and
    /// then what the held ones run: deliveries read after them can only be newer, so a lane
    /// taken and handed back meanwhile shows a new epoch to the record's condition. Without
    /// `vouched`, what the held lanes run is looked up from the held lanes as a second pass
    /// reads them; only the ids the first pass listed count. The held lanes' page comes first,
    /// read on the claim index, for the lanes the owner held when its last claim ended; it
    /// counts only when the lanes read after it show the same lanes held.
    ///
    /// With `only` (a claim after an idle wait, which reads the reported lanes alone), the
    /// lane documents read are those of the lanes `owner` holds on this instance, of `only` and
    /// of the lanes other live owners hold; no other free lane is listed.
    pub(super) async fn read_lanes(
        &self,
        owner: &str,
        handlers: &[&str],
        now: DateTime,
        first: FirstPage<'_>,
        only: Option<&[i32]>,
        vouched: Option<&Vouched<'_>>,
    ) -> Result<LaneView> {
        let held_page = match first {
            FirstPage::Held {
                lanes,
                window,
                issued,
            } if !lanes.is_empty() && lanes.len() <= LANES_PER_QUERY => {
                Some((lanes, window, issued))
            }
            _ => None,
        };
        let inner = &self.inner;
        // With `vouched`, the deliveries this instance handed out and has not seen settled run,
        // as far as it knows: their documents are not read (a run's waiting deliveries are
        // many), and what the claim needs of them comes from the registry. A listed delivery
        // it does not vouch for is read, unless its completion by this instance deleted it.
        let instance = inner.claims.instance;
        let mine = doc! { field::OWNER: owner, field::INSTANCE: instance };
        // The lane documents come as they are stored: a stage that reshapes them (trimming
        // other holders' lists, say) costs the server more than sending them whole. With
        // `only`, the lanes other live owners hold come along, for who holds what.
        let listed = match only {
            Some(lanes) => doc! { "$or": [
                &mine,
                { field::ID: { "$in": lanes } },
                {
                    field::OWNER: { "$ne": null },
                    field::LEASE_EXPIRES_AT: { "$gt": now },
                },
            ] },
            None => doc! {},
        };
        let running = vec![
            doc! { "$match": &mine },
            doc! { "$group": {
                "_id": null,
                "listed": { "$push": { "$ifNull": [path::IN_FLIGHT, []] } },
            } },
            doc! { "$project": {
                "_id": 0,
                "listed": { "$reduce": {
                    "input": "$listed",
                    "initialValue": [],
                    "in": { "$concatArrays": ["$$value", "$$this"] },
                } },
            } },
            doc! { "$lookup": {
                "from": inner.deliveries.name(),
                "localField": "listed",
                "foreignField": field::ID,
                "pipeline": [{ "$project": listed_fields() }],
                "as": RUNNING,
            } },
            doc! { "$project": { field::ID: 0, RUNNING: 1 } },
        ];
        let mut pipeline = Vec::new();
        if let Some((lanes, window, issued)) = held_page {
            // The held lanes' first page leads, read on the claim index it is told to use: a
            // query in a `$lookup` or a `$unionWith` cannot be told, and the server then plans
            // it anew, trying every index it could use, on most claims.
            pipeline.extend(held_page_stages(lanes, handlers, now, window, issued));
            pipeline.push(doc! { "$unionWith": {
                "coll": inner.lanes.name(),
                "pipeline": [{ "$match": listed }],
            } });
        } else {
            pipeline.push(doc! { "$match": listed });
        }
        // What the held lanes run. A read that vouches for the claims handed out there reads
        // only those whose completion was sent, by `_id`: what else the lanes list is either
        // known gone (completed by this instance) or read after the lanes, in a second command.
        // A read that does not, the held lanes' lists (one lookup for all of them: a `$lookup`
        // runs its query once per input document, so the lanes' lists are joined first).
        match vouched {
            Some(Vouched { completing, .. }) if completing.is_empty() => {}
            Some(Vouched { completing, .. }) => pipeline.push(doc! { "$unionWith": {
                "coll": inner.deliveries.name(),
                "pipeline": [
                    { "$match": { field::ID: { "$in": completing } } },
                    { "$project": listed_fields() },
                    { "$group": { "_id": null, RUNNING: { "$push": "$$ROOT" } } },
                    { "$project": { field::ID: 0, RUNNING: 1 } },
                ],
            } }),
            None => pipeline.push(doc! { "$unionWith": {
                "coll": inner.lanes.name(),
                "pipeline": running,
            } }),
        }
        // The parked deliveries of the handlers this instance may find some of (see
        // `ParkedLookup`): a lookup is two sub-pipelines the server parses and plans on every
        // read, for nothing where no delivery is parked.
        let fold_parked = handlers.len() <= PARKED_IN_LANE_READ;
        let parkings = inner.claims.parkings();
        let mut looked = Vec::new();
        if fold_parked {
            for handler in handlers {
                let lookup = inner.claims.parked_lookup(handler, now);
                if lookup == ParkedLookup::Skip {
                    continue;
                }
                looked.push(*handler);
                pipeline.push(doc! { "$unionWith": {
                    "coll": inner.deliveries.name(),
                    "pipeline": parked_heads_stages(handler),
                } });
                // The keys' lowest pending deliveries come along while the handler has parked
                // deliveries; a read that finds the first of them leaves their lookup to
                // unparking.
                if lookup == ParkedLookup::HeadsAndLowest {
                    pipeline.push(doc! { "$unionWith": {
                        "coll": inner.deliveries.name(),
                        "pipeline": lowest_of_parked_stages(handler, inner.deliveries.name()),
                    } });
                }
            }
        }
        if let FirstPage::Reported(lanes, window) = first {
            let mut stages = page_with_events(
                scan_filter(lanes, handlers, now),
                window,
                inner.events.name(),
            );
            stages.push(doc! { "$addFields": { "prescanned": true } });
            pipeline.push(doc! { "$unionWith": {
                "coll": inner.deliveries.name(),
                "pipeline": stages,
            } });
        }
        // A batch large enough that the first one ends the cursor.
        let cursor = match held_page {
            Some(_) => {
                inner
                    .deliveries
                    .aggregate(pipeline)
                    .hint(index::hint(index::CLAIM))
                    .batch_size(100_000)
                    .await?
            }
            None => inner.lanes.aggregate(pipeline).batch_size(100_000).await?,
        };
        let docs: Vec<RawDocumentBuf> = cursor.with_type::<RawDocumentBuf>().try_collect().await?;

        let mut view = LaneView {
            parked: fold_parked.then(ParkedKeys::default),
            ..LaneView::default()
        };
        let mut listed_docs = Vec::new();
        let mut page = Vec::new();
        let mut lanes: Vec<RawDocumentBuf> = Vec::new();
        // Each other live holder's lanes, and whether any of them lists something.
        let mut others: HashMap<(String, Option<ObjectId>), (usize, bool)> = HashMap::new();
        for raw in docs {
            if is_lane(&raw) {
                lanes.push(raw);
                continue;
            }
            let Some(marker) = marker(&raw) else {
                if held_page.is_some() && is_page_delivery(&raw) {
                    page.push(raw);
                }
                continue;
            };
            if marker == RUNNING {
                if let Ok(running) = raw.get_array(RUNNING) {
                    listed_docs.extend(
                        running
                            .into_iter()
                            .filter_map(|d| Document::try_from(d.ok()?.as_document()?).ok()),
                    );
                }
                continue;
            }
            // The parked keys' documents are read as they came, without decoding them.
            match marker {
                "prescanned" => view
                    .prescanned
                    .extend(Document::try_from(raw.as_ref()).ok()),
                "lowestHandler" => {
                    if let Some(parked) = view.parked.as_mut() {
                        parked.lowest.add(&raw);
                    }
                }
                _ => {
                    if let Some(parked) = view.parked.as_mut()
                        && let Some(head) = ParkedHead::from_raw(&raw)
                    {
                        parked.heads.push(head);
                    }
                }
            }
        }
        if let Some(parked) = &view.parked {
            let found: HashSet<&str> = parked
                .heads
                .iter()
                .map(|head| head.handler.as_str())
                .collect();
            inner
                .claims
                .note_parked_lookup(looked.iter().copied(), &found, now, parkings);
        }
        if let Some((lanes, window, _)) = held_page {
            view.held_page = Some(HeldPage {
                lanes: lanes.iter().copied().collect(),
                page,
                window,
            });
        }
        for raw in &lanes {
            let fields = LaneFields::of(raw);
            if fields.owner == Some(owner) && fields.instance == Some(instance) {
                if let Some(lane) = Document::try_from(raw.as_ref())
                    .ok()
                    .as_ref()
                    .and_then(Lane::from_document)
                {
                    view.held.push(lane);
                }
                continue;
            }
            let expired = fields.lease_expires_at.is_none_or(|expiry| expiry <= now);
            match fields.owner {
                Some(holder) if !expired => {
                    if let Some(id) = fields.id {
                        let entry = others
                            .entry((holder.to_owned(), fields.instance))
                            .or_default();
                        entry.0 += 1;
                        entry.1 |= fields.lists;
                        view.taken_by_others.insert(id);
                    }
                }
                _ => view.free.extend(FreeLane::from_fields(&fields)),
            }
        }
        view.sharing = Sharing::of(view.held.len(), others.values().copied());
        view.holders = others.into_keys().collect();
        // The documents of the deliveries the held lanes list, as read; a lane that changed
        // hands between the two reads lists other ids, and conditions its writes on that.
        let listed: HashSet<ObjectId> = view
            .held
            .iter()
            .flat_map(|lane| lane.in_flight.iter().copied())
            .collect();
        view.running_docs = listed_docs
            .into_iter()
            .filter(|doc| {
                doc.get_object_id(field::ID)
                    .is_ok_and(|id| listed.contains(&id))
            })
            .collect();
        // The listed deliveries this instance vouches for: as the registry has them, when it
        // handed them out in the lane and epoch that list them; read otherwise. With `vouched`,
        // so is every other listed delivery neither read with the lanes nor known gone.
        let read_with_lanes: HashSet<&ObjectId> =
            vouched.map_or_else(HashSet::new, |vouched| vouched.completing.iter().collect());
        let mut unvouched = Vec::new();
        // Listed, not vouched for, not read with the lanes: read unless known gone.
        let mut unaccounted = Vec::new();
        for lane in &view.held {
            for id in &lane.in_flight {
                match vouched.and_then(|vouched| vouched.running(id)) {
                    Some(claim) if claim.lane == lane.id && claim.epoch == lane.epoch => {
                        let mut doc = doc! {
                            field::ID: *id,
                            field::CLAIMS: claim.claims,
                            field::STATUS: status::PENDING,
                        };
                        if let Some((handler, key)) = inner.claims.key_of(id) {
                            doc.insert(field::HANDLER, handler);
                            doc.insert(field::KEY, key);
                        }
                        view.running_docs.push(doc);
                    }
                    Some(_) => unvouched.push(*id),
                    None if vouched.is_some() && !read_with_lanes.contains(id) => {
                        unaccounted.push(*id);
                    }
                    None => {}
                }
            }
        }
        if !unaccounted.is_empty() {
            let gone = inner.claims.gone_among(&unaccounted);
            unvouched.extend(unaccounted.into_iter().filter(|id| !gone.contains(id)));
        }
        if !unvouched.is_empty() {
            view.running_docs
                .extend(self.listed_documents(&unvouched).await?);
        }
        Ok(view)
    }

    /// Unparks, level-triggered, the keys of every lane not held by another live owner (that
    /// owner unparks its own), with the parked heads the first read found, or with one
    /// aggregation per handler when it did not look them up. Keys with a pending delivery
    /// running in the held lanes stay parked: nothing else of them can be claimed before it
    /// ends. Never fails the claim.
    ///
    /// With `defer`, when every head to send back is in one of the `held` lanes, the update is
    /// left to the caller ([`Unparking::deferred`]), which picks those heads without scanning
    /// for them and sends the update with its record.
    pub(super) async fn unpark_for_claim(
        &self,
        handlers: &[&str],
        parked: Option<ParkedKeys>,
        taken_by_others: &HashSet<i32>,
        running_docs: &[Document],
        held: &HashSet<i32>,
        defer: bool,
    ) -> Unparking {
        let running_pending: HashSet<KeyOf> = running_docs
            .iter()
            .filter(|doc| doc.get_str(field::STATUS) == Ok(status::PENDING))
            .filter_map(ordered_key_of)
            .collect();
        let result = match parked {
            Some(parked) => {
                self.unpark_planned(parked, taken_by_others, &running_pending, held, defer)
                    .await
            }
            None => {
                let mut result = Ok(Unparking::default());
                for handler in handlers {
                    if let Err(error) = self.unpark(handler, taken_by_others).await {
                        result = Err(error);
                    }
                }
                result
            }
        };
        result.unwrap_or_else(|error| {
            tracing::warn!(%error, "relaybus: unparking deliveries failed");
            Unparking::default()
        })
    }

    /// [`unpark_for_claim`](Self::unpark_for_claim) with the parked heads the first read found.
    async fn unpark_planned(
        &self,
        parked: ParkedKeys,
        taken_by_others: &HashSet<i32>,
        running_pending: &HashSet<KeyOf>,
        held: &HashSet<i32>,
        defer: bool,
    ) -> Result<Unparking> {
        let (free, seen) = self
            .plan_unpark(
                parked.heads,
                taken_by_others,
                running_pending,
                Some(parked.lowest),
            )
            .await?;
        let deferred = defer
            && free
                .iter()
                .all(|head| head.lane.is_some_and(|lane| held.contains(&lane)));
        if !deferred {
            self.unpark_ids(free.iter().map(|head| head.id).collect())
                .await?;
        }
        let unparked = seen
            .iter()
            .filter(|seen| seen.unparked)
            .map(|seen| seen.lane)
            .collect::<Option<HashSet<i32>>>();
        let heads = seen
            .into_iter()
            .filter(|seen| seen.lane.is_some_and(|lane| held.contains(&lane)))
            .map(|seen| (seen.key, seen.lowest))
            .collect();
        Ok(Unparking {
            heads,
            unparked,
            deferred: if deferred { free } else { Vec::new() },
        })
    }

    /// What runs in the `held` lanes: what the first read found (`running_docs`), unless
    /// earlier holders lost claims in them. Those are charged first, and what runs is read
    /// again.
    pub(super) async fn running_in_held_lanes(
        &self,
        held: &[Lane],
        running_docs: &[Document],
        now: DateTime,
    ) -> Result<Running> {
        if held.iter().any(|lane| !lane.lost.is_empty()) {
            self.charge_lost(held, now).await?;
            self.load_running(held).await
        } else {
            Ok(running_of(running_docs))
        }
    }

    /// The deliveries `lanes` list that still exist (they run), their keys, and their claim
    /// generations.
    async fn load_running(&self, lanes: &[Lane]) -> Result<Running> {
        let listed: Vec<ObjectId> = lanes
            .iter()
            .flat_map(|lane| lane.in_flight.iter().copied())
            .collect();
        if listed.is_empty() {
            return Ok(running_of(&[]));
        }
        Ok(running_of(&self.listed_documents(&listed).await?))
    }

    /// The documents of the listed deliveries `ids` that exist, with what a claim judges them
    /// by: handler, key, `unordered`, claim generation and status. One read.
    async fn listed_documents(&self, ids: &[ObjectId]) -> Result<Vec<Document>> {
        Ok(self
            .inner
            .deliveries
            .find(doc! { field::ID: { "$in": ids } })
            .projection(listed_fields())
            .limit(ids.len() as i64)
            .batch_size(u32::try_from(ids.len()).unwrap_or(u32::MAX))
            .await?
            .try_collect()
            .await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::mongo::lease::Lease;

    #[test]
    fn the_held_page_leaves_out_every_claim_handed_out_in_its_lanes_even_while_it_completes() {
        let registry = ClaimRegistry::default();
        let (running, completing, elsewhere) = (ObjectId::new(), ObjectId::new(), ObjectId::new());
        registry.issue([
            Lease::new(running, 3, 1, 1),
            Lease::new(completing, 4, 1, 1),
            // Another bus's claim, in a lane the page does not read.
            Lease::new(elsewhere, 9, 1, 1),
        ]);
        registry.completing([completing]);
        let issued = registry.snapshot();
        // A completion that was sent may have applied: the lanes' read does not vouch for it.
        let vouched = registry.vouched(&issued, &HashSet::from([3, 4]));
        assert!(vouched.running(&completing).is_none());
        assert_eq!(
            vouched.completing,
            [completing],
            "read with the lanes instead"
        );
        assert!(vouched.running(&running).is_some());
        assert!(
            vouched.running(&elsewhere).is_some(),
            "handed out in another lane, vouched for where a lane lists it in that lane"
        );
        registry.completing([elsewhere]);
        let vouched = registry.vouched(&issued, &HashSet::from([3, 4]));
        assert_eq!(
            vouched.completing,
            [completing],
            "completing in another lane: read if listed"
        );

        let now = DateTime::from_millis(1_000);
        let stages = held_page_stages(&[3, 4], &["projector"], now, 40, &issued);
        let filter = stages[0].get_document("$match").unwrap();
        let mut left_out: Vec<ObjectId> = filter
            .get_document("_id")
            .unwrap()
            .get_array("$nin")
            .unwrap()
            .iter()
            .map(|id| id.as_object_id().unwrap())
            .collect();
        left_out.sort();
        let mut expected = vec![running, completing];
        expected.sort();
        assert_eq!(left_out, expected);
        assert_eq!(
            filter.get_document("laneId").unwrap(),
            &doc! { "$in": [3, 4] }
        );
        assert_eq!(stages[2], doc! { "$limit": 40_i64 });
        assert_eq!(stages[3], doc! { "$project": candidate_fields() });
    }

    #[test]
    fn a_free_lane_is_clean_only_with_empty_lists() {
        let free = |doc: Document| {
            let raw = RawDocumentBuf::from_document(&doc).unwrap();
            FreeLane::from_fields(&LaneFields::of(&raw))
        };
        let read = |doc: Document| free(doc).unwrap();
        let clean =
            read(doc! { "_id": 3, "epoch": 7_i64, "owner": null, "inFlight": [], "lost": [] });
        assert!(clean.clean);
        assert_eq!((clean.lane.id, clean.lane.epoch), (3, 7));
        assert_eq!(clean.stored_epoch, Bson::Int64(7));
        assert_eq!(clean.lane.requeues, Bson::Null);
        let seeded = read(doc! { "_id": 4_i64 });
        assert!(seeded.clean);
        assert_eq!(seeded.stored_epoch, Bson::Null);
        let running =
            read(doc! { "_id": 5, "epoch": 1, "inFlight": [ObjectId::new()], "requeues": 2 });
        assert!(!running.clean);
        assert_eq!(running.lane.requeues, Bson::Int32(2));
        let lost =
            read(doc! { "_id": 6, "inFlight": [], "lost": [{ "d": ObjectId::new(), "e": 1_i64 }] });
        assert!(!lost.clean);
        assert!(free(doc! { "_id": "x" }).is_none());
    }

    #[test]
    fn one_pass_reads_a_lane_and_tells_lanes_from_the_other_documents() {
        let instance = ObjectId::new();
        let expires = DateTime::from_millis(1_000);
        let raw = RawDocumentBuf::from_document(&doc! {
            "_id": 9,
            "owner": "worker",
            "instance": instance,
            "leaseExpiresAt": expires,
            "epoch": 4.0,
            "inFlight": [],
            "lost": null,
        })
        .unwrap();
        let fields = LaneFields::of(&raw);
        assert_eq!(fields.id, Some(9));
        assert_eq!(fields.owner, Some("worker"));
        assert_eq!(fields.instance, Some(instance));
        assert_eq!(fields.lease_expires_at, Some(expires));
        assert_eq!(fields.epoch.and_then(whole_number), Some(4));
        assert!(!fields.lists);
        assert!(is_lane(&raw));
        let delivery = RawDocumentBuf::from_document(&doc! {
            "_id": ObjectId::new(), "prescanned": true,
        })
        .unwrap();
        assert!(!is_lane(&delivery));
        let head = RawDocumentBuf::from_document(&doc! { "parkedKey": "k", "id": 1 }).unwrap();
        assert!(!is_lane(&head));
        assert!(!is_page_delivery(&raw) && !is_page_delivery(&head));
        let paged = RawDocumentBuf::from_document(&doc! {
            "_id": ObjectId::new(), "eventId": "e", "laneId": 9,
        })
        .unwrap();
        assert!(!is_lane(&paged) && is_page_delivery(&paged) && marker(&paged).is_none());
    }

    #[test]
    fn only_claims_this_instance_did_not_hand_out_are_foreign() {
        let (ours, gone, other) = (ObjectId::new(), ObjectId::new(), ObjectId::new());
        let held = vec![Lane {
            id: 3,
            epoch: 7,
            lease_expires_at: None,
            in_flight: vec![ours, gone, other],
            lost: Vec::new(),
            requeues: Bson::Null,
        }];
        let issued = |claims| Issued {
            lane: 3,
            epoch: 7,
            claims,
        };
        let mut generations = HashMap::from([(ours, 2)]);
        let mut handed_out = HashMap::from([(ours, issued(2)), (other, issued(0))]);
        // `gone` no longer exists and `other` is not read: only `ours` is judged.
        assert!(!lists_foreign_claims(&held, &generations, &handed_out));
        // A claim generation that moved on, or another epoch, is not this instance's claim.
        generations.insert(other, 1);
        assert!(lists_foreign_claims(&held, &generations, &handed_out));
        handed_out.insert(
            other,
            Issued {
                epoch: 6,
                ..issued(1)
            },
        );
        assert!(lists_foreign_claims(&held, &generations, &handed_out));
        handed_out.insert(other, issued(1));
        assert!(!lists_foreign_claims(&held, &generations, &handed_out));
        // Listed, existing, and never handed out by this instance.
        handed_out.remove(&ours);
        assert!(lists_foreign_claims(&held, &generations, &handed_out));
    }
}
