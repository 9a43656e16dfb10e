//! Errors returned by relaybus.

use std::time::Duration;

/// A boxed error of any kind, as returned by user code (handlers, transaction bodies).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The result type of relaybus operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every error a relaybus operation can return.
///
/// Each variant wraps a more specific error type that says what went wrong and what to do about
/// it. Match on the variant when the caller can act on the cause, for example retry later after a
/// [`TransactionTimeout`](Error::TransactionTimeout).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The store, the bus or a call was configured in a way that cannot work: a standalone
    /// server, an invalid database name, a session without a started transaction, and so on.
    ///
    /// Nothing was written.
    #[error(transparent)]
    Configuration(#[from] ConfigurationError),

    /// An event was refused before anything was written: a malformed type name, an ordering key
    /// that is too long, a document over MongoDB's size limit, a payload that does not serialize.
    #[error(transparent)]
    EventValidation(#[from] EventValidationError),

    /// A transaction ran past its time budget and was aborted with all its writes.
    #[error(transparent)]
    TransactionTimeout(#[from] TransactionTimeoutError),

    /// The database returned an error, or could not be reached.
    ///
    /// Errors that let a transaction run again (a write conflict, a primary that stepped down)
    /// are retried by the transaction helpers and only reach the caller once the retry time
    /// is used up. The driver's own error is kept: see [`DatabaseError::downcast_ref`].
    #[error("database error: {0}")]
    Database(#[from] DatabaseError),

    /// A commit the database applied on the primary whose write concern then failed: the
    /// transaction committed there, but no majority acknowledged it (yet).
    ///
    /// Not retried, and not transient: running the transaction again would write it twice
    /// (a new order, new events). It is most likely committed for good; it is lost only if the
    /// primary fails before the other members have it. Check for its writes before doing it
    /// again (the event ids tell), or treat it as done.
    #[error(transparent)]
    CommitNotAcknowledged(#[from] CommitNotAcknowledgedError),

    /// A lease token or delivery id that the store cannot have issued: malformed, or naming a
    /// lane that does not exist. Refused before any database call; nothing was written.
    #[error(transparent)]
    Lease(#[from] LeaseError),

    /// An argument of a store call is out of range (a claim limit of 0, an empty owner name, a
    /// zero lease duration, ...). Refused before any database call; nothing was written.
    #[error(transparent)]
    InvalidArgument(#[from] InvalidArgumentError),

    /// An error raised by user code inside a transaction body, passed through unchanged.
    #[error(transparent)]
    Custom(BoxError),
}

impl Error {
    /// Wraps an error of user code so that it can be returned from a transaction body.
    ///
    /// The transaction is aborted and the error reaches the caller unchanged.
    pub fn custom(error: impl Into<BoxError>) -> Self {
        Error::Custom(error.into())
    }

    /// Whether the whole transaction that raised this error may be run again: a write conflict,
    /// a lost connection or a primary that stepped down.
    pub fn is_transient_transaction_error(&self) -> bool {
        matches!(self, Error::Database(e) if e.is_transient())
    }

    /// Whether a commit failed without saying whether it committed; sending the commit again
    /// is safe, the database commits a transaction once.
    pub fn is_unknown_commit_result(&self) -> bool {
        match self {
            Error::Database(e) => e.is_unknown_commit_result(),
            Error::CommitNotAcknowledged(e) => e.source.is_unknown_commit_result(),
            _ => false,
        }
    }

    /// Whether the database stopped an operation at its time limit (a commit past its
    /// budget, for example).
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Database(e) if e.is_timeout())
    }
}

/// An error of the database or its driver, with what the transaction helpers need to know
/// about it. Made by the store from its driver's error, which it keeps.
///
/// ```
/// use relaybus::DatabaseError;
///
/// let error = DatabaseError::new(std::io::Error::other("connection reset")).with_transient(true);
/// assert!(error.is_transient());
/// assert!(error.downcast_ref::<std::io::Error>().is_some());
/// ```
#[derive(Debug)]
pub struct DatabaseError {
    source: BoxError,
    transient: bool,
    unknown_commit_result: bool,
    timeout: bool,
}

impl DatabaseError {
    /// Wraps a driver error; it is neither transient nor a timeout until said so.
    pub fn new(source: impl Into<BoxError>) -> Self {
        DatabaseError {
            source: source.into(),
            transient: false,
            unknown_commit_result: false,
            timeout: false,
        }
    }

    /// Marks the error as one after which the whole transaction may run again.
    pub fn with_transient(mut self, transient: bool) -> Self {
        self.transient = transient;
        self
    }

    /// Marks the error as a commit whose outcome is unknown.
    pub fn with_unknown_commit_result(mut self, unknown: bool) -> Self {
        self.unknown_commit_result = unknown;
        self
    }

    /// Marks the error as the database's time limit.
    pub fn with_timeout(mut self, timeout: bool) -> Self {
        self.timeout = timeout;
        self
    }

    /// Whether the whole transaction may run again.
    pub fn is_transient(&self) -> bool {
        self.transient
    }

    /// Whether a commit failed without saying whether it committed.
    pub fn is_unknown_commit_result(&self) -> bool {
        self.unknown_commit_result
    }

    /// Whether the database stopped the operation at its time limit.
    pub fn is_timeout(&self) -> bool {
        self.timeout
    }

    /// The driver's error.
    pub fn get_ref(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self.source.as_ref()
    }

    /// The driver's error as its own type, such as `mongodb::error::Error`.
    pub fn downcast_ref<T: std::error::Error + 'static>(&self) -> Option<&T> {
        self.source.downcast_ref::<T>()
    }
}

impl std::fmt::Display for DatabaseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.source.fmt(f)
    }
}

impl std::error::Error for DatabaseError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.source()
    }
}

