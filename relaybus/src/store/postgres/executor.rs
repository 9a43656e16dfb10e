//! sqlx's `Executor` for a session, so that a route or a handler hands its session to a query
//! as it is (`.execute(&mut *session)`), the way sqlx takes `&mut PgConnection`.

use futures::{future::BoxFuture, stream::BoxStream};
use sqlx::{
    Describe, Either, Error, Execute, Executor, Postgres,
    postgres::{PgQueryResult, PgRow, PgStatement, PgTypeInfo},
};

use super::PostgresSession;

// Every method goes to the session's connection: the session adds no behaviour of its own to
// a query, only the transaction the connection is in.
impl<'c> Executor<'c> for &'c mut PostgresSession {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, Result<Either<PgQueryResult, PgRow>, Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        self.connection().fetch_many(query)
    }

    fn fetch_optional<'e, 'q: 'e, E>(self, query: E) -> BoxFuture<'e, Result<Option<PgRow>, Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        self.connection().fetch_optional(query)
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement<'q>, Error>>
    where
        'c: 'e,
    {
        self.connection().prepare_with(sql, parameters)
    }

    fn describe<'e, 'q: 'e>(self, sql: &'q str) -> BoxFuture<'e, Result<Describe<Postgres>, Error>>
    where
        'c: 'e,
    {
        self.connection().describe(sql)
    }
}
