//! The answer about lanes: their holders, and the keys held back in them.

use relaybus::Timestamp;
use serde::Serialize;

use super::Delivery;

/// `GET /lanes`.
#[derive(Debug, Serialize)]
pub(crate) struct LanesAnswer {
    lanes: Vec<Lane>,
    blocked: Vec<BlockedKey>,
}

/// One lane and its holder.
#[derive(Debug, Serialize)]
struct Lane {
    lane: u32,
    owner: Option<String>,
    lease_expires_at: Option<Timestamp>,
    /// Whether an owner holds it on a lease that has not expired.
    held: bool,
    in_flight: u32,
    lost: u32,
    epoch: i64,
}

/// A key whose deliveries of one handler are parked, and the delivery they wait for.
#[derive(Debug, Serialize)]
struct BlockedKey {
    handler: String,
    key: String,
    parked: u64,
    first_parked_sequence: Option<i64>,
    waiting_for: Option<Delivery>,
}

impl LanesAnswer {
    /// The lanes of `report`, held or not at `now`.
    pub(crate) fn new(report: relaybus::LaneReport, now: Timestamp) -> Self {
        let lanes = report
            .lanes
            .into_iter()
            .map(|lane| Lane {
                held: lane.owner.is_some() && lane.lease_expires_at.is_some_and(|at| at > now),
                lane: lane.lane,
                owner: lane.owner,
                lease_expires_at: lane.lease_expires_at,
                in_flight: lane.in_flight,
                lost: lane.lost,
                epoch: lane.epoch,
            })
            .collect();
        let blocked = report
            .blocked
            .into_iter()
            .map(|key| BlockedKey {
                handler: key.handler,
                key: key.key,
                parked: key.parked,
                first_parked_sequence: key.first_parked_sequence,
                waiting_for: key.waiting_for.map(Delivery::from),
            })
            .collect();
        LanesAnswer { lanes, blocked }
    }
}
