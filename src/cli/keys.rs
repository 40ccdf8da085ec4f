//! `kubectl agentrun rotate-key`: the controller's step-token key (its
//! signing key derives from it) is replaced, and the keys it replaced are
//! retired, each with the time it was retired (the API server's clock, the
//! one that stamps runs' `creationTimestamp`): a retired key's token opens
//! only runs created by then, its signatures count only where each run's
//! status says it was still in charge. With `--prune`, a retired key no
//! step Job holds a token of is cut down to its public signing key: its
//! tokens open nothing, what it signed still verifies.

use std::collections::BTreeMap;
use std::io::Write;

use anyhow::Context as _;
use jiff::Timestamp;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ListParams, PostParams};

use crate::api::AgentRun;
use crate::keys::step_token::{KeyError, RetiredKey, TokenKey, parse_retired, retired_text};

type SecretData = BTreeMap<String, ByteString>;

/// Rotates the key in Secret `namespace/name`.
pub async fn rotate(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let mut secret = read(&api, namespace, name).await?;
    let now = server_time(client).await;
    let fresh = hex::encode(random_key()?);
    let (rotated, ids) = rotated_key_data(&secret.data.clone().unwrap_or_default(), &fresh, now)
        .map_err(|e| anyhow::anyhow!("Secret {namespace}/{name}: {e}"))?;
    secret.data = Some(rotated);
    write(&api, namespace, name, &secret).await?;
    writeln!(
        out,
        "rotated: key {} is current, {} retired at {now}: its tokens open only runs created by \
         then, its signatures count only where each run's status says it still signed\n\
         restart the controller to use it, e.g. kubectl -n {namespace} rollout restart deployment \
         -l app.kubernetes.io/part-of=agentrun; once the runs listed by \
         `kubectl agentrun rotate-key --prune` have finished their steps, prune it",
        ids.0, ids.1
    )?;
    Ok(())
}

/// Prunes the retired keys of Secret `namespace/name` that no step Job
/// holds a token of; fails naming the runs that hold the others.
pub async fn prune(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let mut secret = read(&api, namespace, name).await?;
    let runs: Api<AgentRun> = Api::all(client.clone());
    let runs = runs.list(&ListParams::default()).await.context(
        "listing AgentRuns in every namespace (a retired key is pruned only once no run's \
         step Job holds a token of it)",
    )?;
    let data = secret.data.clone().unwrap_or_default();
    let plan = prune_plan(&data, &runs.items)
        .map_err(|e| anyhow::anyhow!("Secret {namespace}/{name}: {e}"))?;
    if !plan.pruned.is_empty() {
        secret.data = Some(plan.data.clone());
        write(&api, namespace, name, &secret).await?;
    }
    for id in &plan.pruned {
        writeln!(
            out,
            "pruned key {id}: its tokens open nothing; its public signing key stays, so what it \
             signed still verifies"
        )?;
    }
    for (id, holders) in &plan.kept {
        writeln!(out, "kept key {id}: step Jobs still hold a token of it:")?;
        for h in holders {
            writeln!(out, "  {h}")?;
        }
    }
    if plan.pruned.is_empty() && plan.kept.is_empty() {
        writeln!(out, "no retired key to prune")?;
    } else if !plan.pruned.is_empty() {
        writeln!(
            out,
            "restart the controller for its gateway to refuse the pruned keys' tokens, e.g. \
             kubectl -n {namespace} rollout restart deployment -l app.kubernetes.io/part-of=agentrun"
        )?;
    }
    if !plan.kept.is_empty() {
        anyhow::bail!(
            "{} retired key(s) kept: the runs listed hold their tokens; prune again once their \
             step Jobs have ended (a run's next Job gets a token of the current key)",
            plan.kept.len()
        );
    }
    Ok(())
}

async fn read(api: &Api<Secret>, namespace: &str, name: &str) -> anyhow::Result<Secret> {
    api.get(name)
        .await
        .with_context(|| format!("reading Secret {namespace}/{name}"))
}

