//! Leases: the fencing token a claim hands out with each delivery, and what one store instance
//! remembers about the claims it handed out.
//!
//! A lease token reads `<lane>:<epoch>:<claims>`. `lane` is the delivery's lane, `epoch` the lane
//! epoch under which it was claimed (every take of a lane increments it), and `claims` the
//! delivery's claim generation at the time (every claim that ends, however it ends, increments
//! it). A settlement changes something only while all three still hold, so a worker that lost its
//! lane, or that holds the lease of an earlier claim of the same delivery, changes nothing.

use std::{fmt, str::FromStr};

mod registry;

pub(crate) use registry::{ClaimRegistry, Facts, Issued, OwnerState, ParkedLookup};

use mongodb::bson::{Bson, oid::ObjectId};

use crate::{
    error::{LeaseError, truncate_for_message},
    event::LANE_COUNT,
};

/// The right to settle one claimed delivery: its id plus the fencing token
/// `<lane>:<epoch>:<claims>`.
///
/// A claim returns one with every delivery. Pass it back unchanged to
/// [`complete`](crate::MongoEventStore::complete), [`reschedule`](crate::MongoEventStore::reschedule),
/// [`release`](crate::MongoEventStore::release), [`bury`](crate::MongoEventStore::bury) or
/// [`extend_lease`](crate::MongoEventStore::extend_lease). A lease kept as text (the delivery id
/// and [`token`](Lease::token)) is read back with [`Lease::parse`], which refuses what no claim
/// can have produced, before anything reaches the database.
///
/// # Example
///
/// ```
/// use relaybus::Lease;
///
/// let lease = Lease::parse("65f0c0ffee0000000000beef", "17:3:0")?;
/// assert_eq!(lease.token(), "17:3:0");
/// assert_eq!(lease.lane(), 17);
/// assert!(Lease::parse("65f0c0ffee0000000000beef", "256:1:0").is_err());
/// # Ok::<(), relaybus::LeaseError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lease {
    delivery_id: ObjectId,
    lane: u32,
    epoch: i64,
    claims: i64,
}

impl Lease {
    pub(crate) fn new(delivery_id: ObjectId, lane: u32, epoch: i64, claims: i64) -> Self {
        Lease {
            delivery_id,
            lane,
            epoch,
            claims,
        }
    }

    /// Reads a lease back from the delivery id (24 hexadecimal digits) and the token
    /// `<lane>:<epoch>:<claims>`, as [`delivery_id`](Lease::delivery_id) and
    /// [`token`](Lease::token) wrote them.
    ///
    /// # Errors
    ///
    /// [`LeaseError`] when the id is not an ObjectId, the token is not three decimal numbers, the
    /// lane is not one of the 256 lanes, the epoch is below 1 (taking a lane makes it at least
    /// 1) or the claim generation is negative.
    pub fn parse(delivery_id: &str, token: &str) -> Result<Self, LeaseError> {
        let id = ObjectId::parse_str(delivery_id).map_err(|_| LeaseError::InvalidDeliveryId {
            id: truncate_for_message(delivery_id, 64),
        })?;
        let parsed: Token = token.parse()?;
        Ok(Lease::new(id, parsed.lane, parsed.epoch, parsed.claims))
    }

    /// The id of the leased delivery.
    pub fn delivery_id(&self) -> ObjectId {
        self.delivery_id
    }

    /// The fencing token, `<lane>:<epoch>:<claims>`.
    pub fn token(&self) -> String {
        format!("{}:{}:{}", self.lane, self.epoch, self.claims)
    }

    /// The lane of the delivery, 0 to 255.
    pub fn lane(&self) -> u32 {
        self.lane
    }

    /// The lane epoch under which the delivery was claimed.
    pub fn epoch(&self) -> i64 {
        self.epoch
    }

    /// The delivery's claim generation at the time of the claim.
    pub fn claims(&self) -> i64 {
        self.claims
    }

    /// The stored form of the lane id.
    pub(crate) fn lane_i32(&self) -> i32 {
        // Parsing and claiming both keep lanes below 256.
        self.lane as i32
    }

    /// A filter matching the delivery while it still has this lease's claim generation. A
    /// document without a generation (written before generations existed) counts as 0.
    pub(crate) fn generation_filter(&self) -> Bson {
        generation_filter(self.claims)
    }
}

