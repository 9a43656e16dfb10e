//! Taking a batch from the queue: a connection and a channel that consumes it with a prefetch
//! of the batch size, opened again after a loss or a batch given back.

use std::sync::{Arc, atomic::Ordering};

use futures::{FutureExt, StreamExt};
use lapin::{
    message::Delivery,
    options::{BasicConsumeOptions, BasicQosOptions},
    types::FieldTable,
};

use super::{
    RabbitError,
    connection::close_quietly,
    consumer::{RabbitSource, Session},
    inbound::Held,
};
use crate::error::BoxError;

impl RabbitSource {
    /// Takes up to the batch size of messages, in queue order: waits up to the fetch wait for
    /// a first message, then takes it with whatever else the broker has sent ahead. Opens a
    /// connection first when there is none, the last one was lost, or the last batch was
    /// dropped or given back.
    pub(super) async fn take(&self) -> Result<(Vec<Delivery>, Held), RabbitError> {
        let inner = &self.inner;
        let mut guard = Arc::clone(&inner.session).lock_owned().await;
        if guard
            .as_ref()
            .is_some_and(|session| session.reopen || !session.is_open())
            && let Some(session) = guard.take()
        {
            close_quietly(&session.connection, "relaybus consumer reopening").await;
        }
        let session = match guard.as_mut() {
            Some(session) => session,
            None => guard.insert(self.open().await?),
        };
        let lost = |source: BoxError| RabbitError::Fetch {
            queue: inner.queue.clone(),
            source,
        };
        let mut deliveries = Vec::new();
        match tokio::time::timeout(inner.batch.fetch_wait, session.consumer.next()).await {
            Ok(Some(Ok(delivery))) => deliveries.push(delivery),
            Ok(Some(Err(error))) => {
                *guard = None;
                return Err(lost(error.into()));
            }
            Ok(None) => {
                *guard = None;
                return Err(lost(
                    "the broker cancelled the consumer (the queue was deleted?)".into(),
                ));
            }
            Err(_) if !session.is_open() => {
                *guard = None;
                return Err(lost("the connection or the channel closed".into()));
            }
            Err(_) => {}
        }
        while !deliveries.is_empty() && deliveries.len() < inner.batch.batch_size {
            match session.consumer.next().now_or_never() {
                Some(Some(Ok(delivery))) => deliveries.push(delivery),
                // The channel is lost: settling this batch fails, and the next fetch reopens.
                Some(Some(Err(_)) | None) => {
                    session.reopen = true;
                    break;
                }
                None => break,
            }
        }
        let held = Held::new(guard, !deliveries.is_empty());
        Ok((deliveries, held))
    }

    /// Opens a connection and a channel that consumes the queue with a prefetch of the batch
    /// size.
    pub(super) async fn open(&self) -> Result<Session, RabbitError> {
        let inner = &self.inner;
        let connection = inner.endpoint.connect().await?;
        let setup = |source| RabbitError::Setup {
            what: format!("a consumer of the queue {:?}", inner.queue),
            source,
        };
        let opened = async {
            let channel = connection
                .create_channel()
                .await
                .map_err(|error| inner.endpoint.failed(error))?;
            // The batch size is at most MAX_BATCH_SIZE, within u16.
            let prefetch = u16::try_from(inner.batch.batch_size).unwrap_or(u16::MAX);
            channel
                .basic_qos(prefetch, BasicQosOptions::default())
                .await
                .map_err(setup)?;
            let tag = format!("relaybus-{}", uuid::Uuid::now_v7());
            let consumer = channel
                .basic_consume(
                    inner.queue.as_str().into(),
                    tag.into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(setup)?;
            Ok::<_, RabbitError>((channel, consumer))
        }
        .await;
        match opened {
            Ok((channel, consumer)) => {
                inner.connections.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(
                    endpoint = inner.endpoint.display(),
                    queue = inner.queue,
                    "consumer connected"
                );
                Ok(Session {
                    connection,
                    channel,
                    consumer,
                    dead_letter: None,
                    reopen: false,
                })
            }
            Err(error) => {
                close_quietly(&connection, "relaybus consumer could not consume").await;
                Err(error)
            }
        }
    }
}
