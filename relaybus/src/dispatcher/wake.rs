//! Wake-up: a change stream on new deliveries wakes an idle dispatcher at once.
//!
//! Polling stays the safety net: correctness never depends on the stream. A stream that fails or
//! loses its resume point is reopened after a pause, and the dispatcher polls meanwhile.

use std::{sync::Arc, time::Duration};

use futures::StreamExt;
use mongodb::bson::doc;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::Shared;

/// Watches inserts of deliveries of this bus's handlers and wakes the dispatch loop for each.
pub(super) async fn watch(shared: Arc<Shared>, notify: Arc<Notify>, cancel: CancellationToken) {
    let mut pause = Duration::from_millis(100);
    loop {
        let pipeline = [
            doc! { "$match": {
                "operationType": "insert",
                "fullDocument.handler": { "$in": &shared.handler_ids },
            } },
            // The resume token (`_id`), `operationType` (the driver requires it), and the lane,
            // which the next claim after an idle wait looks at first.
            doc! { "$project": { "operationType": 1, "fullDocument.laneId": 1 } },
        ];
        let opened = tokio::select! {
            _ = cancel.cancelled() => return,
            opened = shared.store.inner.deliveries.watch().pipeline(pipeline) => opened,
        };
        match opened {
            Ok(mut stream) => {
                debug!("change stream open");
                // Whatever was inserted while the stream was closed is found by this claim.
                notify.notify_one();
                pause = Duration::from_millis(100);
                loop {
                    let next = tokio::select! {
                        _ = cancel.cancelled() => return,
                        next = stream.next() => next,
                    };
                    match next {
                        Some(Ok(change)) => {
                            if let Some(lane) = change
                                .full_document
                                .as_ref()
                                .and_then(|doc| doc.get_i32("laneId").ok())
                            {
                                shared.report_lane(lane);
                            }
                            notify.notify_one();
                        }
                        Some(Err(error)) => {
                            warn!(%error, "change stream failed; polling until it is reopened");
                            break;
                        }
                        None => break,
                    }
                }
            }
            Err(error) => {
                warn!(%error, "cannot open the change stream; polling until it opens");
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(Duration::from_secs(10));
    }
}
