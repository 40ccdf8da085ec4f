//! Trust attacks on the platform's gate (issue 25, "gates follow what a call
//! does, not what it is called"): an agent author who may write Agents but
//! not policies declares the platform's refund endpoint under another tool
//! name and claims it read-only. The platform's rules select calls by the
//! endpoint they reach and its default believes only the platform's own
//! read-only list, so the call waits for an Approval and nothing reaches
//! the tool before it, whatever spelling of the server's host the author
//! chose (issue 39). Also: an MCP tool the author declares idempotent is
//! called again with the same key after a crash instead of stopping the run.

use agentrun::api::{AgentPolicy, Phase};
use agentrun::replay::Entry;
use agentrun::runlog::records::Recovery;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

use super::common::{
    approvals::{decide, entry, grant_approver_role, pending_approval, refusal},
    world::{World, call, finish},
};

/// The platform owner's policy: every call to the refund endpoint or to the
/// ticket tool of the MCP server needs a finance approver, and so does every
/// call the platform does not itself list as read-only.
async fn finance_policy(w: &World) {
    let (base, t) = (&w.standins.base, w.name());
    let policy: AgentPolicy = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentPolicy",
        "metadata": {"name": "finance"},
        "spec": {"approval": {
            "rules": [
                {"name": "refunds", "match": {"endpoints": [{"url": format!("{base}/tools/{t}/issue_refund")}]},
                 "approvers": {"groups": ["finance-approvers"]}, "expiresAfter": "10m"},
                {"name": "tickets", "match": {"mcp": [{"server": format!("{base}/mcp/{t}"), "tool": "create_ticket"}]},
                 "approvers": {"groups": ["finance-approvers"]}, "expiresAfter": "10m"}
            ],
            "defaultAction": "RequireApprovalForMutating",
            "defaultApprovers": {"groups": ["finance-approvers"]},
            "readOnly": {"endpoints": [{"url": format!("{base}/tools/{t}/lookup_order")}]}
        }}
    }))
    .expect("policy");
    Api::<AgentPolicy>::namespaced(w.client.clone(), w.name())
        .create(&PostParams::default(), &policy)
        .await
        .expect("the platform owner creates the policy");
}

/// The author's agent: the world's tools plus `tool`.
fn agent_with(w: &World, script: &str, tool: Value) -> Value {
    let mut agent = w.agent(script);
    agent["tools"].as_array_mut().expect("tools").push(tool);
    agent
}

async fn start(w: &World, run: &str, tool: Value, first_call: Value) {
    w.standins
        .script(run, json!([first_call, finish("done")]), json!([]))
        .await;
    let agent = agent_with(w, run, tool);
    w.create_run(
        run,
        json!({"input": "Refund 5000.", "agent": agent}),
        json!({}),
    )
    .await;
}

fn refund_tool(name: &str, url: String) -> Value {
    json!({"name": name, "description": "Refunds the customer (read-only, says its author).",
           "http": {"url": url, "readOnly": true, "idempotent": true}})
}

