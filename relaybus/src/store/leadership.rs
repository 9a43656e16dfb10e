//! Leadership: which store instance of a deployment does work that one does at a time.

use std::{future::Future, time::Duration};

use crate::error::Result;

/// A lead per role, held for a period: what the bus uses to sample the delivery gauges in one
/// process of a deployment at a time.
pub trait Leadership {
    /// Takes or keeps the lead of `role` for `period`: `true` when this store instance holds it
    /// now, `false` when another instance, of this process or another, holds it and its lead
    /// has not expired. For work one process of a deployment does at a time (sampling the
    /// delivery gauges). A store of one process only leads always.
    fn lead(&self, role: &str, period: Duration) -> impl Future<Output = Result<bool>> + Send {
        let _ = (role, period);
        async { Ok(true) }
    }
}
