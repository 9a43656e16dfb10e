//! What a running dispatcher keeps up beside its loop: the leases of running deliveries, the
//! delivery gauges and the retention purge.

use std::{sync::Arc, time::Duration};

use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::{Retention, Shared};
use crate::store::Store;

/// Extends, every third of the lease duration, the leases of the running non-transactional
/// handlers; the store renews what covers them (MongoDB: their lanes, each once). Transactional
/// handlers are not renewed: their completion must not conflict with a renewal.
pub(super) async fn renew_leases<S: Store>(shared: Arc<Shared<S>>, cancel: CancellationToken) {
    let lease_duration = shared.settings.lease_duration;
    let period = (lease_duration / 3).max(Duration::from_millis(10));
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(period) => {}
        }
        shared.renew_slots().await;
        let leases: Vec<S::Lease> = shared
            .running()
            .values()
            .filter(|running| !running.transactional)
            .map(|running| running.lease.clone())
            .collect();
        if leases.is_empty() {
            continue;
        }
        match shared
            .store
            .renew(&leases, lease_duration, shared.now())
            .await
        {
            Ok(covered) if covered < leases.len() => debug!(
                running = leases.len(),
                covered, "some leases not renewed: their claims ended or changed hands"
            ),
            Ok(_) => {}
            Err(error) => warn!(%error, "renewing leases failed"),
        }
    }
}

/// Samples the delivery gauges on their interval.
pub(super) async fn sample_periodically<S: Store>(
    shared: Arc<Shared<S>>,
    interval: Duration,
    cancel: CancellationToken,
) {
    loop {
        if let Err(error) = shared.sample_gauges(true).await {
            debug!(%error, "sampling the delivery gauges failed; trying again at the next interval");
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

/// Purges on the retention interval.
pub(super) async fn purge_periodically<S: Store>(
    shared: Arc<Shared<S>>,
    retention: Retention,
    cancel: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(retention.interval) => {}
        }
        match shared.purge(retention).await {
            Ok(purged) => debug!(?purged, "purged expired deliveries and events"),
            Err(error) => warn!(%error, "purge failed; trying again at the next interval"),
        }
    }
}
