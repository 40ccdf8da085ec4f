//! The controller's log API (`log.agentrun.dev`, DESIGN.md section 10) on the
//! local control plane: a serving certificate for the controller, its
//! registration with the aggregation layer (a Service without selector, an
//! EndpointSlice at this host's address, the APIService), the reader role,
//! and requests to the API through the API server (as the test users) or
//! straight to the controller's port (as anyone who can reach it).
//!
//! Only one APIService can serve the group at a time: the tests that need
//! the log API live in one test binary and take [`exclusive`] (through
//! [`LogApiWorld::start`]) for their whole length.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use agentrun::api::runlog::{LOG_GROUP, LOG_VERSION, RUNLOGS, RunLog, WatchEvent};
use agentrun::replay::Entry;
use agentrun::runlog::records::Observation;
use agentrun::store::{Head, Record, RecordDraft, StepKind, StepStore};
use futures::{AsyncBufReadExt as _, Stream, StreamExt as _};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::rbac::v1::{ClusterRole, RoleBinding};
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::discovery::ApiResource;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::json;
use sqlx::Connection as _;

use super::world::World;

/// Name of the APIService of the group.
pub const APISERVICE: &str = "v1alpha1.log.agentrun.dev";
/// Name of the Service the APIService points at.
pub const SERVICE: &str = "agentrun-log-api";
/// The tests' copy of the chart's `agentrun-log-reader` ClusterRole (same
/// rules, its own name: `helm install` refuses to adopt an object it did
/// not create, and the chart tests install the chart on this cluster).
pub const READER_ROLE: &str = "agentrun-e2e-log-reader";
/// How long the aggregator may take to call a new registration Available.
const AVAILABLE_WITHIN: Duration = Duration::from_secs(90);

const HOW_TO_START: &str = "start the local cluster with `e2e/cluster up` and run \
     `eval \"$(e2e/cluster env)\"` (the log API tests need its aggregation layer)";

/// A non-loopback address of this host that the API server's aggregator
/// dials (`AGENTRUN_HOST_ADDR` of `e2e/cluster env`): the controller's
/// serving address and its endpoint.
pub fn host_addr() -> String {
    std::env::var("AGENTRUN_HOST_ADDR")
        .ok()
        .filter(|a| !a.is_empty())
        .unwrap_or_else(|| {
            panic!(
                "AGENTRUN_HOST_ADDR is not set: {HOW_TO_START}; as root `e2e/cluster up` gives the \
                 process node an address of its own (agentrun-agg0), or set AGENTRUN_AGGREGATION_ADDR \
                 to a non-loopback address of this host before `up`"
            )
        })
}

/// The cluster's PKI directory (the front-proxy CA and client certificate,
/// the test users' client certificates), next to `AGENTRUN_FRONT_PROXY_CA`.
pub fn pki_dir() -> PathBuf {
    let ca = std::env::var("AGENTRUN_FRONT_PROXY_CA")
        .ok()
        .filter(|a| !a.is_empty())
        .unwrap_or_else(|| panic!("AGENTRUN_FRONT_PROXY_CA is not set: {HOW_TO_START}"));
    let ca = PathBuf::from(ca);
    assert!(
        ca.is_file(),
        "{}: no such file; {HOW_TO_START}",
        ca.display()
    );
    ca.parent().expect("the CA's directory").to_path_buf()
}

// --- the serving certificate -------------------------------------------------

/// A CA and a serving certificate it signed, as PEM files in a temporary
/// directory (removed when dropped).
pub struct ServingCert {
    dir: tempfile::TempDir,
    /// The CA certificate (the APIService's `caBundle`).
    pub ca_pem: String,
    /// The name the certificate is for: `<service>.<namespace>.svc`, the
    /// name the aggregator checks.
    pub dns_name: String,
}

impl ServingCert {
    pub fn cert_file(&self) -> PathBuf {
        self.dir.path().join("tls.crt")
    }

    pub fn key_file(&self) -> PathBuf {
        self.dir.path().join("tls.key")
    }

    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }
}

