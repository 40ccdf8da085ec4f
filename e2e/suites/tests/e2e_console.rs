//! The approvers' web console end to end (DESIGN.md section 10), on the
//! local control plane, in a real headless Chromium driven through
//! WebDriver: alice approves from her inbox and follows a run live; bob
//! edits an amount through the form built from the tool's schema; carol
//! sees nothing she may do and a decision she forges is refused by the API
//! server; a model's markup shows as text and runs nothing; requests
//! without the session, from another Host or Origin, or writes without the
//! anti-forgery token are refused; and the in-cluster mode acts with the
//! forwarded token of a ServiceAccount. Screenshots of each page go to
//! `$CARGO_TARGET_DIR/e2e-artifacts/console/`.

mod common;

#[path = "common/console.rs"]
mod console;

use std::time::Duration;

use agentrun::api::{Approval, Phase};
use common::approvals::{
    decide, entry, gated_agent, gated_refund_approval, grant_approver_role, live_step_pods,
    pending_approval, refund,
};
use common::container_agents::in_container;
use common::log_api::{self, LogApiWorld};
use common::world::{World, finish};
use console::{Chrome, ConsoleProcess, FormBody as _, csrf_of, http, session_cookie_of};
use kube::api::{Api, PostParams};
use reqwest::StatusCode;
use serde_json::{Value, json};

const PAGE: Duration = Duration::from_secs(30);

async fn approval_named(w: &World, name: &str) -> Approval {
    Api::<Approval>::namespaced(w.client.clone(), w.name())
        .get(name)
        .await
        .unwrap()
}

/// The run's refund tool calls the tool stand-in received.
async fn refunds(w: &World) -> Vec<Value> {
    w.standins
        .tool_requests(w.name())
        .await
        .into_iter()
        .filter(|r| r["tool"] == "issue_refund")
        .collect()
}

#[tokio::test]
async fn alice_approves_from_her_inbox_and_follows_a_run_live() {
    let api = LogApiWorld::start("console-alice").await;
    let w = &api.world;
    let ns = w.name().to_string();
    grant_approver_role(w).await;
    log_api::grant_reader(&w.client, &ns, "alice").await;
    let approval =
        gated_refund_approval(w, "ok", json!([refund(500), finish("refunded 500")])).await;
    let name = approval.metadata.name.clone().unwrap();

    let console = ConsoleProcess::loopback("alice", &ns);
    let chrome = Chrome::start().await;
    let b = &chrome.browser;
    b.goto(&console.session_url).await.unwrap();
    let inbox = chrome.wait_text("Approvals waiting", PAGE).await;
    assert_eq!(
        b.current_url().await.unwrap().as_str(),
        format!("{}/", console.base),
        "the secret left the URL"
    );
    for shown in [
        name.as_str(),
        "issue_refund",
        "large-refund",
        "0 of 1",
        "you may decide",
    ] {
        assert!(inbox.contains(shown), "the inbox shows {shown:?}:\n{inbox}");
    }
    chrome.screenshot("inbox").await;

    chrome.click_link(&name).await;
    let page = chrome.wait_text("Why the agent asks", PAGE).await;
    for shown in [
        "charged twice",
        "orderId",
        "\"1042\"",
        "500",
        "No decision yet.",
        "group finance-approvers",
    ] {
        assert!(
            page.contains(shown),
            "the approval shows {shown:?}:\n{page}"
        );
    }
    chrome.screenshot("approval").await;
    chrome
        .fill("Reason (optional)", "duplicate charge confirmed")
        .await;
    chrome.click_button("Approve").await;
    let after = chrome.wait_text("Your approval was recorded.", PAGE).await;
    assert!(after.contains("alice: Approve"), "{after}");

    w.wait_phase("ok", Phase::Succeeded).await;
    let decided = approval_named(w, &name).await;
    assert_eq!(decided.spec.decisions.len(), 1);
    let d = &decided.spec.decisions[0];
    assert_eq!(d.approver, "alice");
    assert_eq!(d.reason.as_deref(), Some("duplicate charge confirmed"));
    assert_eq!(d.arguments_hash, approval.spec.arguments_hash);
    let calls = refunds(w).await;
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0]["args"], json!({"orderId": "1042", "amount": 500}));

    // The finished run's timeline, from the log API, verified.
    b.goto(&format!("{}/runs/{ns}/ok", console.base))
        .await
        .unwrap();
    let timeline = chrome.wait_text("Timeline", PAGE).await;
    for shown in [
        "Succeeded",
        "RunStarted",
        "ApprovalRequested",
        "ApprovalDecided",
        "alice Approve (duplicate charge confirmed)",
        "ToolResult",
        "RunFinished",
        "tokens in",
        "verified:",
    ] {
        assert!(
            timeline.contains(shown),
            "the timeline shows {shown:?}:\n{timeline}"
        );
    }
    assert!(!timeline.contains("NOT VERIFIED"), "{timeline}");
    chrome.screenshot("run-timeline").await;

    // A run followed live: the page shows what happens after it opened.
    let waiting =
        gated_refund_approval(w, "follow", json!([refund(700), finish("refunded 700")])).await;
    b.goto(&format!("{}/runs/{ns}/follow", console.base))
        .await
        .unwrap();
    let before = chrome.wait_text("Following this run live", PAGE).await;
    assert!(
        before.contains("ApprovalRequested") && !before.contains("RunFinished"),
        "{before}"
    );
    decide(
        w,
        "bob",
        waiting.metadata.name.as_deref().unwrap(),
        entry("bob", "Approve", &waiting.spec.arguments_hash, "ok"),
    )
    .await
    .expect("bob approves");
    let live = chrome
        .wait_text("RunFinished", Duration::from_secs(90))
        .await;
    assert!(live.contains("ToolResult"), "{live}");
    // Then the page as it now stands: the approval decided, nothing followed.
    let live = chrome.wait_text("Approved — bob (Approve)", PAGE).await;
    assert!(!live.contains("Following this run live"), "{live}");
    assert!(
        live.contains("verified:") && !live.contains("NOT VERIFIED"),
        "{live}"
    );
    assert!(live.contains("bob Approve (ok)"), "{live}");
    chrome.screenshot("run-followed-live").await;

    b.goto(&format!("{}/runs", console.base)).await.unwrap();
    let runs = chrome.wait_text("Runs", PAGE).await;
    assert!(
        runs.contains("follow") && runs.contains("Succeeded"),
        "{runs}"
    );
    chrome.screenshot("runs").await;

    // A record altered in the database: the timeline says NOT VERIFIED,
    // marks the record, and never calls the log verified.
    let run = Api::<agentrun::api::AgentRun>::namespaced(w.client.clone(), &ns)
        .get("ok")
        .await
        .unwrap();
    let touched =
        log_api::rewrite_record(&log_api::uid_of(&run), 1, "charged twice", "charged thrice").await;
    assert_eq!(touched, 1, "record 1 rewritten");
    b.goto(&format!("{}/runs/{ns}/ok", console.base))
        .await
        .unwrap();
    let altered = chrome.wait_text("NOT VERIFIED", PAGE).await;
    assert!(!altered.contains("verified: "), "{altered}");
    assert!(
        altered.contains("! 1"),
        "the altered record is marked: {altered}"
    );
    chrome.screenshot("run-not-verified").await;
    chrome.browser.clone().close().await.ok();
}

