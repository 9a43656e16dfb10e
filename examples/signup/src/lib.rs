//! A signup service on PostgreSQL: a route writes a user and publishes `user.registered.v1` in
//! the request's transaction, and a transactional handler adds the user to a directory in the
//! transaction that completes its delivery.

use axum::{Json, Router, http::StatusCode, routing::post};
use relaybus::{
    BoxError, PostgresEventStore,
    postgres::{Bus, Context},
};
use relaybus_axum::{PublishError, ops::NestOps, postgres::Publisher};
use serde::{Deserialize, Serialize};

/// A user registered.
#[relaybus::event("user.registered.v1")]
#[derive(Debug, Serialize, Deserialize)]
pub struct UserRegistered {
    /// The new user's id.
    pub user_id: i64,
    /// Their email address.
    pub email: String,
}

/// Adds the user to the directory; transactional, so the row is written once.
#[relaybus::handler(id = "directory", transactional)]
pub async fn add_to_directory(event: UserRegistered, ctx: Context) -> Result<(), BoxError> {
    let mut session = ctx.session().await?;
    sqlx::query("INSERT INTO directory (user_id, email) VALUES ($1, $2)")
        .bind(event.user_id)
        .bind(&event.email)
        .execute(&mut *session)
        .await?;
    Ok(())
}

/// The body of `POST /signup`.
#[derive(Debug, Deserialize)]
pub struct Signup {
    /// The address to register.
    pub email: String,
}

/// Writes the user and publishes its event in the request's transaction.
pub async fn sign_up(
    mut publisher: Publisher,
    Json(signup): Json<Signup>,
) -> Result<StatusCode, PublishError> {
    let (user_id,): (i64,) = sqlx::query_as("INSERT INTO users (email) VALUES ($1) RETURNING id")
        .bind(&signup.email)
        .fetch_one(publisher.session())
        .await?;
    publisher
        .publish(&UserRegistered {
            user_id,
            email: signup.email,
        })
        .key(user_id.to_string())
        .await?;
    Ok(StatusCode::CREATED)
}

/// The service's own tables, in the connections' schema.
pub async fn create_tables(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(
        "SET client_min_messages = warning;
         CREATE TABLE IF NOT EXISTS users (id bigserial PRIMARY KEY, email text NOT NULL);
         CREATE TABLE IF NOT EXISTS directory (user_id bigint PRIMARY KEY, email text NOT NULL);
         RESET client_min_messages;",
    )
    .execute(pool)
    .await
    .map(|_| ())
}

/// The bus of every registered handler, and the router of the service with the operator
/// routes at `/ops`.
pub fn app(store: PostgresEventStore) -> Result<(Bus, Router), relaybus::ConfigurationError> {
    let bus = Bus::builder(store).build()?;
    let (state, layer) = relaybus_axum::setup(bus.clone())?;
    let router = Router::new()
        .route("/signup", post(sign_up))
        .layer(layer)
        .with_state(state)
        .nest_ops("/ops", relaybus_axum::ops::router(bus.clone()));
    Ok((bus, router))
}

#[cfg(test)]
mod tests;
