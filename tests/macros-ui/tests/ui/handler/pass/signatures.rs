use std::{
    future::Future,
    pin::pin,
    task::{Context, Poll, Waker},
    time::Duration,
};

use relaybus::{BoxError, HandlerContext, RetryPolicy};
use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Debug, Serialize, Deserialize)]
pub struct OrderPlaced {
    order_id: String,
}

/// Takes the context, boxes its errors itself.
#[relaybus::handler(id = "projector", transactional)]
async fn project(event: OrderPlaced, context: HandlerContext) -> Result<(), BoxError> {
    let _ = (event.order_id, context.attempt());
    Ok(())
}

#[derive(Debug)]
pub struct MailError;

impl std::fmt::Display for MailError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the mail server said no")
    }
}

impl std::error::Error for MailError {}

/// Takes the event alone, through a pattern, and returns an error type of its own; its mails
/// need no order.
#[relaybus::handler(
    id = "mailer",
    unordered,
    max_attempts = 5,
    initial_backoff_ms = 200,
    max_backoff_ms = 60_000,
    timeout_ms = 30_000
)]
pub async fn send_mail(OrderPlaced { order_id }: OrderPlaced) -> Result<(), MailError> {
    if order_id.is_empty() {
        Err(MailError)
    } else {
        Ok(())
    }
}

mod audit {
    use super::OrderPlaced;

    #[derive(Clone)]
    pub(crate) struct AuditLog {
        pub(crate) name: &'static str,
    }

    /// Declared in another module, with the crate path spelled out and `relaybus::Result`;
    /// unordered and transactional at once; taking state before the context, and a state
    /// part through a pattern.
    #[relaybus::handler(
        id = "audit:orders",
        unordered,
        transactional,
        max_attempts = 1,
        crate = ::relaybus
    )]
    pub(crate) async fn record(
        _: OrderPlaced,
        log: relaybus::State<AuditLog>,
        _: relaybus::HandlerContext,
        relaybus::State(limit): relaybus::State<u32>,
    ) -> relaybus::Result<()> {
        let _ = (log.name, limit);
        Ok(())
    }
}

/// Runs a future that does not wait on anything.
fn ready<F: Future>(future: F) -> F::Output {
    match pin!(future).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("the handler waited"),
    }
}

fn main() {
    // The functions stay plain functions.
    assert!(
        ready(send_mail(OrderPlaced {
            order_id: String::new()
        }))
        .is_err()
    );
    assert!(
        ready(send_mail(OrderPlaced {
            order_id: "o-1".into()
        }))
        .is_ok()
    );
    let _ = project;
    let _ = audit::record;

    let handlers: Vec<_> = relaybus::registry::handlers()
        .map(|h| {
            (
                h.id(),
                h.event_type(),
                h.rust_path(),
                h.is_transactional(),
                h.is_unordered(),
            )
        })
        .collect();
    // trybuild names the crate of each test itself.
    let path = |item: &str| format!("{}::{item}", module_path!());
    assert_eq!(
        handlers,
        [
            (
                "audit:orders",
                "order.placed.v1",
                path("audit::record").as_str(),
                true,
                true
            ),
            (
                "mailer",
                "order.placed.v1",
                path("send_mail").as_str(),
                false,
                true
            ),
            (
                "projector",
                "order.placed.v1",
                path("project").as_str(),
                true,
                false
            ),
        ]
    );
    let [audit, mailer, projector]: [_; 3] = relaybus::registry::handlers()
        .collect::<Vec<_>>()
        .try_into()
        .unwrap();
    assert_eq!(audit.retry_policy(), Some(RetryPolicy::new(1)));
    assert_eq!(
        mailer.retry_policy(),
        Some(
            RetryPolicy::new(5)
                .initial_backoff(Duration::from_millis(200))
                .max_backoff(Duration::from_secs(60))
        )
    );
    assert_eq!(projector.retry_policy(), None);

    let subscription = projector.subscription();
    assert_eq!(subscription.id(), "projector");
    assert_eq!(subscription.event_type(), "order.placed.v1");
    assert!(subscription.is_transactional());
    assert!(!subscription.is_unordered());
    assert!(mailer.subscription().is_unordered());
    let audit = audit.subscription();
    assert!(audit.is_unordered() && audit.is_transactional());
    assert_eq!(
        mailer.subscription().retry_policy(),
        mailer.retry_policy().as_ref()
    );
    relaybus::registry::check().unwrap();
}
