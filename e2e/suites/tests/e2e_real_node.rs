//! The real node of `e2e/cluster up --node=real`: a kubelet with containerd
//! and runc (e2e/realnode/). A pod with the step pods' security context runs
//! in a real container there, confined as asked, and its output comes back
//! through the API server (`kubectl logs`: API server -> kubelet at its node
//! IP, over TLS both ways). Without a service-account token, the API server
//! (reachable through the `kubernetes` Service) refuses what it asks.
//!
//! Run: `e2e/cluster up --node=real && eval "$(e2e/cluster env)" &&
//! cargo test --test e2e_real_node -- --ignored`.

mod common;

use common::realnode::{NODE, test_image};

use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use kube::api::{Api, PostParams};
use serde_json::json;

const POD_TIMEOUT: Duration = Duration::from_secs(120);

fn ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn internal_ip(node: &Node) -> Option<String> {
    node.status
        .as_ref()?
        .addresses
        .as_ref()?
        .iter()
        .find(|a| a.type_ == "InternalIP")
        .map(|a| a.address.clone())
}

async fn real_node(client: &kube::Client) -> Node {
    let nodes: Api<Node> = Api::all(client.clone());
    common::wait_for(
        &format!("node {NODE} Ready"),
        Duration::from_secs(60),
        || async {
            match nodes.get_opt(NODE).await {
                Ok(Some(n)) if ready(&n) => Ok(n),
                Ok(Some(n)) => Err(format!("not Ready: {:?}", n.status.map(|s| s.conditions))),
                Ok(None) => Err(format!(
                    "no node {NODE}: is the cluster up with --node=real?"
                )),
                Err(e) => Err(e.to_string()),
            }
        },
    )
    .await
}