/// The filter value that matches claim generation `claims`, counting a missing one as 0.
pub(crate) fn generation_filter(claims: i64) -> Bson {
    if claims == 0 {
        Bson::Document(mongodb::bson::doc! { "$in": [0_i64, Bson::Null] })
    } else {
        Bson::Int64(claims)
    }
}

impl fmt::Display for Lease {
    /// Writes `<delivery id>@<lane>:<epoch>:<claims>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}@{}:{}:{}",
            self.delivery_id, self.lane, self.epoch, self.claims
        )
    }
}

/// The three numbers of a token.
struct Token {
    lane: u32,
    epoch: i64,
    claims: i64,
}

impl FromStr for Token {
    type Err = LeaseError;

    fn from_str(token: &str) -> Result<Self, LeaseError> {
        let malformed = |reason| LeaseError::MalformedToken {
            token: truncate_for_message(token, 64),
            reason,
        };
        let mut parts = token.split(':');
        let (Some(lane), Some(epoch), Some(claims), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(malformed("it does not have three `:`-separated parts"));
        };
        let number = |part: &str| -> Result<u64, LeaseError> {
            if part.is_empty() || part.len() > 20 || !part.bytes().all(|b| b.is_ascii_digit()) {
                return Err(malformed(
                    "a part is not a decimal number of 1 to 20 digits",
                ));
            }
            part.parse::<u64>()
                .map_err(|_| malformed("a part is not a decimal number"))
        };
        let lane = number(lane)?;
        let epoch = number(epoch)?;
        let claims = number(claims)?;
        if lane >= u64::from(LANE_COUNT) {
            return Err(LeaseError::LaneOutOfRange { lane });
        }
        let epoch = i64::try_from(epoch).map_err(|_| malformed("the epoch is too large"))?;
        if epoch < 1 {
            return Err(malformed(
                "the epoch is 0, and a claimed lane has epoch 1 or more",
            ));
        }
        let claims =
            i64::try_from(claims).map_err(|_| malformed("the claim generation is too large"))?;
        Ok(Token {
            lane: lane as u32,
            epoch,
            claims,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "65f0c0ffee0000000000beef";

    #[test]
    fn tokens_round_trip() {
        let lease = Lease::parse(ID, "255:9223372036854775807:0").unwrap();
        assert_eq!(lease.lane(), 255);
        assert_eq!(lease.epoch(), i64::MAX);
        assert_eq!(lease.claims(), 0);
        assert_eq!(lease.token(), "255:9223372036854775807:0");
        assert_eq!(lease.delivery_id().to_hex(), ID);
        assert_eq!(lease.to_string(), format!("{ID}@255:9223372036854775807:0"));
        let again = Lease::parse(&lease.delivery_id().to_hex(), &lease.token()).unwrap();
        assert_eq!(again, lease);
    }

    #[test]
    fn tokens_no_claim_can_have_issued_are_refused() {
        for bad in [
            "",
            "1",
            "1:2",
            "1:2:3:4",
            "a:1:0",
            "1:b:0",
            "1:1:c",
            " 1:1:0",
            "1:1:0 ",
            "+1:1:0",
            "-1:1:0",
            "1:-1:0",
            "1:1:-1",
            "1::0",
            "1:1:",
            "1:0:0",
            "1:1:9223372036854775808",
            "1:9223372036854775808:0",
            "1:99999999999999999999:0",
            "1.0:1:0",
            "１:1:0",
        ] {
            assert!(
                matches!(
                    Lease::parse(ID, bad),
                    Err(LeaseError::MalformedToken { .. })
                ),
                "{bad:?}"
            );
        }
        assert_eq!(
            Lease::parse(ID, "256:1:0"),
            Err(LeaseError::LaneOutOfRange { lane: 256 })
        );
        assert_eq!(
            Lease::parse(ID, "18446744073709551615:1:0"),
            Err(LeaseError::LaneOutOfRange { lane: u64::MAX })
        );
        for bad_id in [
            "",
            "xyz",
            "65f0c0ffee0000000000beeg",
            "65f0c0ffee0000000000beef0",
        ] {
            assert!(
                matches!(
                    Lease::parse(bad_id, "1:1:0"),
                    Err(LeaseError::InvalidDeliveryId { .. })
                ),
                "{bad_id:?}"
            );
        }
    }
}