/// A container agent's gated refund (issue 41), decided in the console as
/// a built-in agent's is: the unmodified plain agent of e2e/agents/ asks for
/// a refund over the limit, and its run waits with no pod. alice reads the
/// call the agent made (its tool and arguments) and approves it. The agent
/// starts over in a new pod and is answered from the log up to the call. The
/// refund is made once with the approved arguments. The model is asked as
/// often as for a twin run whose refund is under the limit (no pause).
#[tokio::test]
async fn alice_approves_a_container_agents_refund_and_it_resumes_by_replay() {
    let api = LogApiWorld::start("console-cagent").await;
    let w = &api.world;
    let ns = w.name().to_string();
    grant_approver_role(w).await;
    log_api::grant_reader(&w.client, &ns, "alice").await;
    let done = json!({"text": "Refunded order 1042."});
    for (run, amount) in [("cagent", 500), ("unpaused", 50)] {
        w.standins
            .script(run, json!([refund(amount), done]), json!([]))
            .await;
        let agent = in_container(gated_agent(w, run, json!({})), "plain-agent");
        w.create_run(
            run,
            json!({"input": "Refund order 1042.", "agent": agent}),
            json!({}),
        )
        .await;
    }
    let approval = pending_approval(w, "cagent").await;
    let name = approval.metadata.name.clone().unwrap();
    common::wait_for("the step pod to exit", common::world::TIMEOUT, || async {
        (live_step_pods(w, "cagent").await == 0).then_some(())
    })
    .await;

    let console = ConsoleProcess::loopback("alice", &ns);
    let chrome = Chrome::start().await;
    let b = &chrome.browser;
    b.goto(&console.session_url).await.unwrap();
    let inbox = chrome.wait_text("Approvals waiting", PAGE).await;
    for shown in [name.as_str(), "issue_refund", "you may decide"] {
        assert!(inbox.contains(shown), "the inbox shows {shown:?}:\n{inbox}");
    }
    chrome.click_link(&name).await;
    let page = chrome.wait_text("Why the agent asks", PAGE).await;
    for shown in [
        "issue_refund for run cagent",
        "orderId",
        "\"1042\"",
        "amount",
        "500",
        "The customer was charged twice; refunding 500.",
        "No decision yet.",
    ] {
        assert!(
            page.contains(shown),
            "the approval shows {shown:?}:\n{page}"
        );
    }
    chrome.screenshot("container-approval").await;
    chrome.fill("Reason (optional)", "charged twice").await;
    chrome.click_button("Approve").await;
    chrome.wait_text("Your approval was recorded.", PAGE).await;

    let run = w.wait_phase("cagent", Phase::Succeeded).await;
    w.wait_phase("unpaused", Phase::Succeeded).await;
    assert_eq!(
        run.status.as_ref().and_then(|s| s.result.as_deref()),
        Some("Refunded order 1042.")
    );
    let d = &approval_named(w, &name).await.spec.decisions[0];
    assert_eq!(
        (d.approver.as_str(), d.reason.as_deref()),
        ("alice", Some("charged twice"))
    );
    let made: Vec<Value> = refunds(w)
        .await
        .into_iter()
        .map(|r| r["args"].clone())
        .filter(|a| a["amount"] == 500)
        .collect();
    assert_eq!(made, [json!({"orderId": "1042", "amount": 500})], "once");
    assert_eq!(
        w.standins.model_requests("cagent").await.len(),
        w.standins.model_requests("unpaused").await.len(),
        "the model is asked as often as without the pause"
    );
    let log = w.log(&run).await;
    let pods: std::collections::HashSet<&str> =
        log.iter().map(|(r, _)| r.worker.pod.as_str()).collect();
    assert!(pods.len() >= 2, "a new pod resumed the run: {pods:?}");

    // The finished container run's timeline, from the log API, verified.
    b.goto(&format!("{}/runs/{ns}/cagent", console.base))
        .await
        .unwrap();
    let timeline = chrome.wait_text("Timeline", PAGE).await;
    for shown in [
        "Succeeded",
        "container agentrun-agents:1 (plain-agent)",
        "proposed issue_refund",
        "ApprovalDecided",
        "alice Approve (charged twice)",
        "issue_refund returned",
        "the agent exited 0: the step asks to end Succeeded",
        "RunFinished",
        "verified:",
    ] {
        assert!(
            timeline.contains(shown),
            "the timeline shows {shown:?}:\n{timeline}"
        );
    }
    assert!(!timeline.contains("NOT VERIFIED"), "{timeline}");
    chrome.screenshot("container-run-timeline").await;
    chrome.browser.clone().close().await.ok();
}

