//! The operator page: one HTML document, a script and a style sheet, embedded in the crate and
//! served by the operator router. No build step, nothing loaded from elsewhere.

use axum::{
    extract::{NestedPath, State},
    http::{HeaderValue, header, request::Parts},
    response::{IntoResponse, Response},
};
use relaybus::Store;

use super::OpsState;

const INDEX: &str = include_str!("assets/index.html");
const SCRIPT: &str = include_str!("assets/ops.js");
const STYLE: &str = include_str!("assets/ops.css");

/// The page's policy: its own script, style and API calls, nothing else; never framed.
const PAGE_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
                           connect-src 'self'; img-src 'self' data:; base-uri 'none'; \
                           form-action 'self'; frame-ancestors 'none'";

/// `text` with the characters that mean something in HTML escaped.
fn escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => escaped.push_str("&amp;"),
            '<' => escaped.push_str("&lt;"),
            '>' => escaped.push_str("&gt;"),
            '"' => escaped.push_str("&quot;"),
            '\'' => escaped.push_str("&#39;"),
            c => escaped.push(c),
        }
    }
    escaped
}

fn with_type(body: String, content_type: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(PAGE_POLICY),
    );
    response
}

/// The page, with the path the router is nested at, so that its links and calls work wherever
/// the application mounts it.
pub(super) async fn index<St: Store>(State(state): State<OpsState<St>>, parts: Parts) -> Response {
    let base = parts
        .extensions
        .get::<NestedPath>()
        .map(|nested| nested.as_str().trim_end_matches('/').to_owned())
        .unwrap_or_default();
    let html = INDEX.replace("{{base}}", &escape(&base)).replace(
        "{{read_only}}",
        if state.read_only { "true" } else { "false" },
    );
    with_type(html, "text/html; charset=utf-8")
}

pub(super) async fn script() -> Response {
    with_type(SCRIPT.to_owned(), "text/javascript; charset=utf-8")
}

pub(super) async fn style() -> Response {
    with_type(STYLE.to_owned(), "text/css; charset=utf-8")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_base_path_is_escaped() {
        assert_eq!(escape(r#"/ops"><script>"#), "/ops&quot;&gt;&lt;script&gt;");
        assert!(INDEX.contains("{{base}}/assets/ops.js"));
    }
}
