//! Claiming deliveries.
//!
//! Workers lease lanes, not deliveries. A claim
//!
//! 1. reads, in one aggregation, every lane document (which lanes are free, which this owner
//!    holds on this store instance), the deliveries its held lanes list, and the lowest parked
//!    delivery of each key of its handlers;
//! 2. moves parked deliveries whose predecessors finished back to the ready lane, for the keys of
//!    every lane no other live owner holds and in which nothing of the key runs;
//! 3. claims from the lanes its owner already holds, after charging any lost claims an earlier
//!    holder left there;
//! 4. if it needs more, looks at free lanes (no holder, or an expired lease) that have due
//!    deliveries of its handlers, in rounds of twice as many lanes each (4 at first, more for a
//!    big claim), the lanes with the oldest due deliveries first; with other live holders
//!    around, it picks among a wider set of old lanes at random, so that concurrent claimers
//!    mostly look at different lanes. The rest of a ranking serves the owner's next claims for
//!    a second. A free lane with nothing in flight and nothing lost is read without a write:
//!    the record of step 6 takes it, on condition that its epoch, its requeue count and its
//!    empty lists are still what was read. Any other free lane is taken first with a
//!    conditional `findAndModify` that increments the lane epoch and moves the previous
//!    holder's in-flight list to `lost`, which the claim charges before reading anything from
//!    the lane;
//! 5. reads the due, ready deliveries of those lanes in `(dueAt, _id)` order, leaving out the
//!    ones it already runs, and applies the per-key rules until it has `limit`;
//! 6. reads the events of its picks in one query, then records the batch with one conditional
//!    write per lane, all in one `update` command: it takes the free lanes it picked from (the
//!    epoch grows by one), takes and hands back at once the free lanes that yielded nothing,
//!    and hands back the held lanes that yielded nothing and run nothing. A lane whose
//!    condition no longer holds (another claimer took it first) keeps nothing of this claim.
//!
//! The dispatcher's first claim after an idle wait is told which lanes the change stream
//! reported new deliveries in; it reads those lanes alone, held or free, in the aggregation of
//! step 1, instead of steps 3 and 4: nothing older was due when the dispatcher went idle.
//!
//! An unkeyed claim writes no delivery document. Any failure reconciles the owner's lanes (see
//! [`reconcile`](MongoEventStore::reconcile)).

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    time::Duration,
};

use futures::{TryStreamExt, future};
use mongodb::{
    ClientSession,
    bson::{Bson, DateTime, Document, RawBsonRef, RawDocument, RawDocumentBuf, doc, oid::ObjectId},
    options::{Hint, ReturnDocument},
};

use super::{
    MongoEventStore,
    append::check_write_reply,
    bson_json::{raw_document_to_json, raw_to_json},
    lane::{
        Lane, MAX_CLAIM_LIMIT, STATEMENTS_PER_COMMAND, add, check_lease_duration, check_owner, int,
        raw_int, reply_count, string,
    },
    lease::{Issued, Lease, OwnerState, RankedLanes},
    park::{PARK_THRESHOLD, ParkedHead, parked_heads_stages},
};
use crate::{
    error::{Error, InvalidArgumentError, Result},
    event::EventEnvelope,
    handler::validate_handler_id,
    time::Timestamp,
};

/// Lanes one query reads at most: the query planner merges at most 200 index scans.
const LANES_PER_QUERY: usize = 128;
/// Free lanes taken in the first round; every further round takes twice as many.
const FIRST_ROUND: usize = 4;
/// Further passes of a claim after it lost lanes to other claimers.
const RACE_RETRIES: usize = 2;
/// Deliveries a claim expects from a free lane when it sizes its first round.
const DELIVERIES_PER_LANE: usize = 8;
/// The most free lanes the first round takes.
const MAX_FIRST_ROUND: usize = 64;
/// Index entries one free-lane discovery query reads per group of lanes, at most.
const DISCOVERY_WINDOW: i64 = 512;
/// Deliveries read per batch once the first page did not yield enough.
const SCAN_BATCH: u32 = 500;
/// The most handlers one claim serves.
const MAX_HANDLERS: usize = 1_000;

/// A delivery handed out by [`MongoEventStore::claim`]: the event, which handler should run it,
/// which attempt this is, and the lease to settle it with.
#[derive(Debug, Clone)]
pub struct ClaimedDelivery {
    lease: Lease,
    lease_expires_at: DateTime,
    handler: String,
    attempt: u32,
    sequence: Option<i64>,
    event: EventEnvelope,
}

impl ClaimedDelivery {
    /// The delivery id.
    pub fn delivery_id(&self) -> ObjectId {
        self.lease.delivery_id()
    }

    /// The lease to settle the delivery with.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// When the lane lease expires unless it is extended. An expired lease nobody took over is
    /// still honoured.
    pub fn lease_expires_at(&self) -> DateTime {
        self.lease_expires_at
    }

    /// The handler that should run the delivery.
    pub fn handler(&self) -> &str {
        &self.handler
    }

    /// Which attempt this is, from 1: the attempts that ended before it plus one.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The event's sequence within its ordering key, if it has a key.
    pub fn sequence(&self) -> Option<i64> {
        self.sequence
    }

    /// The event: id, type, payload, key, correlation and causation ids, headers, creation time.
    pub fn event(&self) -> &EventEnvelope {
        &self.event
    }

    /// The event id.
    pub fn event_id(&self) -> &str {
        self.event.id()
    }

    /// The event type name.
    pub fn event_type(&self) -> &str {
        self.event.event_type()
    }

    /// The ordering key, if the event has one.
    pub fn key(&self) -> Option<&str> {
        self.event.key()
    }

    /// Takes the event out, for handing it to a handler.
    pub fn into_event(self) -> EventEnvelope {
        self.event
    }
}

/// What one pass of a claim hands out.
#[derive(Debug, Default)]
struct Batch {
    claimed: Vec<ClaimedDelivery>,
    /// Some picks were given up because another claimer took their lane first.
    raced: bool,
}

/// A due, ready delivery seen by a claim.
#[derive(Debug, Clone)]
struct Candidate {
    id: ObjectId,
    lane: i32,
    event_id: String,
    handler: String,
    key: Option<String>,
    sequence: Option<i64>,
    attempts: i64,
    claims: i64,
    due_at: DateTime,
}

impl Candidate {
    fn from_raw(doc: &RawDocument) -> Option<Candidate> {
        let int = |name: &str| raw_int(doc, name);
        let text = |name: &str| doc.get_str(name).ok().map(str::to_owned);
        Some(Candidate {
            id: doc.get_object_id("_id").ok()?,
            lane: int("laneId").and_then(|l| i32::try_from(l).ok())?,
            event_id: text("eventId")?,
            handler: text("handler")?,
            key: text("key"),
            sequence: int("sequence"),
            attempts: int("attempts").unwrap_or(0),
            claims: int("claims").unwrap_or(0),
            due_at: doc.get_datetime("dueAt").ok()?,
        })
    }

    fn from_document(doc: &Document) -> Option<Candidate> {
        Some(Candidate {
            id: doc.get_object_id("_id").ok()?,
            lane: int(doc, "laneId").and_then(|l| i32::try_from(l).ok())?,
            event_id: string(doc, "eventId")?,
            handler: string(doc, "handler")?,
            key: string(doc, "key"),
            sequence: int(doc, "sequence"),
            attempts: int(doc, "attempts").unwrap_or(0),
            claims: int(doc, "claims").unwrap_or(0),
            due_at: *doc.get_datetime("dueAt").ok()?,
        })
    }
}

type KeyOf = (String, String);

/// The most claimers a claim assumes it competes with when it spreads over free lanes.
const MAX_SPREAD: usize = 8;
/// Handlers whose parked keys the claim's first read looks up itself; a claim for more
/// handlers unparks with one aggregation per handler.
const PARKED_IN_LANE_READ: usize = 32;

