//! Helpers shared by the e2e tests. They run against the local control plane
//! (`e2e/cluster up`, then `eval "$(e2e/cluster env)"`) or, with
//! `AGENTRUN_E2E_CLUSTER=existing`, against whatever cluster KUBECONFIG names.
//! Without a reachable cluster they panic with instructions: never skip.
#![allow(dead_code)] // each test binary uses a different subset

pub mod approvals;
pub mod chart;
pub mod container_agents;
pub mod controller;
pub mod log_api;
pub mod ports;
pub mod procs;
pub mod realnode;
pub mod scripts;
pub mod store;
pub mod world;

use std::{
    fmt::Display,
    future::Future,
    path::PathBuf,
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::{
    Client, Config, ResourceExt as _,
    api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
    discovery::ApiResource,
};
use serde::Deserialize as _;

/// The stand-ins (e2e/standins): one copy, shared with the in-process tests.
pub use agentrun_standins as standins;
/// The workspace's binaries as `e2e/build-binaries` built them (refused when
/// older than their sources).
pub use agentrun_standins::binaries::built as binary;

/// The repository's root (this crate is `e2e/suites` in it).
pub fn root() -> &'static std::path::Path {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("e2e/suites is two levels below the root")
}

const HOW_TO_START: &str = "start the local cluster with `e2e/cluster up` and then run \
     `eval \"$(e2e/cluster env)\"` (or set KUBECONFIG and AGENTRUN_E2E_CLUSTER=existing for another cluster)";

/// True when the tests run against a cluster the project did not start (kind…).
pub fn existing_cluster() -> bool {
    std::env::var("AGENTRUN_E2E_CLUSTER").is_ok_and(|v| v == "existing")
}

