//! Where shipping reads the shop's events: the JetStream stream the shop's relay publishes to,
//! through a durable pull consumer of shipping's own.

use std::time::Duration;

use relaybus::transport::nats::{NatsConsumer, NatsError, async_nats::jetstream};

/// The stream of the shop's events, as the shop's relay names it.
pub const STREAM: &str = "SHOP_ORDERS";
/// The subject prefix of the shop's relay: events go to `shop.orders.<partition>`.
pub const PREFIX: &str = "shop.orders";
/// Shipping's durable consumer of the stream: its position survives restarts.
pub const DURABLE: &str = "shipping";

/// Makes sure `stream` exists, capturing `<prefix>.>` as the shop's relay creates it, so that
/// shipping may start before the shop. A stream that exists is left as it is.
///
/// # Errors
///
/// The server's, when JetStream is off or the stream cannot be made.
pub async fn ensure_stream(
    jetstream: &jetstream::Context,
    stream: &str,
    prefix: &str,
) -> Result<(), jetstream::context::CreateStreamError> {
    jetstream
        .get_or_create_stream(jetstream::stream::Config {
            name: stream.to_owned(),
            subjects: vec![format!("{prefix}.>")],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await?;
    Ok(())
}

/// Shipping's consumer of `stream`, durable as `durable`.
///
/// # Errors
///
/// As [`NatsConsumerBuilder::build`](relaybus::transport::nats::NatsConsumerBuilder::build):
/// the stream does not exist, or the server cannot be reached.
pub async fn consumer(
    jetstream: jetstream::Context,
    stream: &str,
    durable: &str,
) -> Result<NatsConsumer, NatsError> {
    NatsConsumer::builder(jetstream, stream, durable)
        .fetch_wait(Duration::from_millis(500))
        .build()
        .await
}
