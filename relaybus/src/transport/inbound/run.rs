//! The consumers' run loop: batch after batch until shutdown, with the same pauses, logs and
//! report for every broker.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{batch::InboundBatch, broker::Broker, report::BatchReport};
use crate::{bus::RelayBus, store::Store};

/// Fetches one batch, appends it and acknowledges it. An empty batch is settled as such
/// (nothing to acknowledge) and reports nothing.
pub(crate) async fn run_once<B: Broker, S: Store>(
    broker: &B,
    bus: &RelayBus<S>,
) -> Result<BatchReport, B::Error> {
    let batch = InboundBatch::fetch(broker).await?;
    batch.append(bus).await.ack().await
}

/// Consumes until `shutdown` is cancelled: batch after batch, each appended in one
/// transaction of `bus`'s store and then acknowledged. Returns every batch's report added up;
/// a batch whose acknowledgement failed counts its appends too (its redelivery then counts as
/// duplicates).
///
/// A fetch or an acknowledgement that fails is logged, and the loop goes on after the broker's
/// pause after a failure; after a batch whose appends failed it waits for the broker's pause
/// after a retry. On shutdown it stops fetching (a fetch waiting for messages is dropped when
/// the broker allows it), finishes the batch it holds, stops the broker and returns.
pub(crate) async fn run<B: Broker, S: Store>(
    broker: &B,
    bus: &RelayBus<S>,
    shutdown: CancellationToken,
) -> BatchReport {
    let mut total = BatchReport::default();
    while !shutdown.is_cancelled() {
        let fetched = if B::FETCH_STOPS_ON_SHUTDOWN {
            tokio::select! {
                fetched = InboundBatch::fetch(broker) => fetched,
                () = shutdown.cancelled() => break,
            }
        } else {
            InboundBatch::fetch(broker).await
        };
        let batch = match fetched {
            Ok(batch) => batch,
            Err(error) => {
                tracing::warn!(source = broker.source(), %error, "fetch failed; trying again");
                pause(&shutdown, broker.pause_after_failure()).await;
                continue;
            }
        };
        let batch_len = batch.len();
        let appended = batch.append(bus).await;
        // What the store took counts even when the acknowledgement fails: the redelivery
        // then counts as duplicates.
        let created = appended.appended().filter(|a| a.created).count();
        let held = appended.appended().filter(|a| !a.created).count();
        match appended.ack().await {
            Ok(report) => {
                let retried = report.retried > 0;
                if let Some(error) = report.last_error.as_deref().filter(|_| retried) {
                    tracing::warn!(
                        source = broker.source(),
                        retried = report.retried,
                        error,
                        "appending to the store failed; the messages are taken again"
                    );
                }
                total.add(report);
                if retried {
                    pause(&shutdown, broker.pause_after_retry()).await;
                }
            }
            Err(error) => {
                total.fetched += batch_len;
                total.appended += created;
                total.duplicates += held;
                tracing::warn!(source = broker.source(), %error, "acknowledging failed");
                pause(&shutdown, broker.pause_after_failure()).await;
            }
        }
    }
    broker.stop().await;
    total
}

/// Waits `wait`, or less when `shutdown` is cancelled.
async fn pause(shutdown: &CancellationToken, wait: Duration) {
    tokio::select! {
        () = shutdown.cancelled() => {}
        () = tokio::time::sleep(wait) => {}
    }
}