#[tokio::test]
async fn bob_edits_the_amount_and_carol_may_not_decide() {
    let w = World::new("console-edit", &[]).await;
    let ns = w.name().to_string();
    grant_approver_role(&w).await;
    let approval =
        gated_refund_approval(&w, "edit", json!([refund(500), finish("refunded 300")])).await;
    let name = approval.metadata.name.clone().unwrap();
    let page_path = format!("/approvals/{ns}/{name}");

    // carol: no group, not an approver. She sees it, and that she may not.
    let carol = ConsoleProcess::loopback("carol", &ns);
    let chrome = Chrome::start().await;
    let b = &chrome.browser;
    b.goto(&carol.session_url).await.unwrap();
    let inbox = chrome.wait_text("Approvals waiting", PAGE).await;
    assert!(
        inbox.contains(&name) && inbox.contains("not an approver"),
        "{inbox}"
    );
    chrome.click_link(&name).await;
    let page = chrome.wait_text("Your decision", PAGE).await;
    assert!(page.contains("Your decision\nNot an approver."), "{page}");
    assert!(!chrome.has_button("Approve").await && !chrome.has_button("Reject").await);
    chrome.screenshot("carol-approval").await;

    // A decision she forges by hand, with her session and its token: the
    // API server refuses it, and the page says so in words.
    b.execute(
        r#"const f = document.createElement("form");
           f.method = "post"; f.action = location.pathname + "/decide";
           const add = (n, v) => { const i = document.createElement("input"); i.type = "hidden"; i.name = n; i.value = v; f.appendChild(i); };
           add("csrf", document.querySelector('meta[name="agentrun-csrf"]').content);
           add("hash", arguments[0]); add("verdict", "Approve"); add("reason", "forged");
           document.body.appendChild(f); f.submit();"#,
        vec![json!(approval.spec.arguments_hash)],
    )
    .await
    .unwrap();
    let refused = chrome
        .wait_text("the API server refused the decision", PAGE)
        .await;
    assert!(refused.contains("carol is not an approver"), "{refused}");
    chrome.screenshot("carol-forged-decision").await;
    // The same by plain HTTP: 403 and the API server's words.
    let carol_cookie = chrome.session_cookie(&carol).await;
    let page = http()
        .get(format!("{}{page_path}", carol.base))
        .header("cookie", &carol_cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let res = http()
        .post(format!("{}{page_path}/decide", carol.base))
        .header("cookie", &carol_cookie)
        .form_pairs(&[
            ("csrf", csrf_of(&page).as_str()),
            ("hash", approval.spec.arguments_hash.as_str()),
            ("verdict", "Approve"),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::FORBIDDEN);
    let body = res.text().await.unwrap();
    assert!(body.contains("carol is not an approver"), "{body}");
    assert!(approval_named(&w, &name).await.spec.decisions.is_empty());

    // bob edits the amount through the form built from the tool's schema.
    let bob = ConsoleProcess::loopback("bob", &ns);
    b.goto(&bob.session_url).await.unwrap();
    chrome.wait_text("Approvals waiting", PAGE).await;
    chrome.click_link(&name).await;
    chrome.wait_text("Edit the arguments", PAGE).await;
    let amount = b
        .find(fantoccini::Locator::Css("input[name='arg.amount']"))
        .await
        .unwrap();
    assert_eq!(
        amount.attr("type").await.unwrap().as_deref(),
        Some("number")
    );
    assert!(amount.attr("required").await.unwrap().is_some());
    chrome.fill("amount", "300").await;
    chrome.fill("Reason for the change", "partial refund").await;
    chrome.screenshot("edit-form").await;
    chrome.click_button("Approve with these arguments").await;
    let after = chrome.wait_text("Your edit was recorded.", PAGE).await;
    assert!(
        after.contains("bob's edit"),
        "the edit beside the proposal: {after}"
    );
    chrome.screenshot("edited").await;

    w.wait_phase("edit", Phase::Succeeded).await;
    let calls = refunds(&w).await;
    assert_eq!(calls.len(), 1, "the edited call, once: {calls:?}");
    assert_eq!(calls[0]["args"], json!({"orderId": "1042", "amount": 300}));
    let decided = approval_named(&w, &name).await;
    let d = &decided.spec.decisions[0];
    assert_eq!(
        (d.approver.as_str(), d.reason.as_deref()),
        ("bob", Some("partial refund"))
    );
    assert_eq!(d.arguments, Some(json!({"orderId": "1042", "amount": 300})));
    chrome.browser.clone().close().await.ok();
}

#[tokio::test]
async fn a_models_markup_shows_as_text_and_strangers_are_refused() {
    let w = World::new("console-xss", &[]).await;
    let ns = w.name().to_string();
    grant_approver_role(&w).await;
    let text = "Refund now <img src=x onerror=\"document.title='pwned';window.pwned=1\"> \
                </script><script>window.pwned=2</script> [see](javascript:window.pwned=3)";
    let hostile = json!({"text": text, "toolCalls": [{"name": "issue_refund",
        "arguments": {"orderId": "<img src=x onerror=window.pwned=4>", "amount": 500}}]});
    let approval = gated_refund_approval(&w, "xss", json!([hostile, finish("gave up")])).await;
    let name = approval.metadata.name.clone().unwrap();
    let page_path = format!("/approvals/{ns}/{name}");
    let console = ConsoleProcess::loopback("alice", &ns);

    let chrome = Chrome::start().await;
    let b = &chrome.browser;
    b.goto(&console.session_url).await.unwrap();
    chrome.wait_text("Approvals waiting", PAGE).await;
    chrome.click_link(&name).await;
    let page = chrome.wait_text("Why the agent asks", PAGE).await;
    for shown in [
        "<img src=x onerror=\"document.title='pwned';window.pwned=1\">",
        "</script><script>window.pwned=2</script>",
        "[see](javascript:window.pwned=3)",
        "<img src=x onerror=window.pwned=4>",
    ] {
        assert!(page.contains(shown), "shown as text: {shown:?}\n{page}");
    }
    let state = b
        .execute(
            "return [document.title, typeof window.pwned, \
             document.querySelectorAll('img').length, \
             document.querySelectorAll('a[href^=\"javascript\"], [href*=\"javascript:\"]').length, \
             document.scripts.length];",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(
        state,
        json!([format!("{name} · agentrun console"), "undefined", 0, 0, 1]),
        "nothing the model wrote ran or became an element"
    );
    chrome.screenshot("xss").await;
    // A reject needs a reason: the browser keeps the form until one is given.
    chrome.click_button("Reject").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(approval_named(&w, &name).await.spec.decisions.is_empty());
    chrome
        .fill(
            "Reason (required, goes back to the agent)",
            "not with that order id",
        )
        .await;
    chrome.click_button("Reject").await;
    chrome.wait_text("Your rejection was recorded.", PAGE).await;
    w.wait_phase("xss", Phase::Succeeded).await;
    assert!(refunds(&w).await.is_empty(), "a rejected call never runs");
    chrome.browser.clone().close().await.ok();

    // Plain HTTP, with a console of its own (the browser used the URL of
    // the first): the session ticket, the Host, the Origin, the token.
    let console = ConsoleProcess::loopback("alice", &ns);
    let c = http();
    let res = c.get(format!("{}/", console.base)).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::FORBIDDEN, "no session");
    let res = c
        .get(format!("{}/?session=guess", console.base))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::FORBIDDEN, "a wrong session");
    let res = c.get(&console.session_url).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::SEE_OTHER);
    let set = res.headers()["set-cookie"].to_str().unwrap().to_string();
    assert!(
        set.contains("HttpOnly") && set.contains("SameSite=Strict"),
        "{set}"
    );
    let session = session_cookie_of(&res);
    // The URL opens one session: found again (a history, a command line),
    // it opens nothing.
    let again = c.get(&console.session_url).send().await.unwrap();
    assert_eq!(again.status(), StatusCode::FORBIDDEN, "a used URL");
    assert!(again.headers().get("set-cookie").is_none());
    let res = c
        .get(format!("{}/", console.base))
        .header("cookie", &session)
        .header(
            "host",
            format!(
                "evil.example:{}",
                console.host().rsplit(':').next().unwrap()
            ),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(
        res.status(),
        StatusCode::FORBIDDEN,
        "a foreign Host (DNS rebinding)"
    );
    let res = c
        .get(format!("{}/", console.base))
        .header("cookie", &session)
        .header("origin", "http://evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::FORBIDDEN, "a foreign Origin");
    let res = c
        .get(format!("{}{page_path}", console.base))
        .header("cookie", &session)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(
        res.headers()["content-security-policy"]
            .to_str()
            .unwrap()
            .contains("script-src 'self'")
    );
    let token = csrf_of(&res.text().await.unwrap());
    let write = |form: Vec<(&'static str, String)>, origin: Option<&'static str>| {
        let mut r = c
            .post(format!("{}{page_path}/decide", console.base))
            .header("cookie", &session)
            .form_pairs(&form);
        if let Some(o) = origin {
            r = r.header("origin", o);
        }
        r.send()
    };
    let hash = approval.spec.arguments_hash.clone();
    let res = write(
        vec![("verdict", "Approve".into()), ("hash", hash.clone())],
        None,
    )
    .await
    .unwrap();
    assert_eq!(
        res.status(),
        StatusCode::FORBIDDEN,
        "a write without the token"
    );
    assert!(res.text().await.unwrap().contains("anti-forgery token"));
    let res = write(
        vec![
            ("verdict", "Approve".into()),
            ("hash", hash.clone()),
            ("csrf", "0".repeat(64)),
        ],
        None,
    )
    .await
    .unwrap();
    assert_eq!(
        res.status(),
        StatusCode::FORBIDDEN,
        "a write with a made-up token"
    );
    let res = write(
        vec![
            ("verdict", "Approve".into()),
            ("hash", hash.clone()),
            ("csrf", token.clone()),
        ],
        Some("http://evil.example"),
    )
    .await
    .unwrap();
    assert_eq!(
        res.status(),
        StatusCode::FORBIDDEN,
        "a write from another origin"
    );
    assert_eq!(
        approval_named(&w, &name).await.spec.decisions.len(),
        1,
        "only alice's rejection"
    );
}

/// The API server's URL and a file with its CA, from the admin kubeconfig.
async fn api_server_and_ca(dir: &std::path::Path) -> (String, std::path::PathBuf) {
    use base64::Engine as _;
    let kc = kube::config::Kubeconfig::read().expect("KUBECONFIG");
    let context = (!common::existing_cluster()).then(|| "admin".to_string());
    let config = kube::Config::from_custom_kubeconfig(
        kc,
        &kube::config::KubeConfigOptions {
            context,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let mut pem = String::new();
    for der in config.root_cert.clone().unwrap_or_default() {
        let b64 = base64::engine::general_purpose::STANDARD.encode(der);
        pem.push_str("-----BEGIN CERTIFICATE-----\n");
        for line in b64.as_bytes().chunks(64) {
            pem.push_str(std::str::from_utf8(line).unwrap());
            pem.push('\n');
        }
        pem.push_str("-----END CERTIFICATE-----\n");
    }
    let path = dir.join("ca.crt");
    std::fs::write(&path, pem).unwrap();
    (
        config
            .cluster_url
            .to_string()
            .trim_end_matches('/')
            .to_string(),
        path,
    )
}

#[tokio::test]
async fn in_the_cluster_it_acts_with_the_forwarded_token() {
    use k8s_openapi::api::authentication::v1::TokenRequest;
    use k8s_openapi::api::core::v1::ServiceAccount;
    use k8s_openapi::api::rbac::v1::RoleBinding;
    let w = World::new("console-incluster", &[]).await;
    let ns = w.name().to_string();
    let sa_name = "approver-bot";
    let sa_user = format!("system:serviceaccount:{ns}:{sa_name}");
    let sas: Api<ServiceAccount> = Api::namespaced(w.client.clone(), &ns);
    sas.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": sa_name}})).unwrap(),
    )
    .await
    .unwrap();
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "approver-bot"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "agentrun-approver"},
        "subjects": [{"kind": "ServiceAccount", "name": sa_name, "namespace": ns}]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(w.client.clone(), &ns)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let token = sas
        .create_token_request(
            sa_name,
            &PostParams::default(),
            &serde_json::from_value::<TokenRequest>(
                json!({"spec": {"audiences": [], "expirationSeconds": 3600}}),
            )
            .unwrap(),
        )
        .await
        .unwrap()
        .status
        .unwrap()
        .token;
    w.standins
        .script(
            "bot",
            json!([refund(500), finish("refunded 500")]),
            json!([]),
        )
        .await;
    let agent = gated_agent(&w, "bot", json!({"approvers": {"users": [sa_user]}}));
    w.create_run(
        "bot",
        json!({"input": "Refund order 1042.", "agent": agent}),
        json!({}),
    )
    .await;
    let approval = pending_approval(&w, "bot").await;
    let name = approval.metadata.name.clone().unwrap();

    let dir = tempfile::tempdir().unwrap();
    let (api_server, ca) = api_server_and_ca(dir.path()).await;
    let console = ConsoleProcess::in_cluster(&api_server, &ca, &ns);
    let c = http();
    let res = c.get(format!("{}/", console.base)).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "no forwarded token");
    let body = res.text().await.unwrap();
    assert!(body.contains("no forwarded credential"), "{body}");

    let res = c
        .get(format!("{}/", console.base))
        .header("x-forwarded-access-token", &token)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let inbox = res.text().await.unwrap();
    assert!(
        inbox.contains(&name) && inbox.contains("you may decide"),
        "{inbox}"
    );
    assert!(
        inbox.contains(&sa_user),
        "signed in as the service account: {inbox}"
    );
    assert!(
        inbox.contains(&format!("namespaces {ns}")),
        "listed where it may: {inbox}"
    );

    let page_path = format!("/approvals/{ns}/{name}");
    let page = c
        .get(format!("{}{page_path}", console.base))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let csrf = csrf_of(&page);
    let hash = approval.spec.arguments_hash.as_str();
    let res = c
        .post(format!("{}{page_path}/decide", console.base))
        .bearer_auth(&token)
        .form_pairs(&[
            ("csrf", "0".repeat(64).as_str()),
            ("hash", hash),
            ("verdict", "Approve"),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(
        res.status(),
        StatusCode::FORBIDDEN,
        "a write without its token's anti-forgery token"
    );
    let res = c
        .post(format!("{}{page_path}/decide", console.base))
        .form_pairs(&[
            ("csrf", csrf.as_str()),
            ("hash", hash),
            ("verdict", "Approve"),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(
        res.status(),
        StatusCode::UNAUTHORIZED,
        "a write with no forwarded token"
    );
    let res = c
        .post(format!("{}{page_path}/decide", console.base))
        .bearer_auth(&token)
        .header("origin", &console.base)
        .form_pairs(&[
            ("csrf", csrf.as_str()),
            ("hash", hash),
            ("verdict", "Approve"),
            ("reason", "bot says yes"),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(
        res.status(),
        StatusCode::SEE_OTHER,
        "{}",
        res.text().await.unwrap_or_default()
    );
    w.wait_phase("bot", Phase::Succeeded).await;
    let decided = approval_named(&w, &name).await;
    assert_eq!(decided.spec.decisions.len(), 1);
    assert_eq!(decided.spec.decisions[0].approver, sa_user);
}

/// `helm template` of the chart with `values` (plus what any render needs).
fn chart(values: Value) -> Result<Vec<Value>, String> {
    let mut base = json!({
        "store": {"existingSecret": "store"},
        "controller": {"stepTokenKey": {"existingSecret": "key"}},
        "servingCert": {"mode": "controller"}
    });
    if let (Some(b), Some(v)) = (base.as_object_mut(), values.as_object()) {
        b.extend(v.clone());
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("values.json");
    std::fs::write(&file, base.to_string()).unwrap();
    let (ok, out, err) = common::scripts::helm_run(&[
        "template",
        "r",
        "charts/agentrun",
        "--namespace",
        "agentrun-system",
        "--values",
        file.to_str().unwrap(),
    ]);
    if !ok {
        return Err(err);
    }
    Ok(out
        .split("\n---")
        .filter_map(|d| serde_yaml::from_str::<Value>(d).ok())
        .filter(|v| v.is_object())
        .collect())
}

#[test]
fn the_chart_runs_the_console_only_when_asked_and_gives_it_no_credential() {
    let default = chart(json!({})).unwrap();
    assert!(
        !default
            .iter()
            .any(|o| o["metadata"]["name"] == "r-agentrun-console"),
        "off by default"
    );
    let err = chart(json!({"console": {"enabled": true}})).unwrap_err();
    assert!(err.contains("set console.url"), "{err}");
    let err = chart(json!({"console": {"enabled": true, "url": "https://a.example/console"}}))
        .unwrap_err();
    assert!(err.contains("no path"), "{err}");
    let objs = chart(
        json!({"console": {"enabled": true, "url": "https://agentrun.example.com",
                                         "namespaces": ["shop"]}}),
    )
    .unwrap();
    let find = |kind: &str| {
        objs.iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == "r-agentrun-console")
            .unwrap_or_else(|| panic!("no {kind} r-agentrun-console"))
    };
    let pod = &find("Deployment")["spec"]["template"]["spec"];
    assert_eq!(pod["automountServiceAccountToken"], false);
    assert_eq!(
        find("ServiceAccount")["automountServiceAccountToken"],
        false
    );
    let args: Vec<&str> = pod["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(
        args,
        [
            "console",
            "--listen=0.0.0.0:8080",
            "--public-url=https://agentrun.example.com",
            "--ca-file=/etc/agentrun/kube-ca/ca.crt",
            "--controller-namespace=agentrun-system",
            "--namespace=shop"
        ]
    );
    assert_eq!(pod["volumes"][0]["configMap"]["name"], "kube-root-ca.crt");
    assert_eq!(find("Service")["spec"]["ports"][0]["targetPort"], "http");
    // No role of its own: nothing binds the console's ServiceAccount.
    for binding in objs
        .iter()
        .filter(|o| o["kind"] == "RoleBinding" || o["kind"] == "ClusterRoleBinding")
    {
        let subjects = binding["subjects"].to_string();
        assert!(!subjects.contains("r-agentrun-console"), "{binding}");
    }
    let err = chart(json!({"console": {"enabled": true, "url": "https://a.example", "prot": 1}}))
        .unwrap_err();
    assert!(
        err.contains("prot"),
        "the schema refuses unknown keys: {err}"
    );
}

#[tokio::test]
async fn the_requester_sees_she_may_not_decide_her_own_run() {
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    let w = World::new("console-sod", &[]).await;
    let ns = w.name().to_string();
    grant_approver_role(&w).await;
    // alice may start runs here; under separation of duties not decide them.
    let role: Role = serde_json::from_value(json!({"metadata": {"name": "alice-runs"},
        "rules": [{"apiGroups": ["agentrun.dev"], "resources": ["agentruns"], "verbs": ["create", "get"]}]}))
    .unwrap();
    Api::<Role>::namespaced(w.client.clone(), &ns)
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding: RoleBinding = serde_json::from_value(json!({"metadata": {"name": "alice-runs"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "alice-runs"},
        "subjects": [{"kind": "User", "name": "alice", "apiGroup": "rbac.authorization.k8s.io"}]}))
    .unwrap();
    Api::<RoleBinding>::namespaced(w.client.clone(), &ns)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    w.standins
        .script(
            "sod",
            json!([refund(900), finish("refunded 900")]),
            json!([]),
        )
        .await;
    let mut agent = gated_agent(&w, "sod", json!({}));
    agent["approval"]["separationOfDuties"] = json!(true);
    let run: agentrun::api::AgentRun = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "sod", "annotations": {"agentrun.dev/requester": "alice"}},
        "spec": {"input": "Refund 900.", "agent": agent}
    }))
    .unwrap();
    let as_alice: Api<agentrun::api::AgentRun> =
        Api::namespaced(common::client_as("alice").await, &ns);
    common::wait_for(
        "alice to start the run",
        Duration::from_secs(30),
        || async { as_alice.create(&PostParams::default(), &run).await },
    )
    .await;
    let approval = pending_approval(&w, "sod").await;
    let name = approval.metadata.name.clone().unwrap();
    assert_eq!(approval.spec.requester.as_deref(), Some("alice"));

    let console = ConsoleProcess::loopback("alice", &ns);
    let chrome = Chrome::start().await;
    chrome.browser.goto(&console.session_url).await.unwrap();
    let inbox = chrome.wait_text("Approvals waiting", PAGE).await;
    assert!(
        inbox.contains("you may not decide: separation of duties"),
        "{inbox}"
    );
    chrome.click_link(&name).await;
    let page = chrome.wait_text("Your decision", PAGE).await;
    assert!(
        page.contains("You may not decide: separation of duties (you requested this run)."),
        "{page}"
    );
    assert!(
        page.contains("alice (separation of duties: may not decide)"),
        "{page}"
    );
    assert!(!chrome.has_button("Approve").await);
    chrome.screenshot("separation-of-duties").await;
    chrome.browser.clone().close().await.ok();
}

/// An ambient credential is bound to the console's own host (issue 39):
/// browsers scope cookies by host, not port, so a console on 127.0.0.1
/// handed its session to every other web server on 127.0.0.1 its user
/// visited, which could then act as them. The console listens on a random
/// loopback address of its own: alice opens it in Chromium, then visits
/// another server on 127.0.0.1, which receives no console cookie.
#[tokio::test]
async fn the_consoles_session_cookie_reaches_no_other_server_on_loopback() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let w = World::new("console-cookie", &[]).await;
    let ns = w.name().to_string();
    let console = ConsoleProcess::loopback("alice", &ns);
    assert!(
        !console.base.starts_with("http://127.0.0.1:"),
        "the console listens on a loopback address of its own: {}",
        console.base
    );
    // Another web server on 127.0.0.1: it keeps the headers it is sent.
    let other = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let other_url = format!("http://{}/", other.local_addr().unwrap());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = other.accept().await {
            let mut buf = vec![0u8; 16 * 1024];
            let n = conn.read(&mut buf).await.unwrap_or(0);
            let _ = tx.send(String::from_utf8_lossy(&buf[..n]).into_owned());
            let body = "<html><body>another server</body></html>";
            let reply = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = conn.write_all(reply.as_bytes()).await;
        }
    });

    let chrome = Chrome::start().await;
    let b = &chrome.browser;
    b.goto(&console.session_url).await.unwrap();
    chrome.wait_text("Approvals waiting", PAGE).await;
    b.goto(&other_url).await.unwrap();
    chrome.wait_text("another server", PAGE).await;
    chrome.screenshot("another-server-on-loopback").await;
    let mut seen = Vec::new();
    while let Ok(request) = rx.try_recv() {
        seen.push(request);
    }
    assert!(!seen.is_empty(), "the other server was visited");
    for request in &seen {
        assert!(
            !request.to_ascii_lowercase().contains("agentrun_console"),
            "the other server on 127.0.0.1 received the console's cookie:\n{request}"
        );
    }
}

/// alice, who may create runs here and read their logs, forks a finished
/// refund run from its timeline: "fork from here" on the lookup's result
/// creates the fork as her and opens its page; the fork goes on live from
/// there (the refund decided again) and the parent is unchanged.
#[tokio::test]
async fn alice_forks_a_run_from_a_record_of_its_timeline() {
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    let api = LogApiWorld::start("console-fork").await;
    let w = &api.world;
    let ns = w.name().to_string();
    log_api::grant_reader(&w.client, &ns, "alice").await;
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "alice-runs"},
        "rules": [{"apiGroups": ["agentrun.dev"], "resources": ["agentruns"],
                   "verbs": ["create", "get", "list", "watch"]}]
    }))
    .unwrap();
    Api::<Role>::namespaced(w.client.clone(), &ns)
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "alice-runs"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "alice-runs"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "alice"}]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(w.client.clone(), &ns)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    // The fork, after the lookup's result, is answered from reply 3 on.
    let then = [refund(30), finish("refunded 30")];
    let (parent, parent_log, at) = common::world::refunded_run(w, "forkme", "parent", &then).await;

    let console = ConsoleProcess::loopback("alice", &ns);
    let chrome = Chrome::start().await;
    let b = &chrome.browser;
    b.goto(&console.session_url).await.unwrap();
    chrome.wait_text("Approvals", PAGE).await;
    b.goto(&format!("{}/runs/{ns}/parent", console.base))
        .await
        .unwrap();
    let page = chrome.wait_text("Timeline", PAGE).await;
    assert!(page.contains("fork from here"), "{page}");
    chrome.screenshot("fork-from-here").await;
    // The button on the lookup result's row, as a person clicks it.
    b.find(fantoccini::Locator::XPath(&format!(
        "//tr[td[1][normalize-space()='{at}']]//button[normalize-space()='fork from here']"
    )))
    .await
    .unwrap_or_else(|e| panic!("no fork button on record {at}: {e}"))
    .click()
    .await
    .unwrap();
    let forked = chrome.wait_text("Run parent-fork-", PAGE).await;
    let url = b.current_url().await.unwrap();
    let name = url
        .path_segments()
        .and_then(|mut s| s.next_back())
        .map(percent_decode)
        .expect("the fork's page");
    assert!(name.starts_with("parent-fork-"), "{name}: {forked}");

    let fork = w.wait_phase(&name, Phase::Succeeded).await;
    let of = fork.spec.fork_of.clone().expect("spec.forkOf");
    assert_eq!((of.run.as_str(), of.seq), ("parent", at));
    assert_eq!(
        fork.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(agentrun::api::REQUESTER_ANNOTATION))
            .map(String::as_str),
        Some("alice"),
        "the fork is alice's"
    );
    assert_eq!(
        fork.status.as_ref().unwrap().result.as_deref(),
        Some("refunded 30")
    );
    b.goto(&format!("{}/runs/{ns}/{name}", console.base))
        .await
        .unwrap();
    let done = chrome.wait_text("Forked", PAGE).await;
    assert!(
        done.contains("Succeeded") && done.contains("verified:"),
        "{done}"
    );
    assert!(
        done.contains(&format!("parent, after its record {at}")),
        "the page says what it forked: {done}"
    );
    chrome.screenshot("forked").await;
    assert_eq!(
        w.log(&parent).await.len(),
        parent_log.len(),
        "the parent is unchanged"
    );
}

/// A path segment as the console writes it (`%2D` for `-`), read back.
fn percent_decode(s: &str) -> String {
    url::form_urlencoded::parse(format!("x={s}").as_bytes())
        .next()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_default()
}
