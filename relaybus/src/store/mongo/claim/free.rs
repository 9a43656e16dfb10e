//! Free lanes: lanes without a holder, or whose lease expired, that have due deliveries of the
//! claim's handlers. A claim takes them in rounds of 4, then 8, 16, ... lanes, the lane with the
//! oldest due delivery first, until it is full, as the specification describes, when the lanes
//! it holds did not fill it: once a second at most for a member that owns lanes, at every such
//! claim for one that owns none (members that claim for other handler sets than the rest).

use futures::{TryStreamExt, future};
use mongodb::bson::{Bson, DateTime, Document, doc};

use super::{
    Request,
    scan::{LANES_PER_QUERY, Scan, scan_filter},
    take::Hold,
};
use crate::{
    error::Result,
    store::mongo::{
        MongoEventStore,
        lane::Lane,
        schema::{field, index},
    },
};

/// The first round's lanes.
const FIRST_ROUND: usize = 4;
/// The due deliveries read to rank free lanes, per 128 lanes.
const RANK_WINDOW: i64 = 512;

/// A free lane as read.
#[derive(Debug, Clone)]
pub(crate) struct FreeLane {
    pub(crate) lane: Lane,
    /// Nothing in flight, nothing lost: the record may take it without an earlier write.
    pub(crate) clean: bool,
    /// The epoch as stored (`Null` when absent), matched when the record takes it.
    pub(crate) stored_epoch: Bson,
}

impl MongoEventStore {
    /// Takes free lanes with due deliveries of the claim's handlers, round by round, and scans
    /// them, until the claim is full or no free lane has any.
    pub(super) async fn take_free_lanes(
        &self,
        request: &Request<'_>,
        lanes: &mut Vec<(Lane, Hold)>,
        scan: &mut Scan,
    ) -> Result<()> {
        let Request { handlers, now, .. } = *request;
        let free: Vec<FreeLane> = self
            .free_lanes(now)
            .await?
            .into_iter()
            .filter(|free| !lanes.iter().any(|(lane, _)| lane.id == free.lane.id))
            .collect();
        if free.is_empty() {
            return Ok(());
        }
        let ids: Vec<i32> = free.iter().map(|free| free.lane.id).collect();
        let ranked = self.rank(&ids, handlers, now).await?;
        let mut round = FIRST_ROUND;
        let mut at = 0;
        while at < ranked.len() && !scan.picking.full() {
            let chosen = &ranked[at..(at + round).min(ranked.len())];
            at += chosen.len();
            round *= 2;
            let scanned = self.join_lanes(chosen, &free, lanes, request).await?;
            self.scan_lanes(&scanned, handlers, now, scan).await?;
        }
        Ok(())
    }

    /// The free lanes at `now`: no holder, or an expired lease.
    async fn free_lanes(&self, now: DateTime) -> Result<Vec<FreeLane>> {
        let docs: Vec<Document> = self
            .inner
            .lanes
            .find(doc! { "$or": [
                { field::OWNER: Bson::Null },
                { field::LEASE_EXPIRES_AT: { "$lte": now } },
            ] })
            .await?
            .try_collect()
            .await?;
        Ok(docs
            .iter()
            .filter_map(|doc| {
                let lane = Lane::from_document(doc)?;
                Some(FreeLane {
                    clean: lane.in_flight.is_empty() && lane.lost.is_empty(),
                    stored_epoch: doc.get(field::EPOCH).cloned().unwrap_or(Bson::Null),
                    lane,
                })
            })
            .collect())
    }

    /// Of `lanes`, those with due, ready deliveries of `handlers`, the one with the oldest due
    /// delivery first: one read per 128 lanes, in parallel, of the oldest due deliveries.
    async fn rank(&self, lanes: &[i32], handlers: &[&str], now: DateTime) -> Result<Vec<i32>> {
        let reads = lanes.chunks(LANES_PER_QUERY).map(|group| async move {
            let found: Vec<Document> = self
                .inner
                .deliveries
                .find(scan_filter(group, handlers, now))
                .sort(doc! { field::DUE_AT: 1, field::ID: 1 })
                .projection(doc! { field::LANE_ID: 1, field::DUE_AT: 1 })
                .hint(index::hint(index::CLAIM))
                .limit(RANK_WINDOW)
                .await?
                .try_collect()
                .await?;
            Ok::<_, crate::Error>(found)
        });
        let mut found: Vec<(DateTime, i32)> = future::try_join_all(reads)
            .await?
            .iter()
            .flatten()
            .filter_map(|doc| {
                Some((
                    *doc.get_datetime(field::DUE_AT).ok()?,
                    crate::store::mongo::lane::int32(doc, field::LANE_ID)?,
                ))
            })
            .collect();
        found.sort();
        let mut ranked: Vec<i32> = Vec::new();
        for (_, lane) in found {
            if !ranked.contains(&lane) {
                ranked.push(lane);
            }
        }
        Ok(ranked)
    }
}
