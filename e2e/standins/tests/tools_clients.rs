//! The tool clients (`agentrun::tools`) against the stand-in tool and MCP
//! servers (`agentrun-standins`), over real HTTP.

use std::time::Duration;

use agentrun::api::{HttpTool, McpTool, ToolSpec};
use agentrun::tools::{
    CallContext, LookupOutcome, McpCatalog, RetryPolicy, ToolError, ToolOutcome, Toolbox,
    discover_catalog, discover_mcp, idempotency_key,
};
use serde_json::{Value, json};

/// The stand-in servers (see e2e/standins/fixture.rs), with tool helpers.
struct Standins(agentrun_standins::Standins);

impl std::ops::Deref for Standins {
    type Target = agentrun_standins::Standins;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

fn standins() -> Standins {
    Standins(agentrun_standins::Standins::start_exe(
        std::path::Path::new(env!("CARGO_BIN_EXE_agentrun-standins")),
    ))
}

impl Standins {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn get_json(&self, path: &str) -> Value {
        let response = self.http.get(self.url(path)).send().await.unwrap();
        assert!(
            response.status().is_success(),
            "GET {path}: {}",
            response.status()
        );
        response.json().await.unwrap()
    }

    async fn configure(&self, tenant: &str, config: Value) {
        let response = self
            .http
            .put(self.url(&format!("/tools/{tenant}/_config")))
            .json(&config)
            .send()
            .await
            .unwrap();
        assert!(response.status().is_success());
    }

    async fn effects(&self, tenant: &str) -> Vec<Value> {
        self.get_json(&format!("/tools/{tenant}/_effects"))
            .await
            .as_array()
            .unwrap()
            .clone()
    }

    async fn requests(&self, tenant: &str) -> Vec<Value> {
        self.get_json(&format!("/tools/{tenant}/_requests"))
            .await
            .as_array()
            .unwrap()
            .clone()
    }

    async fn mcp_effects(&self, tenant: &str) -> Value {
        self.get_json(&format!("/mcp-effects/{tenant}")).await
    }

    /// A keyed (idempotent) tool of the tool server.
    fn keyed_tool(&self, tenant: &str, name: &str) -> ToolSpec {
        http_tool(
            name,
            self.url(&format!("/tools/{tenant}/{name}")),
            true,
            None,
        )
    }

    /// A tool without idempotency, with its lookup.
    fn nokey_tool(&self, tenant: &str, name: &str) -> ToolSpec {
        http_tool(
            name,
            self.url(&format!("/tools/{tenant}/nokey/{name}")),
            false,
            Some(self.url(&format!("/tools/{tenant}/lookup/{name}"))),
        )
    }

