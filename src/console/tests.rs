//! The console's gate, headers and pages against a stand-in API server
//! (an axum router answering as the API server would), through tower's
//! `oneshot` on the console's router.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use axum::routing::{get, patch, post};
use serde_json::{Value, json};
use tower::ServiceExt as _;

use super::guard::{CSP, csrf_token};
use super::*;

const HOST: &str = "127.0.0.1:4567";
const SESSION: &str = "s3cr3t-session";
/// The ticket of the console's URL (its session opened already in [`console`]).
const TICKET: &str = "t1ck3t";
const XSS_IMG: &str = "<img src=x onerror=alert(1)>";
const XSS_SCRIPT: &str = "</script><script>alert(2)</script>";
const XSS_LINK: &str = "javascript:alert(3)";

fn hostile_approval() -> Value {
    json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "Approval",
        "metadata": {"name": "r-a2-12345678", "namespace": "shop"},
        "spec": {
            "runRef": {"name": "r"}, "step": 2, "tool": "issue_refund", "rule": "large-refund",
            "arguments": {"orderId": XSS_IMG, "amount": 500, "note": XSS_LINK},
            "argumentsHash": "a".repeat(64),
            "approvers": {"groups": ["finance-approvers"]}, "requiredApprovals": 1,
            "requester": "carol", "separationOfDuties": true,
            "expiresAt": "2099-01-01T00:00:00Z", "onExpiry": "Fail",
            "observations": {"reason": format!("{XSS_SCRIPT} see {XSS_LINK}"),
                             "recentResults": [{"seq": 1, "tool": "lookup_order", "summary": XSS_IMG}]},
            "dependencies": [{"name": "order-1042", "version": "<b>7</b>"}],
            "decisions": [{"approver": "bob", "verdict": "Edit", "argumentsHash": "a".repeat(64),
                           "arguments": {"orderId": "1042", "amount": 300}, "reason": XSS_IMG}]
        }
    })
}

fn budget_approval() -> Value {
    let mut a = hostile_approval();
    a["metadata"]["name"] = json!("r-a9-12345678");
    a["spec"]["kind"] = json!("Budget");
    a["spec"]["tool"] = json!(crate::api::BUDGET_TOOL);
    a["spec"]["arguments"] = json!({"maxSteps": 40});
    a["spec"]["decisions"] = json!([]);
    a["spec"]["separationOfDuties"] = json!(false);
    a
}

fn run() -> Value {
    json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "r", "namespace": "shop"},
        "spec": {"input": "x", "agent": {
            "prompt": {"version": "v1", "system": "s"},
            "model": {"provider": "OpenAI", "name": "m"},
            "tools": [{"name": "issue_refund", "description": "d",
                       "inputSchema": {"type": "object", "required": ["orderId", "amount"],
                                       "properties": {"orderId": {"type": "string"}, "amount": {"type": "number"},
                                                      "currency": {"enum": ["EUR", "USD"]}}}}]
        }},
        "status": {"phase": "AwaitingApproval", "result": XSS_IMG}
    })
}

/// A replay test of run `r`.
fn test_run() -> Value {
    json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "r-test-x7", "namespace": "shop"},
        "spec": {"input": "x", "testOf": {"run": "r", "agent": "refunds-v2"}},
        "status": {"phase": "Succeeded"}
    })
}

