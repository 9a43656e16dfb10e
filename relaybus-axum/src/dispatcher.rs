//! [`DispatcherService`]: the bus's dispatcher next to `axum::serve`, with graceful shutdown.

use std::{future::IntoFuture, io, time::Duration};

use axum::Router;
use relaybus::{RelayBus, Store, store::DefaultStore};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// How long in-flight requests get to finish after shutdown began, by default.
const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs an Axum server and the bus's dispatcher in one process, and stops both gracefully.
///
/// [`serve`](Self::serve) starts the dispatcher ([`RelayBus::start`]) and serves the router.
/// Shutdown begins on SIGINT or SIGTERM (unless [`handle_signals`](Self::handle_signals) is
/// off) or when the [shutdown token](Self::shutdown_token) is cancelled, and goes:
///
/// 1. the server stops accepting connections and lets in-flight requests finish, for at most
///    the [drain timeout](Self::drain_timeout) (30 s by default); requests still running then
///    are dropped, which aborts their transactions;
/// 2. [`RelayBus::shutdown`]: no more claims, running handlers get the bus's shutdown timeout,
///    unfinished deliveries are released without charging an attempt and the lanes are handed
///    back, so other workers take over at once;
/// 3. `serve` returns.
///
/// A second SIGINT or SIGTERM during shutdown exits the process at once, with status 130 (or
/// 143 for SIGTERM), as a user pressing Ctrl-C twice expects.
///
/// # Example
///
/// ```no_run
/// # async fn example(bus: relaybus::RelayBus, app: axum::Router) -> Result<(), relaybus_axum::ServeError> {
/// use relaybus_axum::DispatcherService;
///
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
/// DispatcherService::new(bus).serve(listener, app).await?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
#[must_use = "the service does nothing until `serve` is awaited"]
pub struct DispatcherService<S: Store = DefaultStore> {
    bus: RelayBus<S>,
    token: CancellationToken,
    handle_signals: bool,
    drain_timeout: Duration,
}

impl<S: Store> DispatcherService<S> {
    /// A service for `bus`, with its own shutdown token, signal handling on, and a drain
    /// timeout of 30 seconds.
    pub fn new(bus: RelayBus<S>) -> Self {
        DispatcherService {
            bus,
            token: CancellationToken::new(),
            handle_signals: true,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
        }
    }

    /// Uses the caller's token: cancelling it shuts the service down, and the service cancels
    /// it when shutdown begins for another reason (a signal, a server error). Pass a child
    /// token to keep the caller's own from being cancelled.
    pub fn with_shutdown_token(mut self, token: CancellationToken) -> Self {
        self.token = token;
        self
    }

    /// The token whose cancellation shuts the service down.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.token.clone()
    }

    /// Whether SIGINT and SIGTERM (Ctrl-C only, off Unix) begin shutdown, and a second one
    /// exits the process; on by default. Turn it off when the application handles signals
    /// itself and cancels the [shutdown token](Self::shutdown_token).
    pub fn handle_signals(mut self, enabled: bool) -> Self {
        self.handle_signals = enabled;
        self
    }

    /// How long in-flight requests may still run once shutdown began, 30 seconds by default.
    pub fn drain_timeout(mut self, timeout: Duration) -> Self {
        self.drain_timeout = timeout;
        self
    }

    /// Starts the dispatcher, serves `router` on `listener` until shutdown, then shuts the
    /// dispatcher down; see the [type docs](Self) for the steps.
    ///
    /// # Errors
    ///
    /// [`ServeError::Start`] when the dispatcher could not start (nothing was served);
    /// [`ServeError::Io`] when the server failed (the dispatcher is shut down all the same).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: dropping the future stops serving at once, without draining, and leaves
    /// the dispatcher running until [`RelayBus::shutdown`] is called. Cancel the
    /// [shutdown token](Self::shutdown_token) instead.
    pub async fn serve(self, listener: TcpListener, router: Router) -> Result<(), ServeError> {
        self.bus.start().await.map_err(ServeError::Start)?;
        let token = self.token.clone();
        let signals = self
            .handle_signals
            .then(|| tokio::spawn(watch_signals(token.clone())));

        let server = axum::serve(listener, router)
            .with_graceful_shutdown(token.clone().cancelled_owned())
            .into_future();
        let drained = async {
            token.cancelled().await;
            tokio::time::sleep(self.drain_timeout).await;
        };
        let served = tokio::select! {
            served = server => served,
            () = drained => {
                tracing::warn!(
                    drain_timeout = ?self.drain_timeout,
                    "requests still running after the drain timeout are dropped, and their transactions aborted"
                );
                Ok(())
            }
        };
        // Whatever ended the server, the dispatcher stops too.
        token.cancel();
        tracing::info!("server stopped; shutting the dispatcher down");
        let stopped = self.bus.shutdown().await;
        if let Some(signals) = signals {
            signals.abort();
        }
        served.map_err(ServeError::Io)?;
        stopped.map_err(ServeError::Start)?;
        tracing::info!("shut down");
        Ok(())
    }
}

