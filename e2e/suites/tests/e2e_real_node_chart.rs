//! The chart on the real node, as a user installs it: the operator image
//! built from the project's Dockerfile (`e2e/realnode/build-operator-image.sh`,
//! the local `docker build` + `kind load`), `helm install` with the in-chart
//! PostgreSQL (`postgresql.enabled=true`, its image from Debian's package:
//! `e2e/realnode/build-postgres-image.sh`) on a persistent volume, the
//! controller as its Deployment in containers, step Jobs as containers. Step
//! pods reach the controller's step-log gateway, and the model and tool
//! stand-ins (host processes on the node's address, behind a selector-less
//! Service), by Service name.
//!
//! Run: `AGENTRUN_NODE=real e2e/cluster up && eval "$(e2e/cluster env)" &&
//! e2e/realnode/build-operator-image.sh && e2e/realnode/build-postgres-image.sh &&
//! cargo test --test e2e_real_node_chart -- --ignored` (e2e/test does this).

mod common;

use common::chart::{RELEASE, TIMEOUT, expose_host_process, install_on_real_node, wait_phase};
use common::realnode::{NODE, confinement, container_pid, ctr, step_pods_of};

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use agentrun::api::{AgentRun, Phase};
use common::standins::Standins;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use serde_json::{Value, json};

/// Applies a sample of config/samples with the stand-ins' address put in.
fn apply_sample(ns: &str, sample: &str, base: &str) {
    let text = std::fs::read_to_string(common::root().join("config/samples").join(sample))
        .unwrap()
        .replace("http://127.0.0.1:18080", base);
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), text).unwrap();
    common::kubectl(&["apply", "-n", ns, "-f", file.path().to_str().unwrap()]);
}

fn model_turns(request: &Value) -> usize {
    request["messages"].as_array().map_or(0, Vec::len)
}

/// `kubectl --context CONTEXT ARGS` (the test kubeconfig has a context per
/// test user), with a discovery cache of its own (one from before the
/// APIService was available would hide the group): (success, stdout, stderr).
fn kubectl_as(context: &str, args: &[&str]) -> (bool, String, String) {
    let cache = tempfile::tempdir().unwrap();
    let out = Command::new("kubectl")
        .args(["--context", context, "--cache-dir"])
        .arg(cache.path())
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running kubectl {args:?}: {e}"));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A client authenticated as ServiceAccount `sa` of `ns` by a token the
/// API server issued it (TokenRequest), as a GitOps controller would be.
async fn client_as_service_account(ns: &str, sa: &str) -> kube::Client {
    let token = common::kubectl(&["create", "token", sa, "-n", ns, "--duration=10m"]);
    let mut config = kube::Config::infer().await.expect("the test kubeconfig");
    config.auth_info = serde_json::from_value(json!({"token": token.trim()})).unwrap();
    kube::Client::try_from(config).expect("a client with the token")
}

fn requester_of(run: &AgentRun) -> Option<String> {
    run.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(agentrun::api::REQUESTER_ANNOTATION).cloned())
}

/// A run of an Agent that does not exist: nothing runs, its requester is
/// what is looked at.
fn idle_run(name: &str, requester: Option<&str>) -> AgentRun {
    let mut run = json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": name, "labels": {"e2e": "requester"}},
        "spec": {"input": "Nothing to do.", "agentRef": {"name": "no-such-agent"}}
    });
    if let Some(r) = requester {
        run["metadata"]["annotations"] = json!({"agentrun.dev/requester": r});
    }
    serde_json::from_value(run).unwrap()
}

