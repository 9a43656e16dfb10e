//! Business data: named collections of JSON documents keyed by a string id, written in a
//! transaction together with events, and read back committed.

use serde_json::Value;

use super::{
    MemoryEventStore,
    checks::check_document_name,
    error::MemoryStoreError,
    session::{MemorySession, Transaction},
    state::{State, Target},
};
use crate::error::{ConfigurationError, Result};

impl MemorySession {
    /// Inserts a document in the transaction.
    ///
    /// # Errors
    ///
    /// - [`ConfigurationError::NoTransaction`] outside a started transaction;
    ///   [`Error::InvalidArgument`](crate::Error::InvalidArgument) for an empty or over-long
    ///   collection name (1 to 128 bytes, no control characters) or id (1 to 1024 bytes).
    /// - [`MemoryStoreError::DuplicateDocument`] (as [`Error::Database`](crate::Error::Database))
    ///   when the collection holds the id already, as the transaction sees it.
    /// - The transient [`MemoryStoreError::WriteConflict`] when another open transaction wrote
    ///   the document, or one committed a change to it since this transaction read it.
    ///
    /// Nothing is written when it fails.
    ///
    /// # Example
    ///
    /// ```
    /// # use relaybus::MemoryEventStore;
    /// # use serde_json::json;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), relaybus::Error> {
    /// let store = MemoryEventStore::new();
    /// store
    ///     .transaction(async |session| {
    ///         session.insert("orders", "o-1", json!({ "total_cents": 1250 }))?;
    ///         assert!(session.get("orders", "o-1")?.is_some(), "seen in the transaction");
    ///         Ok(())
    ///     })
    ///     .await?;
    /// assert_eq!(store.documents("orders"), [("o-1".to_owned(), json!({ "total_cents": 1250 }))]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn insert(&mut self, collection: &str, id: &str, value: Value) -> Result<()> {
        self.write_with(
            collection,
            id,
            "MemorySession.insert",
            |current| match current {
                Some(_) => Err(MemoryStoreError::DuplicateDocument {
                    collection: collection.to_owned(),
                    id: id.to_owned(),
                }
                .into()),
                None => Ok(Some(Some(value))),
            },
        )
        .map(|_| ())
    }

    /// Inserts a document, or replaces the one with this id, in the transaction.
    ///
    /// # Errors
    ///
    /// As [`insert`](Self::insert), without the duplicate.
    pub fn put(&mut self, collection: &str, id: &str, value: Value) -> Result<()> {
        check_document_name(collection, id)?;
        let state = &mut self.shared.lock();
        let transaction = open(&mut self.transaction, "MemorySession.put")?;
        write(state, transaction, collection, id, Some(value))
    }

    /// The document with this id as the transaction sees it: its own writes included, other
    /// transactions' only once committed.
    ///
    /// # Errors
    ///
    /// [`ConfigurationError::NoTransaction`] outside a started transaction;
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a malformed collection
    /// name or id.
    pub fn get(&mut self, collection: &str, id: &str) -> Result<Option<Value>> {
        check_document_name(collection, id)?;
        let state = &self.shared.lock();
        let transaction = open(&mut self.transaction, "MemorySession.get")?;
        Ok(read(state, transaction, collection, id))
    }

    /// Deletes the document with this id in the transaction; returns whether there was one.
    ///
    /// # Errors
    ///
    /// As [`put`](Self::put).
    pub fn delete(&mut self, collection: &str, id: &str) -> Result<bool> {
        self.write_with(collection, id, "MemorySession.delete", |current| {
            Ok(current.map(|_| None))
        })
        .map(|existed| existed.is_some())
    }

    /// Reads, changes and writes back a document in one step: `change` gets the document as
    /// the transaction sees it (`None`: there is none) and returns what to keep (`None`:
    /// delete it). The document is held against other open transactions from the read on, so
    /// no other transaction's change can come in between.
    ///
    /// # Errors
    ///
    /// As [`put`](Self::put). `change` is not called when the write is refused before it.
    ///
    /// # Example
    ///
    /// ```
    /// # use relaybus::MemoryEventStore;
    /// # use serde_json::json;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), relaybus::Error> {
    /// let store = MemoryEventStore::new();
    /// for _ in 0..3 {
    ///     store
    ///         .transaction(async |session| {
    ///             session.update("counters", "visits", |n| {
    ///                 Some(json!(n.and_then(|n| n.as_u64()).unwrap_or(0) + 1))
    ///             })
    ///         })
    ///         .await?;
    /// }
    /// assert_eq!(store.document("counters", "visits"), Some(json!(3)));
    /// # Ok(())
    /// # }
    /// ```
    pub fn update(
        &mut self,
        collection: &str,
        id: &str,
        change: impl FnOnce(Option<Value>) -> Option<Value>,
    ) -> Result<()> {
        self.write_with(collection, id, "MemorySession.update", |current| {
            Ok(Some(change(current)))
        })
        .map(|_| ())
    }

    /// Takes the document for the transaction, then writes what `decide` makes of the
    /// document as the transaction sees it: `Some(new)` writes `new` (`None` deletes), `None`
    /// writes nothing. Returns what the transaction saw.
    fn write_with(
        &mut self,
        collection: &str,
        id: &str,
        operation: &'static str,
        decide: impl FnOnce(Option<Value>) -> Result<Option<Option<Value>>>,
    ) -> Result<Option<Value>> {
        check_document_name(collection, id)?;
        let current = {
            let state = &mut self.shared.lock();
            let transaction = open(&mut self.transaction, operation)?;
            let current = read(state, transaction, collection, id);
            take(state, transaction, collection, id)?;
            current
        };
        // The caller's code runs without the store's lock (it may read the store); the
        // document is held for this transaction, so nothing changes it meanwhile.
        let decided = decide(current.clone())?;
        if let (Some(value), Some(transaction)) = (decided, self.transaction.as_mut()) {
            transaction
                .documents
                .insert((collection.to_owned(), id.to_owned()), value);
        }
        Ok(current)
    }
}

