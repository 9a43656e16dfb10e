//! Trace context through the outbox: a publish records the current span's context in the
//! event's headers, and the handler's span continues that trace, so that one request can be
//! followed through every handler it caused (and, later, through brokers).
//!
//! With the `opentelemetry` feature, relaybus asks the application's OpenTelemetry propagator
//! (`opentelemetry::global::set_text_map_propagator`, W3C `traceparent`/`tracestate` with
//! `TraceContextPropagator`) to write the context of the current `tracing` span, as
//! `tracing-opentelemetry` knows it, into the event's headers, unless the event carries a
//! `traceparent` already (a relayed event keeps its origin's). The `relaybus.handle` span of
//! each delivery takes the context read back from those headers as its parent. Without a
//! propagator or an OpenTelemetry layer, nothing is written and nothing read. Without the
//! feature, this module does nothing at all.

use crate::event::EventEnvelope;

/// Records the current span's trace context in the envelope's headers.
#[cfg_attr(not(feature = "opentelemetry"), inline(always))]
pub(crate) fn inject(envelope: EventEnvelope) -> EventEnvelope {
    #[cfg(feature = "opentelemetry")]
    {
        otel::inject(envelope)
    }
    #[cfg(not(feature = "opentelemetry"))]
    {
        envelope
    }
}

/// Makes `span` continue the trace whose context the event's headers carry.
#[cfg_attr(not(feature = "opentelemetry"), inline(always))]
pub(crate) fn continue_trace(span: &tracing::Span, envelope: &EventEnvelope) {
    #[cfg(feature = "opentelemetry")]
    otel::continue_trace(span, envelope);
    #[cfg(not(feature = "opentelemetry"))]
    let _ = (span, envelope);
}

#[cfg(feature = "opentelemetry")]
mod otel {
    use std::collections::BTreeMap;

    use opentelemetry::propagation::{Extractor, Injector};
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use crate::event::{EventEnvelope, MAX_FIELD_BYTES};

    /// The W3C header that says an event carries a trace context already.
    const TRACEPARENT: &str = "traceparent";

    struct Writer<'a>(&'a mut BTreeMap<String, String>);

    impl Injector for Writer<'_> {
        fn set(&mut self, key: &str, value: String) {
            // What the envelope could not store is left out rather than refused.
            if !key.is_empty() && key.len() <= MAX_FIELD_BYTES && value.len() <= MAX_FIELD_BYTES {
                self.0.insert(key.to_owned(), value);
            }
        }
    }

    struct Reader<'a>(&'a BTreeMap<String, String>);

    impl Extractor for Reader<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).map(String::as_str)
        }

        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(String::as_str).collect()
        }
    }

    pub(super) fn inject(mut envelope: EventEnvelope) -> EventEnvelope {
        if envelope.headers().contains_key(TRACEPARENT) {
            return envelope;
        }
        let context = tracing::Span::current().context();
        opentelemetry::global::get_text_map_propagator(|propagator| {
            propagator.inject_context(&context, &mut Writer(envelope.headers_mut()));
        });
        envelope
    }

    pub(super) fn continue_trace(span: &tracing::Span, envelope: &EventEnvelope) {
        if !envelope.headers().contains_key(TRACEPARENT) {
            return;
        }
        let parent = opentelemetry::global::get_text_map_propagator(|propagator| {
            propagator.extract(&Reader(envelope.headers()))
        });
        let _ = span.set_parent(parent);
    }
}
