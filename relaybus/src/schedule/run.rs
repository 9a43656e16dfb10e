//! Publishing the ticks of a bus's schedules: on demand, and in the background of a started
//! bus.

use std::{sync::Mutex as StdMutex, time::Duration};

use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::{Cadence, MissedTicks, Schedule, Tick};
use crate::{
    bus::RelayBus,
    error::{Error, Result},
    event::EventEnvelope,
    store::Store,
    time::Timestamp,
};

/// How many ticks back the operator view looks for the last published one.
const LAST_TICK_LOOKUPS: usize = 16;
/// The longest a started bus sleeps between two looks at its schedules, so that a clock set
/// forward or a failed publish is noticed.
const MAX_SLEEP: Duration = Duration::from_secs(60);

/// A bus's schedules, checked, with up to when this bus has looked at each.
#[derive(Debug)]
pub(crate) struct Schedules {
    list: Vec<(Schedule, Cadence)>,
    /// Per schedule, the time up to which this bus published its ticks; `None` before the first
    /// look, which then goes back over the catch-up window.
    looked: StdMutex<Vec<Option<Timestamp>>>,
}

impl Schedules {
    /// Checks the schedules: each valid, no id twice. `completed`: how long the bus keeps
    /// completed events, if it purges them.
    pub(crate) fn new(
        schedules: Vec<Schedule>,
        completed: Option<Duration>,
    ) -> Result<Self, crate::ConfigurationError> {
        let mut list: Vec<(Schedule, Cadence)> = Vec::with_capacity(schedules.len());
        for schedule in schedules {
            if let Some((first, _)) = list.iter().find(|(s, _)| s.id == schedule.id) {
                return Err(crate::ConfigurationError::DuplicateScheduleId {
                    id: schedule.id.clone(),
                    first: format!("{} publishing {}", first.describe(), first.event_type),
                    second: format!("{} publishing {}", schedule.describe(), schedule.event_type),
                });
            }
            let cadence = schedule.compile(completed)?;
            list.push((schedule, cadence));
        }
        let looked = StdMutex::new(vec![None; list.len()]);
        Ok(Schedules { list, looked })
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    pub(crate) fn schedules(&self) -> impl Iterator<Item = &Schedule> {
        self.list.iter().map(|(schedule, _)| schedule)
    }

    fn looked(&self) -> std::sync::MutexGuard<'_, Vec<Option<Timestamp>>> {
        self.looked.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The ticks of schedule `index` to publish at `now`: those since this bus last looked
    /// (or within the catch-up window), as many of the latest as the missed-ticks policy takes.
    fn due(&self, index: usize, now: Timestamp) -> Vec<Timestamp> {
        let (schedule, cadence) = &self.list[index];
        let window_start = now.saturating_sub(schedule.catch_up);
        let after = self.looked()[index].map_or(window_start, |looked| looked.max(window_start));
        cadence.ticks(after, now, schedule.missed.limit())
    }

    /// The earliest next tick of any schedule after `now`.
    fn next_tick(&self, now: Timestamp) -> Option<Timestamp> {
        self.list
            .iter()
            .filter_map(|(_, cadence)| cadence.next_after(now))
            .min()
    }
}

/// What one [`RelayBus::publish_ticks`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TickReport {
    /// The ticks this bus appended, oldest first per schedule.
    pub ticks: Vec<PublishedTick>,
    /// When the next tick of any of the bus's schedules is due.
    pub next_tick: Option<Timestamp>,
}

impl TickReport {
    /// How many ticks this call published: events the store did not hold before.
    pub fn created(&self) -> usize {
        self.ticks.iter().filter(|tick| tick.created).count()
    }
}

/// A tick a bus appended.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PublishedTick {
    /// The schedule id.
    pub schedule: String,
    /// When the tick was due.
    pub at: Timestamp,
    /// The event id.
    pub event_id: String,
    /// Whether this append made the event; `false` when another bus (or an earlier run of
    /// this one) had published the tick already.
    pub created: bool,
}

/// A schedule as the operator page shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ScheduleStatus {
    /// The schedule id.
    pub id: String,
    /// The type name of the events it publishes.
    pub event_type: String,
    /// When it ticks, in words ([`Schedule::describe`]).
    pub cadence: String,
    /// Its missed-ticks policy.
    pub missed: MissedTicks,
    /// The latest tick whose event the store holds, looking back over the last 16 ticks
    /// within the catch-up window; `None` when none of them was published.
    pub last_tick: Option<Timestamp>,
    /// The next tick.
    pub next_tick: Option<Timestamp>,
}