/// With MutatingAdmissionPolicy off (the real node's API server), the chart
/// (`crds.stampRequester: auto`) installed the controller's webhook: runs
/// created by alice, bob and a ServiceAccount carry each creator's name
/// without anybody writing it; a create naming somebody else is refused; a
/// server-side apply whose manifest never named the requester keeps it.
async fn the_webhook_stamps_every_creator(client: &kube::Client, ns: &str) {
    assert!(
        !common::serves_mutating_policies(client).await,
        "this test checks the webhook path: start the real node with MutatingAdmissionPolicy off (the default there; AGENTRUN_MUTATING_ADMISSION_POLICY=off)"
    );
    let hook: Value = serde_json::from_str(&common::kubectl(&[
        "get",
        "mutatingwebhookconfiguration",
        &format!("{RELEASE}-requester-stamp"),
        "-o",
        "json",
    ]))
    .unwrap();
    assert!(
        hook["webhooks"][0]["clientConfig"]["caBundle"].is_string(),
        "the chart's CA in the webhook: {hook}"
    );

    // Who may create runs here: alice, bob and a GitOps ServiceAccount.
    common::kubectl(&["create", "serviceaccount", "gitops", "-n", ns]);
    common::kubectl(&[
        "create",
        "role",
        "run-creators",
        "-n",
        ns,
        "--verb=create,get,patch",
        "--resource=agentruns.agentrun.dev",
    ]);
    common::kubectl(&[
        "create",
        "rolebinding",
        "run-creators",
        "-n",
        ns,
        "--role=run-creators",
        "--user=alice",
        "--user=bob",
        &format!("--serviceaccount={ns}:gitops"),
    ]);
    let sa_user = format!("system:serviceaccount:{ns}:gitops");
    let creators = [
        ("alice", common::client_as("alice").await),
        ("bob", common::client_as("bob").await),
        (
            sa_user.as_str(),
            client_as_service_account(ns, "gitops").await,
        ),
    ];
    let admin_runs: Api<AgentRun> = Api::namespaced(client.clone(), ns);
    for (i, (user, creator)) in creators.iter().enumerate() {
        let runs: Api<AgentRun> = Api::namespaced(creator.clone(), ns);
        let name = format!("stamped-{i}");
        // RBAC takes a moment to reach the authorizer's cache.
        let created = common::wait_for(&format!("{user} to create {name}"), TIMEOUT, || async {
            runs.create(&PostParams::default(), &idle_run(&name, None))
                .await
        })
        .await;
        assert_eq!(
            requester_of(&created).as_deref(),
            Some(*user),
            "{name}: {:?}",
            created.metadata
        );
        let stored = admin_runs.get(&name).await.unwrap();
        assert_eq!(
            requester_of(&stored).as_deref(),
            Some(*user),
            "{name} as stored"
        );
    }

    // Naming somebody else is refused, naming both.
    let alice_runs: Api<AgentRun> = Api::namespaced(creators[0].1.clone(), ns);
    let refused = alice_runs
        .create(&PostParams::default(), &idle_run("forged", Some("bob")))
        .await;
    match refused {
        Err(kube::Error::Api(e)) => {
            assert_eq!(e.code, 403, "{e:?}");
            assert!(
                e.message
                    .contains("metadata.annotations[agentrun.dev/requester]")
                    && e.message.contains("(alice)")
                    && e.message.contains("bob"),
                "{}",
                e.message
            );
        }
        other => panic!("a run naming bob, created by alice, was not refused: {other:?}"),
    }
    assert!(admin_runs.get_opt("forged").await.unwrap().is_none());

    // A server-side apply (as GitOps tools do) that never names the
    // requester: created stamped, and re-applied with a change it keeps it.
    let apply = |label: &str| {
        let mut run = serde_json::to_value(idle_run("applied", None)).unwrap();
        run["metadata"]["labels"]["revision"] = json!(label);
        run
    };
    let pp = kube::api::PatchParams::apply("gitops-e2e");
    for revision in ["1", "2"] {
        let applied = alice_runs
            .patch("applied", &pp, &kube::api::Patch::Apply(apply(revision)))
            .await
            .unwrap_or_else(|e| panic!("server-side apply, revision {revision}: {e}"));
        assert_eq!(
            requester_of(&applied).as_deref(),
            Some("alice"),
            "revision {revision}"
        );
    }
}

