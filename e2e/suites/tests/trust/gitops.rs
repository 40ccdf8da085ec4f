//! Nothing fails for good that is still arriving (issue 39): a GitOps
//! pipeline applies a repository's files in whatever order their names sort
//! (`kubectl apply -f dir/`), so a run can reach the controller before its
//! Agent, its Secret or the AgentPolicy that lets it use that Secret. Played
//! in every order of the four files, each run seen by the controller before
//! the files after it arrive: every run waits for what is missing and
//! succeeds. A run whose allowance never comes waits, saying what for, until
//! its deadline.

use agentrun::api::{AgentRun, Phase};
use kube::api::Api;
use serde_json::{Value, json};

use super::common::{
    self, kubectl,
    world::{TIMEOUT, World, finish},
};

/// The repository's four files for order `i`: Secret, Agent, AgentPolicy, run.
fn files(w: &World, i: usize) -> [(&'static str, Value); 4] {
    let mut agent = w.agent(&format!("gitops-{i}"));
    agent["model"]["secretRef"] = json!({"name": format!("key-{i}"), "key": "apiKey"});
    [
        (
            "secret",
            json!({"apiVersion": "v1", "kind": "Secret",
                   "metadata": {"name": format!("key-{i}")},
                   "stringData": {"apiKey": "sk-e2e-not-a-real-key"}}),
        ),
        (
            "agent",
            json!({"apiVersion": "agentrun.dev/v1alpha1", "kind": "Agent",
                   "metadata": {"name": format!("agent-{i}")}, "spec": agent}),
        ),
        (
            "policy",
            json!({"apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentPolicy",
                   "metadata": {"name": format!("policy-{i}")},
                   "spec": {"allowedSecrets": [{"name": format!("key-{i}")}]}}),
        ),
        (
            "run",
            json!({"apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
                   "metadata": {"name": format!("run-{i}")},
                   "spec": {"input": "Say done.", "agentRef": {"name": format!("agent-{i}")}}}),
        ),
    ]
}

/// Every order of `n` items (Heap's algorithm would do; 4! is small).
fn orders(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![Vec::new()];
    }
    let mut all = Vec::new();
    for rest in orders(n - 1) {
        for at in 0..=rest.len() {
            let mut o = rest.clone();
            o.insert(at, n - 1);
            all.push(o);
        }
    }
    all
}

/// Waits until the controller has looked at run `name` (it has a status).
async fn seen(runs: &Api<AgentRun>, name: &str) {
    common::wait_for(
        &format!("the controller to see {name}"),
        TIMEOUT,
        || async {
            let r = runs.get(name).await.map_err(|e| e.to_string())?;
            r.status
                .map(|_| ())
                .ok_or_else(|| "no status yet".to_string())
        },
    )
    .await
}

#[tokio::test]
async fn one_apply_in_every_order_of_a_repository_ends_in_succeeded_runs() {
    let w = World::new("trust-gitops", &[]).await;
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    let dir = tempfile::tempdir().unwrap();
    let all = orders(4);
    assert_eq!(all.len(), 24);
    for (i, order) in all.iter().enumerate() {
        w.standins
            .script(&format!("gitops-{i}"), json!([finish("done")]), json!([]))
            .await;
        let files = files(&w, i);
        for &f in order {
            let (what, manifest) = &files[f];
            let path = dir.path().join(format!("{i}-{what}.json"));
            std::fs::write(&path, manifest.to_string()).unwrap();
            kubectl(&["apply", "-n", w.name(), "-f", path.to_str().unwrap()]);
            // The run is judged with only what came before it.
            if *what == "run" && order.last() != Some(&f) {
                seen(&runs, &format!("run-{i}")).await;
            }
        }
    }
    for (i, order) in all.iter().enumerate() {
        let names: Vec<_> = order.iter().map(|&f| files(&w, i)[f].0).collect();
        let run = w.wait_phase(&format!("run-{i}"), Phase::Succeeded).await;
        assert_eq!(
            run.status.unwrap().result.as_deref(),
            Some("done"),
            "order {names:?}"
        );
    }
}

/// A run whose Secret no policy lists waits, Pending, with `waitingOn` and
/// the `Allowed` condition naming the field, holding no Job; its deadline
/// still ends it.
#[tokio::test]
async fn a_run_whose_allowance_never_comes_waits_saying_why_until_its_deadline() {
    let w = World::new("trust-gitops-wait", &[]).await;
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    let mut agent = w.agent("never");
    agent["model"]["secretRef"] = json!({"name": "unlisted", "key": "apiKey"});
    w.create_run(
        "waits",
        json!({"input": "Say done.", "agent": agent, "deadline": "20s"}),
        json!({}),
    )
    .await;
    let waiting = common::wait_for("the run to wait for its policy", TIMEOUT, || async {
        let r = runs.get("waits").await.map_err(|e| e.to_string())?;
        let s = r.status.clone().ok_or("no status")?;
        let allowed = s.conditions.iter().find(|c| c.type_ == "Allowed");
        match allowed {
            Some(c) if c.status == "False" && c.reason == "WaitingForPolicy" => Ok(r),
            _ => Err(format!("{s:?}")),
        }
    })
    .await;
    let s = waiting.status.unwrap();
    assert_eq!(s.phase, Some(Phase::Pending));
    assert_eq!(
        s.waiting_on.as_deref(),
        Some("agentpolicy/allowedSecrets/unlisted")
    );
    assert!(
        s.step.is_none_or(|st| st.job.is_none()),
        "no Job while waiting"
    );
    let ended = w.wait_phase("waits", Phase::DeadlineExceeded).await;
    let log = ended.status.and_then(|s| s.log).map_or(0, |l| l.length);
    assert_eq!(log, 0, "the run never started: nothing recorded");
}
