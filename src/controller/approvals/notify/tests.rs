use super::*;
use crate::runlog::records::Gate;
use crate::runlog::v1::Approvers;

const APPROVAL: &str = "refund-order-1042-a4-9f86d081";
const CONSOLE: &str = "https://agentrun.example.com";

fn run() -> AgentRun {
    let mut run = AgentRun::new("refund-order-1042", Default::default());
    run.metadata.namespace = Some("shop".into());
    run.metadata.uid = Some("0d6f6c1e-uid".into());
    run.metadata.annotations = Some(
        [(
            crate::api::REQUESTER_ANNOTATION.to_string(),
            "bob".to_string(),
        )]
        .into_iter()
        .collect(),
    );
    run
}

fn request(arguments: Value, reason: &str) -> ApprovalRequested {
    ApprovalRequested {
        model_call_seq: 3,
        call_index: 0,
        call_id: "c1".into(),
        tool: "issue_refund".into(),
        arguments_hash: crate::policy::arguments_hash("issue_refund", &arguments),
        arguments,
        reason: Some(reason.into()),
        observations: vec![],
        dependencies: vec![],
        gate: Gate {
            rule: "large-refund".into(),
            because: "args.amount > 100".into(),
            approvers: Approvers {
                users: vec![],
                groups: vec!["finance-approvers".into()],
            },
            required_approvals: 1,
            expires_after: "1h".into(),
            separation_of_duties: true,
            notify_webhook: Some("https://hooks.example.com/services/T0/B0/secret".into()),
            notify_format: Some(NotifyFormat::Slack),
            ..Gate::default()
        },
        escalation: 0,
        alternative: None,
        kind: ApprovalKind::Call,
        intent_seq: None,
    }
}

/// The fixed approval of these tests: a refund of 500 for order 1042.
fn refund() -> ApprovalRequested {
    request(
        json!({"orderId": "1042", "amount": 500}),
        "The customer was charged twice & asked for the money back.",
    )
}

fn raised(request: &ApprovalRequested, console: Option<&str>) -> Message {
    Message::of(
        &run(),
        APPROVAL,
        request,
        NoticeKind::Raised,
        &json!({"expiresAt": "2026-12-04T05:00:00Z"}),
        console,
    )
}

fn fixture(text: &str) -> Value {
    serde_json::from_str(text).expect("fixture is JSON")
}

/// Follows Slack's Block Kit reference for incoming webhooks
/// (https://docs.slack.dev/reference/block-kit/blocks/header-block,
/// .../section-block: `text` or up to 10 `fields`, mrkdwn text objects;
/// https://api.slack.com/reference/surfaces/formatting#escaping: `&`, `<`,
/// `>` as entities; a link as `<url|text>`; top-level `text` as the
/// notification's fallback).
#[test]
fn a_raised_approval_in_slack_is_the_published_block_kit_message() {
    let got = slack(&raised(&refund(), Some(CONSOLE)));
    let want = fixture(include_str!("../testdata/slack-raised.json"));
    assert_eq!(got, want, "{}", serde_json::to_string_pretty(&got).unwrap());
}

/// The same reference; a decision lists who decided and why, and without
/// `--console-url` the message has the plugin command but no link.
#[test]
fn a_decision_in_slack_names_the_approvers_and_without_a_console_has_no_link() {
    let m = Message::of(
        &run(),
        APPROVAL,
        &refund(),
        NoticeKind::Decided,
        &json!({"verdict": "Reject", "decisions": [
            {"approver": "alice", "verdict": "Reject", "argumentsHash": "h", "reason": "amount exceeds policy"}
        ]}),
        None,
    );
    let got = slack(&m);
    let want = fixture(include_str!("../testdata/slack-decided.json"));
    assert_eq!(got, want, "{}", serde_json::to_string_pretty(&got).unwrap());
}