/// The process node's state dir (logs in `logs/`), on the local cluster only.
pub fn node_state_dir() -> Option<PathBuf> {
    if existing_cluster() {
        return None;
    }
    std::env::var_os("AGENTRUN_NODE_STATE_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

fn kubeconfig() -> Kubeconfig {
    match std::env::var("KUBECONFIG") {
        Ok(path) if !path.is_empty() => {}
        _ => panic!("KUBECONFIG is not set: {HOW_TO_START}"),
    }
    Kubeconfig::read().unwrap_or_else(|e| panic!("cannot read KUBECONFIG: {e}; {HOW_TO_START}"))
}

fn has_context(kc: &Kubeconfig, name: &str) -> bool {
    kc.contexts.iter().any(|c| c.name == name)
}

async fn config_for(kc: Kubeconfig, context: Option<&str>) -> Config {
    let options = KubeConfigOptions {
        context: context.map(str::to_string),
        ..KubeConfigOptions::default()
    };
    Config::from_custom_kubeconfig(kc, &options)
        .await
        .unwrap_or_else(|e| {
            panic!("kubeconfig context {context:?} is unusable: {e}; {HOW_TO_START}")
        })
}

async fn connect(config: Config, who: &str) -> Client {
    let url = config.cluster_url.clone();
    let client =
        Client::try_from(config).unwrap_or_else(|e| panic!("building a client for {who}: {e}"));
    match tokio::time::timeout(Duration::from_secs(15), client.apiserver_version()).await {
        Ok(Ok(_)) => client,
        Ok(Err(e)) => panic!("the API server at {url} does not answer ({e}): {HOW_TO_START}"),
        Err(_) => panic!("the API server at {url} did not answer within 15 s: {HOW_TO_START}"),
    }
}

/// A cluster-admin client: context `admin` if the kubeconfig has one, else
/// the current context.
pub async fn admin() -> Client {
    let kc = kubeconfig();
    let context = has_context(&kc, "admin").then_some("admin");
    connect(config_for(kc, context).await, "admin").await
}

/// A client acting as `user` (alice, bob: group finance-approvers; carol: no
/// group). The local cluster has a client-certificate context per user; on an
/// existing cluster the admin impersonates them.
pub async fn client_as(user: &str) -> Client {
    let kc = kubeconfig();
    if has_context(&kc, user) {
        return connect(config_for(kc, Some(user)).await, user).await;
    }
    if !existing_cluster() {
        panic!(
            "the kubeconfig has no context {user:?}: the local cluster's kubeconfig has one per test user; {HOW_TO_START}"
        );
    }
    let groups = match user {
        "alice" | "bob" => vec!["finance-approvers".to_string()],
        _ => vec![],
    };
    client_impersonating(user, groups).await
}

/// A client acting as `user` in `groups` through the admin's impersonation:
/// any name, a ServiceAccount's (`system:serviceaccount:NS:NAME`) too.
pub async fn client_impersonating(user: &str, groups: Vec<String>) -> Client {
    let kc = kubeconfig();
    let context = has_context(&kc, "admin").then_some("admin");
    let mut config = config_for(kc, context).await;
    config.auth_info.impersonate = Some(user.to_string());
    config.auth_info.impersonate_groups = (!groups.is_empty()).then_some(groups);
    connect(config, user).await
}

/// What a `wait_for` probe returns: `Some`/`Ok` when done; `None`/`Err`
/// (with what it saw) to keep waiting.
pub trait Observation {
    type Value;
    fn into_result(self) -> Result<Self::Value, String>;
}

impl<T> Observation for Option<T> {
    type Value = T;
    fn into_result(self) -> Result<T, String> {
        self.ok_or_else(|| "not yet (the probe returned None)".to_string())
    }
}

impl<T, E: Display> Observation for Result<T, E> {
    type Value = T;
    fn into_result(self) -> Result<T, String> {
        self.map_err(|e| e.to_string())
    }
}

/// Polls `probe` every 500 ms until it succeeds; panics after `timeout`
/// with `what` and the last thing the probe reported.
pub async fn wait_for<F, Fut, O>(what: &str, timeout: Duration, mut probe: F) -> O::Value
where
    F: FnMut() -> Fut,
    Fut: Future<Output = O>,
    O: Observation,
{
    let start = Instant::now();
    loop {
        let last = match probe().await.into_result() {
            Ok(value) => return value,
            Err(seen) => seen,
        };
        if start.elapsed() >= timeout {
            panic!("timed out after {timeout:?} waiting for {what}; last saw: {last}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A namespace of its own for one test; deleted (best effort) when dropped.
/// Set AGENTRUN_E2E_KEEP_NAMESPACES=1 to keep them for debugging.
pub struct TestNamespace {
    name: String,
}

impl TestNamespace {
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        if std::env::var_os("AGENTRUN_E2E_KEEP_NAMESPACES").is_some() {
            eprintln!("keeping namespace {}", self.name);
            return;
        }
        let name = self.name.clone();
        // The test's runtime may be single-threaded and is blocked in this
        // drop: delete from a fresh runtime on another thread.
        run_detached(async move {
            let api: Api<Namespace> = Api::all(admin().await);
            let _ = api.delete(&name, &DeleteParams::background()).await;
        });
    }
}

/// Runs a cleanup future to completion on its own thread and runtime.
fn run_detached(cleanup: impl Future<Output = ()> + Send + 'static) {
    let thread = std::thread::spawn(move || {
        if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            rt.block_on(async {
                let _ = tokio::time::timeout(Duration::from_secs(20), cleanup).await;
            });
        }
    });
    let _ = thread.join();
}

fn unique_suffix() -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let n = u64::from(nanos)
        ^ (u64::from(std::process::id()) << 32)
        ^ u64::from(COUNTER.fetch_add(1, Ordering::Relaxed)).wrapping_mul(0x9e37_79b9);
    let alphabet = b"0123456789abcdefghijklmnopqrstuvwxyz";
    (0..6)
        .map(|i| char::from(alphabet[((n >> (i * 6)) % 36) as usize]))
        .collect()
}

/// A unique name: `prefix-xxxxxx`, lowercase, at most 63 characters.
pub fn unique_name(prefix: &str) -> String {
    let prefix: String = prefix
        .to_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .take(40)
        .collect();
    format!("{}-{}", prefix.trim_matches('-'), unique_suffix())
}

/// Creates `e2e-<prefix>-<random>` and waits for its default ServiceAccount
/// (pods are refused until the ServiceAccount controller has created it).
pub async fn test_namespace(client: &Client, prefix: &str) -> TestNamespace {
    let name = unique_name(&format!("e2e-{prefix}"));
    let ns: Namespace = serde_json::from_value(serde_json::json!({
        "metadata": { "name": name, "labels": { "agentrun.dev/e2e": "true" } },
    }))
    .expect("namespace object");
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap_or_else(|e| panic!("creating namespace {name}: {e}"));
    let guard = TestNamespace { name };
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), guard.name());
    wait_for(
        &format!("the default ServiceAccount in {}", guard.name()),
        Duration::from_secs(60),
        || async {
            match sas.get_opt("default").await {
                Ok(Some(sa)) => Ok(sa),
                Ok(None) => Err("not created yet".to_string()),
                Err(e) => Err(e.to_string()),
            }
        },
    )
    .await;
    guard
}

/// Deletes a cluster-scoped object when dropped (CRDs, ClusterRoles…).
pub struct DeleteOnDrop {
    pub resource: ApiResource,
    pub name: String,
}

impl Drop for DeleteOnDrop {
    fn drop(&mut self) {
        let (resource, name) = (self.resource.clone(), self.name.clone());
        run_detached(async move {
            let api: Api<DynamicObject> = Api::all_with(admin().await, &resource);
            let _ = api.delete(&name, &DeleteParams::background()).await;
        });
    }
}

/// Waits until a CRD is Established (its API is served).
pub async fn wait_established(client: &Client, crd_name: &str) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    wait_for(
        &format!("CRD {crd_name} Established"),
        Duration::from_secs(60),
        || async {
            let crd = crds.get(crd_name).await.map_err(|e| e.to_string())?;
            let conditions = crd.status.and_then(|s| s.conditions).unwrap_or_default();
            match conditions.iter().find(|c| c.type_ == "Established") {
                Some(c) if c.status == "True" => Ok(()),
                other => Err(format!("Established condition: {other:?}")),
            }
        },
    )
    .await;
}