/// How a claim holds a lane it records in.
#[derive(Debug, Clone)]
enum Hold {
    /// Held under a live lease before the claim started.
    Held,
    /// Taken by this claim with its own conditional write, before it was read.
    Taken,
    /// Free and clean when read: the record takes it, if it is still unchanged. `epoch` is the
    /// epoch as stored when read.
    Joining { epoch: Bson },
}

/// A lane no live holder has.
#[derive(Debug, Clone)]
struct FreeLane {
    lane: Lane,
    /// Nothing in flight and nothing lost: there is nothing to charge before reading it.
    clean: bool,
    /// The epoch as stored (`Null` when absent).
    stored_epoch: Bson,
}

impl FreeLane {
    /// Reads a lane document found free, without decoding its lists: a lane that lists
    /// anything is taken with a write that reads them.
    fn from_raw(raw: &RawDocument) -> Option<FreeLane> {
        let value = |name: &str| {
            raw.get(name)
                .ok()
                .flatten()
                .and_then(|value| Bson::try_from(value).ok())
                .unwrap_or(Bson::Null)
        };
        let empty = |name: &str| match raw.get(name).ok().flatten() {
            None | Some(RawBsonRef::Null) => true,
            Some(RawBsonRef::Array(items)) => items.into_iter().next().is_none(),
            Some(_) => false,
        };
        Some(FreeLane {
            lane: Lane {
                id: raw_int(raw, "_id").and_then(|id| i32::try_from(id).ok())?,
                epoch: raw_int(raw, "epoch").unwrap_or(0),
                lease_expires_at: raw.get_datetime("leaseExpiresAt").ok(),
                in_flight: Vec::new(),
                lost: Vec::new(),
                requeues: value("requeues"),
            },
            clean: empty("inFlight") && empty("lost"),
            stored_epoch: value("epoch"),
        })
    }
}

/// The first page of a scan as aggregation stages: the due, ready deliveries matching
/// `filter` in `(dueAt, _id)` order, at most `window`, each with its event (`event`, an array
/// of at most one document).
fn page_with_events(filter: Document, window: usize, events: &str) -> Vec<Document> {
    vec![
        doc! { "$match": filter },
        doc! { "$sort": { "dueAt": 1, "_id": 1 } },
        doc! { "$limit": window as i64 },
        doc! { "$project": candidate_fields() },
        doc! { "$lookup": {
            "from": events,
            "localField": "eventId",
            "foreignField": "_id",
            "pipeline": [{ "$project": { "handlers": 0 } }],
            "as": "event",
        } },
    ]
}

/// The fields of a delivery a scan reads (see [`Candidate`]).
fn candidate_fields() -> Document {
    doc! {
        "eventId": 1, "handler": 1, "key": 1, "sequence": 1, "laneId": 1,
        "attempts": 1, "claims": 1, "dueAt": 1,
    }
}

/// The filter of a scan of `lanes`.
fn scan_filter(lanes: &[i32], handlers: &[&str], now: DateTime) -> Document {
    doc! {
        "laneId": { "$in": lanes },
        "status": "pending",
        "lane": "ready",
        "dueAt": { "$lte": now },
        "handler": { "$in": handlers },
    }
}

/// What the claim's first read finds.
#[derive(Debug, Default)]
struct LaneView {
    /// The lanes this owner holds on this instance, with their in-flight and lost lists.
    held: Vec<Lane>,
    /// The documents of the deliveries those lanes list: `_id`, `handler`, `key`, `claims`.
    running_docs: Vec<Document>,
    free: Vec<FreeLane>,
    taken_by_others: HashSet<i32>,
    /// This claimer plus the other live holders of lanes.
    contenders: usize,
    /// The lowest parked delivery of each key, when the read looked them up.
    parked: Option<Vec<ParkedHead>>,
    /// The first page of a scan of the lanes the read was asked to look into, with events.
    prescanned: Vec<Document>,
}

/// The running set, running keys and claim generations of the listed delivery documents.
fn running_of(docs: &[Document]) -> (HashSet<ObjectId>, HashSet<KeyOf>, HashMap<ObjectId, i64>) {
    let mut running = HashSet::new();
    let mut keys = HashSet::new();
    let mut generations = HashMap::new();
    for doc in docs {
        let Ok(id) = doc.get_object_id("_id") else {
            continue;
        };
        generations.insert(id, int(doc, "claims").unwrap_or(0));
        running.insert(id);
        if let (Some(handler), Some(key)) = (string(doc, "handler"), string(doc, "key")) {
            keys.insert((handler, key));
        }
    }
    (running, keys, generations)
}

/// `count` of the `ranked` lanes (oldest due delivery first). Alone, a claimer takes the oldest;
/// with others around it takes `count` at random among the oldest `count * spread`, so that
/// claimers running at the same time mostly pick different lanes.
fn choose(mut ranked: Vec<i32>, count: usize, spread: usize) -> Vec<i32> {
    if spread <= 1 || ranked.len() <= count {
        ranked.truncate(count);
        return ranked;
    }
    ranked.truncate(count.saturating_mul(spread));
    // The low bits of a UUID v7 are random.
    let mut state = uuid::Uuid::now_v7().as_u128() as u64 | 1;
    for i in 0..count {
        // xorshift64
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let j = i + (state % (ranked.len() - i) as u64) as usize;
        ranked.swap(i, j);
    }
    ranked.truncate(count);
    ranked
}

/// How long the rest of a ranking of free lanes serves the owner's next claims, by the claims'
/// clock. New deliveries are never due before the ones ranked; a retry that became due since is
/// seen by the next ranking, at most this much later.
const RANKING_REUSE: Duration = Duration::from_secs(1);

/// The lanes of a kept ranking that are still free, in ranking order, with the time of the
/// ranking; `None` when it was for other handlers or is too old.
fn reusable(
    ranking: Option<RankedLanes>,
    handlers: &[&str],
    now: DateTime,
    free: &[i32],
) -> Option<(Vec<i32>, DateTime)> {
    let ranking = ranking?;
    let age = now
        .timestamp_millis()
        .checked_sub(ranking.at.timestamp_millis())?;
    if age < 0
        || age > RANKING_REUSE.as_millis() as i64
        || ranking.handlers.len() != handlers.len()
        || ranking.handlers.iter().zip(handlers).any(|(a, b)| a != b)
    {
        return None;
    }
    let lanes: Vec<i32> = ranking
        .lanes
        .into_iter()
        .filter(|lane| free.contains(lane))
        .collect();
    Some((lanes, ranking.at))
}

/// What one claim learns as it goes.
#[derive(Debug, Default)]
struct Scan {
    limit: usize,
    /// Deliveries listed by the owner's lanes whose documents exist: they run.
    running: HashSet<ObjectId>,
    /// Keys with a running delivery.
    running_keys: HashSet<KeyOf>,
    /// The lowest pending delivery of each key looked up so far (`None`: nothing pending).
    heads: HashMap<KeyOf, Option<ObjectId>>,
    /// Keys of which this claim picked a delivery.
    picked_keys: HashSet<KeyOf>,
    picks: Vec<Candidate>,
    /// Deliveries found waiting behind an unfinished predecessor, per key.
    waiting: HashMap<KeyOf, Vec<(ObjectId, i32)>>,
    /// Whether a scan's first page brings the events of its deliveries along: for a scan that
    /// expects a few deliveries, where one round trip less matters more than the server's
    /// cost of a `$lookup` per delivery.
    with_events: bool,
    /// The events the scans brought along, by event id.
    events: HashMap<String, RawDocumentBuf>,
}

impl Scan {
    fn full(&self) -> bool {
        self.picks.len() >= self.limit
    }

    /// The keys of `page` whose lowest pending delivery the per-key rules need and do not know
    /// yet: keys seen for the first time, unless one of their deliveries runs or was picked
    /// (their deliveries wait whatever the lowest is).
    fn unknown_keys(&self, page: &[Candidate]) -> Vec<KeyOf> {
        let mut unknown: Vec<KeyOf> = Vec::new();
        for candidate in page {
            if let Some(key) = &candidate.key {
                let key_of = (candidate.handler.clone(), key.clone());
                if !self.heads.contains_key(&key_of)
                    && !self.running_keys.contains(&key_of)
                    && !self.picked_keys.contains(&key_of)
                    && !unknown.contains(&key_of)
                {
                    unknown.push(key_of);
                }
            }
        }
        unknown
    }

