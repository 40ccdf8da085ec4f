//! The console's pages. Every value a model, a tool or a run creator wrote
//! goes to the templates as data (they escape it) or to the page's script
//! as JSON (it sets `textContent`), never as markup.

use std::sync::Arc;

use axum::Extension;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use kube::api::{Api, ListParams};
use serde::Serialize;
use serde_json::{Value, json};

use super::guard::{Caller, query_param};
use super::{Console, form};
use crate::api::{Agent, AgentRun, Approval, ApprovalKind, ApprovalState, Verdict};
use crate::client::approvals as shown;
use crate::client::{Kube, log};
use crate::refusal::Refusal;
use crate::runlog::v2::Container;

/// Who the person is (from a SelfSubjectReview with their credential).
struct Me {
    user: String,
    groups: Vec<String>,
}

async fn me(client: &kube::Client) -> Result<Me, Refusal> {
    crate::client::whoami_with_groups(client)
        .await
        .map(|(user, groups)| Me { user, groups })
        .map_err(|e| Refusal::new(client_words("asking the API server who you are", &e)))
}

/// A failure acting as the person, in words: the API server's message, not a trace.
fn client_words(what: &str, e: &crate::client::ClientError) -> String {
    match e {
        crate::client::ClientError::Api(kube::Error::Api(s)) => {
            format!("{what}: the API server answered {} ({})", s.code, s.message)
        }
        other => format!("{what}: {}", crate::text::chain(other)),
    }
}

fn kube_words(what: &str, e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => {
            format!("{what}: the API server answered {} ({})", s.code, s.message)
        }
        other => format!("{what}: {other}"),
    }
}

fn kube_status(e: &kube::Error) -> StatusCode {
    match e {
        kube::Error::Api(s) => StatusCode::from_u16(s.code).unwrap_or(StatusCode::BAD_GATEWAY),
        _ => StatusCode::BAD_GATEWAY,
    }
}

/// Objects of kind `K` the person may list: across all namespaces, or, if
/// that is refused, in each namespace of the console's list; and in words
/// where they were looked for.
async fn list_everywhere<K>(
    client: &kube::Client,
    namespaces: &[String],
    plural: &str,
) -> (Vec<K>, String, Vec<String>)
where
    K: kube::Resource<Scope = kube::core::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    match Api::<K>::all(client.clone())
        .list(&ListParams::default())
        .await
    {
        Ok(l) => (l.items, "all namespaces".into(), vec![]),
        Err(kube::Error::Api(s)) if s.code == 403 => {
            let mut items = Vec::new();
            let mut problems = Vec::new();
            for ns in namespaces {
                match Api::<K>::namespaced(client.clone(), ns)
                    .list(&ListParams::default())
                    .await
                {
                    Ok(l) => items.extend(l.items),
                    Err(e) => problems.push(kube_words(&format!("listing {plural} in {ns}"), &e)),
                }
            }
            let scope = if namespaces.is_empty() {
                format!(
                    "no namespace: you may not list {plural} across all namespaces, and the \
                     console was given no namespace to look in"
                )
            } else {
                format!(
                    "namespaces {} (you may not list {plural} across all namespaces)",
                    namespaces.join(", ")
                )
            };
            (items, scope, problems)
        }
        Err(e) => (
            vec![],
            "nowhere".into(),
            vec![kube_words(&format!("listing {plural}"), &e)],
        ),
    }
}

