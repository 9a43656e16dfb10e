//! The RabbitMQ side of the inbound driver: a batch holds the consumer's channel; dead letters
//! are published, confirmed, to an exchange; settling acknowledges, rejects or requeues runs
//! of messages with one `multiple` acknowledgement each.

use std::{fmt, time::Duration};

use lapin::{
    Channel, Confirmation,
    message::Delivery,
    options::{BasicAckOptions, BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions},
};
use tokio::sync::OwnedMutexGuard;

use super::{
    RabbitError,
    consumer::{RabbitSource, Session},
    wire::{
        self, DEAD_LETTER_QUEUE_HEADER, DEAD_LETTER_REASON_HEADER, DEAD_LETTER_ROUTING_KEY_HEADER,
        PERSISTENT,
    },
};
use crate::{
    error::BoxError,
    transport::inbound::{Broker, Settlement},
};

/// How long publishing an unreadable message to the dead-letter exchange may wait for the
/// broker's confirmation.
const DEAD_LETTER_CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);

/// The consumer's session, held by a batch from its fetch to its settlement: one batch is out
/// at a time. Dropped unsettled, it marks the session to be reopened before the next fetch, so
/// the broker puts the batch back in the queue.
pub struct Held {
    guard: OwnedMutexGuard<Option<Session>>,
    unsettled: bool,
}

impl fmt::Debug for Held {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Held")
            .field("unsettled", &self.unsettled)
            .finish_non_exhaustive()
    }
}

impl Held {
    pub(super) fn new(guard: OwnedMutexGuard<Option<Session>>, unsettled: bool) -> Self {
        Held { guard, unsettled }
    }

    /// Has the session reopened before the next fetch.
    fn give_back(&mut self) {
        if let Some(session) = self.guard.as_mut() {
            session.reopen = true;
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.unsettled {
            self.give_back();
        }
    }
}

impl Broker for RabbitSource {
    type Message = Delivery;
    type Hold = Held;
    type Error = RabbitError;

    // A fetch hands over a message only when it returns; the run notices its token within
    // the fetch wait.
    const FETCH_STOPS_ON_SHUTDOWN: bool = false;

    async fn fetch(&self) -> Result<(Vec<Delivery>, Held), RabbitError> {
        self.take().await
    }

    fn body(delivery: &Delivery) -> Result<&[u8], &'static str> {
        Ok(&delivery.data)
    }

    fn redelivered(delivery: &Delivery) -> bool {
        delivery.redelivered
    }

    /// Publishes the message to the dead-letter exchange and waits for the broker's
    /// confirmation.
    async fn dead_letter(
        &self,
        held: &mut Held,
        delivery: &Delivery,
        reason: &str,
    ) -> Result<(), BoxError> {
        let inner = &self.inner;
        let session = held.guard.as_mut().ok_or("the connection was closed")?;
        let (exchange, routing_key) = inner.dead_letter.as_ref().ok_or(
            "no dead-letter exchange is set (`RabbitConsumerBuilder::dead_letter_exchange`)",
        )?;
        let channel = match &session.dead_letter {
            Some(channel) if channel.status().connected() => channel.clone(),
            _ => {
                let channel = session.connection.create_channel().await?;
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await?;
                session.dead_letter = Some(channel.clone());
                channel
            }
        };
        let mut headers = delivery.properties.headers().clone().unwrap_or_default();
        headers.insert(DEAD_LETTER_REASON_HEADER.into(), wire::header_text(reason));
        headers.insert(DEAD_LETTER_QUEUE_HEADER.into(), wire::text(&inner.queue));
        headers.insert(
            DEAD_LETTER_ROUTING_KEY_HEADER.into(),
            wire::text(delivery.routing_key.as_str()),
        );
        let properties = delivery
            .properties
            .clone()
            .with_headers(headers)
            .with_delivery_mode(PERSISTENT);
        let publish = async {
            let confirm = channel
                .basic_publish(
                    exchange.as_str().into(),
                    routing_key.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &delivery.data,
                    properties,
                )
                .await?;
            confirm.await
        };
        match tokio::time::timeout(DEAD_LETTER_CONFIRM_TIMEOUT, publish).await {
            Ok(Ok(Confirmation::Ack(None))) => Ok(()),
            Ok(Ok(Confirmation::Ack(Some(_)) | Confirmation::Nack(Some(_)))) => Err(format!(
                "the dead-letter exchange {exchange:?} routes nothing for {routing_key:?}; \
                 bind a queue to it"
            )
            .into()),
            Ok(Ok(_)) => Err("the broker refused the dead letter".into()),
            Ok(Err(error)) => Err(error.into()),
            Err(_) => Err(format!(
                "the broker did not confirm the dead letter within {DEAD_LETTER_CONFIRM_TIMEOUT:?}"
            )
            .into()),
        }
    }

    /// Acknowledges, rejects without requeue, or requeues each message, in queue order,
    /// consecutive messages settled alike with one `multiple` acknowledgement. After giving
    /// messages back, or failing to settle, the session is reopened before the next fetch, so
    /// what the broker had sent ahead goes back too and the queue keeps its order.
    async fn settle(
        &self,
        mut held: Held,
        deliveries: Vec<(Delivery, Settlement)>,
    ) -> Result<(), RabbitError> {
        held.unsettled = false;
        if deliveries.is_empty() {
            return Ok(());
        }
        let count = deliveries.len();
        let Some(session) = held.guard.as_mut() else {
            return Err(RabbitError::Ack {
                count,
                source: "the connection was closed".into(),
            });
        };
        let mut settled = 0;
        let mut failure: Option<BoxError> = None;
        let mut at = 0;
        while at < count {
            let kind = deliveries[at].1;
            let run = deliveries[at..]
                .iter()
                .take_while(|(_, settle)| *settle == kind)
                .count();
            let tag = deliveries[at + run - 1].0.delivery_tag;
            if let Err(error) = settle_up_to(&session.channel, kind, tag).await {
                failure = Some(error.into());
                break;
            }
            at += run;
            settled = at;
        }
        let retried = deliveries
            .iter()
            .any(|(_, settle)| *settle == Settlement::Retry);
        if retried || failure.is_some() {
            held.give_back();
        }
        match failure {
            Some(source) => Err(RabbitError::Ack {
                count: count - settled,
                source,
            }),
            None => Ok(()),
        }
    }

    fn pause_after_failure(&self) -> Duration {
        self.inner.batch.fetch_wait
    }

    fn pause_after_retry(&self) -> Duration {
        self.inner.retry_delay
    }

    fn source(&self) -> &str {
        &self.inner.queue
    }

    async fn stop(&self) {
        self.close().await;
    }
}

/// Settles every unsettled message of the channel up to `tag` (`multiple`): the batch's
/// earlier messages are settled already, and the later ones have greater tags. A discarded
/// message is rejected without requeue (dropped, or dead-lettered by the queue's own policy);
/// one to retry is requeued.
async fn settle_up_to(channel: &Channel, kind: Settlement, tag: u64) -> Result<(), lapin::Error> {
    match kind {
        Settlement::Ack => {
            channel
                .basic_ack(tag, BasicAckOptions { multiple: true })
                .await
        }
        Settlement::Retry | Settlement::Discard => {
            channel
                .basic_nack(
                    tag,
                    BasicNackOptions {
                        multiple: true,
                        requeue: kind == Settlement::Retry,
                    },
                )
                .await
        }
    }
}
