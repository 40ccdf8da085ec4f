//! The Helm chart and the kustomize config on a real API server.
//!
//! - Both pass a server-side dry-run apply (schema, RBAC objects, CRDs and
//!   admission policies as the API server sees them).
//! - `helm install` brings the controller up through the process node
//!   (2 replicas, one leader), running with its own ServiceAccount's identity
//!   (the node hands a pod with a token mount a kubeconfig for that account),
//!   so the chart's RBAC is what the controller really has. A sample run
//!   succeeds (`kubectl wait --for=condition=Succeeded`), a run is cancelled
//!   mid-step, metrics and the runtime log-level switch answer.
//! - The API server's audit log of that ServiceAccount is compared with the
//!   installed ClusterRole and Role: nothing the controller called was
//!   refused or missing, and nothing granted went unused (but the approval
//!   writes listed in `NOT_EXERCISED`, with their reason).
//!
//! Needs the local control plane (`e2e/cluster up`; `e2e/cluster env`
//! exports AGENTRUN_AUDIT_LOG and the node's log dir), PostgreSQL
//! (`e2e/postgres`, started if needed), and helm (`e2e/build-helm.sh`).

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agentrun::api::{AgentRun, Phase};
use common::standins::Standins;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde::Deserialize as _;
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(180);

/// Granted but not exercised by this test, and why. Everything else the
/// ClusterRole and Role grant must show up in the audit log.
const NOT_EXERCISED: &[(&str, &str, &str, &str)] = &[
    (
        "agentrun.dev",
        "agents",
        "get",
        "Agents come from the controller's watch cache; one is read from the API server only when the cache has not seen it yet (created a moment before its run)",
    ),
    (
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        "watch",
        "the controller watches the CRDs only while they are not yet established at its start",
    ),
    (
        "",
        "pods",
        "list",
        "the controller lists a failed Job's pods (to tell a lost pod from a crash); no step Job fails here",
    ),
    (
        "events.k8s.io",
        "events",
        "patch",
        "kube's Recorder patches an Event's series only when the same event repeats",
    ),
    (
        "agentrun.dev",
        "agentruns",
        "get",
        "the log API reads the run whose log it serves; this install registers no APIService (the process node's pods have loopback addresses, which the aggregator cannot dial): tests/e2e_log_api.rs and tests/e2e_real_node_chart.rs read logs",
    ),
];

fn helm() -> PathBuf {
    let out = Command::new("bash")
        .arg(common::root().join("e2e/build-helm.sh"))
        .arg("path")
        .stderr(Stdio::inherit())
        .output()
        .expect("running e2e/build-helm.sh");
    assert!(out.status.success(), "building helm failed");
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn docs(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|d| serde_yaml::Value::deserialize(d).expect("valid YAML"))
        .filter(|v| !v.is_null())
        .map(|v| serde_json::to_value(v).unwrap())
        .collect()
}

fn helm_template(release: &str, ns: &str, values: &Value) -> Vec<Value> {
    helm_template_with(release, ns, values, &[])
}

/// `helm template` with more arguments (`--dry-run=server`: the render sees
/// the cluster, as `helm install` does).
fn helm_template_with(release: &str, ns: &str, values: &Value, extra: &[&str]) -> Vec<Value> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("values.json");
    std::fs::write(&file, values.to_string()).unwrap();
    docs(&run_ok(
        Command::new(helm())
            .current_dir(common::root())
            .args(["template", release, "charts/agentrun", "--namespace", ns])
            .arg("--values")
            .arg(&file)
            .args(extra),
    ))
}

fn find<'a>(objs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objs.iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} rendered"))
}