/// What the stand-in API server answers (as alice, in group
/// finance-approvers); a decision is refused the way an admission policy
/// refuses one.
fn api_server() -> Router {
    let list = |items: Vec<Value>, kind: &str| json!({"apiVersion": "agentrun.dev/v1alpha1", "kind": kind, "metadata": {}, "items": items});
    let approvals = list(vec![hostile_approval()], "ApprovalList");
    let runs = list(vec![run(), test_run()], "AgentRunList");
    Router::new()
        .route(
            "/apis/authentication.k8s.io/v1/selfsubjectreviews",
            post(|| async {
                axum::Json(json!({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview",
                    "metadata": {}, "status": {"userInfo": {"username": "alice", "groups": ["finance-approvers"]}}}))
            }),
        )
        .route("/apis/agentrun.dev/v1alpha1/approvals", get(move || async move { axum::Json(approvals) }))
        .route("/apis/agentrun.dev/v1alpha1/agentruns", get(move || async move { axum::Json(runs) }))
        .route(
            "/apis/agentrun.dev/v1alpha1/namespaces/shop/approvals/r-a2-12345678",
            get(|| async { axum::Json(hostile_approval()) }).patch(|| async {
                (
                    StatusCode::UNPROCESSABLE_ENTITY,
                    axum::Json(json!({"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 422,
                        "reason": "Invalid",
                        "message": "ValidatingAdmissionPolicy 'agentrun-approval-decisions' denied request: <b>alice</b> is not an approver"})),
                )
            }),
        )
        .route(
            "/apis/agentrun.dev/v1alpha1/namespaces/shop/approvals/r-a9-12345678",
            get(|| async { axum::Json(budget_approval()) }),
        )
        .route(
            "/apis/agentrun.dev/v1alpha1/namespaces/shop/agentruns/r",
            get(|| async { axum::Json(run()) }),
        )
        // A created run comes back named (as `generateName` asks), and
        // says what it was created with.
        .route(
            "/apis/agentrun.dev/v1alpha1/namespaces/shop/agentruns",
            post(|axum::Json(mut created): axum::Json<Value>| async move {
                let from = created["spec"]["forkOf"]["seq"].clone();
                created["metadata"]["name"] = json!(format!("r-fork-at-{from}"));
                created["metadata"]["namespace"] = json!("shop");
                (StatusCode::CREATED, axum::Json(created))
            }),
        )
        .route("/never", patch(|| async { "" }))
}

fn console() -> Arc<Console> {
    console_of(super::LoopbackSession::opened(TICKET, SESSION))
}

fn console_of(session: super::LoopbackSession) -> Arc<Console> {
    let client = kube::Client::new(api_server(), "shop");
    Arc::new(
        Console::new(
            Mode::Loopback { client, session },
            HOST.into(),
            format!("http://{HOST}"),
            vec!["shop".into()],
            "agentrun-system".into(),
        )
        .unwrap(),
    )
}

fn cookie() -> String {
    format!("agentrun_console_4567={SESSION}")
}

fn request(method: &str, uri: &str) -> axum::http::request::Builder {
    Request::builder()
        .method(method)
        .uri(uri)
        .header(header::HOST, HOST)
        .header(header::COOKIE, cookie())
}

async fn send(c: &Arc<Console>, req: Request<Body>) -> (StatusCode, axum::http::HeaderMap, String) {
    let res = router(c.clone()).oneshot(req).await.unwrap();
    let status = res.status();
    let headers = res.headers().clone();
    let body = axum::body::to_bytes(res.into_body(), 1 << 22)
        .await
        .unwrap();
    (status, headers, String::from_utf8_lossy(&body).into_owned())
}

async fn get_page(c: &Arc<Console>, uri: &str) -> (StatusCode, String) {
    let (s, h, b) = send(c, request("GET", uri).body(Body::empty()).unwrap()).await;
    assert_eq!(
        h.get(header::CONTENT_SECURITY_POLICY).unwrap(),
        CSP,
        "{uri}"
    );
    (s, b)
}

fn form(pairs: &[(&str, &str)]) -> Body {
    let mut s = url::form_urlencoded::Serializer::new(String::new());
    for (k, v) in pairs {
        s.append_pair(k, v);
    }
    Body::from(s.finish())
}