/// Installs (server-side applies) the project's CRDs from `crds/crds.yaml`
/// and waits until they are served. Safe to call from tests in parallel.
pub async fn install_crds(client: &Client) {
    apply_crds(client, &root().join("crds/crds.yaml").to_string_lossy()).await;
    apply_admission_policies(client).await;
}

/// Server-side applies the CRDs in the file at `path` (another release's,
/// for the upgrade test) and waits until they are established.
pub async fn apply_crds(client: &Client, path: &str) {
    let yaml = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let params = PatchParams::apply("agentrun-e2e").force();
    let mut names = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&yaml) {
        let value = serde_yaml::Value::deserialize(doc).unwrap_or_else(|e| panic!("{path}: {e}"));
        if value.is_null() {
            continue;
        }
        let crd: CustomResourceDefinition =
            serde_yaml::from_value(value).unwrap_or_else(|e| panic!("{path}: not a CRD: {e}"));
        let name = crd
            .metadata
            .name
            .clone()
            .unwrap_or_else(|| panic!("{path}: CRD without a name"));
        crds.patch(&name, &params, &Patch::Apply(&crd))
            .await
            .unwrap_or_else(|e| panic!("applying CRD {name}: {e}"));
        names.push(name);
    }
    for name in names {
        wait_established(client, &name).await;
    }
}

/// Applies `crds/admission.yaml` (the ValidatingAdmissionPolicies that guard
/// approvals and run requesters, and the approver ClusterRole) and, where the
/// API server serves MutatingAdmissionPolicy, `config/requester-stamp/`;
/// returns once a run created without a requester would get one stamped.
pub async fn apply_admission_policies(client: &Client) {
    apply_manifests(
        client,
        &root().join("crds/admission.yaml").to_string_lossy(),
    )
    .await;
    apply_requester_stamp(client).await;
}

/// Where the API server serves MutatingAdmissionPolicy, applies
/// `config/requester-stamp/` and returns once a run created without a
/// requester would get one stamped.
pub async fn apply_requester_stamp(client: &Client) {
    if serves_mutating_policies(client).await {
        let policy = root().join("config/requester-stamp/mutating-policy.yaml");
        apply_manifests(client, &policy.to_string_lossy()).await;
        wait_requester_stamped(client).await;
    }
}

/// Does the API server serve admissionregistration.k8s.io/v1beta1 MutatingAdmissionPolicy?
pub async fn serves_mutating_policies(client: &Client) -> bool {
    client
        .list_api_group_resources("admissionregistration.k8s.io/v1beta1")
        .await
        .is_ok_and(|l| {
            l.resources
                .iter()
                .any(|r| r.name == "mutatingadmissionpolicies")
        })
}

/// Policies take effect a moment after they are created: dry-run a run
/// without a requester until the API server stamps one.
async fn wait_requester_stamped(client: &Client) {
    let runs: Api<agentrun::api::AgentRun> = Api::namespaced(client.clone(), "default");
    let probe: agentrun::api::AgentRun = serde_json::from_value(serde_json::json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "requester-stamp-probe"},
        "spec": {"input": "probe", "agentRef": {"name": "probe"}}
    }))
    .expect("probe run");
    let params = PostParams {
        dry_run: true,
        ..Default::default()
    };
    wait_for(
        "the requester stamp to take effect",
        Duration::from_secs(30),
        || async {
            runs.create(&params, &probe).await.ok().filter(|r| {
                let a = r.annotations();
                a.contains_key("agentrun.dev/requester")
                    && a.contains_key("agentrun.dev/requester-groups")
            })
        },
    )
    .await;
}

