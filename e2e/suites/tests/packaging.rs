//! How agentrun is installed, checked without a cluster: the Helm chart
//! (lint, rendering with default and non-default values, the values schema
//! refusing wrong values), the kustomize bases generated from it, the Argo CD
//! health check (run by gopher-lua, the Lua Argo CD embeds), and the
//! Dockerfile's stages (no container engine here: the build context is
//! simulated and checked against what Cargo and the compiler actually read).
//!
//! helm and the Lua runner are built from their Go modules by
//! `e2e/build-helm.sh` (cached in ~/.cache/agentrun); `e2e/test` builds them
//! first, and these tests build them if they are missing.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Command, Stdio};

use serde::Deserialize as _;
use serde_json::{Value, json};

mod common;
use common::scripts::{helm, helm_lint, helm_run, helm_tool};

use common::root;

/// Runs `e2e/build-helm.sh ARG` and returns the tool path it prints.
/// Parses a multi-document YAML stream into JSON values (empty documents dropped).
fn docs(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|d| serde_yaml::Value::deserialize(d).expect("valid YAML"))
        .filter(|v| !v.is_null())
        .map(|v| serde_json::to_value(v).expect("YAML as JSON"))
        .collect()
}

/// Renders the chart with `values` (a JSON document written to a values file).
fn render(release: &str, namespace: &str, values: &Value) -> Result<Vec<Value>, String> {
    render_with(release, namespace, values, &[])
}

/// [`render`] with more `helm template` arguments (e.g. `--api-versions`).
fn render_with(
    release: &str,
    namespace: &str,
    values: &Value,
    extra: &[&str],
) -> Result<Vec<Value>, String> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("values.json");
    std::fs::write(&file, values.to_string()).unwrap();
    let mut args = vec![
        "template",
        release,
        "charts/agentrun",
        "--namespace",
        namespace,
        "--values",
        file.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let (ok, stdout, stderr) = helm_run(&args);
    if ok { Ok(docs(&stdout)) } else { Err(stderr) }
}

fn find<'a>(objs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objs.iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| {
            let have: Vec<String> = objs
                .iter()
                .map(|o| format!("{}/{}", o["kind"], o["metadata"]["name"]))
                .collect();
            panic!("no {kind} {name} rendered; have {have:?}")
        })
}

fn all<'a>(objs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objs.iter().filter(|o| o["kind"] == kind).collect()
}

fn env_of<'a>(container: &'a Value, name: &str) -> &'a Value {
    container["env"]
        .as_array()
        .and_then(|e| e.iter().find(|v| v["name"] == name))
        .unwrap_or_else(|| panic!("env {name} missing in {container}"))
}

fn has_env(container: &Value, name: &str) -> bool {
    container["env"]
        .as_array()
        .is_some_and(|e| e.iter().any(|v| v["name"] == name))
}

fn numbers_as_f64(v: Value) -> Value {
    match v {
        Value::Number(n) => json!(n.as_f64().unwrap()),
        Value::Array(a) => Value::Array(a.into_iter().map(numbers_as_f64).collect()),
        Value::Object(o) => {
            Value::Object(o.into_iter().map(|(k, v)| (k, numbers_as_f64(v))).collect())
        }
        other => other,
    }
}

fn crate_version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// The YAML documents of every file in `crds/`, by (kind, name).
fn source_crds() -> BTreeMap<(String, String), Value> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(root().join("crds")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            for d in docs(&std::fs::read_to_string(&path).unwrap()) {
                let key = (
                    d["kind"].as_str().unwrap().to_string(),
                    d["metadata"]["name"].as_str().unwrap().to_string(),
                );
                out.insert(key, d);
            }
        }
    }
    out
}

#[test]
fn the_charts_crds_are_a_copy_of_crds() {
    let list = |dir: &str| -> BTreeMap<String, Vec<u8>> {
        std::fs::read_dir(root().join(dir))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
            .map(|p| {
                (
                    p.file_name().unwrap().to_string_lossy().into_owned(),
                    std::fs::read(&p).unwrap(),
                )
            })
            .collect()
    };
    let source = list("crds");
    let copy = list("charts/agentrun/files/crds");
    assert!(!source.is_empty());
    assert_eq!(
        source.keys().collect::<Vec<_>>(),
        copy.keys().collect::<Vec<_>>(),
        "charts/agentrun/files/crds/ must hold exactly the files of crds/: run config/generate"
    );
    for (name, bytes) in &source {
        assert!(
            copy[name] == *bytes,
            "charts/agentrun/files/crds/{name} differs from crds/{name}: run config/generate"
        );
    }
}