#[tokio::test]
async fn a_renamed_read_only_refund_tool_still_waits_for_the_platforms_approval() {
    let w = World::new("tr-gates", &[]).await;
    grant_approver_role(&w).await;
    finance_policy(&w).await;
    let (base, t) = (w.standins.base.clone(), w.name().to_string());
    let refund = |name: &str| call(name, json!({"orderId": "1042", "amount": 5000}));
    // The same endpoint under three spellings, each under a name of the
    // author's choosing, each claimed read-only.
    let spellings = [
        ("renamed", format!("{base}/tools/{t}/issue_refund")),
        ("encoded", format!("{base}/tools/{t}/%69ssue_refund")),
        ("dotted", format!("{base}/tools/{t}/x/%2e%2e/issue_refund")),
    ];
    for (run, url) in &spellings {
        start(
            &w,
            run,
            refund_tool("refund_customer", url.clone()),
            refund("refund_customer"),
        )
        .await;
    }
    // A mutating endpoint no rule names, claimed read-only: the platform's
    // default takes the platform's word only.
    start(
        &w,
        "claimed",
        refund_tool("close_account", format!("{base}/tools/{t}/close_account")),
        refund("close_account"),
    )
    .await;
    // What the platform lists as read-only runs unasked.
    start(
        &w,
        "listed",
        json!({"name": "find_order", "http": {"url": format!("{base}/tools/{t}/lookup_order"), "readOnly": true}}),
        call("find_order", json!({"orderId": "1042"})),
    )
    .await;

    for (run, _) in &spellings {
        let approval = pending_approval(&w, run).await;
        assert_eq!(
            approval.spec.rule.as_deref(),
            Some("AgentPolicy/finance/refunds"),
            "{run}"
        );
    }
    let claimed = pending_approval(&w, "claimed").await;
    assert_eq!(
        claimed.spec.rule.as_deref(),
        Some("AgentPolicy/finance/default")
    );
    w.wait_phase("listed", Phase::Succeeded).await;
    let reached: Vec<Value> = w
        .standins
        .tool_requests(w.name())
        .await
        .into_iter()
        .filter(|r| r["tool"] != "lookup_order")
        .collect();
    assert!(
        reached.is_empty(),
        "a gated call reached the tool before any approval: {reached:?}"
    );

    // Approved, the refund runs once, with the approved arguments.
    let approval = pending_approval(&w, "renamed").await;
    decide(
        &w,
        "alice",
        approval.metadata.name.as_deref().unwrap(),
        entry("alice", "Approve", &approval.spec.arguments_hash, "checked"),
    )
    .await
    .expect("alice approves");
    w.wait_phase("renamed", Phase::Succeeded).await;
    let refunds: Vec<Value> = w
        .standins
        .effects(w.name())
        .await
        .into_iter()
        .filter(|e| e["tool"] == "issue_refund")
        .collect();
    assert_eq!(refunds.len(), 1, "{refunds:?}");
    assert_eq!(refunds[0]["args"]["amount"], 5000);
}

#[tokio::test]
async fn a_renamed_mcp_tool_still_waits_for_the_platforms_approval() {
    let w = World::new("tr-gates-mcp", &[]).await;
    // A rule that would rely on the author's tool name is refused outright.
    let by_name: AgentPolicy = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentPolicy",
        "metadata": {"name": "by-name"},
        "spec": {"approval": {"rules": [{"name": "refunds", "tool": "issue_refund",
            "approvers": {"groups": ["finance-approvers"]}}]}}
    }))
    .expect("policy");
    let refused = refusal(
        Api::<AgentPolicy>::namespaced(w.client.clone(), w.name())
            .create(&PostParams::default(), &by_name)
            .await,
    );
    assert!(
        refused.contains("spec.approval.rules[].tool") && refused.contains("match.endpoints"),
        "{refused}"
    );
    finance_policy(&w).await;
    let (base, t) = (w.standins.base.clone(), w.name().to_string());
    start(
        &w,
        "case",
        json!({"name": "open_case", "description": "Opens a case.",
               "mcp": {"url": format!("{base}/mcp/{t}"), "tool": "create_ticket"}}),
        call(
            "open_case",
            json!({"title": "refund 5000", "priority": "high"}),
        ),
    )
    .await;
    let approval = pending_approval(&w, "case").await;
    assert_eq!(
        approval.spec.rule.as_deref(),
        Some("AgentPolicy/finance/tickets")
    );
    let seen: Value = w.standins.get(&format!("/mcp-effects/{t}")).await;
    assert_eq!(
        seen["calls"],
        json!([]),
        "the MCP tool was called before any approval"
    );
}

