//! Idempotent requests: the first answer to a request that carried an idempotency key, stored in
//! the request's own transaction, so that a client's retry gets that answer again instead of
//! running the request a second time.
//!
//! `relaybus-axum`'s `IdempotencyLayer` is the caller: it takes the key in the request's
//! transaction before the route runs ([`take_request_key`](IdempotentRequests::take_request_key)),
//! and stores the route's response in that same transaction
//! ([`store_response`](IdempotentRequests::store_response)), so the response commits with the
//! route's data and events, or not at all.

use std::future::Future;

use sha2::{Digest, Sha256};

use super::Transactions;
use crate::{
    error::{InvalidArgumentError, Result},
    time::Timestamp,
};

/// The longest idempotency key, in characters (each printable ASCII, so in bytes too).
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;

/// The longest method, route or caller identity a [`RequestKey`] takes, in bytes.
pub const MAX_REQUEST_SCOPE_BYTES: usize = 1024;

/// Which request an idempotency key stands for: the key the client sent, scoped by the
/// request's method, its route and, when the application names one, the caller, so that the
/// same key sent to another route, or by another caller, is another request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestKey<'a> {
    /// The client's key: 1 to 255 printable ASCII characters (`' '` to `'~'`).
    pub key: &'a str,
    /// The request method, such as `"POST"`.
    pub method: &'a str,
    /// The route, such as `"/orders/{id}"` (the matched route, or the path without one).
    pub route: &'a str,
    /// Who sent it, as the application identifies its callers; `None` when it does not.
    pub caller: Option<&'a str>,
}

impl<'a> RequestKey<'a> {
    /// The key `key` of a `method` request to `route`, of no particular caller.
    pub fn new(key: &'a str, method: &'a str, route: &'a str) -> Self {
        RequestKey {
            key,
            method,
            route,
            caller: None,
        }
    }

    /// The same key, scoped to `caller` as well.
    pub fn caller(mut self, caller: Option<&'a str>) -> Self {
        self.caller = caller;
        self
    }

    /// Refuses a key that is empty, longer than [`MAX_IDEMPOTENCY_KEY_LEN`] or has a character
    /// outside printable ASCII, and a method, route or caller over
    /// [`MAX_REQUEST_SCOPE_BYTES`], with [`Error::InvalidArgument`](crate::Error::InvalidArgument).
    ///
    /// # Errors
    ///
    /// As above; the stores call it before they write anything.
    pub fn check(&self) -> Result<()> {
        if let Some(reason) = key_problem(self.key) {
            return Err(InvalidArgumentError::new(
                "key",
                format!("{reason}; use 1 to 255 printable ASCII characters"),
            )
            .into());
        }
        let scope = [
            ("method", Some(self.method)),
            ("route", Some(self.route)),
            ("caller", self.caller),
        ];
        for (argument, value) in scope {
            if value.is_some_and(|v| v.len() > MAX_REQUEST_SCOPE_BYTES) {
                return Err(InvalidArgumentError::new(
                    argument,
                    format!(
                        "it is longer than {MAX_REQUEST_SCOPE_BYTES} bytes; use a shorter one \
                         (hash a long caller identity)"
                    ),
                )
                .into());
            }
        }
        Ok(())
    }

    /// The stored record's id: the SHA-256 of the key and its scope, in hex (64 characters),
    /// the same for equal keys and scopes and distinct for any others.
    pub fn id(&self) -> String {
        let joined = serde_json::json!([self.key, self.method, self.route, self.caller]);
        hex(&Sha256::digest(joined.to_string().as_bytes()))
    }
}

/// What is wrong with `key` as an idempotency key, if anything.
pub fn key_problem(key: &str) -> Option<String> {
    if key.is_empty() {
        Some("the idempotency key is empty".to_owned())
    } else if key.len() > MAX_IDEMPOTENCY_KEY_LEN {
        Some(format!(
            "the idempotency key has {} characters, more than {MAX_IDEMPOTENCY_KEY_LEN}",
            key.chars().count()
        ))
    } else {
        key.chars().find(|c| !(' '..='~').contains(c)).map(|c| {
            format!("the idempotency key has the character {c:?}, which is not printable ASCII")
        })
    }
}

