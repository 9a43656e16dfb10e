//! Running a bus step by step until nothing is due: [`RelayBus::run_until_idle`](crate::RelayBus::run_until_idle)
//! and its report.

use std::time::Duration;

use futures::future::join_all;

use super::{Outcome, Shared, run::Settled, run_delivery};
use crate::{
    error::{ConfigurationError, Error, InvalidArgumentError, Result},
    store::{DeliveryQuery, PendingState, Store},
    time::Timestamp,
};

/// The most deliveries one [`RelayBus::run_until_idle`](crate::RelayBus::run_until_idle) runs
/// unless told otherwise.
pub const DEFAULT_MAX_RUNS: usize = 10_000;

/// How one run of a delivery ended, in an [`IdleReport`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RunOutcome {
    /// The handler succeeded and the delivery completed.
    Succeeded,
    /// The handler failed; the delivery runs again at `due_at`.
    Retried {
        /// What the handler's error said.
        error: String,
        /// When it is due again: after the backoff, on the bus's clock.
        due_at: Timestamp,
    },
    /// The handler failed for the last time, or for good
    /// ([`Permanent`](crate::Permanent)): the delivery is a dead letter.
    Dead {
        /// What the handler's error said.
        error: String,
    },
    /// The delivery was given back without charging an attempt: its transactional handler's
    /// transaction kept failing with transient errors, or could not start.
    Released,
    /// The delivery's lease ended before the run could settle it (another claim decides), or
    /// the store could not settle it: it runs again once its lease ends.
    Lost,
}

impl From<Settled> for RunOutcome {
    fn from(settled: Settled) -> Self {
        match settled {
            Settled::Retried { error, due_at } => RunOutcome::Retried { error, due_at },
            Settled::Buried { error } => RunOutcome::Dead { error },
            Settled::Released => RunOutcome::Released,
            Settled::Lost => RunOutcome::Lost,
        }
    }
}

/// One run of one delivery: which event, which handler, which attempt, and how it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeliveryRun {
    /// The event id.
    pub event_id: String,
    /// The event type name.
    pub event_type: String,
    /// The event's ordering key, if any.
    pub key: Option<String>,
    /// The event's sequence within its key, if keyed.
    pub sequence: Option<i64>,
    /// The handler that ran.
    pub handler: String,
    /// Which attempt it was, from 1.
    pub attempt: u32,
    /// How it ended.
    pub outcome: RunOutcome,
    /// When it ended, on the bus's clock.
    pub finished_at: Timestamp,
}

impl DeliveryRun {
    /// Whether the handler succeeded.
    pub fn succeeded(&self) -> bool {
        self.outcome == RunOutcome::Succeeded
    }

    /// The handler's error, when the attempt failed.
    pub fn error(&self) -> Option<&str> {
        match &self.outcome {
            RunOutcome::Retried { error, .. } | RunOutcome::Dead { error } => Some(error),
            _ => None,
        }
    }
}

/// What [`RelayBus::run_until_idle`](crate::RelayBus::run_until_idle) did: every delivery run,
/// in the order the runs ended.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct IdleReport {
    /// The runs, in the order they ended (the runs of one batch, which run concurrently, in
    /// claim order).
    pub runs: Vec<DeliveryRun>,
    /// The bus's clock when the bus became idle.
    pub now: Timestamp,
    /// When the next delivery of the bus's handlers is due, if one is scheduled: a retry after
    /// its backoff, or a delayed publish. Move a test clock there to run it.
    pub next_due_at: Option<Timestamp>,
}

impl IdleReport {
    /// The runs whose handler succeeded.
    pub fn succeeded(&self) -> impl Iterator<Item = &DeliveryRun> {
        self.runs.iter().filter(|run| run.succeeded())
    }

    /// The runs whose handler failed (retried later, or dead).
    pub fn failed(&self) -> impl Iterator<Item = &DeliveryRun> {
        self.runs.iter().filter(|run| run.error().is_some())
    }

    /// The runs that made a dead letter.
    pub fn dead(&self) -> impl Iterator<Item = &DeliveryRun> {
        self.runs
            .iter()
            .filter(|run| matches!(run.outcome, RunOutcome::Dead { .. }))
    }

    /// The runs of one handler.
    pub fn of_handler<'a>(&'a self, handler: &'a str) -> impl Iterator<Item = &'a DeliveryRun> {
        self.runs.iter().filter(move |run| run.handler == handler)
    }
}

/// The options of one [`RelayBus::run_until_idle`](crate::RelayBus::run_until_idle).
#[derive(Debug, Clone, Copy)]
pub(crate) struct IdleOptions {
    /// Move the test clock to each next due time up to this far ahead.
    pub(crate) advance: Option<Duration>,
    /// Stop with an error after this many runs.
    pub(crate) max_runs: usize,
}