/// Runs `router` on `listener` with the bus's dispatcher beside it, until SIGINT or SIGTERM:
/// [`DispatcherService::new(bus).serve(listener, router)`](DispatcherService::serve).
///
/// # Errors
///
/// As [`DispatcherService::serve`].
///
/// # Cancel safety
///
/// Not cancel safe, as [`DispatcherService::serve`]; this one stops on signals only.
pub async fn serve<S: Store>(
    bus: RelayBus<S>,
    listener: TcpListener,
    router: Router,
) -> Result<(), ServeError> {
    DispatcherService::new(bus).serve(listener, router).await
}

/// Why [`DispatcherService::serve`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The dispatcher could not start (the store's setup failed, or the bus was shut down
    /// already), or could not stop cleanly.
    #[error("the dispatcher failed: {0}")]
    Start(#[source] relaybus::Error),

    /// Accepting connections failed, or binding the listener did.
    #[error("the server failed: {0}")]
    Io(#[from] io::Error),
}

/// Cancels `token` on the first SIGINT or SIGTERM, and exits the process on the next one.
async fn watch_signals(token: CancellationToken) {
    let mut signals = Signals::new();
    let first = tokio::select! {
        signal = signals.next() => Some(signal),
        () = token.cancelled() => None,
    };
    if let Some(name) = first {
        tracing::info!(
            signal = name,
            "shutting down gracefully; send the signal again to exit at once"
        );
        token.cancel();
    }
    let name = signals.next().await;
    tracing::warn!(signal = name, "second signal: exiting now");
    std::process::exit(if name == "SIGTERM" { 143 } else { 130 });
}

/// SIGINT and SIGTERM, listened to from creation on, so none is missed between two waits.
struct Signals {
    #[cfg(unix)]
    streams: Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>,
}

impl Signals {
    fn new() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let streams = match (
                signal(SignalKind::interrupt()),
                signal(SignalKind::terminate()),
            ) {
                (Ok(interrupt), Ok(terminate)) => Some((interrupt, terminate)),
                _ => {
                    tracing::warn!("cannot watch SIGINT and SIGTERM; shut down with the token");
                    None
                }
            };
            Signals { streams }
        }
        #[cfg(not(unix))]
        Signals {}
    }

    /// The name of the next signal; never returns when signals cannot be watched.
    async fn next(&mut self) -> &'static str {
        #[cfg(unix)]
        {
            let Some((interrupt, terminate)) = &mut self.streams else {
                return std::future::pending().await;
            };
            tokio::select! {
                _ = interrupt.recv() => "SIGINT",
                _ = terminate.recv() => "SIGTERM",
            }
        }
        #[cfg(not(unix))]
        {
            match tokio::signal::ctrl_c().await {
                Ok(()) => "Ctrl-C",
                Err(_) => std::future::pending().await,
            }
        }
    }
}