    fn mcp_tool(&self, tenant: &str, name: &str, remote: Option<&str>) -> ToolSpec {
        ToolSpec {
            name: name.into(),
            mcp: Some(McpTool {
                url: self.url(&format!("/mcp/{tenant}")),
                tool: remote.map(str::to_string),
                idempotent: false,
            }),
            ..Default::default()
        }
    }
}

fn http_tool(name: &str, url: String, idempotent: bool, lookup: Option<String>) -> ToolSpec {
    ToolSpec {
        name: name.into(),
        description: format!("{name} for tests"),
        input_schema: None,
        http: Some(HttpTool {
            url,
            idempotent,
            lookup,
            read_only: false,
            timeout: Some("5s".into()),
        }),
        mcp: None,
    }
}

fn fast_retry() -> RetryPolicy {
    RetryPolicy {
        attempts: 4,
        initial_backoff: Duration::from_millis(20),
        max_backoff: Duration::from_millis(100),
    }
}

fn toolbox(specs: &[ToolSpec]) -> Toolbox {
    Toolbox::new(specs, &McpCatalog::new())
        .unwrap()
        .with_retry(fast_retry())
}

fn ctx(seq: u64, index: usize) -> CallContext {
    CallContext::new(
        "run-uid-1",
        seq + 1,
        idempotency_key("run-uid-1", seq, index),
    )
}

fn failed(outcome: &ToolOutcome) -> &str {
    match outcome {
        ToolOutcome::Failed { observation } => observation,
        ToolOutcome::Ok(v) => panic!("expected Failed, got Ok({v})"),
    }
}

fn ok(outcome: ToolOutcome) -> Value {
    match outcome {
        ToolOutcome::Ok(v) => v,
        ToolOutcome::Failed { observation } => panic!("expected Ok, got Failed: {observation}"),
    }
}

#[tokio::test]
async fn same_key_twice_makes_one_effect() {
    let s = standins();
    let tb = toolbox(&[s.keyed_tool("t", "refund")]);
    let first = ok(tb.call("refund", &json!({"amount": 5}), &ctx(3, 0)).await);
    let again = ok(tb.call("refund", &json!({"amount": 5}), &ctx(3, 0)).await);
    assert_eq!(
        first,
        json!({"ok": true, "tool": "refund", "echo": {"amount": 5}, "effect": 1})
    );
    assert_eq!(again, first);
    assert_eq!(s.effects("t").await.len(), 1);
    // Another call (another index) is another effect.
    let other = ok(tb.call("refund", &json!({"amount": 5}), &ctx(3, 1)).await);
    assert_eq!(other["effect"], 2);
    assert_eq!(s.effects("t").await.len(), 2);
    // Every request carried the key, the run and the step.
    let requests = s.requests("t").await;
    assert_eq!(requests.len(), 3);
    assert_eq!(
        requests[0]["key"],
        json!(idempotency_key("run-uid-1", 3, 0))
    );
    assert_eq!(requests[1]["key"], requests[0]["key"]);
    assert_eq!(
        requests[2]["key"],
        json!(idempotency_key("run-uid-1", 3, 1))
    );
    assert_eq!(requests[0]["run"], "run-uid-1");
    assert_eq!(requests[0]["step"], "4");
}

#[tokio::test]
async fn server_errors_are_retried_with_the_same_key() {
    let s = standins();
    s.configure(
        "t",
        json!({"failNext": {"tool": "refund", "times": 2, "status": 503}}),
    )
    .await;
    let tb = toolbox(&[s.keyed_tool("t", "refund")]);
    let result = ok(tb.call("refund", &json!({"amount": 1}), &ctx(7, 0)).await);
    assert_eq!(result["effect"], 1);
    let effects = s.effects("t").await;
    assert_eq!(effects.len(), 1);
    let requests = s.requests("t").await;
    assert_eq!(
        requests.len(),
        3,
        "two failures and one success: {requests:?}"
    );
    let key = json!(idempotency_key("run-uid-1", 7, 0));
    assert!(requests.iter().all(|r| r["key"] == key), "{requests:?}");
    assert_eq!(effects[0]["key"], key);
}

#[tokio::test]
async fn retries_are_bounded() {
    let s = standins();
    s.configure(
        "t",
        json!({"failNext": {"tool": "refund", "times": 100, "status": 500}}),
    )
    .await;
    let tb = toolbox(&[s.keyed_tool("t", "refund")]);
    let out = tb.call("refund", &json!({}), &ctx(1, 0)).await;
    let observation = failed(&out);
    assert!(
        observation.starts_with("refund: failed after 4 attempts: HTTP 500"),
        "{observation}"
    );
    assert_eq!(s.requests("t").await.len(), 4);
    assert!(s.effects("t").await.is_empty());
}

#[tokio::test]
async fn timeouts_are_retried_with_the_same_key() {
    let s = standins();
    s.configure("t", json!({"delayMs": {"slow": 1000}})).await;
    let mut spec = s.keyed_tool("t", "slow");
    spec.http.as_mut().unwrap().timeout = Some("150ms".into());
    let tb = Toolbox::new(&[spec], &McpCatalog::new())
        .unwrap()
        .with_retry(RetryPolicy {
            attempts: 3,
            ..fast_retry()
        });
    let out = tb.call("slow", &json!({}), &ctx(2, 0)).await;
    let observation = failed(&out);
    assert!(
        observation.contains("failed after 3 attempts: timed out"),
        "{observation}"
    );
    assert!(observation.contains("unknown"), "{observation}");
    let requests = s.requests("t").await;
    assert_eq!(requests.len(), 3);
    assert!(requests.iter().all(|r| r["key"] == requests[0]["key"]));
}

#[tokio::test]
async fn unreachable_tools_fail_after_retries() {
    // A port nothing listens on: bind, note it, close.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let tb = toolbox(&[http_tool(
        "gone",
        format!("http://127.0.0.1:{port}/x"),
        false,
        None,
    )]);
    let out = tb.call("gone", &json!({}), &ctx(0, 0)).await;
    let observation = failed(&out);
    assert!(
        observation.starts_with("gone: failed after 4 attempts: could not connect"),
        "{observation}"
    );
    assert!(
        observation.contains("did not reach the tool"),
        "{observation}"
    );
}

