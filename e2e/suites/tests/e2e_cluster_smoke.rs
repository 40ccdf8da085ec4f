//! Smoke tests of the cluster the e2e tests run on: Jobs run real commands
//! and report their exit codes, deletion kills processes, CEL validation and
//! RBAC are enforced, and pods get Kubernetes credentials only when they ask.
//! They run on the local control plane (pods are processes of the process
//! node) and on any cluster named by KUBECONFIG (kind: busybox containers),
//! so commands stick to `sh`, `echo`, `sleep` and `exit`.

mod common;

use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::ApiResource;
use serde_json::json;

const IMAGE: &str = "busybox:1.36";
const JOB_TIMEOUT: Duration = Duration::from_secs(180);

fn from_json<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> T {
    serde_json::from_value(value).expect("valid object")
}

/// A one-pod Job running `sh -c script`, never retried.
fn job(name: &str, script: &str) -> Job {
    from_json(json!({
        "metadata": { "name": name },
        "spec": {
            "backoffLimit": 0,
            "template": { "spec": {
                "restartPolicy": "Never",
                // busybox `sh` as PID 1 ignores SIGTERM on a real kubelet.
                "terminationGracePeriodSeconds": 2,
                "containers": [{ "name": "main", "image": IMAGE, "command": ["sh", "-c", script] }],
            }},
        },
    }))
}

fn job_condition(job: &Job, type_: &str) -> bool {
    job.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == type_ && c.status == "True"))
}

/// Waits until the Job is Complete or Failed and returns it.
async fn finished_job(jobs: &Api<Job>, name: &str) -> Job {
    common::wait_for(&format!("Job {name} to finish"), JOB_TIMEOUT, || async {
        let job = jobs.get(name).await.map_err(|e| e.to_string())?;
        if job_condition(&job, "Complete") || job_condition(&job, "Failed") {
            Ok(job)
        } else {
            Err(format!("status {:?}", job.status))
        }
    })
    .await
}

async fn job_pods(pods: &Api<Pod>, job: &str) -> Vec<Pod> {
    pods.list(&ListParams::default().labels(&format!("job-name={job}")))
        .await
        .expect("listing the job's pods")
        .items
}

fn terminated_exit_code(pod: &Pod) -> Option<i32> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .first()?
        .state
        .as_ref()?
        .terminated
        .as_ref()
        .map(|t| t.exit_code)
}

fn phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("")
}

#[tokio::test]
async fn job_runs_a_real_command_to_completion() {
    let client = common::admin().await;
    let ns = common::test_namespace(&client, "job-ok").await;
    let jobs: Api<Job> = Api::namespaced(client.clone(), ns.name());
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns.name());

    jobs.create(
        &PostParams::default(),
        &job("answer", "echo answer=$((6*7))"),
    )
    .await
    .expect("creating the job");
    let done = finished_job(&jobs, "answer").await;
    assert!(
        job_condition(&done, "Complete"),
        "the job did not complete: {:?}",
        done.status
    );
    let pod = job_pods(&pods, "answer")
        .await
        .into_iter()
        .find(|p| phase(p) == "Succeeded")
        .expect("a Succeeded pod");
    assert_eq!(terminated_exit_code(&pod), Some(0));

    // On the local cluster the process node keeps every container's output.
    match common::node_state_dir() {
        Some(dir) => {
            let pod_name = pod.metadata.name.clone().unwrap_or_default();
            let log = dir.join(format!("logs/{}_{pod_name}_main.log", ns.name()));
            let output = std::fs::read_to_string(&log)
                .unwrap_or_else(|e| panic!("reading {}: {e}", log.display()));
            assert!(
                output.contains("answer=42"),
                "{} lacks the computed output:\n{output}",
                log.display()
            );
        }
        None => println!("log check skipped: no AGENTRUN_NODE_STATE_DIR (not the local cluster)"),
    }
}

#[tokio::test]
async fn failing_command_fails_the_job_with_its_exit_code() {
    let client = common::admin().await;
    let ns = common::test_namespace(&client, "job-fail").await;
    let jobs: Api<Job> = Api::namespaced(client.clone(), ns.name());
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns.name());

    jobs.create(
        &PostParams::default(),
        &job("fails", "echo failing; exit 3"),
    )
    .await
    .expect("creating the job");
    let done = finished_job(&jobs, "fails").await;
    assert!(
        job_condition(&done, "Failed"),
        "the job should have failed: {:?}",
        done.status
    );
    let listed = job_pods(&pods, "fails").await;
    let pod = listed
        .iter()
        .find(|p| phase(p) == "Failed")
        .unwrap_or_else(|| panic!("no Failed pod among {listed:#?}"));
    assert_eq!(
        terminated_exit_code(pod),
        Some(3),
        "container status: {:#?}",
        pod.status
    );
}