/// Follows Microsoft's "Send Adaptive Cards using an Incoming Webhook"
/// (learn.microsoft.com/microsoftteams/platform/webhooks-and-connectors/how-to/connectors-using:
/// `{"type": "message", "attachments": [{"contentType":
/// "application/vnd.microsoft.card.adaptive", "contentUrl": null, "content":
/// {...}}]}`) and the Adaptive Cards schema
/// (http://adaptivecards.io/schemas/adaptive-card.json, version 1.4:
/// TextBlock, FactSet of title/value facts, Action.OpenUrl), with text
/// formatted as in learn.microsoft.com/microsoftteams/platform/task-modules-and-cards/cards/cards-format
/// (markdown in TextBlock and Fact values).
#[test]
fn a_raised_approval_in_teams_is_the_published_adaptive_card_message() {
    let got = teams(&raised(&refund(), Some(CONSOLE)));
    let want = fixture(include_str!("../testdata/teams-raised.json"));
    assert_eq!(got, want, "{}", serde_json::to_string_pretty(&got).unwrap());
}

#[test]
fn every_event_says_what_happened() {
    let r = refund();
    let say = |event: NoticeKind, detail: Value| {
        let m = Message::of(&run(), APPROVAL, &r, event, &detail, None);
        (m.title, m.summary)
    };
    assert_eq!(
        say(NoticeKind::Raised, json!({})).0,
        "Approval needed: issue_refund"
    );
    let (title, summary) = say(NoticeKind::Escalated, json!({"escalation": 1}));
    assert_eq!(title, "Approval escalated: issue_refund");
    assert!(
        summary.contains("Nobody decided refund-order-1042-a4-9f86d081 in time: escalated to group finance-approvers (escalation 1 of"),
        "{summary}"
    );
    assert_eq!(
        say(NoticeKind::Decided, json!({"verdict": "Approve"})).0,
        "Approval approved: issue_refund"
    );
    assert_eq!(
        say(NoticeKind::Decided, json!({"verdict": "Edit"})).0,
        "Approval approved with edited arguments: issue_refund"
    );
    let (title, summary) = say(NoticeKind::Expired, json!({"verdict": "Expired"}));
    assert_eq!(title, "Approval expired: issue_refund");
    assert!(summary.contains("the call was not made"), "{summary}");
}

#[test]
fn the_rule_quorum_and_arguments_are_plain_facts() {
    let r = refund();
    assert_eq!(rule(&r.gate), "large-refund (args.amount > 100)");
    assert_eq!(
        quorum(&r.gate),
        "1 of group finance-approvers, not the requester"
    );
    let mut gate = r.gate.clone();
    gate.because = String::new();
    gate.separation_of_duties = false;
    gate.required_approvals = 2;
    gate.approvers.users = vec!["alice".into(), "bob".into()];
    assert_eq!(rule(&gate), "large-refund");
    assert_eq!(
        quorum(&gate),
        "2 of users alice, bob; group finance-approvers"
    );
    let pair = |k: &str, v: &str| (k.to_string(), v.to_string());
    assert_eq!(
        arguments(&json!({"amount": 500, "note": "x"})),
        [pair("amount", "500"), pair("note", "\"x\"")]
    );
    assert!(arguments(&Value::Null).is_empty());
    assert_eq!(arguments(&json!([1])), [pair("arguments", "[1]")]);
    let detail = json!({"decisions": [{"approver": "alice", "verdict": "Approve"}]});
    assert_eq!(
        decisions(&detail),
        [("alice".to_string(), "Approve".to_string(), None)]
    );
    assert!(decisions(&json!({})).is_empty());
}

#[test]
fn an_undelivered_notification_says_how_often_it_was_tried() {
    assert_eq!(
        undelivered(&Failure::Status(500), 4),
        "HTTP 500 after 4 attempts"
    );
    assert_eq!(undelivered(&Failure::Status(404), 1), "HTTP 404");
    assert_eq!(
        undelivered(&Failure::Error("timeout"), 2),
        "timeout after 2 attempts"
    );
}