impl<S: Store> RelayBus<S> {
    /// Publishes the ticks of the bus's schedules that are due on its clock and that it has
    /// not published yet: those since its last call, and on the first call those the
    /// missed-ticks policy picks within each schedule's catch-up window (see
    /// [`schedule`](mod@crate::schedule)). A tick another bus published already is absorbed
    /// ([`PublishedTick::created`] is `false`). A started bus does this on its own, when each
    /// tick comes; call it in tests with a [`TestClock`](crate::clock::TestClock).
    ///
    /// Each schedule's ticks are appended in one transaction of their own.
    ///
    /// # Errors
    ///
    /// The first error of a schedule's publish: the store's errors, or
    /// [`Error::EventValidation`] for an event the schedule's function made that cannot be
    /// stored. The other schedules are published all the same; a schedule whose append failed
    /// is tried again at the next call, one whose event is invalid is not (its ticks up to now
    /// are skipped, and logged).
    pub async fn publish_ticks(&self) -> Result<TickReport> {
        let schedules = self.schedules_state();
        let mut report = TickReport::default();
        let mut first_error: Option<Error> = None;
        for index in 0..schedules.list.len() {
            let now = self.now();
            let due = schedules.due(index, now);
            let schedule = &schedules.list[index].0;
            if due.is_empty() {
                schedules.looked()[index] = Some(now);
                continue;
            }
            let envelopes: Result<Vec<EventEnvelope>, _> = due
                .iter()
                .map(|at| schedule.envelope(&Tick::new(&schedule.id, *at)))
                .collect();
            let envelopes = match envelopes {
                Ok(envelopes) => envelopes
                    .into_iter()
                    .map(|envelope| envelope.made_at(now))
                    .collect::<Vec<_>>(),
                Err(error) => {
                    warn!(schedule = %schedule.id, %error, "the schedule's event cannot be stored; its ticks up to now are skipped");
                    schedules.looked()[index] = Some(now);
                    first_error.get_or_insert(error.into());
                    continue;
                }
            };
            match self.publish_all(envelopes).await {
                Ok(appended) => {
                    schedules.looked()[index] = Some(now);
                    for (at, appended) in due.iter().zip(appended) {
                        debug!(schedule = %schedule.id, tick = %at, created = appended.created, "tick appended");
                        report.ticks.push(PublishedTick {
                            schedule: schedule.id.clone(),
                            at: *at,
                            event_id: appended.event_id,
                            created: appended.created,
                        });
                    }
                }
                Err(error) => {
                    first_error.get_or_insert(error);
                }
            }
        }
        report.next_tick = schedules.next_tick(self.now());
        match first_error {
            Some(error) => Err(error),
            None => Ok(report),
        }
    }

    /// The bus's schedules with their last and next ticks, as the operator page lists them.
    /// The last tick is looked up in the store, so it is the same whichever bus published it.
    ///
    /// # Errors
    ///
    /// The store's errors.
    pub async fn schedule_statuses(&self) -> Result<Vec<ScheduleStatus>> {
        let now = self.now();
        let mut statuses = Vec::new();
        for (schedule, cadence) in &self.schedules_state().list {
            let candidates = cadence.ticks(
                now.saturating_sub(schedule.catch_up),
                now,
                LAST_TICK_LOOKUPS,
            );
            let mut last_tick = None;
            for at in candidates.into_iter().rev() {
                let id = Tick::new(&schedule.id, at).event_id();
                if self.store().event_detail(&id).await?.is_some() {
                    last_tick = Some(at);
                    break;
                }
            }
            statuses.push(ScheduleStatus {
                id: schedule.id.clone(),
                event_type: schedule.event_type.to_owned(),
                cadence: schedule.describe(),
                missed: schedule.missed,
                last_tick,
                next_tick: cadence.next_after(now),
            });
        }
        Ok(statuses)
    }
}

/// Publishes the bus's ticks as they come, until `cancel`. Holds the bus weakly: a bus
/// dropped without shutdown stops it.
pub(crate) async fn publish_periodically<S: Store>(
    bus: std::sync::Weak<crate::bus::BusInner<S>>,
    poll_interval: Duration,
    cancel: CancellationToken,
) {
    loop {
        let Some(bus) = RelayBus::upgrade(&bus) else {
            return;
        };
        let wait = match bus.publish_ticks().await {
            Ok(report) => {
                let now = bus.now();
                let until_next = report
                    .next_tick
                    .map_or(MAX_SLEEP, |next| next.duration_since(now));
                // A test clock moves on its own: look again at the poll interval at least.
                let until_next = if bus.clock().as_test().is_some() {
                    until_next.min(poll_interval)
                } else {
                    until_next
                };
                until_next.clamp(Duration::from_millis(1), MAX_SLEEP)
            }
            Err(error) => {
                warn!(%error, "publishing scheduled ticks failed; trying again after the poll interval");
                poll_interval
            }
        };
        drop(bus);
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}
