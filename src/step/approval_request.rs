//! Raising an approval request and re-checking it before the call runs
//! (DESIGN.md section 5): what the approver sees, and staleness.

use serde_json::Value;

use crate::model::ToolCall;
use crate::policy::{Gate, arguments_hash};
use crate::replay::{Entry, RunState};
use crate::runlog::records::ApprovalRequested;
// What a request holds is built in the log's stored types directly.
use crate::runlog::v1::{
    ApprovalKind, Dependency, DependencyVersion, ObservedResult, OnExpiry, ToolOutcome,
};

/// Tool results shown to the approver.
const OBSERVED_RESULTS: usize = 3;
/// A dependency version that could not be read.
const UNREADABLE: &str = "unreadable";

/// Builds the request for call `call_index` of the ModelCall at `model_call_seq`.
#[allow(clippy::too_many_arguments)]
pub async fn request(
    state: &RunState,
    model_call_seq: u64,
    call_index: usize,
    call: &ToolCall,
    arguments: Value,
    alternative: Option<Value>,
    gate: Gate,
    http: &reqwest::Client,
) -> ApprovalRequested {
    let reason = match state.entry(model_call_seq) {
        Some(Entry::ModelCall(m)) => m.response.text.clone(),
        _ => None,
    };
    let dependencies = read_dependencies(&gate.dependencies, &arguments, http).await;
    ApprovalRequested {
        model_call_seq,
        call_index,
        call_id: call.id.clone(),
        tool: call.name.clone(),
        arguments_hash: arguments_hash(&call.name, &arguments),
        arguments,
        reason,
        observations: recent_results(state),
        dependencies,
        gate,
        escalation: 0,
        alternative,
        kind: ApprovalKind::Call,
        intent_seq: None,
    }
}

/// Asks a human whether the call recorded at `intent_seq` happened: its
/// tool has no idempotency key and no lookup, so the outcome is unknowable.
pub fn reconcile_request(
    state: &RunState,
    intent_seq: u64,
    intent: &crate::runlog::records::ToolIntent,
    mut gate: Gate,
    reason: &str,
) -> ApprovalRequested {
    // Nobody answering is never taken as either answer: the run stops.
    gate.on_expiry = OnExpiry::Fail;
    gate.because = format!("the outcome of {} is unknown: {reason}", intent.tool);
    ApprovalRequested {
        model_call_seq: intent.model_call_seq,
        call_index: intent.call_index,
        call_id: intent.call_id.clone(),
        tool: intent.tool.clone(),
        arguments_hash: arguments_hash(&intent.tool, &intent.arguments),
        arguments: intent.arguments.clone(),
        reason: Some(format!(
            "A worker crashed while calling {} (idempotency key {}); whether the call happened cannot be \
             checked ({reason}). Approve if it DID happen (it will not be repeated); reject if it did NOT \
             (it will be made now).",
            intent.tool, intent.key
        )),
        observations: recent_results(state),
        dependencies: Vec::new(),
        gate,
        escalation: 0,
        alternative: None,
        kind: ApprovalKind::Reconcile,
        intent_seq: Some(intent_seq),
    }
}

/// Asks the budget's approvers whether the run may go on with the limits
/// in `arguments` (`budgets.onExhausted: Ask`). What the approver sees:
/// what is used up, what was spent, and the latest results it bought.
pub fn budget_request(
    state: &RunState,
    reason: &str,
    arguments: Value,
    mut gate: Gate,
) -> ApprovalRequested {
    let spent = &state.spent;
    let model_call_seq = state
        .records()
        .rev()
        .find_map(|(seq, s)| matches!(s, Entry::ModelCall(_)).then_some(seq))
        .unwrap_or_default();
    gate.because = reason.to_string();
    let tool = crate::api::BUDGET_TOOL;
    ApprovalRequested {
        model_call_seq,
        call_index: 0,
        call_id: String::new(),
        tool: tool.into(),
        arguments_hash: arguments_hash(tool, &arguments),
        reason: Some(format!(
            "{reason}. Spent so far: {} steps ({}), {} input + {} output tokens, ${:.4}. \
             Approve to go on with the limits shown, edit them to give others, or reject to end \
             the run BudgetExceeded with its partial result.",
            state.len(),
            spent_on(state),
            spent.input_tokens,
            spent.output_tokens,
            spent.cost_usd
        )),
        arguments,
        observations: recent_results(state),
        dependencies: Vec::new(),
        gate,
        escalation: 0,
        alternative: None,
        kind: ApprovalKind::Budget,
        intent_seq: None,
    }
}