/// Whether any live (not zombie) process is in process group `pgid` (the
/// process node starts every container as the leader of its own group).
fn process_group_alive(pgid: u32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries.flatten().any(|e| {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            return false;
        };
        // Fields after the parenthesised command: state ppid pgrp ...
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map_or("", |(_, rest)| rest)
            .split_whitespace()
            .collect();
        fields.first() != Some(&"Z") && fields.get(2) == Some(&pgid.to_string().as_str())
    })
}

#[tokio::test]
async fn deleting_a_job_deletes_its_pods_and_kills_the_process() {
    let client = common::admin().await;
    let ns = common::test_namespace(&client, "job-del").await;
    let jobs: Api<Job> = Api::namespaced(client.clone(), ns.name());
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns.name());

    jobs.create(
        &PostParams::default(),
        &job("sleeper", "echo started; sleep 600"),
    )
    .await
    .expect("creating the job");
    let container_id = common::wait_for("the sleeper pod to run", JOB_TIMEOUT, || async {
        let listed = job_pods(&pods, "sleeper").await;
        let running = listed.iter().find_map(|p| {
            let cs = p.status.as_ref()?.container_statuses.as_ref()?.first()?;
            cs.state.as_ref()?.running.as_ref()?;
            cs.container_id.clone()
        });
        running.ok_or_else(|| {
            format!(
                "pods: {:?}",
                listed.iter().map(|p| &p.status).collect::<Vec<_>>()
            )
        })
    })
    .await;
    let pid = container_id
        .strip_prefix("process://")
        .and_then(|p| p.parse::<u32>().ok());
    if let Some(pid) = pid {
        assert!(process_group_alive(pid), "process {pid} should be running");
    }

    jobs.delete("sleeper", &DeleteParams::foreground())
        .await
        .expect("deleting the job");
    common::wait_for(
        "the job and its pods to be gone",
        Duration::from_secs(90),
        || async {
            let left = job_pods(&pods, "sleeper").await;
            let job = jobs.get_opt("sleeper").await.map_err(|e| e.to_string())?;
            if left.is_empty() && job.is_none() {
                Ok(())
            } else {
                Err(format!(
                    "job present: {}, pods left: {}",
                    job.is_some(),
                    left.len()
                ))
            }
        },
    )
    .await;

    match pid {
        // SIGKILL is delivered asynchronously: give the kernel a moment.
        Some(pid) => {
            common::wait_for(
                &format!("process group {pid} to die with its pod"),
                Duration::from_secs(10),
                || async { (!process_group_alive(pid)).then_some(()) },
            )
            .await
        }
        None => println!("process check skipped: container {container_id} is not a local process"),
    }
}

#[tokio::test]
async fn cel_rule_of_a_crd_refuses_invalid_objects_with_its_message() {
    let client = common::admin().await;
    let ns = common::test_namespace(&client, "cel").await;
    let group = format!("{}.e2e.agentrun.dev", ns.name());
    let crd_name = format!("ranges.{group}");
    let crd: CustomResourceDefinition = from_json(json!({
        "metadata": { "name": crd_name },
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": { "plural": "ranges", "singular": "range", "kind": "Range", "listKind": "RangeList" },
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "schema": { "openAPIV3Schema": {
                    "type": "object",
                    "properties": { "spec": {
                        "type": "object",
                        "required": ["min", "max"],
                        "properties": {
                            "min": { "type": "integer" },
                            "max": { "type": "integer" },
                        },
                        "x-kubernetes-validations": [{
                            "rule": "self.min <= self.max",
                            "message": "spec.min must not exceed spec.max",
                        }],
                    }},
                }},
            }],
        },
    }));
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    crds.create(&PostParams::default(), &crd)
        .await
        .expect("creating the CRD");
    let _cleanup = common::DeleteOnDrop {
        resource: ApiResource::erase::<CustomResourceDefinition>(&()),
        name: crd_name.clone(),
    };
    common::wait_established(&client, &crd_name).await;

    let resource =
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(&group, "v1", "Range"), "ranges");
    let ranges: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns.name(), &resource);
    let range = |name: &str, min: i64, max: i64| -> DynamicObject {
        from_json(json!({
            "apiVersion": format!("{group}/v1"), "kind": "Range",
            "metadata": { "name": name },
            "spec": { "min": min, "max": max },
        }))
    };

    // Established can precede the first successful create by a moment.
    let refused = common::wait_for(
        "the API server to judge an invalid Range",
        Duration::from_secs(30),
        || async {
            match ranges
                .create(&PostParams::default(), &range("inverted", 5, 1))
                .await
            {
                Err(kube::Error::Api(e)) if e.code == 404 => Err(format!("not served yet: {e}")),
                other => Ok(other),
            }
        },
    )
    .await;
    match refused {
        Err(kube::Error::Api(e)) => {
            assert_eq!(e.code, 422, "{e:?}");
            assert!(
                e.message.contains("spec.min must not exceed spec.max"),
                "the refusal should carry the rule's message: {}",
                e.message
            );
        }
        other => panic!("an inverted range was not refused: {other:?}"),
    }
    ranges
        .create(&PostParams::default(), &range("ordered", 1, 5))
        .await
        .expect("a valid Range is accepted");
    assert!(
        ranges
            .get_opt("ordered")
            .await
            .expect("reading it back")
            .is_some()
    );
}

