//! The dashboard (README "Dashboard"): a page at `/` and its assets at `/ui/...`, embedded in the binary
//! (no separate web server, no CDN: the machines reach no internet), plain HTML, CSS and
//! JavaScript modules with no build step. The page itself is public, like the OpenAPI
//! document; everything it shows comes from the control API with the operators' token (asked
//! once, kept in the browser tab's session, sent as `Authorization: Bearer`), so it opens
//! exactly as the API does, `--insecure` included. Standbys serve it too; the page follows a
//! standby's 503 to the leader.

use axum::extract::Path;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use super::AppState;
use crate::error::CoordinatorError;

/// The assets: name, content type, bytes.
const ASSETS: [(&str, &str, &str); 4] = [
    ("index.html", "text/html; charset=utf-8", include_str!("ui/index.html")),
    ("app.js", "text/javascript; charset=utf-8", include_str!("ui/app.js")),
    ("api.js", "text/javascript; charset=utf-8", include_str!("ui/api.js")),
    ("style.css", "text/css; charset=utf-8", include_str!("ui/style.css")),
];

/// Only the page's own scripts and styles run; it talks to its own origin only; no frames.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; \
                       base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/", get(|| async { asset("index.html") }))
        .route("/ui/{file}", get(|Path(file): Path<String>| async move { asset(&file) }))
}

fn asset(name: &str) -> Response {
    let Some((_, kind, body)) = ASSETS.iter().find(|(n, _, _)| *n == name) else {
        return CoordinatorError::not_found(format!("dashboard file /ui/{name}")).into_response();
    };
    let mut res = (*body).into_response();
    let h = res.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    // A new coordinator's page replaces the old one at once.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_loads_only_embedded_assets() {
        let index = ASSETS[0].2;
        for (name, _, body) in ASSETS {
            // Nothing from elsewhere (no CDN).
            assert!(!body.is_empty() && !body.contains("http://") && !body.contains("https://"), "{name}");
        }
        // No inline script or style (the CSP refuses both).
        for src in ["/ui/app.js", "/ui/style.css"] {
            assert!(index.contains(src), "{src}");
        }
        assert!(!index.contains("<script>") && !index.contains("style="));
        // The token is never put in a URL.
        for (name, _, body) in ASSETS {
            assert!(!body.contains("?token") && !body.contains("&token"), "{name}");
        }
    }
}
