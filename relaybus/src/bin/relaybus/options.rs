//! The command line: global options and commands.

use clap::{Args, Parser, Subcommand, ValueEnum};

/// An operator's command line for a relaybus store: set it up, count and list deliveries, open
/// an event, requeue, discard or bury deliveries, purge, and follow new deliveries.
///
/// Exit codes: 0 done; 1 the store failed; 2 bad input, nothing written; 3 not confirmed,
/// nothing written; 4 done in part (something named was not found or was left alone).
#[derive(Debug, Parser)]
#[command(name = "relaybus", version)]
pub(crate) struct Cli {
    /// The store: mongodb://… (or mongodb+srv://…) or postgres://….
    #[arg(long, env = "RELAYBUS_URL", global = true, hide_env_values = true)]
    pub(crate) url: Option<String>,

    /// MongoDB: the database of the store (else the URL's default database).
    #[arg(long, env = "RELAYBUS_DATABASE", global = true)]
    pub(crate) database: Option<String>,

    /// MongoDB: the prefix of the store's collections.
    #[arg(long, env = "RELAYBUS_PREFIX", global = true)]
    pub(crate) prefix: Option<String>,

    /// PostgreSQL: the schema of the store's tables.
    #[arg(long, env = "RELAYBUS_SCHEMA", global = true)]
    pub(crate) schema: Option<String>,

    /// The store keeps completion records (as the services using it are configured).
    #[arg(long, env = "RELAYBUS_COMPLETION_HISTORY", global = true)]
    pub(crate) completion_history: bool,

    /// One JSON object per line, for scripts, instead of tables.
    #[arg(long, global = true)]
    pub(crate) json: bool,

    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Creates or upgrades the store's collections, tables and indexes.
    Setup {
        /// Print what it would do, and do nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Counts deliveries per handler: waiting, running, parked, dead, oldest due.
    Stats,
    /// Lists deliveries, oldest first, a page at a time.
    List(ListArgs),
    /// Shows an event and every delivery of it with its error history.
    Show {
        /// The event id.
        event_id: String,
    },
    /// Shows the lanes and their holders, and the keys whose deliveries are parked.
    Lanes {
        /// Every lane, held or not.
        #[arg(long)]
        all: bool,
    },
    /// Makes dead letters pending again.
    Requeue(WriteArgs),
    /// Deletes dead letters for good.
    Discard(WriteArgs),
    /// Makes pending deliveries that no worker runs dead letters, to free their keys.
    Bury {
        #[command(flatten)]
        write: WriteArgs,
        /// Why, stored as their error.
        #[arg(long)]
        reason: String,
    },
    /// Deletes dead letters and finished events older than the cutoffs.
    Purge(PurgeArgs),
    /// Follows new deliveries as they commit, until interrupted.
    Tail {
        /// Only deliveries of these handlers.
        #[arg(long)]
        handler: Vec<String>,
    },
}

/// What the deliveries of a listing or a write are narrowed to; every filter optional.
#[derive(Debug, Clone, Default, Args)]
pub(crate) struct FilterArgs {
    /// Only deliveries of this handler.
    #[arg(long)]
    pub(crate) handler: Option<String>,
    /// Only deliveries of events of this type.
    #[arg(long)]
    pub(crate) event_type: Option<String>,
    /// Only deliveries of events with this ordering key.
    #[arg(long)]
    pub(crate) key: Option<String>,
    /// Only the deliveries of this event.
    #[arg(long)]
    pub(crate) event_id: Option<String>,
    /// Only deliveries whose last error contains this text, whatever its case.
    #[arg(long)]
    pub(crate) error: Option<String>,
    /// Only deliveries whose last error is exactly this.
    #[arg(long)]
    pub(crate) last_error: Option<String>,
    /// Only deliveries created at or after this time (RFC 3339, or an age such as 2h or 7d).
    #[arg(long)]
    pub(crate) created_from: Option<String>,
    /// Only deliveries created before this time (RFC 3339, or an age such as 2h or 7d).
    #[arg(long)]
    pub(crate) created_before: Option<String>,
}

impl FilterArgs {
    pub(crate) fn is_empty(&self) -> bool {
        self.handler.is_none()
            && self.event_type.is_none()
            && self.key.is_none()
            && self.event_id.is_none()
            && self.error.is_none()
            && self.last_error.is_none()
            && self.created_from.is_none()
            && self.created_before.is_none()
    }
}

/// The states a listing can select.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum State {
    Pending,
    Waiting,
    Running,
    Parked,
    Dead,
    Completed,
}

#[derive(Debug, Args)]
pub(crate) struct ListArgs {
    #[command(flatten)]
    pub(crate) filter: FilterArgs,
    /// Only deliveries in this state.
    #[arg(long)]
    pub(crate) state: Option<State>,
    /// The page after this delivery id (the last id of the previous page).
    #[arg(long)]
    pub(crate) after: Option<String>,
    /// At most this many deliveries, 1 to 1000.
    #[arg(long, default_value_t = 100)]
    pub(crate) limit: u32,
}

#[derive(Debug, Args)]
pub(crate) struct WriteArgs {
    /// The delivery ids (as `list` shows them); or select by filter instead.
    pub(crate) ids: Vec<String>,
    #[command(flatten)]
    pub(crate) filter: FilterArgs,
    /// Every delivery in the state the command takes, with no filter.
    #[arg(long)]
    pub(crate) all: bool,
    /// Print what it would change, and change nothing.
    #[arg(long)]
    pub(crate) dry_run: bool,
    /// Run a selection by filter without asking.
    #[arg(long, short = 'y')]
    pub(crate) yes: bool,
}

#[derive(Debug, Args)]
pub(crate) struct PurgeArgs {
    /// Delete dead letters buried before this time (RFC 3339, or an age such as 30d).
    #[arg(long)]
    pub(crate) dead_before: Option<String>,
    /// Delete completion records and finished events of before this time (RFC 3339, or an
    /// age such as 7d).
    #[arg(long)]
    pub(crate) completed_before: Option<String>,
    /// Print what it would delete, and delete nothing.
    #[arg(long)]
    pub(crate) dry_run: bool,
    /// Run without asking.
    #[arg(long, short = 'y')]
    pub(crate) yes: bool,
}