#[tokio::test]
async fn rbac_lets_finance_approvers_in_and_keeps_carol_out() {
    let client = common::admin().await;
    let ns = common::test_namespace(&client, "rbac").await;
    let alice: Api<ConfigMap> = Api::namespaced(common::client_as("alice").await, ns.name());
    let bob: Api<ConfigMap> = Api::namespaced(common::client_as("bob").await, ns.name());
    let carol: Api<ConfigMap> = Api::namespaced(common::client_as("carol").await, ns.name());

    // Nothing granted yet: even alice is refused.
    let before = alice.list(&ListParams::default()).await;
    assert_eq!(
        common::api_error_code(&before),
        Some(403),
        "alice before the grant: {before:?}"
    );

    let roles: Api<Role> = Api::namespaced(client.clone(), ns.name());
    roles
        .create(&PostParams::default(), &from_json(json!({
            "metadata": { "name": "configmap-reader" },
            "rules": [{ "apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"] }],
        })))
        .await
        .expect("creating the Role");
    let bindings: Api<RoleBinding> = Api::namespaced(client.clone(), ns.name());
    bindings
        .create(&PostParams::default(), &from_json(json!({
            "metadata": { "name": "finance-approvers-read" },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "configmap-reader" },
            "subjects": [{ "apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "finance-approvers" }],
        })))
        .await
        .expect("creating the RoleBinding");

    // The authorizer's cache catches up within moments.
    common::wait_for(
        "alice to be allowed to list configmaps",
        Duration::from_secs(30),
        || async { alice.list(&ListParams::default()).await },
    )
    .await;
    bob.list(&ListParams::default())
        .await
        .expect("bob, also a finance approver, is allowed");
    let refused = carol.list(&ListParams::default()).await;
    assert_eq!(
        common::api_error_code(&refused),
        Some(403),
        "carol must be refused: {refused:?}"
    );
    let refused = carol.get("kube-root-ca.crt").await;
    assert_eq!(
        common::api_error_code(&refused),
        Some(403),
        "carol must be refused: {refused:?}"
    );
}

/// Runs a one-container pod to its end and returns it.
async fn run_pod(pods: &Api<Pod>, name: &str, automount: bool, script: &str) -> Pod {
    let pod: Pod = from_json(json!({
        "metadata": { "name": name },
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": automount,
            "containers": [{ "name": "main", "image": IMAGE, "command": ["sh", "-c", script] }],
        },
    }));
    pods.create(&PostParams::default(), &pod)
        .await
        .unwrap_or_else(|e| panic!("creating pod {name}: {e}"));
    common::wait_for(&format!("pod {name} to finish"), JOB_TIMEOUT, || async {
        let pod = pods.get(name).await.map_err(|e| e.to_string())?;
        match phase(&pod) {
            "Succeeded" | "Failed" => Ok(pod),
            _ => Err(format!("status {:?}", pod.status)),
        }
    })
    .await
}

#[tokio::test]
async fn pods_get_a_kubeconfig_only_with_a_service_account_token() {
    if common::existing_cluster() {
        println!(
            "skipped: KUBECONFIG in pods is how the local process node hands out service-account \
             identity; a real kubelet mounts token files instead"
        );
        return;
    }
    let client = common::admin().await;
    let ns = common::test_namespace(&client, "identity").await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns.name());

    // Exit codes say what was missing: 10 no kubeconfig file, 11 no token in it.
    let with = run_pod(
        &pods,
        "with-token",
        true,
        r#"test -n "$KUBECONFIG" && test -f "$KUBECONFIG" || exit 10
           while IFS= read -r line; do case "$line" in *token:*) exit 0;; esac; done < "$KUBECONFIG"
           exit 11"#,
    )
    .await;
    assert_eq!(
        (phase(&with), terminated_exit_code(&with)),
        ("Succeeded", Some(0)),
        "a pod with a token mount must see a kubeconfig with a token: {:#?}",
        with.status
    );

    // No token mount: no credentials at all, not even the node's own.
    let without = run_pod(
        &pods,
        "without-token",
        false,
        r#"test -z "$KUBECONFIG" || exit 12"#,
    )
    .await;
    assert_eq!(
        (phase(&without), terminated_exit_code(&without)),
        ("Succeeded", Some(0)),
        "a pod without a token mount must see no KUBECONFIG: {:#?}",
        without.status
    );
}
