//! Who may reach the console and how: the Host and Origin checks (DNS
//! rebinding, cross-site requests), the session secret on loopback, the
//! person's forwarded bearer token in the cluster, the anti-forgery token
//! on every write, and the headers every answer carries.

use std::ops::ControlFlow;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::{Console, Mode};

/// The Content-Security-Policy of every answer: nothing but the console's
/// own script, stylesheet and images; no inline script or style, no
/// framing, forms post only to the console.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
     form-action 'self'; frame-ancestors 'none'; base-uri 'none'; connect-src 'self'";

/// The largest form the console reads (an edit's arguments and a reason).
pub const MAX_FORM: usize = 256 * 1024;

/// The name of the anti-forgery form field.
pub const CSRF_FIELD: &str = "csrf";

/// The person a request acts for: their kube client and the anti-forgery
/// token of their session.
#[derive(Clone)]
pub struct Caller {
    pub client: kube::Client,
    pub csrf: String,
}

/// The session cookie's name: one per port, so two consoles on one host
/// (two people, two contexts) keep their own.
pub fn cookie_name(console: &Console) -> String {
    format!(
        "agentrun_console_{}",
        console.host.rsplit(':').next().unwrap_or("0")
    )
}

/// Equal in constant time (for secrets compared with what a request sent).
pub fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The anti-forgery token bound to `credential` (the session secret on
/// loopback, the person's bearer token in the cluster).
pub fn csrf_token(key: &ring::hmac::Key, credential: &str) -> String {
    hex::encode(ring::hmac::sign(key, format!("csrf\0{credential}").as_bytes()).as_ref())
}

/// Whether `sent` is the anti-forgery token of `credential` (HMAC
/// verification: constant time).
pub fn csrf_ok(key: &ring::hmac::Key, credential: &str, sent: &str) -> bool {
    match hex::decode(sent) {
        Ok(tag) => ring::hmac::verify(key, format!("csrf\0{credential}").as_bytes(), &tag).is_ok(),
        Err(_) => false,
    }
}

/// A refusal page: the status and why, in words (escaped).
pub fn refuse(console: &Console, status: StatusCode, why: &str) -> Response {
    let body = console.page_error(status, why);
    (status, body).into_response()
}

/// The headers of every answer.
pub async fn headers(req: Request, next: Next) -> Response {
    let mut res = next.run(req).await;
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    if !h.contains_key(header::CACHE_CONTROL) {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    res
}

/// The gate every request passes: Host, Origin, then the person's
/// credential, then (for a write) the anti-forgery token. What passes
/// carries a [`Caller`].
pub async fn gate(State(console): State<Arc<Console>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    if path == "/healthz" {
        return next.run(req).await;
    }
    if let Err((status, why)) = screen(&console.host, &console.origin, req.method(), req.headers())
    {
        return refuse(&console, status, &why);
    }
    if path.starts_with("/static/") {
        return next.run(req).await;
    }
    let found = match &console.mode {
        Mode::Loopback { client, session } => loopback_caller(&console, client, session, &req),
        Mode::InCluster(cluster) => cluster_caller(&console, cluster, req.headers()),
    };
    let (caller, credential) = match found {
        ControlFlow::Continue(found) => found,
        ControlFlow::Break(answer) => return answer,
    };
    let mut req = match req.method() == Method::POST {
        true => match with_checked_form(&console, req, &credential).await {
            Ok(req) => req,
            Err(refused) => return refused,
        },
        false => req,
    };
    req.extensions_mut().insert(caller);
    next.run(req).await
}

/// What every request but the health check must be, before any credential
/// is read: for the console's host (`host`), from its own pages if from a
/// page at all (`origin`), a GET, HEAD or POST. Otherwise the refusal's
/// status and words.
fn screen(
    host: &str,
    origin: &str,
    method: &Method,
    headers: &HeaderMap,
) -> Result<(), (StatusCode, String)> {
    let named = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    if !named.eq_ignore_ascii_case(host) {
        return Err((
            StatusCode::FORBIDDEN,
            format!(
                "this console answers only requests for {host} (the request named another host)"
            ),
        ));
    }
    if let Some(sent) = headers.get(header::ORIGIN)
        && !own_origin(origin, sent.as_bytes(), headers)
    {
        return Err((
            StatusCode::FORBIDDEN,
            "this console answers only its own pages (the request came from another origin)".into(),
        ));
    }
    if method != Method::GET && method != Method::HEAD && method != Method::POST {
        return Err((
            StatusCode::METHOD_NOT_ALLOWED,
            "only GET and POST are served".into(),
        ));
    }
    Ok(())
}

/// On loopback: the one person whose session cookie the request carries,
/// with their kubeconfig's client, and their credential; or the answer
/// instead (`Break`: the URL's ticket opening the session, or a refusal).
fn loopback_caller(
    console: &Console,
    client: &kube::Client,
    session: &super::LoopbackSession,
    req: &Request,
) -> ControlFlow<Response, (Caller, String)> {
    if let Some(sent) = query_param(req.uri().query(), "session") {
        return ControlFlow::Break(open_session(console, session, &sent, req.uri().path()));
    }
    let secret = match (
        cookie(req.headers(), &cookie_name(console)),
        session.secret(),
    ) {
        (Some(c), Some(secret)) if same(c.as_bytes(), secret.as_bytes()) => secret,
        _ => {
            return ControlFlow::Break(refuse(
                console,
                StatusCode::FORBIDDEN,
                "no console session: open the URL that `kubectl agentrun console` printed",
            ));
        }
    };
    let caller = Caller {
        client: client.clone(),
        csrf: csrf_token(&console.key, secret),
    };
    ControlFlow::Continue((caller, secret.to_string()))
}

/// In the cluster: the person whose token the login proxy forwarded, with a
/// client acting as them, and the token; or the refusal (`Break`).
fn cluster_caller(
    console: &Console,
    cluster: &super::ClusterAccess,
    headers: &HeaderMap,
) -> ControlFlow<Response, (Caller, String)> {
    let Some(token) = bearer(headers) else {
        return ControlFlow::Break(refuse(
            console,
            StatusCode::UNAUTHORIZED,
            "no forwarded credential: this console acts only with the token of the person \
             its login proxy authenticated (X-Forwarded-Access-Token or Authorization: Bearer)",
        ));
    };
    let client = match cluster.client_for(&token) {
        Ok(client) => client,
        Err(e) => {
            return ControlFlow::Break(refuse(
                console,
                StatusCode::INTERNAL_SERVER_ERROR,
                &format!(
                    "building a client for the API server: {}",
                    crate::text::chain(&e)
                ),
            ));
        }
    };
    let caller = Caller {
        client,
        csrf: csrf_token(&console.key, &token),
    };
    ControlFlow::Continue((caller, token))
}

/// A write, read whole (up to [`MAX_FORM`]) and passed on only with the
/// anti-forgery token of `credential`; or the refusal.
async fn with_checked_form(
    console: &Console,
    req: Request,
    credential: &str,
) -> Result<Request, Response> {
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_FORM).await else {
        return Err(refuse(
            console,
            StatusCode::PAYLOAD_TOO_LARGE,
            "the form is too large",
        ));
    };
    let sent = form_value(&bytes, CSRF_FIELD).unwrap_or_default();
    if !csrf_ok(&console.key, credential, &sent) {
        return Err(refuse(
            console,
            StatusCode::FORBIDDEN,
            "the form lacks this session's anti-forgery token: reload the page and try again",
        ));
    }
    Ok(Request::from_parts(parts, Body::from(bytes)))
}

/// Whether a request's `Origin` is the console's own (`own`). Under
/// `Referrer-Policy: no-referrer` a browser sends `Origin: null` on the
/// console's own form posts; that counts only with the browser's own word
/// that the request came from this origin (`Sec-Fetch-Site: same-origin`,
/// a header no page can set).
fn own_origin(own: &str, origin: &[u8], headers: &HeaderMap) -> bool {
    origin == own.as_bytes()
        || (origin == b"null"
            && headers
                .get("sec-fetch-site")
                .is_some_and(|v| v.as_bytes() == b"same-origin"))
}

/// The ticket in the URL opens the session, once: a session cookie with a
/// secret of its own (HttpOnly, SameSite=Strict), and the browser is sent
/// on without the ticket in the URL. The ticket opens nothing after that.
fn open_session(
    console: &Console,
    session: &super::LoopbackSession,
    sent: &str,
    path: &str,
) -> Response {
    if !session.is_ticket(sent) {
        return refuse(
            console,
            StatusCode::FORBIDDEN,
            "wrong console session: open the URL that `kubectl agentrun console` printed",
        );
    }
    let secret = match session.open() {
        Ok(Some(secret)) => secret,
        Ok(None) => {
            return refuse(
                console,
                StatusCode::FORBIDDEN,
                "this console's URL has opened its session already (it works once, in one \
                 browser): run `kubectl agentrun console` again for another",
            );
        }
        Err(e) => {
            return refuse(
                console,
                StatusCode::INTERNAL_SERVER_ERROR,
                &format!("opening the session: {e:#}"),
            );
        }
    };
    let cookie = format!(
        "{}={secret}; Path=/; HttpOnly; SameSite=Strict",
        cookie_name(console)
    );
    let location = if path.starts_with('/') && !path.starts_with("//") {
        path
    } else {
        "/"
    };
    let mut res = StatusCode::SEE_OTHER.into_response();
    if let (Ok(c), Ok(l)) = (
        HeaderValue::from_str(&cookie),
        HeaderValue::from_str(location),
    ) {
        res.headers_mut().insert(header::SET_COOKIE, c);
        res.headers_mut().insert(header::LOCATION, l);
    }
    res
}

/// The person's forwarded token: `Authorization: Bearer` (oauth2-proxy's
/// `--pass-authorization-header`: the OIDC ID token the API server
/// authenticates), else `X-Forwarded-Access-Token` (`--pass-access-token`,
/// for providers whose access tokens the API server accepts).
pub fn bearer(headers: &HeaderMap) -> Option<String> {
    let auth = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|a| a.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, t)| t.trim())
        .filter(|t| !t.is_empty());
    if let Some(t) = auth {
        return Some(t.to_string());
    }
    headers
        .get("x-forwarded-access-token")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(str::to_string)
}