/// A model's text never becomes markup: no link of its naming, no
/// `<!channel>`, no mention, in Slack or in Teams.
#[test]
fn model_text_is_escaped_for_each_receiver() {
    let hostile = request(
        json!({"note": "<https://evil.example|click here> <!channel> <@U123> [click](https://evil.example) `x`"}),
        "Refund now: <https://evil.example|the policy> [approve here](https://evil.example) <!here>",
    );
    let m = raised(&hostile, Some(CONSOLE));
    let s = slack(&m).to_string();
    for bad in ["<https://evil", "<!channel>", "<!here>", "<@U123>"] {
        assert!(!s.contains(bad), "slack message has {bad}: {s}");
    }
    assert!(s.contains("&lt;https://evil.example|click here&gt; &lt;!channel&gt;"));
    // The only link is the console's.
    assert_eq!(s.matches('<').count(), 1, "{s}");

    let t = teams(&m).to_string();
    assert!(!t.contains("[click](https"), "{t}");
    assert!(!t.contains("[approve here]("), "{t}");
    assert!(!t.contains("]("), "no ] meets ( in {t}");
    assert!(t.contains(r"\\[click\\]\\(https://evil.example\\)"), "{t}");

    assert_eq!(
        slack_escape("a & b <c> `d`"),
        "a &amp; b &lt;c&gt; \u{2035}d\u{2035}"
    );
    assert_eq!(teams_escape("[x](y) **b** \\"), r"\[x\]\(y\) \*\*b\*\* \\");
}

/// Nothing a message holds is a secret or acts: no webhook URL, no hash to
/// quote, no token; the only link opens the console.
#[test]
fn messages_carry_no_secret_and_no_decision_power() {
    let m = raised(&refund(), Some(CONSOLE));
    for body in [slack(&m), teams(&m)] {
        let s = body.to_string();
        assert!(!s.contains("hooks.example.com"), "{s}");
        assert!(!s.contains(&refund().arguments_hash), "{s}");
        assert!(!s.contains("token"), "{s}");
    }
}

/// Where a Slack message passes a Block Kit limit: a header's text (150),
/// a section's text (3000), a section's fields (10) and each field's text
/// (2000), the blocks (50), the fallback `text` (kept to a section's 3000);
/// empty when it passes none.
fn slack_over_limits(message: &Value) -> Vec<String> {
    // In UTF-16 code units: never fewer than characters (see `units`).
    let chars = |v: &Value| v.as_str().map_or(0, units);
    let mut over = Vec::new();
    let mut check = |what: String, n: usize, max: usize| {
        if n > max {
            over.push(format!("{what}: {n} > {max}"));
        }
    };
    check("text".into(), chars(&message["text"]), SLACK_SECTION_MAX);
    let blocks = message["blocks"].as_array().cloned().unwrap_or_default();
    check("blocks".into(), blocks.len(), SLACK_BLOCKS_MAX);
    for (i, b) in blocks.iter().enumerate() {
        let text = chars(&b["text"]["text"]);
        match b["type"].as_str() {
            Some("header") => check(format!("block {i} header"), text, SLACK_HEADER_MAX),
            _ => check(format!("block {i} text"), text, SLACK_SECTION_MAX),
        }
        let fields = b["fields"].as_array().cloned().unwrap_or_default();
        check(format!("block {i} fields"), fields.len(), SLACK_FIELDS_MAX);
        for (j, f) in fields.iter().enumerate() {
            check(
                format!("block {i} field {j}"),
                chars(&f["text"]),
                SLACK_FIELD_MAX,
            );
        }
    }
    over
}

/// A Teams message's size as sent.
fn teams_bytes(message: &Value) -> usize {
    serde_json::to_vec(message).unwrap().len()
}

