//! Services on the real node of `e2e/cluster up --node=real`: kube-proxy
//! (iptables mode) takes pods to a Service's ClusterIP, CoreDNS on the node
//! IP resolves `<svc>.<ns>.svc.cluster.local`, `<svc>.<ns>` and `<svc>`, and
//! the `kubernetes` Service leads a pod with a service-account token to the
//! API server, whose certificate verifies against the token's ca.crt. A
//! selector-less Service with a hand-written EndpointSlice reaches a process
//! on the machine listening on the node IP: how step pods reach stand-ins.
//!
//! Run: `e2e/cluster up --node=real && eval "$(e2e/cluster env)" &&
//! cargo test --test e2e_real_node_services -- --ignored`.

mod common;

use common::realnode::{NODE, node_ip, test_image};

use std::io::{Read as _, Write as _};
use std::net::{IpAddr, TcpListener};
use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;

const POD_TIMEOUT: Duration = Duration::from_secs(120);
/// kube-proxy's and CoreDNS's informers, then kube-proxy's next sync.
const ROUTE_TIMEOUT: Duration = Duration::from_secs(60);

/// A busybox pod on the real node running `script`; returns once it is Ready
/// (its readiness probe, if any, passed).
async fn run_pod(
    pods: &Api<Pod>,
    name: &str,
    labels: serde_json::Value,
    container: serde_json::Value,
) {
    let mut container = container;
    container["name"] = json!("main");
    container["image"] = json!(test_image());
    container["imagePullPolicy"] = json!("Never");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": name, "labels": labels },
        "spec": {
            "nodeSelector": { "kubernetes.io/hostname": NODE },
            "terminationGracePeriodSeconds": 0,
            "containers": [container],
        },
    }))
    .expect("pod object");
    pods.create(&PostParams::default(), &pod)
        .await
        .unwrap_or_else(|e| panic!("creating pod {name}: {e}"));
    common::wait_for(&format!("pod {name} Ready"), POD_TIMEOUT, || async {
        let p = pods.get(name).await.map_err(|e| e.to_string())?;
        let status = p.status.unwrap_or_default();
        let ready = status
            .conditions
            .as_ref()
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        if ready {
            Ok(())
        } else {
            Err(format!(
                "phase {:?}, containers {:?}",
                status.phase, status.container_statuses
            ))
        }
    })
    .await;
}

/// A pod that only waits, to run commands in with `kubectl exec`.
async fn client_pod(pods: &Api<Pod>, name: &str, automount_token: bool) {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": {
            "nodeSelector": { "kubernetes.io/hostname": NODE },
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": automount_token,
            "containers": [{
                "name": "main",
                "image": test_image(),
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", "exec sleep 3600"],
            }],
        },
    }))
    .expect("pod object");
    pods.create(&PostParams::default(), &pod)
        .await
        .unwrap_or_else(|e| panic!("creating pod {name}: {e}"));
    common::wait_for(&format!("pod {name} Running"), POD_TIMEOUT, || async {
        let p = pods.get(name).await.map_err(|e| e.to_string())?;
        match p.status.as_ref().and_then(|s| s.phase.as_deref()) {
            Some("Running") => Ok(()),
            other => Err(format!(
                "phase {other:?}, containers {:?}",
                p.status.as_ref().map(|s| &s.container_statuses)
            )),
        }
    })
    .await;
}