/// Makes a CA and a serving certificate for `<service>.<namespace>.svc`
/// with rcgen, and writes `ca.crt`, `tls.crt` and `tls.key`.
pub fn serving_cert(service: &str, namespace: &str) -> ServingCert {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, KeyUsagePurpose,
    };
    let dns_name = format!("{service}.{namespace}.svc");
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, format!("{service} e2e serving CA"));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca.self_signed(&ca_key).expect("self-signing the CA");
    let issuer = Issuer::new(ca, ca_key);

    let key = KeyPair::generate().expect("serving key");
    let mut params =
        CertificateParams::new(vec![dns_name.clone(), format!("{dns_name}.cluster.local")])
            .expect("serving params");
    params
        .distinguished_name
        .push(DnType::CommonName, &dns_name);
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    let cert = params.signed_by(&key, &issuer).expect("signing");

    let out = ServingCert {
        dir: tempfile::tempdir().expect("temp dir"),
        ca_pem: ca_cert.pem(),
        dns_name,
    };
    std::fs::write(out.ca_file(), &out.ca_pem).expect("writing ca.crt");
    std::fs::write(out.cert_file(), cert.pem()).expect("writing tls.crt");
    std::fs::write(out.key_file(), key.serialize_pem()).expect("writing tls.key");
    out
}

// --- registration --------------------------------------------------------------

/// The APIService of the group, deleted when dropped (an APIService whose
/// server is gone breaks discovery for every client of the cluster, and
/// namespace deletion with it).
pub struct Registration {
    _apiservice: super::DeleteOnDrop,
}

fn apiservice_resource() -> ApiResource {
    ApiResource::erase::<APIService>(&())
}

/// Registers the log API served at `host_addr:port`: a Service without
/// selector in `namespace` (port 443 to `port`), its EndpointSlice (the
/// aggregator routes to EndpointSlices' addresses) and the APIService with
/// `ca_pem` as its CA bundle; returns once the APIService is Available.
pub async fn register(
    client: &Client,
    namespace: &str,
    service_name: &str,
    host_addr: &str,
    port: u16,
    ca_pem: &str,
) -> Registration {
    create_service(client, namespace, service_name, host_addr, port).await;
    let apiservices: Api<APIService> = Api::all(client.clone());
    // A registration left by an earlier, killed test process would still
    // say Available: remove it, so the condition waited on is this one's.
    let _ = apiservices
        .delete(APISERVICE, &DeleteParams::background())
        .await;
    super::wait_for(
        "an earlier APIService to be gone",
        Duration::from_secs(30),
        || async {
            match apiservices.get_opt(APISERVICE).await {
                Ok(None) => Ok(()),
                Ok(Some(_)) => Err("still there".to_string()),
                Err(e) => Err(e.to_string()),
            }
        },
    )
    .await;
    let registration = Registration {
        _apiservice: super::DeleteOnDrop {
            resource: apiservice_resource(),
            name: APISERVICE.to_string(),
        },
    };
    apiservices
        .create(
            &PostParams::default(),
            &apiservice(namespace, service_name, ca_pem),
        )
        .await
        .unwrap_or_else(|e| panic!("creating APIService {APISERVICE}: {e}"));
    wait_available(&apiservices).await;
    registration
}

fn apiservice(namespace: &str, service_name: &str, ca_pem: &str) -> APIService {
    use base64::Engine as _;
    serde_json::from_value(json!({
        "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
        "metadata": {"name": APISERVICE, "labels": {"agentrun.dev/e2e": "true"}},
        "spec": {
            "group": LOG_GROUP, "version": LOG_VERSION,
            "service": {"namespace": namespace, "name": service_name, "port": 443},
            "caBundle": base64::engine::general_purpose::STANDARD.encode(ca_pem),
            "groupPriorityMinimum": 1000, "versionPriority": 15
        }
    }))
    .expect("APIService")
}