#[tokio::test]
async fn invalid_arguments_fail_without_a_request() {
    let s = standins();
    let mut spec = s.keyed_tool("t", "issue_refund");
    spec.input_schema = Some(json!({
        "type": "object",
        "properties": {"order": {"type": "string"}, "amount": {"type": "number", "minimum": 0}},
        "required": ["order", "amount"]
    }));
    let tb = toolbox(&[spec]);
    let out = tb
        .call(
            "issue_refund",
            &json!({"order": "A-1", "amount": -5}),
            &ctx(0, 0),
        )
        .await;
    assert_eq!(
        failed(&out),
        "issue_refund: arguments invalid: amount: -5 is less than the minimum of 0"
    );
    let out = tb
        .call("issue_refund", &json!({"amount": 5}), &ctx(0, 0))
        .await;
    assert!(
        failed(&out).contains("\"order\" is a required property"),
        "{out:?}"
    );
    // A malformed model reply arrives as the raw string.
    let out = tb
        .call(
            "issue_refund",
            &Value::String("{\"order\": ".into()),
            &ctx(0, 0),
        )
        .await;
    assert!(
        failed(&out).contains("expected a JSON object, got a string"),
        "{out:?}"
    );
    assert!(
        s.requests("t").await.is_empty(),
        "nothing may be sent for invalid arguments"
    );
    assert!(s.effects("t").await.is_empty());
    // The same tool with valid arguments does reach the server.
    ok(tb
        .call(
            "issue_refund",
            &json!({"order": "A-1", "amount": 5}),
            &ctx(0, 0),
        )
        .await);
    assert_eq!(s.effects("t").await.len(), 1);
}

#[tokio::test]
async fn unknown_tools_fail() {
    let s = standins();
    let tb = toolbox(&[s.keyed_tool("t", "refund")]);
    let out = tb.call("refund_all", &json!({}), &ctx(0, 0)).await;
    assert_eq!(
        failed(&out),
        "refund_all: no such tool; available tools: refund, finish"
    );
    assert!(s.requests("t").await.is_empty());
}

#[tokio::test]
async fn non_json_answers_fail() {
    let s = standins();
    s.configure("t", json!({"nonJson": ["refund"]})).await;
    let tb = toolbox(&[s.keyed_tool("t", "refund")]);
    let out = tb.call("refund", &json!({}), &ctx(0, 0)).await;
    let observation = failed(&out);
    assert!(
        observation.starts_with("refund: the tool answered with a body that is not JSON"),
        "{observation}"
    );
    assert!(observation.contains("this is not JSON"), "{observation}");
}

#[tokio::test]
async fn client_errors_fail_without_retry() {
    let s = standins();
    s.configure(
        "t",
        json!({"failNext": {"tool": "refund", "times": 1, "status": 422}}),
    )
    .await;
    let tb = toolbox(&[s.keyed_tool("t", "refund")]);
    let out = tb.call("refund", &json!({}), &ctx(0, 0)).await;
    let observation = failed(&out);
    assert!(
        observation.starts_with("refund: the tool refused the call: HTTP 422"),
        "{observation}"
    );
    assert!(observation.contains("injected failure"), "{observation}");
    assert_eq!(s.requests("t").await.len(), 1);
}

#[tokio::test]
async fn lookups_answer_done_not_done_and_unknown() {
    let s = standins();
    let tb = toolbox(&[s.nokey_tool("t", "charge"), s.keyed_tool("t", "refund")]);
    let result = ok(tb.call("charge", &json!({"cents": 100}), &ctx(5, 0)).await);
    assert_eq!(
        tb.lookup("charge", &json!({"cents": 100}), &ctx(5, 0))
            .await,
        LookupOutcome::Done(result)
    );
    assert_eq!(
        tb.lookup("charge", &json!({}), &ctx(5, 1)).await,
        LookupOutcome::NotDone
    );
    assert!(matches!(
        tb.lookup("refund", &json!({}), &ctx(5, 0)).await,
        LookupOutcome::Unknown { reason } if reason == "refund declares no lookup"
    ));
    // A lookup whose server is gone is unknown, not "not done".
    drop(s);
    assert!(matches!(
        tb.lookup("charge", &json!({}), &ctx(5, 0)).await,
        LookupOutcome::Unknown { .. }
    ));
}