    /// Remembers the lowest pending delivery of each of `keys` as looked up; `lowest` leaves out
    /// the keys with nothing pending.
    fn learn_heads(&mut self, keys: Vec<KeyOf>, lowest: &HashMap<KeyOf, (ObjectId, i64)>) {
        for key_of in keys {
            let head = lowest.get(&key_of).map(|(id, _)| *id);
            self.heads.insert(key_of, head);
        }
    }

    /// Applies the per-key rules to a page of candidates, in order, until the claim is full. No
    /// database access: the lowest pending delivery of each key was looked up before.
    fn pick(&mut self, page: Vec<Candidate>) {
        for candidate in page {
            if self.full() {
                break;
            }
            if self.running.contains(&candidate.id) {
                continue;
            }
            let Some(key) = &candidate.key else {
                self.picks.push(candidate);
                continue;
            };
            let key_of = (candidate.handler.clone(), key.clone());
            let free = !self.picked_keys.contains(&key_of)
                && !self.running_keys.contains(&key_of)
                && self.heads.get(&key_of) == Some(&Some(candidate.id));
            if free {
                self.picked_keys.insert(key_of);
                self.picks.push(candidate);
            } else {
                self.waiting
                    .entry(key_of)
                    .or_default()
                    .push((candidate.id, candidate.lane));
            }
        }
    }
}

impl MongoEventStore {
    /// Claims up to `limit` due deliveries of `handlers` for `owner`, leasing their lanes for
    /// `lease_duration` from `now`.
    ///
    /// Deliveries come in `(dueAt, id)` order within each group of lanes, from the lanes the
    /// owner already holds first. A keyed delivery is handed out only when no earlier delivery
    /// of its handler and key is pending and none of them runs, and one claim never hands out
    /// two deliveries of one key; the claim looks past blocked keys until it has `limit`.
    /// Deliveries a claim finds waiting behind a slow predecessor may be parked, and come back
    /// once the predecessor finished (see the crate documentation).
    ///
    /// `owner` names the worker. Lanes are held per owner **and per store instance** (one
    /// [`build`](crate::MongoEventStoreBuilder::build), shared by clones): a restarted process
    /// with the same owner name takes its predecessor's lanes over once their leases expired,
    /// and is charged for what the predecessor left running. Claims of one owner on one store
    /// instance run one after the other.
    ///
    /// The store compares lease expiries with `now` and never reads the server clock, so keep
    /// worker clocks synchronised.
    ///
    /// # Cost
    ///
    /// With its lanes already held, an unkeyed claim costs the same four commands whatever
    /// `limit` is (lanes, deliveries, their events, the record), and writes no delivery
    /// document. Each round over free lanes adds two reads (one per 128 lanes ranked, in
    /// parallel, and one scan); a free lane with lost claims to charge adds one write before it
    /// is read. A keyed claim adds one lookup per key, in
    /// parallel, and parked keys one lookup per key whose lane runs nothing of it.
    ///
    /// # Errors
    ///
    /// - [`Error::InvalidArgument`] for an empty or over-long `owner`, a `limit` outside 1 to
    ///   10,000, a `lease_duration` outside 1 ms to 7 days, or no handlers;
    ///   [`Error::Configuration`] for a malformed handler id. Nothing is sent to the database.
    /// - [`Error::Database`]. The owner's lanes on this instance are then reconciled: nothing
    ///   this failed claim recorded stays listed as running, and no lease of it can match.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a claim dropped half-way may have recorded deliveries nobody received.
    /// They are not lost: every claim checks that the owner's lanes list only deliveries this
    /// instance handed out, and reconciles them first when they do not, so the next claim of the
    /// same owner on the same instance puts them back. Without one, they wait for the lane lease
    /// to expire and are charged one attempt when the lane is taken over.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn example(store: relaybus::MongoEventStore) -> Result<(), relaybus::Error> {
    /// use std::time::Duration;
    /// use relaybus::mongodb::bson::DateTime;
    ///
    /// let batch = store
    ///     .claim("worker-1", &["send-confirmation"], 50, Duration::from_secs(30), DateTime::now())
    ///     .await?;
    /// for delivery in &batch {
    ///     // run the handler, then:
    ///     store.complete(delivery.lease(), DateTime::now()).await?;
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn claim<H: AsRef<str>>(
        &self,
        owner: &str,
        handlers: &[H],
        limit: u32,
        lease_duration: Duration,
        now: DateTime,
    ) -> Result<Vec<ClaimedDelivery>> {
        check_owner(owner)?;
        let mut wanted: Vec<&str> = Vec::with_capacity(handlers.len());
        for handler in handlers {
            let handler = handler.as_ref();
            validate_handler_id(handler)?;
            if !wanted.contains(&handler) {
                wanted.push(handler);
            }
        }
        if wanted.is_empty() || wanted.len() > MAX_HANDLERS {
            return Err(InvalidArgumentError::new(
                "handlers",
                format!(
                    "{} handlers given; claim for 1 to 1000 handlers",
                    wanted.len()
                ),
            )
            .into());
        }
        if !(1..=MAX_CLAIM_LIMIT).contains(&limit) {
            return Err(InvalidArgumentError::new(
                "limit",
                format!("{limit} is out of range; claim 1 to 10000 deliveries at a time"),
            )
            .into());
        }
        check_lease_duration(lease_duration)?;
        let expires_at = add(now, lease_duration)?;

        let lock = self.inner.claims.owner(owner);
        let mut state = lock.lock().await;
        if state.interrupted {
            // The previous claim of this owner was dropped half-way.
            self.reconcile(owner, now).await?;
            state.interrupted = false;
        }
        state.interrupted = true;
        let mut outcome = self
            .claim_locked(owner, &wanted, limit as usize, expires_at, now, &mut state)
            .await;
        if matches!(outcome, Ok(None)) {
            // The owner's lanes list deliveries this instance did not hand out (a claim that
            // was dropped, or whose record landed late): reconcile, then claim again.
            outcome = match self.reconcile(owner, now).await {
                Ok(()) => {
                    self.claim_locked(owner, &wanted, limit as usize, expires_at, now, &mut state)
                        .await
                }
                Err(error) => Err(error),
            };
        }
        match outcome.map(Option::unwrap_or_default) {
            Ok(Batch {
                mut claimed,
                mut raced,
            }) => {
                // Lanes another claimer took first were given up at the record: try other
                // lanes for what is missing, a few times at most.
                let mut retries = 0;
                while raced && claimed.len() < limit as usize && retries < RACE_RETRIES {
                    retries += 1;
                    let more = self
                        .claim_locked(
                            owner,
                            &wanted,
                            limit as usize - claimed.len(),
                            expires_at,
                            now,
                            &mut state,
                        )
                        .await;
                    match more {
                        Ok(Some(more)) => {
                            claimed.extend(more.claimed);
                            raced = more.raced;
                        }
                        Ok(None) => break,
                        Err(error) => {
                            // What this claim handed out so far stays handed out; whatever the
                            // failed attempt may have recorded is reconciled.
                            tracing::warn!(owner, %error, "relaybus: claiming more after a lost race failed");
                            if self.reconcile(owner, now).await.is_err() {
                                return Ok(claimed);
                            }
                            break;
                        }
                    }
                }
                state.interrupted = false;
                Ok(claimed)
            }
            Err(error) => {
                match self.reconcile(owner, now).await {
                    Ok(()) => state.interrupted = false,
                    Err(reconcile_error) => tracing::warn!(
                        owner,
                        error = %reconcile_error,
                        "relaybus: reconciling the lanes of a failed claim failed; \
                         the next claim of this owner tries again"
                    ),
                }
                Err(error)
            }
        }
    }

