//! [`Leadership`] for MongoDB: a document `lead:<role>` in the `processes` collection, naming its
//! holder (the store instance's id) and an expiry by the server's clock.
//!
//! Taking a lead is one `findOneAndUpdate` that changes the holder only when the lead is free,
//! expired or ours. Keeping it in a transaction is an update of the document in that
//! transaction: a take-over's write then waits for the transaction, or makes it fail with a
//! write conflict when it came first, so the two never both commit. The update counts the keeps
//! (`kept`), so that it always changes the document, which is what makes it a write.

use std::time::Duration;

use futures::TryStreamExt;
use mongodb::{
    ClientSession,
    bson::{Bson, Document, doc, oid::ObjectId},
    options::ReturnDocument,
};

use super::{
    MongoEventStore,
    schema::{field, path},
};
use crate::{
    error::Result,
    store::{
        Lead, Leadership,
        checks::{check_role, check_role_prefix},
    },
};

/// The `_id` of a lead's document is this and the role.
const LEAD_PREFIX: &str = "lead:";

/// How many times a lead was kept in a transaction.
const KEPT: &str = "kept";

/// `DuplicateKey`.
const DUPLICATE_KEY: i32 = 11000;

impl Leadership for MongoEventStore {
    async fn lead(&self, role: &str, period: Duration) -> Result<bool> {
        check_role(role, period)?;
        let holder = self.holder();
        let holder_path = format!("${}", field::HOLDER);
        // Free (never held, or expired) or ours: take it; otherwise leave it as it is.
        let ours = doc! { "$or": [
            { "$eq": [{ "$type": &holder_path }, "missing"] },
            { "$eq": [&holder_path, holder] },
            { "$lt": [path::EXPIRES_AT, "$$NOW"] },
        ] };
        let taken = self
            .inner
            .processes
            .find_one_and_update(
                doc! { field::ID: lead_id(role) },
                vec![doc! { "$set": {
                    field::HOLDER: { "$cond": [&ours, holder, &holder_path] },
                    field::EXPIRES_AT: {
                        "$cond": [&ours, { "$add": ["$$NOW", millis(period)] }, path::EXPIRES_AT],
                    },
                } }],
            )
            .upsert(true)
            .return_document(ReturnDocument::After)
            .await;
        match taken {
            Ok(lead) => {
                Ok(lead.and_then(|lead| lead.get_object_id(field::HOLDER).ok()) == Some(holder))
            }
            // Two instances created the document at once; the other one did.
            Err(error) if super::error_code(&error) == Some(DUPLICATE_KEY) => Ok(false),
            Err(error) => Err(error.into()),
        }
    }

    async fn keep_lead(
        &self,
        session: &mut ClientSession,
        role: &str,
        period: Duration,
    ) -> Result<bool> {
        check_role(role, period)?;
        self.ensure_in_transaction(session, "MongoEventStore.keep_lead")
            .await?;
        let kept = self
            .inner
            .processes
            .update_one(
                doc! {
                    field::ID: lead_id(role),
                    field::HOLDER: self.holder(),
                    "$expr": { "$gt": [path::EXPIRES_AT, "$$NOW"] },
                },
                vec![doc! { "$set": {
                    field::EXPIRES_AT: { "$add": ["$$NOW", millis(period)] },
                    KEPT: { "$add": [{ "$ifNull": [format!("${KEPT}"), 0_i64] }, 1_i64] },
                } }],
            )
            .session(&mut *session)
            .await?;
        Ok(kept.matched_count == 1)
    }

    async fn leads(&self, prefix: &str) -> Result<Vec<Lead>> {
        check_role_prefix(prefix)?;
        let holder = self.holder();
        let found: Vec<Document> = self
            .inner
            .processes
            .find(doc! {
                field::ID: { "$regex": format!("^{}", escape_regex(&lead_id(prefix))) },
                "$expr": { "$gt": [path::EXPIRES_AT, "$$NOW"] },
            })
            .sort(doc! { field::ID: 1 })
            .await?
            .try_collect()
            .await?;
        Ok(found
            .iter()
            .filter_map(|lead| {
                let role = lead.get_str(field::ID).ok()?.strip_prefix(LEAD_PREFIX)?;
                let ours = lead.get(field::HOLDER) == Some(&Bson::ObjectId(holder));
                Some(Lead::new(role, ours))
            })
            .collect())
    }

    async fn resign(&self, role: &str) -> Result<()> {
        check_role(role, Duration::from_millis(1))?;
        self.inner
            .processes
            .delete_one(doc! { field::ID: lead_id(role), field::HOLDER: self.holder() })
            .await?;
        Ok(())
    }
}

impl MongoEventStore {
    /// The holder of this instance's leads: the id of its document in `processes`.
    fn holder(&self) -> ObjectId {
        self.inner.sessions.id
    }
}

fn lead_id(role: &str) -> String {
    format!("{LEAD_PREFIX}{role}")
}

fn millis(period: Duration) -> i64 {
    i64::try_from(period.as_millis()).unwrap_or(i64::MAX)
}

/// `text` matched literally in a regular expression.
fn escape_regex(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\^$.|?*+()[]{}-/#".contains(c) {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_is_matched_literally() {
        assert_eq!(escape_regex("kafka/a.b(c)"), r"kafka\/a\.b\(c\)");
        assert_eq!(escape_regex("plain"), "plain");
    }
}