#[tokio::test]
async fn non_idempotent_tools_are_repeated_only_when_the_lookup_says_not_done() {
    let s = standins();
    // Failures before the effect: the lookup says "not done", so the call is repeated.
    s.configure(
        "t",
        json!({"failNext": {"tool": "charge", "times": 2, "status": 503}}),
    )
    .await;
    let tb = toolbox(&[s.nokey_tool("t", "charge")]);
    let result = ok(tb.call("charge", &json!({"cents": 1}), &ctx(1, 0)).await);
    assert_eq!(result["effect"], 1);
    assert_eq!(s.effects("t").await.len(), 1);

    // The answer is lost after the effect: the lookup finds it; no second effect.
    s.configure(
        "t",
        json!({"failAfterEffect": {"tool": "charge", "times": 1, "status": 502}}),
    )
    .await;
    let result = ok(tb.call("charge", &json!({"cents": 2}), &ctx(2, 0)).await);
    assert_eq!(result["effect"], 2);
    assert_eq!(result["echo"], json!({"cents": 2}));
    let effects = s.effects("t").await;
    assert_eq!(effects.len(), 2, "{effects:?}");
    let attempts = s
        .requests("t")
        .await
        .iter()
        .filter(|r| r["args"] == json!({"cents": 2}))
        .count();
    assert_eq!(attempts, 1);
}

#[tokio::test]
async fn non_idempotent_tools_without_lookup_are_not_repeated() {
    let s = standins();
    s.configure(
        "t",
        json!({"failNext": {"tool": "charge", "times": 1, "status": 503}}),
    )
    .await;
    let mut spec = s.nokey_tool("t", "charge");
    spec.http.as_mut().unwrap().lookup = None;
    let tb = toolbox(&[spec]);
    let out = tb.call("charge", &json!({}), &ctx(0, 0)).await;
    let observation = failed(&out);
    assert!(observation.contains("HTTP 503"), "{observation}");
    assert!(observation.contains("not repeated"), "{observation}");
    assert_eq!(s.requests("t").await.len(), 1);
}

#[tokio::test]
async fn mcp_discovery_lists_tools_with_schemas_and_annotations() {
    let s = standins();
    let tools = discover_mcp(&s.url("/mcp/m")).await.unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["get_weather", "create_ticket"]);
    let weather = &tools[0];
    assert_eq!(weather.input_schema["required"], json!(["city"]));
    assert_eq!(weather.annotations.read_only_hint, Some(true));
    assert!(!weather.description.is_empty());
    let ticket = &tools[1];
    assert_eq!(
        ticket.input_schema["properties"]["priority"]["enum"],
        json!(["low", "medium", "high"])
    );
    assert_eq!(ticket.annotations.destructive_hint, Some(true));
    assert_eq!(ticket.annotations.read_only_hint, Some(false));

    // The catalog maps the agent's names (and renamed tools) to what was found.
    let specs = [
        s.mcp_tool("m", "weather", Some("get_weather")),
        s.mcp_tool("m", "create_ticket", None),
    ];
    let catalog = discover_catalog(&specs).await.unwrap();
    assert_eq!(catalog["weather"], *weather);
    assert_eq!(catalog["create_ticket"], *ticket);
    let tb = Toolbox::new(&specs, &catalog).unwrap();
    let defs = tb.defs();
    assert_eq!(defs[0].name, "weather");
    assert_eq!(defs[0].input_schema, weather.input_schema);
    assert_eq!(tb.mcp_hints("weather").unwrap().read_only_hint, Some(true));
    assert!(
        !tb.is_read_only("weather"),
        "annotations are hints, not declarations"
    );

    let missing = discover_catalog(&[s.mcp_tool("m", "nope", None)])
        .await
        .unwrap_err();
    assert!(
        matches!(missing, ToolError::McpToolMissing { ref tool, .. } if tool == "nope"),
        "{missing}"
    );
}

async fn mcp_toolbox(s: &Standins, tenant: &str) -> Toolbox {
    let specs = [
        s.mcp_tool(tenant, "get_weather", None),
        s.mcp_tool(tenant, "create_ticket", None),
    ];
    let catalog = discover_catalog(&specs).await.unwrap();
    Toolbox::new(&specs, &catalog)
        .unwrap()
        .with_retry(fast_retry())
}