/// The outside review's attack: a gated call whose argument KEY is 450 `&`
/// (each escaped to `&amp;`, 2,250 characters as a field's title) under
/// `notifyFormat: Slack`. It overflowed the field's room (a panic that
/// ended the controller; a release build wrapped and cut nothing).
#[test]
fn a_key_of_450_ampersands_in_slack_is_cut_within_every_limit() {
    let key = "&".repeat(450);
    let r = request(json!({ key.clone(): "x", "amount": 500 }), "because");
    let s = slack(&raised(&r, Some(CONSOLE)));
    assert_eq!(slack_over_limits(&s), Vec::<String>::new());
    let fields = s["blocks"][3]["fields"].as_array().unwrap();
    let field = fields
        .iter()
        .map(|f| f["text"].as_str().unwrap())
        .find(|t| t.starts_with("*&amp;"))
        .expect("the key's field is shown");
    assert!(
        field.contains("more bytes; see kubectl agentrun show"),
        "{field}"
    );
    assert!(field.ends_with("\n`\"x\"`"), "the value is whole: {field}");
    assert!(
        !field.replace("&amp;", "").contains('&'),
        "cut between entities: {field}"
    );
}

/// The same class in Teams: a key of 30,000 characters made a card of 31 KB
/// (fact titles were escaped but never cut; the card gave up shrinking).
#[test]
fn a_key_of_30000_characters_in_teams_fits_its_28_kb() {
    for key in ["k".repeat(30_000), "[".repeat(30_000), "界".repeat(30_000)] {
        let r = request(json!({ key: "x" }), "because");
        let t = teams(&raised(&r, Some(CONSOLE)));
        assert!(teams_bytes(&t) <= TEAMS_MAX_BYTES, "{}", teams_bytes(&t));
        let facts = &t["attachments"][0]["content"]["body"][4]["facts"];
        let title = facts[0]["title"].as_str().unwrap();
        assert!(
            title.contains("more bytes; see kubectl agentrun show"),
            "{title}"
        );
    }
}

/// However much there is (here 3,000 decisions, each line of which alone
/// fits), the card that goes out fits: the shortest one, which says where
/// to see it all.
#[test]
fn a_teams_card_too_big_at_every_cut_is_the_short_card() {
    let mut m = raised(&refund(), Some(CONSOLE));
    m.decisions = (0..3000)
        .map(|i| (format!("approver-{i}"), "Approve".into(), Some("ok".into())))
        .collect();
    let t = teams(&m);
    assert!(teams_bytes(&t) <= TEAMS_MAX_BYTES, "{}", teams_bytes(&t));
    let s = t.to_string();
    assert!(s.contains("Too much to show here"), "{s}");
    assert!(s.contains(&m.command), "{s}");
    assert!(s.contains(CONSOLE), "the console link stays: {s}");
    // Slack shows the decisions that fit and says how many more there are.
    let s = slack(&m);
    assert_eq!(slack_over_limits(&s), Vec::<String>::new());
    let summary = s["blocks"][1]["text"]["text"].as_str().unwrap();
    assert!(
        summary.contains("more decisions; see `kubectl agentrun show"),
        "{summary}"
    );
}

/// `fit` keeps to `max` even when its note does not fit in it: "…" alone
/// marks the cut, and with no room at all nothing is shown.
#[test]
fn fit_never_passes_its_max_even_without_room_for_the_note() {
    let long = "<&>".repeat(100);
    for max in 0..80 {
        let escapes: [fn(&str) -> String; 3] = [slack_escape, teams_escape, |s| s.to_string()];
        for escape in escapes {
            let got = fit(&long, max, escape);
            assert!(units(&got) <= max, "{max}: {got}");
        }
    }
    assert_eq!(fit("abcdef", 3, |s| s.to_string()), "ab…");
    assert_eq!(fit("abcdef", 0, |s| s.to_string()), "");
    assert_eq!(fit("&&", 4, slack_escape), "…", "never half an entity");
}

