//! A container agent in a real image on the real node (issue 41): the
//! agents of e2e/agents/ in an image built as the operator's is
//! (`e2e/realnode/build-agents-image.sh`: e2e/agents/Dockerfile FROM the
//! local debian:bookworm-slim, buildah, no registry, imported into the
//! node's containerd), the chart installed as a user installs it, and
//! `plain-agent` (the `openai` SDK and the `mcp` client, unmodified) asked
//! for a refund that needs an approver. The run waits with no pod, is
//! approved, its agent starts over in a new pod and is answered from the
//! log; the refund is made once, each model answer asked once. The agent's
//! container is read from the kernel while it waits for its model: the
//! image's Python, uid 65532, no capability, a read-only root, no token.
//!
//! Run: `AGENTRUN_NODE=real e2e/cluster up && eval "$(e2e/cluster env)" &&
//! e2e/realnode/build-operator-image.sh && e2e/realnode/build-postgres-image.sh &&
//! e2e/realnode/build-agents-image.sh &&
//! cargo test --test e2e_real_node_container_agents -- --ignored` (e2e/test does this).

mod common;

use agentrun::api::{AgentRun, Phase};
use common::approvals::live_step_pods_in;
use common::chart::{
    TIMEOUT, expose_host_process, image_paths, install_on_real_node, path_value, wait_phase,
};
use common::realnode::{children, cmdline, confinement, container_pid, step_pods_of};
use common::standins::Standins;
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use kube::api::{Api, ListParams, PostParams};
use serde_json::{Value, json};

/// The run, its model script and its tools' tenant.
const RUN: &str = "cagent";
/// What the first model answer waits before it is given: time to read the
/// agent's container while it runs.
const FIRST_ANSWER_DELAY_MS: u64 = 15_000;

/// The image the agents' script built (what the process node's suite
/// names too: `agentrun-agents:1`).
fn agents_image() -> String {
    path_value(&image_paths("build-agents-image.sh"), "AGENTS_IMAGE")
}

/// `plain-agent` in the agents' image, its tools (the Agent's HTTP tools,
/// served to it over MCP by the runner) handed over by URL, refunds over
/// 100 gated on finance approvers.
fn gated_container_agent(base: &str, image: &str) -> Value {
    json!({
        "container": {
            "image": image,
            "command": ["plain-agent"],
            "env": [{"name": "MCP_URLS", "value": "$(AGENTRUN_MCP_TOOLS_URL)"}]
        },
        "model": {
            "provider": "OpenAI", "name": "gpt-e2e",
            "endpoint": format!("{base}/scripts/{RUN}/v1"),
            "secretRef": {"name": "model-api-key", "key": "apiKey"}
        },
        "tools": [
            {"name": "lookup_order", "description": "Looks an order up.",
             "inputSchema": {"type": "object", "required": ["orderId"], "properties": {"orderId": {"type": "string"}}},
             "http": {"url": format!("{base}/tools/{RUN}/lookup_order"), "idempotent": true, "readOnly": true}},
            {"name": "issue_refund", "description": "Refunds an amount.",
             "inputSchema": {"type": "object", "required": ["orderId", "amount"],
                             "properties": {"orderId": {"type": "string"}, "amount": {"type": "number"}}},
             "http": {"url": format!("{base}/tools/{RUN}/issue_refund"), "idempotent": true}}
        ],
        "approval": {"rules": [{
            "name": "large-refund", "tool": "issue_refund", "when": "args.amount > 100",
            "approvers": {"groups": ["finance-approvers"]}
        }]}
    })
}

fn container_status<'a>(pod: &'a Pod, name: &str) -> Option<&'a ContainerStatus> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|c| c.name == name)
}

/// The running agent container of the run's step pod: its pod and
/// containerd id.
async fn running_agent_container(pods: &Api<Pod>) -> (String, String) {
    common::wait_for("the agent container to run", TIMEOUT, || async {
        let all = pods.list(&ListParams::default()).await.ok()?.items;
        step_pods_of(&all, RUN).into_iter().find_map(|p| {
            let c = container_status(&p, "agent")?;
            c.state.as_ref()?.running.as_ref()?;
            let id = c.container_id.as_ref()?.strip_prefix("containerd://")?;
            Some((p.metadata.name.clone()?, id.to_string()))
        })
    })
    .await
}

/// Reads the agent's container from the host while the agent waits for
/// its first answer: the shim (the container's process) and, as its
/// child, the image's Python running plain_agent.py, confined as every
/// step container is. Returns the pod's name.
async fn the_agent_container_is_confined(pods: &Api<Pod>, standins: &Standins) -> String {
    let (pod, container) = running_agent_container(pods).await;
    common::wait_for("the agent to ask its model", TIMEOUT, || async {
        (!standins.model_requests(RUN).await.is_empty()).then_some(())
    })
    .await;
    let shim = container_pid(&container);
    let agent = children(shim)
        .into_iter()
        .find(|&pid| cmdline(pid).contains("plain_agent.py"))
        .unwrap_or_else(|| {
            panic!(
                "{pod}: no plain_agent.py under the shim ({}): children {:?}",
                cmdline(shim),
                children(shim).into_iter().map(cmdline).collect::<Vec<_>>()
            )
        });
    let command = cmdline(agent);
    assert!(
        command.starts_with("/opt/agents/venv/bin/python /opt/agents/lib/plain_agent.py"),
        "{pod}: the image's venv runs the agent: {command}"
    );
    for pid in [shim, agent] {
        let c = confinement(pid);
        assert!(
            c.uid.split(' ').all(|u| u == "65532"),
            "{pod}: {} runs as {}",
            cmdline(pid),
            c.uid
        );
        assert_eq!(c.cap_eff, "0000000000000000", "{pod}: no capability");
        assert!(c.root_read_only, "{pod}: the agent's root is read-only");
        assert!(!c.token_mounted, "{pod}: no service-account token");
    }
    eprintln!("real node: {pod}'s agent container: {command} (uid 65532)");
    pod
}