/// Issue 39, "a host by its spelling": the platform's rules name the tool
/// server at 127.0.0.1; the agent author, who may write Agents but not
/// policies, declares the same server as `localhost`, `[::ffff:127.0.0.1]`
/// and in decimal (in the review, two refunds of 5,000 and a ticket ran
/// with no Approval). Every refund and every ticket waits for the
/// platform's Approval, and nothing reaches a tool before it.
#[tokio::test]
async fn the_platforms_server_under_another_spelling_still_waits_for_its_approval() {
    let w = World::new("tr-gates-hosts", &[]).await;
    finance_policy(&w).await;
    let t = w.name().to_string();
    let port = w
        .standins
        .base
        .rsplit(':')
        .next()
        .expect("a port")
        .to_string();
    let spellings = [
        ("named", "localhost"),
        ("mapped", "[::ffff:127.0.0.1]"),
        ("decimal", "2130706433"),
    ];
    for (run, host) in spellings {
        let base = format!("http://{host}:{port}");
        start(
            &w,
            run,
            refund_tool("refund_customer", format!("{base}/tools/{t}/issue_refund")),
            call(
                "refund_customer",
                json!({"orderId": "1042", "amount": 5000}),
            ),
        )
        .await;
        start(
            &w,
            &format!("{run}-case"),
            json!({"name": "open_case", "description": "Opens a case.",
                   "mcp": {"url": format!("{base}/mcp/{t}"), "tool": "create_ticket"}}),
            call(
                "open_case",
                json!({"title": "refund 5000", "priority": "high"}),
            ),
        )
        .await;
    }
    for (run, host) in spellings {
        let refund = pending_approval(&w, run).await;
        assert_eq!(
            refund.spec.rule.as_deref(),
            Some("AgentPolicy/finance/refunds"),
            "the refund at {host}"
        );
        let case = pending_approval(&w, &format!("{run}-case")).await;
        assert_eq!(
            case.spec.rule.as_deref(),
            Some("AgentPolicy/finance/tickets"),
            "the ticket at {host}"
        );
    }
    let reached = w.standins.tool_requests(&t).await;
    assert!(
        reached.is_empty(),
        "a gated call reached the tool before any approval: {reached:?}"
    );
    let seen: Value = w.standins.get(&format!("/mcp-effects/{t}")).await;
    assert_eq!(
        seen["calls"],
        json!([]),
        "the MCP tool was called before any approval"
    );
}

#[tokio::test]
async fn an_idempotent_mcp_call_cut_by_a_crash_is_made_again_with_the_same_key() {
    let w = World::new("tr-mcp-crash", &[]).await;
    let (base, t) = (w.standins.base.clone(), w.name().to_string());
    let mut agent = w.agent("ticket");
    // The author says the server honours the key agentrun sends in `_meta`.
    agent["tools"] = json!([{"name": "create_ticket", "description": "Opens a ticket.",
        "mcp": {"url": format!("{base}/mcp/{t}"), "idempotent": true}}]);
    w.standins
        .script(
            "ticket",
            json!([
                call(
                    "create_ticket",
                    json!({"title": "refund stuck", "priority": "high"})
                ),
                finish("opened")
            ]),
            json!([]),
        )
        .await;
    // The worker dies after the call, before recording its result.
    let fp = json!({"agentrun.dev/failpoint": "after-tool-call"});
    w.create_run(
        "ticket",
        json!({"input": "Open a ticket.", "agent": agent}),
        fp,
    )
    .await;
    let run = w.wait_phase("ticket", Phase::Succeeded).await;

    let seen: Value = w.standins.get(&format!("/mcp-effects/{t}")).await;
    let calls = seen["calls"].as_array().cloned().unwrap_or_default();
    assert_eq!(
        calls.len(),
        2,
        "called before and after the crash: {calls:?}"
    );
    assert_eq!(calls[0]["key"], calls[1]["key"], "with the same key");
    assert!(calls[0]["key"].is_string());
    assert_eq!(
        seen["tickets"].as_array().map(Vec::len),
        Some(1),
        "one ticket: {seen}"
    );
    let recovery = w.log(&run).await.into_iter().find_map(|(_, s)| match s {
        Entry::ToolResult(r) => r.recovery,
        _ => None,
    });
    assert_eq!(recovery, Some(Recovery::RetriedWithSameKey));
}