/// What the steps went to: model calls, and tool calls by tool (of the
/// records held; a compacted run's earlier ones are in its summary).
fn spent_on(state: &RunState) -> String {
    let mut model_calls = 0;
    let mut tools: std::collections::BTreeMap<&str, usize> = Default::default();
    for (_, step) in state.records() {
        match step {
            Entry::ModelCall(_) | Entry::Summary(_) => model_calls += 1,
            Entry::ToolResult(r) => *tools.entry(r.tool.as_str()).or_default() += 1,
            _ => {}
        }
    }
    let mut parts = vec![format!("{model_calls} model calls")];
    parts.extend(tools.iter().map(|(tool, n)| format!("{tool} ×{n}")));
    parts.join(", ")
}

/// The latest tool results, abbreviated, newest last.
fn recent_results(state: &RunState) -> Vec<ObservedResult> {
    let mut out: Vec<ObservedResult> = state
        .records()
        .rev()
        .filter_map(|(seq, s)| match s {
            Entry::ToolResult(r) => Some(ObservedResult {
                seq,
                tool: r.tool.clone(),
                summary: abbreviate(&match &r.outcome {
                    ToolOutcome::Ok(v) => v.to_string(),
                    ToolOutcome::Failed { observation } => format!("failed: {observation}"),
                }),
            }),
            _ => None,
        })
        .take(OBSERVED_RESULTS)
        .collect();
    out.reverse();
    out
}

fn abbreviate(s: &str) -> String {
    match s.char_indices().nth(500) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// Largest lookup reply read: a version is small, and whoever answers is
/// untrusted (a reply over this reads as unreadable).
const MAX_LOOKUP_BYTES: usize = 1 << 20;

/// The client dependency lookups go out with: no redirects (a lookup URL
/// the agent author chose must not be bounced to an address nobody chose;
/// a 3xx reads as unreadable), short timeouts.
pub fn lookup_client() -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(std::time::Duration::from_secs(15))
        .build()
}

/// Reads each dependency's current version through its read-only lookup.
/// `{name}` in a lookup URL is replaced by the call's argument `name`.
pub async fn read_dependencies(
    deps: &[Dependency],
    args: &Value,
    http: &reqwest::Client,
) -> Vec<DependencyVersion> {
    let mut out = Vec::with_capacity(deps.len());
    for dep in deps {
        let version = match http.get(fill(&dep.lookup, args)).send().await {
            Ok(resp) if resp.status().is_success() => {
                match crate::tools::read_body(resp, MAX_LOOKUP_BYTES)
                    .await
                    .map_err(|e| e.to_string())
                    .and_then(|b| serde_json::from_slice::<Value>(&b).map_err(|e| e.to_string()))
                {
                    Ok(body) => match body.get("version") {
                        Some(Value::String(v)) => v.clone(),
                        Some(v) => v.to_string(),
                        None => crate::store::sha256_hex(&crate::store::canonical_json(&body)),
                    },
                    Err(e) => format!("{UNREADABLE}: {e}"),
                }
            }
            Ok(resp) => format!("{UNREADABLE}: HTTP {}", resp.status().as_u16()),
            Err(e) => format!("{UNREADABLE}: {e}"),
        };
        out.push(DependencyVersion {
            name: dep.name.clone(),
            version,
        });
    }
    out
}