#[test]
fn long_text_is_cut_with_a_note_within_slack_limits() {
    let long = "x".repeat(5000);
    let many: Map<String, Value> = (0..25)
        .map(|i| (format!("k{i:02}"), json!("<".repeat(3000))))
        .collect();
    let mut r = request(Value::Object(many), &"<&>".repeat(2000));
    r.tool = "t".repeat(200);
    let m = raised(&r, Some(CONSOLE));
    let s = slack(&m);
    assert_eq!(slack_over_limits(&s), Vec::<String>::new());
    let blocks = s["blocks"].as_array().unwrap();
    let args = &blocks[3]["fields"];
    assert_eq!(args.as_array().unwrap().len(), SLACK_FIELDS_MAX);
    let last = args[9]["text"].as_str().unwrap();
    assert!(
        last.contains("16 more arguments; see kubectl agentrun show"),
        "{last}"
    );
    let first = args[0]["text"].as_str().unwrap();
    assert!(
        first.contains("more bytes; see kubectl agentrun show"),
        "{first}"
    );
    assert!(!first.contains('<'), "cut text stays escaped: {first}");
    let reason = blocks[4]["text"]["text"].as_str().unwrap();
    assert!(reason.contains("… cut, "), "{reason}");

    let cut = fit(&long, 100, |s| s.to_string());
    assert!(cut.chars().count() <= 100, "{cut}");
    assert!(
        cut.ends_with("more bytes; see kubectl agentrun show"),
        "{cut}"
    );
    let n: usize = cut
        .split("cut, ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(n, 5000 - cut.split('…').next().unwrap().len());
    assert_eq!(fit("short", 100, slack_escape), "short");
}

#[test]
fn a_teams_message_fits_its_28_kb_with_a_note() {
    let many: Map<String, Value> = (0..25)
        .map(|i| (format!("k{i:02}"), json!("é[](".repeat(1000))))
        .collect();
    let r = request(Value::Object(many), &"ü".repeat(20_000));
    let t = teams(&raised(&r, Some(CONSOLE)));
    let size = serde_json::to_vec(&t).unwrap().len();
    assert!(size <= TEAMS_MAX_BYTES, "{size}");
    let s = t.to_string();
    assert!(s.contains("more bytes; see kubectl agentrun show"), "{s}");
    assert!(s.contains("16 more arguments"), "{s}");
    // Small ones are whole.
    let small = serde_json::to_vec(&teams(&raised(&refund(), None))).unwrap();
    assert!(small.len() < 4096);
}

#[test]
fn the_console_url_is_an_http_base_without_secrets() {
    assert_eq!(
        console_url("https://agentrun.example.com/").unwrap(),
        "https://agentrun.example.com"
    );
    assert_eq!(
        console_url("http://127.0.0.1:8080/agentrun").unwrap(),
        "http://127.0.0.1:8080/agentrun"
    );
    for bad in [
        "ftp://example.com",
        "javascript:alert(1)",
        "example.com",
        "https://user:pw@example.com",
        "https://example.com/?token=x",
        "https://example.com/#x",
        "https://example.com/a|b",
    ] {
        assert!(console_url(bad).is_err(), "{bad}");
    }
    let m = raised(&refund(), Some("https://agentrun.example.com"));
    assert_eq!(
        m.link.as_deref(),
        Some("https://agentrun.example.com/approvals/shop/refund-order-1042-a4-9f86d081")
    );
}

#[test]
fn retry_after_is_seconds_or_a_date() {
    let mut h = reqwest::header::HeaderMap::new();
    let now: jiff::Timestamp = "2026-12-04T04:00:00Z".parse().unwrap();
    assert_eq!(retry_after(&h, now), None);
    h.insert(reqwest::header::RETRY_AFTER, "7".parse().unwrap());
    assert_eq!(retry_after(&h, now), Some(Duration::from_secs(7)));
    h.insert(
        reqwest::header::RETRY_AFTER,
        "Fri, 04 Dec 2026 04:00:12 GMT".parse().unwrap(),
    );
    assert_eq!(retry_after(&h, now), Some(Duration::from_secs(12)));
    h.insert(reqwest::header::RETRY_AFTER, "soon".parse().unwrap());
    assert_eq!(retry_after(&h, now), None);
}

#[test]
fn webhook_deliveries_are_capped_per_namespace_and_in_all() {
    let slots = WebhookSlots::new(5, 2);
    let a: Vec<_> = (0..2).map(|_| slots.try_acquire("a").unwrap()).collect();
    assert!(slots.try_acquire("a").is_none(), "a's share is full");
    let b: Vec<_> = (0..2).map(|_| slots.try_acquire("b").unwrap()).collect();
    let c = slots
        .try_acquire("c")
        .expect("another namespace still gets one");
    assert!(slots.try_acquire("d").is_none(), "all slots in use");
    drop(a);
    assert!(
        slots.try_acquire("a").is_some(),
        "given back when delivered"
    );
    drop((b, c));
    assert_eq!(slots.global.available_permits(), 5);
}

/// A receiver answering each request with the next status of `script`
/// (the last one again when it runs out), headers `headers` with each;
/// returns its URL and the number of requests it got.
async fn receiver(
    script: Vec<u16>,
    headers: Vec<(&'static str, &'static str)>,
) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let got = std::sync::Arc::new(AtomicUsize::new(0));
    let seen = got.clone();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move || {
            let n = seen.fetch_add(1, Ordering::SeqCst);
            let status = *script.get(n).or(script.last()).unwrap();
            let headers = headers.clone();
            async move {
                let mut r = axum::response::Response::builder().status(status);
                for (k, v) in headers {
                    r = r.header(k, v);
                }
                r.body(axum::body::Body::from("the receiver's secret reply"))
                    .unwrap()
            }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}/hook"), got)
}

