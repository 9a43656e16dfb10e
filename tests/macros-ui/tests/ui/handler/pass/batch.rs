use std::time::Duration;

use relaybus::{Batch, BatchOutcome, BoxError, HandlerContext};
use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {
    total_cents: i64,
}

#[relaybus::handler(id = "project-orders", batch, max_batch = 25, batch_wait_ms = 10)]
async fn project(batch: Batch<OrderPlaced>) -> Result<(), BoxError> {
    let _ = batch.len();
    Ok(())
}

#[relaybus::handler(id = "bill-orders", batch, transactional)]
async fn bill(batch: Batch<OrderPlaced>, _: HandlerContext) -> Result<BatchOutcome, BoxError> {
    let mut outcome = BatchOutcome::succeeded();
    for item in &batch {
        if item.event().total_cents < 0 {
            outcome.fail_permanently(item, "a negative total");
        }
    }
    Ok(outcome)
}

fn main() {
    let limits: Vec<_> = relaybus::registry::handlers()
        .map(|h| (h.id(), h.event_type(), h.subscription().batch_limits()))
        .collect();
    assert_eq!(
        limits,
        [
            (
                "bill-orders",
                "order.placed.v1",
                Some((100, Duration::from_millis(50)))
            ),
            (
                "project-orders",
                "order.placed.v1",
                Some((25, Duration::from_millis(10)))
            ),
        ]
    );
}