#[tokio::test]
async fn the_urls_ticket_opens_one_strict_httponly_session_once_and_nothing_opens_without_it() {
    let c = console_of(super::LoopbackSession::new(TICKET.into()));
    let bare = |uri: &str| {
        Request::get(uri)
            .header(header::HOST, HOST)
            .body(Body::empty())
            .unwrap()
    };
    for uri in [
        "/",
        "/runs",
        "/approvals/shop/r-a2-12345678",
        "/runs/shop/r/records",
    ] {
        let (s, _, b) = send(&c, bare(uri)).await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{uri}");
        assert!(b.contains("no console session"), "{b}");
    }
    let (s, _, _) = send(&c, bare("/?session=wrong")).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let wrong_cookie = Request::get("/")
        .header(header::HOST, HOST)
        .header(header::COOKIE, "agentrun_console_4567=guess")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&c, wrong_cookie).await.0, StatusCode::FORBIDDEN);
    let (s, h, _) = send(&c, bare(&format!("/?session={TICKET}"))).await;
    assert_eq!(s, StatusCode::SEE_OTHER);
    assert_eq!(h.get(header::LOCATION).unwrap(), "/");
    let set = h.get(header::SET_COOKIE).unwrap().to_str().unwrap();
    assert!(
        set.contains("HttpOnly") && set.contains("SameSite=Strict"),
        "{set}"
    );
    let session = set.split(';').next().unwrap().to_string();
    let secret = session.strip_prefix("agentrun_console_4567=").unwrap();
    assert!(
        secret.len() == 64 && secret != TICKET,
        "a secret of its own: {set}"
    );
    let with = |cookie: &str| {
        Request::get("/")
            .header(header::HOST, HOST)
            .header(header::COOKIE, cookie)
            .body(Body::empty())
            .unwrap()
    };
    assert_eq!(send(&c, with(&session)).await.0, StatusCode::OK);
    // The URL, found again in a history or a command line, opens nothing,
    // and its ticket is no session either.
    let (s, h, b) = send(&c, bare(&format!("/?session={TICKET}"))).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    assert!(h.get(header::SET_COOKIE).is_none());
    assert!(b.contains("opened its session already"), "{b}");
    let ticket_cookie = format!("agentrun_console_4567={TICKET}");
    assert_eq!(
        send(&c, with(&ticket_cookie)).await.0,
        StatusCode::FORBIDDEN
    );
    assert_eq!(send(&c, with(&session)).await.0, StatusCode::OK);
    // The stylesheet and script are no secret (and carry no data).
    let (s, _, _) = send(&c, bare("/static/console.css")).await;
    assert_eq!(s, StatusCode::OK);
}

#[tokio::test]
async fn a_foreign_host_or_origin_is_refused() {
    let c = console();
    for host in ["evil.example:4567", "localhost:4567", "127.0.0.1:80"] {
        let req = Request::get("/")
            .header(header::HOST, host)
            .header(header::COOKIE, cookie())
            .body(Body::empty())
            .unwrap();
        let (s, h, b) = send(&c, req).await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{host}");
        assert!(
            b.contains("answers only requests for 127.0.0.1:4567"),
            "{b}"
        );
        assert_eq!(h.get(header::CONTENT_SECURITY_POLICY).unwrap(), CSP);
    }
    // Even the session URL: a rebinding page cannot obtain the cookie.
    let req = Request::get(format!("/?session={TICKET}"))
        .header(header::HOST, "evil.example")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&c, req).await.0, StatusCode::FORBIDDEN);
    for origin in ["http://evil.example", "null", "http://127.0.0.1:4568"] {
        let req = request("GET", "/")
            .header(header::ORIGIN, origin)
            .body(Body::empty())
            .unwrap();
        assert_eq!(send(&c, req).await.0, StatusCode::FORBIDDEN, "{origin}");
    }
    let req = request("GET", "/")
        .header(header::ORIGIN, format!("http://{HOST}"))
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&c, req).await.0, StatusCode::OK);
    // `Origin: null` (a form post under no-referrer) only with the
    // browser's word that it came from this origin.
    let req = request("GET", "/")
        .header(header::ORIGIN, "null")
        .header("sec-fetch-site", "same-origin")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&c, req).await.0, StatusCode::OK);
    let req = request("GET", "/")
        .header(header::ORIGIN, "null")
        .header("sec-fetch-site", "cross-site")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&c, req).await.0, StatusCode::FORBIDDEN);
}

