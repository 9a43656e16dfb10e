//! Wake-up: the store's stream of new deliveries (a change stream on MongoDB) wakes an idle
//! dispatcher at once.
//!
//! Polling stays the safety net: correctness never depends on the stream. A stream that fails or
//! loses its resume point is reopened after a pause, and the dispatcher polls meanwhile.

use std::{sync::Arc, time::Duration};

use futures::StreamExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::Shared;
use crate::store::Store;

/// Watches new deliveries of this bus's handlers and wakes the dispatch loop for each.
pub(super) async fn watch<S: Store>(
    shared: Arc<Shared<S>>,
    notify: Arc<Notify>,
    cancel: CancellationToken,
) {
    let mut pause = Duration::from_millis(100);
    loop {
        let opened = tokio::select! {
            _ = cancel.cancelled() => return,
            opened = shared.store.watch(&shared.handler_ids) => opened,
        };
        match opened {
            Ok(mut stream) => {
                debug!("wake-up stream open");
                // Whatever was inserted while the stream was closed is found by this claim.
                notify.notify_one();
                pause = Duration::from_millis(100);
                loop {
                    let next = tokio::select! {
                        _ = cancel.cancelled() => return,
                        next = stream.next() => next,
                    };
                    match next {
                        Some(Ok(_)) => notify.notify_one(),
                        Some(Err(error)) => {
                            warn!(%error, "wake-up stream failed; polling until it is reopened");
                            break;
                        }
                        None => break,
                    }
                }
            }
            Err(error) => {
                warn!(%error, "cannot open the wake-up stream; polling until it opens");
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(Duration::from_secs(10));
    }
}