/// A replace with the read resourceVersion: a rotation or prune that raced
/// another one fails instead of losing a key.
async fn write(
    api: &Api<Secret>,
    namespace: &str,
    name: &str,
    secret: &Secret,
) -> anyhow::Result<()> {
    api.replace(name, &PostParams::default(), secret)
        .await
        .with_context(|| format!("writing Secret {namespace}/{name}"))?;
    Ok(())
}

/// The API server's clock (its `Date` header): the runs' creation times a
/// retirement is compared with are its own. This machine's clock when the
/// server does not say.
async fn server_time(client: &kube::Client) -> Timestamp {
    let asked = async {
        let req = axum::http::Request::get("/version").body(Vec::<u8>::new().into())?;
        let res = client.send(req).await?;
        let date = res
            .headers()
            .get(axum::http::header::DATE)
            .and_then(|d| d.to_str().ok())
            .ok_or_else(|| anyhow::anyhow!("no Date header"))?;
        Ok::<_, anyhow::Error>(jiff::fmt::rfc2822::DateTimeParser::new().parse_timestamp(date)?)
    };
    match asked.await {
        Ok(t) => t,
        Err(e) => {
            eprintln!("note: the API server's time is not known ({e:#}); using this machine's");
            Timestamp::from_second(Timestamp::now().as_second())
                .unwrap_or_else(|_| Timestamp::now())
        }
    }
}

fn random_key() -> anyhow::Result<[u8; 32]> {
    use ring::rand::SecureRandom;
    let mut key = [0u8; 32];
    ring::rand::SystemRandom::new()
        .fill(&mut key)
        .map_err(|_| anyhow::anyhow!("no system randomness for a new key"))?;
    Ok(key)
}

/// Why the key Secret's data cannot be rotated or pruned. Each message
/// quotes its cause, so the cause is a plain field, not a `#[source]`
/// (the chain would print it twice).
#[derive(Debug, thiserror::Error)]
pub enum KeyDataError {
    #[error("no `key` entry to rotate")]
    NoKey,
    #[error("`key`: {0}")]
    Key(KeyError),
    #[error("{0}")]
    Fresh(KeyError),
    #[error("`retired`: {0}")]
    Retired(KeyError),
}

/// The Secret `data` after a rotation to `fresh` at `now`: `key` = `fresh`,
/// `retired` = the old key retired at `now`, then the keys retired before;
/// and the key ids (new, old). Refuses data with no valid `key` or an
/// unreadable `retired`.
pub fn rotated_key_data(
    data: &SecretData,
    fresh: &str,
    now: Timestamp,
) -> Result<(SecretData, (String, String)), KeyDataError> {
    let old = data.get("key").ok_or(KeyDataError::NoKey)?;
    let old = RetiredKey::new(&old.0, now).map_err(KeyDataError::Key)?;
    let mut retired = vec![old.clone()];
    retired.extend(retired_of(data)?);
    let new = TokenKey::new(fresh.as_bytes()).map_err(KeyDataError::Fresh)?;
    let mut out = data.clone();
    out.insert("key".into(), ByteString(fresh.as_bytes().to_vec()));
    out.insert("retired".into(), ByteString(retired_text(&retired)));
    Ok((
        out,
        (
            new.record_signer().key_id().to_string(),
            old.id().to_string(),
        ),
    ))
}

fn retired_of(data: &SecretData) -> Result<Vec<RetiredKey>, KeyDataError> {
    parse_retired(data.get("retired").map_or(&[][..], |r| &r.0)).map_err(KeyDataError::Retired)
}

/// What `--prune` does to the Secret.
#[derive(Debug)]
pub struct PrunePlan {
    /// The Secret's data afterwards.
    pub data: SecretData,
    /// The ids of the keys pruned now.
    pub pruned: Vec<String>,
    /// The keys kept, with the runs whose step Jobs hold their tokens.
    pub kept: Vec<(String, Vec<String>)>,
}