    /// Joins the `chosen` free lanes to the claim and returns the ids to scan. A clean lane
    /// (nothing in flight, nothing lost) is only remembered: the record takes it on condition
    /// that it is unchanged. Any other is taken at once with a conditional write and its lost
    /// claims are charged before it is read; a lane another claimer took first is left out.
    async fn join_lanes(
        &self,
        chosen: &[i32],
        free: &[FreeLane],
        lanes: &mut Vec<(Lane, Hold)>,
        owner: &str,
        expires_at: DateTime,
        now: DateTime,
    ) -> Result<Vec<i32>> {
        let mut dirty = Vec::new();
        let mut scanned = Vec::new();
        for id in chosen {
            let Some(lane) = free.iter().find(|lane| lane.lane.id == *id) else {
                continue;
            };
            if lane.clean {
                scanned.push(*id);
                lanes.push((
                    lane.lane.clone(),
                    Hold::Joining {
                        epoch: lane.stored_epoch.clone(),
                    },
                ));
            } else {
                dirty.push(*id);
            }
        }
        if !dirty.is_empty() {
            let taken = self.take_lanes(&dirty, owner, expires_at, now).await?;
            self.charge_lost(&taken, now).await?;
            scanned.extend(taken.iter().map(|lane| lane.id));
            lanes.extend(taken.into_iter().map(|lane| (lane, Hold::Taken)));
        }
        Ok(scanned)
    }

    /// Tells the next claim of `owner` on this instance which lanes just received new
    /// deliveries (a change stream reported them), for it to look at before ranking free lanes.
    /// Meant for a claim after an idle wait, when nothing older was due.
    pub(crate) async fn hint_lanes(&self, owner: &str, lanes: Vec<i32>) {
        let lock = self.inner.claims.owner(owner);
        lock.lock().await.hints = lanes;
    }

