//! Mounting the operator routes: nested at a path, and answering that path with a trailing
//! slash too, which axum's `nest` leaves to the application's 404.

use axum::{Router, extract::RawQuery, response::Redirect, routing::get};

/// Nests the operator routes in an application's router: [`nest_ops`](Self::nest_ops).
pub trait NestOps<S> {
    /// Nests the operator routes `ops` at `path` (such as `/ops`), as [`Router::nest`] does,
    /// and answers `path/` with a permanent redirect to `path`, so that the page opens from
    /// either address. The redirect is relative (`../ops`), so it holds behind a proxy that
    /// serves the application under a prefix, and it keeps the query.
    ///
    /// # Panics
    ///
    /// As [`Router::nest`]: when `path` is empty, `/`, or does not start with `/`.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # fn example(bus: relaybus::RelayBus) {
    /// use axum::Router;
    /// use relaybus_axum::ops::NestOps;
    ///
    /// # let require_operator = tower::layer::util::Identity::new();
    /// let app: Router = Router::new()
    ///     // .route(..) for the application
    ///     .nest_ops("/ops", relaybus_axum::ops::router(bus).layer(require_operator));
    /// # }
    /// ```
    #[must_use]
    fn nest_ops(self, path: &str, ops: Router<S>) -> Self;
}

impl<S> NestOps<S> for Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    fn nest_ops(self, path: &str, ops: Router<S>) -> Self {
        let base = path.trim_end_matches('/');
        let last = base.rsplit('/').next().unwrap_or_default().to_owned();
        self.nest(base, ops).route(
            &format!("{base}/"),
            get(move |RawQuery(query): RawQuery| async move {
                let target = match query {
                    Some(query) => format!("../{last}?{query}"),
                    None => format!("../{last}"),
                };
                Redirect::permanent(&target)
            }),
        )
    }
}