/// `kubectl exec` in a pod's container (through the API server and the kubelet).
fn exec(ns: &str, pod: &str, script: &str) -> Result<String, String> {
    let kubectl = std::env::var("KUBECTL").unwrap_or_else(|_| "kubectl".to_string());
    let out = Command::new(&kubectl)
        .args(["exec", "-n", ns, pod, "--", "/bin/sh", "-c", script])
        .output()
        .unwrap_or_else(|e| {
            panic!("running {kubectl} (on PATH after `eval \"$(e2e/cluster env)\"`): {e}")
        });
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!(
            "exit {}: {}{}",
            out.status,
            stdout,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// An HTTP/1.0 GET from inside the pod with busybox `nc` (which resolves
/// names through the pod's resolv.conf; busybox's `wget` here crashes on
/// every URL): the whole response, status line first.
fn http_get_script(host: &str, port: u16, path: &str) -> String {
    format!("printf 'GET {path} HTTP/1.0\\r\\nHost: {host}\\r\\n\\r\\n' | nc -w 3 {host} {port}")
}

/// Until a GET of `http://host:port/` from the pod answers 200; its body.
async fn fetch_from_pod(ns: &str, pod: &str, host: &str, port: u16) -> String {
    let script = http_get_script(host, port, "/");
    common::wait_for(
        &format!("http://{host}:{port}/ from pod {pod}"),
        ROUTE_TIMEOUT,
        || async {
            let response = exec(ns, pod, &script)?;
            match response.split_once("\r\n\r\n") {
                Some((head, body)) if head.starts_with("HTTP/1.") && head.contains(" 200 ") => {
                    Ok(body.to_string())
                }
                _ => Err(format!("response {response:?}")),
            }
        },
    )
    .await
}

async fn create_service(client: &kube::Client, ns: &str, svc: serde_json::Value) -> Service {
    let services: Api<Service> = Api::namespaced(client.clone(), ns);
    let svc: Service = serde_json::from_value(svc).expect("service object");
    services
        .create(&PostParams::default(), &svc)
        .await
        .unwrap_or_else(|e| panic!("creating service: {e}"))
}

fn cluster_ip(svc: &Service) -> String {
    svc.spec
        .as_ref()
        .and_then(|s| s.cluster_ip.clone())
        .filter(|ip| !ip.is_empty() && ip != "None")
        .expect("the service has a ClusterIP")
}

#[tokio::test]
#[ignore = "needs e2e/cluster up --node=real"]
async fn a_pod_reaches_a_service_by_its_dns_names_through_the_cluster_ip() {
    let client = common::admin().await;
    node_ip(&client).await;
    let ns = common::test_namespace(&client, "real-svc").await;
    let ns = ns.name();
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);

    // The server answers with its own pod name, so the client's output shows
    // whom it reached.
    run_pod(
        &pods,
        "web",
        json!({ "app": "web" }),
        json!({
            "command": ["/bin/sh", "-c",
                "mkdir -p /tmp/www && echo \"served-by=$(hostname)\" > /tmp/www/index.html && \
                 exec httpd -f -p 8080 -h /tmp/www"],
            "ports": [{ "containerPort": 8080 }],
            "readinessProbe": {
                "tcpSocket": { "port": 8080 },
                "periodSeconds": 1,
            },
        }),
    )
    .await;
    let svc = create_service(
        &client,
        ns,
        json!({
            "metadata": { "name": "web" },
            "spec": {
                "selector": { "app": "web" },
                "ports": [{ "name": "http", "port": 80, "targetPort": 8080 }],
            },
        }),
    )
    .await;
    let ip = cluster_ip(&svc);

    // The EndpointSlice controller puts the ready pod behind the Service.
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), ns);
    let web_ip = pods
        .get("web")
        .await
        .expect("pod web")
        .status
        .and_then(|s| s.pod_ip)
        .expect("pod web has an IP");
    common::wait_for("the web Service's EndpointSlice", ROUTE_TIMEOUT, || async {
        let list = slices
            .list(&ListParams::default().labels("kubernetes.io/service-name=web"))
            .await
            .map_err(|e| e.to_string())?;
        let ready: Vec<String> = list
            .items
            .iter()
            .flat_map(|s| s.endpoints.iter())
            .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
            .flat_map(|e| e.addresses.clone())
            .collect();
        if ready.contains(&web_ip) {
            Ok(())
        } else {
            Err(format!("ready endpoints {ready:?}, want {web_ip}"))
        }
    })
    .await;

    client_pod(&pods, "client", false).await;
    // CoreDNS answers the full name with the ClusterIP (not the pod's IP).
    let fqdn = format!("web.{ns}.svc.cluster.local");
    let lookup = common::wait_for(
        &format!("{fqdn} resolving to {ip} in pod client"),
        ROUTE_TIMEOUT,
        || async {
            let out = exec(ns, "client", &format!("nslookup {fqdn}"))?;
            if out
                .lines()
                .any(|l| l.contains("Address") && l.trim_end().ends_with(&ip))
            {
                Ok(out)
            } else {
                Err(format!("nslookup said: {out}"))
            }
        },
    )
    .await;
    println!("nslookup {fqdn} in pod client:\n{lookup}");
    let resolv = exec(ns, "client", "cat /etc/resolv.conf").expect("the pod's resolv.conf");
    assert!(
        resolv.contains(&format!(
            "search {ns}.svc.cluster.local svc.cluster.local cluster.local"
        )),
        "the pod's resolv.conf:\n{resolv}"
    );

    // Every name a pod may use, through kube-proxy to the one pod.
    for name in [fqdn.as_str(), &format!("web.{ns}"), "web", &ip] {
        let body = fetch_from_pod(ns, "client", name, 80).await;
        assert_eq!(
            body.trim(),
            "served-by=web",
            "http://{name}/ answered {body:?}"
        );
    }
}