/// Which retired keys of `data` are pruned, given every AgentRun.
pub fn prune_plan(data: &SecretData, runs: &[AgentRun]) -> Result<PrunePlan, KeyDataError> {
    let mut plan = PrunePlan {
        data: data.clone(),
        pruned: Vec::new(),
        kept: Vec::new(),
    };
    let mut retired = retired_of(data)?;
    for key in retired.iter_mut().filter(|k| k.opens()) {
        let holders: Vec<String> = runs.iter().filter_map(|r| holds(r, key)).collect();
        if holders.is_empty() {
            plan.pruned.push(key.id().to_string());
            *key = key.pruned();
        } else {
            plan.kept.push((key.id().to_string(), holders));
        }
    }
    plan.data
        .insert("retired".into(), ByteString(retired_text(&retired)));
    Ok(plan)
}

/// `ns/name (job ...)` when run `r` may still use a token of `key`: it has
/// not finished, a step Job of it still holds its credential, the key opens
/// it (it was created by the key's retirement, or its creation is not
/// said), and the Job's token is of that key (or of an unrecorded key: a
/// Job of an earlier release).
fn holds(r: &AgentRun, key: &RetiredKey) -> Option<String> {
    let status = r.status.as_ref()?;
    if status.phase.is_some_and(|p| p.is_terminal()) {
        return None;
    }
    let step = status.step.as_ref()?;
    let job = step.job.as_deref()?;
    let created = r.metadata.creation_timestamp.as_ref().map(|t| t.0);
    if created.is_some_and(|c| c > key.retired_at) {
        return None;
    }
    if step.token_key.as_deref().is_some_and(|k| k != key.id()) {
        return None;
    }
    Some(format!(
        "{}/{} (step Job {job})",
        r.metadata.namespace.as_deref().unwrap_or_default(),
        r.metadata.name.as_deref().unwrap_or_default()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn t(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn data(key: &str) -> SecretData {
        BTreeMap::from([(
            "key".to_string(),
            ByteString(format!("{key}\n").into_bytes()),
        )])
    }

    fn id(key: &str) -> String {
        TokenKey::new(key.as_bytes())
            .unwrap()
            .record_signer()
            .key_id()
            .to_string()
    }

    #[test]
    fn a_rotation_retires_the_old_key_first_with_its_time_and_keeps_earlier_ones() {
        let (a, b, c) = ("a".repeat(32), "b".repeat(32), "c".repeat(32));
        let (once, (new_id, old_id)) =
            rotated_key_data(&data(&a), &b, t("2026-12-05T10:00:00Z")).unwrap();
        assert_eq!(once["key"].0, b.as_bytes());
        assert_eq!(
            once["retired"].0,
            format!("{a} 2026-12-05T10:00:00Z\n").as_bytes()
        );
        assert_eq!((new_id, old_id), (id(&b), id(&a)));
        let (twice, _) = rotated_key_data(&once, &c, t("2026-12-06T10:00:00Z")).unwrap();
        assert_eq!(
            twice["retired"].0,
            format!("{b} 2026-12-06T10:00:00Z\n{a} 2026-12-05T10:00:00Z\n").as_bytes()
        );
        let keys = TokenKey::new(&twice["key"].0)
            .unwrap()
            .with_retired(&twice["retired"].0)
            .unwrap();
        let old_token = TokenKey::new(a.as_bytes()).unwrap().mint("run");
        assert!(
            keys.check("run", &old_token)
                .opens(Some(t("2026-12-05T09:00:00Z")))
        );
        assert!(
            !keys
                .check("run", &old_token)
                .opens(Some(t("2026-12-05T11:00:00Z")))
        );
        assert_eq!(keys.record_verifier().keys().len(), 3);
        let e = rotated_key_data(&BTreeMap::new(), &c, t("2026-12-05T10:00:00Z")).unwrap_err();
        assert!(e.to_string().contains("`key`"), "{e}");
    }

    /// A run in namespace `ns` created at `created`, in phase `phase`,
    /// whose step Job `job` (if any) holds a token of key `token_key`.
    fn run(
        name: &str,
        created: &str,
        phase: &str,
        job: Option<&str>,
        token_key: Option<&str>,
    ) -> AgentRun {
        serde_json::from_value(json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
            "metadata": {"name": name, "namespace": "ns", "creationTimestamp": created},
            "spec": {"input": "x"},
            "status": {"phase": phase, "step": {"seq": 3, "job": job, "attempt": 1, "tokenKey": token_key}},
        }))
        .unwrap()
    }

    /// A run created before the rotation whose step Job holds a token of
    /// the retired key keeps it; once the Job is let go (or the run ends),
    /// the key is pruned to its public key.
    #[test]
    fn prune_keeps_a_key_while_a_step_job_holds_its_token_and_prunes_it_afterwards() {
        let (a, b) = ("a".repeat(32), "b".repeat(32));
        let (rotated, (_, old_id)) =
            rotated_key_data(&data(&a), &b, t("2026-12-05T10:00:00Z")).unwrap();
        let before = "2026-12-05T09:00:00Z";
        let holding = run("r1", before, "Running", Some("r1-s3-a1"), Some(&old_id));
        let others = [
            // A Job holding the current key's token, and one created after
            // the retirement (the old key never opens it).
            run("r2", before, "Running", Some("r2-s3-a1"), Some(&id(&b))),
            run(
                "r3",
                "2026-12-05T11:00:00Z",
                "Running",
                Some("r3-s3-a1"),
                None,
            ),
            // Waiting for a person, no Job: its next one gets a new token.
            run("r4", before, "AwaitingApproval", None, Some(&old_id)),
            run("r5", before, "Succeeded", Some("r5-s3-a1"), Some(&old_id)),
        ];
        let mut runs = others.to_vec();
        runs.push(holding.clone());
        let plan = prune_plan(&rotated, &runs).unwrap();
        assert!(plan.pruned.is_empty());
        assert_eq!(
            plan.kept,
            vec![(
                old_id.clone(),
                vec!["ns/r1 (step Job r1-s3-a1)".to_string()]
            )]
        );
        assert_eq!(plan.data, rotated, "nothing changes");
        // A Job of an earlier release (no key recorded) may hold it too.
        let unrecorded = run("r6", before, "Running", Some("r6-s3-a1"), None);
        let plan = prune_plan(&rotated, &[unrecorded]).unwrap();
        assert_eq!(plan.kept.len(), 1);

        // r1's Job ended: pruned.
        let plan = prune_plan(&rotated, &others).unwrap();
        assert_eq!(plan.pruned, vec![old_id.clone()]);
        assert!(plan.kept.is_empty());
        let keys = TokenKey::new(b.as_bytes())
            .unwrap()
            .with_retired(&plan.data["retired"].0)
            .unwrap();
        let old_token = TokenKey::new(a.as_bytes()).unwrap().mint("r1");
        assert!(!keys.check("r1", &old_token).opens(Some(t(before))));
        let before_prune = TokenKey::new(b.as_bytes())
            .unwrap()
            .with_retired(&rotated["retired"].0)
            .unwrap();
        assert_eq!(
            keys.record_verifier().keys(),
            before_prune.record_verifier().keys(),
            "its signatures still verify"
        );
        // Pruning again changes nothing.
        let again = prune_plan(&plan.data, &runs).unwrap();
        assert!(again.pruned.is_empty() && again.kept.is_empty());
        assert_eq!(again.data, plan.data);
    }

    /// The API server of the prune: one Secret, the runs, its clock.
    async fn fake_api(secret: Secret, runs: Vec<AgentRun>) -> (kube::Client, FakeSecret) {
        use axum::extract::State;
        let stored = FakeSecret(std::sync::Arc::new(std::sync::Mutex::new(secret)));
        async fn handle(
            State((stored, runs)): State<(FakeSecret, Vec<AgentRun>)>,
            req: axum::extract::Request,
        ) -> axum::response::Response {
            let path = req.uri().path().to_string();
            let put = req.method() == axum::http::Method::PUT;
            let body = axum::body::to_bytes(req.into_body(), 1 << 20)
                .await
                .unwrap();
            let json = |v: serde_json::Value| {
                axum::response::Response::builder()
                    .header("content-type", "application/json")
                    .header("date", "Sat, 05 Dec 2026 10:00:00 GMT")
                    .body(axum::body::Body::from(v.to_string()))
                    .unwrap()
            };
            match path.as_str() {
                "/version" => json(json!({"major": "1", "minor": "34"})),
                "/apis/agentrun.dev/v1alpha1/agentruns" => json(json!({
                    "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRunList",
                    "metadata": {}, "items": runs,
                })),
                "/api/v1/namespaces/agentrun-system/secrets/keys" if put => {
                    let s: Secret = serde_json::from_slice(&body).unwrap();
                    *stored.0.lock().unwrap() = s.clone();
                    json(serde_json::to_value(s).unwrap())
                }
                "/api/v1/namespaces/agentrun-system/secrets/keys" => {
                    json(serde_json::to_value(stored.0.lock().unwrap().clone()).unwrap())
                }
                _ => panic!("unexpected request {path}"),
            }
        }
        let app = axum::Router::new()
            .fallback(handle)
            .with_state((stored.clone(), runs));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        let client = kube::Client::try_from(kube::Config::new(url.parse().unwrap())).unwrap();
        (client, stored)
    }

    #[derive(Clone)]
    struct FakeSecret(std::sync::Arc<std::sync::Mutex<Secret>>);

    impl FakeSecret {
        fn data(&self) -> SecretData {
            self.0.lock().unwrap().data.clone().unwrap_or_default()
        }
    }

    #[tokio::test]
    async fn rotate_key_stamps_the_api_servers_time_and_prune_names_the_runs_it_waits_for() {
        let a = "a".repeat(32);
        let secret: Secret = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "keys", "namespace": "agentrun-system", "resourceVersion": "1"},
            "data": {"key": base64::Engine::encode(&base64::engine::general_purpose::STANDARD, &a)},
        }))
        .unwrap();
        let (client, stored) = fake_api(secret.clone(), Vec::new()).await;
        let mut out = Vec::new();
        rotate(&client, "agentrun-system", "keys", &mut out)
            .await
            .unwrap();
        let rotated = stored.data();
        assert_eq!(
            rotated["retired"].0,
            format!("{a} 2026-12-05T10:00:00Z\n").as_bytes(),
            "the API server's time"
        );

        // A run holds a token of the retired key: kept, named, non-zero exit.
        let holding = run(
            "r1",
            "2026-12-05T09:00:00Z",
            "Running",
            Some("r1-s3-a1"),
            Some(&id(&a)),
        );
        let mut held = secret.clone();
        held.data = Some(rotated.clone());
        let (client, stored) = fake_api(held.clone(), vec![holding]).await;
        let mut out = Vec::new();
        let e = prune(&client, "agentrun-system", "keys", &mut out)
            .await
            .unwrap_err();
        let out = String::from_utf8(out).unwrap();
        assert!(e.to_string().contains("1 retired key(s) kept"), "{e}");
        assert!(out.contains("ns/r1 (step Job r1-s3-a1)"), "{out}");
        assert_eq!(stored.data(), rotated, "nothing pruned");

        // Its Job let go: pruned.
        let (client, stored) = fake_api(held, Vec::new()).await;
        let mut out = Vec::new();
        prune(&client, "agentrun-system", "keys", &mut out)
            .await
            .unwrap();
        let retired = parse_retired(&stored.data()["retired"].0).unwrap();
        assert_eq!(retired.len(), 1);
        assert!(!retired[0].opens(), "pruned");
        assert!(String::from_utf8(out).unwrap().contains("pruned key"));
    }
}