/// The step-token key the chart generated at install is the same after a
/// `helm upgrade`; after `kubectl agentrun rotate-key` the next upgrade keeps
/// the new key and the retired one (the chart reads both from the cluster).
async fn generated_key_survives_upgrades_and_rotations(
    client: &kube::Client,
    release: &str,
    ns: &str,
) {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let name = format!("{release}-step-token-key");
    let data = || async {
        let s = secrets.get(&name).await.expect("the generated key Secret");
        s.data.unwrap_or_default()
    };
    let upgrade = || {
        run_ok(
            Command::new(helm())
                .current_dir(common::root())
                .args(["upgrade", release, "charts/agentrun", "--namespace", ns])
                .args(["--reuse-values", "--wait", "--timeout", "180s"]),
        )
    };
    let installed = data().await;
    assert!(
        installed["key"].0.len() >= 64,
        "a random key of 64 characters"
    );
    assert!(!installed.contains_key("retired"));
    upgrade();
    assert_eq!(
        data().await,
        installed,
        "helm upgrade kept the generated key"
    );

    let out = run_ok(Command::new(common::binary("kubectl-agentrun")).args([
        "rotate-key",
        "--controller-namespace",
        ns,
        "--secret",
        &name,
    ]));
    assert!(out.contains("rotated"), "{out}");
    let rotated = data().await;
    assert_ne!(rotated["key"], installed["key"], "a new current key");
    // The old key retired, with the time of its retirement (`KEY TIME`).
    let retired = String::from_utf8(rotated["retired"].0.clone()).unwrap();
    let old = String::from_utf8(installed["key"].0.clone()).unwrap();
    let (key, at) = retired.trim_end().split_once(' ').expect("KEY TIME");
    assert_eq!(key, old.trim_end(), "the old key retired");
    assert!(at.parse::<jiff::Timestamp>().is_ok(), "{retired:?}");
    upgrade();
    assert_eq!(data().await, rotated, "helm upgrade kept the rotation");
}

/// `kubectl apply --server-side --dry-run=server` of `objs` (as a v1 List).
fn dry_run_apply(objs: &[Value]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("objects.json");
    std::fs::write(
        &file,
        json!({"apiVersion": "v1", "kind": "List", "items": objs}).to_string(),
    )
    .unwrap();
    run_ok(Command::new("kubectl").args([
        "apply",
        "--server-side",
        "--dry-run=server",
        "--force-conflicts",
        "--field-manager=agentrun-e2e-dry-run",
        "-f",
        file.to_str().unwrap(),
    ]))
}

fn assert_all_applied(out: &str, objs: &[Value]) {
    for o in objs {
        let name = o["metadata"]["name"].as_str().unwrap();
        assert!(
            out.lines()
                .any(|l| l.contains(&format!("/{name} ")) && l.contains("(server dry run)")),
            "{}/{name} was not applied by the dry run:\n{out}",
            o["kind"]
        );
    }
}