#[test]
fn the_chart_version_follows_the_crate() {
    let chart: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(root().join("charts/agentrun/Chart.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(chart["version"].as_str(), Some(crate_version()));
    assert_eq!(chart["appVersion"].as_str(), Some(crate_version()));
}

/// The least a render without the cluster (`helm template`, as Argo CD
/// renders) needs: the store and the step-token key, both existing Secrets,
/// and a serving certificate the chart does not generate (the controller's).
fn default_values() -> Value {
    json!({"store": {"existingSecret": "agentrun-store"},
           "controller": {"stepTokenKey": {"existingSecret": "agentrun-step-token-key"}},
           "servingCert": {"mode": "controller"}})
}

/// `values` with the step-token key's existing Secret and the controller's
/// serving certificate, unless they name their own.
fn with_key(mut values: Value) -> Value {
    let o = values.as_object_mut().unwrap();
    o.entry("servingCert")
        .or_insert_with(|| json!({"mode": "controller"}));
    let c = o.entry("controller").or_insert_with(|| json!({}));
    if c.get("stepTokenKey").is_none() {
        c["stepTokenKey"] = json!({"existingSecret": "token-key"});
    }
    values
}

/// Values that switch on everything optional.
fn full_values() -> Value {
    json!({
        "watchNamespace": "runs",
        "image": {"repository": "example/agentrun", "tag": "1.2.3"},
        "controller": {"replicas": 3, "logFormat": "text", "extraArgs": ["--lease-name=x"], "servingPort": 8443,
                        "stepTokenKey": {"existingSecret": "ops-token-key"},
                        "podAnnotations": {"team": "ml"},
                        "userUrls": {"allow": ["10.20.0.0/16", "mcp.tools.svc:8080"],
                                     "deny": ["10.20.9.0/24"], "public": false}},
        "stepRunner": {"serviceAccount": {"name": "steps", "namespaces": ["runs", "more-runs"]}},
        "store": {"migrate": false},
        "postgresql": {"enabled": true, "password": "s3cret/+x", "persistence": {"size": "1Gi"}},
        "modelSecrets": [
            {"name": "openai", "stringData": {"apiKey": "sk-1"}},
            {"name": "anthropic", "namespace": "more-runs", "stringData": {"apiKey": "sk-2"}}
        ],
        "metrics": {"port": 9090, "serviceMonitor": {"enabled": true, "labels": {"release": "prom"}}},
        "networkPolicy": {"enabled": true,
                          "metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
                          "controllerEgress": [{"ports": [{"port": 443}, {"port": 6443}, {"port": 5432}, {"port": 53, "protocol": "UDP"}]}]},
        "approverRole": {"name": "runs-approver"},
        "tracing": {"otlpEndpoint": "http://otel-collector.observability:4318", "captureContent": true},
        "commonLabels": {"cost-center": "42"},
        "crds": {"stampRequester": "webhook"},
        "servingCert": {"mode": "certManager",
                        "certManager": {"issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}, "duration": "720h"}},
        "logApi": {"readerRole": {"name": "runs-log-reader"}},
        "console": {"url": "https://agentrun.example.com"}
    })
}

#[test]
fn helm_lint_passes_with_default_and_non_default_values() {
    for (what, values) in [("default", default_values()), ("full", full_values())] {
        let (ok, stdout, stderr) = helm_lint(&values);
        assert!(ok, "helm lint ({what} values):\n{stdout}\n{stderr}");
        assert!(stdout.contains("0 chart(s) failed"), "{stdout}");
    }
}

#[test]
fn default_rendering_is_a_least_privilege_two_replica_controller() {
    let objs = render("agentrun", "agentrun-system", &default_values()).expect("renders");

    // The controller Deployment.
    let deploy = find(&objs, "Deployment", "agentrun-controller");
    let spec = &deploy["spec"];
    assert_eq!(spec["replicas"], 2);
    let pod = &spec["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "agentrun-controller");
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(pod["securityContext"]["runAsUser"], 65532);
    let c = &pod["containers"][0];
    let image = format!("agentrun:{}", crate_version());
    assert_eq!(c["image"], image.as_str());
    assert_eq!(c["args"][0], "controller");
    assert!(
        !has_env(c, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        "traces are off by default"
    );
    assert!(
        !has_env(c, "AGENTRUN_CONSOLE_URL"),
        "approval notifications link nowhere by default"
    );
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(c["securityContext"]["capabilities"]["drop"], json!(["ALL"]));
    assert!(c["resources"]["requests"]["cpu"].is_string());
    assert!(c["resources"]["limits"]["memory"].is_string());
    assert_eq!(
        env_of(c, "POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.name"
    );
    assert_eq!(
        env_of(c, "POD_NAMESPACE")["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.namespace"
    );
    assert_eq!(
        env_of(c, "AGENTRUN_STORE_URL")["valueFrom"]["secretKeyRef"],
        json!({"name": "agentrun-store", "key": "url"})
    );
    assert!(!has_env(c, "AGENTRUN_STEP_STORE_URL"));
    assert!(!has_env(c, "AGENTRUN_WATCH_NAMESPACE"));
    // Step Jobs run the controller's own image.
    assert_eq!(env_of(c, "AGENTRUN_STEP_IMAGE")["value"], image.as_str());
    assert_eq!(env_of(c, "AGENTRUN_METRICS_ADDR")["value"], "0.0.0.0:8080");
    assert_eq!(env_of(c, "AGENTRUN_LOG_FORMAT")["value"], "json");
    assert!(
        c["args"]
            .as_array()
            .unwrap()
            .contains(&json!("--step-service-account=agentrun-step"))
    );
    // User-chosen URLs: public addresses only, by default.
    assert!(
        c["args"]
            .as_array()
            .unwrap()
            .contains(&json!("--user-url-public=true"))
    );
    assert_eq!(
        c["ports"][0],
        json!({"name": "metrics", "containerPort": 8080, "protocol": "TCP"})
    );
    assert_eq!(
        c["livenessProbe"]["httpGet"],
        json!({"path": "/healthz", "port": "metrics"})
    );
    assert_eq!(
        c["readinessProbe"]["httpGet"],
        json!({"path": "/readyz", "port": "metrics"})
    );
    let migrate = &pod["initContainers"][0];
    assert_eq!(migrate["args"], json!(["store", "migrate"]));
    assert_eq!(migrate["securityContext"]["readOnlyRootFilesystem"], true);
    find(&objs, "PodDisruptionBudget", "agentrun-controller");

    // ServiceAccounts: the controller's, and the step pods' without a token.
    find(&objs, "ServiceAccount", "agentrun-controller");
    let step_sa = find(&objs, "ServiceAccount", "agentrun-step");
    assert_eq!(step_sa["automountServiceAccountToken"], false);
    assert_eq!(step_sa["metadata"]["namespace"], "agentrun-system");
    assert!(
        all(&objs, "RoleBinding")
            .iter()
            .chain(all(&objs, "ClusterRoleBinding").iter())
            .all(|b| b["subjects"]
                .as_array()
                .unwrap()
                .iter()
                .all(|s| s["name"] != "agentrun-step")),
        "no role may be bound to the step pods' ServiceAccount"
    );

    // RBAC: the controller's ClusterRole, its binding, the leader-election Role.
    let role = find(&objs, "ClusterRole", "agentrun-agentrun-system-controller");
    let rules = role["rules"].as_array().unwrap();
    assert!(
        rules.iter().all(|r| !r.to_string().contains('*')),
        "no wildcards in the controller's ClusterRole: {role}"
    );
    let secrets = rules
        .iter()
        .find(|r| r["resources"] == json!(["secrets"]))
        .expect("a secrets rule");
    // Per-run credential Secrets (named by run uid) are created, never read or changed.
    assert_eq!(
        secrets["verbs"],
        json!(["create"]),
        "the controller only creates Secrets"
    );
    let binding = find(
        &objs,
        "ClusterRoleBinding",
        "agentrun-agentrun-system-controller",
    );
    assert_eq!(
        binding["subjects"],
        json!([{"kind": "ServiceAccount", "name": "agentrun-controller", "namespace": "agentrun-system"}])
    );
    let lease = find(&objs, "Role", "agentrun-leader-election");
    assert_eq!(lease["metadata"]["namespace"], "agentrun-system");
    assert_eq!(lease["rules"][0]["resources"], json!(["leases"]));

    // The approver role, exactly once (crds/ may ship it with the admission policy).
    let approver = all(&objs, "ClusterRole")
        .into_iter()
        .filter(|r| r["metadata"]["name"] == "agentrun-approver")
        .collect::<Vec<_>>();
    assert_eq!(approver.len(), 1, "one agentrun-approver ClusterRole");
    let approver_rules = approver[0]["rules"].to_string();
    assert!(approver_rules.contains("approvals") && approver_rules.contains("update"));

    // CRDs and admission policies: those of crds/, unchanged but for labels
    // and Helm's keep annotation.
    let source = source_crds();
    let mut rendered = BTreeMap::new();
    for o in &objs {
        let key = (
            o["kind"].as_str().unwrap().to_string(),
            o["metadata"]["name"].as_str().unwrap().to_string(),
        );
        if source.contains_key(&key) {
            rendered.insert(key, o.clone());
        }
    }
    assert_eq!(
        rendered.keys().collect::<Vec<_>>(),
        source.keys().collect::<Vec<_>>(),
        "every object of crds/ is rendered"
    );
    for (key, mut obj) in rendered {
        let meta = obj["metadata"].as_object_mut().unwrap();
        assert_eq!(
            meta["labels"]["app.kubernetes.io/instance"], "agentrun",
            "{key:?}"
        );
        assert_eq!(
            meta["annotations"]["helm.sh/resource-policy"], "keep",
            "{key:?}"
        );
        let mut want = source[&key].clone();
        for m in [meta, want["metadata"].as_object_mut().unwrap()] {
            m.remove("labels");
            m.remove("annotations");
        }
        // YAML `0.0` and `0` are one JSON number to the API server.
        assert!(
            numbers_as_f64(obj) == numbers_as_f64(want),
            "{key:?} is rendered differently from crds/"
        );
    }

    // Metrics Service; nothing optional by default.
    let svc = find(&objs, "Service", "agentrun-metrics");
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], "metrics");
    assert_eq!(
        svc["spec"]["selector"],
        deploy["spec"]["selector"]["matchLabels"]
    );
    for kind in ["ServiceMonitor", "StatefulSet"] {
        assert!(all(&objs, kind).is_empty(), "no {kind} by default");
    }

    // The step-log gateway: on every replica, behind the controller Service;
    // its token key in a Secret of the controller's namespace (and nowhere else).
    let gw = find(&objs, "Service", "agentrun-controller");
    assert_eq!(
        gw["spec"]["ports"][0],
        json!({"name": "step-api", "port": 8081, "targetPort": "step-api", "protocol": "TCP"})
    );
    assert_eq!(
        gw["spec"]["selector"],
        deploy["spec"]["selector"]["matchLabels"]
    );
    assert_eq!(
        c["ports"][1],
        json!({"name": "step-api", "containerPort": 8081, "protocol": "TCP"})
    );
    assert_eq!(
        env_of(c, "AGENTRUN_STEP_API_URL")["value"],
        "http://agentrun-controller.agentrun-system.svc:8081"
    );
    assert_eq!(env_of(c, "AGENTRUN_STEP_API_ADDR")["value"], "0.0.0.0:8081");
    // The key (and the ones a rotation retired) from the existing Secret:
    // a render without the cluster invents none.
    assert_eq!(
        env_of(c, "AGENTRUN_STEP_TOKEN_KEY")["valueFrom"]["secretKeyRef"],
        json!({"name": "agentrun-step-token-key", "key": "key"})
    );
    assert_eq!(
        env_of(c, "AGENTRUN_STEP_TOKEN_RETIRED_KEYS")["valueFrom"]["secretKeyRef"],
        json!({"name": "agentrun-step-token-key", "key": "retired", "optional": true})
    );
    assert!(
        all(&objs, "Secret").is_empty(),
        "no Secret by default (servingCert.mode=controller: the controller makes its own)"
    );

    // Step pods' egress: DNS, the gateway, anything but link-local addresses.
    let policies = all(&objs, "NetworkPolicy");
    assert_eq!(policies.len(), 1, "only the step egress policy by default");
    let np = &policies[0];
    assert_eq!(np["metadata"]["name"], "agentrun-step-egress");
    assert_eq!(np["metadata"]["namespace"], "agentrun-system");
    assert_eq!(np["spec"]["policyTypes"], json!(["Egress"]));
    assert_eq!(
        np["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/managed-by"],
        "agentrun"
    );
    let egress = np["spec"]["egress"].as_array().unwrap();
    assert_eq!(
        egress[0]["ports"][0],
        json!({"port": 53, "protocol": "UDP"})
    );
    assert_eq!(
        egress[1]["ports"][0],
        json!({"port": 8081, "protocol": "TCP"})
    );
    assert_eq!(
        egress[1]["to"][0]["podSelector"]["matchLabels"],
        deploy["spec"]["selector"]["matchLabels"]
    );
    let v4 = &egress[2]["to"][0]["ipBlock"];
    assert_eq!(v4["cidr"], "0.0.0.0/0");
    assert_eq!(
        v4["except"],
        json!(["169.254.0.0/16"]),
        "the node's metadata address is blocked"
    );
    assert!(
        egress
            .iter()
            .all(|rule| !rule.to_string().contains("169.254.169.254")
                || rule.to_string().contains("except")),
        "no rule allows the metadata address"
    );
    the_https_port_serves_the_log_api_and_the_requester_stamp(&objs, c);

    // Every namespaced object names its namespace (kustomize and GitOps need it).
    for o in &objs {
        let cluster_scoped = matches!(
            o["kind"].as_str().unwrap(),
            "CustomResourceDefinition"
                | "ClusterRole"
                | "ClusterRoleBinding"
                | "ValidatingAdmissionPolicy"
                | "ValidatingAdmissionPolicyBinding"
                | "APIService"
                | "MutatingWebhookConfiguration"
        );
        assert_eq!(
            o["metadata"]["namespace"].is_string(),
            !cluster_scoped,
            "{}/{}",
            o["kind"],
            o["metadata"]["name"]
        );
    }
}

/// The rules of a (Cluster)Role as (group, resource, verb, resourceNames) rows.
fn rule_rows(role: &Value) -> BTreeSet<(String, String, String, Vec<String>)> {
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| a.iter().map(|s| s.as_str().unwrap().to_string()).collect())
            .unwrap_or_default()
    };
    let mut rows = BTreeSet::new();
    for rule in role["rules"].as_array().unwrap() {
        let names = strings(&rule["resourceNames"]);
        for g in strings(&rule["apiGroups"]) {
            for r in strings(&rule["resources"]) {
                for v in strings(&rule["verbs"]) {
                    rows.insert((g.clone(), r.clone(), v, names.clone()));
                }
            }
        }
    }
    rows
}

fn row(g: &str, r: &str, v: &str, names: &[&str]) -> (String, String, String, Vec<String>) {
    (
        g.into(),
        r.into(),
        v.into(),
        names.iter().map(|n| n.to_string()).collect(),
    )
}

fn args_of(container: &Value) -> Vec<String> {
    container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

/// Default values (release agentrun in agentrun-system, rendered without
/// the cluster, so without MutatingAdmissionPolicy): every replica serves
/// HTTPS on 9443 behind the controller Service's port 443, with a
/// certificate it makes itself (servingCert.mode=controller); the APIService
/// and the requester-stamp webhook point there; RBAC grants exactly what
/// the log API and the certificate need.
fn the_https_port_serves_the_log_api_and_the_requester_stamp(objs: &[Value], c: &Value) {
    let svc = find(objs, "Service", "agentrun-controller");
    assert!(
        svc["spec"]["ports"].as_array().unwrap().contains(
            &json!({"name": "https", "port": 443, "targetPort": "https", "protocol": "TCP"})
        ),
        "{svc}"
    );
    assert!(
        c["ports"]
            .as_array()
            .unwrap()
            .contains(&json!({"name": "https", "containerPort": 9443, "protocol": "TCP"}))
    );
    assert_eq!(env_of(c, "AGENTRUN_SERVING_ADDR")["value"], "0.0.0.0:9443");
    let args = args_of(c);
    for flag in [
        "--serving-cert-secret=agentrun-serving-cert",
        "--serving-dns-name=agentrun-controller.agentrun-system.svc",
        "--serving-dns-name=agentrun-controller.agentrun-system.svc.cluster.local",
        "--inject-ca-apiservice=v1alpha1.log.agentrun.dev",
        "--inject-ca-webhook=agentrun-requester-stamp",
    ] {
        assert!(args.contains(&flag.to_string()), "{flag} in {args:?}");
    }
    assert!(!args.iter().any(|a| a.starts_with("--serving-cert-file")));
    assert!(c["volumeMounts"].is_null(), "nothing to mount: {c}");

    // The log API.
    let api = find(objs, "APIService", "v1alpha1.log.agentrun.dev");
    assert_eq!(
        api["spec"],
        json!({"group": "log.agentrun.dev", "version": "v1alpha1",
               "groupPriorityMinimum": 1000, "versionPriority": 15,
               "service": {"namespace": "agentrun-system", "name": "agentrun-controller", "port": 443}}),
        "the controller writes the caBundle itself"
    );

    // The requester stamp: the webhook (no MutatingAdmissionPolicy here).
    assert!(all(objs, "MutatingAdmissionPolicy").is_empty());
    let hook = find(
        objs,
        "MutatingWebhookConfiguration",
        "agentrun-requester-stamp",
    );
    let webhooks = hook["webhooks"].as_array().unwrap();
    assert_eq!(webhooks.len(), 1);
    let w = &webhooks[0];
    assert_eq!(w["name"], "requester.agentrun.dev");
    assert_eq!(w["failurePolicy"], "Fail");
    assert_eq!(w["sideEffects"], "None");
    assert_eq!(w["admissionReviewVersions"], json!(["v1"]));
    assert_eq!(w["timeoutSeconds"], 5);
    assert_eq!(w["matchPolicy"], "Equivalent");
    assert_eq!(
        w["rules"],
        json!([{"apiGroups": ["agentrun.dev"], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE"],
                "resources": ["agentruns"], "scope": "Namespaced"}])
    );
    // Updates reach it only when they would drop the requester.
    let condition = w["matchConditions"][0]["expression"].as_str().unwrap();
    assert!(
        condition.starts_with("request.operation == 'CREATE' ||")
            && condition.contains("oldObject"),
        "{condition}"
    );
    assert!(w["namespaceSelector"].is_null(), "every namespace");
    assert_eq!(
        w["clientConfig"],
        json!({"service": {"namespace": "agentrun-system", "name": "agentrun-controller",
                           "port": 443, "path": "/stamp-requester"}})
    );
    // Two replicas and a budget keep one serving it.
    find(objs, "PodDisruptionBudget", "agentrun-controller");

    // RBAC: the CA written into exactly those two objects...
    let rows = rule_rows(find(
        objs,
        "ClusterRole",
        "agentrun-agentrun-system-controller",
    ));
    for want in [
        row(
            "apiregistration.k8s.io",
            "apiservices",
            "get",
            &["v1alpha1.log.agentrun.dev"],
        ),
        row(
            "apiregistration.k8s.io",
            "apiservices",
            "patch",
            &["v1alpha1.log.agentrun.dev"],
        ),
        row(
            "admissionregistration.k8s.io",
            "mutatingwebhookconfigurations",
            "get",
            &["agentrun-requester-stamp"],
        ),
        row(
            "admissionregistration.k8s.io",
            "mutatingwebhookconfigurations",
            "patch",
            &["agentrun-requester-stamp"],
        ),
        // The log API reads the run whose log it serves.
        row("agentrun.dev", "agentruns", "get", &[]),
    ] {
        assert!(rows.contains(&want), "{want:?} in {rows:?}");
    }
    assert!(
        rows.iter()
            .filter(|(g, ..)| g == "apiregistration.k8s.io" || g == "admissionregistration.k8s.io")
            .all(|(.., names)| !names.is_empty()),
        "registration objects only by name: {rows:?}"
    );
    // ...the certificate's Secret read by name, created in its namespace...
    let cert_role = find(objs, "Role", "agentrun-serving-cert");
    assert_eq!(cert_role["metadata"]["namespace"], "agentrun-system");
    assert_eq!(
        rule_rows(cert_role),
        BTreeSet::from([
            row("", "secrets", "get", &["agentrun-serving-cert"]),
            row("", "secrets", "create", &[]),
        ])
    );
    let sa = json!([{"kind": "ServiceAccount", "name": "agentrun-controller", "namespace": "agentrun-system"}]);
    assert_eq!(
        find(objs, "RoleBinding", "agentrun-serving-cert")["subjects"],
        sa
    );
    // ...SubjectAccessReviews, and the front-proxy CA in kube-system.
    let delegator = find(
        objs,
        "ClusterRoleBinding",
        "agentrun-agentrun-system-controller-auth-delegator",
    );
    assert_eq!(delegator["roleRef"]["name"], "system:auth-delegator");
    assert_eq!(delegator["subjects"], sa);
    let reader = find(
        objs,
        "RoleBinding",
        "agentrun-agentrun-system-controller-auth-reader",
    );
    assert_eq!(reader["metadata"]["namespace"], "kube-system");
    assert_eq!(
        reader["roleRef"],
        json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "extension-apiserver-authentication-reader"})
    );
    assert_eq!(reader["subjects"], sa);

    // Who reads logs: the log reader (not aggregated to `view`) and approvers.
    let log_reader = find(objs, "ClusterRole", "agentrun-log-reader");
    assert!(
        log_reader["metadata"]["labels"]
            .as_object()
            .unwrap()
            .keys()
            .all(|k| !k.starts_with("rbac.authorization.k8s.io/aggregate-to")),
        "{log_reader}"
    );
    let rows = rule_rows(log_reader);
    for verb in ["get", "list", "watch"] {
        assert!(rows.contains(&row("log.agentrun.dev", "runlogs", verb, &[])));
    }
    assert!(
        rows.iter()
            .all(|(_, _, v, _)| ["get", "list", "watch"].contains(&v.as_str()))
    );
    let approver = all(objs, "ClusterRole")
        .into_iter()
        .find(|r| r["metadata"]["name"] == "agentrun-approver")
        .unwrap();
    let rows = rule_rows(approver);
    for verb in ["get", "list", "watch"] {
        assert!(
            rows.contains(&row("log.agentrun.dev", "runlogs", verb, &[])),
            "approvers read logs"
        );
    }
}

#[test]
fn non_default_rendering_switches_on_every_option() {
    let objs = render("ops", "platform", &full_values()).expect("renders");
    let deploy = find(&objs, "Deployment", "ops-agentrun-controller");
    assert_eq!(deploy["spec"]["replicas"], 3);
    let pod = &deploy["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert_eq!(c["image"], "example/agentrun:1.2.3");
    assert_eq!(
        env_of(c, "AGENTRUN_STEP_IMAGE")["value"],
        "example/agentrun:1.2.3"
    );
    assert_eq!(env_of(c, "AGENTRUN_WATCH_NAMESPACE")["value"], "runs");
    assert_eq!(env_of(c, "AGENTRUN_METRICS_ADDR")["value"], "0.0.0.0:9090");
    assert_eq!(
        env_of(c, "OTEL_EXPORTER_OTLP_ENDPOINT")["value"],
        "http://otel-collector.observability:4318"
    );
    assert_eq!(
        env_of(c, "OTEL_EXPORTER_OTLP_PROTOCOL")["value"],
        "http/protobuf"
    );
    assert_eq!(
        env_of(c, "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT")["value"],
        "true"
    );
    assert_eq!(env_of(c, "AGENTRUN_LOG_FORMAT")["value"], "text");
    assert_eq!(
        env_of(c, "AGENTRUN_CONSOLE_URL")["value"],
        "https://agentrun.example.com"
    );
    let args = c["args"].as_array().unwrap();
    assert!(args.contains(&json!("--lease-name=x")));
    assert!(args.contains(&json!("--step-service-account=steps")));
    for flag in [
        "--user-url-allow=10.20.0.0/16",
        "--user-url-allow=mcp.tools.svc:8080",
        "--user-url-deny=10.20.9.0/24",
        "--user-url-public=false",
    ] {
        assert!(args.contains(&json!(flag)), "{flag} in {args:?}");
    }
    assert!(pod["initContainers"].is_null(), "store.migrate=false");
    assert_eq!(
        deploy["spec"]["template"]["metadata"]["annotations"]["team"],
        "ml"
    );
    assert_eq!(deploy["metadata"]["labels"]["cost-center"], "42");

    // The in-chart PostgreSQL and the URL the controller gets for it.
    let sts = find(&objs, "StatefulSet", "ops-agentrun-postgresql");
    let pg = &sts["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(pg["image"], "postgres:17");
    assert_eq!(pg["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(
        sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"],
        "1Gi"
    );
    let pg_secret = find(&objs, "Secret", "ops-agentrun-postgresql");
    assert_eq!(pg_secret["stringData"]["password"], "s3cret/+x");
    let store = find(&objs, "Secret", "ops-agentrun-store");
    assert_eq!(
        store["stringData"]["url"],
        "postgres://agentrun:s3cret%2F%2Bx@ops-agentrun-postgresql.platform.svc:5432/agentrun"
    );
    assert_eq!(
        env_of(c, "AGENTRUN_STORE_URL")["valueFrom"]["secretKeyRef"],
        json!({"name": "ops-agentrun-store", "key": "url"})
    );
    find(&objs, "Service", "ops-agentrun-postgresql");

    // Step ServiceAccounts where runs execute; model keys where asked.
    for ns in ["runs", "more-runs"] {
        let sa = objs
            .iter()
            .find(|o| {
                o["kind"] == "ServiceAccount"
                    && o["metadata"]["name"] == "steps"
                    && o["metadata"]["namespace"] == ns
            })
            .unwrap_or_else(|| panic!("step ServiceAccount in {ns}"));
        assert_eq!(sa["automountServiceAccountToken"], false);
    }
    assert_eq!(
        find(&objs, "Secret", "openai")["metadata"]["namespace"],
        "runs"
    );
    assert_eq!(
        find(&objs, "Secret", "anthropic")["metadata"]["namespace"],
        "more-runs"
    );
    assert_eq!(
        find(&objs, "Secret", "anthropic")["stringData"]["apiKey"],
        "sk-2"
    );

    // Leader election happens in the watched namespace.
    assert_eq!(
        find(&objs, "Role", "ops-agentrun-leader-election")["metadata"]["namespace"],
        "runs"
    );

    // ServiceMonitor scrapes the metrics Service's port.
    let svc = find(&objs, "Service", "ops-agentrun-metrics");
    assert_eq!(svc["spec"]["ports"][0]["port"], 9090);
    let sm = find(&objs, "ServiceMonitor", "ops-agentrun");
    assert_eq!(sm["metadata"]["labels"]["release"], "prom");
    assert_eq!(
        sm["spec"]["endpoints"][0]["port"],
        svc["spec"]["ports"][0]["name"]
    );
    for (k, v) in sm["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(
            &svc["metadata"]["labels"][k], v,
            "ServiceMonitor selects the Service"
        );
    }

    // NetworkPolicies: metrics ingress from the given peers, gateway ingress
    // from step pods, egress as given, PostgreSQL only from the controller.
    let np = find(&objs, "NetworkPolicy", "ops-agentrun-controller");
    assert_eq!(np["spec"]["policyTypes"], json!(["Ingress", "Egress"]));
    assert_eq!(
        np["spec"]["ingress"][0]["from"][0]["namespaceSelector"]["matchLabels"]["name"],
        "monitoring"
    );
    assert_eq!(
        np["spec"]["egress"][0]["ports"].as_array().unwrap().len(),
        4
    );
    assert_eq!(
        np["spec"]["ingress"][1]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/managed-by"],
        "agentrun"
    );
    assert_eq!(np["spec"]["ingress"][1]["ports"][0]["port"], "step-api");
    let pg_np = find(&objs, "NetworkPolicy", "ops-agentrun-postgresql");
    assert_eq!(
        pg_np["spec"]["ingress"][0]["from"]
            .as_array()
            .unwrap()
            .len(),
        1,
        "PostgreSQL is reachable from the controller only: {pg_np}"
    );
    // A step egress policy in each namespace where runs execute.
    for ns in ["runs", "more-runs"] {
        assert!(
            all(&objs, "NetworkPolicy")
                .iter()
                .any(|p| p["metadata"]["name"] == "ops-agentrun-step-egress"
                    && p["metadata"]["namespace"] == ns),
            "step egress policy in {ns}"
        );
    }

    find(&objs, "ClusterRole", "ops-agentrun-platform-controller");
    // The approver role under its own name (crds/ may ship agentrun-approver too).
    find(&objs, "ClusterRole", "runs-approver");
    find(&objs, "ClusterRole", "runs-log-reader");

    // The API server reaches the HTTPS port from outside any pod.
    assert_eq!(
        np["spec"]["ingress"][2],
        json!({"ports": [{"port": "https", "protocol": "TCP"}]})
    );
    assert_eq!(env_of(c, "AGENTRUN_SERVING_ADDR")["value"], "0.0.0.0:8443");

    // cert-manager issues the certificate from the given issuer (no chain of
    // the chart's own); its cainjector fills in both caBundles.
    assert!(all(&objs, "Issuer").is_empty());
    let cert = find(&objs, "Certificate", "ops-agentrun-serving-cert");
    assert_eq!(
        cert["spec"]["issuerRef"],
        json!({"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"})
    );
    assert_eq!(cert["spec"]["duration"], "720h");
    assert_eq!(cert["spec"]["secretName"], "ops-agentrun-serving-cert");
    assert_eq!(
        cert["spec"]["dnsNames"],
        json!([
            "ops-agentrun-controller.platform.svc",
            "ops-agentrun-controller.platform.svc.cluster.local"
        ])
    );
    for (kind, name) in [
        ("APIService", "v1alpha1.log.agentrun.dev"),
        (
            "MutatingWebhookConfiguration",
            "ops-agentrun-requester-stamp",
        ),
    ] {
        let o = find(&objs, kind, name);
        assert_eq!(
            o["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
            "platform/ops-agentrun-serving-cert",
            "{kind}"
        );
        assert!(!o.to_string().contains("caBundle"), "{o}");
    }
    // The Secret mounted, its files given to the controller.
    let args = args_of(c);
    for flag in [
        "--serving-cert-file=/etc/agentrun/serving-cert/tls.crt",
        "--serving-key-file=/etc/agentrun/serving-cert/tls.key",
    ] {
        assert!(args.contains(&flag.to_string()), "{flag} in {args:?}");
    }
    assert!(
        !args
            .iter()
            .any(|a| a.starts_with("--serving-cert-secret") || a.starts_with("--inject-ca"))
    );
    assert_eq!(
        pod["volumes"][0]["secret"]["secretName"],
        "ops-agentrun-serving-cert"
    );
    assert_eq!(
        c["volumeMounts"][0]["mountPath"],
        "/etc/agentrun/serving-cert"
    );
    assert_eq!(c["volumeMounts"][0]["readOnly"], true);
    // No RBAC for a certificate the controller does not make.
    assert!(
        all(&objs, "Role")
            .iter()
            .all(|r| r["metadata"]["name"] != "ops-agentrun-serving-cert")
    );
    let rows = rule_rows(find(
        &objs,
        "ClusterRole",
        "ops-agentrun-platform-controller",
    ));
    assert!(
        rows.iter()
            .all(|(g, ..)| g != "apiregistration.k8s.io" && g != "admissionregistration.k8s.io"),
        "{rows:?}"
    );
    // The webhook serves the watched namespace only.
    let hook = find(
        &objs,
        "MutatingWebhookConfiguration",
        "ops-agentrun-requester-stamp",
    );
    assert_eq!(
        hook["webhooks"][0]["namespaceSelector"],
        json!({"matchLabels": {"kubernetes.io/metadata.name": "runs"}})
    );
}

/// `crds.stampRequester` picks the policy where the API server serves
/// MutatingAdmissionPolicy (`auto`), the webhook elsewhere, or what it
/// names; the controller is told to write the CA into the webhook only when
/// the webhook is there, and RBAC follows.
#[test]
fn the_requester_stamp_is_the_policy_where_served_else_the_webhook() {
    const SERVED: &[&str] = &[
        "--api-versions",
        "admissionregistration.k8s.io/v1beta1/MutatingAdmissionPolicy",
    ];
    let stamp = |value: Value, install: bool, extra: &[&str]| -> (bool, bool, bool) {
        let mut values = default_values();
        values["crds"] = json!({"stampRequester": value, "install": install});
        let objs = render_with("agentrun", "agentrun-system", &values, extra).expect("renders");
        let policy = !all(&objs, "MutatingAdmissionPolicy").is_empty();
        let webhook = !all(&objs, "MutatingWebhookConfiguration").is_empty();
        let c = &find(&objs, "Deployment", "agentrun-controller")["spec"]["template"]["spec"]["containers"]
            [0];
        let injects = args_of(c)
            .iter()
            .any(|a| a.starts_with("--inject-ca-webhook="));
        let grants = rule_rows(find(
            &objs,
            "ClusterRole",
            "agentrun-agentrun-system-controller",
        ))
        .iter()
        .any(|(_, r, ..)| r == "mutatingwebhookconfigurations");
        assert_eq!(
            injects, webhook,
            "--inject-ca-webhook with the webhook only"
        );
        assert_eq!(grants, webhook, "RBAC on the webhook with the webhook only");
        (
            policy,
            webhook,
            !all(&objs, "MutatingAdmissionPolicyBinding").is_empty(),
        )
    };
    // (policy, webhook, policy binding)
    assert_eq!(stamp(json!("auto"), true, SERVED), (true, false, true));
    assert_eq!(stamp(json!("auto"), true, &[]), (false, true, false));
    assert_eq!(stamp(json!("policy"), true, &[]), (true, false, true));
    assert_eq!(
        stamp(json!("true"), true, &[]),
        (true, false, true),
        "the old \"true\""
    );
    assert_eq!(
        stamp(json!(true), true, &[]),
        (true, false, true),
        "--set crds.stampRequester=true"
    );
    assert_eq!(stamp(json!("webhook"), true, SERVED), (false, true, false));
    assert_eq!(stamp(json!("false"), true, &[]), (false, false, false));
    assert_eq!(stamp(json!(false), true, SERVED), (false, false, false));
    // Without the CRDs the policy is the user's (crds/, config/requester-stamp);
    // the webhook is the controller's and comes with it.
    assert_eq!(stamp(json!("auto"), false, SERVED), (false, false, false));
    assert_eq!(stamp(json!("auto"), false, &[]), (false, true, false));

    // Without the APIService (a second release in a cluster) the controller
    // writes no CA there and may not.
    let mut values = default_values();
    values["logApi"] = json!({"apiService": false});
    let objs = render("agentrun", "agentrun-system", &values).unwrap();
    assert!(all(&objs, "APIService").is_empty());
    let c = &find(&objs, "Deployment", "agentrun-controller")["spec"]["template"]["spec"]["containers"]
        [0];
    assert!(
        !args_of(c)
            .iter()
            .any(|a| a.starts_with("--inject-ca-apiservice"))
    );
    assert!(
        rule_rows(find(
            &objs,
            "ClusterRole",
            "agentrun-agentrun-system-controller"
        ))
        .iter()
        .all(|(_, r, ..)| r != "apiservices")
    );
}

/// servingCert.mode=certManager without an issuer: a self-signed CA of the
/// release's own issues the serving certificate.
#[test]
fn cert_manager_mode_brings_its_own_ca_chain() {
    let mut values = default_values();
    values["servingCert"] = json!({"mode": "certManager"});
    let objs = render("agentrun", "agentrun-system", &values).unwrap();
    let selfsigned = find(&objs, "Issuer", "agentrun-selfsigned");
    assert_eq!(selfsigned["spec"], json!({"selfSigned": {}}));
    let ca = find(&objs, "Certificate", "agentrun-serving-ca");
    assert_eq!(ca["spec"]["isCA"], true);
    assert_eq!(ca["spec"]["issuerRef"]["name"], "agentrun-selfsigned");
    let ca_issuer = find(&objs, "Issuer", "agentrun-ca");
    assert_eq!(
        ca_issuer["spec"]["ca"]["secretName"],
        ca["spec"]["secretName"]
    );
    let cert = find(&objs, "Certificate", "agentrun-serving-cert");
    assert_eq!(cert["spec"]["issuerRef"]["name"], "agentrun-ca");
    assert_eq!(cert["spec"]["issuerRef"]["kind"], "Issuer");
    assert!(
        cert["spec"]["usages"]
            .as_array()
            .unwrap()
            .contains(&json!("server auth"))
    );
    assert!(
        all(&objs, "Secret").is_empty(),
        "cert-manager writes the Secret"
    );
}

#[test]
fn the_values_schema_and_the_chart_refuse_wrong_values() {
    let store = json!({"existingSecret": "s"});
    let cases: Vec<(Value, &str)> = vec![
        (
            json!({"store": store, "controller": {"replicas": "two"}}),
            "replicas",
        ),
        (
            json!({"store": store, "controler": {"replicas": 1}}),
            "controler",
        ),
        (json!({"store": store, "metrics": {"port": 70000}}), "port"),
        (
            json!({"store": store, "controller": {"logFormat": "xml"}}),
            "logFormat",
        ),
        (
            json!({"store": store, "image": {"pullPolicy": "Sometimes"}}),
            "pullPolicy",
        ),
        (json!({"store": {"url": "mysql://db/x"}}), "url"),
        (
            json!({"store": store, "console": {"url": "https://user:pw@console.example.com"}}),
            "url",
        ),
        (
            json!({"store": store, "console": {"url": "javascript:alert(1)"}}),
            "url",
        ),
        (
            json!({"store": store, "watchNamespace": "Not_A_Namespace"}),
            "watchNamespace",
        ),
        (
            json!({"store": store, "modelSecrets": [{"name": "k"}]}),
            "stringData",
        ),
        (
            json!({"store": store, "serviceAccount": {"name": "other"}}),
            "name",
        ),
        (
            json!({"store": store, "controller": {"resources": {"limits": {"memory": "lots"}}}}),
            "memory",
        ),
        (json!({}), "set exactly one step store"),
        (
            json!({"store": {"existingSecret": "s", "url": "postgres://a@b/c"}}),
            "set exactly one step store",
        ),
        (
            json!({"store": store, "postgresql": {"enabled": true}}),
            "set exactly one step store",
        ),
        (
            json!({"store": {"existingSecret": "s", "stepUrl": "postgres://a@b/c"}}),
            "stepUrl",
        ),
        (
            json!({"store": store, "metrics": {"service": {"enabled": false}, "serviceMonitor": {"enabled": true}}}),
            "serviceMonitor",
        ),
        (
            json!({"store": store, "servingCert": {"mode": "vault"}}),
            "mode",
        ),
        (
            json!({"store": store, "crds": {"stampRequester": "maybe"}}),
            "stampRequester",
        ),
        (
            json!({"store": store, "logApi": {"readerRole": {"aggregate": true}}}),
            "aggregate",
        ),
        (
            json!({"store": store, "servingCert": {"mode": "certManager", "certManager": {"issuerRef": {"kind": "Issuer"}}}}),
            "name",
        ),
    ];
    for (values, field) in cases {
        match render("x", "x", &with_key(values.clone())) {
            Ok(_) => panic!("{values} was accepted"),
            Err(e) => assert!(
                e.contains(field),
                "{values}: error does not name {field:?}: {e}"
            ),
        }
    }
    // ...and the right ones pass.
    render(
        "x",
        "x",
        &with_key(json!({"store": {"url": "postgres://a:b@db/agentrun"}})),
    )
    .expect("store.url");
    render(
        "x",
        "x",
        &with_key(json!({"postgresql": {"enabled": true, "password": "p"}})),
    )
    .expect("quick start");
}

/// Argo CD renders with `helm template` at every sync: a key or password
/// the chart generated there would change every time (breaking running
/// steps, recorded signatures, the database's login). So a render that
/// cannot see the cluster refuses to invent one, naming the value to set,
/// and what it does render is the same every time.
#[test]
fn a_render_without_the_cluster_invents_no_key_or_password_and_repeats_itself() {
    let store = json!({"existingSecret": "s"});
    for (values, field) in [
        (
            json!({"store": store, "servingCert": {"mode": "controller"}}),
            "controller.stepTokenKey.existingSecret",
        ),
        (
            with_key(json!({"postgresql": {"enabled": true}})),
            "postgresql.password",
        ),
        // The serving certificate Helm would generate (the default mode).
        (
            json!({"store": store, "controller": {"stepTokenKey": {"existingSecret": "k"}}}),
            "servingCert.mode",
        ),
    ] {
        let e = render("x", "x", &values).expect_err(&values.to_string());
        assert!(
            e.contains(field),
            "{values}: error does not name {field}: {e}"
        );
        assert!(e.contains("cannot see the cluster"), "{e}");
    }
    for values in [default_values(), full_values()] {
        assert_eq!(
            render("x", "x", &values).unwrap(),
            render("x", "x", &values).unwrap(),
            "rendered twice, {values}"
        );
    }
}

#[test]
fn the_kustomize_bases_are_generated_from_the_chart() {
    let out = tempfile::tempdir().unwrap();
    let status = Command::new("bash")
        .arg(root().join("config/generate"))
        .args(["--out", out.path().to_str().unwrap()])
        .env("HELM", helm())
        .status()
        .expect("running config/generate");
    assert!(status.success(), "config/generate --out failed");
    let mut generated = BTreeSet::new();
    for base in ["crd", "rbac", "manager", "default"] {
        for entry in std::fs::read_dir(out.path().join(base)).unwrap() {
            let path = entry.unwrap().path();
            let rel = format!("{base}/{}", path.file_name().unwrap().to_string_lossy());
            let checked_in = std::fs::read_to_string(root().join("config").join(&rel))
                .unwrap_or_else(|_| panic!("config/{rel} is missing: run config/generate"));
            assert!(
                checked_in == std::fs::read_to_string(&path).unwrap(),
                "config/{rel} is stale: run config/generate"
            );
            generated.insert(rel);
        }
    }
    // Nothing left over from an earlier generation (config/samples is the
    // hand-written samples base; tests/e2e_api.rs checks it lists every sample).
    for base in ["crd", "rbac", "manager", "default"] {
        for entry in std::fs::read_dir(root().join("config").join(base)).unwrap() {
            let rel = format!("{base}/{}", entry.unwrap().file_name().to_string_lossy());
            assert!(
                generated.contains(&rel),
                "config/{rel} is not generated: remove it or run config/generate"
            );
        }
    }
}

#[test]
fn the_argocd_health_check_maps_phases_to_health() {
    let runner = helm_tool("lua-path");
    let script = root().join("charts/agentrun/files/argocd-health.lua");
    let health = |obj: Value| -> (String, String) {
        let mut child = Command::new(&runner)
            .arg(&script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("running argocd-lua-health");
        use std::io::Write as _;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(obj.to_string().as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{obj}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        (
            v["status"].as_str().unwrap().to_string(),
            v["message"].as_str().unwrap_or("").to_string(),
        )
    };
    let run = |status: Value| {
        json!({"apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "r", "generation": 1}, "spec": {"input": "x"}, "status": status})
    };

    assert_eq!(health(json!({"metadata": {"name": "r"}})).0, "Progressing");
    assert_eq!(health(run(json!({"phase": "Pending"}))).0, "Progressing");
    let (s, m) = health(run(
        json!({"phase": "Running", "waitingOn": "job/r-s1-a1", "observedGeneration": 1}),
    ));
    assert_eq!(s, "Progressing");
    assert!(m.contains("job/r-s1-a1"), "{m}");
    let (s, m) = health(run(
        json!({"phase": "AwaitingApproval", "approval": {"name": "r-a3", "expiresAt": "2030-01-01T00:00:00Z"}}),
    ));
    assert_eq!(s, "Suspended");
    assert!(m.contains("r-a3") && m.contains("2030-01-01"), "{m}");
    let (s, m) = health(run(
        json!({"phase": "Succeeded", "result": "Refunded 40.00"}),
    ));
    assert_eq!((s.as_str(), m.as_str()), ("Healthy", "Refunded 40.00"));
    for phase in ["Failed", "BudgetExceeded", "DeadlineExceeded", "Cancelled"] {
        let (s, m) = health(run(json!({"phase": phase, "error": "why"})));
        assert_eq!(s, "Degraded", "{phase}");
        assert!(m.starts_with(phase) && m.contains("why"), "{m}");
    }
    // A live run whose spec changed (spec.cancel) shows Progressing until observed.
    let mut cancelled = run(json!({"phase": "Running", "observedGeneration": 1}));
    cancelled["metadata"]["generation"] = json!(2);
    assert!(health(cancelled).1.contains("generation 2"));
    // Every phase the API defines has a mapping Argo CD accepts.
    for phase in [
        "Pending",
        "Running",
        "AwaitingApproval",
        "Succeeded",
        "Failed",
        "Cancelled",
        "BudgetExceeded",
        "DeadlineExceeded",
    ] {
        let parsed: agentrun::api::Phase =
            serde_json::from_value(json!(phase)).expect("a phase of the API");
        let _ = parsed;
        let (s, _) = health(run(json!({"phase": phase})));
        assert!(
            ["Healthy", "Progressing", "Suspended", "Degraded"].contains(&s.as_str()),
            "{phase}: {s}"
        );
    }
}

// --- Dockerfile ---------------------------------------------------------------

/// One instruction: keyword and arguments, continuation lines joined.
fn dockerfile() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(root().join("Dockerfile")).expect("Dockerfile");
    let mut out = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let t = line.trim();
        if current.is_empty() && (t.is_empty() || t.starts_with('#')) {
            continue;
        }
        if let Some(stripped) = t.strip_suffix('\\') {
            current.push_str(stripped);
            current.push(' ');
            continue;
        }
        current.push_str(t);
        let (kw, rest) = current
            .split_once(char::is_whitespace)
            .unwrap_or((&current, ""));
        out.push((kw.to_uppercase(), rest.trim().to_string()));
        current.clear();
    }
    out
}

struct Stage {
    image: String,
    name: Option<String>,
    instructions: Vec<(String, String)>,
}

fn stages() -> Vec<Stage> {
    let mut stages: Vec<Stage> = Vec::new();
    for (kw, args) in dockerfile() {
        if kw == "FROM" {
            let parts: Vec<&str> = args
                .split_whitespace()
                .filter(|p| !p.starts_with("--"))
                .collect();
            let name = match parts.as_slice() {
                [_, as_, name] if as_.eq_ignore_ascii_case("as") => Some(name.to_string()),
                [_] => None,
                _ => panic!("unexpected FROM {args}"),
            };
            stages.push(Stage {
                image: parts[0].to_string(),
                name,
                instructions: Vec::new(),
            });
        } else {
            stages
                .last_mut()
                .unwrap_or_else(|| panic!("{kw} before FROM"))
                .instructions
                .push((kw, args));
        }
    }
    stages
}

/// The bin targets the workspace's members declare, with their source files.
fn cargo_bins(workspace: &Path) -> Result<BTreeMap<String, String>, String> {
    let meta: Value = serde_json::from_slice(&cargo_ok(
        workspace,
        &[
            "metadata",
            "--locked",
            "--offline",
            "--no-deps",
            "--format-version",
            "1",
        ],
    )?)
    .unwrap();
    Ok(meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap())
        .filter(|t| t["kind"][0] == "bin")
        .map(|t| {
            (
                t["name"].as_str().unwrap().to_string(),
                t["src_path"].as_str().unwrap().to_string(),
            )
        })
        .collect())
}

/// `cargo ARGS` in `dir`: its stdout, or its stderr when it fails.
fn cargo_ok(dir: &Path, args: &[&str]) -> Result<Vec<u8>, String> {
    let out = Command::new(env!("CARGO"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("running cargo");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(out.stdout)
}

/// This machine's target triple (`host:` of `cargo -vV`).
fn host_triple() -> String {
    let out = cargo_ok(Path::new("."), &["-vV"]).expect("cargo -vV");
    String::from_utf8(out)
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .expect("cargo -vV names the host")
}

/// Paths (relative, `/`-separated) excluded by .dockerignore.
fn docker_ignored(rel: &str, patterns: &[String]) -> bool {
    patterns.iter().any(|p| {
        let p = p.trim_start_matches("**/");
        rel == p
            || rel.starts_with(&format!("{p}/"))
            || p.strip_prefix('*')
                .is_some_and(|suffix| rel.ends_with(suffix))
    })
}

fn copy_tree(from: &Path, to: &Path, rel: &str, ignore: &[String]) {
    if docker_ignored(rel, ignore) {
        return;
    }
    if from.is_dir() {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let name = entry.unwrap().file_name();
            let child_rel = format!("{rel}/{}", name.to_string_lossy());
            copy_tree(
                &from.join(&name),
                &to.join(&name),
                child_rel.trim_start_matches('/'),
                ignore,
            );
        }
    } else {
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(from, to).unwrap();
    }
}

#[test]
fn the_dockerfile_builds_the_shipped_binaries_from_a_complete_context_and_runs_them_as_non_root() {
    let stages = stages();
    assert!(stages.len() >= 2, "multi-stage");
    for s in &stages {
        let first = s.image.split('/').next().unwrap();
        assert!(
            !(s.image.contains('/')
                && (first.contains('.') || first.contains(':') || first == "localhost")),
            "FROM {}: no registry host names in the Dockerfile",
            s.image
        );
    }
    let build = &stages[0];
    assert_eq!(build.name.as_deref(), Some("build"));
    // The toolchain image satisfies Cargo.toml's rust-version.
    let tag = build
        .image
        .strip_prefix("rust:")
        .expect("the build stage uses the rust image");
    let version: Vec<u32> = tag
        .split('-')
        .next()
        .unwrap()
        .split('.')
        .map(|n| n.parse().unwrap())
        .collect();
    let needed: Vec<u32> = env!("CARGO_PKG_RUST_VERSION")
        .split('.')
        .map(|n| n.parse().unwrap())
        .collect();
    assert!(
        version[..2] >= needed[..2],
        "rust:{tag} is older than rust-version {needed:?}"
    );

    // The cargo command: --locked, --release, and which binaries.
    let workdir = build
        .instructions
        .iter()
        .rev()
        .find(|(k, _)| k == "WORKDIR")
        .map(|(_, a)| a.clone())
        .expect("WORKDIR in the build stage");
    let cargo = build
        .instructions
        .iter()
        .find(|(k, a)| k == "RUN" && a.contains("cargo build"))
        .map(|(_, a)| a.clone())
        .expect("RUN cargo build");
    let words: Vec<&str> = cargo.split_whitespace().collect();
    assert!(words.contains(&"--locked"), "{cargo}");
    // Release unless a build argument says otherwise.
    let profile_arg = build
        .instructions
        .iter()
        .find(|(k, a)| k == "ARG" && a.starts_with("PROFILE="))
        .map(|(_, a)| a.clone());
    assert!(
        words.contains(&"--release")
            || (words.windows(2).any(|w| w == ["--profile", "\"$PROFILE\""])
                && profile_arg.as_deref() == Some("PROFILE=release")),
        "{cargo}: --release, or --profile \"$PROFILE\" with ARG PROFILE=release ({profile_arg:?})"
    );
    let built: BTreeSet<String> = words
        .windows(2)
        .filter(|w| w[0] == "--bin")
        .map(|w| w[1].to_string())
        .collect();
    assert_eq!(
        built,
        BTreeSet::from(["agentrun".to_string(), "kubectl-agentrun".to_string()]),
        "the image holds the operator and the kubectl plugin, nothing else"
    );
    let declared = cargo_bins(root()).expect("cargo metadata");
    for bin in &built {
        assert!(
            declared.contains_key(bin),
            "the workspace declares no bin {bin}"
        );
    }

    // The final stage copies exactly those binaries out of the directory the
    // build step puts them in (the last word of its command, relative to
    // WORKDIR).
    let last = stages.last().unwrap();
    let out = words.last().unwrap().trim_end_matches('/');
    let release_dir = format!("{}/{out}/", workdir.trim_end_matches('/'));
    let mut copied = BTreeMap::new();
    for (k, a) in &last.instructions {
        if k == "COPY" && a.starts_with("--from=build") {
            let parts: Vec<&str> = a.split_whitespace().collect();
            let (src, dst) = (parts[1], parts[2]);
            if let Some(bin) = src.strip_prefix(&release_dir) {
                copied.insert(bin.to_string(), dst.to_string());
            }
        }
    }
    assert_eq!(
        copied.keys().cloned().collect::<BTreeSet<_>>(),
        built,
        "copied binaries"
    );
    let user = last
        .instructions
        .iter()
        .rev()
        .find(|(k, _)| k == "USER")
        .map(|(_, a)| a.clone())
        .expect("USER in the final stage");
    let uid = user.split(':').next().unwrap();
    assert!(
        uid.parse::<u32>().is_ok_and(|u| u != 0),
        "USER {user}: numeric and not root (runAsNonRoot)"
    );
    let entry = last
        .instructions
        .iter()
        .rev()
        .find(|(k, _)| k == "ENTRYPOINT")
        .map(|(_, a)| a.clone())
        .expect("ENTRYPOINT");
    let entry: Vec<String> = serde_json::from_str(&entry).expect("exec-form ENTRYPOINT");
    assert_eq!(entry[0], copied["agentrun"]);
    // Step Jobs run `agentrun step` from this image: found on the default PATH.
    assert!(copied["kubectl-agentrun"].starts_with("/usr/local/bin/"));
    assert!(copied["agentrun"].starts_with("/usr/local/bin/"));

    // Simulate the build context: the files the build stage COPYs (minus
    // .dockerignore). Cargo must accept the manifest and lockfile there...
    let ignore: Vec<String> = std::fs::read_to_string(root().join(".dockerignore"))
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect();
    let ctx = tempfile::tempdir().unwrap();
    for (k, a) in &build.instructions {
        if k != "COPY" {
            continue;
        }
        assert!(
            !a.starts_with("--from"),
            "the build stage copies from the context only"
        );
        let parts: Vec<&str> = a.split_whitespace().collect();
        let (srcs, dst) = parts.split_at(parts.len() - 1);
        let dst = dst[0].trim_start_matches("./");
        for src in srcs {
            let from = root().join(src);
            assert!(from.exists(), "COPY {src}: not in the repository");
            let to = if dst.ends_with('/') || dst.is_empty() || srcs.len() > 1 {
                ctx.path()
                    .join(dst)
                    .join(Path::new(src).file_name().unwrap())
            } else {
                ctx.path().join(dst)
            };
            copy_tree(&from, &to, src, &ignore);
        }
    }
    let in_ctx = cargo_bins(ctx.path()).unwrap_or_else(|e| {
        panic!("cargo rejects the Dockerfile's build context (a member's manifest or Cargo.lock missing?):\n{e}")
    });
    assert_eq!(in_ctx.len(), declared.len());
    // Cargo reads every member's manifest as a build does (fetch parses them
    // as strictly: a target declared by name whose source is missing is
    // refused; one declared with its path is read only when built)...
    let host = host_triple();
    let args = ["fetch", "--locked", "--offline", "--target", &host];
    if let Err(e) = cargo_ok(ctx.path(), &args) {
        panic!("cargo refuses the workspace in the Dockerfile's build context:\n{e}");
    }
    // ...and it must hold every local file the compiler read for the shipped
    // binaries (their dep-info, written when `e2e/build-binaries` built them).
    for bin in ["agentrun", "kubectl-agentrun"] {
        let dep_info = format!("{}.d", common::binary(bin).display());
        let text = std::fs::read_to_string(&dep_info)
            .unwrap_or_else(|e| panic!("{dep_info}: {e} (cargo writes it next to the binary)"));
        let (_, inputs) = text.split_once(": ").expect("dep-info");
        let mut local = 0;
        for input in inputs.split_whitespace() {
            let Ok(rel) = Path::new(input).strip_prefix(root()) else {
                continue;
            };
            local += 1;
            assert!(
                ctx.path().join(rel).is_file(),
                "{bin} is compiled from {} but the Dockerfile does not copy it",
                rel.display()
            );
        }
        assert!(local > 5, "{bin}: the dep-info names its sources ({local})");
    }
}
