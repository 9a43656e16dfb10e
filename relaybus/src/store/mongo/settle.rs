//! Ending a claim other than by completion (retry later, give back, bury), and renewing a lease.
//!
//! Each runs in one transaction that reads the lane and writes both the delivery and the lane,
//! so it conflicts with a takeover of the lane: whichever commits second sees the other's state.
//! A claim that ends moves the delivery's claim generation on, so its lease never matches a
//! later claim of the same delivery, even by the same owner in the same lane epoch.

use std::time::Duration;

use mongodb::{
    ClientSession,
    bson::{Bson, DateTime, Document, doc},
};

use super::{
    MongoEventStore,
    lane::{add, clip_error, push_error},
    lease::Lease,
    schema::{field, lane, status},
};
use crate::{error::Result, store::checks::check_lease_duration};

/// How a claim ends.
#[derive(Debug, Clone, Copy)]
enum Ending<'a> {
    Reschedule { due_at: DateTime, error: &'a str },
    Release,
    Bury { error: &'a str },
}

impl Ending<'_> {
    /// The delivery's update, a pipeline: a failed attempt also joins the error history.
    fn update(&self, now: DateTime) -> Vec<Document> {
        let plus_one = |field: &str, one: Bson| {
            doc! { "$add": [{ "$ifNull": [format!("${field}"), 0_i32] }, one] }
        };
        let mut set = doc! {
            field::CLAIMS: plus_one(field::CLAIMS, Bson::Int64(1)),
            field::UPDATED_AT: now,
        };
        match *self {
            Ending::Reschedule { due_at, error } => {
                set.insert(field::ATTEMPTS, plus_one(field::ATTEMPTS, Bson::Int32(1)));
                set.insert(field::DUE_AT, due_at);
                set.insert(field::LAST_ERROR, doc! { "$literal": clip_error(error) });
                set.insert(field::ERRORS, push_error(error, now));
            }
            Ending::Release => {}
            Ending::Bury { error } => {
                set.insert(field::ATTEMPTS, plus_one(field::ATTEMPTS, Bson::Int32(1)));
                set.insert(field::STATUS, status::DEAD);
                // One that ran from the parked lane leaves it: a dead delivery parked would
                // stand for its key's parked deliveries and hide the next ones.
                set.insert(field::LANE, lane::READY);
                set.insert(field::LAST_ERROR, doc! { "$literal": clip_error(error) });
                set.insert(field::ERRORS, push_error(error, now));
            }
        }
        vec![doc! { "$set": set }]
    }
}

impl MongoEventStore {
    /// Ends a failed attempt and makes the delivery due again at `due_at`.
    ///
    /// The attempt counts (`attempts` grows by one) and `error` is kept as the delivery's last
    /// error (cut to 8 KiB). Returns `false`, changing nothing, when the lease no longer holds:
    /// the lane changed hands or no longer lists the delivery, or the claim already ended.
    /// Later deliveries of the same key stay blocked until this one completes or is buried,
    /// unless it is an unordered delivery.
    ///
    /// # Errors
    ///
    /// [`Error::Database`](crate::Error::Database) once the transaction's retries are used up.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may or may not have rescheduled the delivery; calling again with the
    /// same lease returns `false` if it was.
    pub async fn reschedule(
        &self,
        lease: &Lease,
        due_at: DateTime,
        error: &str,
        now: DateTime,
    ) -> Result<bool> {
        self.end_claim(lease, Ending::Reschedule { due_at, error }, now)
            .await
    }

    /// Gives the delivery back without counting an attempt, for a worker that stops before
    /// running it (graceful shutdown). It is due again at once, for any worker.
    ///
    /// Returns `false`, changing nothing, when the lease no longer holds.
    ///
    /// # Errors
    ///
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    ///
    /// As for [`reschedule`](Self::reschedule).
    pub async fn release(&self, lease: &Lease, now: DateTime) -> Result<bool> {
        self.end_claim(lease, Ending::Release, now).await
    }

    /// Ends a failed attempt and moves the delivery to the dead letters, for good or until an
    /// operator [requeues](Self::requeue) it. The attempt counts and `error` is kept.
    ///
    /// A dead delivery no longer blocks later deliveries of its key. Returns `false`, changing
    /// nothing, when the lease no longer holds.
    ///
    /// # Errors
    ///
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    ///
    /// As for [`reschedule`](Self::reschedule).
    pub async fn bury(&self, lease: &Lease, error: &str, now: DateTime) -> Result<bool> {
        self.end_claim(lease, Ending::Bury { error }, now).await
    }

