//! End-to-end tests of the API and the controller skeleton on a real API
//! server: CRDs install, samples apply, bad manifests are refused with their
//! message, the controller writes status and events, and two replicas elect
//! one leader that fails over.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use agentrun::api::{Agent, AgentRun, Phase};
use common::controller::ControllerProcess;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::ApiResource;

fn repo() -> &'static Path {
    common::root()
}

fn yaml_files(dir: &str) -> Vec<PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(repo().join(dir))
        .unwrap_or_else(|e| panic!("reading {dir}: {e}"))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .filter(|p| p.file_name().is_some_and(|n| n != "kustomization.yaml"))
        .collect();
    files.sort();
    files
}

/// Creates one manifest in `ns` through the dynamic API, as `kubectl create` would.
async fn create_manifest(
    client: &kube::Client,
    ns: &str,
    yaml: &str,
) -> Result<DynamicObject, kube::Error> {
    let obj: DynamicObject = serde_yaml::from_str(yaml).expect("manifest parses as YAML");
    let types = obj.types.clone().expect("manifest has apiVersion and kind");
    let gvk = GroupVersionKind::try_from(&types).expect("valid apiVersion");
    let plural = match gvk.kind.as_str() {
        "Agent" => "agents",
        "AgentRun" => "agentruns",
        "Approval" => "approvals",
        "AgentPolicy" => "agentpolicies",
        other => panic!("unexpected kind {other}"),
    };
    let api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        ns,
        &ApiResource::from_gvk_with_plural(&gvk, plural),
    );
    api.create(&PostParams::default(), &obj).await
}

#[tokio::test]
async fn crds_are_established_with_printer_columns() {
    let client = common::admin().await;
    common::install_crds(&client).await;
    let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> =
        Api::all(client.clone());
    let ar = crds
        .get("agentruns.agentrun.dev")
        .await
        .expect("agentruns CRD installed");
    let cols: Vec<_> = ar.spec.versions[0]
        .additional_printer_columns
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.name)
        .collect();
    for want in ["Phase", "Step", "Waiting-On", "Age"] {
        assert!(
            cols.iter().any(|c| c == want),
            "printer column {want} missing from {cols:?}"
        );
    }
    assert_eq!(
        ar.spec.names.short_names.as_deref(),
        Some(&["ar".to_string()][..])
    );
}

#[tokio::test]
async fn every_sample_applies() {
    let client = common::admin().await;
    common::install_crds(&client).await;
    let ns = common::test_namespace(&client, "samples").await;
    let samples = yaml_files("config/samples");
    // The kustomize base lists exactly the samples.
    let kustomization =
        std::fs::read_to_string(repo().join("config/samples/kustomization.yaml")).unwrap();
    let listed: serde_yaml::Value = serde_yaml::from_str(&kustomization).unwrap();
    let mut listed: Vec<String> = listed["resources"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_string())
        .collect();
    listed.sort();
    let present: Vec<String> = samples
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        listed, present,
        "config/samples/kustomization.yaml must list every sample"
    );
    let rendered = common::kubectl(&[
        "kustomize",
        &repo().join("config/samples").to_string_lossy(),
    ]);
    assert_eq!(
        rendered.matches("\nkind: ").count() + usize::from(rendered.starts_with("kind: ")),
        present.len(),
        "{rendered}"
    );
    assert!(
        samples.len() >= 3,
        "expected at least three samples, found {samples:?}"
    );
    for path in samples {
        let yaml = std::fs::read_to_string(&path).unwrap();
        create_manifest(&client, ns.name(), &yaml)
            .await
            .unwrap_or_else(|e| panic!("{} was refused: {e}", path.display()));
    }
}