/// The lookup URL with `{name}` replaced by that argument, percent-encoded:
/// a model-written value can neither change the path or query nor inject
/// another placeholder.
fn fill(url: &str, args: &Value) -> String {
    let mut out = url.to_string();
    if let Value::Object(map) = args {
        for (k, v) in map {
            let text = match v {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            out = out.replace(&format!("{{{k}}}"), &encode_component(&text));
        }
    }
    out
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
fn encode_component(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// Why an approval no longer holds, if it does not: a dependency changed,
/// or cannot be read now (an unknown state never counts as unchanged).
pub fn changed(before: &[DependencyVersion], now: &[DependencyVersion]) -> Option<String> {
    let mut reasons = Vec::new();
    for dep in now {
        let was = before
            .iter()
            .find(|b| b.name == dep.name)
            .map(|b| b.version.as_str());
        if dep.version.starts_with(UNREADABLE) {
            reasons.push(format!("{} cannot be read now ({})", dep.name, dep.version));
        } else if was != Some(dep.version.as_str()) {
            reasons.push(format!(
                "{} changed from version {} to {}",
                dep.name,
                was.unwrap_or("none"),
                dep.version
            ));
        }
    }
    (!reasons.is_empty()).then(|| reasons.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::split_alternative;
    use serde_json::json;

    /// A server answering every request with `reply(addr)`; counts them
    /// (until half a second passes with none).
    async fn serve(
        reply: impl Fn(std::net::SocketAddr) -> Vec<u8> + Send + 'static,
    ) -> (std::net::SocketAddr, tokio::task::JoinHandle<usize>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let _ = rustls::crypto::ring::default_provider().install_default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let served = tokio::spawn(async move {
            let mut hits = 0;
            while let Ok(Ok((mut conn, _))) =
                tokio::time::timeout(std::time::Duration::from_millis(500), listener.accept()).await
            {
                hits += 1;
                let mut buf = [0u8; 1024];
                let _ = conn.read(&mut buf).await;
                let _ = conn.write_all(&reply(addr)).await;
            }
            hits
        });
        (addr, served)
    }

    async fn lookup(addr: std::net::SocketAddr) -> String {
        let deps = vec![Dependency {
            name: "order".into(),
            lookup: format!("http://{addr}/orders/{{orderId}}"),
        }];
        let got =
            read_dependencies(&deps, &json!({"orderId": "1"}), &lookup_client().unwrap()).await;
        got[0].version.clone()
    }

    #[tokio::test]
    async fn a_lookup_that_redirects_is_unreadable_never_followed() {
        let (addr, served) = serve(|addr| {
            format!(
                "HTTP/1.1 307 Temporary Redirect\r\nLocation: http://{addr}/elsewhere\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
            .into_bytes()
        })
        .await;
        assert_eq!(lookup(addr).await, format!("{UNREADABLE}: HTTP 307"));
        assert_eq!(served.await.unwrap(), 1, "the redirect was not followed");
    }

    #[tokio::test]
    async fn a_lookup_reply_over_the_cap_is_unreadable() {
        let (addr, served) = serve(|_| {
            let body = format!("{{\"version\": \"{}\"}}", "v".repeat(MAX_LOOKUP_BYTES));
            let mut r = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            )
            .into_bytes();
            r.extend_from_slice(body.as_bytes());
            r
        })
        .await;
        let version = lookup(addr).await;
        assert!(
            version.starts_with(UNREADABLE) && version.contains("larger than"),
            "{}",
            crate::text::prefix(&version, 200)
        );
        served.await.unwrap();
    }

    fn v(name: &str, version: &str) -> DependencyVersion {
        DependencyVersion {
            name: name.into(),
            version: version.into(),
        }
    }

    #[test]
    fn alternatives_are_split_off_the_arguments() {
        let (args, alt) =
            split_alternative(&json!({"amount": 500, "_alternative": {"amount": 100}}));
        assert_eq!(args, json!({"amount": 500}));
        assert_eq!(alt, Some(json!({"amount": 100})));
        assert_eq!(split_alternative(&json!({"a": 1})), (json!({"a": 1}), None));
    }

    #[test]
    fn staleness_names_what_changed_and_distrusts_unreadable_records() {
        assert_eq!(changed(&[v("order", "3")], &[v("order", "3")]), None);
        assert_eq!(
            changed(&[v("order", "3")], &[v("order", "4")]).unwrap(),
            "order changed from version 3 to 4"
        );
        assert!(
            changed(&[v("order", "3")], &[v("order", "unreadable: HTTP 503")])
                .unwrap()
                .contains("cannot be read")
        );
    }

    #[test]
    fn lookup_urls_take_the_call_arguments() {
        assert_eq!(
            fill(
                "http://x/records/{orderId}",
                &json!({"orderId": "1042", "amount": 5})
            ),
            "http://x/records/1042"
        );
        assert_eq!(
            fill(
                "http://x/records/{orderId}?v={amount}",
                &json!({"orderId": "../admin?x=1#{amount}", "amount": 5})
            ),
            "http://x/records/..%2Fadmin%3Fx%3D1%23%7Bamount%7D?v=5"
        );
    }
}
