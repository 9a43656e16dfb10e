//! The NATS side of the inbound driver: a batch is a pull's messages, reported in progress
//! while held; dead letters are published to a subject; settling acknowledges, terminates or
//! negatively acknowledges each message.

use std::time::Duration;

use async_nats::{
    header::NATS_MESSAGE_ID,
    jetstream::{self, AckKind, message::PublishMessage},
};

use super::{
    NatsError,
    consumer::NatsSource,
    progress::InProgress,
    wire::{
        self, DEAD_LETTER_REASON_HEADER, DEAD_LETTER_SOURCE_HEADER, DEAD_LETTER_SUBJECT_HEADER,
    },
};
use crate::{
    error::BoxError,
    transport::inbound::{Broker, Settlement},
};

impl Broker for NatsSource {
    type Message = jetstream::Message;
    type Hold = InProgress;
    type Error = NatsError;

    // A fetch dropped with messages taken would leave them out until the ack wait ends.
    const FETCH_STOPS_ON_SHUTDOWN: bool = false;

    async fn fetch(&self) -> Result<(Vec<jetstream::Message>, InProgress), NatsError> {
        self.take().await
    }

    fn body(message: &jetstream::Message) -> Result<&[u8], &'static str> {
        Ok(&message.payload)
    }

    fn redelivered(message: &jetstream::Message) -> bool {
        message.info().is_ok_and(|info| info.delivered > 1)
    }

    /// Publishes the message to the dead-letter subject and waits for JetStream's
    /// confirmation. Its `Nats-Msg-Id` is `<stream>:<sequence>`, so dead-lettering a
    /// redelivered message again keeps one copy.
    async fn dead_letter(
        &self,
        _progress: &mut InProgress,
        message: &jetstream::Message,
        reason: &str,
    ) -> Result<(), BoxError> {
        let inner = &self.inner;
        let subject = inner
            .dead_letter_subject
            .as_deref()
            .ok_or("no dead-letter subject is set (`NatsConsumerBuilder::dead_letter_subject`)")?;
        let mut headers = message.headers.clone().unwrap_or_default();
        headers.insert(DEAD_LETTER_REASON_HEADER, wire::header_text(reason));
        headers.insert(
            DEAD_LETTER_SUBJECT_HEADER,
            wire::header_text(message.subject.as_str()),
        );
        if let Ok(info) = message.info() {
            let source = format!("{}:{}", info.stream, info.stream_sequence);
            headers.insert(DEAD_LETTER_SOURCE_HEADER, wire::header_text(&source));
            headers.insert(NATS_MESSAGE_ID, wire::header_text(&source));
        }
        let publish = PublishMessage::build()
            .payload(message.payload.clone())
            .headers(headers);
        inner
            .jetstream
            .send_publish(subject.to_owned(), publish)
            .await?
            .await?;
        Ok(())
    }

    /// Acknowledges, terminates (`+TERM`) or negatively acknowledges with the nak delay each
    /// message, in stream order. The last acknowledgement waits for the server's reply (the
    /// server takes a consumer's acknowledgements in order, so all of them are in when it
    /// comes), and the connection is flushed.
    async fn settle(
        &self,
        mut progress: InProgress,
        messages: Vec<(jetstream::Message, Settlement)>,
    ) -> Result<(), NatsError> {
        // No progress report may follow a negative acknowledgement: it could restart the
        // message's timer and cut its nak delay short.
        progress.finish();
        if messages.is_empty() {
            return Ok(());
        }
        let inner = &self.inner;
        if messages
            .iter()
            .any(|(_, settle)| *settle == Settlement::Retry)
        {
            // Negatively acknowledged, they are out until redelivered.
            self.unsettle();
        }
        let mut failures = 0;
        let mut first_failure: Option<async_nats::Error> = None;
        let last = messages.len() - 1;
        for (at, (message, settle)) in messages.iter().enumerate() {
            let kind = match settle {
                Settlement::Ack => AckKind::Ack,
                Settlement::Retry => AckKind::Nak(Some(inner.nak_delay)),
                Settlement::Discard => AckKind::Term,
            };
            let sent = if at == last && *settle == Settlement::Ack {
                message.double_ack_with(kind).await
            } else {
                message.ack_with(kind).await
            };
            if let Err(error) = sent {
                failures += 1;
                first_failure.get_or_insert(error);
            }
        }
        if let Err(error) = inner.jetstream.client().flush().await {
            failures = messages.len();
            first_failure.get_or_insert(error.into());
        }
        match first_failure {
            Some(source) => {
                self.unsettle();
                Err(NatsError::Ack {
                    count: failures,
                    source,
                })
            }
            None => Ok(()),
        }
    }

    fn pause_after_failure(&self) -> Duration {
        self.inner.batch.fetch_wait
    }

    fn pause_after_retry(&self) -> Duration {
        self.inner.nak_delay
    }

    fn source(&self) -> &str {
        &self.inner.durable
    }
}
