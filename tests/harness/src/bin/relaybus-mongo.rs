//! `relaybus-mongo`: local MongoDB replica sets for development and
//! `scripts/test`. Run it through `scripts/mongo`, which installs `mongod`
//! first; `relaybus-mongo --help` lists the commands.

fn main() -> std::process::ExitCode {
    relaybus_harness::cli::main()
}