/// A commit the primary applied whose write concern failed: see
/// [`Error::CommitNotAcknowledged`].
#[derive(Debug, thiserror::Error)]
#[error(
    "the transaction committed on the primary, but its write concern failed ({source}); it \
     stays committed unless the primary fails before a majority has it: check for its writes \
     before running it again, which would write them twice"
)]
pub struct CommitNotAcknowledgedError {
    source: DatabaseError,
}

impl CommitNotAcknowledgedError {
    /// The commit's write concern error.
    pub fn new(source: DatabaseError) -> Self {
        CommitNotAcknowledgedError { source }
    }

    /// The database's error: the write concern that failed.
    pub fn database_error(&self) -> &DatabaseError {
        &self.source
    }
}

/// A configuration that cannot work. Nothing was written.
///
/// The message says what is wrong and how to fix it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigurationError {
    /// The server is a standalone `mongod`, which has no multi-document transactions.
    #[error(
        "MongoEventStore needs multi-document transactions, and the server at {address} is a standalone mongod; \
         run it as a replica set (`mongod --replSet rs0`, then `rs.initiate()` or the `replSetInitiate` command) \
         or connect to a sharded cluster"
    )]
    NotReplicaSet {
        /// The address of the server that answered.
        address: String,
    },

    /// A session was handed to an operation that must run in a transaction, but the session has
    /// no started transaction: each write would commit on its own.
    #[error(
        "{operation} needs a {} inside a started transaction; start one with {} or use \
         `transaction(..)` of the bus or store",
        session_of(operation).0,
        session_of(operation).1
    )]
    NoTransaction {
        /// The operation that was refused.
        operation: &'static str,
    },

    /// A publish without a session ran inside the body of a transaction of the bus or the
    /// store: it would commit in a transaction of its own, even if the body's is aborted.
    #[error(
        "{operation} was called without `.session(session)` inside a transaction body, where it \
         would commit on its own even if the body's transaction is aborted; pass the session the \
         body was given"
    )]
    SessionNotPassed {
        /// The operation that was refused.
        operation: &'static str,
    },

    /// The database name cannot be used.
    #[error(
        "invalid database name {name:?}: {reason}; use 1 to 63 characters of ASCII letters, digits, `_` and `-`, \
         other than `admin`, `local` and `config`"
    )]
    InvalidDatabaseName {
        /// The name given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// The client has no default database and none was given.
    #[error(
        "no database given and the connection string names none; call `.database(\"name\")` on the store builder"
    )]
    MissingDatabase,

    /// The collection prefix cannot be used.
    #[error(
        "invalid collection prefix {prefix:?}: {reason}; use up to 32 characters of ASCII letters, digits, `_`, `-` and `.`"
    )]
    InvalidCollectionPrefix {
        /// The prefix given.
        prefix: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// A numeric or duration option is out of range.
    #[error("invalid option `{option}`: {reason}")]
    InvalidOption {
        /// The option's name.
        option: &'static str,
        /// What is wrong and what is accepted.
        reason: String,
    },

    /// A handler id cannot be used.
    #[error(
        "invalid handler id {id:?}: {reason}; use 1 to 128 characters of ASCII letters, digits, `_`, `-`, `.` and `:`"
    )]
    InvalidHandlerId {
        /// The id given.
        id: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// Two handlers share one id: two subscriptions of a bus, or two `#[handler]` functions
    /// linked into the binary.
    #[error(
        "handler id {id:?} is subscribed twice ({first} and {second}); give each handler its own id"
    )]
    DuplicateHandlerId {
        /// The id both use.
        id: String,
        /// The first handler: its `#[handler]` function, or the event its subscription handles.
        first: String,
        /// The second handler, described as the first.
        second: String,
    },

    /// A handler's context or session belongs to another store than the bus's: it could not
    /// be given the transaction it asks for.
    #[error(
        "handler {handler:?} is written for the {handler_store} store (its `HandlerContext` names \
         it), and this bus runs on the {bus_store} store; write the handler's context as \
         `HandlerContext<{bus_type}>`, or leave the context out if the handler does not need it"
    )]
    HandlerOfAnotherStore {
        /// The handler id.
        handler: String,
        /// The store the handler is written for.
        handler_store: &'static str,
        /// The bus's store.
        bus_store: &'static str,
        /// The bus's store type, as Rust names it.
        bus_type: &'static str,
    },

    /// A handler takes a [`State`](crate::State) of a type the bus was never given.
    #[error(
        "handler {handler:?} takes `State<{type_name}>`, but the bus has no state of that type; \
         give it with `RelayBus::builder(store).state(value)` (a part of a larger state is given \
         on its own: `.state(app.part.clone())`)"
    )]
    MissingState {
        /// The handler id.
        handler: String,
        /// The state type the handler asks for, as Rust names it.
        type_name: &'static str,
    },

    /// [`RelayBusBuilder::state`](crate::RelayBusBuilder::state) was given two values of one
    /// type: a handler's `State<T>` could not tell which it means.
    #[error(
        "the bus was given two state values of type {type_name}; give each type once (wrap two \
         values of one type in types of their own, such as `struct Billing(Client)`)"
    )]
    DuplicateState {
        /// The state type, as Rust names it.
        type_name: &'static str,
    },

    /// Two event types declared with `#[event]` share one type name, so each would be read as
    /// the other.
    #[error(
        "event type name {type_name:?} is declared twice ({first} and {second}); give each event \
         type its own name (a new version of an event is a new name, such as `order.placed.v2`)"
    )]
    DuplicateEventType {
        /// The type name both use.
        type_name: String,
        /// The path of the first Rust type.
        first: String,
        /// The path of the second Rust type.
        second: String,
    },

    /// A schedule cannot be used: its id, cron expression, time zone, interval, missed-ticks
    /// bound or catch-up window.
    #[error("invalid schedule {id:?}: {reason}")]
    InvalidSchedule {
        /// The schedule id.
        id: String,
        /// What is wrong and what is accepted.
        reason: String,
    },

    /// Two schedules share one id: two given to a bus, or two `#[schedule]` functions linked
    /// into the binary. The id names the ticks' events, so the two would publish one event.
    #[error(
        "schedule id {id:?} is given twice ({first} and {second}); give each schedule its own id"
    )]
    DuplicateScheduleId {
        /// The id both use.
        id: String,
        /// The first schedule, described.
        first: String,
        /// The second schedule, described.
        second: String,
    },
}

