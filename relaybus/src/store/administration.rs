//! What an operator's tools ask of a store beyond the operator reads and writes of
//! [`Store`]: what `setup()` would do, the handlers it holds deliveries of, and whether a text
//! has the form of its delivery ids. The `relaybus` command line is written against it.

use std::future::Future;

use super::Store;
use crate::error::Result;

/// One thing [`Store::setup`] would do, as [`Administration::setup_plan`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SetupStep {
    /// What kind of change it is.
    pub kind: SetupStepKind,
    /// What it changes, in a sentence: the table, collection or index, and how many documents
    /// or rows.
    pub description: String,
}

impl SetupStep {
    /// A step of this kind.
    pub fn new(kind: SetupStepKind, description: impl Into<String>) -> Self {
        SetupStep {
            kind,
            description: description.into(),
        }
    }
}

/// The kind of a [`SetupStep`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SetupStepKind {
    /// Creates a schema, a table, a collection, an index or the lane documents.
    Create,
    /// Drops or replaces something an earlier version made.
    Replace,
    /// Changes stored data that an earlier version left: the upgrade of a 0.1.0 database,
    /// dead deliveries moved out of the parked lane.
    Upgrade,
}

impl SetupStepKind {
    /// `create`, `replace` or `upgrade`.
    pub fn as_str(&self) -> &'static str {
        match self {
            SetupStepKind::Create => "create",
            SetupStepKind::Replace => "replace",
            SetupStepKind::Upgrade => "upgrade",
        }
    }
}

/// What an operator's tools ask of a store beyond [`Store`]'s operator methods. Implemented by
/// the MongoDB and the PostgreSQL stores.
pub trait Administration: Store {
    /// What [`setup`](Store::setup) would do now, in order, without doing any of it: empty
    /// when the store is set up. It reads only.
    ///
    /// # Errors
    ///
    /// As `setup()` for a server the store cannot use (MongoDB: a standalone server), and
    /// [`Error::Database`](crate::Error::Database) when a read fails.
    fn setup_plan(&self) -> impl Future<Output = Result<Vec<SetupStep>>> + Send;

    /// The handlers the store holds deliveries or completion records of, in order: what a
    /// filter by handler can select.
    fn handler_ids(&self) -> impl Future<Output = Result<Vec<String>>> + Send;

    /// Whether `id` has the form of this store's delivery ids (MongoDB: 24 hexadecimal digits,
    /// PostgreSQL: a positive decimal number). It says nothing of whether such a delivery
    /// exists.
    fn is_delivery_id(&self, id: &str) -> bool;

    /// A sentence naming the form of the store's delivery ids, for messages.
    fn delivery_id_form(&self) -> &'static str;
}