    /// One claim, with the owner's lock held. `None` when the owner's lanes list a delivery
    /// this instance did not hand out; nothing was recorded then.
    async fn claim_locked(
        &self,
        owner: &str,
        handlers: &[&str],
        limit: usize,
        expires_at: DateTime,
        now: DateTime,
        state: &mut OwnerState,
    ) -> Result<Option<Batch>> {
        let inner = &self.inner;
        let instance = inner.claims.instance;

        // 1. Every lane document, what runs in the lanes this owner holds on this instance, and
        //    (for a few handlers) the lowest parked delivery of each key. After an idle wait,
        //    the first page of the lanes where new deliveries were reported comes along.
        let hints = std::mem::take(&mut state.hints);
        let window = (limit + 16).min(MAX_CLAIM_LIMIT as usize * 2);
        let issued = inner.claims.snapshot();
        let view = self
            .read_lanes(
                owner,
                handlers,
                now,
                (!hints.is_empty()).then_some((hints.as_slice(), window)),
            )
            .await?;
        let LaneView {
            held,
            running_docs,
            free,
            taken_by_others,
            contenders,
            parked,
            prescanned,
        } = view;
        let mut free = free;

        // 2. Level-triggered unparking for the keys of every lane not held by another live
        //    owner (that owner unparks its own). Never fails the claim. At the same time, 3:
        //    charge what earlier holders lost in the held lanes.
        // Keys with a pending delivery running in the held lanes stay parked: nothing else of
        // them can be claimed before it ends.
        let running_pending: HashSet<KeyOf> = running_docs
            .iter()
            .filter(|doc| doc.get_str("status") == Ok("pending"))
            .filter_map(|doc| Some((string(doc, "handler")?, string(doc, "key")?)))
            .collect();
        let unparking = async {
            let result = match parked {
                Some(heads) => self
                    .unpark_heads(heads, &taken_by_others, &running_pending)
                    .await
                    .map(|_| ()),
                None => {
                    let mut result = Ok(());
                    for handler in handlers {
                        if let Err(error) = self.unpark(handler, &taken_by_others).await {
                            result = Err(error);
                        }
                    }
                    result
                }
            };
            if let Err(error) = result {
                tracing::warn!(%error, "relaybus: unparking deliveries failed");
            }
        };
        let any_lost = held.iter().any(|lane| !lane.lost.is_empty());
        let loading = async {
            if any_lost {
                self.charge_lost(&held, now).await?;
                self.load_running(&held).await
            } else {
                Ok(running_of(&running_docs))
            }
        };
        let ((), running) = futures::join!(unparking, loading);
        let (running, running_keys, generations) = running?;
        let mut lanes: Vec<(Lane, Hold)> =
            held.into_iter().map(|lane| (lane, Hold::Held)).collect();
        let mut scan = Scan {
            limit,
            running,
            running_keys,
            ..Scan::default()
        };
        if !generations.is_empty() {
            // Everything a lane of this instance lists was handed out by this instance, unless
            // a claim failed or was dropped after its record reached the database. It is judged
            // against the claims outstanding when the read began: one completed meanwhile may
            // still show in the read.
            let orphaned = lanes.iter().any(|(lane, _)| {
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
            });
            if orphaned {
                return Ok(None);
            }
        }
        let held_ids: Vec<i32> = lanes.iter().map(|(lane, _)| lane.id).collect();
        if hints.is_empty() {
            self.scan_lanes(&held_ids, handlers, now, &mut scan).await?;
        } else {
            // After an idle wait, the lanes where new deliveries were reported meanwhile hold
            // the only new work: they are read alone, held or free, and nothing is ranked.
            let mut ready: Vec<i32> = held_ids
                .iter()
                .filter(|lane| hints.contains(lane))
                .copied()
                .collect();
            let chosen: Vec<i32> = hints
                .iter()
                .filter(|id| free.iter().any(|lane| lane.lane.id == **id))
                .copied()
                .collect();
            // The first read's page holds for held lanes and for free lanes read without a
            // write; a lane taken with a write (lost claims charged) is read again.
            ready.extend(
                chosen
                    .iter()
                    .filter(|id| free.iter().any(|lane| lane.lane.id == **id && lane.clean)),
            );
            let joined = self
                .join_lanes(&chosen, &free, &mut lanes, owner, expires_at, now)
                .await?;
            scan.with_events = true;
            if prescanned.len() < window {
                let mut page = Vec::with_capacity(prescanned.len());
                for doc in &prescanned {
                    let Some(candidate) = Candidate::from_document(doc) else {
                        continue;
                    };
                    if !ready.contains(&candidate.lane) {
                        continue;
                    }
                    if let Ok(events) = doc.get_array("event")
                        && let Some(Bson::Document(event)) = events.first()
                        && let Ok(raw) = RawDocumentBuf::from_document(event)
                    {
                        scan.events.insert(candidate.event_id.clone(), raw);
                    }
                    page.push(candidate);
                }
                self.look_up_and_pick(page, &mut scan).await?;
                let again: Vec<i32> = joined
                    .into_iter()
                    .filter(|lane| !ready.contains(lane))
                    .collect();
                self.scan_lanes(&again, handlers, now, &mut scan).await?;
            } else {
                // More than one page: scan them as usual.
                ready.extend(joined);
                ready.sort_unstable();
                ready.dedup();
                self.scan_lanes(&ready, handlers, now, &mut scan).await?;
            }
            scan.with_events = false;
        }

        // 4. Free lanes, 4, 8, 16, ... per round, oldest due delivery first. Nothing is written
        //    yet for a lane with nothing to charge: the record below takes it, on condition that
        //    nobody took it since it was read. A lane with lost claims or an earlier holder's
        //    in-flight list is taken first and charged before it is read.
        let mut tried: HashSet<i32> = held_ids.iter().copied().collect();
        // A big claim starts with more lanes, so that it needs fewer rounds now and finds more
        // in the lanes it holds next time.
        let mut round = ((limit - scan.picks.len().min(limit)) / DELIVERIES_PER_LANE)
            .clamp(FIRST_ROUND, MAX_FIRST_ROUND);
        let spread = contenders.clamp(1, MAX_SPREAD);
        // Set once a ranking of this claim saw every due delivery of the lanes it ranked: the
        // free lanes it did not list have nothing to claim.
        let mut complete = false;
        while hints.is_empty() && !scan.full() {
            free.retain(|lane| !tried.contains(&lane.lane.id));
            if free.is_empty() {
                break;
            }
            let free_ids: Vec<i32> = free.iter().map(|lane| lane.lane.id).collect();
            // The rest of a recent ranking serves while it has enough lanes that are still
            // free: ranking reads one index range per free lane, scanning a few lanes
            // does not.
            let kept = reusable(state.ranked.take(), handlers, now, &free_ids);
            let (ranked, ranked_at) = match kept {
                Some((kept, at)) if kept.len() >= round || complete => (kept, at),
                _ if complete => break,
                _ => {
                    let (ranked, seen_all) = self
                        .rank_lanes(&free_ids, handlers, now, round.saturating_mul(spread))
                        .await?;
                    complete = seen_all;
                    (ranked, now)
                }
            };
            if ranked.is_empty() {
                break;
            }
            let chosen = choose(ranked.clone(), round, spread);
            let rest: Vec<i32> = ranked
                .into_iter()
                .filter(|lane| !chosen.contains(lane))
                .collect();
            state.ranked = (!rest.is_empty()).then(|| RankedLanes {
                handlers: handlers.iter().map(|h| (*h).to_owned()).collect(),
                at: ranked_at,
                lanes: rest,
            });
            tried.extend(chosen.iter().copied());
            let scanned = self
                .join_lanes(&chosen, &free, &mut lanes, owner, expires_at, now)
                .await?;
            self.scan_lanes(&scanned, handlers, now, &mut scan).await?;
            round = round.saturating_mul(2);
        }

        // 4. The events of the picks, in one query unless the scans brought them along, read
        //    before anything is recorded.
        let mut events = std::mem::take(&mut scan.events);
        let missing: Vec<Candidate> = scan
            .picks
            .iter()
            .filter(|pick| !events.contains_key(&pick.event_id))
            .cloned()
            .collect();
        if !missing.is_empty() {
            events.extend(self.read_events(&missing).await?);
        }
        let mut picks = std::mem::take(&mut scan.picks);
        picks.retain(|pick| {
            let found = events.contains_key(&pick.event_id);
            if !found {
                tracing::warn!(
                    delivery = %pick.id,
                    event = %pick.event_id,
                    "relaybus: a pending delivery has no event; it is left out of the claim"
                );
            }
            found
        });

        // 5. One conditional write per lane, in one command.
        let mut by_lane: BTreeMap<i32, Vec<ObjectId>> = BTreeMap::new();
        for pick in &picks {
            by_lane.entry(pick.lane).or_default().push(pick.id);
        }
        let mut statements = Vec::new();
        let mut recorded_lanes = Vec::new();
        let mut handed_back = HashSet::new();
        let mut gone_ids = Vec::new();
        for (lane, hold) in &mut lanes {
            let new_ids = by_lane.get(&lane.id).map(Vec::as_slice).unwrap_or(&[]);
            if let Hold::Joining { epoch } = hold {
                // Taken only if it is still free and unchanged since it was read: same epoch,
                // no requeue, nothing listed.
                let filter = doc! {
                    "_id": lane.id,
                    "epoch": epoch.clone(),
                    "requeues": lane.requeues.clone(),
                    "inFlight": { "$in": [Bson::Null, []] },
                    "lost": { "$in": [Bson::Null, []] },
                    "$or": [
                        { "owner": Bson::Null },
                        { "leaseExpiresAt": { "$lte": now } },
                    ],
                };
                lane.epoch = lane.epoch.saturating_add(1);
                if new_ids.is_empty() {
                    // Taken and handed back in one write: it yielded nothing.
                    handed_back.insert(lane.id);
                    statements.push(doc! {
                        "q": filter,
                        "u": { "$set": {
                            "epoch": lane.epoch,
                            "owner": Bson::Null,
                            "instance": Bson::Null,
                            "leaseExpiresAt": Bson::Null,
                            "inFlight": [],
                            "lost": [],
                        } },
                    });
                } else {
                    lane.lease_expires_at = Some(expires_at);
                    statements.push(doc! {
                        "q": filter,
                        "u": { "$set": {
                            "epoch": lane.epoch,
                            "owner": owner,
                            "instance": instance,
                            "leaseExpiresAt": expires_at,
                            "inFlight": new_ids,
                            "lost": [],
                        } },
                    });
                    recorded_lanes.push(lane.id);
                }
                continue;
            }
            let held = matches!(hold, Hold::Held);
            let gone: Vec<ObjectId> = lane
                .in_flight
                .iter()
                .filter(|id| !scan.running.contains(id))
                .copied()
                .collect();
            let runs = lane.in_flight.len() > gone.len();
            gone_ids.extend(gone.iter().copied());
            let filter = lane.held_filter(owner, instance);
            if new_ids.is_empty() && !runs {
                handed_back.insert(lane.id);
                statements.push(doc! {
                    "q": filter,
                    "u": { "$set": {
                        "owner": Bson::Null,
                        "instance": Bson::Null,
                        "leaseExpiresAt": Bson::Null,
                        "inFlight": [],
                        "lost": [],
                    } },
                });
            } else if !new_ids.is_empty() || !gone.is_empty() || !lane.lost.is_empty() || !held {
                statements.push(doc! {
                    "q": filter,
                    "u": [{ "$set": {
                        "inFlight": { "$concatArrays": [
                            { "$filter": {
                                "input": { "$ifNull": ["$inFlight", []] },
                                "cond": { "$not": [{ "$in": ["$$this", { "$literal": &gone }] }] },
                            } },
                            { "$literal": new_ids },
                        ] },
                        "leaseExpiresAt": { "$max": ["$leaseExpiresAt", expires_at] },
                        "lost": { "$literal": [] },
                    } }],
                });
                if !new_ids.is_empty() {
                    recorded_lanes.push(lane.id);
                }
            }
        }
        let lanes: Vec<Lane> = lanes.into_iter().map(|(lane, _)| lane).collect();
        let mut matched = 0;
        for chunk in statements.chunks(STATEMENTS_PER_COMMAND) {
            let reply = inner
                .db
                .run_command(doc! {
                    "update": inner.lanes.name(),
                    "updates": chunk,
                    "ordered": false,
                    "writeConcern": { "w": "majority" },
                })
                .await?;
            check_write_reply(&reply)?;
            matched += reply_count(&reply);
        }
        inner.claims.forget(gone_ids);
        let mut raced = false;
        if matched < statements.len() as u64 && !recorded_lanes.is_empty() {
            // A lane changed hands, or a requeue touched it, since it was read: keep only the
            // picks of lanes that list them under the epoch they were read in.
            let confirmed = self
                .confirm_recorded(&lanes, &recorded_lanes, &by_lane, owner)
                .await?;
            let before = picks.len();
            picks.retain(|pick| confirmed.contains(&pick.lane));
            raced = picks.len() < before;
        }

        // 6. Park what waits, best effort: big backlogs of one key, and whatever waits in a
        //    lane handed back (its due work is all blocked).
        let mut to_park: Vec<ObjectId> = Vec::new();
        for waiting in scan.waiting.values() {
            if waiting.len() >= PARK_THRESHOLD {
                to_park.extend(waiting.iter().map(|(id, _)| *id));
            } else {
                to_park.extend(
                    waiting
                        .iter()
                        .filter(|(_, lane)| handed_back.contains(lane))
                        .map(|(id, _)| *id),
                );
            }
        }
        if !to_park.is_empty()
            && let Err(error) = self.park(&to_park).await
        {
            tracing::warn!(
                owner,
                count = to_park.len(),
                %error,
                "relaybus: parking waiting deliveries failed; the next claims scan them again"
            );
        }

        // 7. Hand the batch out.
        let lane_expiry: HashMap<i32, DateTime> = lanes
            .iter()
            .map(|lane| {
                let current = lane.lease_expires_at.unwrap_or(expires_at);
                (lane.id, current.max(expires_at))
            })
            .collect();
        let mut claimed = Vec::with_capacity(picks.len());
        for pick in picks {
            let lane = lanes
                .iter()
                .find(|lane| lane.id == pick.lane)
                .map(|lane| lane.epoch)
                .unwrap_or_default();
            let lease = Lease::new(pick.id, pick.lane as u32, lane, pick.claims);
            let event = match events.get(&pick.event_id) {
                Some(raw) => envelope(&pick, raw),
                None => continue,
            };
            claimed.push(ClaimedDelivery {
                lease,
                lease_expires_at: lane_expiry.get(&pick.lane).copied().unwrap_or(expires_at),
                handler: pick.handler,
                attempt: u32::try_from(pick.attempts.max(0).saturating_add(1)).unwrap_or(u32::MAX),
                sequence: pick.sequence,
                event,
            });
        }
        inner.claims.issue(claimed.iter().map(|c| c.lease));
        Ok(Some(Batch { claimed, raced }))
    }