/// An event that cannot be stored as it is. Nothing was written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EventValidationError {
    /// The event type name does not follow the naming rule.
    #[error(
        "invalid event type name {name:?}: {reason}; use dot-separated lowercase segments of ASCII letters, \
         digits, `_` and `-`, each starting with a letter or digit, 128 bytes at most (for example \"order.placed.v1\")"
    )]
    InvalidTypeName {
        /// The name given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// The event id is empty, too long or not text.
    #[error("invalid event id {id:?}: {reason}; use 1 to {max} bytes without control characters", max = crate::event::MAX_ID_BYTES)]
    InvalidId {
        /// The id given.
        id: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// The ordering key is empty or too long.
    #[error("invalid ordering key {key:?}: {reason}; use 1 to {max} bytes", max = crate::event::MAX_KEY_BYTES)]
    InvalidKey {
        /// The key given, cut to its first 64 characters.
        key: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// A correlation or causation id, or a header name, is empty or too long.
    #[error("invalid {field}: {reason}")]
    InvalidField {
        /// Which field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    /// The payload could not be serialized to JSON.
    #[error("the payload of {event_type} could not be serialized: {source}")]
    Payload {
        /// The event type.
        event_type: String,
        /// The serializer's error.
        #[source]
        source: serde_json::Error,
    },

    /// The payload is not a JSON object.
    #[error(
        "the payload of {event_type} serializes to {found}, not an object; make the event a struct or a \
         map-like enum, or wrap the value in a struct"
    )]
    PayloadNotObject {
        /// The event type.
        event_type: String,
        /// What JSON kind it serializes to.
        found: &'static str,
    },

    /// The payload nests objects and arrays deeper than MongoDB stores
    /// ([`MAX_PAYLOAD_DEPTH`](crate::event::MAX_PAYLOAD_DEPTH) levels, the payload object
    /// counted).
    #[error(
        "the payload of {event_type} nests objects and arrays more than {limit} levels deep, \
         more than MongoDB supports in a document; flatten it, or store the data elsewhere and \
         put a reference in the payload"
    )]
    PayloadTooDeep {
        /// The event type.
        event_type: String,
        /// The deepest nesting accepted.
        limit: usize,
    },

    /// The event id already names an event of another type, in the store or earlier in the
    /// same batch. Ids deduplicate events, so the handlers of this type would get deliveries
    /// of an event they cannot read.
    ///
    /// Found by the store's `append` inside the transaction when the
    /// other event is stored: the transaction must not commit (the transaction helpers of the
    /// bus and the store abort it).
    #[error(
        "event id {id:?} already names an event of type {existing_type}, so it cannot also be \
         published as {event_type}; give every event its own id (a publish of a known id adds \
         deliveries to the stored event, it never replaces it)"
    )]
    IdReused {
        /// The event id.
        id: String,
        /// The type of the event the id names already.
        existing_type: String,
        /// The type of the event that was refused.
        event_type: String,
    },

    /// The stored event document would exceed MongoDB's document size limit.
    #[error(
        "event {id} would be stored as {size} bytes, over MongoDB's limit of {limit} bytes; store large \
         data elsewhere and put a reference in the payload"
    )]
    TooLarge {
        /// The event id.
        id: String,
        /// The size of the document in bytes.
        size: usize,
        /// The limit in bytes.
        limit: usize,
    },
}