/// A toolbox keeps one MCP session per server: `initialize` and its
/// notification once, then one request per call (as an MCP client that
/// keeps its session does), a refused call included.
#[tokio::test]
async fn mcp_calls_of_one_toolbox_share_one_session() {
    let s = standins();
    let tb = mcp_toolbox(&s, "session").await;
    let before = s.get_json("/mcp-requests/session").await["requests"]
        .as_u64()
        .unwrap();
    for i in 0..5 {
        let args = json!({"title": format!("t{i}"), "priority": "low"});
        ok(tb.call("create_ticket", &args, &ctx(1, i)).await);
    }
    failed(
        &tb.call("get_weather", &json!({"city": "Atlantis"}), &ctx(2, 0))
            .await,
    );
    ok(tb
        .call("get_weather", &json!({"city": "Paris"}), &ctx(3, 0))
        .await);
    let after = s.get_json("/mcp-requests/session").await["requests"]
        .as_u64()
        .unwrap();
    assert_eq!(
        after - before,
        2 + 7,
        "initialize, initialized, then one per call"
    );
    assert_eq!(
        s.mcp_effects("session").await["tickets"]
            .as_array()
            .unwrap()
            .len(),
        5
    );
}

/// A TCP relay to the stand-ins that can be taken down (its port then
/// refuses connections) and brought back on the same port.
struct Relay {
    addr: std::net::SocketAddr,
    to: String,
    serving: tokio::task::JoinSet<()>,
}

impl Relay {
    async fn start(to: &str) -> Relay {
        let to = to.trim_start_matches("http://").to_string();
        let mut relay = Relay {
            addr: "127.0.0.1:0".parse().unwrap(),
            to,
            serving: tokio::task::JoinSet::new(),
        };
        relay.up().await;
        relay
    }

    async fn up(&mut self) {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_reuseaddr(true).unwrap();
        socket.bind(self.addr).unwrap();
        let listener = socket.listen(64).unwrap();
        self.addr = listener.local_addr().unwrap();
        let to = self.to.clone();
        self.serving.spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let (mut inbound, _) = listener.accept().await.unwrap();
                let to = to.clone();
                conns.spawn(async move {
                    let mut outbound = tokio::net::TcpStream::connect(&to).await.unwrap();
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                });
            }
        });
    }

    /// Closes the port and every relayed connection, and returns once the
    /// port refuses.
    async fn down(&mut self) {
        self.serving.abort_all();
        while self.serving.join_next().await.is_some() {}
        while tokio::net::TcpStream::connect(self.addr).await.is_ok() {
            tokio::task::yield_now().await;
        }
        // The client's pool sees its connections closed (not a request
        // lost on a closing one, which would be another case).
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A kept session whose server cannot be reached (its port refuses, so
/// nothing was sent) is opened anew once the server is back: the call is
/// made once, on a new session, and nothing is lost or doubled.
#[tokio::test]
async fn a_kept_mcp_session_whose_server_refused_the_connection_is_opened_again() {
    let s = standins();
    let mut relay = Relay::start(&s.base).await;
    let url = format!("http://{}/mcp/reopen", relay.addr);
    let specs = [ToolSpec {
        name: "create_ticket".into(),
        mcp: Some(McpTool {
            url,
            tool: None,
            idempotent: false,
        }),
        ..Default::default()
    }];
    let catalog = discover_catalog(&specs).await.unwrap();
    let tb = Toolbox::new(&specs, &catalog)
        .unwrap()
        .with_retry(RetryPolicy {
            attempts: 20,
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(100),
        });
    let args = |i: u32| json!({"title": format!("t{i}"), "priority": "low"});
    ok(tb.call("create_ticket", &args(0), &ctx(1, 0)).await);
    let requests = || async {
        s.get_json("/mcp-requests/reopen").await["requests"]
            .as_u64()
            .unwrap()
    };
    let before = requests().await;

    relay.down().await;
    // Back while the reopened session's attempts go on (about 1.5 s of them).
    let back = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        relay.up().await;
        relay
    });
    ok(tb.call("create_ticket", &args(1), &ctx(2, 0)).await);
    let _relay = back.await.unwrap();

    assert_eq!(
        requests().await - before,
        3,
        "initialize, initialized and the call, on a new session; nothing on the refused one"
    );
    let tickets = s.mcp_effects("reopen").await["tickets"].clone();
    assert_eq!(tickets.as_array().unwrap().len(), 2, "{tickets}");
}

