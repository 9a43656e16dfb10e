//! Completing the deliveries whose handlers succeeded, in batches.

use std::{sync::Arc, time::Duration};

use tokio::sync::{Notify, mpsc};
use tracing::{Instrument, debug, info_span, warn};

use super::Shared;
use crate::store::{Store, StoreLease};

/// A succeeded delivery for the completer: its lease, and whether it is keyed.
pub(super) struct Completion<L> {
    pub(super) lease: L,
    pub(super) keyed: bool,
}

/// Completes the deliveries whose handlers succeeded, batching those that finish close together.
pub(super) async fn complete_batches<S: Store>(
    shared: Arc<Shared<S>>,
    mut completions: mpsc::UnboundedReceiver<Completion<S::Lease>>,
    wake: Arc<Notify>,
) {
    const MAX_BATCH: usize = 1_000;
    while let Some(first) = completions.recv().await {
        let mut keyed = first.keyed;
        let mut batch = vec![first.lease];
        while batch.len() < MAX_BATCH {
            match completions.try_recv() {
                Ok(completion) => {
                    keyed |= completion.keyed;
                    batch.push(completion.lease);
                }
                Err(_) => break,
            }
        }
        let span = info_span!("relaybus.complete", deliveries = batch.len());
        async {
            let mut attempt = 0;
            loop {
                attempt += 1;
                match shared.complete(&batch).await {
                    Ok(completed) => {
                        let lost = completed.iter().filter(|c| !**c).count();
                        if lost > 0 {
                            debug!(
                                lost,
                                "some completions could not be proven; those deliveries may run again"
                            );
                        }
                        break;
                    }
                    Err(error) if attempt < 3 => {
                        warn!(%error, attempt, "completion failed; trying again");
                        tokio::time::sleep(Duration::from_millis(100 * attempt)).await;
                    }
                    Err(error) => {
                        warn!(%error, "completion failed; the deliveries run again once their leases end");
                        break;
                    }
                }
            }
        }
        .instrument(span)
        .await;
        {
            let mut running = shared.running();
            for lease in &batch {
                running.remove(&lease.delivery_id());
            }
        }
        if keyed {
            // Followers of these keys may be claimable now.
            wake.notify_one();
        }
    }
}