impl<S: Store> Shared<S> {
    /// One claim, its handlers run concurrently, successes completed in one call; every run
    /// with its outcome.
    pub(crate) async fn run_batch(&self) -> Result<Vec<DeliveryRun>> {
        if self.handler_ids.is_empty() {
            return Ok(Vec::new());
        }
        let claimed = self.claim(self.settings.batch_size).await?;
        let mut runs: Vec<DeliveryRun> = claimed
            .iter()
            .map(|delivery| DeliveryRun {
                event_id: delivery.event.id().to_owned(),
                event_type: delivery.event.event_type().to_owned(),
                key: delivery.event.key().map(str::to_owned),
                sequence: delivery.sequence,
                handler: delivery.handler.clone(),
                attempt: delivery.attempt,
                outcome: RunOutcome::Lost,
                finished_at: Timestamp::EPOCH,
            })
            .collect();
        // Batch handlers' deliveries run in batches of their handler (in claim order, up to
        // its most per batch), the others one by one, all at once.
        let mut singles = Vec::new();
        let mut batches: Vec<(String, Vec<usize>)> = Vec::new();
        for (at, delivery) in claimed.iter().enumerate() {
            match self
                .subscriptions
                .get(&delivery.handler)
                .and_then(|s| s.batch.as_ref())
            {
                Some(spec) => match batches
                    .iter_mut()
                    .find(|(h, ats)| *h == delivery.handler && ats.len() < spec.max)
                {
                    Some((_, ats)) => ats.push(at),
                    None => batches.push((delivery.handler.clone(), vec![at])),
                },
                None => singles.push(at),
            }
        }
        let never = tokio_util::sync::CancellationToken::new();
        let claimed = &claimed;
        let single_runs = join_all(singles.iter().map(|&at| {
            let never = &never;
            async move {
                let delivery = claimed[at].clone();
                let handler = delivery.handler.clone();
                // The bus never stops here: each delivery passes its handler's limits,
                // waiting for other buses as long as it takes.
                let partition = self.gates.partition(&handler, delivery.event.payload());
                let admission = self.admit(&handler, partition, never).await;
                let outcome = run_delivery(self, delivery).await;
                if let Some(admission) = admission {
                    self.give_back(&handler, admission).await;
                }
                vec![(at, outcome)]
            }
        }));
        let batch_runs = join_all(batches.iter().map(|(handler, ats)| async move {
            let deliveries: Vec<_> = ats.iter().map(|&at| claimed[at].clone()).collect();
            let outcomes = match self.subscriptions.get(handler) {
                Some(subscription) => {
                    super::batch::run_batch_deliveries(self, subscription, &deliveries).await
                }
                None => Vec::new(),
            };
            ats.iter().copied().zip(outcomes).collect::<Vec<_>>()
        }));
        let (single_runs, batch_runs) = futures::join!(single_runs, batch_runs);
        let mut outcomes: Vec<(usize, Outcome<S::Lease>)> = single_runs
            .into_iter()
            .chain(batch_runs)
            .flatten()
            .collect();
        outcomes.sort_by_key(|(at, _)| *at);
        let mut succeeded: Vec<(usize, S::Lease)> = Vec::new();
        for (at, outcome) in outcomes {
            match outcome {
                Outcome::Succeeded(lease) => succeeded.push((at, lease)),
                Outcome::Completed => runs[at].outcome = RunOutcome::Succeeded,
                Outcome::Settled(settled) => runs[at].outcome = settled.into(),
            }
        }
        if !succeeded.is_empty() {
            let leases: Vec<S::Lease> = succeeded.iter().map(|(_, l)| l.clone()).collect();
            let completed = self.complete(&leases).await?;
            for ((at, _), completed) in succeeded.iter().zip(completed) {
                runs[*at].outcome = if completed {
                    RunOutcome::Succeeded
                } else {
                    RunOutcome::Lost
                };
            }
        }
        let now = self.now();
        for run in &mut runs {
            run.finished_at = now;
        }
        Ok(runs)
    }

    /// Runs batches until a claim finds nothing due; with `options.advance`, moves the test
    /// clock to the next due time within it and goes on.
    pub(crate) async fn run_until_idle(&self, options: IdleOptions) -> Result<IdleReport> {
        let test_clock = match options.advance {
            Some(_) => Some(self.settings.clock.as_test().ok_or_else(|| {
                ConfigurationError::InvalidOption {
                    option: "advance_clock",
                    reason: "the bus runs on the system clock, which only time moves; build it \
                             with `.clock(relaybus::clock::TestClock::new(..))` to move time in \
                             a test"
                        .to_owned(),
                }
            })?),
            None => None,
        };
        let horizon = options
            .advance
            .map(|within| self.now().saturating_add(within));
        let mut runs = Vec::new();
        loop {
            let batch = self.run_batch().await?;
            if batch.is_empty() {
                let next = self.next_due_at().await?;
                match (test_clock, horizon, next) {
                    (Some(clock), Some(horizon), Some(next)) if next <= horizon => {
                        clock.advance_to(next);
                        continue;
                    }
                    _ => {
                        return Ok(IdleReport {
                            runs,
                            now: self.now(),
                            next_due_at: next,
                        });
                    }
                }
            }
            runs.extend(batch);
            if runs.len() >= options.max_runs {
                return Err(Error::InvalidArgument(InvalidArgumentError::new(
                    "max_runs",
                    format!(
                        "the bus was not idle after {} deliveries ran (do the handlers keep \
                         publishing new work, or a delivery keep failing?); look at the \
                         report of a smaller run, or raise the limit with `.max_runs(n)`",
                        runs.len()
                    ),
                )));
            }
        }
    }

    /// The earliest due time after now of a waiting delivery of this bus's handlers.
    async fn next_due_at(&self) -> Result<Option<Timestamp>> {
        let now = self.now();
        let mut next: Option<Timestamp> = None;
        for handler in &self.handler_ids {
            let mut query = DeliveryQuery::new()
                .handler(handler.clone())
                .pending_state(PendingState::Waiting)
                .limit(1_000);
            loop {
                let page = self.store.list_deliveries(&query).await?;
                for due in page.iter().filter_map(|record| record.due_at) {
                    if due > now && next.is_none_or(|next| due < next) {
                        next = Some(due);
                    }
                }
                match page.last() {
                    Some(last) if page.len() == 1_000 => query = query.after(last.id.clone()),
                    _ => break,
                }
            }
        }
        Ok(next)
    }
}
