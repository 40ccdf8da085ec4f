//! Trust attacks on MCP discovery and reconcile slots (issue 25, "no
//! user-chosen I/O and no unbounded work inside a reconcile"), played by a
//! run creator and an agent author: URLs that answer slowly, never, or with
//! huge lists; more servers than allowed; an Agent that gains a hanging tool
//! under a FollowLatest run. Each test asserts what the victim sees: another
//! tenant's run starts within a stated bound, a run ends with its failure
//! recorded once, and the bad servers are asked a bounded number of times.

use std::time::{Duration, Instant};

use agentrun::api::{Agent, AgentRun, Phase};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use super::common::{
    self,
    controller::ControllerProcess,
    standins::Standins,
    world::{TIMEOUT, World, finish, kinds},
};

/// How long an ordinary run of a quiet namespace may take to get its first
/// Job while another namespace floods the controller.
const FIRST_JOB_BOUND: Duration = Duration::from_secs(20);

/// A tenant's namespace with the model key, as `World` makes them, but
/// without a controller of its own.
async fn tenant(client: &kube::Client, prefix: &str) -> common::TestNamespace {
    let ns = common::test_namespace(client, prefix).await;
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "model-key"},
        "stringData": {"apiKey": "sk-e2e-not-a-real-key"}
    }))
    .unwrap();
    Api::<Secret>::namespaced(client.clone(), ns.name())
        .create(&PostParams::default(), &secret)
        .await
        .expect("model key Secret");
    common::allow_secrets(client, ns.name(), &["model-key"]).await;
    ns
}

/// An inline agent whose tools are `mcp` (name, URL, remote tool).
fn agent(s: &Standins, script: &str, mcp: &[(String, String, &str)]) -> Value {
    let tools: Vec<Value> = mcp
        .iter()
        .map(|(name, url, tool)| json!({"name": name, "mcp": {"url": url, "tool": tool}}))
        .collect();
    json!({
        "prompt": {"version": "v1", "system": "You are a careful agent."},
        "model": {
            "provider": "OpenAI", "name": "gpt-e2e",
            "endpoint": format!("{}/scripts/{script}/v1", s.base),
            "secretRef": {"name": "model-key", "key": "apiKey"}
        },
        "tools": tools
    })
}

async fn create_run(client: &kube::Client, ns: &str, name: &str, labels: Value, spec: Value) {
    let run: AgentRun = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": name, "labels": labels}, "spec": spec
    }))
    .unwrap();
    Api::<AgentRun>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &run)
        .await
        .unwrap_or_else(|e| panic!("creating run {ns}/{name}: {e}"));
}

/// HTTP requests the stand-in's MCP URL of `tenant` received.
async fn mcp_requests(s: &Standins, tenant: &str) -> u64 {
    let seen: Value = s.get(&format!("/mcp-requests/{tenant}")).await;
    seen["requests"].as_u64().unwrap_or_default()
}

