//! Consumer positions: how far a consumer of a partitioned log (a Kafka topic's partition)
//! has taken records into the store, written in the transaction that appended them.

use std::future::Future;

use super::Transactions;
#[cfg(any(feature = "mongodb", feature = "postgres", feature = "memory"))]
use crate::error::InvalidArgumentError;
use crate::{error::Result, time::Timestamp};

/// The longest consumer or source name a position takes, in bytes.
pub const MAX_POSITION_NAME_BYTES: usize = 255;

/// Which position: a consumer's, on one partition of one source (a topic).
///
/// Positions are read and written with [`ConsumerPositions::consumer_position`] and
/// [`ConsumerPositions::advance_consumer_position`], inside the
/// transaction that appends what was read, so that the records a transaction appended and the
/// position after them commit together or not at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PositionKey<'a> {
    /// The consumer's name: each consuming service keeps its own positions.
    pub consumer: &'a str,
    /// The source read, such as a Kafka topic.
    pub source: &'a str,
    /// The partition of the source.
    pub partition: u32,
}

/// Consumer positions kept in the store, in the caller's transaction: what the Kafka consumer
/// uses to take each record into the store exactly once.
pub trait ConsumerPositions: Transactions {
    /// The position of a consumer of a partitioned log, as the transaction of `session` sees
    /// it: the offset of the next record to take, or `None` when the consumer has none there
    /// yet. A consumer reads it inside the transaction that appends what it reads, and moves it
    /// with [`advance_consumer_position`](Self::advance_consumer_position) in that same
    /// transaction, so the appended records and the position commit together: a consumer
    /// that crashes before the commit reads the records again, one that crashes after it
    /// goes on behind them.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for an empty consumer or
    /// source name, one over 255 bytes or with a control character;
    /// [`ConfigurationError::NoTransaction`](crate::ConfigurationError::NoTransaction) for a
    /// session without a started transaction; database errors.
    fn consumer_position(
        &self,
        session: &mut Self::Session,
        key: &PositionKey<'_>,
    ) -> impl Future<Output = Result<Option<i64>>> + Send;

    /// Moves a consumer's position forward to `next` (the offset of the next record to take)
    /// in the transaction of `session`. A position never moves back: a `next` below the stored
    /// one leaves it as it is.
    ///
    /// # Errors
    ///
    /// As [`consumer_position`](Self::consumer_position), and
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a negative `next`. Nothing
    /// is written then.
    fn advance_consumer_position(
        &self,
        session: &mut Self::Session,
        key: &PositionKey<'_>,
        next: i64,
        now: Timestamp,
    ) -> impl Future<Output = Result<()>> + Send;
}

impl<'a> PositionKey<'a> {
    /// The position of `consumer` on `partition` of `source`.
    pub fn new(consumer: &'a str, source: &'a str, partition: u32) -> Self {
        PositionKey {
            consumer,
            source,
            partition,
        }
    }

    /// Refuses an empty name, one over [`MAX_POSITION_NAME_BYTES`], or one with a control
    /// character, with [`Error::InvalidArgument`](crate::Error::InvalidArgument).
    #[cfg(any(feature = "mongodb", feature = "postgres", feature = "memory"))]
    pub(crate) fn check(&self) -> Result<()> {
        for (argument, name) in [("consumer", self.consumer), ("source", self.source)] {
            let reason = if name.is_empty() {
                Some("it is empty")
            } else if name.len() > MAX_POSITION_NAME_BYTES {
                Some("it is longer than 255 bytes")
            } else if name.chars().any(char::is_control) {
                Some("it contains a control character")
            } else {
                None
            };
            if let Some(reason) = reason {
                return Err(InvalidArgumentError::new(
                    argument,
                    format!(
                        "{name:?} cannot name a consumer position: {reason}; use 1 to 255 bytes \
                         without control characters"
                    ),
                )
                .into());
            }
        }
        Ok(())
    }

    /// What an advance of the position to `next` refuses: the key as [`check`](Self::check)
    /// does, and a negative offset.
    #[cfg(any(feature = "mongodb", feature = "postgres", feature = "memory"))]
    pub(crate) fn check_advance(&self, next: i64) -> Result<()> {
        self.check()?;
        if next < 0 {
            return Err(InvalidArgumentError::new(
                "next",
                format!(
                    "{next} is not an offset: a position is the offset of the next record, 0 or \
                     more"
                ),
            )
            .into());
        }
        Ok(())
    }

    /// The key as one string, unambiguous for any names: a JSON array.
    #[allow(dead_code)]
    pub(crate) fn joined(&self) -> String {
        serde_json::json!([self.consumer, self.source, self.partition]).to_string()
    }
}