const FAST: Retry = Retry {
    attempts: 4,
    backoff: Duration::from_millis(10),
    max_retry_after: Duration::from_millis(1500),
    timeout: Duration::from_secs(5),
};

#[tokio::test]
async fn a_delivery_is_retried_on_5xx_408_and_429_and_not_on_other_4xx() {
    use std::sync::atomic::Ordering;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::new();
    let body = json!({"text": "hi"});

    let (url, got) = receiver(vec![500, 200], vec![]).await;
    assert_eq!(deliver(&http, &url, &body, FAST).await, Ok(2));
    assert_eq!(got.load(Ordering::SeqCst), 2);

    let (url, got) = receiver(vec![408, 503, 200], vec![]).await;
    assert_eq!(deliver(&http, &url, &body, FAST).await, Ok(3));
    assert_eq!(got.load(Ordering::SeqCst), 3);

    let (url, got) = receiver(vec![500], vec![]).await;
    assert_eq!(
        deliver(&http, &url, &body, FAST).await,
        Err((Failure::Status(500), 4))
    );
    assert_eq!(got.load(Ordering::SeqCst), 4, "four attempts, no more");

    for status in [400, 403, 404] {
        let (url, got) = receiver(vec![status], vec![]).await;
        assert_eq!(
            deliver(&http, &url, &body, FAST).await,
            Err((Failure::Status(status), 1))
        );
        assert_eq!(got.load(Ordering::SeqCst), 1, "{status} is not tried again");
    }

    // A 429 waits its Retry-After (capped), not the backoff.
    let (url, got) = receiver(vec![429, 200], vec![("retry-after", "1")]).await;
    let started = std::time::Instant::now();
    assert_eq!(deliver(&http, &url, &body, FAST).await, Ok(2));
    assert!(started.elapsed() >= Duration::from_secs(1));
    assert_eq!(got.load(Ordering::SeqCst), 2);
    let (url, _) = receiver(vec![429, 200], vec![("retry-after", "3600")]).await;
    let started = std::time::Instant::now();
    assert_eq!(deliver(&http, &url, &body, FAST).await, Ok(2));
    assert!(started.elapsed() < Duration::from_secs(3), "capped");

    // Nobody listening: a connection error, tried again.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", closed.local_addr().unwrap());
    drop(closed);
    assert_eq!(
        deliver(&http, &url, &body, FAST).await,
        Err((Failure::Error("connection failed"), 4))
    );
}

#[test]
fn the_default_retry_is_four_attempts_one_two_four_seconds_apart() {
    assert_eq!(RETRY.attempts, 4);
    assert_eq!(RETRY.backoff, Duration::from_secs(1));
    assert_eq!(RETRY.max_retry_after, Duration::from_secs(30));
    assert_eq!(RETRY.timeout, Duration::from_secs(5));
}