    /// The claim's first read, one aggregation: every lane document; the documents of the
    /// deliveries listed by the lanes `owner` holds on this instance; for up to 32 handlers, the
    /// lowest parked delivery of each of their keys; and, when asked, the first page of a scan
    /// of some lanes. The lanes are read first: deliveries read after them can only be newer,
    /// so a lane taken and handed back meanwhile shows a new epoch to the record's condition.
    async fn read_lanes(
        &self,
        owner: &str,
        handlers: &[&str],
        now: DateTime,
        prescan: Option<(&[i32], usize)>,
    ) -> Result<LaneView> {
        let inner = &self.inner;
        let instance = inner.claims.instance;
        // The lane documents pass through as they are (read raw: the in-flight lists of other
        // holders' lanes are only looked at, never decoded); the rest comes after them.
        let mut pipeline = vec![doc! { "$unionWith": {
            "coll": inner.lanes.name(),
            "pipeline": [
                { "$match": { "owner": owner, "instance": instance } },
                { "$lookup": {
                    "from": inner.deliveries.name(),
                    "localField": "inFlight",
                    "foreignField": "_id",
                    "pipeline": [{ "$project": {
                        "handler": 1, "key": 1, "claims": 1, "status": 1,
                    } }],
                    "as": "running",
                } },
                { "$project": { "_id": 0, "running": 1 } },
            ],
        } }];
        let fold_parked = handlers.len() <= PARKED_IN_LANE_READ;
        if fold_parked {
            for handler in handlers {
                pipeline.push(doc! { "$unionWith": {
                    "coll": inner.deliveries.name(),
                    "pipeline": parked_heads_stages(handler),
                } });
            }
        }
        if let Some((lanes, window)) = prescan {
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
        let docs: Vec<RawDocumentBuf> = inner
            .lanes
            .aggregate(pipeline)
            // Large enough that the first batch ends the cursor.
            .batch_size(100_000)
            .await?
            .with_type::<RawDocumentBuf>()
            .try_collect()
            .await?;

        let mut view = LaneView {
            parked: fold_parked.then(Vec::new),
            ..LaneView::default()
        };
        let mut listed_docs = Vec::new();
        let mut lanes = Vec::new();
        for raw in docs {
            let has = |name: &str| raw.get(name).ok().flatten().is_some();
            if !(has("prescanned") || has("parkedKey") || has("running")) {
                lanes.push(raw);
                continue;
            }
            let Ok(doc) = Document::try_from(raw.as_ref()) else {
                continue;
            };
            if doc.contains_key("prescanned") {
                view.prescanned.push(doc);
            } else if doc.contains_key("parkedKey") {
                if let (Some(parked), Some(head)) =
                    (view.parked.as_mut(), ParkedHead::from_document(&doc))
                {
                    parked.push(head);
                }
            } else if let Ok(running) = doc.get_array("running") {
                listed_docs.extend(running.iter().filter_map(|d| d.as_document().cloned()));
            }
        }
        let mut others: HashSet<(String, Option<ObjectId>)> = HashSet::new();
        for raw in &lanes {
            let owned_by = raw.get_str("owner").ok();
            let held_by = raw.get_object_id("instance").ok();
            if owned_by == Some(owner) && held_by == Some(instance) {
                if let Some(lane) = Document::try_from(raw.as_ref())
                    .ok()
                    .as_ref()
                    .and_then(Lane::from_document)
                {
                    view.held.push(lane);
                }
                continue;
            }
            let expired = raw
                .get_datetime("leaseExpiresAt")
                .ok()
                .is_none_or(|expiry| expiry <= now);
            if owned_by.is_none() || expired {
                if let Some(lane) = FreeLane::from_raw(raw) {
                    view.free.push(lane);
                }
            } else {
                if let (Some(owner), Some(id)) = (
                    owned_by,
                    raw_int(raw, "_id").and_then(|id| i32::try_from(id).ok()),
                ) {
                    others.insert((owner.to_owned(), held_by));
                    view.taken_by_others.insert(id);
                }
            }
        }
        view.contenders = 1 + others.len();
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
                doc.get_object_id("_id")
                    .is_ok_and(|id| listed.contains(&id))
            })
            .collect();
        Ok(view)
    }

    /// The deliveries `lanes` list that still exist (they run), their keys, and their claim
    /// generations.
    async fn load_running(
        &self,
        lanes: &[Lane],
    ) -> Result<(HashSet<ObjectId>, HashSet<KeyOf>, HashMap<ObjectId, i64>)> {
        let listed: Vec<ObjectId> = lanes
            .iter()
            .flat_map(|lane| lane.in_flight.iter().copied())
            .collect();
        if listed.is_empty() {
            return Ok(running_of(&[]));
        }
        let docs: Vec<Document> = self
            .inner
            .deliveries
            .find(doc! { "_id": { "$in": &listed } })
            .projection(doc! { "handler": 1, "key": 1, "claims": 1 })
            .limit(listed.len() as i64)
            .batch_size(u32::try_from(listed.len()).unwrap_or(u32::MAX))
            .await?
            .try_collect()
            .await?;
        Ok(running_of(&docs))
    }

    /// Charges every lost claim listed by `lanes` one attempt, once: `lostAt` records the epoch
    /// of the last lost claim charged and only grows. The claim generation moves on, so the
    /// lease of the lost claim can no longer match.
    async fn charge_lost(&self, lanes: &[Lane], now: DateTime) -> Result<()> {
        let statements: Vec<Document> = lanes
            .iter()
            .flat_map(|lane| lane.lost.iter())
            .map(|lost| {
                doc! {
                    "q": {
                        "_id": lost.delivery,
                        "status": "pending",
                        "$or": [
                            { "lostAt": { "$exists": false } },
                            { "lostAt": { "$lt": lost.epoch } },
                        ],
                    },
                    "u": {
                        "$inc": { "attempts": 1, "claims": 1_i64 },
                        "$set": { "lostAt": lost.epoch, "updatedAt": now },
                    },
                }
            })
            .collect();
        for chunk in statements.chunks(STATEMENTS_PER_COMMAND) {
            let reply = self
                .inner
                .db
                .run_command(doc! {
                    "update": self.inner.deliveries.name(),
                    "updates": chunk,
                    "ordered": false,
                    "writeConcern": { "w": "majority" },
                })
                .await?;
            check_write_reply(&reply)?;
        }
        let lost: Vec<ObjectId> = lanes
            .iter()
            .flat_map(|lane| lane.lost.iter().map(|lost| lost.delivery))
            .collect();
        self.inner.claims.forget(lost);
        Ok(())
    }

    /// Reads the due, ready deliveries of `lanes` in `(dueAt, _id)` order and picks from them
    /// until the claim is full or the lanes have nothing more.
    async fn scan_lanes(
        &self,
        lanes: &[i32],
        handlers: &[&str],
        now: DateTime,
        scan: &mut Scan,
    ) -> Result<()> {
        for group in lanes.chunks(LANES_PER_QUERY) {
            if scan.full() {
                return Ok(());
            }
            let filter = scan_filter(group, handlers, now);
            let projection = candidate_fields();
            // The first page is sized to fill the claim, plus a few blocked ones; the deliveries
            // already running are left out on the index keys. The events of the picks are read
            // afterwards, in one query: for a big page, a `$lookup` here costs the server more
            // than that extra round trip, and it would read events of deliveries not picked.
            let need = scan.limit - scan.picks.len();
            let window = (need + 16).min(MAX_CLAIM_LIMIT as usize * 2);
            let mut first = filter.clone();
            if !scan.running.is_empty() {
                let running: Vec<ObjectId> = scan.running.iter().copied().collect();
                first.insert("_id", doc! { "$nin": running });
            }
            let raw: Vec<RawDocumentBuf> = if scan.with_events {
                self.inner
                    .deliveries
                    .aggregate(page_with_events(first, window, self.inner.events.name()))
                    .hint(Hint::Name("claim".to_owned()))
                    .batch_size(window as u32 + 1)
                    .await?
                    .with_type::<RawDocumentBuf>()
                    .try_collect()
                    .await?
            } else {
                self.inner
                    .deliveries
                    .clone_with_type::<RawDocumentBuf>()
                    .find(first)
                    .sort(doc! { "dueAt": 1, "_id": 1 })
                    .projection(projection.clone())
                    .hint(Hint::Name("claim".to_owned()))
                    .limit(window as i64)
                    // One more than the page holds, so that the first batch ends the cursor.
                    .batch_size(window as u32 + 1)
                    .await?
                    .try_collect()
                    .await?
            };
            let mut page = Vec::with_capacity(raw.len());
            for doc in &raw {
                let Some(candidate) = Candidate::from_raw(doc) else {
                    continue;
                };
                if let Ok(events) = doc.get_array("event")
                    && let Some(Ok(event)) = events.into_iter().next()
                    && let Some(event) = event.as_document()
                {
                    scan.events
                        .entry(candidate.event_id.clone())
                        .or_insert_with(|| event.to_raw_document_buf());
                }
                page.push(candidate);
            }
            let exhausted = raw.len() < window;
            let mut last = page.last().map(|c| (c.due_at, c.id));
            self.look_up_and_pick(page, scan).await?;
            if exhausted || scan.full() {
                continue;
            }
            // More than one page: go on from where the page ended, in batches.
            let Some((due, id)) = last.take() else {
                continue;
            };
            let mut rest = filter;
            rest.insert(
                "$or",
                vec![
                    doc! { "dueAt": { "$gt": due } },
                    doc! { "dueAt": due, "_id": { "$gt": id } },
                ],
            );
            let mut cursor = self
                .inner
                .deliveries
                .find(rest)
                .sort(doc! { "dueAt": 1, "_id": 1 })
                .projection(projection)
                .batch_size(SCAN_BATCH)
                .await?;
            let mut batch = Vec::with_capacity(SCAN_BATCH as usize);
            loop {
                let next = cursor.try_next().await?;
                let done = next.is_none();
                if let Some(candidate) = next.as_ref().and_then(Candidate::from_document) {
                    batch.push(candidate);
                }
                if (done && !batch.is_empty()) || batch.len() >= SCAN_BATCH as usize {
                    self.look_up_and_pick(std::mem::take(&mut batch), scan)
                        .await?;
                }
                if done || scan.full() {
                    break;
                }
            }
        }
        Ok(())
    }

    /// Looks up, in parallel, the lowest pending delivery of the keys of `page` that the per-key
    /// rules need and do not know yet, then picks from the page.
    async fn look_up_and_pick(&self, page: Vec<Candidate>, scan: &mut Scan) -> Result<()> {
        let unknown = scan.unknown_keys(&page);
        if !unknown.is_empty() {
            let lowest = self.lowest_pending(&unknown).await?;
            scan.learn_heads(unknown, &lowest);
        }
        scan.pick(page);
        Ok(())
    }

    /// The `free` lanes with due deliveries of `handlers` that the oldest entries of the claim
    /// index show (enough to find `count` lanes, unless a few lanes hold all the oldest work),
    /// the lane with the oldest due delivery first; and whether these are all the `free` lanes
    /// with due deliveries (the queries read fewer entries than they could).
    async fn rank_lanes(
        &self,
        free: &[i32],
        handlers: &[&str],
        now: DateTime,
        count: usize,
    ) -> Result<(Vec<i32>, bool)> {
        // Enough index entries to find `count` lanes unless a few lanes hold all the oldest
        // work; the next round then looks again without them.
        let window = (count as i64 * 8).clamp(32, DISCOVERY_WINDOW);
        let queries = free.chunks(LANES_PER_QUERY).map(|group| async move {
            let docs: Vec<Document> = self
                .inner
                .deliveries
                .find(doc! {
                    "laneId": { "$in": group },
                    "status": "pending",
                    "lane": "ready",
                    "dueAt": { "$lte": now },
                    "handler": { "$in": handlers },
                })
                .sort(doc! { "dueAt": 1, "_id": 1 })
                .projection(doc! { "_id": 0, "laneId": 1, "dueAt": 1 })
                .hint(Hint::Name("claim".to_owned()))
                .limit(window)
                .batch_size(window as u32)
                .await?
                .try_collect()
                .await?;
            let seen_all = (docs.len() as i64) < window;
            Ok::<_, Error>((docs, seen_all))
        });
        let mut oldest: HashMap<i32, DateTime> = HashMap::new();
        let mut seen_all = true;
        for (docs, all) in future::try_join_all(queries).await? {
            seen_all &= all;
            for doc in docs {
                let (Some(lane), Ok(due)) = (int(&doc, "laneId"), doc.get_datetime("dueAt")) else {
                    continue;
                };
                let Ok(lane) = i32::try_from(lane) else {
                    continue;
                };
                let entry = oldest.entry(lane).or_insert(*due);
                if *due < *entry {
                    *entry = *due;
                }
            }
        }
        let mut ranked: Vec<(DateTime, i32)> = oldest.into_iter().map(|(l, d)| (d, l)).collect();
        ranked.sort();
        Ok((ranked.into_iter().map(|(_, lane)| lane).collect(), seen_all))
    }

    /// Takes free lanes, in parallel, each with one conditional `findAndModify`: the epoch grows
    /// by one and the previous holder's in-flight list moves to `lost`, tagged with the epoch it
    /// was claimed in. A lane another claimer took first is skipped.
    async fn take_lanes(
        &self,
        lanes: &[i32],
        owner: &str,
        expires_at: DateTime,
        now: DateTime,
    ) -> Result<Vec<Lane>> {
        let instance = self.inner.claims.instance;
        let takes = lanes.iter().map(|&lane| async move {
            let taken = self
                .inner
                .lanes
                .find_one_and_update(
                    doc! {
                        "_id": lane,
                        "$or": [
                            { "owner": Bson::Null },
                            { "leaseExpiresAt": { "$lte": now } },
                        ],
                    },
                    vec![doc! { "$set": {
                        "lost": { "$concatArrays": [
                            { "$ifNull": ["$lost", []] },
                            { "$map": {
                                "input": { "$ifNull": ["$inFlight", []] },
                                "in": { "d": "$$this", "e": { "$ifNull": ["$epoch", 0_i64] } },
                            } },
                        ] },
                        "inFlight": { "$literal": [] },
                        "epoch": { "$add": [{ "$ifNull": ["$epoch", 0_i64] }, 1_i64] },
                        "owner": { "$literal": owner },
                        "instance": { "$literal": instance },
                        "leaseExpiresAt": { "$literal": expires_at },
                    } }],
                )
                .return_document(ReturnDocument::After)
                .await?;
            Ok::<_, Error>(taken.as_ref().and_then(Lane::from_document))
        });
        Ok(future::try_join_all(takes)
            .await?
            .into_iter()
            .flatten()
            .collect())
    }

    /// The events of the picks, as raw documents (payloads are never decoded as extended JSON).
    async fn read_events(&self, picks: &[Candidate]) -> Result<HashMap<String, RawDocumentBuf>> {
        let mut ids: Vec<&str> = picks.iter().map(|p| p.event_id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        if ids.is_empty() {
            return Ok(HashMap::new());
        }
        let events = self.inner.events.clone_with_type::<RawDocumentBuf>();
        let mut cursor = events
            .find(doc! { "_id": { "$in": &ids } })
            .projection(doc! { "handlers": 0 })
            .limit(ids.len() as i64)
            .batch_size(u32::try_from(ids.len()).unwrap_or(u32::MAX))
            .await?;
        let mut found = HashMap::with_capacity(ids.len());
        while let Some(event) = cursor.try_next().await? {
            if let Ok(id) = event.get_str("_id") {
                found.insert(id.to_owned(), event);
            }
        }
        Ok(found)
    }

    /// After a short write: the lanes (of those given) that list their picks under the epoch the
    /// claim read.
    async fn confirm_recorded(
        &self,
        lanes: &[Lane],
        recorded: &[i32],
        picks: &BTreeMap<i32, Vec<ObjectId>>,
        owner: &str,
    ) -> Result<HashSet<i32>> {
        let instance = self.inner.claims.instance;
        let docs: Vec<Document> = self
            .inner
            .lanes
            .find(doc! { "_id": { "$in": recorded } })
            .await?
            .try_collect()
            .await?;
        let mut confirmed = HashSet::new();
        for doc in &docs {
            let Some(now) = Lane::from_document(doc) else {
                continue;
            };
            let Some(then) = lanes.iter().find(|lane| lane.id == now.id) else {
                continue;
            };
            let ours = doc.get_str("owner") == Ok(owner)
                && doc.get_object_id("instance") == Ok(instance)
                && now.epoch == then.epoch;
            let listed = picks
                .get(&now.id)
                .is_some_and(|ids| ids.iter().all(|id| now.in_flight.contains(id)));
            if ours && listed {
                confirmed.insert(now.id);
            }
        }
        Ok(confirmed)
    }

    /// Puts the owner's lanes on this instance back in order after a failed or interrupted
    /// claim, in one transaction. A listed delivery stays listed only if this instance handed
    /// out its current claim (same lane epoch and claim generation) and has not seen it settled;
    /// every other one is taken out of the lane and its claim generation moves on, so no lease
    /// of it can match a later claim. A lane taken over meanwhile conflicts with the
    /// transaction, which then runs again and leaves the new holder's lane alone.
    pub(crate) async fn reconcile(&self, owner: &str, now: DateTime) -> Result<()> {
        let dropped = self
            // The failed claim's record may have been applied without being majority-committed
            // yet (a write concern error): read the latest data, or the record could be missed.
            .own_transaction_reading_latest((self, owner, now), |session, (store, owner, now)| {
                Box::pin(store.reconcile_in(session, owner, *now))
            })
            .await?;
        self.inner.claims.forget(dropped);
        Ok(())
    }

    async fn reconcile_in(
        &self,
        session: &mut ClientSession,
        owner: &str,
        now: DateTime,
    ) -> Result<Vec<ObjectId>> {
        let inner = &self.inner;
        let instance = inner.claims.instance;
        let lanes: Vec<Lane> = inner
            .lanes
            .find(doc! { "owner": owner, "instance": instance })
            .session(&mut *session)
            .await?
            .stream(&mut *session)
            .try_collect::<Vec<Document>>()
            .await?
            .iter()
            .filter_map(Lane::from_document)
            .collect();
        let listed: Vec<ObjectId> = lanes
            .iter()
            .flat_map(|lane| lane.in_flight.iter().copied())
            .collect();
        if listed.is_empty() {
            return Ok(Vec::new());
        }
        let generations: HashMap<ObjectId, i64> = inner
            .deliveries
            .find(doc! { "_id": { "$in": &listed } })
            .projection(doc! { "claims": 1 })
            .session(&mut *session)
            .await?
            .stream(&mut *session)
            .try_collect::<Vec<Document>>()
            .await?
            .iter()
            .filter_map(|doc| {
                Some((
                    doc.get_object_id("_id").ok()?,
                    int(doc, "claims").unwrap_or(0),
                ))
            })
            .collect();
        let mut dropped = Vec::new();
        for lane in &lanes {
            let (keep, drop): (Vec<ObjectId>, Vec<ObjectId>) =
                lane.in_flight.iter().partition(|id| {
                    let current = generations.get(id).map(|&claims| Issued {
                        lane: lane.id,
                        epoch: lane.epoch,
                        claims,
                    });
                    current.is_some() && inner.claims.issued(id) == current
                });
            if drop.is_empty() {
                continue;
            }
            inner
                .lanes
                .update_one(
                    doc! { "_id": lane.id, "epoch": lane.epoch },
                    doc! { "$set": { "inFlight": keep } },
                )
                .session(&mut *session)
                .await?;
            dropped.extend(drop);
        }
        let existing: Vec<ObjectId> = dropped
            .iter()
            .filter(|id| generations.contains_key(id))
            .copied()
            .collect();
        if !existing.is_empty() {
            inner
                .deliveries
                .update_many(
                    doc! { "_id": { "$in": existing } },
                    doc! { "$inc": { "claims": 1_i64 }, "$set": { "updatedAt": now } },
                )
                .session(&mut *session)
                .await?;
        }
        Ok(dropped)
    }
}