/// The Service (no selector: nothing manages its endpoints) and the one
/// EndpointSlice the aggregator reads, at `host_addr:port`.
async fn create_service(client: &Client, namespace: &str, name: &str, host_addr: &str, port: u16) {
    let service: Service = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"ports": [{"name": "https", "protocol": "TCP", "port": 443, "targetPort": port}]}
    }))
    .expect("Service");
    Api::<Service>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &service)
        .await
        .unwrap_or_else(|e| panic!("creating Service {namespace}/{name}: {e}"));
    let slice: EndpointSlice = serde_json::from_value(json!({
        "metadata": {
            "name": format!("{name}-host"),
            "labels": {
                "kubernetes.io/service-name": name,
                // Not the EndpointSlice controllers': they leave it alone.
                "endpointslice.kubernetes.io/managed-by": "agentrun-e2e"
            }
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [host_addr], "conditions": {"ready": true}}],
        "ports": [{"name": "https", "protocol": "TCP", "port": port}]
    }))
    .expect("EndpointSlice");
    Api::<EndpointSlice>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &slice)
        .await
        .unwrap_or_else(|e| panic!("creating EndpointSlice {namespace}/{name}-host: {e}"));
}

/// Waits until the APIService's `Available` condition is True; the panic
/// names the condition's reason and message (what the aggregator saw).
async fn wait_available(apiservices: &Api<APIService>) {
    super::wait_for(
        &format!("APIService {APISERVICE} to be Available"),
        AVAILABLE_WITHIN,
        || async {
            let service = apiservices
                .get(APISERVICE)
                .await
                .map_err(|e| e.to_string())?;
            let conditions = service
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default();
            match conditions.iter().find(|c| c.type_ == "Available") {
                Some(c) if c.status == "True" => Ok(()),
                Some(c) => Err(format!(
                    "Available={} reason {:?}: {}",
                    c.status,
                    c.reason.as_deref().unwrap_or_default(),
                    c.message.as_deref().unwrap_or_default()
                )),
                None => Err("no Available condition yet".to_string()),
            }
        },
    )
    .await;
}

/// The log API held by one test: a lock on a file of the cluster's state
/// dir, released when dropped (or when the process dies).
pub struct Exclusive {
    _file: std::fs::File,
}

/// How long a test may wait for the others to be done with the log API.
const EXCLUSIVE_WITHIN: Duration = Duration::from_secs(1800);

/// Holds the log API for one test at a time (one APIService per group):
/// across the tests of a binary and across processes (the tests, the log
/// API benchmark), as `flock` locks one open file description.
pub async fn exclusive() -> Exclusive {
    let dir = std::env::var_os("AGENTRUN_CLUSTER_DIR")
        .filter(|d| !d.is_empty())
        .map_or_else(std::env::temp_dir, PathBuf::from);
    let path = dir.join("log-api.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    let started = std::time::Instant::now();
    loop {
        use std::os::fd::AsRawFd as _;
        // SAFETY: flock(2) on a descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            note_holder(&file);
            return Exclusive { _file: file };
        }
        if started.elapsed() >= EXCLUSIVE_WITHIN {
            let holder = std::fs::read_to_string(&path).unwrap_or_default();
            panic!(
                "the log API ({}) was not free within {EXCLUSIVE_WITHIN:?}; held by {holder}",
                path.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Writes who holds the lock into its file (for a waiter's panic message).
fn note_holder(mut file: &std::fs::File) {
    use std::io::{Seek as _, Write as _};
    let me = format!(
        "pid {} ({})\n",
        std::process::id(),
        std::thread::current().name().unwrap_or("?")
    );
    let _ = file.set_len(0);
    let _ = file.seek(std::io::SeekFrom::Start(0));
    let _ = file.write_all(me.as_bytes());
}

// --- RBAC ------------------------------------------------------------------------

/// Creates [`READER_ROLE`] (get, list, watch on runlogs, as the chart's
/// `agentrun-log-reader`) and binds `user` to it in `namespace` only.
pub async fn grant_reader(client: &Client, namespace: &str, user: &str) {
    let role: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": READER_ROLE, "labels": {"agentrun.dev/e2e": "true"}},
        "rules": [{"apiGroups": [LOG_GROUP], "resources": [RUNLOGS], "verbs": ["get", "list", "watch"]}]
    }))
    .expect("ClusterRole");
    Api::<ClusterRole>::all(client.clone())
        .patch(
            READER_ROLE,
            &PatchParams::apply("agentrun-e2e").force(),
            &Patch::Apply(&role),
        )
        .await
        .unwrap_or_else(|e| panic!("applying ClusterRole {READER_ROLE}: {e}"));
    let name = format!("{user}-log-reader");
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": READER_ROLE},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]
    }))
    .expect("RoleBinding");
    Api::<RoleBinding>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap_or_else(|e| panic!("binding {user} to {READER_ROLE} in {namespace}: {e}"));
}

