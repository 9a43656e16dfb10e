//! Where the broker is and how to connect to it: the relay and the consumer each own their
//! connection and open a new one when the last one is gone.

use std::{fmt, str::FromStr, time::Duration};

use lapin::{Connection, ConnectionProperties, uri::AMQPUri};

use super::RabbitError;

/// A broker's address, parsed once, and the connection settings.
#[derive(Clone)]
pub(crate) struct Endpoint {
    uri: AMQPUri,
    properties: ConnectionProperties,
    /// `host:port/vhost`, for messages: never the credentials.
    display: String,
    timeout: Duration,
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.display)
    }
}

impl Endpoint {
    /// Parses `uri` (`amqp://user:password@host:port/vhost`, the virtual host percent-encoded,
    /// `%2f` for `/`).
    pub(crate) fn parse(
        uri: &str,
        properties: Option<ConnectionProperties>,
        name: String,
        timeout: Duration,
    ) -> Result<Endpoint, RabbitError> {
        // The parser's message may quote the URI, password included: leave it out.
        let parsed = AMQPUri::from_str(uri).map_err(|_| {
            RabbitError::invalid(
                "uri",
                "it is not an AMQP URI; write `amqp://user:password@host:5672/vhost`, with the \
                 virtual host percent-encoded (`%2f` for `/`)",
            )
        })?;
        let display = format!(
            "{}:{}/{}",
            parsed.authority.host, parsed.authority.port, parsed.vhost
        );
        let properties = properties
            .unwrap_or_default()
            .with_connection_name(name.into());
        Ok(Endpoint {
            uri: parsed,
            properties,
            display,
            timeout,
        })
    }

    /// `host:port/vhost`.
    pub(crate) fn display(&self) -> &str {
        &self.display
    }

    /// Opens a connection, within the connect timeout.
    pub(crate) async fn connect(&self) -> Result<Connection, RabbitError> {
        let connecting = Connection::connect_uri(self.uri.clone(), self.properties.clone());
        match tokio::time::timeout(self.timeout, connecting).await {
            Ok(Ok(connection)) => Ok(connection),
            Ok(Err(source)) => Err(self.failed(source)),
            Err(_) => Err(self.failed(lapin::Error::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer within {:?}", self.timeout),
            )))),
        }
    }

    /// The connect error for `source`.
    pub(crate) fn failed(&self, source: lapin::Error) -> RabbitError {
        RabbitError::Connect {
            endpoint: self.display.clone(),
            source,
        }
    }
}

/// Closes a connection without waiting long for the broker's answer; errors are of no use.
pub(crate) async fn close_quietly(connection: &Connection, reason: &str) {
    if connection.status().connected() {
        let _ = tokio::time::timeout(Duration::from_secs(2), connection.close(200, reason.into()))
            .await;
    }
}
