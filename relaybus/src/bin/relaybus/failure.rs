//! Why a command failed, and the exit code each reason gets: scripts rely on these.

use std::process::ExitCode;

/// The command did what it was asked.
pub(crate) const DONE: u8 = 0;
/// The store failed (unreachable, or an error of the database): nothing more is known of
/// what was written; running the command again is safe.
pub(crate) const STORE_FAILED: u8 = 1;
/// Bad input (an option, a URL, a handler, an id or a filter): nothing was written.
pub(crate) const BAD_INPUT: u8 = 2;
/// The run was not confirmed: nothing was written.
pub(crate) const NOT_CONFIRMED: u8 = 3;
/// Done in part: some of what was named was not there (an unknown event, delivery ids that
/// name no delivery in the state the command takes) or was left alone (a running delivery).
pub(crate) const PARTLY: u8 = 4;

/// Why a command stopped.
#[derive(Debug)]
pub(crate) enum Failure {
    /// Bad input: what is wrong, and what to do.
    BadInput(String),
    /// The store failed.
    Store(String),
    /// The run was not confirmed.
    NotConfirmed,
}

impl Failure {
    /// Prints one line on standard error and gives the exit code.
    pub(crate) fn report(self) -> ExitCode {
        let (message, code) = match self {
            Failure::BadInput(message) => (message, BAD_INPUT),
            Failure::Store(message) => (message, STORE_FAILED),
            Failure::NotConfirmed => (
                "not confirmed: nothing was changed (pass --yes to run without asking)".to_owned(),
                NOT_CONFIRMED,
            ),
        };
        eprintln!("relaybus: {}", message.replace('\n', " "));
        ExitCode::from(code)
    }
}

impl From<relaybus::Error> for Failure {
    fn from(error: relaybus::Error) -> Self {
        match error {
            relaybus::Error::Configuration(error) => Failure::BadInput(error.to_string()),
            relaybus::Error::InvalidArgument(error) => Failure::BadInput(error.to_string()),
            error => Failure::Store(format!("the store failed: {error}")),
        }
    }
}

/// Bad input, as a result.
pub(crate) fn bad<T>(message: impl Into<String>) -> Result<T, Failure> {
    Err(Failure::BadInput(message.into()))
}

/// A command line clap refused (exit 2, one line), or help and version (exit 0).
pub(crate) fn usage(error: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    let message = match error.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = error.print();
            return ExitCode::from(DONE);
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand | ErrorKind::MissingSubcommand => {
            "no command given: use setup, stats, list, show, lanes, requeue, discard, bury, \
             purge or tail"
                .to_owned()
        }
        _ => {
            let rendered = error.render().to_string();
            rendered
                .lines()
                .find(|line| !line.trim().is_empty())
                .unwrap_or("bad arguments")
                .trim_start_matches("error: ")
                .to_owned()
        }
    };
    eprintln!("relaybus: {message} (see relaybus --help)");
    ExitCode::from(BAD_INPUT)
}