/// A transaction ran past its time budget and was aborted with all its writes.
///
/// Nothing the transaction wrote is visible. Run it again, make it shorter, or give it a larger
/// budget (`transaction_timeout` on the bus builder).
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "transaction aborted after {elapsed:?}, over its time budget of {budget:?}; nothing was committed \
     (raise `transaction_timeout` or do less work per transaction)"
)]
pub struct TransactionTimeoutError {
    pub(crate) budget: Duration,
    pub(crate) elapsed: Duration,
}

impl TransactionTimeoutError {
    /// The time budget the transaction had.
    pub fn budget(&self) -> Duration {
        self.budget
    }

    /// How long the transaction ran before it was aborted.
    pub fn elapsed(&self) -> Duration {
        self.elapsed
    }
}

/// A lease or delivery id that the store cannot have issued. Nothing was sent to the database.
///
/// Leases come from a claim; a MongoDB lease that was stored as text and read back goes through
/// `Lease::parse`, which refuses what no claim can
/// have produced.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LeaseError {
    /// The token is not three decimal numbers `<lane>:<epoch>:<claims>`, or one of them is out of
    /// range.
    #[error(
        "malformed lease token {token:?}: {reason}; pass the token a claim returned, unchanged \
         (`<lane>:<epoch>:<claims>`)"
    )]
    MalformedToken {
        /// The token given, cut to its first 64 characters.
        token: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// The token names a lane that does not exist.
    #[error(
        "lease token names lane {lane}, and lanes are numbered 0 to 255; the token was not issued by a claim"
    )]
    LaneOutOfRange {
        /// The lane the token names.
        lane: u64,
    },

    /// The delivery id is not the 24 hexadecimal digits of an ObjectId.
    #[error("invalid delivery id {id:?}: use the 24 hexadecimal digits of the id a claim returned")]
    InvalidDeliveryId {
        /// The id given, cut to its first 64 characters.
        id: String,
    },
}

/// An argument of a store call is out of range. Nothing was sent to the database.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid argument `{argument}`: {reason}")]
pub struct InvalidArgumentError {
    pub(crate) argument: &'static str,
    pub(crate) reason: String,
}

impl InvalidArgumentError {
    /// Refuses `argument`, saying what is wrong and what is accepted.
    pub fn new(argument: &'static str, reason: impl Into<String>) -> Self {
        InvalidArgumentError {
            argument,
            reason: reason.into(),
        }
    }

    /// The name of the argument that was refused.
    pub fn argument(&self) -> &'static str {
        self.argument
    }

    /// What is wrong with it and what is accepted.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

/// The first `max` characters of `text`, for error messages that echo input.
#[cfg_attr(not(feature = "mongodb"), allow(dead_code))]
pub(crate) fn truncate_for_message(text: &str, max: usize) -> String {
    text.chars().take(max).collect()
}

/// The session type of the store an operation belongs to (named by the operation's type, as in
/// `MemorySession.put`), and how to start its transaction, for
/// [`ConfigurationError::NoTransaction`].
fn session_of(operation: &str) -> (&'static str, &'static str) {
    let owner = operation.split('.').next().unwrap_or_default();
    if owner.starts_with("Memory") {
        ("MemorySession", "`store.begin(&mut session, None)`")
    } else if owner.starts_with("Postgres") {
        (
            "PostgresSession",
            "`store.begin(&mut session, None)` or `PostgresSession::from(pool.begin().await?)`",
        )
    } else {
        ("ClientSession", "`session.start_transaction()`")
    }
}

/// The message of an error with its sources, each cause once.
pub(crate) fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = cause.source();
    }
    message
}