/// The worst one namespace may legally create: many runs, each with the
/// most MCP servers allowed, most of them slow or hanging, one listing
/// hundreds of tools with long descriptions (within the caps). A run of
/// another namespace, with an MCP tool of its own, still gets its first Job
/// within [`FIRST_JOB_BOUND`]; before, discovery ran inside the reconcile
/// (30 s per URL, one after another, 32 slots) and it waited minutes.
#[tokio::test]
async fn a_noisy_namespace_does_not_delay_another_namespaces_first_job() {
    let client = common::admin().await;
    common::install_crds(&client).await;
    let noisy = tenant(&client, "noisy").await;
    let quiet = tenant(&client, "quiet").await;
    let s = Standins::start();
    let shard = common::unique_name("shard");
    let labels = json!({"agentrun.test/shard": shard});
    let controller = ControllerProcess::start_selecting(
        noisy.name(),
        &format!("agentrun.test/shard={shard}"),
        &[],
    )
    .await;

    let a = noisy.name();
    let bad_servers = |run: usize| -> Vec<(String, String, &str)> {
        let url = |kind: &str, i: usize, query: &str| {
            format!("{}/mcp/{a}-{kind}-{run}-{i}?{query}", s.base)
        };
        let mut tools = vec![(
            "big".to_string(),
            url("big", 0, "extraTools=200&pad=2000"),
            "get_weather",
        )];
        for i in 0..3 {
            tools.push((
                format!("slow{i}"),
                url("slow", i, "delayMs=3000"),
                "get_weather",
            ));
        }
        for i in 0..4 {
            tools.push((format!("hang{i}"), url("hang", i, "hang=1"), "get_weather"));
        }
        tools
    };
    const RUNS: usize = 40;
    let floods = (0..RUNS).map(|i| {
        let spec = json!({"input": "x", "agent": agent(&s, "flood", &bad_servers(i))});
        let (client, labels) = (client.clone(), labels.clone());
        async move { create_run(&client, a, &format!("flood-{i}"), labels, spec).await }
    });
    futures::future::join_all(floods).await;
    // The flood is being discovered (its servers are being asked).
    common::wait_for("the noisy runs' discovery", TIMEOUT, || async {
        for i in 0..RUNS {
            if mcp_requests(&s, &format!("{a}-big-{i}-0")).await > 0 {
                return Ok(());
            }
        }
        Err(controller
            .log()
            .lines()
            .last()
            .unwrap_or_default()
            .to_string())
    })
    .await;

    let b = quiet.name();
    s.script("ordinary", json!([finish("done")]), json!([]))
        .await;
    let own = [(
        "create_ticket".to_string(),
        format!("{}/mcp/{b}", s.base),
        "create_ticket",
    )];
    let created = Instant::now();
    create_run(
        &client,
        b,
        "ordinary",
        labels.clone(),
        json!({"input": "x", "agent": agent(&s, "ordinary", &own)}),
    )
    .await;
    let jobs: Api<Job> = Api::namespaced(client.clone(), b);
    let selector = format!(
        "{}=ordinary",
        agentrun::controller::reconciler::job::RUN_LABEL
    );
    loop {
        let found = jobs.list(&ListParams::default().labels(&selector)).await;
        if found.is_ok_and(|l| !l.items.is_empty()) {
            break;
        }
        assert!(
            created.elapsed() < FIRST_JOB_BOUND,
            "the quiet namespace's run had no Job after {FIRST_JOB_BOUND:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let first_job = created.elapsed();
    println!(
        "bench: noisy_neighbour_first_job_ms {} ms",
        first_job.as_millis()
    );

    // The flood's runs wait (their servers may yet answer), each saying
    // why once its turn came, naming the server; none ends and none has a
    // Job.
    let prefix = format!("/mcp/{a}-");
    let runs: Api<AgentRun> = Api::namespaced(client.clone(), a);
    let waiting = common::wait_for("a noisy run to wait on its discovery", TIMEOUT, || async {
        let list = runs
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        assert!(
            !list.items.iter().any(|r| r
                .status
                .as_ref()
                .and_then(|s| s.phase)
                .is_some_and(|p| p.is_terminal())),
            "a noisy run ended instead of waiting"
        );
        list.items
            .into_iter()
            .find(|r| {
                r.status.as_ref().is_some_and(|s| {
                    s.waiting_on.as_deref() == Some("mcp/discovery")
                        && s.conditions.iter().any(|c| {
                            c.type_ == "ToolsDiscovered"
                                && c.status == "False"
                                && c.message.contains(&prefix)
                                && c.message.contains("no answer within")
                        })
                })
            })
            .ok_or_else(|| "none waits on its discovery yet".to_string())
    })
    .await;
    assert_eq!(waiting.status.unwrap().phase, Some(Phase::Pending));
    let flood_jobs: Api<Job> = Api::namespaced(client.clone(), a);
    let list = flood_jobs.list(&ListParams::default()).await.unwrap();
    assert!(list.items.is_empty(), "a noisy run got a Job");
}

/// An agent author adds a hanging MCP tool to an Agent a FollowLatest run
/// follows. At its next step boundary the run waits, saying why (the
/// server and the reason in its `ToolsDiscovered` condition), records
/// nothing, and asks the server again only after a backoff (before, the
/// controller rediscovered at every reconcile; then the run failed for
/// good, though the server might have been on its way). Once the author
/// fixes the Agent, the run follows it and succeeds.
#[tokio::test]
async fn a_followed_agent_that_gains_a_hanging_tool_waits_until_it_is_fixed() {
    let w = World::new(
        "follow-hang",
        &[
            "--discovery-server-timeout-seconds",
            "2",
            "--discovery-deadline-seconds",
            "4",
        ],
    )
    .await;
    let first_call = json!({"delayMs": 4000, "toolCalls": [{"name": "lookup_order", "arguments": {"orderId": "1"}}]});
    w.standins
        .script("follow", json!([first_call, finish("done")]), json!([]))
        .await;
    let agents: Api<Agent> = Api::namespaced(w.client.clone(), w.name());
    let spec = w.agent("follow");
    let agent: Agent = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "Agent",
        "metadata": {"name": "follow"}, "spec": spec
    }))
    .unwrap();
    agents.create(&PostParams::default(), &agent).await.unwrap();
    w.create_run(
        "follow",
        json!({"input": "x", "agentRef": {"name": "follow"}, "versionPolicy": "FollowLatest"}),
        json!({}),
    )
    .await;
    common::wait_for("the first model call", TIMEOUT, || async {
        (!w.standins.model_requests("follow").await.is_empty()).then_some(())
    })
    .await;
    let stuck = format!("{}-stuck", w.name());
    let good_tools = spec["tools"].as_array().unwrap().clone();
    let mut tools = good_tools.clone();
    tools.push(json!({"name": "stuck", "mcp": {
        "url": format!("{}/mcp/{stuck}?hang=1", w.standins.base), "tool": "get_weather"}}));
    let set_tools = |tools: Vec<Value>| {
        let agents = agents.clone();
        async move {
            agents
                .patch(
                    "follow",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"tools": tools}})),
                )
                .await
                .unwrap();
        }
    };
    set_tools(tools).await;

    let run = w
        .wait_discovery_failing("follow", &[&stuck, "no answer within"])
        .await;
    let log = w.log(&run).await;
    let kinds = kinds(&log);
    assert!(
        !kinds.contains(&"VersionChanged") && !kinds.contains(&"RunFinished"),
        "{kinds:?}"
    );
    // Asked again after a backoff (5 s, then 10 s), not at every reconcile.
    let asked = mcp_requests(&w.standins, &stuck).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let later = mcp_requests(&w.standins, &stuck).await;
    assert!(
        asked <= 2 && later <= asked + 1,
        "asked {asked}, then {later}"
    );

    // The author takes the tool out again: the run follows and finishes.
    set_tools(good_tools).await;
    let run = w.wait_phase("follow", Phase::Succeeded).await;
    let discovered = run
        .status
        .as_ref()
        .unwrap()
        .conditions
        .iter()
        .find(|c| c.type_ == "ToolsDiscovered")
        .cloned();
    assert_eq!(discovered.map(|c| c.status), Some("True".into()));
}

