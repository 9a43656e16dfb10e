//! The commands, each generic over the store.

mod lanes;
mod list;
mod purge;
mod setup;
mod show;
mod stats;
mod tail;
mod write;

use std::process::ExitCode;

use relaybus::store::Administration;

use crate::{
    failure::Failure,
    options::{Cli, Command},
};

/// Runs the command of `cli` on `store`.
pub(crate) async fn run<S: Administration>(store: S, cli: Cli) -> Result<ExitCode, Failure> {
    let json = cli.json;
    match cli.command {
        Command::Setup { dry_run } => setup::run(&store, json, dry_run).await,
        Command::Stats => stats::run(&store, json).await,
        Command::List(args) => list::run(&store, json, &args).await,
        Command::Show { event_id } => show::run(&store, json, &event_id).await,
        Command::Lanes { all } => lanes::run(&store, json, all).await,
        Command::Requeue(args) => write::run(&store, json, write::Write::Requeue, &args).await,
        Command::Discard(args) => write::run(&store, json, write::Write::Discard, &args).await,
        Command::Bury {
            write: args,
            reason,
        } => write::run(&store, json, write::Write::Bury(reason), &args).await,
        Command::Purge(args) => purge::run(&store, json, &args).await,
        Command::Tail { handler } => tail::run(&store, json, &handler).await,
    }
}
