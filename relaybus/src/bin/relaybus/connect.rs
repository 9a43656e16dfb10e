//! The store the global options name, and the command run on it.

use std::{process::ExitCode, time::Duration};

use relaybus::{MongoEventStore, PostgresEventStore};

use crate::{
    commands,
    failure::{Failure, bad},
    options::Cli,
};

/// How long a first contact with the server may take before the command gives up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Connects to the store of `--url` and runs the command on it.
pub(crate) async fn run(cli: Cli) -> Result<ExitCode, Failure> {
    let Some(url) = cli.url.clone() else {
        return bad(
            "no store given: pass --url mongodb://… or --url postgres://… (or set RELAYBUS_URL)",
        );
    };
    let scheme = url.split_once("://").map(|(scheme, _)| scheme);
    match scheme {
        Some("mongodb" | "mongodb+srv") => {
            let store = mongo(&cli, &url).await?;
            commands::run(store, cli).await
        }
        Some("postgres" | "postgresql") => {
            let store = postgres(&cli, &url).await?;
            commands::run(store, cli).await
        }
        _ => bad(format!(
            "--url {:?} names no store: give mongodb://host/… or postgres://user@host/database",
            redacted(&url)
        )),
    }
}

async fn mongo(cli: &Cli, url: &str) -> Result<MongoEventStore, Failure> {
    if cli.schema.is_some() {
        return bad(
            "--schema is for PostgreSQL; a MongoDB store is named by --database and --prefix",
        );
    }
    let mut options = mongodb::options::ClientOptions::parse(url)
        .await
        .map_err(|e| {
            Failure::BadInput(format!(
                "--url {:?} is not a MongoDB connection string: {e}",
                redacted(url)
            ))
        })?;
    let Some(database) = cli.database.clone().or(options.default_database.clone()) else {
        return bad(
            "no MongoDB database given: pass --database NAME (or name it in the URL's path)",
        );
    };
    options
        .app_name
        .get_or_insert_with(|| "relaybus-cli".to_owned());
    options
        .server_selection_timeout
        .get_or_insert(CONNECT_TIMEOUT);
    options.connect_timeout.get_or_insert(CONNECT_TIMEOUT);
    let client = mongodb::Client::with_options(options)
        .map_err(|e| Failure::BadInput(format!("--url {:?}: {e}", redacted(url))))?;
    let mut builder = MongoEventStore::builder(client.clone())
        .database(database)
        .completion_history(cli.completion_history);
    if let Some(prefix) = &cli.prefix {
        builder = builder.collection_prefix(prefix.clone());
    }
    let store = builder
        .build()
        .map_err(|e| Failure::BadInput(e.to_string()))?;
    client
        .database("admin")
        .run_command(mongodb::bson::doc! { "ping": 1 })
        .await
        .map_err(|e| {
            Failure::Store(format!(
                "cannot reach MongoDB at {}: {e}; check --url and that the server runs",
                redacted(url)
            ))
        })?;
    Ok(store)
}

async fn postgres(cli: &Cli, url: &str) -> Result<PostgresEventStore, Failure> {
    if cli.database.is_some() || cli.prefix.is_some() {
        return bad(
            "--database and --prefix are for MongoDB; a PostgreSQL store is named by the URL's \
             database and --schema",
        );
    }
    let options: sqlx::postgres::PgConnectOptions = url.parse().map_err(|e| {
        Failure::BadInput(format!(
            "--url {:?} is not a PostgreSQL URL: {e}",
            redacted(url)
        ))
    })?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(CONNECT_TIMEOUT)
        .connect_with(options)
        .await
        .map_err(|e| {
            Failure::Store(format!(
                "cannot connect to PostgreSQL at {}: {e}; check --url and that the server runs",
                redacted(url)
            ))
        })?;
    let mut builder = PostgresEventStore::builder(pool).completion_history(cli.completion_history);
    if let Some(schema) = &cli.schema {
        builder = builder.schema(schema.clone());
    }
    builder
        .build()
        .map_err(|e| Failure::BadInput(e.to_string()))
}

/// `url` without its password, for messages.
fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((credentials, host)) => {
            let user = credentials.split(':').next().unwrap_or_default();
            let hidden = if credentials.contains(':') {
                ":***"
            } else {
                ""
            };
            format!("{scheme}://{user}{hidden}@{host}{path}")
        }
        None => url.to_owned(),
    }
}
