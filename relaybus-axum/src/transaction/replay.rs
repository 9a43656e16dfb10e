//! A copy of a request's body, kept so that the request can run again.

use axum::{
    body::{Body, Bytes},
    http::{HeaderMap, StatusCode, header::CONTENT_LENGTH},
    response::{IntoResponse, Response},
};
use futures::{StreamExt, stream};

/// A request body after [`buffer`].
pub(super) enum Buffered {
    /// The whole body, within the limit.
    Whole(Bytes),
    /// A body over the limit, whole again (what was read, then the rest): it runs once.
    TooLarge(Body),
    /// Reading the body failed; the request cannot run.
    Failed(Response),
}

/// Reads `body` whole when it fits in `limit` bytes. A body whose `Content-Length` says it
/// will not fit is not read at all; one without a length is read up to the limit, and handed
/// back whole if it goes over.
pub(super) async fn buffer(body: Body, headers: &HeaderMap, limit: usize) -> Buffered {
    let declared = headers
        .get(CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Buffered::TooLarge(body);
    }
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut size = 0_usize;
    let mut data = body.into_data_stream();
    while let Some(chunk) = data.next().await {
        let chunk = match chunk {
            Ok(chunk) => chunk,
            Err(error) => {
                tracing::debug!(%error, "the request body could not be read");
                return Buffered::Failed(
                    (
                        StatusCode::BAD_REQUEST,
                        "the request body could not be read",
                    )
                        .into_response(),
                );
            }
        };
        size += chunk.len();
        chunks.push(chunk);
        if size > limit {
            let read = stream::iter(chunks.into_iter().map(Ok::<_, axum::Error>));
            return Buffered::TooLarge(Body::from_stream(read.chain(data)));
        }
    }
    Buffered::Whole(match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop().unwrap_or_default(),
        _ => chunks.concat().into(),
    })
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    async fn text(body: Body) -> Bytes {
        axum::body::to_bytes(body, usize::MAX).await.unwrap()
    }

    #[tokio::test]
    async fn a_body_within_the_limit_is_kept_whole() {
        let body = Body::from_stream(stream::iter(["ab", "cd"].map(Ok::<_, std::io::Error>)));
        match buffer(body, &HeaderMap::new(), 4).await {
            Buffered::Whole(bytes) => assert_eq!(bytes, "abcd"),
            _ => panic!("expected the whole body"),
        }
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_handed_back_whole() {
        let body = Body::from_stream(stream::iter(
            ["ab", "cd", "ef"].map(Ok::<_, std::io::Error>),
        ));
        match buffer(body, &HeaderMap::new(), 3).await {
            Buffered::TooLarge(body) => assert_eq!(text(body).await, "abcdef"),
            _ => panic!("expected a body too large"),
        }
    }

    #[tokio::test]
    async fn a_declared_length_over_the_limit_is_not_read() {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_LENGTH, HeaderValue::from_static("6"));
        match buffer(Body::from("abcdef"), &headers, 5).await {
            Buffered::TooLarge(body) => assert_eq!(text(body).await, "abcdef"),
            _ => panic!("expected a body too large"),
        }
    }
}
