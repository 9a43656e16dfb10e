//! The shop's event and the two handlers that react to it.
//!
//! The handlers are generic over where the shop keeps its data ([`Orders`]), so the same code
//! runs on MongoDB and, in the tests, on the in-memory store; [`subscriptions`] subscribes them
//! to a bus of either store. (A `#[relaybus::handler]` function names one store in its
//! `HandlerContext`, so store-generic handlers are subscribed with `Subscription`s.)

use std::sync::{Arc, Mutex};

use relaybus::{BoxError, HandlerContext, State, Subscription, event};
use serde::{Deserialize, Serialize};

use crate::orders::Orders;

/// A customer placed an order.
#[event("order.placed.v1")]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct OrderPlaced {
    pub(crate) order_id: String,
    pub(crate) customer: String,
    pub(crate) total_cents: i64,
}

/// The handler ids: the keys of the deliveries in the store, so renaming one means migrating
/// its pending deliveries.
pub(crate) const SEND_CONFIRMATION: &str = "send-confirmation";
pub(crate) const PROJECTOR: &str = "projector";

/// The shop's subscriptions, for a bus whose state holds the [`Orders`] and a [`Mailer`].
pub(crate) fn subscriptions<O: Orders>() -> [Subscription; 2] {
    [
        Subscription::new(SEND_CONFIRMATION, send_confirmation::<O>),
        Subscription::new(PROJECTOR, projector::<O>).transactional(),
    ]
}

/// Sends the confirmation e-mail (here: prints it, and keeps it in the mailer's sent box). Not
/// transactional: if it fails after the mail went out, the mail goes out again, so a real one
/// would pass the event id to the mail service as an idempotency key.
async fn send_confirmation<O: Orders>(
    event: OrderPlaced,
    ctx: HandlerContext<O::Store>,
    State(mailer): State<Mailer>,
) -> Result<(), BoxError> {
    mailer.send(Mail {
        to: event.customer.clone(),
        order_id: event.order_id.clone(),
        text: format!(
            "order {} of {} is confirmed (event {}, attempt {})",
            event.order_id,
            money(event.total_cents),
            ctx.event_id(),
            ctx.attempt()
        ),
    });
    Ok(())
}

/// Keeps the totals per customer. Transactional: its write and the completion of its delivery
/// commit together, so each order counts exactly once.
async fn projector<O: Orders>(
    event: OrderPlaced,
    ctx: HandlerContext<O::Store>,
    State(orders): State<O>,
) -> Result<(), BoxError> {
    let mut session = ctx.session().await?;
    orders
        .add_to_totals(&mut session, &event.customer, event.total_cents)
        .await?;
    Ok(())
}

/// A confirmation e-mail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Mail {
    pub(crate) to: String,
    pub(crate) order_id: String,
    pub(crate) text: String,
}

/// The (simulated) mail service: prints each mail and keeps the last hundred.
#[derive(Debug, Clone, Default)]
pub(crate) struct Mailer {
    sent: Arc<Mutex<Vec<Mail>>>,
}

impl Mailer {
    fn send(&self, mail: Mail) {
        println!("  [{SEND_CONFIRMATION}] to {}: {}", mail.to, mail.text);
        let mut sent = self.sent.lock().unwrap_or_else(|e| e.into_inner());
        if sent.len() == 100 {
            sent.remove(0);
        }
        sent.push(mail);
    }

    /// The mails sent so far, oldest first.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn sent(&self) -> Vec<Mail> {
        self.sent.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

pub(crate) fn money(cents: i64) -> String {
    format!("${}.{:02}", cents / 100, cents % 100)
}
