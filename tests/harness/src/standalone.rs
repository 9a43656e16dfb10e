//! A standalone server, for tests that check behaviour without a replica set.

use crate::instance::Instance;

/// A standalone `mongod` (no `--replSet`) on a free port of 127.0.0.1.
///
/// Made by [`start_standalone`]. Killed, and its data removed, when dropped,
/// and killed by the kernel if the process dies first.
#[derive(Debug)]
pub struct Standalone {
    instance: Instance,
    uri: String,
}

impl Standalone {
    /// Its URI, `mongodb://127.0.0.1:<port>/`.
    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.instance.port(0)
    }
}

/// Starts a standalone `mongod`, and waits until it answers.
///
/// Used to test that relaybus refuses a server that is not a replica set
/// member. It is started with `enableTestCommands`.
///
/// # Panics
///
/// When the server cannot be installed or started.
pub async fn start_standalone() -> Standalone {
    let instance = match Instance::launch(1, None).await {
        Ok(i) => i,
        Err(e) => panic!("relaybus-harness: cannot start a standalone mongod: {e}"),
    };
    let uri = format!("mongodb://127.0.0.1:{}/", instance.port(0));
    Standalone { instance, uri }
}
