//! Leadership: which store instance of a deployment does work that one does at a time.

use std::{future::Future, time::Duration};

use super::Transactions;
use crate::error::Result;

/// The longest role name, in bytes.
pub const MAX_ROLE_BYTES: usize = 128;

/// A lead per role, held for a period: what the bus uses to sample the delivery gauges in one
/// process of a deployment at a time, and what the Kafka consumer uses to read each partition of
/// a topic in one process at a time.
///
/// A role is 1 to [`MAX_ROLE_BYTES`] bytes without control characters. A lead is held by a store
/// instance: two instances on one database (two processes) exclude each other, while the clones
/// of one instance are one holder.
///
/// The defaults are those of a store that lives in one process: it leads every role, always,
/// and has no other holder to list.
pub trait Leadership: Transactions {
    /// Takes or keeps the lead of `role` for `period`: `true` when this store instance holds it
    /// now, `false` when another instance, of this process or another, holds it and its lead
    /// has not expired. For work one process of a deployment does at a time (sampling the
    /// delivery gauges). A store of one process only leads always.
    fn lead(&self, role: &str, period: Duration) -> impl Future<Output = Result<bool>> + Send {
        let _ = (role, period);
        async { Ok(true) }
    }

    /// Keeps the lead of `role` in the transaction of `session`: `true` when this store
    /// instance holds it and it has not expired, renewed for `period` from now when the
    /// transaction commits; `false` when it does not, and then nothing is written.
    ///
    /// This is the fence of work done under a lead. The renewal is a write in the caller's
    /// transaction, so another instance's [`lead`](Self::lead) waits for the transaction or
    /// makes it fail (a write conflict, which the transaction runner retries): once another
    /// instance took the lead over, no transaction in which this answered `true` can still
    /// commit.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a role or period out of
    /// range; [`ConfigurationError::NoTransaction`](crate::ConfigurationError::NoTransaction)
    /// for a session without a started transaction; database errors.
    fn keep_lead(
        &self,
        session: &mut Self::Session,
        role: &str,
        period: Duration,
    ) -> impl Future<Output = Result<bool>> + Send {
        let _ = (session, role, period);
        async { Ok(true) }
    }

    /// The leads held now (not expired) whose role starts with `prefix`, in the order of their
    /// roles, each saying whether this store instance holds it. What a process reads to learn
    /// which others share a piece of work, and what they hold of it.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a prefix over
    /// [`MAX_ROLE_BYTES`] or with a control character; database errors.
    fn leads(&self, prefix: &str) -> impl Future<Output = Result<Vec<Lead>>> + Send {
        let _ = prefix;
        async { Ok(Vec::new()) }
    }

    /// Gives up the lead of `role` if this store instance holds it, so that another instance
    /// may take it at once rather than when it expires. A lead held by another instance is left
    /// as it is.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a role out of range;
    /// database errors.
    fn resign(&self, role: &str) -> impl Future<Output = Result<()>> + Send {
        let _ = role;
        async { Ok(()) }
    }
}

/// A lead held now, as [`Leadership::leads`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Lead {
    /// The role led.
    pub role: String,
    /// Whether the store instance that listed it holds it.
    pub ours: bool,
}

impl Lead {
    /// A lead of `role`, held by the listing instance when `ours`.
    pub fn new(role: impl Into<String>, ours: bool) -> Self {
        Lead {
            role: role.into(),
            ours,
        }
    }
}
