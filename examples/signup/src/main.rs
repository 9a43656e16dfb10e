//! Serves the signup service on `127.0.0.1:3000` (`SIGNUP_ADDR`), with PostgreSQL at
//! `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`).

use example_signup::{app, create_tables};
use relaybus::PostgresEventStore;
use relaybus_axum::DispatcherService;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt().init();
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let pool = sqlx::PgPool::connect(&url).await?;
    create_tables(&pool).await?;
    let store = PostgresEventStore::builder(pool)
        .schema("relaybus")
        .build()?;
    let (bus, router) = app(store)?;
    let address = std::env::var("SIGNUP_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&address).await?;
    println!("signup serving on http://{address}; POST /signup {{\"email\": ..}}");
    // Sets the store up, dispatches beside the server, stops both on SIGINT or SIGTERM.
    DispatcherService::new(bus).serve(listener, router).await?;
    Ok(())
}
