//! Spans exported to memory, for the tests that read a trace back.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::{
    propagation::TraceContextPropagator,
    trace::{InMemorySpanExporter, SdkTracerProvider, SpanData},
};
use tracing::subscriber::DefaultGuard;
use tracing_subscriber::layer::SubscriberExt;

/// The spans of one test, exported to memory while it holds this.
///
/// The subscriber is set for the test's thread only: run the test on a current-thread runtime,
/// so that every task of the test runs under it, while the spans of the tests on other threads
/// never reach it. The propagator is global; every test that sets one sets this one.
#[derive(Debug)]
pub struct Traces {
    exporter: InMemorySpanExporter,
    provider: SdkTracerProvider,
    _subscriber: DefaultGuard,
}

impl Traces {
    /// Sets the W3C trace context propagator, and for this thread a subscriber with an
    /// OpenTelemetry layer that exports every span to memory.
    pub fn capture() -> Traces {
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("relaybus-tests")));
        Traces {
            exporter,
            provider,
            _subscriber: tracing::subscriber::set_default(subscriber),
        }
    }

    /// The spans finished so far.
    pub fn finished(&self) -> Vec<SpanData> {
        self.provider.force_flush().expect("flush");
        self.exporter.get_finished_spans().expect("spans")
    }
}