/// Lowercase hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// The first answer to an idempotent request, as stored with its key.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoredResponse {
    /// What identifies the request's content (the caller's hash of its method, path and
    /// body): a repeat of the key with another fingerprint is another request.
    pub fingerprint: String,
    /// The response status.
    pub status: u16,
    /// The response headers kept for the replay, names in lowercase, in their order.
    pub headers: Vec<(String, String)>,
    /// The response body.
    pub body: Vec<u8>,
    /// When the request was answered.
    pub created_at: Timestamp,
    /// When the stored answer expires: from then on the key is new again, and the store's
    /// purge deletes it.
    pub expires_at: Timestamp,
}

impl StoredResponse {
    /// A response to store for a request of `fingerprint`, answered at `created_at` and kept
    /// until `expires_at`.
    pub fn new(
        fingerprint: impl Into<String>,
        status: u16,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
        created_at: Timestamp,
        expires_at: Timestamp,
    ) -> Self {
        StoredResponse {
            fingerprint: fingerprint.into(),
            status,
            headers,
            body,
            created_at,
            expires_at,
        }
    }
}

/// What [`IdempotentRequests::take_request_key`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RequestKeyState {
    /// The key is new (or its stored answer expired): this transaction holds it now, and no
    /// other transaction can take it until this one ends. Run the request, and store its
    /// answer with [`IdempotentRequests::store_response`] before the commit.
    Taken,
    /// A request with this key was answered, and its answer committed: replay it (after
    /// comparing the fingerprint). The transaction wrote nothing.
    Answered(StoredResponse),
    /// Another open transaction holds the key: its request is still running. This
    /// transaction can only be aborted; take the key again in a new one later.
    Running,
}

/// Stored answers of idempotent requests, written in the request's transaction: what
/// `relaybus-axum`'s `IdempotencyLayer` uses, so that a client's retry of a request gets the
/// first answer instead of running the request (and publishing its events) again.
///
/// `setup()` creates where they are kept: the `idempotency_keys` table of the PostgreSQL store's
/// schema, the `<prefix>idempotency_keys` collection of the MongoDB store, the
/// [`memory::IDEMPOTENCY_KEYS`](crate::store::memory::IDEMPOTENCY_KEYS) documents of the memory
/// store. [`Operate::purge`](crate::store::Operate::purge) deletes the expired ones when the
/// options name a time ([`PurgeOptions::request_keys_expired_at`](crate::PurgeOptions::request_keys_expired_at)),
/// as the bus's retention does.
pub trait IdempotentRequests: Transactions {
    /// Looks `key` up in the transaction of `session`, and takes it for that transaction when
    /// no unexpired answer is stored: see [`RequestKeyState`]. A transaction that took a key
    /// holds it until it ends; another one asking for it meanwhile gets
    /// [`RequestKeyState::Running`] at once (it never waits), and after a commit that stored
    /// an answer, [`RequestKeyState::Answered`]; after an abort the key is free again.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a malformed key
    /// ([`RequestKey::check`]);
    /// [`ConfigurationError::NoTransaction`](crate::ConfigurationError::NoTransaction) for a
    /// session without a started transaction; database errors.
    fn take_request_key(
        &self,
        session: &mut Self::Session,
        key: &RequestKey<'_>,
        now: Timestamp,
    ) -> impl Future<Output = Result<RequestKeyState>> + Send;

    /// Stores the answer to the request of `key` in the transaction of `session`, which took
    /// the key with [`take_request_key`](Self::take_request_key): it commits with the
    /// request's data, or not at all.
    ///
    /// # Errors
    ///
    /// As [`take_request_key`](Self::take_request_key). Nothing is written then.
    fn store_response(
        &self,
        session: &mut Self::Session,
        key: &RequestKey<'_>,
        response: &StoredResponse,
    ) -> impl Future<Output = Result<()>> + Send;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        assert!(RequestKey::new("k-1", "POST", "/orders").check().is_ok());
        let long = "k".repeat(256);
        for bad in ["", long.as_str(), "tab\there", "é"] {
            let error = RequestKey::new(bad, "POST", "/orders").check().unwrap_err();
            assert!(error.to_string().contains("printable ASCII"), "{error}");
        }
        assert!(
            RequestKey::new(&"k".repeat(255), "POST", "/")
                .check()
                .is_ok()
        );
    }

    #[test]
    fn ids_tell_scopes_apart() {
        let key = RequestKey::new("k", "POST", "/orders");
        assert_eq!(key.id(), RequestKey::new("k", "POST", "/orders").id());
        assert_eq!(key.id().len(), 64);
        assert_ne!(key.id(), RequestKey::new("k", "PUT", "/orders").id());
        assert_ne!(key.id(), key.caller(Some("alice")).id());
        assert_ne!(key.caller(Some("")).id(), key.id());
    }
}