/// The log API through the aggregation layer, served by the chart's
/// replicas: alice, once bound to `agentrun-log-reader` in the namespace,
/// reads a run's records with `kubectl get --raw`; carol, bound to nothing,
/// is refused (403), as alice was before her binding.
async fn the_log_api_serves_bound_readers_only(ns: &str, run: &str) {
    common::wait_for(
        "the log API's APIService to be Available",
        TIMEOUT,
        || async {
            let out = Command::new("kubectl")
                .args([
                    "get",
                    "apiservice",
                    "v1alpha1.log.agentrun.dev",
                    "-o",
                    "json",
                ])
                .output()
                .ok()?;
            let v: Value = serde_json::from_slice(&out.stdout).ok()?;
            v["status"]["conditions"]
                .as_array()?
                .iter()
                .any(|c| c["type"] == "Available" && c["status"] == "True")
                .then_some(())
        },
    )
    .await;
    let path = format!("/apis/log.agentrun.dev/v1alpha1/namespaces/{ns}/runlogs/{run}");
    let refused = |who: &str| {
        let (ok, stdout, stderr) = kubectl_as(who, &["get", "--raw", &path]);
        assert!(!ok, "{who} read {path} without a binding:\n{stdout}");
        assert!(
            stderr.contains("Forbidden") && stderr.contains("runlogs"),
            "{who}: a 403 naming the resource, got:\n{stderr}"
        );
    };
    refused("alice");
    refused("carol");

    common::kubectl(&[
        "create",
        "rolebinding",
        "alice-logs",
        "-n",
        ns,
        "--clusterrole=agentrun-log-reader",
        "--user=alice",
    ]);
    let log: Value = common::wait_for("alice to read the run's log", TIMEOUT, || async {
        let (ok, stdout, stderr) = kubectl_as("alice", &["get", "--raw", &path]);
        if ok {
            serde_json::from_str::<Value>(&stdout).map_err(|e| format!("{e}: {stdout}"))
        } else {
            Err(stderr)
        }
    })
    .await;
    assert_eq!(log["kind"], "RunLog", "{log}");
    assert_eq!(log["metadata"]["name"], run);
    let records = log["records"].as_array().expect("records");
    assert!(records.len() >= 3, "a finished run's records: {log}");
    // In order.
    let seqs: Vec<u64> = records.iter().filter_map(|r| r["seq"].as_u64()).collect();
    assert_eq!(seqs.len(), records.len(), "every record has its seq: {log}");
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    refused("carol");

    // The plugin, as alice, through the same API: every record, verified
    // here with the chart's published keys; `log -f` of the finished run
    // prints the same records and ends.
    let within = Duration::from_secs(90);
    for args in [vec!["log", run], vec!["log", "-f", run]] {
        let out = common::log_api::plugin_as("alice", ns, &args, within).await;
        assert!(
            out.ok,
            "kubectl agentrun {args:?} as alice:\n{}{}",
            out.stdout, out.stderr
        );
        let printed: Vec<u64> = common::log_api::plugin_records(&out.stdout)
            .iter()
            .map(|l| l.seq)
            .collect();
        assert_eq!(printed, seqs, "{args:?}:\n{}", out.stdout);
        assert!(!out.stdout.contains("NOT VERIFIED"), "{}", out.stdout);
    }
    let verify = common::log_api::plugin_as("alice", ns, &["verify", run], within).await;
    assert!(
        verify.ok && verify.stdout.contains("chain intact"),
        "kubectl agentrun verify as alice:\n{}{}",
        verify.stdout,
        verify.stderr
    );
    let carol = common::log_api::plugin_as("carol", ns, &["log", run], within).await;
    assert!(
        !carol.ok && common::log_api::plugin_records(&carol.stdout).is_empty(),
        "carol's log:\n{}",
        carol.stdout
    );
}