/// Lets `user` do only `verbs` on runlogs in `namespace` (a Role of its own).
pub async fn grant_verbs(client: &Client, namespace: &str, user: &str, verbs: &[&str]) {
    use k8s_openapi::api::rbac::v1::Role;
    let name = format!("{user}-runlogs");
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": name},
        "rules": [{"apiGroups": [LOG_GROUP], "resources": [RUNLOGS], "verbs": verbs}]
    }))
    .expect("Role");
    Api::<Role>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &role)
        .await
        .unwrap_or_else(|e| panic!("creating Role {namespace}/{name}: {e}"));
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]
    }))
    .expect("RoleBinding");
    Api::<RoleBinding>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap_or_else(|e| panic!("binding {user} to Role {name} in {namespace}: {e}"));
}

// --- a namespace with a controller that serves the log API -----------------------

/// A [`World`] (namespace A, its controller, stand-ins) whose controller
/// also serves the log API, registered with the aggregation layer. Fields
/// drop in order: the APIService first (no client sees an unavailable group
/// for long), then the world (its controller and namespace), last the lock.
pub struct LogApiWorld {
    _registration: Registration,
    pub world: World,
    /// The namespace of the Service (the controller's own, in a cluster).
    pub home: super::TestNamespace,
    pub cert: ServingCert,
    /// Where the controller serves: `host_addr:port`.
    pub addr: String,
    pub port: u16,
    _exclusive: Exclusive,
}

impl LogApiWorld {
    /// Takes the log API ([`exclusive`]), makes the serving certificate,
    /// starts the world's controller serving on this host's address and
    /// registers it.
    pub async fn start(prefix: &str) -> LogApiWorld {
        let exclusive = exclusive().await;
        let addr = host_addr();
        let client = super::admin().await;
        let home = super::test_namespace(&client, "logapi-home").await;
        let cert = serving_cert(SERVICE, home.name());
        let port = super::ports::reserve_on(&addr);
        let serving = format!("{addr}:{port}");
        let (cert_file, key_file) = (cert.cert_file(), cert.key_file());
        let flags = [
            "--serving-addr",
            &serving,
            "--serving-cert-file",
            cert_file.to_str().unwrap(),
            "--serving-key-file",
            key_file.to_str().unwrap(),
        ];
        let world = World::new(prefix, &flags).await;
        let registration = register(&client, home.name(), SERVICE, &addr, port, &cert.ca_pem).await;
        LogApiWorld {
            _registration: registration,
            world,
            home,
            cert,
            addr,
            port,
            _exclusive: exclusive,
        }
    }

    pub fn ns(&self) -> &str {
        self.world.name()
    }
}

// --- requests through the API server ----------------------------------------------

/// `/apis/log.agentrun.dev/v1alpha1/namespaces/NS/runlogs[/NAME][?QUERY]`.
pub fn runlog_path(namespace: &str, name: Option<&str>, query: &str) -> String {
    let mut path = format!("/apis/{LOG_GROUP}/{LOG_VERSION}/namespaces/{namespace}/{RUNLOGS}");
    if let Some(name) = name {
        path.push('/');
        path.push_str(name);
    }
    if !query.is_empty() {
        path.push('?');
        path.push_str(query);
    }
    path
}

fn get_request(path: &str) -> http::Request<Vec<u8>> {
    http::Request::get(path)
        .header("Accept", "application/json")
        .body(Vec::new())
        .expect("request")
}

/// GETs one page of a run's log through the API server as `client`.
pub async fn get_runlog(
    client: &Client,
    namespace: &str,
    name: &str,
    query: &str,
) -> Result<RunLog, kube::Error> {
    client
        .request(get_request(&runlog_path(namespace, Some(name), query)))
        .await
}