#[tokio::test]
async fn a_write_needs_the_sessions_anti_forgery_token() {
    let c = console();
    let path = "/approvals/shop/r-a2-12345678/decide";
    let token = csrf_token(&c.key, SESSION);
    let fields =
        |csrf: &'static str| vec![("verdict", "Approve"), ("hash", "aaaa"), ("csrf", csrf)];
    for sent in [fields(""), fields("00"), fields("not-hex")] {
        let req = request("POST", path)
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body(form(&sent))
            .unwrap();
        let (s, _, b) = send(&c, req).await;
        assert_eq!(s, StatusCode::FORBIDDEN);
        assert!(b.contains("anti-forgery token"), "{b}");
    }
    // Another session's token does not open this one.
    let other = csrf_token(&c.key, "another-session");
    let hash = "a".repeat(64);
    let req = request("POST", path)
        .body(form(&[
            ("verdict", "Approve"),
            ("hash", &hash),
            ("csrf", &other),
        ]))
        .unwrap();
    assert_eq!(send(&c, req).await.0, StatusCode::FORBIDDEN);
    // The right token passes the gate; the API server's refusal is shown in
    // words (escaped), with its status, not a trace.
    let req = request("POST", path)
        .header(header::ORIGIN, format!("http://{HOST}"))
        .body(form(&[
            ("verdict", "Approve"),
            ("hash", &hash),
            ("csrf", &token),
            ("reason", "ok"),
        ]))
        .unwrap();
    let (s, _, b) = send(&c, req).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{b}");
    assert!(b.contains("the API server refused the decision"), "{b}");
    assert!(
        b.contains("&lt;b&gt;alice&lt;&#x2f;b&gt; is not an approver"),
        "{b}"
    );
    assert!(!b.contains("<b>alice"), "{b}");
    // Only GET and POST.
    let req = request("PUT", path).body(Body::empty()).unwrap();
    assert_eq!(send(&c, req).await.0, StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test]
async fn the_forms_refuse_what_does_not_fit_before_the_api_server_sees_it() {
    let c = console();
    let path = "/approvals/shop/r-a2-12345678/decide";
    let token = csrf_token(&c.key, SESSION);
    let hash = "a".repeat(64);
    // A reject without a reason.
    let req = request("POST", path)
        .body(form(&[
            ("verdict", "Reject"),
            ("hash", &hash),
            ("csrf", &token),
        ]))
        .unwrap();
    let (s, _, b) = send(&c, req).await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(b.contains("A rejection needs a reason"), "{b}");
    // An edit that does not fit the tool's schema.
    let req = request("POST", path)
        .body(form(&[
            ("verdict", "Edit"),
            ("hash", &hash),
            ("csrf", &token),
            ("arg.orderId", ""),
            ("arg.amount", "lots"),
            ("arg.currency", "GBP"),
        ]))
        .unwrap();
    let (s, _, b) = send(&c, req).await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(b.contains("orderId is required"), "{b}");
    assert!(
        b.contains("amount: &quot;lots&quot; is not a number"),
        "{b}"
    );
    assert!(b.contains("is not one of EUR, USD"), "{b}");
    // A decision on other arguments than the approval's.
    let req = request("POST", path)
        .body(form(&[
            ("verdict", "Approve"),
            ("hash", &"b".repeat(64)),
            ("csrf", &token),
        ]))
        .unwrap();
    assert_eq!(send(&c, req).await.0, StatusCode::CONFLICT);
}

#[tokio::test]
async fn model_written_text_is_escaped_everywhere_and_never_a_link() {
    let c = console();
    for uri in ["/", "/approvals/shop/r-a2-12345678", "/runs"] {
        let (s, b) = get_page(&c, uri).await;
        assert_eq!(s, StatusCode::OK, "{uri}: {b}");
        assert!(!b.contains("<img"), "{uri}: {b}");
        assert!(!b.contains("<script>"), "{uri}: {b}");
        assert!(!b.contains("</script><"), "{uri}: {b}");
        assert!(!b.contains("href=\"javascript"), "{uri}: {b}");
        assert!(!b.contains("<b>"), "{uri}: {b}");
        // The only scripts are the console's own file.
        assert_eq!(b.matches("<script").count(), 1, "{uri}");
        assert!(
            b.contains("<script src=\"/static/console.js\" defer></script>"),
            "{uri}"
        );
    }
    let (_, b) = get_page(&c, "/approvals/shop/r-a2-12345678").await;
    assert!(b.contains("&lt;img src=x onerror=alert(1)&gt;"), "{b}");
    assert!(
        b.contains("&lt;&#x2f;script&gt;&lt;script&gt;alert(2)&lt;&#x2f;script&gt;"),
        "{b}"
    );
    assert!(b.contains("javascript:alert(3)"), "shown as text: {b}");
    assert!(b.contains("&lt;b&gt;7&lt;&#x2f;b&gt;"), "{b}");
}

#[tokio::test]
async fn the_approval_page_shows_the_edit_beside_the_proposal_and_who_may_not_decide() {
    let c = console();
    let (_, b) = get_page(&c, "/approvals/shop/r-a2-12345678").await;
    // bob's edit in its own column, the changed cell marked.
    assert!(b.contains("bob&#x27;s edit"), "{b}");
    assert!(b.contains("class=\"changed\""), "{b}");
    // alice may decide: the three forms, each with the anti-forgery token.
    let token = csrf_token(&c.key, SESSION);
    assert_eq!(
        b.matches(&format!("name=\"csrf\" value=\"{token}\""))
            .count(),
        3,
        "{b}"
    );
    assert!(b.contains(">Approve</button>") && b.contains(">Reject</button>"));
    // The edit form from the tool's schema: required, number, select.
    assert!(
        b.contains("name=\"arg.amount\" type=\"number\" step=\"any\" value=\"500\" required"),
        "{b}"
    );
    assert!(
        b.contains("<select id=\"f-2\" name=\"arg.currency\">"),
        "{b}"
    );
    assert!(b.contains("<option value=\"EUR\">EUR</option>"), "{b}");
    // The reject reason is required in the browser too.
    assert!(
        b.contains(
            "id=\"reject-reason\" name=\"reason\" type=\"text\" maxlength=\"2000\" required"
        ),
        "{b}"
    );
}

#[test]
fn who_may_not_decide_is_said_before_anyone_clicks() {
    let a: crate::api::Approval = serde_json::from_value(hostile_approval()).unwrap();
    assert_eq!(
        views::may_not_decide(&a, "alice", &["finance-approvers".into()]),
        None
    );
    assert_eq!(
        views::may_not_decide(&a, "carol", &["finance-approvers".into()]).unwrap(),
        "you may not decide: separation of duties (you requested this run)"
    );
    assert_eq!(
        views::may_not_decide(&a, "dave", &[]).unwrap(),
        "not an approver"
    );
    assert_eq!(
        views::may_not_decide(&a, "bob", &["finance-approvers".into()]).unwrap(),
        "you have decided"
    );
}

#[tokio::test]
async fn every_answer_carries_the_security_headers() {
    let c = console();
    for uri in [
        "/",
        "/runs",
        "/approvals/shop/r-a2-12345678",
        "/static/console.css",
        "/static/console.js",
        "/nope",
    ] {
        let (_, h, _) = send(&c, request("GET", uri).body(Body::empty()).unwrap()).await;
        assert_eq!(
            h.get(header::CONTENT_SECURITY_POLICY).unwrap(),
            CSP,
            "{uri}"
        );
        assert_eq!(
            h.get(header::X_CONTENT_TYPE_OPTIONS).unwrap(),
            "nosniff",
            "{uri}"
        );
        assert_eq!(
            h.get(header::REFERRER_POLICY).unwrap(),
            "no-referrer",
            "{uri}"
        );
    }
    let (_, h, _) = send(
        &c,
        Request::get("/")
            .header(header::HOST, "x")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(h.get(header::CONTENT_SECURITY_POLICY).unwrap(), CSP);
}

#[tokio::test]
async fn in_the_cluster_a_request_without_a_forwarded_token_is_refused() {
    let c = Arc::new(
        Console::new(
            Mode::InCluster(ClusterAccess {
                api_server: "https://127.0.0.1:1".parse().unwrap(),
                ca: vec![],
            }),
            "console.example".into(),
            "https://console.example".into(),
            vec![],
            "agentrun-system".into(),
        )
        .unwrap(),
    );
    let req = Request::get("/")
        .header(header::HOST, "console.example")
        .body(Body::empty())
        .unwrap();
    let (s, _, b) = send(&c, req).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert!(b.contains("no forwarded credential"), "{b}");
    // A session secret means nothing there; nor does another Host.
    let req = Request::get("/?session=x")
        .header(header::HOST, "127.0.0.1:8080")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&c, req).await.0, StatusCode::FORBIDDEN);
    let mut h = axum::http::HeaderMap::new();
    h.insert("x-forwarded-access-token", "tok-1".parse().unwrap());
    assert_eq!(guard::bearer(&h).as_deref(), Some("tok-1"));
    let mut h = axum::http::HeaderMap::new();
    h.insert(header::AUTHORIZATION, "Bearer tok-2".parse().unwrap());
    assert_eq!(guard::bearer(&h).as_deref(), Some("tok-2"));
    h.insert("x-forwarded-access-token", "tok-3".parse().unwrap());
    assert_eq!(
        guard::bearer(&h).as_deref(),
        Some("tok-2"),
        "the ID token first"
    );
    h.insert(header::AUTHORIZATION, "Basic dXNlcg==".parse().unwrap());
    assert_eq!(guard::bearer(&h).as_deref(), Some("tok-3"));
    h.remove("x-forwarded-access-token");
    assert_eq!(guard::bearer(&h), None);
    // The anti-forgery token is bound to the person's token.
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, b"k");
    let t = csrf_token(&key, "tok-1");
    assert!(guard::csrf_ok(&key, "tok-1", &t));
    assert!(!guard::csrf_ok(&key, "tok-2", &t));
}

