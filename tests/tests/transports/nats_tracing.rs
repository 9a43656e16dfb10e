//! Trace context across the broker: the handler of the consuming service continues the trace
//! of the span that published the event in the first service, through a NATS JetStream stream.
//!
//! The spans are the test's own ([`Traces`]): it runs on a current-thread runtime, under a
//! subscriber set for its thread.

use std::{future::IntoFuture, time::Duration};

use async_nats::jetstream::{self, stream::StorageType};
use opentelemetry::trace::TraceContextExt;
use relaybus::{
    BoxError, Event, HandlerContext, MemoryEventStore, RelayBus, Subscription,
    transport::nats::{NatsConsumer, NatsRelay},
};
use relaybus_tests::traces::Traces;
use serde::{Deserialize, Serialize};
use tracing_opentelemetry::OpenTelemetrySpanExt;

#[derive(Debug, Serialize, Deserialize)]
struct Shipped {
    order_id: String,
}

impl Event for Shipped {
    const TYPE: &'static str = "transport-test.shipped.v1";
}

#[tokio::test(flavor = "current_thread")]
async fn the_consuming_handler_continues_the_publishers_trace() {
    let traces = Traces::capture();

    let url = std::env::var("RELAYBUS_TEST_NATS_URL")
        .unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let client = async_nats::connect(&url).await.unwrap_or_else(|error| {
        panic!("no NATS server at {url} ({error}); start one (scripts/nats start) and set RELAYBUS_TEST_NATS_URL")
    });
    let jetstream = jetstream::new(client);
    let unique = format!("{}_{:08x}", std::process::id(), rand::random::<u32>());
    let prefix = format!("relaybus-test.trace.{unique}");
    let stream = format!("RBT_trace_{unique}");
    jetstream
        .create_stream(jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{prefix}.>")],
            storage: StorageType::Memory,
            max_age: Duration::from_secs(3_600),
            ..Default::default()
        })
        .await
        .expect("a JetStream stream (is JetStream on: `nats-server -js`?)");

    let relay = NatsRelay::builder(jetstream.clone(), &prefix)
        .build()
        .expect("valid relay");
    let shop = RelayBus::builder(MemoryEventStore::new())
        .without_registered_handlers()
        .subscribe(
            relay
                .subscription::<Shipped, MemoryEventStore>()
                .expect("relay subscription"),
        )
        .build()
        .expect("shop bus");
    let shipping = RelayBus::builder(MemoryEventStore::new())
        .without_registered_handlers()
        .subscribe(Subscription::new(
            "notify",
            |_: Shipped, _: HandlerContext<MemoryEventStore>| async { Ok::<(), BoxError>(()) },
        ))
        .build()
        .expect("shipping bus");

    let request = tracing::info_span!("POST /shipments");
    let request_context = request.context().span().span_context().clone();
    assert!(request_context.is_valid());
    let publish = request.in_scope(|| {
        shop.publish(&Shipped {
            order_id: "o-1".into(),
        })
        .into_future()
    });
    publish.await.expect("publish");
    drop(request);

    assert_eq!(
        shop.run_until_idle()
            .await
            .expect("relay")
            .succeeded()
            .count(),
        1
    );
    let consumer = NatsConsumer::builder(jetstream.clone(), &stream, "shipping")
        .fetch_wait(Duration::from_millis(200))
        .build()
        .await
        .expect("consumer");
    let mut appended = 0;
    for _ in 0..50 {
        appended += consumer
            .run_once(&shipping)
            .await
            .expect("consume")
            .appended;
        if appended == 1 {
            break;
        }
    }
    assert_eq!(appended, 1, "the consumer appended the relayed event");
    assert_eq!(
        shipping
            .run_until_idle()
            .await
            .expect("handle")
            .succeeded()
            .count(),
        1
    );

    let spans = traces.finished();
    let handled: Vec<_> = spans
        .iter()
        .filter(|span| span.name == "relaybus.handle")
        .map(|span| (span.span_context.trace_id(), span.parent_span_id))
        .collect();
    // Two handler runs: the relay's in the shop, and `notify` in the shipping service; both
    // continue the request's trace, as children of the request's span.
    assert_eq!(handled.len(), 2, "{spans:#?}");
    for (trace_id, parent) in handled {
        assert_eq!(trace_id, request_context.trace_id());
        assert_eq!(parent, request_context.span_id());
    }
    let _ = jetstream.delete_stream(&stream).await;
}