/// `continue=TOKEN`, the token escaped for a query string.
pub fn continue_query(token: &str) -> String {
    let escaped = percent_encoding::utf8_percent_encode(token, percent_encoding::NON_ALPHANUMERIC);
    format!("continue={escaped}")
}

/// The status code and message of an API error (`None` if `result` is Ok or
/// not an API error).
pub fn refusal<T>(result: &Result<T, kube::Error>) -> Option<(u16, String)> {
    match result {
        Err(kube::Error::Api(status)) => Some((status.code, status.message.clone())),
        _ => None,
    }
}

/// A follow (or watch) stream: newline-delimited [`WatchEvent`]s.
pub struct Follow {
    lines: Pin<Box<dyn Stream<Item = std::io::Result<String>> + Send>>,
    what: String,
}

impl Follow {
    /// Opens `GET .../runlogs/NAME?QUERY` (e.g. `follow=true`) through the
    /// API server as `client`; fails as the API server answered.
    pub async fn open(
        client: &Client,
        namespace: &str,
        name: &str,
        query: &str,
    ) -> Result<Follow, kube::Error> {
        let path = runlog_path(namespace, Some(name), query);
        let body = client.request_stream(get_request(&path)).await?;
        Ok(Follow {
            lines: Box::pin(body.lines()),
            what: format!("GET {path}"),
        })
    }

    /// The next event, `None` when the stream ended; panics when none comes
    /// within `within`, or on a line that is not a watch event.
    pub async fn next(&mut self, within: Duration) -> Option<WatchEvent> {
        loop {
            let line = match tokio::time::timeout(within, self.lines.next()).await {
                Err(_) => panic!("{}: no event within {within:?}", self.what),
                Ok(None) => return None,
                Ok(Some(Err(e))) => panic!("{}: reading the stream: {e}", self.what),
                Ok(Some(Ok(line))) => line,
            };
            if line.trim().is_empty() {
                continue;
            }
            return Some(
                serde_json::from_str(&line)
                    .unwrap_or_else(|e| panic!("{}: not a watch event ({e}): {line}", self.what)),
            );
        }
    }
}

/// The [`RunLog`] of an ADDED or MODIFIED event.
pub fn event_log(event: &WatchEvent) -> RunLog {
    serde_json::from_value(event.object.clone())
        .unwrap_or_else(|e| panic!("{} event without a RunLog ({e}): {event:?}", event.kind))
}