/// A run creator names more MCP servers than an agent may have: the run is
/// refused before any server is asked, with an error naming the field and
/// the limit; an Agent with as many says so in its Ready condition.
#[tokio::test]
async fn too_many_mcp_servers_are_refused_naming_the_field() {
    let w = World::new("mcp-count", &[]).await;
    let n = agentrun::controller::watchers::tool_discovery::MAX_MCP_SERVERS + 1;
    let servers: Vec<_> = (0..n)
        .map(|i| {
            (
                format!("t{i}"),
                format!("{}/mcp/{}-{i}", w.standins.base, w.name()),
                "get_weather",
            )
        })
        .collect();
    let spec = agent(&w.standins, "count", &servers);
    w.create_run("many", json!({"input": "x", "agent": spec}), json!({}))
        .await;
    let run = w.wait_phase("many", Phase::Failed).await;
    let error = run.status.unwrap().error.unwrap_or_default();
    let expected = format!(
        "spec.agent.tools: {n} distinct MCP servers (mcp.url), at most {} per agent",
        n - 1
    );
    assert!(error.contains(&expected), "{error}");
    for i in 0..n {
        let tenant = format!("{}-{i}", w.name());
        assert_eq!(
            mcp_requests(&w.standins, &tenant).await,
            0,
            "{tenant} was asked"
        );
    }

    let agents: Api<Agent> = Api::namespaced(w.client.clone(), w.name());
    let agent: Agent = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "Agent",
        "metadata": {"name": "many"}, "spec": spec
    }))
    .unwrap();
    agents.create(&PostParams::default(), &agent).await.unwrap();
    let message = common::wait_for("the Agent's Ready condition", TIMEOUT, || async {
        let a = agents.get("many").await.map_err(|e| e.to_string())?;
        let ready = a
            .status
            .and_then(|s| s.conditions.into_iter().find(|c| c.type_ == "Ready"))
            .ok_or("no Ready condition yet")?;
        (ready.status == "False")
            .then_some(ready.message.clone())
            .ok_or(format!("{ready:?}"))
    })
    .await;
    assert!(
        message.starts_with(&format!("spec.tools: {n} distinct MCP servers")),
        "{message}"
    );
}
