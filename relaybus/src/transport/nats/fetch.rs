//! Taking messages from the durable pull consumer, in stream order, even after another
//! process died holding some.

use std::{
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use async_nats::jetstream;
use futures::StreamExt;

use super::{NatsError, consumer::NatsSource, progress::InProgress};

impl NatsSource {
    /// Takes up to the batch size of messages, in stream order: what is there now, or, when
    /// nothing is, waits up to the fetch wait for the first message and takes it with whatever
    /// came along. The messages are reported in progress until the batch is settled.
    pub(super) async fn take(&self) -> Result<(Vec<jetstream::Message>, InProgress), NatsError> {
        let inner = &self.inner;
        let started = Instant::now();
        let limit = self.take_over().await?;
        let mut messages = self.pull(false, limit).await?;
        if messages.is_empty() {
            messages = self.pull(true, 1).await?;
            if messages.is_empty() {
                // The broker answered early (its limit of unacknowledged messages is reached
                // while earlier messages wait for redelivery): wait out the fetch wait rather
                // than ask again at once.
                let rest = inner.batch.fetch_wait.saturating_sub(started.elapsed());
                tokio::time::sleep(rest).await;
            } else if limit > 1 {
                let more = self.pull(false, limit - 1).await?;
                messages.extend(more);
            }
        }
        let replies = messages.iter().filter_map(|m| m.reply.clone()).collect();
        let progress = InProgress::start(
            inner.jetstream.client(),
            replies,
            inner.ack_wait,
            &inner.settled,
        );
        Ok((messages, progress))
    }

    /// Makes sure that messages out unacknowledged, which this process does not hold (a dead
    /// process's batch, or one of its own that was dropped, given back or not acknowledged),
    /// are taken again before any later message: the broker hands out messages up to the
    /// durable consumer's limit of unacknowledged messages, so a batch shorter than the limit
    /// would let the next fetch take later messages ahead of it. Until nothing is out, the
    /// limit is narrowed to what is out; the broker then redelivers those messages (after
    /// their ack wait), and only them, and the limit goes back to the batch size.
    ///
    /// Asks the broker only while unsettled: before the first fetch, after a batch that was
    /// not acknowledged in full.
    ///
    /// Returns how many messages this fetch may take: the limit. Asking for more than the
    /// limit would make the broker (2.9) redeliver what it just delivered.
    async fn take_over(&self) -> Result<usize, NatsError> {
        let inner = &self.inner;
        if inner.settled.load(Ordering::Acquire) {
            return Ok(inner.batch.batch_size);
        }
        let failed = |source: async_nats::Error| NatsError::Fetch {
            durable: inner.durable.clone(),
            source,
        };
        let info = inner
            .consumer
            .get_info()
            .await
            .map_err(|e| failed(e.into()))?;
        let out = info.num_ack_pending.min(inner.batch.batch_size);
        let limit = i64::try_from(if out == 0 {
            inner.batch.batch_size
        } else {
            out
        })
        .unwrap_or(i64::MAX);
        if info.config.max_ack_pending != limit {
            tracing::debug!(
                durable = inner.durable,
                out = info.num_ack_pending,
                limit,
                "setting the limit of unacknowledged messages"
            );
            let config = jetstream::consumer::pull::Config {
                max_ack_pending: limit,
                ..inner.config.clone()
            };
            inner
                .jetstream
                .create_consumer_on_stream(config, &inner.stream)
                .await
                .map_err(|e| failed(e.into()))?;
        }
        if info.num_ack_pending == 0 {
            inner.settled.store(true, Ordering::Release);
        }
        Ok(usize::try_from(limit).unwrap_or(inner.batch.batch_size))
    }

    /// Marks the durable consumer as possibly holding unacknowledged messages that this
    /// process does not: the next fetch takes them first.
    pub(super) fn unsettle(&self) {
        self.inner.settled.store(false, Ordering::Release);
    }

    /// One pull request: `no_wait` returns what is there now, otherwise the server holds the
    /// request up to the fetch wait.
    async fn pull(&self, wait: bool, count: usize) -> Result<Vec<jetstream::Message>, NatsError> {
        let inner = &self.inner;
        let failed = |source: async_nats::Error| {
            // The request may have been answered with messages that never came.
            self.unsettle();
            NatsError::Fetch {
                durable: inner.durable.clone(),
                source,
            }
        };
        let mut batch = if wait {
            inner
                .consumer
                .batch()
                .max_messages(count)
                .expires(inner.batch.fetch_wait)
                .messages()
                .await
                .map_err(|e| failed(e.into()))?
        } else {
            inner
                .consumer
                .fetch()
                .max_messages(count)
                .messages()
                .await
                .map_err(|e| failed(e.into()))?
        };
        // A pull request whose answer was lost (the connection dropped after it left) gets
        // no answer at all: give up on it past the fetch wait plus the server's grace, and
        // keep what came.
        let guard = inner
            .batch
            .fetch_wait
            .saturating_add(Duration::from_secs(5));
        let mut messages = Vec::new();
        loop {
            match tokio::time::timeout(guard, batch.next()).await {
                Ok(Some(Ok(message))) => messages.push(message),
                Ok(Some(Err(error))) => {
                    // A status such as "exceeded max ack pending" ends the pull; what came
                    // before it is kept.
                    tracing::debug!(durable = inner.durable, %error, "pull request ended");
                    break;
                }
                Ok(None) => break,
                Err(_) => {
                    tracing::debug!(durable = inner.durable, "pull request unanswered");
                    self.unsettle();
                    break;
                }
            }
        }
        Ok(messages)
    }
}