#[tokio::test]
async fn a_budget_question_offers_the_budget_limits_as_its_form() {
    let c = console();
    let (s, b) = get_page(&c, "/approvals/shop/r-a9-12345678").await;
    assert_eq!(s, StatusCode::OK, "{b}");
    assert!(b.contains("Budget exhausted: may run"), "{b}");
    assert!(b.contains("Go on with other limits"), "{b}");
    assert!(
        b.contains("name=\"arg.maxSteps\" type=\"number\" step=\"1\" value=\"40\""),
        "{b}"
    );
    assert!(
        b.contains("name=\"arg.maxCostUSD\" type=\"number\" step=\"any\""),
        "{b}"
    );
    let token = csrf_token(&c.key, SESSION);
    let hash = "a".repeat(64);
    let req = request("POST", "/approvals/shop/r-a9-12345678/decide")
        .body(form(&[
            ("verdict", "Edit"),
            ("hash", &hash),
            ("csrf", &token),
            ("arg.maxSteps", "0"),
        ]))
        .unwrap();
    let (s, _, b) = send(&c, req).await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
    assert!(
        b.contains("maxSteps: 0 is less than the minimum of 1"),
        "{b}"
    );
}

/// How the timeline shows `step`, recorded at `seq`.
fn timeline_entry(seq: u64, kind: crate::store::StepKind, step: &crate::replay::Entry) -> Value {
    let record = crate::store::Record {
        format: 2,
        seq,
        kind,
        payload: step.payload(),
        versions: Default::default(),
        usage: Default::default(),
        worker: Default::default(),
        prev_hash: Default::default(),
        hash: Default::default(),
        created_at: None,
    };
    serde_json::to_value(views::entry(&record, false)).unwrap()
}