/// A path segment, percent-encoded (names are DNS labels; anything else
/// stays one segment).
fn seg(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

fn approval_href(ns: &str, name: &str) -> String {
    format!("/approvals/{}/{}", seg(ns), seg(name))
}

fn run_href(ns: &str, name: &str) -> String {
    format!("/runs/{}/{}", seg(ns), seg(name))
}

fn name_of(v: &impl Serialize) -> String {
    match serde_json::to_value(v) {
        Ok(Value::String(s)) => s,
        Ok(other) => other.to_string(),
        Err(_) => "?".into(),
    }
}

/// Why the person may not decide `a`, or `None` when they may.
pub(crate) fn may_not_decide(a: &Approval, user: &str, groups: &[String]) -> Option<String> {
    let st = shown::state(a);
    if st != ApprovalState::Pending {
        return Some(format!("already {}", name_of(&st)));
    }
    if jiff::Timestamp::now() >= a.spec.expires_at.0 {
        return Some("expired".into());
    }
    if a.spec.decisions.iter().any(|d| d.approver == user) {
        return Some("you have decided".into());
    }
    if a.spec.separation_of_duties && a.spec.requester.as_deref() == Some(user) {
        return Some("you may not decide: separation of duties (you requested this run)".into());
    }
    let listed = a.spec.approvers.users.iter().any(|u| u == user)
        || a.spec.approvers.groups.iter().any(|g| groups.contains(g));
    if !listed {
        return Some("not an approver".into());
    }
    None
}

/// One row of the inbox.
#[derive(Serialize)]
struct Row {
    namespace: String,
    name: String,
    href: String,
    run: String,
    run_href: String,
    tool: String,
    rule: String,
    kind: String,
    requester: String,
    expires: String,
    left: String,
    quorum: String,
    decided: Vec<String>,
    state: String,
    cannot: Option<String>,
}

fn row(a: &Approval, me: &Me) -> Row {
    let ns = a.metadata.namespace.clone().unwrap_or_default();
    let name = a.metadata.name.clone().unwrap_or_default();
    let agreeing = a
        .spec
        .decisions
        .iter()
        .filter(|d| d.verdict != Verdict::Reject)
        .count();
    Row {
        href: approval_href(&ns, &name),
        run_href: run_href(&ns, &a.spec.run_ref.name),
        run: a.spec.run_ref.name.clone(),
        tool: a.spec.tool.clone(),
        rule: a.spec.rule.clone().unwrap_or_default(),
        kind: name_of(&a.spec.kind),
        requester: a.spec.requester.clone().unwrap_or_default(),
        expires: a.spec.expires_at.0.to_string(),
        left: shown::time_left(a),
        quorum: format!("{agreeing} of {}", a.spec.required_approvals),
        decided: a
            .spec
            .decisions
            .iter()
            .map(|d| format!("{} ({})", d.approver, name_of(&d.verdict)))
            .collect(),
        state: if shown::state(a) == ApprovalState::Pending
            && jiff::Timestamp::now() >= a.spec.expires_at.0
        {
            "Expired".into()
        } else {
            name_of(&shown::state(a))
        },
        cannot: may_not_decide(a, &me.user, &me.groups),
        namespace: ns,
        name,
    }
}

fn html(status: StatusCode, body: Result<String, super::RenderError>) -> Response {
    match body {
        Ok(b) => (status, Html(b)).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

fn failed(c: &Console, status: StatusCode, why: &str) -> Response {
    (status, c.page_error(status, why)).into_response()
}

/// `/`: the inbox.
pub async fn inbox(
    State(c): State<Arc<Console>>,
    Extension(caller): Extension<Caller>,
) -> Response {
    let me = match me(&caller.client).await {
        Ok(m) => m,
        Err(e) => return failed(&c, StatusCode::BAD_GATEWAY, &e),
    };
    let (mut items, scope, problems) =
        list_everywhere::<Approval>(&caller.client, &c.namespaces, "approvals").await;
    items.sort_by_key(|a| a.spec.expires_at.0);
    let (open, closed): (Vec<Row>, Vec<Row>) = items
        .iter()
        .map(|a| row(a, &me))
        .partition(|r| r.state == "Pending");
    let ctx = json!({
        "who": me.user, "csrf": caller.csrf, "scope": scope, "problems": problems,
        "open": open, "closed": closed,
    });
    html(StatusCode::OK, c.render("inbox.html", ctx))
}

/// A cell of the arguments table.
#[derive(Serialize)]
struct Cell {
    text: String,
    changed: bool,
}

/// The arguments table: one row per argument, a column per set of
/// arguments (proposed, the alternative, each edit).
fn compare(spec: &crate::api::ApprovalSpec) -> (Vec<String>, Vec<(String, Vec<Cell>)>) {
    let columns = shown::alternatives(spec);
    let mut keys: Vec<String> = Vec::new();
    for (_, v) in &columns {
        match v.as_object() {
            Some(m) => {
                for k in m.keys() {
                    if !keys.contains(k) {
                        keys.push(k.clone());
                    }
                }
            }
            None if !keys.iter().any(String::is_empty) => keys.push(String::new()),
            None => {}
        }
    }
    let cell = |v: &Value, k: &str| -> Option<Value> {
        if k.is_empty() {
            (!v.is_object()).then(|| v.clone())
        } else {
            v.get(k).cloned()
        }
    };
    let rows = keys
        .iter()
        .map(|k| {
            let base = cell(columns[0].1, k);
            let cells = columns
                .iter()
                .enumerate()
                .map(|(i, (_, v))| {
                    let c = cell(v, k);
                    Cell {
                        text: c.as_ref().map_or("—".into(), |v| v.to_string()),
                        changed: i > 0 && c != base,
                    }
                })
                .collect();
            (
                if k.is_empty() {
                    "(whole)".into()
                } else {
                    k.clone()
                },
                cells,
            )
        })
        .collect();
    (columns.into_iter().map(|(h, _)| h).collect(), rows)
}

/// The tool's argument schema for `a`: the budget's for a Budget approval,
/// else the tool's `inputSchema` in the run's agent (inline or its Agent),
/// read as the person; `Err` says why it could not be read.
async fn tool_schema(
    client: &kube::Client,
    ns: &str,
    a: &Approval,
) -> Result<Option<Value>, Refusal> {
    if a.spec.kind == ApprovalKind::Budget {
        return Ok(Some(crate::api::budget_arguments_schema()));
    }
    let runs: Api<AgentRun> = Api::namespaced(client.clone(), ns);
    let run = runs
        .get(&a.spec.run_ref.name)
        .await
        .map_err(|e| kube_words(&format!("reading run {}", a.spec.run_ref.name), &e))?;
    let template = match (&run.spec.agent, &run.spec.agent_ref) {
        (Some(inline), _) => inline.clone(),
        (None, Some(r)) => {
            let agents: Api<Agent> = Api::namespaced(client.clone(), ns);
            agents
                .get(&r.name)
                .await
                .map_err(|e| kube_words(&format!("reading agent {}", r.name), &e))?
                .spec
        }
        (None, None) => return Err("the run names no agent".into()),
    };
    Ok(template
        .tools
        .iter()
        .find(|t| t.name == a.spec.tool)
        .and_then(|t| t.input_schema.clone()))
}

/// What the approval page says after a decision or a refusal.
#[derive(Serialize, Default)]
struct Notice {
    ok: Option<String>,
    error: Option<String>,
    problems: Vec<String>,
}

/// `/approvals/{ns}/{name}`.
pub async fn approval(
    State(c): State<Arc<Console>>,
    Extension(caller): Extension<Caller>,
    Path((ns, name)): Path<(String, String)>,
    RawQuery(q): RawQuery,
) -> Response {
    let notice = Notice {
        ok: query_param(q.as_deref(), "decided").map(|v| match v.as_str() {
            "Approve" => "Your approval was recorded.".to_string(),
            "Reject" => "Your rejection was recorded.".to_string(),
            _ => "Your edit was recorded.".to_string(),
        }),
        ..Notice::default()
    };
    approval_page(&c, &caller, &ns, &name, notice, StatusCode::OK, None).await
}

async fn approval_page(
    c: &Console,
    caller: &Caller,
    ns: &str,
    name: &str,
    notice: Notice,
    status: StatusCode,
    submitted: Option<&[(String, String)]>,
) -> Response {
    let me = match me(&caller.client).await {
        Ok(m) => m,
        Err(e) => return failed(c, StatusCode::BAD_GATEWAY, &e),
    };
    let api: Api<Approval> = Api::namespaced(caller.client.clone(), ns);
    let a = match api.get(name).await {
        Ok(a) => a,
        Err(e) => {
            return failed(
                c,
                kube_status(&e),
                &kube_words(&format!("reading approval {ns}/{name}"), &e),
            );
        }
    };
    let (schema, schema_note) = match tool_schema(&caller.client, ns, &a).await {
        Ok(Some(s)) => (Some(s), None),
        Ok(None) => (
            None,
            Some(
                "the tool declares no input schema: the form follows the arguments' types"
                    .to_string(),
            ),
        ),
        Err(e) => (
            None,
            Some(format!("{e}: the form follows the arguments' types")),
        ),
    };
    let mut fields = form::fields(schema.as_ref(), &a.spec.arguments);
    if let Some(sent) = submitted {
        for f in &mut fields {
            if let Some((_, v)) = sent.iter().find(|(k, _)| *k == f.input) {
                f.value = v.clone();
            }
        }
    }
    let (headers, rows) = compare(&a.spec);
    let r = row(&a, &me);
    let decisions: Vec<Value> = a
        .spec
        .decisions
        .iter()
        .map(|d| {
            json!({"approver": d.approver, "verdict": name_of(&d.verdict),
                   "reason": d.reason.clone().unwrap_or_default(),
                   "arguments": d.arguments.as_ref().map(|v| v.to_string())})
        })
        .collect();
    let ctx = json!({
        "who": me.user, "csrf": caller.csrf, "a": r, "notice": notice,
        "decide_href": format!("{}/decide", approval_href(ns, name)),
        "headers": headers, "rows": rows,
        "exact": serde_json::to_string_pretty(&a.spec.arguments).unwrap_or_default(),
        "hash": a.spec.arguments_hash,
        "reason": a.spec.observations.reason.clone().unwrap_or_default(),
        "observations": a.spec.observations.recent_results.iter().map(|o| json!({"seq": o.seq, "tool": o.tool, "summary": o.summary})).collect::<Vec<_>>(),
        "dependencies": a.spec.dependencies.iter().map(|d| json!({"name": d.name, "version": d.version})).collect::<Vec<_>>(),
        "alternative": a.spec.alternative.as_ref().map(|alt| json!({"tool": alt.tool, "arguments": alt.arguments.to_string()})),
        "on_expiry": name_of(&a.spec.on_expiry),
        "approvers_users": a.spec.approvers.users, "approvers_groups": a.spec.approvers.groups,
        "separation": a.spec.separation_of_duties,
        "decisions": decisions,
        "decided_by": a.status.as_ref().map(|s| s.decided_by.clone()).unwrap_or_default(),
        "reconcile": a.spec.kind == ApprovalKind::Reconcile,
        "budget": a.spec.kind == ApprovalKind::Budget,
        "fields": fields, "schema_note": schema_note,
    });
    html(status, c.render("approval.html", ctx))
}

/// `POST /approvals/{ns}/{name}/decide`: the person's own `spec.decisions`
/// entry, through the plugin's decide path; the API server's refusal is
/// shown in words.
pub async fn decide(
    State(c): State<Arc<Console>>,
    Extension(caller): Extension<Caller>,
    Path((ns, name)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let pairs: Vec<(String, String)> = url::form_urlencoded::parse(&body).into_owned().collect();
    let form = SentForm {
        c: &c,
        caller: &caller,
        ns: &ns,
        name: &name,
        pairs: &pairs,
    };
    let (verdict, reason) = match verdict_of(&pairs) {
        Ok(asked) => asked,
        Err(Unasked::Verdict) => {
            return failed(
                &c,
                StatusCode::BAD_REQUEST,
                "the form names no verdict (Approve, Reject or Edit)",
            );
        }
        Err(Unasked::Reason) => {
            let error = "A rejection needs a reason: it goes back to the agent.";
            return form
                .refuse(StatusCode::UNPROCESSABLE_ENTITY, error.into(), vec![])
                .await;
        }
    };
    let api: Api<Approval> = Api::namespaced(caller.client.clone(), &ns);
    let a = match api.get(&name).await {
        Ok(a) => a,
        Err(e) => {
            return failed(
                &c,
                kube_status(&e),
                &kube_words(&format!("reading approval {ns}/{name}"), &e),
            );
        }
    };
    if form_field(&pairs, "hash").as_deref() != Some(a.spec.arguments_hash.as_str()) {
        return form.refuse(
            StatusCode::CONFLICT,
            "This approval is not the one the form was made for (its arguments hash differs): look again before deciding.".into(),
            vec![],
        )
        .await;
    }
    let arguments = match verdict {
        Verdict::Edit => {
            let schema = tool_schema(&caller.client, &ns, &a).await.ok().flatten();
            match edited(schema.as_ref(), &a.spec.arguments, &pairs) {
                Ok(args) => Some(args),
                Err((error, problems)) => {
                    return form
                        .refuse(StatusCode::UNPROCESSABLE_ENTITY, error.into(), problems)
                        .await;
                }
            }
        }
        _ => None,
    };
    let k = Kube::new(caller.client.clone(), &ns);
    match shown::decide(&k, &name, verdict, arguments, reason).await {
        Ok(_) => {
            let to = format!(
                "{}?decided={}",
                approval_href(&ns, &name),
                name_of(&verdict)
            );
            see_other(&to)
        }
        Err(e) => {
            form.refuse(refused_status(&e), crate::text::chain(&e), vec![])
                .await
        }
    }
}

/// A decision form as it was sent, for the page that refuses it.
struct SentForm<'a> {
    c: &'a Console,
    caller: &'a Caller,
    ns: &'a str,
    name: &'a str,
    pairs: &'a [(String, String)],
}

impl SentForm<'_> {
    /// The approval's page again, saying why, with the form as it was sent.
    async fn refuse(&self, status: StatusCode, error: String, problems: Vec<String>) -> Response {
        let notice = Notice {
            error: Some(error),
            problems,
            ..Notice::default()
        };
        let sent = Some(self.pairs);
        approval_page(
            self.c,
            self.caller,
            self.ns,
            self.name,
            notice,
            status,
            sent,
        )
        .await
    }
}

/// The value of a form's field `k`.
fn form_field(pairs: &[(String, String)], k: &str) -> Option<String> {
    pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
}

/// What a decision form lacks.
#[derive(Debug, PartialEq)]
enum Unasked {
    Verdict,
    /// A rejection's reason: it goes back to the agent.
    Reason,
}

/// The verdict a decision form asks for, and its reason (trimmed, if any).
fn verdict_of(pairs: &[(String, String)]) -> Result<(Verdict, Option<String>), Unasked> {
    let reason = form_field(pairs, "reason")
        .map(|r| r.trim().to_string())
        .filter(|r| !r.is_empty());
    let verdict = match form_field(pairs, "verdict").as_deref() {
        Some("Approve") => Verdict::Approve,
        Some("Reject") => Verdict::Reject,
        Some("Edit") => Verdict::Edit,
        _ => return Err(Unasked::Verdict),
    };
    if verdict == Verdict::Reject && reason.is_none() {
        return Err(Unasked::Reason);
    }
    Ok((verdict, reason))
}

/// The arguments an edit gives in place of the `proposed` ones; otherwise
/// why not, in words, with the schema's problems.
fn edited(
    schema: Option<&Value>,
    proposed: &Value,
    pairs: &[(String, String)],
) -> Result<Value, (&'static str, Vec<String>)> {
    match form::parse(schema, proposed, pairs) {
        Ok(args) if args == *proposed => Err((
            "The edited arguments are the proposed ones: approve instead.",
            vec![],
        )),
        Ok(args) => Ok(args),
        Err(problems) => Err((
            "The edited arguments do not fit the tool's schema:",
            problems.into_iter().map(String::from).collect(),
        )),
    }
}

/// How a decision the plugin's path refused is answered: the API server's
/// admission refused it (the person may not decide), or it came too late.
fn refused_status(e: &shown::DecideError) -> StatusCode {
    if matches!(e, shown::DecideError::Refused(_)) {
        StatusCode::FORBIDDEN
    } else {
        StatusCode::CONFLICT
    }
}

/// One run in the list.
#[derive(Serialize)]
struct RunRow {
    namespace: String,
    name: String,
    href: String,
    phase: String,
    step: String,
    waiting_on: String,
    tokens: String,
    cost: String,
    started: String,
    finished: String,
    /// A replay test's recorded run and tested Agent (it calls no tool and
    /// raises no approval): marked wherever the run is listed.
    test_of: Option<TestMark>,
    /// A fork's parent, linked, and the parent's last record it copied.
    fork_of: Option<ForkMark>,
}

#[derive(Serialize)]
struct ForkMark {
    run: String,
    href: String,
    seq: u64,
}

#[derive(Serialize)]
struct TestMark {
    run: String,
    href: String,
    agent: String,
}

fn run_row(r: &AgentRun) -> RunRow {
    let ns = r.metadata.namespace.clone().unwrap_or_default();
    let name = r.metadata.name.clone().unwrap_or_default();
    let s = r.status.clone().unwrap_or_default();
    let u = s.usage.clone().unwrap_or_default();
    RunRow {
        href: run_href(&ns, &name),
        phase: s
            .phase
            .map(|p| name_of(&p))
            .unwrap_or_else(|| "Pending".into()),
        step: s
            .step
            .as_ref()
            .map(|st| st.seq.to_string())
            .unwrap_or_default(),
        waiting_on: s.waiting_on.clone().unwrap_or_default(),
        tokens: format!("{} in / {} out", u.input_tokens, u.output_tokens),
        cost: format!("${:.4}", u.cost_usd),
        started: s
            .started_at
            .as_ref()
            .map(|t| t.0.to_string())
            .unwrap_or_default(),
        finished: s
            .finished_at
            .as_ref()
            .map(|t| t.0.to_string())
            .unwrap_or_default(),
        test_of: r.spec.test_of.as_ref().map(|t| TestMark {
            run: t.run.clone(),
            href: run_href(&ns, &t.run),
            agent: t.agent.clone(),
        }),
        fork_of: r.spec.fork_of.as_ref().map(|f| ForkMark {
            run: f.run.clone(),
            href: run_href(&ns, &f.run),
            seq: f.seq,
        }),
        namespace: ns,
        name,
    }
}

/// `/runs`.
pub async fn runs(State(c): State<Arc<Console>>, Extension(caller): Extension<Caller>) -> Response {
    let me = match me(&caller.client).await {
        Ok(m) => m,
        Err(e) => return failed(&c, StatusCode::BAD_GATEWAY, &e),
    };
    let (mut items, scope, problems) =
        list_everywhere::<AgentRun>(&caller.client, &c.namespaces, "agentruns").await;
    items.sort_by_key(|r| std::cmp::Reverse(r.metadata.creation_timestamp.clone().map(|t| t.0)));
    let rows: Vec<RunRow> = items.iter().map(run_row).collect();
    let ctx = json!({"who": me.user, "csrf": caller.csrf, "scope": scope, "problems": problems, "runs": rows});
    html(StatusCode::OK, c.render("runs.html", ctx))
}

/// One record of a run's timeline.
#[derive(Serialize)]
pub(crate) struct Entry {
    seq: u64,
    kind: String,
    time: String,
    worker: String,
    what: String,
    detail: String,
    marked: bool,
    /// A fork may begin after it (not the run's start, not its end).
    forkable: bool,
}

pub(crate) fn entry(r: &crate::store::Record, marked: bool) -> Entry {
    let step = crate::replay::Entry::decode(r.seq, r.kind.as_str(), &r.payload).ok();
    let mut what = step
        .as_ref()
        .and_then(|s| in_words(s).or_else(|| shown::describe_entry(s)))
        .unwrap_or_else(|| r.kind.as_str().to_string());
    if r.usage.input_tokens > 0 || r.usage.output_tokens > 0 {
        what.push_str(&format!(
            " — {} tokens in, {} out, ${:.6}",
            r.usage.input_tokens,
            r.usage.output_tokens,
            r.usage.cost_micros as f64 / 1e6
        ));
    }
    Entry {
        seq: r.seq,
        kind: r.kind.as_str().to_string(),
        time: r
            .created_at
            .map(|t| t.format("%Y-%m-%d %H:%M:%S%.3f").to_string())
            .unwrap_or_default(),
        worker: format!("{}#{}", r.worker.pod, r.worker.attempt),
        what: crate::text::excerpt(&what, 400),
        detail: serde_json::to_string_pretty(&r.payload).unwrap_or_default(),
        marked,
        forkable: r.seq >= 1 && r.kind != crate::store::StepKind::RunFinished,
    }
}

/// The timeline's words for the kinds it says more about than the audit
/// trail does (`None` for the others).
fn in_words(step: &crate::replay::Entry) -> Option<String> {
    use crate::replay::Entry as Decoded;
    Some(match step {
        Decoded::RunStarted(st) => format!(
            "started on {}, model {}, tool schema {}",
            agent_text(&st.versions, st.container.as_ref()),
            st.versions.model,
            short(&st.versions.tool_schema_hash)
        ),
        Decoded::VersionChanged(vc) => {
            // A container agent has no prompt: its image is what changes.
            let agent = match &vc.container {
                Some(c) => format!("now {}", container_text(c)),
                None => format!(
                    "prompt {} → {}",
                    vc.from.prompt_version, vc.to.prompt_version
                ),
            };
            format!(
                "version changed: {agent}, model {} → {}, tool schema {} → {}",
                vc.from.model,
                vc.to.model,
                short(&vc.from.tool_schema_hash),
                short(&vc.to.tool_schema_hash)
            )
        }
        // What the model is told, or (with `stop`) the end a step asks for,
        // such as a container agent's exit.
        Decoded::Observation(o) => match &o.stop {
            // Cut before the end is named, so a long text never hides it.
            Some(end) => format!(
                "{}: the step asks to end {}",
                crate::text::excerpt(&o.text, 300),
                name_of(&end.outcome)
            ),
            None => o.text.clone(),
        },
        _ => return None,
    })
}

/// What a run's agent is: its container (issue 41), or its prompt.
fn agent_text(v: &crate::runlog::records::Versions, c: Option<&Container>) -> String {
    match c {
        Some(c) => container_text(c),
        None => format!("prompt {} ({})", v.prompt_version, short(&v.prompt_hash)),
    }
}

/// `container IMAGE (COMMAND ARGS)`.
fn container_text(c: &Container) -> String {
    let argv: Vec<&str> = c
        .command
        .iter()
        .chain(&c.args)
        .map(String::as_str)
        .collect();
    format!("container {} ({})", c.image, argv.join(" "))
}

/// The first 12 characters of a hash.
fn short(h: &str) -> String {
    h.chars().take(12).collect()
}

/// The timeline of a run: its records and the verdict in words.
struct Timeline {
    entries: Vec<Entry>,
    verified: bool,
    verdict: String,
    problems: Vec<String>,
    next: u64,
    /// What the run started on (its seq 0), in words.
    agent: Option<String>,
}

async fn timeline(
    c: &Console,
    caller: &Caller,
    ns: &str,
    name: &str,
    from: u64,
) -> Result<Timeline, Refusal> {
    let k = Kube::new(caller.client.clone(), ns);
    let read = log::read_api(&k, name, &c.controller_namespace)
        .await
        .map_err(|e| Refusal::new(crate::text::chain(&e)))?;
    let v = &read.verdict;
    let verdict = if v.ok() {
        format!(
            "verified: {} records, chain intact, {}, {} controller records signed",
            v.head.len,
            v.anchored,
            v.signed.len()
        )
    } else {
        // The plugin prints the problems before its verdict; here they follow it.
        format!(
            "NOT VERIFIED: {}",
            log::summary(v).replace("(see above)", "(see below)")
        )
    };
    let mut problems = v.notes.clone();
    problems.extend(v.problems());
    Ok(Timeline {
        agent: read.records.first().and_then(started_on),
        next: read.records.last().map_or(0, |r| r.seq + 1).max(from),
        entries: read
            .records
            .iter()
            .filter(|r| r.seq >= from)
            .map(|r| entry(r, v.marks(r.seq)))
            .collect(),
        verified: v.ok(),
        verdict,
        problems,
    })
}

/// What the run started on, if `r` is its `RunStarted`.
fn started_on(r: &crate::store::Record) -> Option<String> {
    match crate::replay::Entry::decode(r.seq, r.kind.as_str(), &r.payload).ok()? {
        crate::replay::Entry::RunStarted(st) => {
            Some(agent_text(&st.versions, st.container.as_ref()))
        }
        _ => None,
    }
}

/// `/runs/{ns}/{name}`.
pub async fn run(
    State(c): State<Arc<Console>>,
    Extension(caller): Extension<Caller>,
    Path((ns, name)): Path<(String, String)>,
) -> Response {
    let me = match me(&caller.client).await {
        Ok(m) => m,
        Err(e) => return failed(&c, StatusCode::BAD_GATEWAY, &e),
    };
    let runs: Api<AgentRun> = Api::namespaced(caller.client.clone(), &ns);
    let r = match runs.get(&name).await {
        Ok(r) => r,
        Err(e) => {
            return failed(
                &c,
                kube_status(&e),
                &kube_words(&format!("reading run {ns}/{name}"), &e),
            );
        }
    };
    let s = r.status.clone().unwrap_or_default();
    let live = !s.phase.is_some_and(|p| p.is_terminal());
    let (tl, log_error) = match timeline(&c, &caller, &ns, &name, 0).await {
        Ok(t) => (Some(t), None),
        Err(e) => (None, Some(e.to_string())),
    };
    let approvals: Api<Approval> = Api::namespaced(caller.client.clone(), &ns);
    let related: Vec<Value> = approvals
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .iter()
        .filter(|a| a.spec.run_ref.name == name)
        .map(|a| {
            let rr = row(a, &me);
            json!({"name": rr.name, "href": rr.href, "tool": rr.tool, "state": rr.state, "decided": rr.decided})
        })
        .collect();
    let ctx = json!({
        "who": me.user, "csrf": caller.csrf,
        "run": run_row(&r),
        "error": s.error, "result": s.result,
        // The log says what the run started on (a container has no prompt).
        "pinned": s.pinned.as_ref().map(|p| json!({
            "agent": tl.as_ref().and_then(|t| t.agent.clone())
                .unwrap_or_else(|| format!("prompt {}", p.prompt_version)),
            "model": p.model})),
        "approval": s.approval.as_ref().map(|p| json!({"name": p.name, "href": approval_href(&ns, &p.name)})),
        "approvals": related,
        "live": live,
        "follow": format!("{}/records", run_href(&ns, &name)),
        "fork_action": format!("{}/fork", run_href(&ns, &name)),
        "log_error": log_error,
        "entries": tl.as_ref().map(|t| &t.entries),
        "verified": tl.as_ref().map(|t| t.verified),
        "verdict": tl.as_ref().map(|t| t.verdict.clone()),
        "problems": tl.as_ref().map(|t| t.problems.clone()).unwrap_or_default(),
        "next": tl.as_ref().map_or(0, |t| t.next),
    });
    html(StatusCode::OK, c.render("run.html", ctx))
}

/// On to `to` (a page of the console) after a write.
fn see_other(to: &str) -> Response {
    let mut res = StatusCode::SEE_OTHER.into_response();
    if let Ok(l) = HeaderValue::from_str(to) {
        res.headers_mut().insert(header::LOCATION, l);
    }
    res
}

/// `POST /runs/{ns}/{name}/fork` (`seq`): "fork from here" on a record of
/// the timeline, as `kubectl agentrun fork NAME --at SEQ` with the
/// person's own identity: the API server and the controller judge it (may
/// they create runs here, read this run's log). On to the fork's page.
pub async fn fork(
    State(c): State<Arc<Console>>,
    Extension(caller): Extension<Caller>,
    Path((ns, name)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let pairs: Vec<(String, String)> = url::form_urlencoded::parse(&body).into_owned().collect();
    let seq = pairs
        .iter()
        .find(|(k, _)| k == "seq")
        .and_then(|(_, v)| v.parse::<u64>().ok());
    let Some(seq) = seq.filter(|s| *s >= 1) else {
        return failed(
            &c,
            StatusCode::BAD_REQUEST,
            "seq: the record to fork from is a seq of 1 or more",
        );
    };
    let runs: Api<AgentRun> = Api::namespaced(caller.client.clone(), &ns);
    let parent = match runs.get(&name).await {
        Ok(r) => r,
        Err(e) => {
            return failed(
                &c,
                kube_status(&e),
                &kube_words(&format!("reading run {ns}/{name}"), &e),
            );
        }
    };
    let fork = crate::client::fork_of(&parent, &name, seq, None, None);
    match runs.create(&kube::api::PostParams::default(), &fork).await {
        Ok(created) => {
            let to = run_href(&ns, created.metadata.name.as_deref().unwrap_or_default());
            see_other(&to)
        }
        Err(e) => failed(
            &c,
            kube_status(&e),
            &kube_words(&format!("forking run {ns}/{name} at {seq}"), &e),
        ),
    }
}

/// `/runs/{ns}/{name}/records?fromSeq=N`: the records from N on, as JSON
/// (the page's script shows them with `textContent`), the verdict and the
/// phase.
pub async fn records(
    State(c): State<Arc<Console>>,
    Extension(caller): Extension<Caller>,
    Path((ns, name)): Path<(String, String)>,
    RawQuery(q): RawQuery,
) -> Response {
    let from: u64 = query_param(q.as_deref(), "fromSeq")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let runs: Api<AgentRun> = Api::namespaced(caller.client.clone(), &ns);
    let phase = match runs.get(&name).await {
        Ok(r) => r.status.and_then(|s| s.phase),
        Err(e) => {
            return (
                kube_status(&e),
                axum::Json(json!({"error": kube_words("reading the run", &e)})),
            )
                .into_response();
        }
    };
    match timeline(&c, &caller, &ns, &name, from).await {
        Ok(t) => axum::Json(json!({
            "records": t.entries, "next": t.next, "verified": t.verified, "verdict": t.verdict,
            "phase": phase.map(|p| name_of(&p)), "finished": phase.is_some_and(|p| p.is_terminal()),
        }))
        .into_response(),
        Err(e) => (
            StatusCode::BAD_GATEWAY,
            axum::Json(json!({"error": e.as_str()})),
        )
            .into_response(),
    }
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut res = body.into_response();
    res.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    res.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    res
}

pub async fn stylesheet() -> Response {
    asset(
        "text/css; charset=utf-8",
        include_str!("static/console.css"),
    )
}

pub async fn script() -> Response {
    asset(
        "text/javascript; charset=utf-8",
        include_str!("static/console.js"),
    )
}

pub async fn not_found(State(c): State<Arc<Console>>) -> Response {
    failed(&c, StatusCode::NOT_FOUND, "no such page")
}

#[cfg(test)]
mod decide_tests {
    use super::*;

    fn form(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_decision_form_names_its_verdict_and_a_rejection_its_reason() {
        assert_eq!(
            verdict_of(&form(&[("verdict", "Approve")])),
            Ok((Verdict::Approve, None))
        );
        assert_eq!(
            verdict_of(&form(&[("verdict", "Edit"), ("reason", "  too much  ")])),
            Ok((Verdict::Edit, Some("too much".into())))
        );
        assert_eq!(
            verdict_of(&form(&[("verdict", "Reject"), ("reason", "no")])),
            Ok((Verdict::Reject, Some("no".into())))
        );
        assert_eq!(
            verdict_of(&form(&[("verdict", "Reject"), ("reason", "   ")])),
            Err(Unasked::Reason)
        );
        assert_eq!(verdict_of(&form(&[])), Err(Unasked::Verdict));
        assert_eq!(
            verdict_of(&form(&[("verdict", "Expired")])),
            Err(Unasked::Verdict)
        );
    }

    #[test]
    fn an_edit_gives_other_arguments_that_fit_the_tools_schema() {
        let schema = json!({"type": "object", "required": ["amount"],
            "properties": {"amount": {"type": "number", "minimum": 0}}});
        let proposed = json!({"amount": 500});
        let pairs = form(&[("arg.amount", "300")]);
        assert_eq!(
            edited(Some(&schema), &proposed, &pairs),
            Ok(json!({"amount": 300}))
        );
        let same = form(&[("arg.amount", "500")]);
        let (error, problems) = edited(Some(&schema), &proposed, &same).unwrap_err();
        assert!(error.contains("approve instead") && problems.is_empty());
        let negative = form(&[("arg.amount", "-1")]);
        let (error, problems) = edited(Some(&schema), &proposed, &negative).unwrap_err();
        assert!(
            error.contains("do not fit") && !problems.is_empty(),
            "{problems:?}"
        );
    }

    #[test]
    fn a_decision_the_api_server_refuses_is_forbidden_and_a_late_one_a_conflict() {
        let refused = shown::DecideError::Refused("not an approver".into());
        assert_eq!(refused_status(&refused), StatusCode::FORBIDDEN);
        let late = shown::DecideError::AlreadyDecided {
            me: "alice".into(),
            name: "a".into(),
        };
        assert_eq!(refused_status(&late), StatusCode::CONFLICT);
    }
}