/// Every step pod left of the run: the runner and the agent's container,
/// the agent's from the agents' image, ended with 0; no token.
fn the_step_pods_ran_the_agents_image(all: &[Pod], image: &str) {
    let steps = step_pods_of(all, RUN);
    assert!(!steps.is_empty(), "the step pods of {RUN}");
    for p in &steps {
        let name = p.metadata.name.clone().unwrap_or_default();
        let spec = p.spec.as_ref().unwrap();
        let containers: Vec<&str> = spec.containers.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(containers, ["step", "agent"], "{name}");
        assert_eq!(spec.automount_service_account_token, Some(false), "{name}");
        let agent = container_status(p, "agent").expect("the agent's status");
        assert!(
            agent.image.ends_with(image),
            "{name}: the agent ran {} (not {image})",
            agent.image
        );
        let ended = agent.state.as_ref().and_then(|s| s.terminated.as_ref());
        assert_eq!(
            ended.map(|t| t.exit_code),
            Some(0),
            "{name}: the agent's container ended: {:?}",
            agent.state
        );
    }
}

#[tokio::test]
#[ignore = "needs e2e/cluster up --node=real and the images (e2e/test does both)"]
async fn a_container_agent_in_its_image_waits_for_approval_resumes_and_refunds_once() {
    let client = common::admin().await;
    let node_ip = common::realnode::node_ip(&client).await.to_string();
    let ns_guard = common::test_namespace(&client, "rn-cagent").await;
    let ns = ns_guard.name().to_string();
    let image = agents_image();

    let standins = Standins::start_on(&format!("{node_ip}:0"));
    let port: u16 = standins.base.rsplit(':').next().unwrap().parse().unwrap();
    expose_host_process(&client, &ns, "standins", &node_ip, port).await;
    let base = format!("http://standins.{ns}.svc:{port}");

    let approver_role = format!("{ns}-approver");
    let _installed = install_on_real_node(
        &client,
        &ns,
        json!({"approverRole": {"name": approver_role}, "controller": {"leaseSeconds": 6}}),
    )
    .await;
    common::kubectl(&[
        "apply",
        "-n",
        &ns,
        "-f",
        common::root()
            .join("config/samples/agentpolicy-platform.yaml")
            .to_str()
            .unwrap(),
    ]);

    standins
        .script(
            RUN,
            json!([
                {"text": "The customer was charged twice; refunding.", "delayMs": FIRST_ANSWER_DELAY_MS,
                 "toolCalls": [{"name": "issue_refund", "arguments": {"orderId": "1042", "amount": 500}}]},
                {"text": "Refunded 500 for order 1042."}
            ]),
            json!([]),
        )
        .await;
    let runs: Api<AgentRun> = Api::namespaced(client.clone(), &ns);
    let run: AgentRun = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": RUN},
        "spec": {"input": "Refund order 1042.", "agent": gated_container_agent(&base, &image)}
    }))
    .unwrap();
    runs.create(&PostParams::default(), &run)
        .await
        .expect("the container agent's run");

    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let first_pod = the_agent_container_is_confined(&pods, &standins).await;

    // The refund waits for an approver, with no pod.
    let approval = common::approvals::awaited_approval(&client, &ns, RUN).await;
    common::wait_for("the step pod to end", TIMEOUT, || async {
        (live_step_pods_in(&client, &ns, RUN).await == 0).then_some(())
    })
    .await;
    assert!(
        standins.effects(RUN).await.is_empty(),
        "nothing refunded before the approval"
    );
    assert_eq!(standins.model_requests(RUN).await.len(), 1);

    common::approvals::approve_as_alice_through_role(
        &client,
        &ns,
        &approver_role,
        &approval,
        "charged twice",
    )
    .await;
    let run = wait_phase(&runs, &ns, RUN, Phase::Succeeded).await;
    assert_eq!(
        run.status.unwrap().result.as_deref(),
        Some("Refunded 500 for order 1042.")
    );

    // The new pod's agent was answered the first answer from the log: each
    // answer asked once, the refund made once, with the approved amount.
    let requests = standins.model_requests(RUN).await;
    assert_eq!(requests.len(), 2, "each model answer asked once");
    assert!(
        requests[1].to_string().contains("issue_refund"),
        "the second request carries the refund's result: {}",
        requests[1]
    );
    let refunds: Vec<Value> = standins
        .effects(RUN)
        .await
        .into_iter()
        .filter(|e| e["tool"] == "issue_refund")
        .collect();
    assert_eq!(refunds.len(), 1, "one refund: {refunds:?}");
    assert_eq!(refunds[0]["args"]["amount"], 500);

    let all = pods.list(&ListParams::default()).await.unwrap().items;
    let resumed: Vec<String> = step_pods_of(&all, RUN)
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .filter(|n| *n != first_pod)
        .collect();
    assert!(
        !resumed.is_empty(),
        "the agent resumed in a pod after {first_pod}"
    );
    the_step_pods_ran_the_agents_image(&all, &image);
}