/// A container agent's run (issue 41) started on its image, not on a
/// prompt it does not have: the timeline and the run's facts say which.
#[test]
fn a_container_runs_timeline_names_its_image_not_an_empty_prompt() {
    use crate::replay::Entry as Step;
    use crate::runlog::records::{RunStarted, Versions};
    use crate::store::StepKind;
    // A container agent's stored template holds an empty prompt.
    let agent = serde_json::from_value(json!({
        "prompt": {"version": "", "system": ""},
        "model": {"provider": "OpenAI", "name": "gpt-e2e", "endpoint": "http://m/v1"}
    }))
    .unwrap();
    let container = serde_json::from_value(json!({
        "image": "agentrun-agents:1", "command": ["plain-agent"], "args": ["--fast"]
    }))
    .unwrap();
    let started = Step::RunStarted(RunStarted {
        run_name: "r".into(),
        namespace: "ns".into(),
        input: "Refund order 1042.".into(),
        agent,
        tools: vec![],
        mcp: Default::default(),
        versions: Versions {
            model: "gpt-e2e".into(),
            tool_schema_hash: "ab".repeat(32),
            ..Versions::default()
        },
        container: Some(container),
    });
    let shown = timeline_entry(0, StepKind::RunStarted, &started);
    assert_eq!(
        shown["what"],
        "started on container agentrun-agents:1 (plain-agent --fast), model gpt-e2e, tool schema abababababab"
    );
}