/// `kubectl logs` through the API server (which asks the kubelet).
fn kubectl_logs(ns: &str, pod: &str) -> String {
    let kubectl = std::env::var("KUBECTL").unwrap_or_else(|_| "kubectl".to_string());
    let out = Command::new(&kubectl)
        .args(["logs", "-n", ns, pod])
        .output()
        .unwrap_or_else(|e| {
            panic!("running {kubectl} (on PATH after `eval \"$(e2e/cluster env)\"`): {e}")
        });
    assert!(
        out.status.success(),
        "kubectl logs -n {ns} {pod} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn line<'a>(logs: &'a str, key: &str) -> Option<&'a str> {
    logs.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")))
        .map(str::trim)
}

#[tokio::test]
#[ignore = "needs e2e/cluster up --node=real"]
async fn the_real_node_is_ready_with_its_node_ip() {
    let client = common::admin().await;
    let node = real_node(&client).await;
    let ip = internal_ip(&node).expect("the real node reports an InternalIP");
    assert!(
        !ip.starts_with("127."),
        "the kubelet refuses a loopback node IP; got {ip}"
    );
    let info = node.status.and_then(|s| s.node_info).expect("node info");
    assert_eq!(info.kubelet_version, "v1.34.4");
    assert!(
        info.container_runtime_version.starts_with("containerd://"),
        "runtime {}",
        info.container_runtime_version
    );
}

#[tokio::test]
#[ignore = "needs e2e/cluster up --node=real"]
async fn a_pod_with_the_step_pods_security_context_runs_confined() {
    let client = common::admin().await;
    let node = real_node(&client).await;
    let node_ip = internal_ip(&node).expect("the real node's InternalIP");
    let api_port = std::env::var("AGENTRUN_API_PORT").unwrap_or_else(|_| "16443".to_string());
    let ns = common::test_namespace(&client, "real-node").await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns.name());

    // What a step pod may do on a real node: print who it is, try to write
    // its root filesystem, look for a service-account token, and try the API
    // server at the node IP, the `kubernetes` Service and its own loopback.
    let script = format!(
        "echo uid=$(id -u); echo gid=$(id -g); \
         if echo x > /x 2>/dev/null; then echo write=ok; else echo write=failed; fi; \
         if [ -e /var/run/secrets/kubernetes.io/serviceaccount ]; then echo token=present; else echo token=absent; fi; \
         for t in {node_ip}:{api_port} 10.0.0.1:443 127.0.0.1:{api_port}; do \
           if nc -w 2 ${{t%:*}} ${{t#*:}} </dev/null >/dev/null 2>&1; then echo \"api $t=reachable\"; \
           else echo \"api $t=unreachable\"; fi; \
         done; \
         echo done=1"
    );
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "confined" },
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": { "kubernetes.io/hostname": NODE },
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 2,
            "securityContext": {
                "runAsNonRoot": true,
                "runAsUser": 65532,
                "runAsGroup": 65532,
                "seccompProfile": { "type": "RuntimeDefault" },
            },
            "containers": [{
                "name": "step",
                "image": test_image(),
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", script],
                "securityContext": {
                    "allowPrivilegeEscalation": false,
                    "readOnlyRootFilesystem": true,
                    "capabilities": { "drop": ["ALL"] },
                },
            }],
        },
    }))
    .expect("pod object");
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("creating the pod");

    let done = common::wait_for("pod confined to finish", POD_TIMEOUT, || async {
        let p = pods.get("confined").await.map_err(|e| e.to_string())?;
        match p.status.as_ref().and_then(|s| s.phase.as_deref()) {
            Some("Succeeded") | Some("Failed") => Ok(p),
            other => Err(format!(
                "phase {other:?}, containers {:?}",
                p.status.as_ref().map(|s| &s.container_statuses)
            )),
        }
    })
    .await;
    assert_eq!(
        done.spec.as_ref().and_then(|s| s.node_name.as_deref()),
        Some(NODE)
    );
    let phase = done.status.as_ref().and_then(|s| s.phase.clone());

    let logs = kubectl_logs(ns.name(), "confined");
    println!("kubectl logs of the confined pod:\n{logs}");
    assert_eq!(phase.as_deref(), Some("Succeeded"), "logs:\n{logs}");
    assert_eq!(line(&logs, "uid"), Some("65532"), "logs:\n{logs}");
    assert_eq!(line(&logs, "gid"), Some("65532"), "logs:\n{logs}");
    assert_eq!(
        line(&logs, "write"),
        Some("failed"),
        "the root filesystem is writable; logs:\n{logs}"
    );
    assert_eq!(
        line(&logs, "token"),
        Some("absent"),
        "a service-account token is mounted; logs:\n{logs}"
    );
    assert_eq!(line(&logs, "done"), Some("1"), "logs:\n{logs}");
    // The API server is on the pods' network (the `kubernetes` Service), as
    // on any cluster; what keeps a step pod from it is that it has no
    // credentials: the requests a token-less pod can send are anonymous, and
    // the API server refuses them.
    for l in logs.lines().filter(|l| l.starts_with("api ")) {
        println!("from the pod: {l}");
    }
    let ca = Api::<ConfigMap>::namespaced(client.clone(), ns.name())
        .get("kube-root-ca.crt")
        .await
        .expect("the kube-root-ca.crt ConfigMap")
        .data
        .and_then(|d| d.get("ca.crt").cloned())
        .expect("ca.crt");
    let _ = rustls::crypto::ring::default_provider().install_default();
    let anonymous = reqwest::Client::builder()
        .tls_certs_only([reqwest::Certificate::from_pem(ca.as_bytes()).expect("the cluster CA")])
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    for path in [
        format!("/api/v1/namespaces/{}/secrets", ns.name()),
        "/api/v1/pods".to_string(),
        "/apis/agentrun.dev/v1alpha1/agentruns".to_string(),
        "/apis/batch/v1/jobs".to_string(),
    ] {
        let status = anonymous
            .get(format!("https://10.0.0.1:443{path}"))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path} through the kubernetes Service: {e}"))
            .status()
            .as_u16();
        assert!(
            status == 401 || status == 403,
            "GET {path} without credentials answered {status}"
        );
    }
}
