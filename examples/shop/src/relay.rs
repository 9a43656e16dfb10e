//! The shop's opt-in relay: with `--relay nats://...` (or `SHOP_RELAY`), `order.placed.v1`
//! also goes to the JetStream stream `SHOP_ORDERS`, subjects `shop.orders.<partition>`, for
//! other services to consume (`examples/shipping`). Without it nothing leaves the process.

use relaybus::{
    BoxError,
    transport::nats::{NatsRelay, async_nats::jetstream},
};

/// The stream the relay publishes to.
pub(crate) const STREAM: &str = "SHOP_ORDERS";
/// The relay's subject prefix.
pub(crate) const PREFIX: &str = "shop.orders";

/// The relay to `stream` (subjects `<prefix>.<partition>`, one partition per customer hash
/// of four), with the stream created when missing.
pub(crate) async fn nats_relay(
    jetstream: jetstream::Context,
    stream: &str,
    prefix: &str,
) -> Result<NatsRelay, BoxError> {
    let relay = NatsRelay::builder(jetstream.clone(), prefix)
        .partitions(4)
        .expected_stream(stream)
        .build()?;
    jetstream
        .get_or_create_stream(relay.stream_config(stream))
        .await
        .map_err(|error| {
            format!(
                "could not make the stream {stream} ({error}): is JetStream on (`nats-server -js`)?"
            )
        })?;
    Ok(relay)
}

/// Connects to the NATS server at `url` and makes the shop's relay.
pub(crate) async fn connect(url: &str) -> Result<NatsRelay, BoxError> {
    let client = relaybus::transport::nats::async_nats::connect(url)
        .await
        .map_err(|error| {
            format!(
                "no NATS server answers at {url} ({error}); start one with JetStream \
                 (`scripts/nats start`), or leave out --relay"
            )
        })?;
    nats_relay(jetstream::new(client), STREAM, PREFIX).await
}