/// A container agent's long termination message still shows how its step
/// asks to end: the message is cut, not the end.
#[test]
fn a_long_exit_message_is_cut_before_the_end_it_asks_for() {
    use crate::replay::Entry as Step;
    use crate::runlog::records::{Observation, Outcome, RunFinished};
    use crate::store::StepKind;
    let text = format!("the agent exited 1: {}", "Traceback line\n".repeat(100));
    let exited = Step::Observation(Observation {
        text,
        about_seq: None,
        stop: Some(RunFinished {
            outcome: Outcome::Failed,
            result: None,
            error: Some("exit 1".into()),
        }),
        attempts: None,
    });
    let shown = timeline_entry(3, StepKind::Observation, &exited);
    let what = shown["what"].as_str().unwrap();
    assert!(
        what.starts_with("the agent exited 1: Traceback line"),
        "{what}"
    );
    assert!(what.ends_with("…: the step asks to end Failed"), "{what}");
}

#[tokio::test]
async fn a_replay_test_is_marked_as_one_where_runs_are_listed() {
    let c = console();
    let (s, b) = get_page(&c, "/runs").await;
    assert_eq!(s, StatusCode::OK, "{b}");
    let row = b
        .split("<tr>")
        .find(|row| row.contains("r-test-x7"))
        .expect("the test is listed");
    assert!(row.contains("replay test of r"), "{row}");
    let plain = b.split("<tr>").find(|row| row.contains(">r</a>")).unwrap();
    assert!(!plain.contains("replay test"), "{plain}");
}

#[tokio::test]
async fn fork_from_here_creates_the_fork_as_the_person_and_goes_to_its_page() {
    let c = console();
    let token = csrf_token(&c.key, SESSION);
    let req = request("POST", "/runs/shop/r/fork")
        .header(header::ORIGIN, format!("http://{HOST}"))
        .body(form(&[("seq", "3"), ("csrf", &token)]))
        .unwrap();
    let (s, h, b) = send(&c, req).await;
    assert_eq!(s, StatusCode::SEE_OTHER, "{b}");
    assert_eq!(
        h.get(header::LOCATION).unwrap(),
        "/runs/shop/r%2Dfork%2Dat%2D3",
        "the fork's page (its name as a path segment)"
    );
    // Without the token, or at the run's start, nothing is created.
    let req = request("POST", "/runs/shop/r/fork")
        .body(form(&[("seq", "3")]))
        .unwrap();
    assert_eq!(send(&c, req).await.0, StatusCode::FORBIDDEN);
    let req = request("POST", "/runs/shop/r/fork")
        .body(form(&[("seq", "0"), ("csrf", &token)]))
        .unwrap();
    let (s, _, b) = send(&c, req).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(b.contains("seq"), "{b}");
}
