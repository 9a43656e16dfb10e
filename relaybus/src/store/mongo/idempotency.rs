//! [`IdempotentRequests`] for MongoDB: the `<prefix>idempotency_keys` collection.
//!
//! A transaction takes a key by writing the key's document (an upsert that replaces an expired
//! answer): MongoDB refuses a second open transaction's write to that document with a write
//! conflict at once, which is how a request finds its key's first request still running. The
//! answer is written over the document in the same transaction.

use mongodb::{
    ClientSession,
    bson::{Binary, Bson, Document, doc, spec::BinarySubtype},
};

use super::{MongoEventStore, bson_date, error_code, schema::field, timestamp};
use crate::{
    error::Result,
    store::{IdempotentRequests, PurgeOptions, RequestKey, RequestKeyState, StoredResponse},
    time::Timestamp,
};

/// `WriteConflict`: another open transaction wrote the document.
const WRITE_CONFLICT: i32 = 112;
/// `DuplicateKey`: a transaction that committed meanwhile inserted it.
const DUPLICATE_KEY: i32 = 11000;

impl IdempotentRequests for MongoEventStore {
    async fn take_request_key(
        &self,
        session: &mut ClientSession,
        key: &RequestKey<'_>,
        now: Timestamp,
    ) -> Result<RequestKeyState> {
        key.check()?;
        self.ensure_in_transaction(session, "MongoEventStore.take_request_key")
            .await?;
        let keys = &self.inner.idempotency_keys;
        let id = key.id();
        let found = keys
            .find_one(doc! { field::ID: &id })
            .session(&mut *session)
            .await?;
        if let Some(response) = found.as_ref().and_then(stored_response)
            && response.expires_at > now
        {
            return Ok(RequestKeyState::Answered(response));
        }
        let taken = keys
            .replace_one(
                doc! { field::ID: &id },
                doc! { field::ID: &id, "takenAt": bson_date(now) },
            )
            .upsert(true)
            .session(&mut *session)
            .await;
        match taken {
            Ok(_) => Ok(RequestKeyState::Taken),
            Err(error)
                if error.contains_label(mongodb::error::TRANSIENT_TRANSACTION_ERROR)
                    || matches!(error_code(&error), Some(WRITE_CONFLICT | DUPLICATE_KEY)) =>
            {
                Ok(RequestKeyState::Running)
            }
            Err(error) => Err(error.into()),
        }
    }

    async fn store_response(
        &self,
        session: &mut ClientSession,
        key: &RequestKey<'_>,
        response: &StoredResponse,
    ) -> Result<()> {
        key.check()?;
        self.ensure_in_transaction(session, "MongoEventStore.store_response")
            .await?;
        let id = key.id();
        let headers: Vec<Bson> = response
            .headers
            .iter()
            .map(|(name, value)| Bson::Array(vec![name.clone().into(), value.clone().into()]))
            .collect();
        let document = doc! {
            field::ID: &id,
            "key": key.key,
            "method": key.method,
            "route": key.route,
            "caller": key.caller,
            "fingerprint": &response.fingerprint,
            "status": i32::from(response.status),
            "headers": headers,
            "body": Binary { subtype: BinarySubtype::Generic, bytes: response.body.clone() },
            field::CREATED_AT: bson_date(response.created_at),
            field::EXPIRES_AT: bson_date(response.expires_at),
        };
        self.inner
            .idempotency_keys
            .replace_one(doc! { field::ID: &id }, document)
            .upsert(true)
            .session(&mut *session)
            .await?;
        Ok(())
    }
}

impl MongoEventStore {
    /// Deletes the stored answers that expired at or before the options' time.
    pub(super) async fn purge_request_keys(&self, options: &PurgeOptions) -> Result<u64> {
        let Some(now) = options.request_keys_expired_at else {
            return Ok(0);
        };
        let deleted = self
            .inner
            .idempotency_keys
            .delete_many(doc! { field::EXPIRES_AT: { "$lte": bson_date(now) } })
            .await?;
        Ok(deleted.deleted_count)
    }
}

/// The answer a stored document holds; `None` for a document without one.
fn stored_response(document: &Document) -> Option<StoredResponse> {
    let status = u16::try_from(document.get_i32("status").ok()?).ok()?;
    let headers = document
        .get_array("headers")
        .ok()?
        .iter()
        .filter_map(|pair| match pair {
            Bson::Array(pair) => match pair.as_slice() {
                [Bson::String(name), Bson::String(value)] => Some((name.clone(), value.clone())),
                _ => None,
            },
            _ => None,
        })
        .collect();
    Some(StoredResponse::new(
        document.get_str("fingerprint").ok()?,
        status,
        headers,
        document.get_binary_generic("body").ok()?.clone(),
        timestamp(*document.get_datetime(field::CREATED_AT).ok()?),
        timestamp(*document.get_datetime(field::EXPIRES_AT).ok()?),
    ))
}