/// What `kubectl` printed and whether it succeeded.
pub struct KubectlOutput {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `kubectl --context USER ARGS` (the kubectl on PATH, the ambient
/// KUBECONFIG) with a discovery cache of its own: a cache from before the
/// APIService existed must not hide the group.
pub fn kubectl_as(user: &str, args: &[&str]) -> KubectlOutput {
    let cache = tempfile::tempdir().expect("temp dir");
    let out = std::process::Command::new("kubectl")
        .args([
            "--context",
            user,
            "--cache-dir",
            cache.path().to_str().unwrap(),
        ])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running kubectl {args:?}: {e}; {HOW_TO_START}"));
    KubectlOutput {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The plugin's arguments for `user` on namespace `namespace`, whose
/// controller publishes its keys there (the tests' controllers run in the
/// namespace they serve).
fn plugin_command(user: &str, namespace: &str, args: &[&str]) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(super::binary("kubectl-agentrun"));
    cmd.args(args)
        .args(["-n", namespace, "--context", user])
        .args(["--controller-namespace", namespace])
        .kill_on_drop(true);
    cmd
}

/// Runs `kubectl agentrun ARGS` as `user` (its kubeconfig context) on
/// `namespace`, through the log API (no --store-url); fails the test when
/// it does not end within `within`.
pub async fn plugin_as(
    user: &str,
    namespace: &str,
    args: &[&str],
    within: Duration,
) -> KubectlOutput {
    let out = tokio::time::timeout(within, plugin_command(user, namespace, args).output())
        .await
        .unwrap_or_else(|_| {
            panic!("kubectl agentrun {args:?} as {user} did not end within {within:?}")
        })
        .unwrap_or_else(|e| panic!("running kubectl-agentrun: {e}"));
    KubectlOutput {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A record's line of `kubectl agentrun log`: seq, kind, marked `!`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginLine {
    pub seq: u64,
    pub kind: String,
    pub marked: bool,
}

/// The record lines of `kubectl agentrun log` output (`[!] SEQ KIND ...`),
/// in the order printed; verdict and note lines are not records.
pub fn plugin_records(stdout: &str) -> Vec<PluginLine> {
    stdout
        .lines()
        .filter_map(|line| {
            let (marked, rest) = match line.strip_prefix('!') {
                Some(rest) => (true, rest),
                None => (false, line),
            };
            let mut words = rest.split_whitespace();
            let seq = words.next()?.parse().ok()?;
            let kind = words.next()?;
            StepKind::ALL
                .iter()
                .any(|k| k.as_str() == kind)
                .then(|| PluginLine {
                    seq,
                    kind: kind.to_string(),
                    marked,
                })
        })
        .collect()
}

// --- requests straight to the controller's port ------------------------------------

/// A client certificate and key (PEM files) to present.
pub struct ClientIdentity<'a> {
    pub cert: &'a Path,
    pub key: &'a Path,
}

/// The front-proxy client certificate of the cluster (what the aggregator
/// presents).
pub fn front_proxy_client() -> (PathBuf, PathBuf) {
    let pki = pki_dir();
    (
        pki.join("front-proxy-client.crt"),
        pki.join("front-proxy-client.key"),
    )
}

/// A test user's client certificate (the cluster CA's, not the front proxy's).
pub fn user_cert(user: &str) -> (PathBuf, PathBuf) {
    let pki = pki_dir();
    (
        pki.join(format!("{user}.crt")),
        pki.join(format!("{user}.key")),
    )
}

/// GETs `path` from `addr:port` over TLS (the server checked against
/// `ca_pem` for `server_name`), presenting `identity` if any, with extra
/// `headers`; HTTP/1.0, so the body ends with the connection. Returns the
/// status code and body, or `Err` when the TLS connection failed (a server
/// that refuses a client certificate may do so in the handshake).
pub async fn direct_get(
    addr: &str,
    port: u16,
    server_name: &str,
    ca_pem: &str,
    identity: Option<ClientIdentity<'_>>,
    headers: &[(&str, &str)],
    path: &str,
) -> Result<(u16, String), String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let config = tls_client_config(ca_pem, identity);
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect((addr, port))
        .await
        .map_err(|e| format!("connecting to {addr}:{port}: {e}"))?;
    let name = ServerName::try_from(server_name.to_string()).expect("server name");
    let mut tls = connector
        .connect(name, tcp)
        .await
        .map_err(|e| format!("TLS handshake: {e}"))?;
    let mut request =
        format!("GET {path} HTTP/1.0\r\nHost: {server_name}\r\nAccept: application/json\r\n");
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    request.push_str("\r\n");
    tls.write_all(request.as_bytes())
        .await
        .map_err(|e| format!("sending: {e}"))?;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), tls.read_to_end(&mut raw))
        .await
        .map_err(|_| format!("no full answer to GET {path} within 30 s"))?
        .map_err(|e| format!("reading: {e}"))?;
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no HTTP status line in {head:?}"))?;
    Ok((code, body.to_string()))
}

fn tls_client_config(ca_pem: &str, identity: Option<ClientIdentity<'_>>) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.expect("CA PEM")).expect("CA certificate");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots);
    match identity {
        None => builder.with_no_client_auth(),
        Some(id) => {
            let certs = CertificateDer::pem_file_iter(id.cert)
                .unwrap_or_else(|e| panic!("{}: {e}", id.cert.display()))
                .collect::<Result<Vec<_>, _>>()
                .unwrap_or_else(|e| panic!("{}: {e}", id.cert.display()));
            let key = PrivateKeyDer::from_pem_file(id.key)
                .unwrap_or_else(|e| panic!("{}: {e}", id.key.display()));
            builder
                .with_client_auth_cert(certs, key)
                .expect("client certificate")
        }
    }
}

// --- the store, as its owner and as its superuser ---------------------------------------

/// Every record of run `uid` as the e2e store holds it.
pub async fn stored_records(uid: &str) -> Vec<Record> {
    let store = agentrun::store::open(&super::store::e2e_store_url().await)
        .await
        .expect("opening the e2e store");
    store
        .read_all(uid)
        .await
        .unwrap_or_else(|e| panic!("reading run {uid} from the store: {e}"))
}

