//! The step log as a Kubernetes API (`log.agentrun.dev`, DESIGN.md section
//! 10, issue 27) on the local control plane with the process node: the
//! controller serves it on this host, registered with the aggregation
//! layer. People read it with their own identities and RBAC (alice is bound
//! to the reader role in namespace A only, carol nowhere); only the API
//! server's front-proxy certificate is trusted at the controller's port;
//! paging walks a log exactly once; follow streams a running run to its end;
//! a record rewritten in the database is reported, never served as
//! verified.
//!
//! Every test here takes the one APIService of the group for its length
//! (`LogApiWorld::start` serializes them), so they live in this one binary.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use agentrun::api::runlog::{ADDED, ERROR, FAILED, MAX_PAGE, MODIFIED, RunLog, VERIFIED};
use agentrun::api::{AgentRun, Phase};
use agentrun::store::{Record, StepKind, StoredRecord};
use common::log_api::{
    self, ClientIdentity, Follow, LogApiWorld, continue_query, event_log, get_runlog, kubectl_as,
    refusal, uid_of,
};
use common::world::{TIMEOUT, call, finish};
use kube::api::{Api, DeleteParams};
use serde_json::{Value, json};

/// How long a follow may stay silent while its run is working.
const EVENT_WITHIN: Duration = Duration::from_secs(60);

/// The run of these tests: a lookup, a refund, the answer (9 records:
/// RunStarted, three ModelCalls, two intents and results, RunFinished).
fn refund_replies() -> Value {
    json!([
        {"text": "Let me look the order up first.", "toolCalls": [{"name": "lookup_order", "arguments": {"orderId": "1042"}}]},
        call("issue_refund", json!({"orderId": "1042", "amount": 40})),
        finish("Refunded 40.00 for order 1042.")
    ])
}

/// Creates run `name` with `replies` as its model's script.
async fn create_run(api: &LogApiWorld, name: &str, replies: Value) -> AgentRun {
    let w = &api.world;
    w.standins.script(name, replies, json!([])).await;
    w.create_run(
        name,
        json!({"input": "Refund order 1042.", "agent": w.agent(name)}),
        json!({}),
    )
    .await
}

/// A run of [`refund_replies`] that has Succeeded.
async fn finished_run(api: &LogApiWorld, name: &str) -> AgentRun {
    create_run(api, name, refund_replies()).await;
    api.world.wait_phase(name, Phase::Succeeded).await
}

/// (seq, hash) of records, to compare what was served with the store.
fn seqs_and_hashes(records: &[StoredRecord]) -> Vec<(u64, String)> {
    records
        .iter()
        .map(|r| (r.seq, r.hash.to_string()))
        .collect()
}

/// Records as the store holds them (each in its canonical form).
fn as_stored(records: &[Record]) -> Vec<StoredRecord> {
    records.iter().map(StoredRecord::of).collect()
}