/// Server-side applies every object of a YAML file (cluster-scoped kinds).
pub async fn apply_manifests(client: &Client, path: &str) {
    let yaml = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    for doc in serde_yaml::Deserializer::from_str(&yaml) {
        let value = serde_yaml::Value::deserialize(doc).unwrap_or_else(|e| panic!("{path}: {e}"));
        if value.is_null() {
            continue;
        }
        let obj: DynamicObject =
            serde_yaml::from_value(value).unwrap_or_else(|e| panic!("{path}: {e}"));
        let types = obj.types.clone().expect("apiVersion and kind");
        let gvk = kube::core::GroupVersionKind::try_from(&types).expect("apiVersion");
        let lower = gvk.kind.to_lowercase();
        let plural = match lower.strip_suffix('y') {
            Some(stem) => format!("{stem}ies"),
            None => format!("{lower}s"),
        };
        let api: Api<DynamicObject> = Api::all_with(
            client.clone(),
            &ApiResource::from_gvk_with_plural(&gvk, &plural),
        );
        let name = obj.metadata.name.clone().expect("name");
        api.patch(
            &name,
            &PatchParams::apply("agentrun-e2e").force(),
            &Patch::Apply(&obj),
        )
        .await
        .unwrap_or_else(|e| panic!("applying {} {name}: {e}", gvk.kind));
    }
}

/// Lets runs in `namespace` hand these Secrets to their step pods (an
/// AgentPolicy, as a platform owner would write it).
pub async fn allow_secrets(client: &Client, namespace: &str, secrets: &[&str]) {
    let api: Api<agentrun::api::AgentPolicy> = Api::namespaced(client.clone(), namespace);
    let policy: agentrun::api::AgentPolicy = serde_json::from_value(serde_json::json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentPolicy",
        "metadata": {"name": "e2e-secrets"},
        "spec": {"allowedSecrets": secrets.iter().map(|s| serde_json::json!({"name": s})).collect::<Vec<_>>()}
    }))
    .expect("policy");
    api.patch(
        "e2e-secrets",
        &PatchParams::apply("agentrun-e2e").force(),
        &Patch::Apply(&policy),
    )
    .await
    .unwrap_or_else(|e| panic!("applying AgentPolicy e2e-secrets in {namespace}: {e}"));
}

/// Runs kubectl (first on PATH, ambient KUBECONFIG); panics with its stderr
/// if it fails, returns its stdout.
pub fn kubectl(args: &[&str]) -> String {
    let out = std::process::Command::new("kubectl")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running kubectl {args:?}: {e}; {HOW_TO_START}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        panic!(
            "kubectl {args:?} failed ({}):\n{}{stdout}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    stdout
}

/// The status of an API error, if `result` is one (403, 404, 422…).
pub fn api_error_code<T>(result: &Result<T, kube::Error>) -> Option<u16> {
    match result {
        Err(kube::Error::Api(e)) => Some(e.code),
        _ => None,
    }
}

/// As the chart does in the controller's namespace: every authenticated user
/// may read the ConfigMap of the controller's public keys (public, and what
/// `kubectl agentrun verify` checks signatures with).
pub async fn publish_keys_to_everyone(client: &Client, namespace: &str) {
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    let role: Role = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "agentrun-controller-keys-reader"},
        "rules": [{"apiGroups": [""], "resources": ["configmaps"],
                   "resourceNames": [agentrun::keys::published::CONFIGMAP], "verbs": ["get"]}]
    }))
    .expect("role");
    let binding: RoleBinding = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "agentrun-controller-keys-reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "agentrun-controller-keys-reader"},
        "subjects": [{"kind": "Group", "name": "system:authenticated", "apiGroup": "rbac.authorization.k8s.io"}]
    }))
    .expect("binding");
    let pp = PatchParams::apply("agentrun-e2e").force();
    Api::<Role>::namespaced(client.clone(), namespace)
        .patch("agentrun-controller-keys-reader", &pp, &Patch::Apply(&role))
        .await
        .expect("keys reader Role");
    Api::<RoleBinding>::namespaced(client.clone(), namespace)
        .patch(
            "agentrun-controller-keys-reader",
            &pp,
            &Patch::Apply(&binding),
        )
        .await
        .expect("keys reader RoleBinding");
}

/// A benchmark binary's `main` (it has no test harness): `cargo test
/// <filter>` passes its filter here, honoured as libtest would in check
/// mode; `body` runs on a multi-threaded runtime with the TLS provider set.
pub fn bench_main<F: Future<Output = ()>>(name: &str, check: bool, body: F) {
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    if check && !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
        println!("{name}: filtered out by {filters:?}");
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let _ = rustls::crypto::ring::default_provider().install_default();
        body.await
    });
}