/// The value of cookie `name`.
pub fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_string())
}

/// A query parameter.
pub fn query_param(query: Option<&str>, name: &str) -> Option<String> {
    url::form_urlencoded::parse(query?.as_bytes())
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.into_owned())
}

/// A form field of an `application/x-www-form-urlencoded` body.
pub fn form_value(body: &Bytes, name: &str) -> Option<String> {
    url::form_urlencoded::parse(body)
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOST: &str = "127.0.0.1:4567";
    const ORIGIN: &str = "http://127.0.0.1:4567";

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| {
                (
                    header::HeaderName::from_static(k),
                    HeaderValue::from_static(v),
                )
            })
            .collect()
    }

    fn screened(method: Method, pairs: &[(&'static str, &'static str)]) -> Option<StatusCode> {
        screen(HOST, ORIGIN, &method, &headers(pairs))
            .err()
            .map(|(status, _)| status)
    }

    #[test]
    fn only_the_consoles_host_and_own_pages_pass_the_screen() {
        assert_eq!(screened(Method::GET, &[("host", HOST)]), None);
        assert_eq!(screened(Method::POST, &[("host", "127.0.0.1:4567")]), None);
        // DNS rebinding: the browser names the attacker's host.
        let (status, why) = screen(
            HOST,
            ORIGIN,
            &Method::GET,
            &headers(&[("host", "evil.example:4567")]),
        )
        .unwrap_err();
        assert_eq!(status, StatusCode::FORBIDDEN);
        assert!(why.contains(HOST), "{why}");
        assert_eq!(screened(Method::GET, &[]), Some(StatusCode::FORBIDDEN));
        // A cross-site request.
        let foreign = [("host", HOST), ("origin", "https://evil.example")];
        assert_eq!(
            screened(Method::POST, &foreign),
            Some(StatusCode::FORBIDDEN)
        );
        let own = [("host", HOST), ("origin", ORIGIN)];
        assert_eq!(screened(Method::POST, &own), None);
        // Only the methods the console serves.
        assert_eq!(
            screened(Method::PUT, &[("host", HOST)]),
            Some(StatusCode::METHOD_NOT_ALLOWED)
        );
        assert_eq!(screened(Method::HEAD, &[("host", HOST)]), None);
    }

    #[test]
    fn a_null_origin_is_own_only_on_the_browsers_word() {
        let same_origin = headers(&[("sec-fetch-site", "same-origin")]);
        assert!(own_origin(ORIGIN, b"null", &same_origin));
        assert!(!own_origin(ORIGIN, b"null", &HeaderMap::new()));
        let cross_site = headers(&[("sec-fetch-site", "cross-site")]);
        assert!(!own_origin(ORIGIN, b"null", &cross_site));
        assert!(own_origin(ORIGIN, ORIGIN.as_bytes(), &HeaderMap::new()));
    }
}