#[tokio::test]
#[ignore = "needs e2e/cluster up --node=real"]
async fn a_pod_with_a_service_account_token_reaches_the_api_server_through_the_kubernetes_service()
{
    let client = common::admin().await;
    let node_ip = node_ip(&client).await.to_string();
    let api_port: i32 = std::env::var("AGENTRUN_API_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(16443);

    // The API server keeps the node IP as the `kubernetes` Service's endpoint.
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    let slice = slices
        .get("kubernetes")
        .await
        .expect("the kubernetes EndpointSlice in default (the API server's endpoint reconciler)");
    let addresses: Vec<String> = slice
        .endpoints
        .iter()
        .flat_map(|e| e.addresses.clone())
        .collect();
    assert_eq!(
        addresses,
        vec![node_ip.clone()],
        "the kubernetes Service's endpoints"
    );
    let ports: Vec<Option<i32>> = slice.ports.iter().flatten().map(|p| p.port).collect();
    assert_eq!(
        ports,
        vec![Some(api_port)],
        "the kubernetes Service's endpoint ports"
    );

    let ns = common::test_namespace(&client, "real-api").await;
    let ns = ns.name();
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    client_pod(&pods, "in-cluster", true).await;

    const SA: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
    let env = exec(
        ns,
        "in-cluster",
        "echo $KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT",
    )
    .expect("the pod's environment");
    assert_eq!(
        env.trim(),
        "10.0.0.1:443",
        "KUBERNETES_SERVICE_HOST:PORT in the pod"
    );
    let ca = exec(ns, "in-cluster", &format!("cat {SA}/ca.crt")).expect("the token's ca.crt");
    let token = exec(ns, "in-cluster", &format!("cat {SA}/token")).expect("the token");
    assert!(!token.trim().is_empty(), "an empty service-account token");

    // The controller-manager publishes the cluster CA in every namespace; the
    // kubelet mounts it next to the token.
    let root_ca = Api::<ConfigMap>::namespaced(client.clone(), ns)
        .get("kube-root-ca.crt")
        .await
        .expect("the kube-root-ca.crt ConfigMap")
        .data
        .and_then(|d| d.get("ca.crt").cloned())
        .expect("kube-root-ca.crt has ca.crt");
    assert_eq!(
        ca.trim(),
        root_ca.trim(),
        "the token's ca.crt is the cluster CA"
    );

    // From the pod, by name and by the ClusterIP: the API server's TLS port
    // answers (a plain HTTP request gets Go's reply for HTTP on an HTTPS port;
    // busybox has no TLS client that works here, the check below does TLS).
    for host in ["kubernetes.default.svc", "kubernetes.default", "10.0.0.1"] {
        let script = http_get_script(host, 443, "/");
        let answer = common::wait_for(
            &format!("the API server through {host}:443 from the pod"),
            ROUTE_TIMEOUT,
            || async {
                let out = exec(ns, "in-cluster", &script)?;
                if out.contains("Client sent an HTTP request to an HTTPS server") {
                    Ok(out)
                } else {
                    Err(format!("answer {out:?}"))
                }
            },
        )
        .await;
        assert!(
            answer.starts_with("HTTP/1.0 400"),
            "{host}:443 answered {answer:?}"
        );
    }

    // What an in-cluster kube-rs client does: https://10.0.0.1:443 (through
    // kube-proxy, as the pod's Service environment says), the certificate
    // checked against the token's ca.crt, the token as bearer.
    let mut config = kube::Config::new("https://10.0.0.1:443".parse().expect("url"));
    config.root_cert = Some(vec![pem_der(&ca)]);
    config.auth_info.token = Some(token.trim().to_string().into());
    let in_cluster = kube::Client::try_from(config).expect("an in-cluster style client");
    let version = common::wait_for(
        "the API server's version through https://10.0.0.1:443 with the token's CA",
        ROUTE_TIMEOUT,
        || async { in_cluster.apiserver_version().await },
    )
    .await;
    assert_eq!(version.git_version, "v1.34.4");
    // Who the API server took the token for.
    let review: SelfSubjectReview =
        serde_json::from_value(json!({ "metadata": {} })).expect("review object");
    let review = Api::<SelfSubjectReview>::all(in_cluster)
        .create(&PostParams::default(), &review)
        .await
        .expect("a SelfSubjectReview through https://10.0.0.1:443");
    let user = review
        .status
        .and_then(|s| s.user_info)
        .and_then(|u| u.username);
    assert_eq!(
        user.as_deref(),
        Some(format!("system:serviceaccount:{ns}:default").as_str()),
        "the identity of the pod's token"
    );
}

/// The DER bytes of the first certificate in a PEM text.
fn pem_der(pem: &str) -> Vec<u8> {
    use base64::Engine as _;
    let body: String = pem
        .lines()
        .skip_while(|l| !l.starts_with("-----BEGIN CERTIFICATE-----"))
        .skip(1)
        .take_while(|l| !l.starts_with("-----END CERTIFICATE-----"))
        .collect();
    base64::engine::general_purpose::STANDARD
        .decode(body.trim())
        .expect("a PEM certificate")
}

/// A listener on the node IP on a free port below the ephemeral range (the
/// port a stand-in on the machine would use).
fn listen_on(ip: IpAddr) -> TcpListener {
    (20000..32768)
        .step_by(7)
        .find_map(|port| TcpListener::bind((ip, port)).ok())
        .unwrap_or_else(|| panic!("no free port on {ip} below 32768"))
}

#[tokio::test]
#[ignore = "needs e2e/cluster up --node=real"]
async fn a_selectorless_service_reaches_a_process_on_the_node_ip_by_name() {
    let client = common::admin().await;
    let ip = node_ip(&client).await;
    let listener = listen_on(ip);
    let port = listener.local_addr().expect("listener address").port();
    let marker = common::unique_name("host-standin");
    let reply = marker.clone();
    // A stand-in on the machine: answers every request with its marker.
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut buf = [0u8; 2048];
            let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
            let _ = conn.read(&mut buf);
            let body = format!("{reply}\n");
            let _ = write!(
                conn,
                "HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });

    let ns = common::test_namespace(&client, "real-host").await;
    let ns = ns.name();
    create_service(
        &client,
        ns,
        json!({
            "metadata": { "name": "standin" },
            "spec": { "ports": [{ "name": "http", "port": 80, "targetPort": port }] },
        }),
    )
    .await;
    let slice: EndpointSlice = serde_json::from_value(json!({
        "metadata": {
            "name": "standin-host",
            "labels": {
                "kubernetes.io/service-name": "standin",
                "endpointslice.kubernetes.io/managed-by": "e2e.agentrun.dev",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{ "addresses": [ip.to_string()], "conditions": { "ready": true } }],
        "ports": [{ "name": "http", "port": port, "protocol": "TCP" }],
    }))
    .expect("endpointslice object");
    Api::<EndpointSlice>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &slice)
        .await
        .expect("creating the EndpointSlice");

    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    client_pod(&pods, "client", false).await;
    for name in ["standin", &format!("standin.{ns}.svc.cluster.local")] {
        let body = fetch_from_pod(ns, "client", name, 80).await;
        assert_eq!(body.trim(), marker, "http://{name}/ answered {body:?}");
    }
}
