//! Running a bus step by step until nothing is due: [`RelayBus::run_until_idle`].

use std::{
    future::{Future, IntoFuture},
    pin::Pin,
    time::Duration,
};

use super::{DispatcherState, RelayBus};
use crate::{
    dispatcher::{DEFAULT_MAX_RUNS, IdleOptions, IdleReport},
    error::{ConfigurationError, Result},
    store::{DefaultStore, Store},
};

impl<S: Store> RelayBus<S> {
    /// Runs every delivery of this bus's handlers that is due, batch after batch, until a
    /// claim finds nothing due, and reports every run: what succeeded, what failed and when it
    /// is due again, and what became a dead letter. Deliveries that become due while it runs
    /// (the next event of a key, events the handlers publish, retries whose backoff has passed
    /// on the bus's clock) run too.
    ///
    /// For tests: with a [`TestClock`](crate::clock::TestClock),
    /// [`advance_clock(within)`](RunUntilIdle::advance_clock) also moves the clock to each
    /// retry or delayed delivery due within `within`, so a handler that fails twice and then
    /// succeeds runs to its success in one call, with no sleep.
    ///
    /// ```no_run
    /// # use relaybus::{RelayBus, Store};
    /// # async fn example<S: Store>(bus: RelayBus<S>) -> Result<(), relaybus::Error> {
    /// use std::time::Duration;
    ///
    /// let report = bus.run_until_idle().advance_clock(Duration::from_secs(3600)).await?;
    /// assert_eq!(report.dead().count(), 0);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`ConfigurationError::InvalidOption`] when the bus dispatches in the background
    /// (after [`start`](Self::start)), or when `advance_clock` is asked of a bus on the system
    /// clock; [`Error::InvalidArgument`](crate::Error::InvalidArgument) when it ran more than
    /// [`max_runs`](RunUntilIdle::max_runs) deliveries ([`DEFAULT_MAX_RUNS`]
    /// by default) without becoming idle; the store's errors. The handlers' own errors are in
    /// the report.
    pub fn run_until_idle(&self) -> RunUntilIdle<'_, S> {
        RunUntilIdle {
            bus: self,
            options: IdleOptions {
                advance: None,
                max_runs: DEFAULT_MAX_RUNS,
            },
        }
    }
}

/// A pending [`RelayBus::run_until_idle`]. Runs when awaited.
#[must_use = "running until idle does nothing until it is awaited"]
pub struct RunUntilIdle<'a, S: Store = DefaultStore> {
    bus: &'a RelayBus<S>,
    options: IdleOptions,
}

impl<S: Store> std::fmt::Debug for RunUntilIdle<'_, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunUntilIdle")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<S: Store> RunUntilIdle<'_, S> {
    /// Once nothing is due, moves the bus's [`TestClock`](crate::clock::TestClock) to the
    /// next due time of a delivery of its handlers (a retry after its backoff, a delayed
    /// publish), if it lies within `within` of the clock's time when the call started, and
    /// goes on running. The clock ends at the last due time it moved to.
    pub fn advance_clock(mut self, within: Duration) -> Self {
        self.options.advance = Some(within);
        self
    }

    /// Stops with an error after this many runs, rather than running on forever when handlers
    /// keep making new work; [`DEFAULT_MAX_RUNS`] by default.
    pub fn max_runs(mut self, runs: usize) -> Self {
        self.options.max_runs = runs.max(1);
        self
    }
}

impl<'a, S: Store> IntoFuture for RunUntilIdle<'a, S> {
    type Output = Result<IdleReport>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send + 'a>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(async move {
            {
                let state = self.bus.inner.dispatcher.lock().await;
                if matches!(*state, DispatcherState::Running(_)) {
                    return Err(ConfigurationError::InvalidOption {
                        option: "run_until_idle",
                        reason: "the bus dispatches in the background (`start` was called), \
                                 which would run the same deliveries; run a bus that is not \
                                 started step by step"
                            .to_owned(),
                    }
                    .into());
                }
            }
            self.bus.inner.shared.run_until_idle(self.options).await
        })
    }
}