#[tokio::test]
async fn the_rendered_chart_and_config_default_pass_a_server_side_dry_run() {
    let client = common::admin().await;
    let ns = common::test_namespace(&client, "chart-dry").await;
    let release = common::unique_name("dry");

    // Default values, as a render without the cluster must give them (the
    // controller makes its serving certificate): the APIService and, helm
    // template knowing no MutatingAdmissionPolicy, the requester-stamp webhook.
    let objs = helm_template(
        &release,
        ns.name(),
        &json!({"store": {"existingSecret": "agentrun-store"},
                "controller": {"stepTokenKey": {"existingSecret": "agentrun-step-token-key"}},
                "servingCert": {"mode": "controller"}}),
    );
    assert!(objs.len() >= 12, "{} objects", objs.len());
    for kind in ["APIService", "MutatingWebhookConfiguration"] {
        assert!(objs.iter().any(|o| o["kind"] == kind), "{kind} rendered");
    }
    assert_all_applied(&dry_run_apply(&objs), &objs);

    // (The release name lacks "agentrun": objects are named <release>-agentrun-….)
    let fullname = format!("{release}-agentrun");
    // servingCert.mode=chart where the render sees the cluster (helm
    // install's render): a generated certificate whose CA is the caBundle of
    // the APIService and of the webhook, both accepted by the API server.
    let objs = helm_template_with(
        &release,
        ns.name(),
        &json!({"store": {"existingSecret": "agentrun-store"},
                "controller": {"stepTokenKey": {"existingSecret": "agentrun-step-token-key"}},
                "crds": {"stampRequester": "webhook"}}),
        &["--dry-run=server"],
    );
    let secret = find(&objs, "Secret", &format!("{fullname}-serving-cert"));
    assert_eq!(secret["type"], "kubernetes.io/tls");
    let ca = secret["data"]["ca.crt"].as_str().expect("ca.crt");
    assert_eq!(
        find(&objs, "APIService", "v1alpha1.log.agentrun.dev")["spec"]["caBundle"],
        ca
    );
    assert_eq!(
        find(
            &objs,
            "MutatingWebhookConfiguration",
            &format!("{fullname}-requester-stamp")
        )["webhooks"][0]["clientConfig"]["caBundle"],
        ca
    );
    assert_all_applied(&dry_run_apply(&objs), &objs);

    // servingCert.mode=certManager: the APIService and the webhook carry
    // cainjector's annotation (cert-manager's own kinds are left out: this
    // cluster has no cert-manager CRDs).
    let objs = helm_template(
        &release,
        ns.name(),
        &json!({"store": {"existingSecret": "agentrun-store"},
                "controller": {"stepTokenKey": {"existingSecret": "agentrun-step-token-key"}},
                "servingCert": {"mode": "certManager"}, "crds": {"stampRequester": "webhook"}}),
    );
    let (issued, objs): (Vec<Value>, Vec<Value>) = objs
        .into_iter()
        .partition(|o| o["apiVersion"] == "cert-manager.io/v1");
    assert_eq!(issued.len(), 4, "two Issuers and two Certificates");
    for kind in ["APIService", "MutatingWebhookConfiguration"] {
        let o = objs.iter().find(|o| o["kind"] == kind).unwrap();
        assert_eq!(
            o["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
            format!("{}/{fullname}-serving-cert", ns.name()).as_str()
        );
    }
    assert_all_applied(&dry_run_apply(&objs), &objs);

    // Everything optional switched on (the ServiceMonitor needs the
    // prometheus-operator CRD, which this cluster does not have: it is
    // checked by tests/packaging.rs, and left out here).
    let objs = helm_template(
        &release,
        ns.name(),
        &json!({
            "watchNamespace": ns.name(),
            "controller": {"replicas": 3, "stepTokenKey": {"existingSecret": "token-key"}},
            "servingCert": {"mode": "controller"},
            "logApi": {"apiService": false, "readerRole": {"name": format!("{release}-log-reader")}},
            "postgresql": {"enabled": true, "password": "e2e"},
            "modelSecrets": [{"name": "openai", "stringData": {"apiKey": "sk-x"}}],
            "metrics": {"serviceMonitor": {"enabled": true}},
            "networkPolicy": {"enabled": true, "controllerEgress": [{"ports": [{"port": 443}]}]},
            "approverRole": {"name": format!("{release}-approver")},
            "crds": {"install": false}
        }),
    );
    let (monitors, objs): (Vec<Value>, Vec<Value>) = objs
        .into_iter()
        .partition(|o| o["kind"] == "ServiceMonitor");
    assert_eq!(monitors.len(), 1);
    for kind in ["StatefulSet", "NetworkPolicy", "Secret"] {
        assert!(objs.iter().any(|o| o["kind"] == kind), "{kind} rendered");
    }
    assert_all_applied(&dry_run_apply(&objs), &objs);

    // The kustomize install, moved into the test namespace by an overlay.
    let overlay = tempfile::tempdir().unwrap();
    // kustomize takes bases by relative path only.
    let up = "../".repeat(overlay.path().components().count() - 1);
    std::fs::write(
        overlay.path().join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: {}\nresources:\n  - {up}{}/config/default\n",
            ns.name(),
            common::root().to_string_lossy().trim_start_matches('/')
        ),
    )
    .unwrap();
    let built = run_ok(Command::new("kubectl").arg("kustomize").arg(overlay.path()));
    let objs: Vec<Value> = docs(&built)
        .into_iter()
        .filter(|o| o["kind"] != "Namespace")
        .collect();
    for kind in [
        "CustomResourceDefinition",
        "ClusterRole",
        "Deployment",
        "ServiceAccount",
        "APIService",
        "MutatingWebhookConfiguration",
    ] {
        assert!(
            objs.iter().any(|o| o["kind"] == kind),
            "config/default has a {kind}"
        );
    }
    assert_all_applied(&dry_run_apply(&objs), &objs);
    // And config/default itself builds (what `kubectl apply -k config/default` sends).
    let plain = docs(&run_ok(Command::new("kubectl").args([
        "kustomize",
        &format!("{}/config/default", common::root().display()),
    ])));
    assert!(
        plain
            .iter()
            .any(|o| o["kind"] == "Namespace" && o["metadata"]["name"] == "agentrun-system")
    );
    // The log API's authentication reader stays in kube-system (config/default
    // has no namespace transformer to move it).
    assert_eq!(
        find(
            &plain,
            "RoleBinding",
            "agentrun-agentrun-system-controller-auth-reader"
        )["metadata"]["namespace"],
        "kube-system"
    );
}

/// A Helm release, uninstalled when dropped.
struct Release {
    name: String,
    namespace: String,
}