/// The event of a pick, from its raw stored document.
fn envelope(pick: &Candidate, raw: &RawDocumentBuf) -> EventEnvelope {
    let text = |name: &str| raw.get_str(name).ok().map(str::to_owned);
    let payload = match raw.get_document("payload") {
        Ok(payload) => raw_document_to_json(payload),
        _ => serde_json::Map::new(),
    };
    let headers = match raw.get_document("headers") {
        Ok(headers) => headers
            .into_iter()
            .filter_map(Result::ok)
            .filter_map(|(name, value)| match raw_to_json(value) {
                serde_json::Value::String(value) => Some((name.to_owned(), value)),
                _ => None,
            })
            .collect(),
        _ => Default::default(),
    };
    let created_at = raw
        .get_datetime("createdAt")
        .map_or(Timestamp::EPOCH, |at| {
            Timestamp::from_millis(at.timestamp_millis())
        });
    EventEnvelope {
        id: pick.event_id.clone(),
        event_type: text("type").unwrap_or_default(),
        payload,
        key: text("key"),
        correlation_id: text("correlationId"),
        causation_id: text("causationId"),
        headers,
        created_at,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_ranking_serves_the_same_handlers_for_a_second_and_only_free_lanes() {
        let at = DateTime::from_millis(10_000);
        let kept = || {
            Some(RankedLanes {
                handlers: vec!["a".into(), "b".into()],
                at,
                lanes: vec![5, 3, 9],
            })
        };
        let later = |ms: i64| DateTime::from_millis(10_000 + ms);
        assert_eq!(
            reusable(kept(), &["a", "b"], later(1_000), &[9, 5, 7]),
            Some((vec![5, 9], at))
        );
        assert_eq!(reusable(kept(), &["a", "b"], later(1_001), &[5]), None);
        assert_eq!(reusable(kept(), &["a", "b"], later(-1), &[5]), None);
        assert_eq!(reusable(kept(), &["a"], later(0), &[5]), None);
        assert_eq!(reusable(kept(), &["b", "a"], later(0), &[5]), None);
        assert_eq!(reusable(None, &["a", "b"], later(0), &[5]), None);
    }

    #[test]
    fn a_free_lane_is_clean_only_with_empty_lists() {
        let read = |doc: Document| {
            FreeLane::from_raw(&RawDocumentBuf::from_document(&doc).unwrap()).unwrap()
        };
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
        assert!(
            FreeLane::from_raw(&RawDocumentBuf::from_document(&doc! { "_id": "x" }).unwrap())
                .is_none()
        );
    }

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
        };
        let raw = RawDocumentBuf::from_document(&doc! {
            "_id": "e-1",
            "type": "a.b",
            "payload": { "id": { "$oid": "not an id" }, "n": 1 },
            "headers": { "$date": "x" },
            "createdAt": DateTime::from_millis(7),
        })
        .unwrap();
        let event = envelope(&pick, &raw);
        assert_eq!(
            serde_json::Value::Object(event.payload),
            serde_json::json!({ "id": { "$oid": "not an id" }, "n": 1 })
        );
        assert_eq!(event.headers.get("$date").map(String::as_str), Some("x"));
        assert_eq!(event.created_at, Timestamp::from_millis(7));
    }
}