/// The session's open transaction, or [`ConfigurationError::NoTransaction`].
fn open<'t>(
    transaction: &'t mut Option<Transaction>,
    operation: &'static str,
) -> Result<&'t mut Transaction> {
    transaction
        .as_mut()
        .ok_or_else(|| ConfigurationError::NoTransaction { operation }.into())
}

/// The document as the transaction sees it; a committed one it reads is remembered with its
/// version, so that a write after another transaction changed it conflicts.
fn read(state: &State, transaction: &mut Transaction, collection: &str, id: &str) -> Option<Value> {
    let key = (collection.to_owned(), id.to_owned());
    if let Some(own) = transaction.documents.get(&key) {
        return own.clone();
    }
    let committed = state
        .documents
        .get(collection)
        .and_then(|documents| documents.get(id));
    transaction
        .seen
        .entry(key)
        .or_insert(committed.map(|document| document.version));
    committed.map(|document| document.value.clone())
}

/// Takes the document for the transaction: refused when another open transaction holds it,
/// or when it changed since this transaction read it.
fn take(
    state: &mut State,
    transaction: &mut Transaction,
    collection: &str,
    id: &str,
) -> Result<()> {
    let target = Target::Document(collection.to_owned(), id.to_owned());
    transaction.lock(state, target.clone())?;
    let key = (collection.to_owned(), id.to_owned());
    if let Some(seen) = transaction.seen.get(&key) {
        let now = state
            .documents
            .get(collection)
            .and_then(|documents| documents.get(id))
            .map(|document| document.version);
        if now != *seen {
            return Err(
                transaction.fail(format!("{target} changed since this transaction read it"))
            );
        }
    }
    Ok(())
}

/// Writes `value` (`None`: deletes) in the transaction.
fn write(
    state: &mut State,
    transaction: &mut Transaction,
    collection: &str,
    id: &str,
    value: Option<Value>,
) -> Result<()> {
    take(state, transaction, collection, id)?;
    transaction
        .documents
        .insert((collection.to_owned(), id.to_owned()), value);
    Ok(())
}

impl MemoryEventStore {
    /// The committed document with this id, if there is one. Open transactions' writes are not
    /// seen.
    pub fn document(&self, collection: &str, id: &str) -> Option<Value> {
        self.inner
            .lock()
            .documents
            .get(collection)?
            .get(id)
            .map(|document| document.value.clone())
    }

    /// Every committed document of the collection with its id, in id order.
    pub fn documents(&self, collection: &str) -> Vec<(String, Value)> {
        self.inner
            .lock()
            .documents
            .get(collection)
            .map(|documents| {
                documents
                    .iter()
                    .map(|(id, document)| (id.clone(), document.value.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// How many committed documents the collection holds.
    pub fn count(&self, collection: &str) -> usize {
        self.inner
            .lock()
            .documents
            .get(collection)
            .map_or(0, |documents| documents.len())
    }
}