#[tokio::test]
async fn bad_manifests_are_refused_with_their_message() {
    let client = common::admin().await;
    common::install_crds(&client).await;
    let ns = common::test_namespace(&client, "bad").await;
    let files = yaml_files("e2e/bad-manifests");
    assert!(
        files.len() >= 12,
        "the corpus must hold at least 12 bad manifests, found {}",
        files.len()
    );
    let mut failures = Vec::new();
    for path in files {
        let yaml = std::fs::read_to_string(&path).unwrap();
        let expect = yaml
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("# expect: "))
            .unwrap_or_else(|| panic!("{} must start with '# expect: <message>'", path.display()));
        match create_manifest(&client, ns.name(), &yaml).await {
            Ok(_) => failures.push(format!(
                "{}: accepted, expected refusal with {expect:?}",
                path.display()
            )),
            Err(kube::Error::Api(e)) if e.code == 422 && e.message.contains(expect) => {}
            Err(e) => failures.push(format!(
                "{}: refused with {e}, expected {expect:?}",
                path.display()
            )),
        }
    }
    assert!(
        failures.is_empty(),
        "bad manifests not refused as expected:\n{}",
        failures.join("\n")
    );
}

#[tokio::test]
async fn controller_resolves_agents_writes_status_and_events() {
    let client = common::admin().await;
    common::install_crds(&client).await;
    let ns = common::test_namespace(&client, "ctrl").await;
    let controller = ControllerProcess::start(ns.name(), "solo").await;

    let runs: Api<AgentRun> = Api::namespaced(client.clone(), ns.name());
    let run_yaml =
        std::fs::read_to_string(repo().join("config/samples/agentrun-refund.yaml")).unwrap();
    create_manifest(&client, ns.name(), &run_yaml)
        .await
        .expect("sample run created");

    // No Agent yet: the run says so, names the field, and a Warning event is published.
    let run = common::wait_for(
        "AgentResolved=False on the run",
        Duration::from_secs(60),
        || async {
            let run = runs.get("refund-order-1042").await.ok()?;
            let c = run
                .status
                .as_ref()?
                .conditions
                .iter()
                .find(|c| c.type_ == "AgentResolved")?
                .clone();
            (c.status == "False").then_some(run)
        },
    )
    .await;
    let status = run.status.unwrap();
    let cond = status
        .conditions
        .iter()
        .find(|c| c.type_ == "AgentResolved")
        .unwrap();
    assert_eq!(cond.reason, "AgentNotFound");
    assert!(
        cond.message.contains("spec.agentRef.name") && cond.message.contains("refund-assistant"),
        "{}",
        cond.message
    );
    assert_eq!(status.phase, Some(Phase::Pending));
    assert_eq!(status.waiting_on.as_deref(), Some("agent/refund-assistant"));
    assert_eq!(status.observed_generation, run.metadata.generation);

    let events: Api<Event> = Api::namespaced(client.clone(), ns.name());
    common::wait_for("AgentNotFound event", Duration::from_secs(30), || async {
        let list = events.list(&ListParams::default()).await.ok()?;
        list.items.into_iter().find(|e| {
            e.reason.as_deref() == Some("AgentNotFound") && e.type_.as_deref() == Some("Warning")
        })
    })
    .await;

    // `kubectl get ar` shows the columns people look at.
    let table = common::kubectl(&["get", "ar", "-n", ns.name()]);
    let header = table.lines().next().unwrap_or_default();
    for col in ["NAME", "PHASE", "STEP", "WAITING-ON", "AGE"] {
        assert!(
            header.contains(col),
            "kubectl get ar header {header:?} lacks {col}"
        );
    }
    assert!(
        table.contains("Pending") && table.contains("agent/refund-assistant"),
        "{table}"
    );

    // Creating the Agent resolves the run without any change to the run.
    let agent_yaml =
        std::fs::read_to_string(repo().join("config/samples/agent-refund-assistant.yaml")).unwrap();
    create_manifest(&client, ns.name(), &agent_yaml)
        .await
        .expect("sample agent created");
    let run = common::wait_for("AgentResolved=True", Duration::from_secs(60), || async {
        let run = runs.get("refund-order-1042").await.ok()?;
        let ok = run
            .status
            .as_ref()?
            .conditions
            .iter()
            .any(|c| c.type_ == "AgentResolved" && c.status == "True");
        ok.then_some(run)
    })
    .await;
    assert_ne!(
        run.status.unwrap().waiting_on.as_deref(),
        Some("agent/refund-assistant")
    );

    // The controller never writes spec, and status has exactly one field manager.
    let managers: Vec<_> = run
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .filter(|m| m.subresource.as_deref() == Some("status"))
        .map(|m| m.manager.unwrap_or_default())
        .collect();
    assert_eq!(
        managers,
        vec![agentrun::controller::FIELD_MANAGER.to_string()]
    );
    let agents: Api<Agent> = Api::namespaced(client.clone(), ns.name());
    // The Agent's status says it is usable, and what a run would pin.
    let ready = |name: &'static str| {
        let agents = agents.clone();
        async move {
            let a = agents.get(name).await.map_err(|e| e.to_string())?;
            let s = a.status.clone().ok_or("no status yet")?;
            let c = s
                .conditions
                .iter()
                .find(|c| c.type_ == "Ready")
                .ok_or("no Ready condition")?;
            Ok::<_, String>((c.status.clone(), c.message.clone(), s.prompt_hash.clone()))
        }
    };
    let (status, _, hash) = common::wait_for("Agent status", Duration::from_secs(60), || {
        ready("refund-assistant")
    })
    .await;
    assert_eq!(status, "True");
    assert_eq!(hash.map(|h| h.len()), Some(64));
    // A condition the API server cannot check is named on the Agent before any run uses it.
    let mut broken: Agent = serde_yaml::from_str(&agent_yaml).unwrap();
    broken.metadata.name = Some("broken-policy".into());
    broken.spec.approval.as_mut().unwrap().rules[0].when = Some("args.amount >".into());
    agents
        .create(&PostParams::default(), &broken)
        .await
        .expect("created");
    let (status, message, _) = common::wait_for(
        "the broken Agent's status",
        Duration::from_secs(60),
        || async {
            match ready("broken-policy").await {
                Ok(r) if r.0 == "False" => Ok(r),
                Ok(r) => Err(format!("{r:?}")),
                Err(e) => Err(e),
            }
        },
    )
    .await;
    assert_eq!(status, "False");
    assert!(message.contains("spec.approval.rules[0].when"), "{message}");

    // Probes and metrics are served.
    let port = controller.metrics_port;
    assert_eq!(common::controller::http_get(port, "/healthz").await.0, 200);
    assert_eq!(common::controller::http_get(port, "/readyz").await.0, 200);
    let (code, body) = common::controller::http_get(port, "/metrics").await;
    assert_eq!(code, 200);
    let reconciles = body
        .lines()
        .find_map(|l| l.strip_prefix("agentrun_reconciliations_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no agentrun_reconciliations_total in:\n{body}"));
    assert!(
        reconciles >= 2.0,
        "expected at least two reconciliations, metrics say {reconciles}"
    );
}