#[test]
fn the_json_event_is_unchanged() {
    let body = json_body(
        &run(),
        APPROVAL,
        &refund(),
        NoticeKind::Raised,
        &json!({"expiresAt": "2026-12-04T05:00:00Z"}),
    );
    assert_eq!(
        body,
        json!({
            "event": "raised",
            "namespace": "shop",
            "run": "refund-order-1042",
            "approval": APPROVAL,
            "tool": "issue_refund",
            "arguments": {"orderId": "1042", "amount": 500},
            "argumentsHash": refund().arguments_hash,
            "rule": "large-refund",
            "approvers": {"users": [], "groups": ["finance-approvers"]},
            "detail": {"expiresAt": "2026-12-04T05:00:00Z"},
        })
    );
}

/// Fuzzing the formatters: any message, with any text in any field (the
/// characters of each receiver's markup, other scripts, control
/// characters, up to 40,000 of them), formats without a panic within every
/// limit of the place it lands.
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    /// Characters that mean something to Slack's mrkdwn, to Teams'
    /// markdown or to JSON, wide ones, and controls; now and then any.
    fn hostile_char() -> impl Strategy<Value = char> {
        prop_oneof![
            3 => prop::sample::select(vec![
                '&', '<', '>', '`', '[', ']', '(', ')', '*', '\\', '|', '_', '~', '"', '\n',
                'a', ' ', 'é', '界', '😀', '\u{0}', '\u{1b}', '\u{202e}',
            ]),
            1 => any::<char>(),
        ]
    }

    /// Mostly short text; one in ten a run of up to 40,000 characters.
    fn text() -> impl Strategy<Value = String> {
        let short = prop::collection::vec(hostile_char(), 0..40).prop_map(String::from_iter);
        let long = (
            prop::collection::vec(hostile_char(), 0..8),
            hostile_char(),
            0usize..=40_000,
        )
            .prop_map(|(head, c, n)| {
                let mut s = String::from_iter(head);
                s.extend(std::iter::repeat_n(c, n));
                s
            });
        prop_oneof![9 => short, 1 => long]
    }

    fn message() -> impl Strategy<Value = Message> {
        let names = (text(), text(), text(), text(), text(), text(), text());
        let facts = (
            prop::option::of(text()),
            text(),
            prop::option::of(text()),
            text(),
            prop::option::of(text()),
            text(),
        );
        let arguments = prop::collection::vec((text(), text()), 0..14);
        let decisions = prop::collection::vec((text(), text(), prop::option::of(text())), 0..8);
        (names, facts, arguments, prop::option::of(text()), decisions).prop_map(
            |(
                (_event, title, summary, namespace, run, approval, tool),
                (requester, rule, expires_at, quorum, link, command),
                arguments,
                reason,
                decisions,
            )| Message {
                event: NoticeKind::Decided,
                title,
                summary,
                namespace,
                run,
                approval,
                tool,
                requester,
                rule,
                expires_at,
                quorum,
                arguments,
                reason,
                decisions,
                link,
                command,
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn any_message_in_slack_meets_every_block_kit_limit(m in message()) {
            let s = slack(&m);
            prop_assert_eq!(slack_over_limits(&s), Vec::<String>::new());
        }

        #[test]
        fn any_message_in_teams_fits_28_kb(m in message()) {
            let t = teams(&m);
            prop_assert!(teams_bytes(&t) <= TEAMS_MAX_BYTES, "{} bytes", teams_bytes(&t));
        }

        #[test]
        fn fit_keeps_to_its_max_and_leaves_text_that_fits_whole(
            s in text(),
            max in prop_oneof![0usize..80, 0usize..4000],
            which in 0usize..3,
        ) {
            let escapes: [fn(&str) -> String; 3] = [slack_escape, teams_escape, |s| s.to_string()];
            let escape = escapes[which];
            let got = fit(&s, max, escape);
            prop_assert!(units(&got) <= max);
            if units(&escape(&s)) <= max {
                prop_assert_eq!(got, escape(&s));
            }
        }
    }
}
