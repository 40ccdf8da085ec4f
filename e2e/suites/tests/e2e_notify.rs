//! Approval notifications end to end: a policy's `notifyWebhook` in
//! `notifyFormat: Slack` gets a Block Kit message for a raised approval,
//! with the link to the console (`--console-url`) and the plugin command; a
//! receiver that fails once gets it on the next attempt; one that always
//! fails leaves a Warning Event on the run, which still goes on when
//! approved.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentrun::api::Phase;
use common::approvals::{
    decide, entry, gated_agent, grant_approver_role, pending_approval, refund,
};
use common::world::{TIMEOUT, World, finish};
use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, ListParams};
use serde_json::{Value, json};

const CONSOLE: &str = "https://agentrun.example.com/console";

/// A webhook receiver on loopback: answers each POST with the next status
/// of `statuses` (the last one again when they run out) and keeps the bodies.
struct Receiver {
    url: String,
    bodies: Arc<Mutex<Vec<Value>>>,
}

impl Receiver {
    async fn start(statuses: Vec<u16>) -> Receiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let kept = bodies.clone();
        let app = axum::Router::new().route(
            "/hook",
            axum::routing::post(move |axum::Json(body): axum::Json<Value>| {
                let status = {
                    let mut b = kept.lock().unwrap();
                    b.push(body);
                    *statuses.get(b.len() - 1).or(statuses.last()).unwrap()
                };
                async move { (axum::http::StatusCode::from_u16(status).unwrap(), "reply") }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
        Receiver { url, bodies }
    }

    fn bodies(&self) -> Vec<Value> {
        self.bodies.lock().unwrap().clone()
    }
}

/// The run's agent: the gated refund, its approvals told to `hook` in
/// Slack's format (Teams' for the run `teams`).
fn agent(w: &World, script: &str, hook: &str) -> Value {
    let mut agent = gated_agent(w, script, json!({}));
    agent["approval"]["notifyWebhook"] = json!(hook);
    let format = if script == "teams" { "Teams" } else { "Slack" };
    agent["approval"]["notifyFormat"] = json!(format);
    agent
}

/// The mrkdwn texts of a Slack message's sections, joined.
fn slack_text(body: &Value) -> String {
    let mut out = String::new();
    for b in body["blocks"].as_array().into_iter().flatten() {
        if let Some(t) = b["text"]["text"].as_str() {
            out.push_str(t);
            out.push('\n');
        }
        for f in b["fields"].as_array().into_iter().flatten() {
            out.push_str(f["text"].as_str().unwrap_or_default());
            out.push('\n');
        }
    }
    out
}

#[tokio::test]
async fn approvals_reach_slack_with_the_console_link_after_retries_or_as_a_warning() {
    let w = World::new("notify", &["--console-url", CONSOLE]).await;
    grant_approver_role(&w).await;
    let ok = Receiver::start(vec![200]).await;
    let flaky = Receiver::start(vec![500, 200]).await;
    let down = Receiver::start(vec![500]).await;
    let teams = Receiver::start(vec![200]).await;
    for (run, hook) in [
        ("ok", &ok),
        ("flaky", &flaky),
        ("down", &down),
        ("teams", &teams),
    ] {
        w.standins
            .script(run, json!([refund(500), finish("refunded 500")]), json!([]))
            .await;
        w.create_run(
            run,
            json!({"input": "Refund order 1042.", "agent": agent(&w, run, &hook.url)}),
            json!({}),
        )
        .await;
    }

    // A Block Kit message for the raised approval, with the console link and the command.
    let approval = pending_approval(&w, "ok").await;
    let name = approval.metadata.name.clone().unwrap();
    let body = common::wait_for("the Slack message", TIMEOUT, || async {
        ok.bodies().first().cloned().ok_or("nothing yet")
    })
    .await;
    assert_eq!(
        body["blocks"][0],
        json!({"type": "header", "text": {"type": "plain_text", "text": "Approval needed: issue_refund", "emoji": true}})
    );
    assert!(
        body["text"]
            .as_str()
            .unwrap()
            .starts_with("Approval needed: issue_refund"),
        "{body}"
    );
    let text = slack_text(&body);
    let link = format!(
        "<{CONSOLE}/approvals/{}/{name}|Open {name} in the console>",
        w.name()
    );
    assert!(text.contains(&link), "{text}");
    assert!(
        text.contains(&format!("`kubectl agentrun show {name} -n {}`", w.name())),
        "{text}"
    );
    assert!(text.contains("*amount*\n`500`"), "{text}");
    assert!(text.contains("*Expires*\n"), "{text}");
    assert!(
        !body.to_string().contains(&ok.url),
        "no webhook URL in the message"
    );

    // Teams gets an Adaptive Card with the same facts and the console link.
    let card_for = pending_approval(&w, "teams").await.metadata.name.unwrap();
    let body = common::wait_for("the Teams message", TIMEOUT, || async {
        teams.bodies().first().cloned().ok_or("nothing yet")
    })
    .await;
    assert_eq!(body["type"], "message", "{body}");
    let attachment = &body["attachments"][0];
    assert_eq!(
        attachment["contentType"],
        "application/vnd.microsoft.card.adaptive"
    );
    let card = &attachment["content"];
    assert_eq!(card["type"], "AdaptiveCard");
    assert_eq!(card["version"], "1.4");
    assert_eq!(
        card["actions"][0],
        json!({"type": "Action.OpenUrl", "title": "Open in the console",
               "url": format!("{CONSOLE}/approvals/{}/{card_for}", w.name())})
    );
    let facts = card["body"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["type"] == "FactSet")
        .expect("a FactSet");
    assert!(
        facts["facts"]
            .as_array()
            .unwrap()
            .contains(&json!({"title": "Run", "value": "teams"})),
        "{facts}"
    );

    // 500, then 200: the same message again, and no warning.
    let bodies = common::wait_for("the retried Slack message", TIMEOUT, || async {
        let b = flaky.bodies();
        if b.len() >= 2 {
            Ok(b)
        } else {
            Err(format!("{} so far", b.len()))
        }
    })
    .await;
    assert_eq!(bodies[0], bodies[1], "the retry sends the same message");
    assert!(
        slack_text(&bodies[1]).contains("Approval needed")
            || bodies[1]["text"]
                .as_str()
                .unwrap()
                .contains("Approval needed")
    );

    // Always 500: four attempts, then a Warning Event on the run.
    let events: Api<Event> = Api::namespaced(w.client.clone(), w.name());
    let warning = common::wait_for("the ApprovalNotificationFailed event", TIMEOUT, || async {
        let list = events
            .list(&ListParams::default().fields("involvedObject.name=down"))
            .await
            .map_err(|e| e.to_string())?;
        list.items
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("ApprovalNotificationFailed"))
            .ok_or_else(|| "no event yet".to_string())
    })
    .await;
    assert_eq!(warning.type_.as_deref(), Some("Warning"));
    let message = warning.message.unwrap_or_default();
    assert!(message.contains("the raised notification"), "{message}");
    assert!(message.contains("HTTP 500 after 4 attempts"), "{message}");
    assert!(
        !message.contains("reply"),
        "never the receiver's reply: {message}"
    );
    assert!(!message.contains(&down.url), "never the URL: {message}");
    assert_eq!(down.bodies().len(), 4, "four attempts, no more");
    let flaky_events = events
        .list(&ListParams::default().fields("involvedObject.name=flaky"))
        .await
        .unwrap();
    assert!(
        !flaky_events
            .items
            .iter()
            .any(|e| e.reason.as_deref() == Some("ApprovalNotificationFailed")),
        "a retried delivery is no failure"
    );

    // The run whose webhook is down still goes on when approved.
    let a = pending_approval(&w, "down").await;
    decide(
        &w,
        "alice",
        &a.metadata.name.clone().unwrap(),
        entry("alice", "Approve", &a.spec.arguments_hash, "checked"),
    )
    .await
    .expect("alice approves");
    w.wait_phase("down", Phase::Succeeded).await;

    // And the decision is told too.
    decide(
        &w,
        "alice",
        &name,
        entry(
            "alice",
            "Approve",
            &approval.spec.arguments_hash,
            "duplicate charge",
        ),
    )
    .await
    .expect("alice approves");
    w.wait_phase("ok", Phase::Succeeded).await;
    let decided = common::wait_for(
        "the decision's Slack message",
        Duration::from_secs(30),
        || async { ok.bodies().get(1).cloned().ok_or("one message so far") },
    )
    .await;
    let text = slack_text(&decided);
    assert!(
        decided["blocks"][0]["text"]["text"] == "Approval approved: issue_refund",
        "{decided}"
    );
    assert!(
        text.contains("• *alice*: Approve (duplicate charge)"),
        "{text}"
    );
}