#[tokio::test]
async fn two_replicas_elect_one_leader_and_fail_over() {
    let client = common::admin().await;
    common::install_crds(&client).await;
    let ns = common::test_namespace(&client, "leader").await;
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns.name());
    let holder = || async {
        leases
            .get_opt("agentrun-controller")
            .await
            .ok()
            .flatten()?
            .spec?
            .holder_identity
    };

    let mut a = ControllerProcess::start(ns.name(), "replica-a").await;
    let first = common::wait_for("a lease holder", Duration::from_secs(60), || async {
        holder().await
    })
    .await;
    assert_eq!(first, "replica-a");
    let b = ControllerProcess::start(ns.name(), "replica-b").await;
    // b stays standby while a renews: the holder does not change.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        holder().await.as_deref(),
        Some("replica-a"),
        "the standby must not take a held lease"
    );
    assert!(
        !b.log().contains("became leader"),
        "replica-b led while replica-a held the lease:\n{}",
        b.log()
    );

    // The leader stops gracefully: the standby takes over and reconciles.
    a.stop();
    common::wait_for("replica-b to lead", Duration::from_secs(60), || async {
        (holder().await.as_deref() == Some("replica-b")).then_some(())
    })
    .await;
    let runs: Api<AgentRun> = Api::namespaced(client.clone(), ns.name());
    let run_yaml =
        std::fs::read_to_string(repo().join("config/samples/agentrun-inline.yaml")).unwrap();
    create_manifest(&client, ns.name(), &run_yaml)
        .await
        .expect("run created");
    common::wait_for(
        "the new leader to reconcile",
        Duration::from_secs(60),
        || async {
            let run = runs.get("summarize-incident").await.ok()?;
            run.status?
                .conditions
                .iter()
                .any(|c| c.type_ == "AgentResolved" && c.status == "True")
                .then_some(())
        },
    )
    .await;
}
