//! What the routes read: query strings and bodies, every value still as sent. Unknown fields
//! are refused, so that a misspelled filter never widens a write.

use serde::Deserialize;

/// The query string of `GET /deliveries`, every value still text.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListParams {
    pub(crate) status: Option<String>,
    pub(crate) handler: Option<String>,
    pub(crate) event_type: Option<String>,
    pub(crate) key: Option<String>,
    pub(crate) event_id: Option<String>,
    pub(crate) error: Option<String>,
    pub(crate) last_error: Option<String>,
    pub(crate) created_from: Option<String>,
    pub(crate) created_before: Option<String>,
    pub(crate) after: Option<String>,
    pub(crate) limit: Option<String>,
}

impl ListParams {
    /// The parameters that filter, apart from the state and the page.
    pub(crate) fn filter(&self) -> Filter {
        Filter {
            handler: self.handler.clone(),
            event_type: self.event_type.clone(),
            key: self.key.clone(),
            event_id: self.event_id.clone(),
            error: self.error.clone(),
            last_error: self.last_error.clone(),
            created_from: self.created_from.clone(),
            created_before: self.created_before.clone(),
        }
    }
}

/// The query string of `GET /dead-letters`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct GroupParams {
    pub(crate) handler: Option<String>,
}

/// The filter of a listing, a requeue or a discard: every field optional, each checked.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Filter {
    pub(crate) handler: Option<String>,
    pub(crate) event_type: Option<String>,
    pub(crate) key: Option<String>,
    pub(crate) event_id: Option<String>,
    /// Text the last error contains, whatever its case.
    pub(crate) error: Option<String>,
    /// The last error exactly: a group of `GET /dead-letters`.
    pub(crate) last_error: Option<String>,
    pub(crate) created_from: Option<String>,
    pub(crate) created_before: Option<String>,
}

impl Filter {
    /// Whether no field is given, so that the filter matches everything.
    pub(crate) fn is_empty(&self) -> bool {
        self.handler.is_none()
            && self.event_type.is_none()
            && self.key.is_none()
            && self.event_id.is_none()
            && self.error.is_none()
            && self.last_error.is_none()
            && self.created_from.is_none()
            && self.created_before.is_none()
    }
}

/// The body of `POST /deliveries/requeue` and `POST /deliveries/discard`: exactly one field.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct WriteBody {
    pub(crate) ids: Option<Vec<String>>,
    pub(crate) filter: Option<Filter>,
    pub(crate) all: Option<bool>,
}

/// The body of `POST /deliveries/bury`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BuryBody {
    pub(crate) ids: Vec<String>,
    pub(crate) reason: String,
}
