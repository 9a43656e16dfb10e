//! Consumer positions: how far a consumer of a partitioned log (a Kafka topic's partition)
//! has taken records into the store, written in the transaction that appended them.

#[cfg(any(feature = "mongodb", feature = "postgres", feature = "memory"))]
use crate::error::{InvalidArgumentError, Result};

/// The longest consumer or source name a position takes, in bytes.
pub const MAX_POSITION_NAME_BYTES: usize = 255;

/// Which position: a consumer's, on one partition of one source (a topic).
///
/// Positions are read and written with [`Store::consumer_position`](super::Store::consumer_position)
/// and [`Store::advance_consumer_position`](super::Store::advance_consumer_position), inside the
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

    /// The key as one string, unambiguous for any names: a JSON array.
    #[allow(dead_code)]
    pub(crate) fn joined(&self) -> String {
        serde_json::json!([self.consumer, self.source, self.partition]).to_string()
    }
}

/// Refuses a negative offset.
#[cfg(any(feature = "mongodb", feature = "postgres", feature = "memory"))]
pub(crate) fn check_offset(next: i64) -> Result<()> {
    if next < 0 {
        return Err(InvalidArgumentError::new(
            "next",
            format!(
                "{next} is not an offset: a position is the offset of the next record, 0 or more"
            ),
        )
        .into());
    }
    Ok(())
}
