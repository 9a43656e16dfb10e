//! The wake-up stream: a change stream on inserted deliveries, read as often as the
//! dispatcher's pace asks.
//!
//! While a change stream waits for a matching change, the server scans every new oplog entry
//! for it, waking up once per write, however little matches: with several dispatchers on a
//! busy database, that is work for every write times every stream. A dispatcher that has been
//! claiming without a pause finds most new deliveries with its claims anyway, so while its pace
//! is [`WakePace::Gathered`] the stream is read with one short read per interval instead: the
//! oplog written meanwhile is scanned once, and nothing of it is missed. When the pace turns
//! eager again, the stream is reopened where the last read ended (its resume token) and waits
//! for changes as before, its first read reporting what the gathered reads had not yet.

use std::time::Duration;

use futures::{StreamExt, stream::BoxStream};
use mongodb::{
    Collection,
    bson::{Document, RawDocumentBuf},
    change_stream::{ChangeStream, event::ChangeStreamEvent, event::ResumeToken},
};
use tokio::sync::watch;

use crate::store::WakePace;

/// How long one gathered read waits on the server for a matching change before it returns
/// empty: the read is meant to take what is there and leave.
const GATHERED_AWAIT: Duration = Duration::from_millis(1);

/// One change: the inserted delivery, projected.
type Change = ChangeStreamEvent<RawDocumentBuf>;

/// A change stream on `deliveries` with `pipeline`, read as `pace` says.
pub(super) struct PacedStream {
    deliveries: Collection<RawDocumentBuf>,
    pipeline: Vec<Document>,
    stream: ChangeStream<Change>,
    /// Whether `stream` was opened for gathered reads (a short server-side wait), and whether
    /// it can be read on: a read dropped half-way leaves it to be reopened.
    opened_gathered: Option<bool>,
    /// Where the last completed read ended.
    token: Option<ResumeToken>,
    pace: watch::Receiver<WakePace>,
}

impl PacedStream {
    /// Opens the change stream as the current pace asks.
    pub(super) async fn open(
        deliveries: Collection<RawDocumentBuf>,
        pipeline: Vec<Document>,
        mut pace: watch::Receiver<WakePace>,
    ) -> mongodb::error::Result<PacedStream> {
        let gathered = matches!(*pace.borrow_and_update(), WakePace::Gathered(_));
        let stream = open(&deliveries, &pipeline, None, gathered).await?;
        Ok(PacedStream {
            token: stream.resume_token(),
            deliveries,
            pipeline,
            stream,
            opened_gathered: Some(gathered),
            pace,
        })
    }

    /// The changes, one at a time. The stream ends when it would have to be reopened with no
    /// position to resume from; the dispatcher then opens a new one and claims meanwhile.
    pub(super) fn into_stream(self) -> BoxStream<'static, mongodb::error::Result<Change>> {
        futures::stream::unfold(self, PacedStream::next).boxed()
    }

    async fn next(mut self) -> Option<(mongodb::error::Result<Change>, PacedStream)> {
        loop {
            let pace = *self.pace.borrow_and_update();
            let gathered = matches!(pace, WakePace::Gathered(_));
            if self.opened_gathered != Some(gathered) {
                // Reopened where the last read ended, so that nothing is missed between them.
                let token = self.token.clone()?;
                match open(&self.deliveries, &self.pipeline, Some(token), gathered).await {
                    Ok(stream) => {
                        self.stream = stream;
                        self.opened_gathered = Some(gathered);
                    }
                    Err(error) => return Some((Err(error), self)),
                }
            }
            let read = match pace {
                WakePace::Eager => tokio::select! {
                    read = self.stream.next_if_any() => Some(read),
                    () = changed(&mut self.pace) => None,
                },
                WakePace::Gathered(_) => Some(self.stream.next_if_any().await),
            };
            match read {
                Some(Ok(Some(change))) => {
                    self.token = self.stream.resume_token();
                    return Some((Ok(change), self));
                }
                Some(Ok(None)) => {
                    self.token = self.stream.resume_token();
                    if let WakePace::Gathered(interval) = pace {
                        tokio::select! {
                            () = tokio::time::sleep(interval) => {}
                            () = changed(&mut self.pace) => {}
                        }
                    }
                }
                Some(Err(error)) => return Some((Err(error), self)),
                // The pace changed while the stream waited on the server: that read is dropped,
                // and the stream reopened from the last one.
                None => self.opened_gathered = None,
            }
        }
    }
}

/// Opens a change stream on `deliveries`, after `token` if given.
async fn open(
    deliveries: &Collection<RawDocumentBuf>,
    pipeline: &[Document],
    token: Option<ResumeToken>,
    gathered: bool,
) -> mongodb::error::Result<ChangeStream<Change>> {
    let mut watch = deliveries
        .watch()
        .pipeline(pipeline.to_vec())
        .resume_after(token);
    if gathered {
        watch = watch.max_await_time(GATHERED_AWAIT);
    }
    watch.await
}

/// Waits until the pace changes; forever once nobody can change it.
async fn changed(pace: &mut watch::Receiver<WakePace>) {
    if pace.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}