/// Reads a run's log as `client` page by page (`limit` records a page),
/// following `page.continue`; returns every page.
async fn all_pages(client: &kube::Client, ns: &str, name: &str, limit: u64) -> Vec<RunLog> {
    let mut pages = Vec::new();
    let mut query = format!("limit={limit}");
    loop {
        let page = get_runlog(client, ns, name, &query)
            .await
            .unwrap_or_else(|e| panic!("GET runlogs/{name}?{query}: {e}"));
        let next = page.page.as_ref().and_then(|p| p.r#continue.clone());
        pages.push(page);
        match next {
            Some(token) => query = format!("limit={limit}&{}", continue_query(&token)),
            None => return pages,
        }
        assert!(
            pages.len() <= 1000,
            "more than 1000 pages of {limit}: the continue tokens do not advance"
        );
    }
}

/// Waits until the log API serves run `name` (its replica has seen the run).
async fn wait_served(client: &kube::Client, ns: &str, name: &str) -> RunLog {
    common::wait_for(
        &format!("the log API to serve runlogs/{name} in {ns}"),
        TIMEOUT,
        || async { get_runlog(client, ns, name, "").await },
    )
    .await
}

/// Whether `message` names `seq` as a number of its own (not inside another).
fn names_number(message: &str, seq: u64) -> bool {
    message
        .split(|c: char| !c.is_ascii_alphanumeric())
        .any(|token| token == seq.to_string())
}

#[tokio::test]
async fn a_reader_bound_in_the_namespace_reads_a_finished_runs_log_as_the_store_holds_it() {
    let api = LogApiWorld::start("logread").await;
    let ns = api.ns();
    log_api::grant_reader(&api.world.client, ns, "alice").await;
    let run = finished_run(&api, "readme").await;
    let stored = log_api::stored_records(&uid_of(&run)).await;
    assert!(
        stored.len() >= 9,
        "the store holds the run's log: {stored:?}"
    );

    // `kubectl get --raw` as alice: the whole log in one page.
    let path = log_api::runlog_path(ns, Some("readme"), "");
    let raw = kubectl_as("alice", &["get", "--raw", &path]);
    assert!(raw.ok, "kubectl get --raw {path} as alice: {}", raw.stderr);
    let served: RunLog = serde_json::from_str(&raw.stdout)
        .unwrap_or_else(|e| panic!("not a RunLog ({e}): {}", raw.stdout));
    assert_eq!(served.kind, "RunLog");
    assert_eq!(served.metadata.name.as_deref(), Some("readme"));
    assert_eq!(served.metadata.uid, run.metadata.uid);
    assert_eq!(
        seqs_and_hashes(&served.records),
        seqs_and_hashes(&as_stored(&stored))
    );
    assert_eq!(
        served.records,
        as_stored(&stored),
        "records as the store holds them"
    );
    assert!(served.run.finished, "{:?}", served.run);
    assert_eq!(served.run.phase.as_deref(), Some("Succeeded"));
    let status_log = run.status.as_ref().and_then(|s| s.log.clone()).unwrap();
    let verification = served.verification.expect("what the server checked");
    assert_eq!(verification.result, VERIFIED, "{verification:?}");
    assert_eq!(verification.head_hash, status_log.head_hash);
    assert_eq!(verification.head_length, status_log.length);

    // `kubectl get runlogs` lists it; discovery names the resource.
    let list = kubectl_as("alice", &["get", "runlogs", "-n", ns]);
    assert!(list.ok, "kubectl get runlogs as alice: {}", list.stderr);
    assert!(
        list.stdout
            .lines()
            .any(|l| l.split_whitespace().next() == Some("readme")),
        "kubectl get runlogs -n {ns} lists readme:\n{}",
        list.stdout
    );
    let resources = kubectl_as(
        "alice",
        &[
            "api-resources",
            "--api-group=log.agentrun.dev",
            "-o",
            "name",
        ],
    );
    assert!(resources.ok, "kubectl api-resources: {}", resources.stderr);
    assert!(
        resources
            .stdout
            .lines()
            .any(|l| l.trim() == "runlogs.log.agentrun.dev"),
        "api-resources lists runlogs:\n{}",
        resources.stdout
    );
}

#[tokio::test]
async fn people_without_a_binding_in_the_namespace_are_refused_naming_the_verb_and_resource() {
    let api = LogApiWorld::start("logdeny").await;
    let ns = api.ns();
    log_api::grant_reader(&api.world.client, ns, "alice").await;
    finished_run(&api, "secret").await;
    let other = common::test_namespace(&api.world.client, "logdeny-b").await;

    // carol has no binding anywhere. (The API server authorizes a request
    // before its aggregator proxies it, so these refusals are its own; the
    // controller's check is what refuses bob below, and the front proxy's
    // carol in the_serving_port_refuses_requests_without_the_front_proxy_certificate.)
    let carol = common::client_as("carol").await;
    let refused = get_runlog(&carol, ns, "secret", "").await;
    let (code, message) = refusal(&refused).unwrap_or_else(|| panic!("carol read it: {refused:?}"));
    assert_eq!(code, 403, "{message}");
    assert!(
        message.contains("get") && message.contains("runlogs") && message.contains("carol"),
        "the refusal names the user, the verb and the resource: {message}"
    );
    let list = carol
        .request::<Value>(
            http::Request::get(log_api::runlog_path(ns, None, ""))
                .body(Vec::new())
                .unwrap(),
        )
        .await;
    let (code, message) = refusal(&list).unwrap_or_else(|| panic!("carol listed: {list:?}"));
    assert_eq!(code, 403, "{message}");
    assert!(
        message.contains("list") && message.contains("runlogs"),
        "{message}"
    );
    // The same through kubectl: Forbidden, not a server error.
    let path = log_api::runlog_path(ns, Some("secret"), "");
    let out = kubectl_as("carol", &["get", "--raw", &path]);
    assert!(!out.ok, "kubectl as carol read it:\n{}", out.stdout);
    assert!(out.stderr.contains("Forbidden"), "{}", out.stderr);

    // alice is bound in A only.
    let alice = common::client_as("alice").await;
    get_runlog(&alice, ns, "secret", "")
        .await
        .unwrap_or_else(|e| panic!("alice reads in {ns}, where she is bound: {e}"));
    let elsewhere = get_runlog(&alice, other.name(), "secret", "").await;
    let (code, message) =
        refusal(&elsewhere).unwrap_or_else(|| panic!("alice read in B: {elsewhere:?}"));
    assert_eq!(code, 403, "{message}");
    assert!(
        message.contains("get") && message.contains("runlogs") && message.contains(other.name()),
        "the refusal names the verb, the resource and the namespace: {message}"
    );

    // bob may get runlogs in A, not watch them. The API server sees a
    // `get` in `?follow=true` and passes it on; the controller asks its
    // SubjectAccessReview for `watch`, and refuses.
    log_api::grant_verbs(&api.world.client, ns, "bob", &["get"]).await;
    let bob = common::client_as("bob").await;
    let page = common::wait_for("bob's get to be allowed", TIMEOUT, || async {
        get_runlog(&bob, ns, "secret", "").await
    })
    .await;
    assert!(!page.records.is_empty(), "bob reads the records");
    let followed = Follow::open(&bob, ns, "secret", "follow=true").await;
    let (code, message) = refusal(&followed)
        .unwrap_or_else(|| panic!("bob followed without watch: {:?}", followed.is_ok()));
    assert_eq!(code, 403, "{message}");
    assert!(
        message.contains("watch") && message.contains("runlogs") && message.contains("bob"),
        "the controller's refusal names the user, the verb and the resource: {message}"
    );
}

#[tokio::test]
async fn the_serving_port_refuses_requests_without_the_front_proxy_certificate() {
    let api = LogApiWorld::start("logport").await;
    let ns = api.ns();
    log_api::grant_reader(&api.world.client, ns, "alice").await;
    finished_run(&api, "direct").await;
    let path = log_api::runlog_path(ns, Some("direct"), "");
    let admin = [
        ("X-Remote-User", "admin"),
        ("X-Remote-Group", "system:masters"),
    ];

    // No client certificate at all, whatever the headers claim.
    let (code, body) = direct(&api, None, &admin, &path)
        .await
        .unwrap_or_else(|e| panic!("the port answers TLS clients without a certificate: {e}"));
    assert_eq!(code, 401, "without a client certificate: {body}");

    // A certificate of the cluster CA (alice's) is a person's, not the front
    // proxy's: its X-Remote-* headers are not believed.
    let alice = log_api::user_cert("alice");
    match direct(&api, Some(&alice), &admin, &path).await {
        Ok((code, body)) => assert_eq!(code, 401, "alice's certificate claiming admin: {body}"),
        Err(e) => assert!(
            e.contains("TLS") || e.contains("reading"),
            "refused in the handshake is refused too: {e}"
        ),
    }

    // The front-proxy certificate (what the API server presents): the user
    // it names is believed, and authorized like any other.
    let proxy = log_api::front_proxy_client();
    let (code, body) = direct(&api, Some(&proxy), &[("X-Remote-User", "alice")], &path)
        .await
        .expect("the front proxy's request");
    assert_eq!(code, 200, "the front proxy for alice: {body}");
    let served: RunLog = serde_json::from_str(&body).expect("a RunLog");
    assert_eq!(served.metadata.name.as_deref(), Some("direct"));
    let (code, body) = direct(&api, Some(&proxy), &[("X-Remote-User", "carol")], &path)
        .await
        .expect("the front proxy's request");
    assert_eq!(code, 403, "the front proxy for carol: {body}");
    assert!(
        body.contains("carol") && body.contains("get") && body.contains("runlogs"),
        "the controller's refusal names the user, the verb and the resource: {body}"
    );
}

/// GETs `path` straight from the controller's serving port, presenting the
/// client certificate and key `identity` (files) if any.
async fn direct(
    api: &LogApiWorld,
    identity: Option<&(PathBuf, PathBuf)>,
    headers: &[(&str, &str)],
    path: &str,
) -> Result<(u16, String), String> {
    let identity = identity.map(|(cert, key)| ClientIdentity { cert, key });
    log_api::direct_get(
        &api.addr,
        api.port,
        &api.cert.dns_name,
        &api.cert.ca_pem,
        identity,
        headers,
        path,
    )
    .await
}

#[tokio::test]
async fn paging_with_limit_and_continue_walks_the_whole_log_once() {
    let api = LogApiWorld::start("logpage").await;
    let ns = api.ns();
    let run = finished_run(&api, "pages").await;
    let stored = log_api::stored_records(&uid_of(&run)).await;

    let pages = all_pages(&api.world.client, ns, "pages", 2).await;
    let mut walked = Vec::new();
    let mut next = 0;
    for page in &pages {
        assert!(page.records.len() <= 2, "limit=2 page: {:?}", page.page);
        let info = page.page.as_ref().expect("a get names its page");
        assert_eq!(info.from_seq, next, "pages follow each other");
        next += page.records.len() as u64;
        assert_eq!(info.next_seq, next, "{info:?}");
        walked.extend(page.records.iter().cloned());
    }
    assert_eq!(
        pages.len(),
        stored.len().div_ceil(2),
        "no empty page before the end"
    );
    assert_eq!(
        seqs_and_hashes(&walked),
        seqs_and_hashes(&as_stored(&stored)),
        "every record once, in order"
    );
    assert!(
        pages
            .last()
            .unwrap()
            .page
            .as_ref()
            .unwrap()
            .r#continue
            .is_none(),
        "the last page has no continue"
    );

    // fromSeq starts where it says.
    let tail = get_runlog(&api.world.client, ns, "pages", "fromSeq=5&limit=2")
        .await
        .expect("fromSeq=5");
    assert_eq!(
        seqs_and_hashes(&tail.records),
        seqs_and_hashes(&as_stored(&stored[5..7]))
    );
}

#[tokio::test]
async fn a_huge_limit_is_capped_at_the_page_maximum() {
    let api = LogApiWorld::start("logcap").await;
    let ns = api.ns();
    // A run that never starts (its Agent does not exist), whose log in the
    // store is written here: more records than a page may hold, without a
    // run of thousands of steps.
    let run = api
        .world
        .create_run(
            "long",
            json!({"input": "x", "agentRef": {"name": "no-such-agent"}}),
            json!({}),
        )
        .await;
    let total = MAX_PAGE + 1;
    log_api::append_observations(&uid_of(&run), total).await;

    let client = &api.world.client;
    wait_served(client, ns, "long").await;
    let page = get_runlog(client, ns, "long", "limit=1000000")
        .await
        .expect("limit=1000000");
    assert_eq!(page.records.len() as u64, MAX_PAGE, "{:?}", page.page);
    let info = page.page.expect("page");
    assert_eq!(info.next_seq, MAX_PAGE);
    let token = info.r#continue.expect("a continue token to the rest");
    let rest = get_runlog(
        client,
        ns,
        "long",
        &format!("limit=1000000&{}", continue_query(&token)),
    )
    .await
    .expect("the rest");
    assert_eq!(
        rest.records.iter().map(|r| r.seq).collect::<Vec<_>>(),
        vec![MAX_PAGE]
    );
}

/// A page holds at most `limitBytes` of record bodies, capped at 4 MiB
/// (a larger record is a page of its own), whatever `limit` says: a log of
/// large records is read a few records at a time and walked whole by its
/// continue tokens.
#[tokio::test]
async fn a_page_holds_at_most_its_bytes_and_a_log_of_large_records_is_walked_whole() {
    let api = LogApiWorld::start("logbytes").await;
    let ns = api.ns();
    let run = api
        .world
        .create_run(
            "large",
            json!({"input": "x", "agentRef": {"name": "no-such-agent"}}),
            json!({}),
        )
        .await;
    let mib = 1 << 20;
    log_api::append_observations_of(&uid_of(&run), 7, 3 * mib / 2).await;
    let client = &api.world.client;
    wait_served(client, ns, "large").await;
    let bytes = |page: &RunLog| page.records.iter().map(|r| r.body.len()).sum::<usize>();

    let page = get_runlog(client, ns, "large", "limit=1000000")
        .await
        .unwrap();
    assert_eq!(page.records.len(), 2, "two records of 1.5 MiB in 4 MiB");
    assert!(bytes(&page) <= 4 * mib);
    let one = get_runlog(client, ns, "large", "limitBytes=1")
        .await
        .unwrap();
    assert_eq!(
        one.records.len(),
        1,
        "a record larger than the page is a page"
    );
    let huge = format!("limitBytes={}", 1u64 << 40);
    let capped = get_runlog(client, ns, "large", &huge).await.unwrap();
    assert_eq!(capped.records.len(), 2, "limitBytes is capped at 4 MiB");

    let mut walked = Vec::new();
    let mut query = "limit=1000000".to_string();
    loop {
        let page = get_runlog(client, ns, "large", &query).await.unwrap();
        assert!(page.records.len() <= 2, "{:?}", page.page);
        walked.extend(page.records.iter().map(|r| r.seq));
        match page.page.and_then(|p| p.r#continue) {
            Some(token) => query = format!("limit=1000000&{}", continue_query(&token)),
            None => break,
        }
    }
    assert_eq!(
        walked,
        (0..7).collect::<Vec<u64>>(),
        "every record once, in order"
    );
}

/// The worst sizes the caps allow (issue 39): a run of 32 tool answers of
/// 3.9 MiB each (124 MiB of log), read whole by six readers at once, each
/// asking for as much as it may. Before, one page of it took the
/// controller to 790 MiB; its peak memory now stays under the chart's
/// limit (512 MiB), the budgets of `docs/memory.md` holding.
#[tokio::test]
async fn the_controllers_memory_stays_under_its_limit_while_the_largest_log_is_read() {
    let api = LogApiWorld::start("logmem").await;
    let ns = api.ns().to_string();
    let run = api
        .world
        .create_run(
            "largest",
            json!({"input": "x", "agentRef": {"name": "no-such-agent"}}),
            json!({}),
        )
        .await;
    log_api::append_large_steps(&uid_of(&run), 32, 3_900_000).await;
    let client = api.world.client.clone();
    wait_served(&client, &ns, "largest").await;
    let pid = api.world.controller_pid().expect("the controller runs");
    let before = common::procs::status_kb(pid, "VmHWM");

    let walk = |client: kube::Client, ns: String| async move {
        let mut seqs = Vec::new();
        let mut query = "limit=1000000&limitBytes=1000000000".to_string();
        loop {
            let page = get_runlog(&client, &ns, "largest", &query).await.unwrap();
            seqs.extend(page.records.iter().map(|r| r.seq));
            match page.page.and_then(|p| p.r#continue) {
                Some(token) => query = format!("limit=1000000&{}", continue_query(&token)),
                None => return seqs,
            }
        }
    };
    let walks = (0..6).map(|_| walk(client.clone(), ns.clone()));
    for seqs in futures::future::join_all(walks).await {
        assert_eq!(
            seqs,
            (0..64).collect::<Vec<u64>>(),
            "each reader read it all"
        );
    }
    let peak = common::procs::status_kb(pid, "VmHWM");
    println!(
        "controller peak memory: {} MiB before, {} MiB after",
        before / 1024,
        peak / 1024
    );
    assert!(
        peak < 512 * 1024,
        "the controller peaked at {} MiB, over the chart's 512 MiB",
        peak / 1024
    );
}

#[tokio::test]
async fn a_from_seq_past_the_head_is_an_empty_page_and_an_unknown_run_is_not_found() {
    let api = LogApiWorld::start("logbad").await;
    let ns = api.ns();
    let run = finished_run(&api, "short").await;
    let length = run
        .status
        .as_ref()
        .and_then(|s| s.log.clone())
        .unwrap()
        .length;
    let client = &api.world.client;

    let past = get_runlog(client, ns, "short", &format!("fromSeq={}", length + 100))
        .await
        .expect("a fromSeq past the head is not an error");
    assert!(past.records.is_empty(), "{:?}", past.records);
    assert_eq!(past.run.length, length);

    let unknown = get_runlog(client, ns, "no-such-run", "").await;
    let (code, message) =
        refusal(&unknown).unwrap_or_else(|| panic!("an unknown run was served: {unknown:?}"));
    assert_eq!(code, 404, "{message}");
    assert!(message.contains("no-such-run"), "{message}");
}

#[tokio::test]
async fn follow_streams_every_record_in_order_and_ends_when_the_run_finishes() {
    let api = LogApiWorld::start("logfollow").await;
    let ns = api.ns();
    log_api::grant_reader(&api.world.client, ns, "alice").await;
    // Each model answer takes a while: the run appends over seconds.
    let replies = json!([
        {"text": "Looking.", "delayMs": 1500, "toolCalls": [{"name": "lookup_order", "arguments": {"orderId": "1042"}}]},
        {"delayMs": 1500, "toolCalls": [{"name": "issue_refund", "arguments": {"orderId": "1042", "amount": 40}}]},
        {"delayMs": 1500, "toolCalls": [{"name": "finish", "arguments": {"result": "Refunded."}}]}
    ]);
    let run = create_run(&api, "followed", replies).await;
    let alice = common::client_as("alice").await;
    wait_served(&alice, ns, "followed").await;

    let mut follow = Follow::open(&alice, ns, "followed", "follow=true")
        .await
        .expect("follow as alice");
    let mut records = Vec::new();
    let mut added = 0;
    let finished = loop {
        let event = follow
            .next(EVENT_WITHIN)
            .await
            .unwrap_or_else(|| panic!("the stream ended before the run did: {records:?}"));
        match event.kind.as_str() {
            ADDED => {
                added += 1;
                records.extend(event_log(&event).records);
            }
            MODIFIED => break event_log(&event),
            _ => panic!("unexpected event: {event:?}"),
        }
    };
    assert!(finished.run.finished, "{:?}", finished.run);
    assert!(
        follow.next(Duration::from_secs(10)).await.is_none(),
        "the stream ends after the run finished"
    );
    assert!(
        added >= 2,
        "records arrive as they are appended, not all at once at the end ({added} ADDED events)"
    );
    let stored = log_api::stored_records(&uid_of(&run)).await;
    assert_eq!(
        seqs_and_hashes(&records),
        seqs_and_hashes(&as_stored(&stored)),
        "every record once, in seq order"
    );
    assert_eq!(
        records.last().and_then(|r| r.decode().ok()).map(|r| r.kind),
        Some(StepKind::RunFinished)
    );
}

#[tokio::test]
async fn follow_of_a_run_deleted_meanwhile_ends_with_an_error_naming_the_deletion() {
    let api = LogApiWorld::start("logdelete").await;
    let ns = api.ns();
    // The model never answers in time: the run stays running until deleted.
    let replies = json!([{"text": "too late", "delayMs": 600_000}]);
    create_run(&api, "doomed", replies).await;
    let client = &api.world.client;
    wait_served(client, ns, "doomed").await;

    let mut follow = Follow::open(client, ns, "doomed", "follow=true")
        .await
        .expect("follow");
    let first = follow.next(EVENT_WITHIN).await.expect("a first event");
    assert_eq!(first.kind, ADDED, "{first:?}");
    assert!(
        event_log(&first).records.iter().any(|r| r.seq == 0),
        "the log from its start: {first:?}"
    );
    Api::<AgentRun>::namespaced(client.clone(), ns)
        .delete("doomed", &DeleteParams::default())
        .await
        .expect("deleting the run");

    let last = loop {
        let event = follow
            .next(EVENT_WITHIN)
            .await
            .expect("an event saying why the stream ends");
        match event.kind.as_str() {
            ADDED => continue,
            _ => break event,
        }
    };
    assert_eq!(last.kind, ERROR, "{last:?}");
    let message = last.object["message"].as_str().unwrap_or_default();
    assert!(
        message.to_lowercase().contains("deleted"),
        "the ERROR names the deletion: {last:?}"
    );
    assert!(
        follow.next(Duration::from_secs(10)).await.is_none(),
        "the stream ends after its ERROR"
    );
}

/// Revocation reaches open streams (issue 39): alice follows a running
/// run's log; her RoleBinding is removed; the stream ends with a Forbidden
/// ERROR within twice the authorizer's TTL (10 s), not when the run ends.
#[tokio::test]
async fn a_follow_ends_forbidden_once_the_followers_binding_is_removed() {
    use k8s_openapi::api::rbac::v1::RoleBinding;
    let api = LogApiWorld::start("logrevoke").await;
    let ns = api.ns();
    log_api::grant_reader(&api.world.client, ns, "alice").await;
    // The model never answers in time: the run stays running throughout.
    let replies = json!([{"text": "too late", "delayMs": 600_000}]);
    create_run(&api, "watched", replies).await;
    wait_served(&api.world.client, ns, "watched").await;

    let alice = common::client_as("alice").await;
    let mut follow = Follow::open(&alice, ns, "watched", "follow=true")
        .await
        .expect("alice may follow");
    let first = follow.next(EVENT_WITHIN).await.expect("a first event");
    assert_eq!(first.kind, ADDED, "{first:?}");
    Api::<RoleBinding>::namespaced(api.world.client.clone(), ns)
        .delete("alice-log-reader", &DeleteParams::default())
        .await
        .expect("removing alice's binding");

    let last = loop {
        let event = follow
            .next(Duration::from_secs(30))
            .await
            .expect("an event saying why the stream ends");
        if event.kind != ADDED {
            break event;
        }
    };
    assert_eq!(last.kind, ERROR, "{last:?}");
    assert_eq!(last.object["code"], 403, "{last:?}");
    assert_eq!(last.object["reason"], "Forbidden", "{last:?}");
    assert!(
        follow.next(Duration::from_secs(10)).await.is_none(),
        "the stream ends after its ERROR"
    );
    let run = Api::<AgentRun>::namespaced(api.world.client.clone(), ns)
        .get("watched")
        .await
        .unwrap();
    assert!(
        !run.status
            .and_then(|s| s.phase)
            .is_some_and(|p| p.is_terminal()),
        "the stream ended for the revocation, not the run's end"
    );
}

/// The stored bytes are the evidence (issue 39): the database superuser
/// respells three records of a finished run without changing what they
/// say (a field added to a ModelCall, keys reordered, spacing). The log API
/// hands the bytes on as stored and fails its own check at the first; the
/// plugin, reading as alice, names each one as altered and never says
/// "chain intact".
#[tokio::test]
async fn records_respelled_by_the_database_superuser_are_named_altered_by_verify_and_log() {
    let api = LogApiWorld::start("logrespell").await;
    let ns = api.ns();
    log_api::grant_reader(&api.world.client, ns, "alice").await;
    let run = finished_run(&api, "respelled").await;
    let uid = uid_of(&run);
    let stored = log_api::stored_records(&uid).await;
    let of_kind = |kind: StepKind| {
        stored
            .iter()
            .find(|r| r.kind == kind)
            .unwrap_or_else(|| panic!("a {kind} in the log: {stored:?}"))
            .clone()
    };
    let (model, finished) = (of_kind(StepKind::ModelCall), of_kind(StepKind::RunFinished));
    let intent = of_kind(StepKind::ToolIntent);
    let respellings = [
        (
            model.seq,
            "{\"format\":1,".to_string(),
            "{\"format\":1,\"tampered\":true,".to_string(),
        ),
        (
            intent.seq,
            "{\"format\":1,\"kind\":\"ToolIntent\",".to_string(),
            "{\"kind\":\"ToolIntent\",\"format\":1,".to_string(),
        ),
        (
            finished.seq,
            ",\"payload\":".to_string(),
            " ,\n\"payload\" : ".to_string(),
        ),
    ];
    for (seq, from, to) in &respellings {
        let touched = log_api::rewrite_record(&uid, *seq, from, to).await;
        assert_eq!(touched, 1, "record {seq} respelled");
    }
    let mut seqs: Vec<u64> = respellings.iter().map(|(seq, _, _)| *seq).collect();
    seqs.sort_unstable();

    let served = get_runlog(&api.world.client, ns, "respelled", "")
        .await
        .expect("a respelled log is still served, as stored");
    let verification = served.verification.expect("what the server checked");
    assert_eq!(verification.result, FAILED, "{verification:?}");
    assert!(
        names_number(&verification.message, seqs[0]),
        "the server names record {}: {verification:?}",
        seqs[0]
    );
    let sent = &served.records[model.seq as usize];
    assert!(
        sent.body.contains("\"tampered\":true"),
        "sent as stored: {sent:?}"
    );

    let verify = log_api::plugin_as("alice", ns, &["verify", "respelled"], PLUGIN_WITHIN).await;
    assert!(!verify.ok, "verify passed:\n{}", verify.stdout);
    for seq in &seqs {
        assert!(
            verify
                .stdout
                .lines()
                .any(|l| l.starts_with(&format!("FAILED: seq {seq}:")) && l.contains("altered")),
            "verify names record {seq} as altered:\n{}",
            verify.stdout
        );
    }
    assert!(!verify.stdout.contains("chain intact"), "{}", verify.stdout);
    let log = log_api::plugin_as("alice", ns, &["log", "respelled"], PLUGIN_WITHIN).await;
    assert!(!log.ok, "log passed:\n{}", log.stdout);
    let marked: Vec<u64> = log_api::plugin_records(&log.stdout)
        .iter()
        .filter(|l| l.marked)
        .map(|l| l.seq)
        .collect();
    assert_eq!(
        marked, seqs,
        "exactly the respelled records marked:\n{}",
        log.stdout
    );
    assert!(!log.stdout.contains("verified: "), "{}", log.stdout);
}

#[tokio::test]
async fn a_record_rewritten_by_the_database_superuser_fails_verification_naming_its_seq() {
    let api = LogApiWorld::start("logtamper").await;
    let ns = api.ns();
    log_api::grant_reader(&api.world.client, ns, "alice").await;
    let run = finished_run(&api, "altered").await;
    let uid = uid_of(&run);
    let stored = log_api::stored_records(&uid).await;
    let target = stored
        .iter()
        .find(|r| {
            r.kind == StepKind::ModelCall && r.payload.to_string().contains("look the order up")
        })
        .unwrap_or_else(|| panic!("the first model answer is in the log: {stored:?}"))
        .seq;
    let client = &api.world.client;
    let before = get_runlog(client, ns, "altered", "").await.expect("before");
    assert_eq!(
        before.verification.as_ref().map(|v| v.result.as_str()),
        Some(VERIFIED)
    );

    let touched =
        log_api::rewrite_record(&uid, target, "look the order up", "refund everything").await;
    assert_eq!(touched, 1, "record {target} rewritten");

    let after = get_runlog(client, ns, "altered", "")
        .await
        .expect("an altered log is still served, marked");
    let verification = after.verification.expect("what the server checked");
    assert_eq!(verification.result, FAILED, "{verification:?}");
    assert!(
        names_number(&verification.message, target),
        "the message names record {target}: {verification:?}"
    );

    // The plugin checks on its own: `verify` fails naming the record, `log`
    // prints the log with that record marked and says it is not verified.
    let verify = log_api::plugin_as("alice", ns, &["verify", "altered"], PLUGIN_WITHIN).await;
    assert!(
        !verify.ok,
        "verify of an altered log passed:\n{}",
        verify.stdout
    );
    assert!(
        verify
            .stdout
            .lines()
            .any(|l| l.starts_with("FAILED") && names_number(l, target)),
        "a FAILED line names record {target}:\n{}",
        verify.stdout
    );
    let log = log_api::plugin_as("alice", ns, &["log", "altered"], PLUGIN_WITHIN).await;
    assert!(!log.ok, "log of an altered log passed:\n{}", log.stdout);
    let marked: Vec<u64> = log_api::plugin_records(&log.stdout)
        .iter()
        .filter(|l| l.marked)
        .map(|l| l.seq)
        .collect();
    assert!(
        marked.contains(&target),
        "record {target} marked !:\n{}",
        log.stdout
    );
    assert!(log.stdout.contains("NOT VERIFIED"), "{}", log.stdout);
    assert!(!log.stdout.contains("verified: "), "{}", log.stdout);
}

/// The plugin's deadline for a finished run's log.
const PLUGIN_WITHIN: Duration = Duration::from_secs(60);

/// seqs and kinds of records, as the plugin prints them.
fn printed(records: &[Record]) -> Vec<(u64, String)> {
    records
        .iter()
        .map(|r| (r.seq, r.kind.as_str().to_string()))
        .collect()
}

#[tokio::test]
async fn the_plugin_reads_and_verifies_a_finished_run_through_the_api_for_a_bound_reader_only() {
    let api = LogApiWorld::start("logplugin").await;
    let ns = api.ns();
    log_api::grant_reader(&api.world.client, ns, "alice").await;
    let run = finished_run(&api, "audited").await;
    let stored = log_api::stored_records(&uid_of(&run)).await;

    let log = log_api::plugin_as("alice", ns, &["log", "audited"], PLUGIN_WITHIN).await;
    assert!(
        log.ok,
        "kubectl agentrun log as alice:\n{}{}",
        log.stdout, log.stderr
    );
    let lines = log_api::plugin_records(&log.stdout);
    assert_eq!(
        lines
            .iter()
            .map(|l| (l.seq, l.kind.clone()))
            .collect::<Vec<_>>(),
        printed(&stored),
        "one line per record, in order:\n{}",
        log.stdout
    );
    assert!(lines.iter().all(|l| !l.marked), "{}", log.stdout);
    assert!(
        log.stdout
            .contains(&format!("verified: {} records, chain intact", stored.len())),
        "{}",
        log.stdout
    );

    let verify = log_api::plugin_as("alice", ns, &["verify", "audited"], PLUGIN_WITHIN).await;
    assert!(
        verify.ok,
        "kubectl agentrun verify as alice:\n{}{}",
        verify.stdout, verify.stderr
    );
    assert!(
        verify
            .stdout
            .contains(&format!("ok: {} records, chain intact", stored.len())),
        "{}",
        verify.stdout
    );

    // carol may not read runlogs: the plugin fails and prints no record.
    let refused = log_api::plugin_as("carol", ns, &["log", "audited"], PLUGIN_WITHIN).await;
    assert!(!refused.ok, "carol's log:\n{}", refused.stdout);
    assert!(
        log_api::plugin_records(&refused.stdout).is_empty(),
        "{}",
        refused.stdout
    );
    assert!(
        refused.stderr.contains("runlogs"),
        "the refusal names what is missing: {}",
        refused.stderr
    );
}

#[tokio::test]
async fn the_plugin_follows_a_running_run_record_by_record_to_its_final_phase() {
    let api = LogApiWorld::start("logplugfollow").await;
    let ns = api.ns();
    log_api::grant_reader(&api.world.client, ns, "alice").await;
    let replies = json!([
        {"text": "Looking.", "delayMs": 1500, "toolCalls": [{"name": "lookup_order", "arguments": {"orderId": "1042"}}]},
        {"delayMs": 1500, "toolCalls": [{"name": "finish", "arguments": {"result": "Nothing to refund."}}]}
    ]);
    let run = create_run(&api, "tailed", replies).await;
    let alice = common::client_as("alice").await;
    wait_served(&alice, ns, "tailed").await;

    let out = log_api::plugin_as("alice", ns, &["log", "-f", "tailed"], TIMEOUT).await;
    assert!(
        out.ok,
        "kubectl agentrun log -f as alice:\n{}{}",
        out.stdout, out.stderr
    );
    let stored = log_api::stored_records(&uid_of(&run)).await;
    assert_eq!(
        log_api::plugin_records(&out.stdout)
            .into_iter()
            .map(|l| (l.seq, l.kind))
            .collect::<Vec<_>>(),
        printed(&stored),
        "every record once, in order:\n{}",
        out.stdout
    );
    let last = out.stdout.lines().last().unwrap_or_default();
    assert_eq!(last, "run tailed finished: Succeeded", "{}", out.stdout);
}

#[tokio::test]
async fn the_plugin_follows_a_run_across_a_restart_of_the_replica_serving_it() {
    let mut api = LogApiWorld::start("logplugrestart").await;
    let ns = api.ns().to_string();
    log_api::grant_reader(&api.world.client, &ns, "alice").await;
    // Slow replies: the run is still working when its serving replica goes.
    let replies = json!([
        {"text": "Looking.", "delayMs": 2000, "toolCalls": [{"name": "lookup_order", "arguments": {"orderId": "1042"}}]},
        {"text": "Checking again.", "delayMs": 2000, "toolCalls": [{"name": "lookup_order", "arguments": {"orderId": "1043"}}]},
        {"delayMs": 2000, "toolCalls": [{"name": "finish", "arguments": {"result": "Nothing to refund."}}]}
    ]);
    let run = create_run(&api, "restarted", replies).await;
    let uid = uid_of(&run);
    let alice = common::client_as("alice").await;
    wait_served(&alice, &ns, "restarted").await;

    let follow = {
        let ns = ns.clone();
        tokio::spawn(async move {
            log_api::plugin_as("alice", &ns, &["log", "-f", "restarted"], TIMEOUT).await
        })
    };
    // Once the run has made progress (and the follower has records to
    // resume after), the replica serving the log API is replaced.
    let store = api.world.store().await;
    let at_restart = common::wait_for("the run to record its first model call", TIMEOUT, || {
        let store = store.clone();
        let uid = uid.clone();
        async move {
            let len = store.head(&uid).await.map_err(|e| e.to_string())?.len;
            if len >= 2 {
                Ok(len)
            } else {
                Err(format!("{len} records"))
            }
        }
    })
    .await;
    api.world.restart_controller().await;

    let out = follow.await.expect("the follower");
    assert!(
        out.ok,
        "kubectl agentrun log -f across a restart:\n{}{}",
        out.stdout, out.stderr
    );
    let stored = log_api::stored_records(&uid).await;
    assert!(
        (stored.len() as u64) > at_restart,
        "the run went on after the restart ({at_restart} records then, {} at the end)",
        stored.len()
    );
    assert_eq!(
        log_api::plugin_records(&out.stdout)
            .into_iter()
            .map(|l| (l.seq, l.kind))
            .collect::<Vec<_>>(),
        printed(&stored),
        "every record once, in order, across the restart:\n{}\n{}",
        out.stdout,
        out.stderr
    );
    let last = out.stdout.lines().last().unwrap_or_default();
    assert_eq!(last, "run restarted finished: Succeeded", "{}", out.stdout);
}