impl Drop for Release {
    fn drop(&mut self) {
        if std::env::var_os("AGENTRUN_E2E_KEEP_NAMESPACES").is_some() {
            return;
        }
        let _ = Command::new(helm())
            .args(["uninstall", &self.name, "--namespace", &self.namespace])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// The process node's log of a pod's container.
fn pod_log(ns: &str, pod: &str) -> String {
    let dir = common::node_state_dir()
        .expect("the chart install test runs on the local control plane (e2e/cluster)")
        .join("logs");
    let prefix = format!("{ns}_{pod}_");
    let mut out = String::new();
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                out.push_str(&std::fs::read_to_string(e.path()).unwrap_or_default());
            }
        }
    }
    out
}

/// The address a controller replica serves /metrics on (from its JSON log).
fn metrics_port(log: &str) -> Option<u16> {
    log.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["fields"]["message"] == "serving /metrics, /healthz, /readyz")
        .and_then(|v| {
            v["fields"]["addr"]
                .as_str()?
                .rsplit(':')
                .next()?
                .parse()
                .ok()
        })
}

/// The value of a Prometheus sample (first line starting with `series`).
fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

#[tokio::test]
async fn the_chart_installs_a_controller_that_runs_a_sample_with_least_privilege() {
    assert!(
        !common::existing_cluster(),
        "this test installs the chart on the local control plane (process node, audit log); run it with e2e/test"
    );
    let audit_log = PathBuf::from(std::env::var("AGENTRUN_AUDIT_LOG").unwrap_or_else(|_| {
        panic!("AGENTRUN_AUDIT_LOG is not set: eval \"$(e2e/cluster env)\" (e2e/cluster up enables the API server's audit log)")
    }));
    assert!(
        audit_log.exists(),
        "{} does not exist: this cluster was started without the audit log; restart it (e2e/cluster down && e2e/cluster up)",
        audit_log.display()
    );
    // The chart's copy of crds/ must be current before it is applied to the
    // shared cluster (a stale copy would downgrade the CRDs other tests use).
    for f in std::fs::read_dir(common::root().join("crds")).unwrap() {
        let f = f.unwrap().path();
        let copy = common::root()
            .join("charts/agentrun/files/crds")
            .join(f.file_name().unwrap());
        assert!(
            std::fs::read(&copy).ok() == std::fs::read(&f).ok(),
            "{} is stale: run config/generate",
            copy.display()
        );
    }

    let client = common::admin().await;
    let ns_guard = common::test_namespace(&client, "chart").await;
    let ns = ns_guard.name().to_string();
    let standins = Standins::start();
    let store_url = common::store::e2e_store_url().await;
    let release = common::unique_name("agentrun");
    let approver_role = format!("{release}-approver");

    // CRDs and admission policies from the chart, applied idempotently (they
    // are cluster-wide and shared with the other tests).
    let crd_yaml = run_ok(
        Command::new(helm())
            .current_dir(common::root())
            .args(["template", &release, "charts/agentrun", "--namespace", &ns])
            .args([
                "--set",
                "store.existingSecret=x",
                "--set",
                "controller.stepTokenKey.existingSecret=x",
                "--set",
                "servingCert.mode=controller",
                "--show-only",
                "templates/crds.yaml",
            ]),
    );
    let crd_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(crd_file.path(), &crd_yaml).unwrap();
    run_ok(Command::new("kubectl").args([
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=agentrun-e2e",
        "-f",
        crd_file.path().to_str().unwrap(),
    ]));
    for name in [
        "agents.agentrun.dev",
        "agentruns.agentrun.dev",
        "approvals.agentrun.dev",
    ] {
        common::wait_established(&client, name).await;
    }
    // The requester stamp the chart installs where the API server serves
    // MutatingAdmissionPolicy (the template rendered here holds the CRDs and
    // the validating policies for this release): applied as the other suites
    // apply it, so this test does not depend on their order.
    common::apply_requester_stamp(&client).await;

    // helm install: watching only the test namespace, store URL through the
    // chart's Secret, model key through the chart's modelSecrets.
    let gateway_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    // The process node runs no secret volumes and its pods' addresses are
    // loopback, which neither the aggregator nor a webhook call can reach:
    // the controller makes its serving certificate (servingCert.mode
    // controller, exercising that RBAC), no APIService is registered (it is
    // one per cluster; tests/e2e_log_api.rs registers its own) and requesters
    // are stamped by the policy applied above, not the webhook.
    let values = json!({
        "crds": {"install": false, "stampRequester": "false"},
        "servingCert": {"mode": "controller"},
        "logApi": {"apiService": false, "readerRole": {"name": format!("{release}-log-reader")}},
        "watchNamespace": ns,
        "store": {"url": store_url},
        "modelSecrets": [{"name": "model-api-key", "stringData": {"apiKey": "sk-e2e-not-a-real-key"}}],
        "approverRole": {"name": approver_role},
        "controller": {
            "leaseSeconds": 6,
            // Both replicas share the node's loopback: each takes a free
            // metrics port; they share one gateway port (SO_REUSEPORT), which
            // step pods, local processes too, reach instead of the Service.
            "extraArgs": [
                "--metrics-addr=127.0.0.1:0",
                "--serving-addr=127.0.0.1:0",
                format!("--step-api-addr=127.0.0.1:{gateway_port}"),
                format!("--step-api-url=http://127.0.0.1:{gateway_port}")
            ]
        }
    });
    let values_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(values_file.path(), values.to_string()).unwrap();
    let guard = Release {
        name: release.clone(),
        namespace: ns.clone(),
    };
    let started = Instant::now();
    run_ok(
        Command::new(helm())
            .current_dir(common::root())
            .args(["install", &release, "charts/agentrun", "--namespace", &ns])
            .arg("--values")
            .arg(values_file.path())
            .args(["--wait", "--timeout", "180s"]),
    );
    let ready_after = started.elapsed();

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let deploy_name = format!("{release}-controller");
    let deploy = deployments.get(&deploy_name).await.unwrap();
    assert_eq!(
        deploy.status.as_ref().and_then(|s| s.ready_replicas),
        Some(2),
        "both replicas Ready"
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let controller_pods = pods
        .list(&ListParams::default().labels(&format!(
            "app.kubernetes.io/instance={release},app.kubernetes.io/component=controller"
        )))
        .await
        .unwrap()
        .items;
    assert_eq!(controller_pods.len(), 2);
    for p in &controller_pods {
        let spec = p.spec.as_ref().unwrap();
        assert_eq!(
            spec.service_account_name.as_deref(),
            Some("agentrun-controller")
        );
    }

    // The serving certificate the replicas made (one Secret: the replica
    // that lost the race to create it read the other's).
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let serving_cert =
        common::wait_for("the controller's serving certificate", TIMEOUT, || async {
            secrets
                .get_opt(&format!("{release}-serving-cert"))
                .await
                .ok()?
        })
        .await;
    assert_eq!(serving_cert.type_.as_deref(), Some("kubernetes.io/tls"));
    let data = serving_cert.data.unwrap_or_default();
    for key in ["tls.crt", "tls.key", "ca.crt"] {
        assert!(
            std::str::from_utf8(&data[key].0).is_ok_and(|pem| pem.contains("-----BEGIN ")),
            "{key} is PEM"
        );
    }

    // One leader, through the Lease in the watched namespace.
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let leader = common::wait_for("a leader in the Lease", TIMEOUT, || async {
        let lease = leases.get_opt("agentrun-controller").await.ok()??;
        lease.spec?.holder_identity
    })
    .await;
    let elected_after = started.elapsed();
    assert!(
        controller_pods
            .iter()
            .any(|p| p.metadata.name.as_deref() == Some(leader.as_str())),
        "the leader {leader} is one of the pods"
    );
    eprintln!(
        "chart install: helm install --wait to 2/2 Ready in {:.1} s, leader elected after {:.1} s",
        ready_after.as_secs_f64(),
        elected_after.as_secs_f64()
    );
    let leader_port = common::wait_for(
        "the leader's metrics address in its log",
        TIMEOUT,
        || async { metrics_port(&pod_log(&ns, &leader)) },
    )
    .await;

    // A sample run, as in config/samples, against the stand-ins.
    standins.script_refund_samples().await;
    standins
        .script(
            "slow",
            json!([{"text": "thinking", "delayMs": 60000, "toolCalls": [{"name": "lookup_order", "arguments": {"orderId": "1"}}]}]),
            json!([]),
        )
        .await;
    let samples = common::root().join("config/samples");
    for sample in [
        "agentpolicy-platform.yaml",
        "agent-refund-assistant.yaml",
        "agentrun-refund.yaml",
    ] {
        let text = std::fs::read_to_string(samples.join(sample))
            .unwrap()
            .replace("http://127.0.0.1:18080", &standins.base);
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), text).unwrap();
        run_ok(Command::new("kubectl").args([
            "apply",
            "-n",
            &ns,
            "-f",
            file.path().to_str().unwrap(),
        ]));
    }
    // A run of the same agent whose refund needs a finance approver.
    let agent_sample: Value = serde_yaml::from_str(
        &std::fs::read_to_string(samples.join("agent-refund-assistant.yaml"))
            .unwrap()
            .replace("http://127.0.0.1:18080", &standins.base)
            .replace("/scripts/refund-demo/", "/scripts/refund-big/"),
    )
    .unwrap();
    let big: AgentRun = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "refund-big"},
        "spec": {"input": "Refund order 1043 in full.", "agent": agent_sample["spec"]}
    }))
    .unwrap();
    let runs: Api<AgentRun> = Api::namespaced(client.clone(), &ns);
    runs.create(&Default::default(), &big)
        .await
        .expect("refund-big run");

    // A run cancelled while its step Job works (the controller deletes the Job).
    let slow_agent = json!({
        "prompt": {"version": "v1", "system": "x"},
        "model": {"provider": "OpenAI", "name": "m", "endpoint": format!("{}/scripts/slow/v1", standins.base),
                  "secretRef": {"name": "model-api-key", "key": "apiKey"}},
        "tools": [{"name": "lookup_order", "description": "Looks an order up.",
                   "http": {"url": format!("{}/tools/slow/lookup_order", standins.base), "idempotent": true}}]
    });
    let slow: AgentRun = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "slow"},
        "spec": {"input": "Wait.", "agent": slow_agent}
    }))
    .unwrap();
    runs.create(&Default::default(), &slow)
        .await
        .expect("slow run");

    // `kubectl wait --for=condition=Succeeded ar/NAME`, as the README shows.
    let waited = Instant::now();
    run_ok(Command::new("kubectl").args([
        "wait",
        "-n",
        &ns,
        "--for=condition=Succeeded",
        "ar/refund-order-1042",
        "--timeout=180s",
    ]));
    let run = runs.get("refund-order-1042").await.unwrap();
    let status = run.status.clone().unwrap();
    assert_eq!(status.phase, Some(Phase::Succeeded));
    assert_eq!(
        status.result.as_deref(),
        Some("Refunded 40.00 for order 1042.")
    );
    eprintln!(
        "sample run: apply to Succeeded in {:.1} s",
        waited.elapsed().as_secs_f64()
    );

    // Step pods: the chart's step ServiceAccount, no token.
    let step_pods = pods
        .list(&ListParams::default().labels("agentrun.dev/run=refund-order-1042"))
        .await
        .unwrap()
        .items;
    assert!(!step_pods.is_empty());
    for p in &step_pods {
        let spec = p.spec.as_ref().unwrap();
        assert_eq!(spec.service_account_name.as_deref(), Some("agentrun-step"));
        assert_eq!(spec.automount_service_account_token, Some(false));
    }

    // The big refund waits for an approver: alice (group finance-approvers),
    // with the chart's approver ClusterRole bound in the namespace, approves.
    let approval_name = common::approvals::awaited_approval(&client, &ns, "refund-big").await;
    common::approvals::approve_as_alice_through_role(
        &client,
        &ns,
        &approver_role,
        &approval_name,
        "damaged, paid in full",
    )
    .await;
    run_ok(Command::new("kubectl").args([
        "wait",
        "-n",
        &ns,
        "--for=condition=Succeeded",
        "ar/refund-big",
        "--timeout=180s",
    ]));

    // Cancel the slow run while its Job is busy with the model call.
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns);
    common::wait_for("the slow run's step Job to be active", TIMEOUT, || async {
        let r = runs.get("slow").await.ok()?;
        let job = r.status?.step?.job?;
        let j = jobs.get_opt(&job).await.ok()??;
        (j.status?.active.unwrap_or(0) > 0).then_some(())
    })
    .await;
    runs.patch(
        "slow",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"cancel": true}})),
    )
    .await
    .unwrap();
    common::wait_for("the slow run to be Cancelled", TIMEOUT, || async {
        let r = runs.get("slow").await.map_err(|e| e.to_string())?;
        match r.status.and_then(|s| s.phase) {
            Some(Phase::Cancelled) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;

    // Metrics of the leader.
    let metrics = common::wait_for(
        "the leader's metrics to count the runs",
        TIMEOUT,
        || async {
            let (code, body) =
                common::controller::http_request(leader_port, "GET", "/metrics", "").await;
            (code == 200
                && sample(&body, r#"agentrun_runs{phase="Succeeded"}"#) >= Some(2.0)
                && sample(&body, r#"agentrun_runs{phase="Cancelled"}"#) >= Some(1.0))
            .then_some(body)
        },
    )
    .await;
    for (series, at_least) in [
        (r#"agentrun_steps_total{kind="ModelCall"}"#, 3.0),
        (r#"agentrun_steps_total{kind="ToolResult"}"#, 2.0),
        (r#"agentrun_steps_total{kind="RunFinished"}"#, 1.0),
        (
            r#"agentrun_step_duration_seconds_count{outcome="succeeded"}"#,
            1.0,
        ),
        (r#"agentrun_model_tokens_total{direction="input""#, 1.0),
        (
            r#"agentrun_store_append_duration_seconds_count{outcome="ok"}"#,
            1.0,
        ),
        (
            r#"agentrun_approval_wait_seconds_count{verdict="Approve"}"#,
            1.0,
        ),
        (r#"agentrun_steps_total{kind="ApprovalDecided"}"#, 1.0),
        ("agentrun_reconciliations_total", 5.0),
    ] {
        let v = sample(&metrics, series).unwrap_or(0.0);
        assert!(
            v >= at_least,
            "{series} = {v}, expected at least {at_least}:\n{metrics}"
        );
    }
    assert!(
        metrics.contains("agentrun_model_cost_usd_total"),
        "{metrics}"
    );

    // The runtime log-level switch: debug on, and reconcile's debug lines
    // appear, as JSON carrying the run and step of their span.
    let (code, body) =
        common::controller::http_request(leader_port, "PUT", "/loglevel", "info,agentrun=debug")
            .await;
    assert_eq!(code, 200, "{body}");
    let (code, body) = common::controller::http_request(leader_port, "GET", "/loglevel", "").await;
    assert_eq!((code, body.trim()), (200, "info,agentrun=debug"));
    let (code, _) =
        common::controller::http_request(leader_port, "PUT", "/loglevel", "not a [level").await;
    assert_eq!(code, 400);
    runs.patch(
        "refund-order-1042",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {"touched": "yes"}}})),
    )
    .await
    .unwrap();
    let line = common::wait_for(
        "a debug line of reconcile in the leader's log",
        TIMEOUT,
        || async {
            pod_log(&ns, &leader)
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .find(|v| {
                    v["level"] == "DEBUG"
                        && v["span"]["name"] == "reconcile"
                        && v["span"]["run"] == "refund-order-1042"
                })
        },
    )
    .await;
    assert!(
        line["span"]["step"].as_u64().is_some_and(|s| s >= 5),
        "{line}"
    );
    assert_eq!(line["span"]["namespace"], ns.as_str(), "{line}");

    // --- RBAC: what the controller's ServiceAccount did vs. what it may do.
    let user = format!("system:serviceaccount:{ns}:agentrun-controller");
    let mut used: BTreeSet<(String, String, String)> = BTreeSet::new();
    let mut refused = Vec::new();
    let mut secret_names = BTreeSet::new();
    let audit = std::fs::read_to_string(&audit_log).unwrap();
    for line in audit.lines() {
        let Ok(e) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        // Watches are logged when they start (and complete only when they end).
        let stage = e["stage"].as_str().unwrap_or("");
        if e["user"]["username"] != user.as_str()
            || !matches!(stage, "ResponseStarted" | "ResponseComplete")
        {
            continue;
        }
        let Some(obj) = e["objectRef"].as_object() else {
            continue; // discovery and other non-resource URLs
        };
        let group = obj
            .get("apiGroup")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let mut resource = obj["resource"].as_str().unwrap_or("").to_string();
        if let Some(sub) = obj.get("subresource").and_then(Value::as_str) {
            resource = format!("{resource}/{sub}");
        }
        let verb = e["verb"].as_str().unwrap_or("").to_string();
        let code = e["responseStatus"]["code"].as_u64().unwrap_or(0);
        if code == 403 {
            refused.push(format!(
                "{verb} {group}/{resource} {}",
                obj.get("name").and_then(Value::as_str).unwrap_or("")
            ));
        }
        if resource == "secrets" {
            secret_names.insert(
                obj.get("name")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
            );
        }
        // A server-side apply that creates the object is also authorized as `create`.
        if verb == "patch" && code == 201 {
            used.insert((group.clone(), resource.clone(), "create".into()));
        }
        used.insert((group, resource, verb));
    }
    assert!(
        refused.is_empty(),
        "the API server refused the controller: {refused:?}"
    );
    assert!(
        used.contains(&(
            "agentrun.dev".into(),
            "agentruns/status".into(),
            "patch".into()
        )),
        "the controller wrote run status as {user}: {used:?}"
    );
    // The only Secrets the controller touches: the runs' step credentials
    // (named by run uid; the shared store Secret is gone) and its serving
    // certificate.
    let serving_secret = format!("{release}-serving-cert");
    assert!(
        !secret_names.is_empty()
            && secret_names
                .iter()
                // (a create's audit entry may carry no name)
                .all(|n| n.is_empty()
                    || *n == serving_secret
                    || (n.starts_with("agentrun-step-") && n != "agentrun-step-store")),
        "the controller touched other Secrets: {secret_names:?}"
    );

    let mut granted: BTreeSet<(String, String, String)> = BTreeSet::new();
    let role_json = |kind: &str, name: &str, namespace: Option<&str>| -> Value {
        let mut cmd = Command::new("kubectl");
        cmd.args(["get", kind, name, "-o", "json"]);
        if let Some(n) = namespace {
            cmd.args(["-n", n]);
        }
        serde_json::from_str(&run_ok(&mut cmd)).unwrap()
    };
    let cluster_role = role_json("clusterrole", &format!("{release}-{ns}-controller"), None);
    let lease_role = role_json("role", &format!("{release}-leader-election"), Some(&ns));
    let keys_role = role_json("role", &format!("{release}-controller-keys"), Some(&ns));
    let cert_role = role_json("role", &format!("{release}-serving-cert"), Some(&ns));
    let rows = |role: &Value, into: &mut BTreeSet<(String, String, String)>| {
        for rule in role["rules"].as_array().unwrap() {
            for g in rule["apiGroups"].as_array().unwrap() {
                for r in rule["resources"].as_array().unwrap() {
                    for v in rule["verbs"].as_array().unwrap() {
                        into.insert((
                            g.as_str().unwrap().into(),
                            r.as_str().unwrap().into(),
                            v.as_str().unwrap().into(),
                        ));
                    }
                }
            }
        }
    };
    for role in [&cluster_role, &lease_role, &keys_role, &cert_role] {
        rows(role, &mut granted);
    }
    // The built-in roles the chart binds for the log API (SubjectAccessReviews;
    // the front-proxy CA in kube-system): what the controller calls through
    // them is granted, but they are Kubernetes' and grant more than it uses.
    let mut granted_built_in = granted.clone();
    rows(
        &role_json("clusterrole", "system:auth-delegator", None),
        &mut granted_built_in,
    );
    rows(
        &role_json(
            "role",
            "extension-apiserver-authentication-reader",
            Some("kube-system"),
        ),
        &mut granted_built_in,
    );
    let missing: Vec<_> = used.difference(&granted_built_in).collect();
    assert!(missing.is_empty(), "called but not granted: {missing:?}");
    let excused: BTreeSet<(String, String, String)> = NOT_EXERCISED
        .iter()
        .map(|(g, r, v, _)| (g.to_string(), r.to_string(), v.to_string()))
        .collect();
    for e in &excused {
        assert!(
            granted.contains(e),
            "NOT_EXERCISED lists {e:?}, which is not granted: remove it"
        );
    }
    let unused: Vec<_> = granted
        .difference(&used)
        .filter(|g| !excused.contains(*g))
        .collect();
    assert!(
        unused.is_empty(),
        "granted but never called (least privilege: drop them, or exercise them here): {unused:?}\nused: {used:?}"
    );
    let exercised_anyway: Vec<_> = excused.intersection(&used).collect();
    eprintln!(
        "rbac: {} (group, resource, verb) used, {} granted; listed as not exercised but used: {exercised_anyway:?}",
        used.len(),
        granted.len()
    );
    // Step pods never talk to the API server.
    assert!(
        !audit.contains(&format!("\"system:serviceaccount:{ns}:agentrun-step\"")),
        "a step pod called the API server"
    );

    generated_key_survives_upgrades_and_rotations(&client, &release, &ns).await;

    // helm uninstall removes the cluster-scoped objects of the release.
    drop(guard);
    let gone = Command::new("kubectl")
        .args(["get", "clusterrole", &format!("{release}-{ns}-controller")])
        .output()
        .unwrap();
    assert!(
        !gone.status.success(),
        "the ClusterRole outlived helm uninstall"
    );
}