#[tokio::test]
#[ignore = "needs e2e/cluster up --node=real and the images (e2e/test does both)"]
async fn the_chart_runs_samples_on_the_real_node_through_an_approval_and_a_killed_step_pod() {
    let client = common::admin().await;
    let node_ip = common::realnode::node_ip(&client).await.to_string();
    let ns_guard = common::test_namespace(&client, "rn-chart").await;
    let ns = ns_guard.name().to_string();

    // The stand-ins on the node's address, reached by pods as a Service.
    let standins = Standins::start_on(&format!("{node_ip}:0"));
    let port: u16 = standins.base.rsplit(':').next().unwrap().parse().unwrap();
    expose_host_process(&client, &ns, "standins", &node_ip, port).await;
    let base = format!("http://standins.{ns}.svc:{port}");

    let approver_role = format!("{ns}-approver");
    let installed = install_on_real_node(
        &client,
        &ns,
        json!({"approverRole": {"name": approver_role}, "controller": {"leaseSeconds": 6}}),
    )
    .await;

    // The step pods' egress policy leaves out the API server, as the
    // cluster has it (the `kubernetes` Service and its endpoint at the node
    // IP). Nothing here enforces NetworkPolicies (the bridge plugin has no
    // policy engine): what is checked is what the chart asks of one.
    let policy: Value = serde_json::from_str(&common::kubectl(&[
        "get",
        "networkpolicy",
        "-n",
        &ns,
        &format!("{RELEASE}-step-egress"),
        "-o",
        "json",
    ]))
    .unwrap();
    let excepted: BTreeSet<String> = policy["spec"]["egress"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|rule| rule["to"].as_array().cloned().unwrap_or_default())
        .flat_map(|peer| {
            peer["ipBlock"]["except"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|c| c.as_str().map(str::to_string))
        .collect();
    for api in ["10.0.0.1/32".to_string(), format!("{node_ip}/32")] {
        assert!(
            excepted.contains(&api),
            "the step egress policy lets step pods reach the API server at {api}: {excepted:?}"
        );
    }

    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let all = pods.list(&ListParams::default()).await.unwrap().items;
    for p in &all {
        assert_eq!(
            p.spec.as_ref().and_then(|s| s.node_name.as_deref()),
            Some(NODE),
            "{:?} runs on the real node",
            p.metadata.name
        );
    }

    // The samples, then a second run of the refund agent that needs an
    // approver, then one whose step container is killed mid-run.
    standins.script_refund_samples().await;
    standins
        .script(
            "crash",
            json!([
                {"text": "Looking it up.", "toolCalls": [{"name": "lookup_order", "arguments": {"orderId": "1044"}}]},
                // Killed while it waits for this answer (the pod's
                // connection goes with it); asked again by the next pod.
                {"text": "slow", "delayMs": 120000, "toolCalls": [{"name": "finish", "arguments": {"result": "late"}}]},
                {"toolCalls": [{"name": "finish", "arguments": {"result": "Order 1044 is on its way."}}]}
            ]),
            json!([]),
        )
        .await;
    for sample in [
        "agentpolicy-platform.yaml",
        "agent-refund-assistant.yaml",
        "agentrun-refund.yaml",
    ] {
        apply_sample(&ns, sample, &base);
    }
    let agent_sample: Value = serde_yaml::from_str(
        &std::fs::read_to_string(common::root().join("config/samples/agent-refund-assistant.yaml"))
            .unwrap()
            .replace("http://127.0.0.1:18080", &base)
            .replace("/scripts/refund-demo/", "/scripts/refund-big/"),
    )
    .unwrap();
    let runs: Api<AgentRun> = Api::namespaced(client.clone(), &ns);
    let big: AgentRun = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "refund-big"},
        "spec": {"input": "Refund order 1043 in full.", "agent": agent_sample["spec"]}
    }))
    .unwrap();
    runs.create(&PostParams::default(), &big)
        .await
        .expect("refund-big");
    let crash: AgentRun = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "crash"},
        "spec": {"input": "Where is order 1044?", "agent": {
            "prompt": {"version": "v1", "system": "Answer with the order's state."},
            "model": {"provider": "OpenAI", "name": "m", "endpoint": format!("{base}/scripts/crash/v1"),
                      "secretRef": {"name": "model-api-key", "key": "apiKey"}},
            "tools": [{"name": "lookup_order", "description": "Looks an order up.",
                       "http": {"url": format!("{base}/tools/crash/lookup_order"), "idempotent": true}}]
        }}
    }))
    .unwrap();
    runs.create(&PostParams::default(), &crash)
        .await
        .expect("crash");

    // The sample, through step pods that reach the gateway and the stand-ins
    // by Service name.
    let run = wait_phase(&runs, &ns, "refund-order-1042", Phase::Succeeded).await;
    assert_eq!(
        run.status.clone().unwrap().result.as_deref(),
        Some("Refunded 40.00 for order 1042.")
    );
    // The sample names no requester: the webhook stamped the admin's name.
    assert!(
        requester_of(&run).is_some(),
        "{:?}",
        run.metadata.annotations
    );
    the_webhook_stamps_every_creator(&client, &ns).await;
    the_log_api_serves_bound_readers_only(&ns, "refund-order-1042").await;

    // The step container killed while it waits for the model's second
    // answer: read its confinement from the kernel, then SIGKILL it.
    let (killed_pod, container) = common::wait_for(
        "the crash run's step pod waiting for the second answer",
        TIMEOUT,
        || async {
            if standins.model_requests("crash").await.len() < 2 {
                return None;
            }
            let all = pods.list(&ListParams::default()).await.ok()?.items;
            step_pods_of(&all, "crash").into_iter().find_map(|p| {
                let status = p.status.as_ref()?;
                let c = status.container_statuses.as_ref()?.first()?;
                c.state.as_ref()?.running.as_ref()?;
                let id = c.container_id.as_ref()?.strip_prefix("containerd://")?;
                Some((p.metadata.name.clone()?, id.to_string()))
            })
        },
    )
    .await;
    let confined = confinement(container_pid(&container));
    assert!(
        confined.uid.split(' ').all(|u| u == "65532"),
        "the step container's uids: {}",
        confined.uid
    );
    assert_eq!(
        confined.cap_eff, "0000000000000000",
        "the step container keeps no capability"
    );
    assert!(
        confined.root_read_only,
        "the step container's root is read-only"
    );
    assert!(
        !confined.token_mounted,
        "no service-account token in the step container"
    );
    ctr(&["tasks", "kill", "--signal", "SIGKILL", &container]);

    // The big refund waits for an approver; alice approves through the
    // chart's approver ClusterRole bound in the namespace.
    let approval_name = common::approvals::awaited_approval(&client, &ns, "refund-big").await;
    common::approvals::approve_as_alice_through_role(
        &client,
        &ns,
        &approver_role,
        &approval_name,
        "damaged, paid in full",
    )
    .await;
    let run = wait_phase(&runs, &ns, "refund-big", Phase::Succeeded).await;
    assert_eq!(
        run.status.unwrap().result.as_deref(),
        Some("Refunded 150.00 for order 1043.")
    );
    // Both runs share the sample agent's tool tenant.
    let refunds: Vec<Value> = standins
        .effects("refund-demo")
        .await
        .into_iter()
        .filter(|e| e["tool"] == "issue_refund" && e["args"]["orderId"] == "1043")
        .collect();
    assert_eq!(
        refunds.len(),
        1,
        "one refund of 1043, after the approval: {refunds:?}"
    );
    assert_eq!(refunds[0]["args"]["amount"], 150);

    // The killed run resumed in a new pod from the log: the first answer
    // and the tool's result were replayed, not asked for again.
    let run = wait_phase(&runs, &ns, "crash", Phase::Succeeded).await;
    assert_eq!(
        run.status.unwrap().result.as_deref(),
        Some("Order 1044 is on its way.")
    );
    let requests = standins.model_requests("crash").await;
    assert_eq!(requests.len(), 3, "first answer once, the killed one again");
    let first_turns = model_turns(&requests[0]);
    assert_eq!(
        requests
            .iter()
            .filter(|r| model_turns(r) == first_turns)
            .count(),
        1,
        "the recorded first answer was not asked for again"
    );
    assert_eq!(
        model_turns(&requests[1]),
        model_turns(&requests[2]),
        "the killed request, asked again with the same history"
    );
    assert_eq!(
        standins.tool_requests("crash").await.len(),
        1,
        "the recorded tool result was replayed, not called again"
    );
    let all = pods.list(&ListParams::default()).await.unwrap().items;
    let crash_pods = step_pods_of(&all, "crash");
    let names: BTreeSet<_> = crash_pods
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    assert!(
        names.len() >= 2 && names.contains(&killed_pod),
        "the killed pod and its successor: {names:?}"
    );
    let killed = crash_pods
        .iter()
        .find(|p| p.metadata.name.as_ref() == Some(&killed_pod))
        .unwrap();
    let terminated = killed
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.terminated.as_ref())
        .expect("the killed container terminated");
    assert_eq!(terminated.exit_code, 137, "killed by SIGKILL");

    // Every step pod: the step ServiceAccount, no token; `kubectl logs` of
    // one comes from the kubelet through the API server as JSON lines.
    let steps: Vec<_> = all
        .iter()
        .filter(|p| {
            p.metadata
                .labels
                .as_ref()
                .is_some_and(|l| l.contains_key("agentrun.dev/run"))
        })
        .collect();
    // At least: the refund's, the approved big refund's (the pod that asked
    // for its approval is gone: a waiting run lets go of its ended Job), and
    // the crash run's killed pod and its successor.
    assert!(steps.len() >= 4, "{} step pods", steps.len());
    for p in &steps {
        let spec = p.spec.as_ref().unwrap();
        assert_eq!(spec.service_account_name.as_deref(), Some("agentrun-step"));
        assert_eq!(spec.automount_service_account_token, Some(false));
    }
    // The successor may have done its work before its kubelet reported the
    // container started (its status lags): wait until the API shows it ended.
    let logged = common::wait_for("the successor pod's container to end", TIMEOUT, || async {
        let all = pods.list(&ListParams::default()).await.ok()?.items;
        step_pods_of(&all, "crash").into_iter().find_map(|p| {
            let name = p.metadata.name.clone()?;
            let c = p
                .status
                .as_ref()?
                .container_statuses
                .as_ref()?
                .first()?
                .clone();
            c.state?.terminated?;
            (name != killed_pod).then_some(name)
        })
    })
    .await;
    let logs = common::kubectl(&["logs", "-n", &ns, &logged]);
    let lines: Vec<Value> = logs
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert!(
        !lines.is_empty(),
        "kubectl logs {logged}: no JSON lines:\n{logs}"
    );

    // The chart's PostgreSQL kept the log on the volume.
    let entries = std::fs::read_dir(&installed.volume.dir).unwrap().count();
    assert!(entries > 0, "PostgreSQL's data is on the host volume");
}
