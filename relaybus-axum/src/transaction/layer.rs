use std::sync::Arc;

use tower::Layer;

use relaybus::{Store, store::DefaultStore};

use super::RequestTx;
use crate::config::Shared;

/// Gives every request of the routes it wraps a MongoDB transaction, started on first use and
/// committed or aborted from the response status; see [`RequestTx`] and the
/// [module docs](crate::transaction). Made by [`setup`](crate::setup), together with the
/// [`RelayState`](crate::RelayState) of the same bus.
///
/// # Ordering
///
/// [`Router::layer`](axum::Router::layer) wraps the routes added **before** it, so add the
/// layer after the routes that use [`Tx`](crate::Tx) or [`Publisher`](crate::Publisher)
/// (routes added after it have no transaction, and their extractors answer 500). Layers added
/// after it run outside it and see the response once the transaction is resolved: put a
/// request timeout there, and the transaction of a request that runs out of time is aborted.
///
/// ```no_run
/// # async fn example(bus: relaybus::RelayBus) -> Result<(), relaybus::ConfigurationError> {
/// use axum::{Router, routing::post};
/// use relaybus_axum::Publisher;
///
/// async fn place_order(publisher: Publisher) { /* ... */ }
///
/// let (state, layer) = relaybus_axum::setup(bus)?;
/// let app: Router = Router::new()
///     .route("/orders", post(place_order))
///     .layer(layer)
///     .with_state(state);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct RequestTxLayer<St: Store = DefaultStore> {
    shared: Arc<Shared<St>>,
}

impl<St: Store> Clone for RequestTxLayer<St> {
    fn clone(&self) -> Self {
        RequestTxLayer {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<St: Store> RequestTxLayer<St> {
    pub(crate) fn new(shared: Arc<Shared<St>>) -> Self {
        RequestTxLayer { shared }
    }
}

impl<S, St: Store> Layer<S> for RequestTxLayer<St> {
    type Service = RequestTx<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        RequestTx::new(inner, Arc::clone(&self.shared))
    }
}