/// Appends `n` Observation records to run `uid`'s log in the store
/// directly (under a store lease of its own): a long log without a long
/// run.
pub async fn append_observations(uid: &str, n: u64) {
    append_observations_of(uid, n, 0).await
}

/// [`append_observations`], each text padded to `bytes` bytes.
pub async fn append_observations_of(uid: &str, n: u64, bytes: usize) {
    let text = |i| Observation {
        text: format!("o{i}{}", "x".repeat(bytes)),
        about_seq: None,
        stop: None,
        attempts: None,
    };
    append_as_step_pod(uid, (0..n).map(|i| Entry::Observation(text(i)))).await
}

/// Appends `n` steps of the largest records a run may have: a model call
/// (the window starts there) and a tool's answer of `bytes`, as a step pod
/// would.
pub async fn append_large_steps(uid: &str, n: u64, bytes: usize) {
    use agentrun::runlog::records::ModelCall;
    use agentrun::runlog::v1::{ModelResponse, TokenUsage};
    let steps = (0..n).flat_map(|i| {
        let call = Entry::ModelCall(ModelCall {
            request: None,
            response: ModelResponse {
                text: Some(format!("step {i}")),
                tool_calls: vec![],
                usage: TokenUsage::default(),
                model_id: "m".into(),
                stop_reason: None,
            },
            cost_usd: 0.0,
            context: Default::default(),
            attempts: None,
        });
        let answer = Entry::Observation(Observation {
            text: format!("{i}{}", "x".repeat(bytes)),
            about_seq: None,
            stop: None,
            attempts: None,
        });
        [call, answer]
    });
    append_as_step_pod(uid, steps).await
}

/// Appends `steps` to run `uid` in the e2e store, under a lease, as a step
/// pod would.
async fn append_as_step_pod(uid: &str, steps: impl Iterator<Item = Entry>) {
    let store: Arc<dyn StepStore> = agentrun::store::open(&super::store::e2e_store_url().await)
        .await
        .expect("opening the e2e store");
    let lease = store
        .acquire(uid, "e2e-log-api", Duration::from_secs(600))
        .await
        .expect("a store lease");
    let mut head: Head = store.head(uid).await.expect("head");
    for step in steps {
        let record = RecordDraft::new(step.store_kind(), step.payload())
            .seal(&head)
            .expect("sealing");
        head = store
            .append(uid, lease.epoch, &record)
            .await
            .unwrap_or_else(|e| panic!("appending to {uid}: {e}"))
            .head();
    }
    store.release(&lease).await.expect("releasing the lease");
}

/// Replaces `from` by `to` in the stored body of record `seq` of run `uid`,
/// as the database superuser with the append-only trigger off (what no role
/// of the project can do); returns the rows touched.
pub async fn rewrite_record(uid: &str, seq: u64, from: &str, to: &str) -> u64 {
    let mut url = url::Url::parse(super::store::pg_admin_url()).unwrap();
    url.set_path("/agentrun_e2e");
    let mut conn = sqlx::PgConnection::connect(url.as_str())
        .await
        .expect("connecting as the superuser");
    sqlx::raw_sql("SET session_replication_role = replica")
        .execute(&mut conn)
        .await
        .expect("turning the triggers off");
    let done = sqlx::query(
        "UPDATE agentrun_steps SET body = replace(body, $3, $4) WHERE run = $1 AND seq = $2",
    )
    .bind(uid)
    .bind(i64::try_from(seq).unwrap())
    .bind(from)
    .bind(to)
    .execute(&mut conn)
    .await
    .unwrap_or_else(|e| panic!("rewriting record {seq} of {uid}: {e}"));
    sqlx::raw_sql("SET session_replication_role = DEFAULT")
        .execute(&mut conn)
        .await
        .expect("turning the triggers on");
    done.rows_affected()
}

/// The uid of a Kubernetes object (it has one once created).
pub fn uid_of<K: kube::Resource>(object: &K) -> String {
    object.meta().uid.clone().expect("uid")
}