#[tokio::test]
async fn mcp_create_ticket_with_the_same_key_twice_makes_one_ticket() {
    let s = standins();
    let tb = mcp_toolbox(&s, "m").await;
    let args = json!({"title": "printer on fire", "priority": "high"});
    let first = ok(tb.call("create_ticket", &args, &ctx(9, 0)).await);
    let again = ok(tb.call("create_ticket", &args, &ctx(9, 0)).await);
    assert_eq!(
        first,
        json!({"id": "T-1", "title": "printer on fire", "priority": "high"})
    );
    assert_eq!(again, first);
    let effects = s.mcp_effects("m").await;
    assert_eq!(effects["tickets"].as_array().unwrap().len(), 1, "{effects}");
    let calls = effects["calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0]["key"], json!(idempotency_key("run-uid-1", 9, 0)));
    assert_eq!(calls[0]["run"], "run-uid-1");
    assert_eq!(calls[0]["step"], 10);
    // Another key is another ticket.
    let other = ok(tb.call("create_ticket", &args, &ctx(9, 1)).await);
    assert_eq!(other["id"], "T-2");
    assert_eq!(
        s.mcp_effects("m").await["tickets"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
}

#[tokio::test]
async fn mcp_results_and_errors() {
    let s = standins();
    let tb = mcp_toolbox(&s, "m").await;
    let weather = ok(tb
        .call("get_weather", &json!({"city": "Lyon"}), &ctx(0, 0))
        .await);
    assert_eq!(
        weather,
        json!({"city": "Lyon", "forecast": "sunny", "temperatureC": 21})
    );
    let out = tb
        .call("get_weather", &json!({"city": "Atlantis"}), &ctx(0, 1))
        .await;
    assert_eq!(failed(&out), "get_weather: unknown city: Atlantis");
    // Arguments are validated against the discovered schema before anything is sent.
    let out = tb
        .call(
            "create_ticket",
            &json!({"title": "x", "priority": "urgent"}),
            &ctx(0, 2),
        )
        .await;
    assert!(
        failed(&out).starts_with("create_ticket: arguments invalid: priority: "),
        "{out:?}"
    );
    assert_eq!(
        s.mcp_effects("m").await["calls"].as_array().unwrap().len(),
        2
    );
}

#[tokio::test]
async fn mcp_refusals_and_unreachable_servers_fail() {
    let s = standins();
    // The agent names a tool the server does not have (no discovery): the server refuses.
    let specs = [s.mcp_tool("m", "delete_everything", None)];
    let tb = Toolbox::new(&specs, &McpCatalog::new())
        .unwrap()
        .with_retry(fast_retry());
    let out = tb.call("delete_everything", &json!({}), &ctx(0, 0)).await;
    assert!(
        failed(&out)
            .starts_with("delete_everything: the MCP server refused the call: unknown tool"),
        "{out:?}"
    );
    // A toolbox whose server is gone: nothing could be sent. (One that
    // kept a session to it may have sent its call as the server went: an
    // unknown outcome, said so.)
    drop(s);
    let tb = Toolbox::new(&specs, &McpCatalog::new())
        .unwrap()
        .with_retry(fast_retry());
    let out = tb.call("delete_everything", &json!({}), &ctx(0, 0)).await;
    let observation = failed(&out);
    assert!(
        observation.contains("could not be reached after 4 attempts"),
        "{observation}"
    );
    assert!(observation.contains("not called"), "{observation}");
}

#[tokio::test]
async fn standin_contract_no_key_mode_and_record_versions() {
    let s = standins();
    // No-key mode: the same key twice is two effects (the lookup remembers the key).
    let tb = toolbox(&[s.nokey_tool("t", "charge")]);
    ok(tb.call("charge", &json!({}), &ctx(0, 0)).await);
    let second = ok(tb.call("charge", &json!({}), &ctx(0, 0)).await);
    assert_eq!(second["effect"], 2);
    assert_eq!(s.effects("t").await.len(), 2);
    // A lookup without a key is a client error.
    let response = s
        .http
        .get(s.url("/tools/t/lookup/charge"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);

    // Records: 404 until set, then every PUT bumps the version.
    let record = s.url("/tools/t/records/order-1");
    assert_eq!(s.http.get(&record).send().await.unwrap().status(), 404);
    let put = |data: Value| {
        let request = s.http.put(&record).json(&json!({ "data": data }));
        async move { request.send().await.unwrap().json::<Value>().await.unwrap() }
    };
    assert_eq!(
        put(json!({"total": 10})).await,
        json!({"id": "order-1", "version": 1, "data": {"total": 10}})
    );
    assert_eq!(put(json!({"total": 12})).await["version"], 2);
    assert_eq!(
        s.get_json("/tools/t/records/order-1").await,
        json!({"id": "order-1", "version": 2, "data": {"total": 12}})
    );
    // Tenants are separate.
    assert_eq!(
        s.http
            .get(s.url("/tools/u/records/order-1"))
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
    assert!(s.effects("u").await.is_empty());
}
