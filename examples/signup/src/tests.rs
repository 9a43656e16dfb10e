//! The service on a scratch schema of the PostgreSQL at `RELAYBUS_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`): a signup commits the user and its event, and
//! `run_until_idle` runs the directory handler.

use axum::{
    body::Body,
    http::{Request, StatusCode},
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tower::ServiceExt;

use super::*;

#[tokio::test]
async fn a_signup_commits_the_user_and_the_directory_handler_adds_it() {
    let url = std::env::var("RELAYBUS_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let schema = format!("signup{}", std::process::id());
    let options: PgConnectOptions = url.parse().unwrap();
    let admin = PgPoolOptions::new()
        .connect_with(options.clone())
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {url} does not answer: {e}"));
    sqlx::raw_sql(&format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
    ))
    .execute(&admin)
    .await
    .unwrap();
    let pool = PgPoolOptions::new()
        .connect_with(options.options([("search_path", schema.as_str())]))
        .await
        .unwrap();
    create_tables(&pool).await.unwrap();
    let store = PostgresEventStore::builder(pool.clone())
        .schema(&schema)
        .build()
        .unwrap();
    store.setup().await.unwrap();
    let (bus, router) = app(store).unwrap();

    let signup = |email: &str| {
        Request::post("/signup")
            .header("content-type", "application/json")
            .body(Body::from(format!("{{\"email\": \"{email}\"}}")))
            .unwrap()
    };
    let created = router
        .clone()
        .oneshot(signup("ada@example.com"))
        .await
        .unwrap();
    assert_eq!(created.status(), StatusCode::CREATED);

    let report = bus.run_until_idle().await.unwrap();
    assert_eq!(report.succeeded().count(), 1, "{report:?}");
    let directory: Vec<String> = sqlx::query_scalar("SELECT email FROM directory")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(directory, ["ada@example.com"]);

    sqlx::raw_sql(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&admin)
        .await
        .unwrap();
}
