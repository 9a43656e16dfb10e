//! Trace context: a handler's span continues the trace of the span that published its event.
//!
//! The spans are the test's own ([`Traces`]): it runs on a current-thread runtime, under a
//! subscriber set for its thread.

use std::future::IntoFuture;

use opentelemetry::trace::TraceContextExt;
use relaybus::{BoxError, HandlerContext, RelayBus, Subscription};
use relaybus_harness::test_db;
use relaybus_tests::{
    support::{OrderPlaced, next, placed, store},
    traces::Traces,
};
use tokio::sync::mpsc;
use tracing_opentelemetry::OpenTelemetrySpanExt;

#[tokio::test(flavor = "current_thread")]
async fn a_handler_continues_the_trace_of_the_span_that_published() {
    let traces = Traces::capture();

    let db = test_db("trace_context").await;
    let store = store(&db).await;
    let (seen, mut headers) = mpsc::unbounded_channel();
    let bus = RelayBus::builder(store)
        .without_registered_handlers()
        .subscribe(Subscription::new(
            "projector",
            move |_: OrderPlaced, ctx: HandlerContext| {
                let seen = seen.clone();
                async move {
                    seen.send(ctx.headers().clone()).unwrap();
                    Ok::<(), BoxError>(())
                }
            },
        ))
        .build()
        .unwrap();

    let request = tracing::info_span!("POST /orders");
    let request_context = request.context().span().span_context().clone();
    assert!(
        request_context.is_valid(),
        "the layer gives the span a context"
    );
    let publish = request.in_scope(|| bus.publish(&placed("o-1")).into_future());
    publish.await.unwrap();
    // A publish outside any span carries no context.
    bus.publish(&placed("o-2")).await.unwrap();
    drop(request);

    assert_eq!(bus.run_once().await.unwrap().completed, 2);
    let mut carried = vec![
        next(&mut headers, "the first handler run").await,
        next(&mut headers, "the second handler run").await,
    ];
    carried.sort_by_key(|h| h.contains_key("traceparent"));
    assert!(!carried[0].contains_key("traceparent"), "{carried:?}");
    let traceparent = &carried[1]["traceparent"];
    assert!(
        traceparent.starts_with(&format!("00-{}-", request_context.trace_id())),
        "{traceparent}"
    );

    let spans = traces.finished();
    let handled: Vec<_> = spans
        .iter()
        .filter(|span| span.name == "relaybus.handle")
        .collect();
    assert_eq!(handled.len(), 2, "{spans:#?}");
    let continued: Vec<_> = handled
        .iter()
        .filter(|span| span.span_context.trace_id() == request_context.trace_id())
        .collect();
    assert_eq!(
        continued.len(),
        1,
        "one handler run continues the request's trace"
    );
    assert_eq!(continued[0].parent_span_id, request_context.span_id());
    db.drop_database().await.unwrap();
}
