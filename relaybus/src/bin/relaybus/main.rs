//! `relaybus`: an operator's command line for a relaybus store, on MongoDB or PostgreSQL.
//!
//! See the operations guide (`docs/cli.md`) for the commands, their output and exit codes.

mod commands;
mod connect;
mod failure;
mod options;
mod output;
mod selection;
mod time;

use std::process::ExitCode;

use clap::Parser;

use crate::{failure::Failure, options::Cli};

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => return failure::usage(error),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            return Failure::Store(format!("cannot start the async runtime: {error}")).report();
        }
    };
    match runtime.block_on(connect::run(cli)) {
        Ok(code) => code,
        Err(failure) => failure.report(),
    }
}
