//! Keeps a fetched batch's messages from being redelivered while this process works on them.
//!
//! The durable consumer's ack wait is short (seconds), so that the messages of a process that
//! died are delivered again soon. A batch whose append takes longer than that would be
//! redelivered while it is still being appended; so, while a batch is held, its messages are
//! reported in progress (`+WPI`) several times per ack wait, each report restarting the
//! broker's timer. When the process dies, the reports stop and the ack wait runs out.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use async_nats::{Client, Subject, jetstream::AckKind};
use tokio::task::JoinHandle;

/// How many progress reports go out per ack wait: one lost or late report is then no
/// redelivery.
const REPORTS_PER_ACK_WAIT: u32 = 4;

/// Reports a batch's messages in progress until it is finished or dropped. Dropped
/// unfinished, the batch is abandoned: it clears the consumer's `settled` flag, since its
/// messages are out unacknowledged and must be taken again before any later one.
#[derive(Debug)]
pub struct InProgress {
    task: Option<JoinHandle<()>>,
    settled: Option<Arc<AtomicBool>>,
}

impl InProgress {
    /// Starts reporting the messages whose acknowledgement subjects are `replies`, a
    /// [fraction](REPORTS_PER_ACK_WAIT) of `ack_wait` apart, the first one after that fraction
    /// (the broker's timer started at the delivery).
    pub(crate) fn start(
        client: Client,
        replies: Vec<Subject>,
        ack_wait: Duration,
        settled: &Arc<AtomicBool>,
    ) -> InProgress {
        if replies.is_empty() {
            return InProgress {
                task: None,
                settled: None,
            };
        }
        let every = ack_wait / REPORTS_PER_ACK_WAIT;
        let task = tokio::spawn(async move {
            let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                for reply in &replies {
                    // A report that cannot be sent (the connection is down) is no harm: the
                    // acknowledgement would fail too, and the broker redelivers.
                    if client
                        .publish(reply.clone(), AckKind::Progress.into())
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
                let _ = client.flush().await;
            }
        });
        InProgress {
            task: Some(task),
            settled: Some(Arc::clone(settled)),
        }
    }

    /// Stops reporting, before the batch's messages are settled with the broker; a report
    /// being sent is cut short.
    pub(crate) fn finish(&mut self) {
        self.settled = None;
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        if let Some(settled) = self.settled.take() {
            settled.store(false, Ordering::Release);
        }
        self.finish();
    }
}
