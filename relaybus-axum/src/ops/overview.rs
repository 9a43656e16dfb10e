//! The overview routes: counts by state, each handler, this process's runs, the schedules.

use axum::{Json, extract::State};
use relaybus::{RelayBus, Store};

use super::{
    error::OpsError,
    model::{ActivityAnswer, HandlerOverview, HandlersAnswer, SchedulesAnswer, StatisticsAnswer},
};

/// `GET /statistics`.
pub(super) async fn statistics<St: Store>(
    State(bus): State<RelayBus<St>>,
) -> Result<Json<StatisticsAnswer>, OpsError> {
    let stats = bus.store().statistics().await.map_err(OpsError::Store)?;
    Ok(Json(stats.into()))
}

/// `GET /handlers`: every handler this bus runs, and any other with deliveries in the store.
pub(super) async fn handlers<St: Store>(
    State(bus): State<RelayBus<St>>,
) -> Result<Json<HandlersAnswer>, OpsError> {
    let statistics = bus
        .store()
        .handler_statistics()
        .await
        .map_err(OpsError::Store)?;
    let activity = bus.activity();
    // A handler whose work has all finished has no statistics row, and is still worth seeing.
    let mut names: Vec<&str> = bus
        .subscriptions()
        .iter()
        .map(|subscription| subscription.id())
        .chain(statistics.iter().map(|h| h.handler.as_str()))
        .collect();
    names.sort_unstable();
    names.dedup();
    let now = bus.now();
    let handlers = names
        .into_iter()
        .map(|name| {
            HandlerOverview::new(
                name,
                statistics.iter().find(|h| h.handler == name),
                activity.iter().find(|h| h.handler == name),
                bus.subscriptions().iter().find(|s| s.id() == name),
                now,
            )
        })
        .collect();
    Ok(Json(HandlersAnswer { handlers }))
}

/// `GET /activity`: this process's runs of the last hour.
pub(super) async fn activity<St: Store>(State(bus): State<RelayBus<St>>) -> Json<ActivityAnswer> {
    Json(bus.activity().into())
}

/// `GET /schedules`.
pub(super) async fn schedules<St: Store>(
    State(bus): State<RelayBus<St>>,
) -> Result<Json<SchedulesAnswer>, OpsError> {
    let statuses = bus.schedule_statuses().await.map_err(OpsError::Store)?;
    Ok(Json(statuses.into()))
}
