//! The shapes of the operator API: the query strings and bodies it reads, and one type per JSON
//! object it answers, as the page and scripts read them (see the [module docs](super)).
//!
//! Times are RFC 3339 strings in UTC ([`Timestamp`](relaybus::Timestamp)'s own serialization)
//! and absent values are `null`: no field of an answer is left out, except `completed_note`.

mod deliveries;
mod lanes;
mod overview;
mod request;
mod writes;

use serde::Serialize;

pub(super) use deliveries::{DeadLettersAnswer, DeliveriesAnswer, Delivery, EventAnswer};
pub(super) use lanes::LanesAnswer;
pub(super) use overview::{
    ActivityAnswer, HandlerOverview, HandlersAnswer, SchedulesAnswer, StatisticsAnswer,
};
pub(super) use request::{BuryBody, Filter, GroupParams, ListParams, WriteBody};
pub(super) use writes::{BuryAnswer, DiscardAnswer, RequeueAnswer};

/// Every refusal: `{"error": "..."}`.
#[derive(Debug, Serialize)]
pub(super) struct ErrorAnswer {
    /// What was refused, and what is accepted.
    pub(super) error: String,
}