    /// Extends the lease of the delivery's lane to at least `now + lease_duration`, and returns
    /// the new expiry; a lease never shrinks. Returns `None`, changing nothing, when the lease
    /// no longer holds.
    ///
    /// The claim generation is checked and the lane extended in one transaction, so a stale
    /// lease never extends the lane of a newer claim. The lease covers the whole lane, so one
    /// renewal per lane is enough for all its deliveries.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a duration outside 1 ms to
    /// 7 days (nothing is sent); [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future at most leaves the lease extended.
    pub async fn extend_lease(
        &self,
        lease: &Lease,
        lease_duration: Duration,
        now: DateTime,
    ) -> Result<Option<DateTime>> {
        check_lease_duration(lease_duration)?;
        let expires_at = add(now, lease_duration)?;
        self.own_transaction((self, lease, expires_at), |session, (store, lease, at)| {
            Box::pin(store.extend_in(session, lease, *at))
        })
        .await
    }

    async fn end_claim(&self, lease: &Lease, ending: Ending<'_>, now: DateTime) -> Result<bool> {
        let ended = self
            .own_transaction(
                (self, lease, ending, now),
                |session, (store, lease, ending, now)| {
                    Box::pin(store.end_claim_in(session, lease, *ending, *now))
                },
            )
            .await?;
        self.inner.claims.settled(lease);
        if ended {
            self.inner.claims.given_back(lease);
        }
        Ok(ended)
    }

    async fn end_claim_in(
        &self,
        session: &mut ClientSession,
        lease: &Lease,
        ending: Ending<'_>,
        now: DateTime,
    ) -> Result<bool> {
        let inner = &self.inner;
        let lane_filter = doc! {
            field::ID: lease.lane_i32(),
            field::EPOCH: lease.epoch(),
            field::IN_FLIGHT: lease.delivery_id(),
        };
        let listed = inner
            .lanes
            .find_one(lane_filter.clone())
            .projection(doc! { field::ID: 1 })
            .session(&mut *session)
            .await?;
        if listed.is_none() {
            return Ok(false);
        }
        let changed = inner
            .deliveries
            .update_one(
                doc! {
                    field::ID: lease.delivery_id(),
                    field::STATUS: status::PENDING,
                    field::LANE_ID: lease.lane_i32(),
                    field::CLAIMS: lease.generation_filter(),
                },
                ending.update(now),
            )
            .session(&mut *session)
            .await?;
        if changed.matched_count == 0 {
            return Ok(false);
        }
        inner
            .lanes
            .update_one(
                lane_filter,
                doc! { "$pull": { field::IN_FLIGHT: lease.delivery_id() } },
            )
            .session(&mut *session)
            .await?;
        Ok(true)
    }

    async fn extend_in(
        &self,
        session: &mut ClientSession,
        lease: &Lease,
        expires_at: DateTime,
    ) -> Result<Option<DateTime>> {
        let inner = &self.inner;
        let lane_filter = doc! {
            field::ID: lease.lane_i32(),
            field::EPOCH: lease.epoch(),
            field::IN_FLIGHT: lease.delivery_id(),
        };
        let Some(lane) = inner
            .lanes
            .find_one(lane_filter.clone())
            .projection(doc! { field::LEASE_EXPIRES_AT: 1 })
            .session(&mut *session)
            .await?
        else {
            return Ok(None);
        };
        let current = inner
            .deliveries
            .find_one(doc! {
                field::ID: lease.delivery_id(),
                field::STATUS: status::PENDING,
                field::CLAIMS: lease.generation_filter(),
            })
            .projection(doc! { field::ID: 1 })
            .session(&mut *session)
            .await?;
        if current.is_none() {
            return Ok(None);
        }
        let previous = lane.get_datetime(field::LEASE_EXPIRES_AT).ok().copied();
        let new_expiry = previous.map_or(expires_at, |previous| previous.max(expires_at));
        inner
            .lanes
            .update_one(
                lane_filter,
                doc! { "$max": { field::LEASE_EXPIRES_AT: expires_at } },
            )
            .session(&mut *session)
            .await?;
        Ok(Some(new_expiry))
    }
}
