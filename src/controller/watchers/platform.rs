//! The platform owner's word on a run (`AgentPolicy` in its namespace,
//! `ClusterAgentPolicy` everywhere): read when a run starts, follows its
//! Agent or gets a Job; the pure part decides.

use futures::StreamExt;
use kube::api::{Api, ListParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};

use crate::api::REQUESTER_ANNOTATION as REQUESTER;
use crate::api::{
    AgentPolicy, AgentRun, AgentTemplate, ApprovalPolicy, ApprovalRule, ClusterAgentPolicy,
    DefaultAction, PlatformAdded, PlatformApproval, PlatformDefault, PlatformReadOnly,
    PlatformRule,
};
use crate::controller::error::Error;

/// The policies that apply to one namespace, in the order they are checked.
#[derive(Clone, Debug, Default)]
pub struct Platform {
    /// (where the rules come from, the rules): cluster policies first, by name.
    pub approval: Vec<(String, PlatformApproval)>,
    /// Which policy forbids inline agents, if one does.
    pub forbids_inline: Option<String>,
    /// Secrets of the namespace runs may use, with their allowed endpoints.
    pub secrets: Vec<crate::api::AllowedSecret>,
}

/// The policies as the controller's watches see them (kept in memory, so
/// judging a Job costs no API call).
#[derive(Clone)]
pub struct PolicyCache {
    pub cluster: Store<ClusterAgentPolicy>,
    pub local: Store<AgentPolicy>,
}

impl PolicyCache {
    /// Starts following both kinds of policy (namespace-scoped ones in `ns`
    /// only, when the controller watches one namespace).
    pub fn follow(
        client: &kube::Client,
        ns: Option<&str>,
        watches: &crate::controller::watchers::health::Watches,
    ) -> PolicyCache {
        let (cluster, cluster_writer) = reflector::store();
        let (local, local_writer) = reflector::store();
        let local_api: Api<AgentPolicy> = match ns {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        };
        let cluster_api: Api<ClusterAgentPolicy> = Api::all(client.clone());
        tokio::spawn(drain(
            watches
                .follow(
                    "clusteragentpolicies",
                    watcher(cluster_api, watcher::Config::default()),
                )
                .default_backoff()
                .reflect(cluster_writer),
        ));
        tokio::spawn(drain(
            watches
                .follow(
                    "agentpolicies",
                    watcher(local_api, watcher::Config::default()),
                )
                .default_backoff()
                .reflect(local_writer),
        ));
        PolicyCache { cluster, local }
    }

    /// Waits until both watches have listed. Called once, before any
    /// reconcile: kube's readiness signal wakes only the last of several
    /// concurrent waiters, so reconciles must never be the first to wait.
    pub async fn ready(&self) -> Result<(), reflector::store::WriterDropped> {
        self.cluster.wait_until_ready().await?;
        self.local.wait_until_ready().await
    }
}

/// Polls a watch to its end; its errors are reported by `Watches::follow`.
async fn drain<S: futures::Stream + Send>(stream: S) {
    futures::pin_mut!(stream);
    while stream.next().await.is_some() {}
}

/// The policies of the run's namespace and of the cluster: from the
/// watches' caches once they have listed, else listed now.
pub async fn read(
    client: &kube::Client,
    cache: Option<&PolicyCache>,
    ns: &str,
) -> Result<Platform, Error> {
    let read = |source| Error::Read {
        what: "agent policies",
        source,
    };
    if let Some(c) = cache
        && c.cluster.wait_until_ready().await.is_ok()
        && c.local.wait_until_ready().await.is_ok()
    {
        let cluster = c.cluster.state().iter().map(|p| (**p).clone()).collect();
        let local = c
            .local
            .state()
            .iter()
            .filter(|p| p.metadata.namespace.as_deref() == Some(ns))
            .map(|p| (**p).clone())
            .collect();
        return Ok(Platform::from_policies(cluster, local));
    }
    let cluster: Api<ClusterAgentPolicy> = Api::all(client.clone());
    let local: Api<AgentPolicy> = Api::namespaced(client.clone(), ns);
    let cluster = cluster
        .list(&ListParams::default())
        .await
        .map_err(read)?
        .items;
    let local = local
        .list(&ListParams::default())
        .await
        .map_err(read)?
        .items;
    Ok(Platform::from_policies(cluster, local))
}

impl Platform {
    /// Cluster policies first, then the namespace's, each by name.
    pub fn from_policies(
        mut cluster: Vec<ClusterAgentPolicy>,
        mut local: Vec<AgentPolicy>,
    ) -> Platform {
        cluster.sort_by_key(|p| p.metadata.name.clone());
        local.sort_by_key(|p| p.metadata.name.clone());
        let mut platform = Platform::default();
        for p in cluster {
            let name = format!("ClusterAgentPolicy/{}", p.metadata.name.unwrap_or_default());
            if p.spec.forbid_inline_agents && platform.forbids_inline.is_none() {
                platform.forbids_inline = Some(name.clone());
            }
            platform.approval.extend(p.spec.approval.map(|a| (name, a)));
        }
        for p in local {
            let name = format!("AgentPolicy/{}", p.metadata.name.unwrap_or_default());
            if p.spec.forbid_inline_agents && platform.forbids_inline.is_none() {
                platform.forbids_inline = Some(name.clone());
            }
            platform.secrets.extend(p.spec.allowed_secrets);
            platform.approval.extend(p.spec.approval.map(|a| (name, a)));
        }
        platform
    }
}

/// What a run waits for before the platform lets it go on: something a
/// later object (an AgentPolicy applied after the run) can still give.
#[derive(Clone, Debug, PartialEq)]
pub struct Awaited {
    /// For `status.waitingOn`: `agentpolicy/allowedSecrets/NAME`.
    pub waiting_on: String,
    /// Why, naming the field and what would end the wait.
    pub message: String,
}

impl Platform {
    /// What the run waits for, if anything: its model's Secret is not (yet)
    /// listed in any AgentPolicy of its namespace. Unlike a refusal, an
    /// AgentPolicy applied later (a GitOps apply in any file order) ends it.
    pub fn awaited(&self, template: &AgentTemplate) -> Option<Awaited> {
        let key = template.model.secret_ref.as_ref()?;
        if self.secrets.iter().any(|s| s.name == key.name) {
            return None;
        }
        Some(Awaited {
            waiting_on: format!("agentpolicy/allowedSecrets/{}", key.name),
            message: format!(
                "spec.model.secretRef: Secret {:?} is not listed in an AgentPolicy's allowedSecrets in this namespace \
                 (yet): the run waits until one lists it, or until spec.deadline passes",
                key.name
            ),
        })
    }
}

impl Platform {
    /// Why the run may not start or get a Job under these policies, naming
    /// the field; `None` when it may.
    pub fn refusal(&self, run: &AgentRun, template: &AgentTemplate) -> Option<String> {
        if let Some(why) = self.forbidden_inline(run) {
            return Some(why);
        }
        let key = template.model.secret_ref.as_ref()?;
        let Some(allowed) = self.secrets.iter().find(|s| s.name == key.name) else {
            return Some(format!(
                "spec.model.secretRef: Secret {:?} is not listed in an AgentPolicy's allowedSecrets in this namespace; \
                 a run may only hand its step pods Secrets the platform owner opted in",
                key.name
            ));
        };
        let endpoint =
            template
                .model
                .endpoint
                .as_deref()
                .unwrap_or(match template.model.provider {
                    crate::api::Provider::OpenAI => crate::model::OPENAI_DEFAULT_ENDPOINT,
                    crate::api::Provider::Anthropic => crate::model::ANTHROPIC_DEFAULT_ENDPOINT,
                });
        if !allowed.endpoints.is_empty()
            && let Some(why) = crate::policy::endpoint::ambiguity(endpoint)
        {
            return Some(format!(
                "spec.model.endpoint: Secret {:?} may only be sent to {:?}, and the endpoint is ambiguous: {why}",
                key.name, allowed.endpoints
            ));
        }
        let namespace = kube::ResourceExt::namespace(run).unwrap_or_default();
        if !allowed.endpoints.is_empty()
            && !allowed
                .endpoints
                .iter()
                .any(|p| crate::policy::endpoint::allows(endpoint, p, &namespace))
        {
            return Some(format!(
                "spec.model.endpoint: Secret {:?} may only be sent to {:?}, not to {endpoint:?}",
                key.name, allowed.endpoints
            ));
        }
        None
    }

    /// Why the run's inline agent is refused, if a policy forbids inline agents.
    pub fn forbidden_inline(&self, run: &AgentRun) -> Option<String> {
        let by = self
            .forbids_inline
            .as_ref()
            .filter(|_| run.spec.agent.is_some())?;
        Some(format!(
            "spec.agent: inline agents are forbidden here by {by}; name an Agent in spec.agentRef"
        ))
    }

    /// The policy forbidding inline agents, if one does.
    pub fn forbids_inline(&self) -> Option<&str> {
        self.forbids_inline.as_deref()
    }

    /// Why these policies refuse `governed` (as [`Platform::govern`] made
    /// it) for `run`, and what the run waits for instead, if anything: what a
    /// later object can still give is waited for; only what none can fix is
    /// refused.
    pub fn judge(
        &self,
        run: &AgentRun,
        governed: &AgentTemplate,
    ) -> (Option<String>, Option<Awaited>) {
        let awaited = self.awaited(governed);
        let refused = self
            .forbidden_inline(run)
            .or_else(|| awaited.is_none().then(|| self.refusal(run, governed))?)
            .or_else(|| Platform::unjudgeable(run, governed));
        (refused, awaited)
    }

    /// Why the governed agent cannot judge this run: separation of duties
    /// without a known requester (a run created where the admission policies
    /// were not installed) would let anyone approve.
    pub fn unjudgeable(run: &AgentRun, governed: &AgentTemplate) -> Option<String> {
        let sod = governed
            .approval
            .as_ref()
            .is_some_and(|p| p.separation_of_duties);
        let known = run
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.get(REQUESTER).is_some_and(|r| !r.is_empty()));
        (sod && !known).then(|| {
            format!(
                "metadata.annotations[{REQUESTER}] is missing, so separation of duties cannot be enforced; \
                 install the admission policies (crds/admission.yaml) and create the run again"
            )
        })
    }

    /// The agent with the platform's approval rules put first: what the run
    /// pins in `RunStarted` and is judged by.
    pub fn govern(&self, template: &AgentTemplate) -> AgentTemplate {
        let mut governed = template.clone();
        governed.approval = effective_policy(template.approval.as_ref(), &self.approval);
        governed
    }

    /// An agent a log pinned (governed by the platform of its day), governed
    /// by these policies instead: what a fork that keeps its parent's agent
    /// goes on with.
    pub fn govern_again(&self, pinned: &AgentTemplate) -> AgentTemplate {
        let mut own = pinned.clone();
        own.approval = agents_own(pinned.approval.as_ref());
        self.govern(&own)
    }
}

/// Platform rules first (named after their policy), then the agent's; the
/// stricter default action and separation of duties win. A platform rule
/// selects calls by endpoint only (`tool` is `*` in the pinned form: the
/// agent author chooses tool names), and the platform's default is pinned
/// with its own read-only list beside the agent's default.
fn effective_policy(
    agent: Option<&ApprovalPolicy>,
    platform: &[(String, PlatformApproval)],
) -> Option<ApprovalPolicy> {
    // `platformAdded` is the controller's to write: whatever an agent's
    // policy says of it (the API server prunes it) is never pinned, or a
    // fork would take the agent's own rules off.
    let own = agent.cloned().map(|mut p| {
        p.platform_added = None;
        p
    });
    if platform.is_empty() {
        return own;
    }
    let mut policy = own.unwrap_or_default();
    let agent_action = policy.default_action;
    let mut added = PlatformAdded {
        rules: 0,
        separation_of_duties: policy.separation_of_duties,
        default_approvers: policy.default_approvers.clone(),
    };
    let mut by = Vec::new();
    let mut rules: Vec<ApprovalRule> = Vec::new();
    for (source, p) in platform {
        rules.extend(p.rules.iter().map(|r| pinned_rule(source, r)));
        policy.separation_of_duties |= p.separation_of_duties;
        if p.default_action == Some(DefaultAction::RequireApprovalForMutating) {
            by.push(PlatformReadOnly {
                policy: source.clone(),
                read_only: p.read_only.clone(),
            });
            // The stricter action, for any reader of the log that does not
            // know `platformDefault` (it then trusts `readOnly`, as before).
            if policy.default_action != DefaultAction::RequireApprovalForMutating {
                policy.default_action = DefaultAction::RequireApprovalForMutating;
                policy.default_approvers = p.default_approvers.clone().or(policy.default_approvers);
            }
        }
    }
    policy.platform_default = (!by.is_empty()).then_some(PlatformDefault { agent_action, by });
    added.rules = u32::try_from(rules.len()).unwrap_or(u32::MAX);
    policy.platform_added = Some(added);
    rules.append(&mut policy.rules);
    policy.rules = rules;
    Some(policy)
}

/// The agent's own policy under a pinned one: what [`effective_policy`]
/// added taken off (`platformAdded` says what). A policy pinned before
/// that record was kept is returned whole: its platform parts cannot be
/// told from the agent's, so they stay (stricter, never weaker).
fn agents_own(pinned: Option<&ApprovalPolicy>) -> Option<ApprovalPolicy> {
    let mut policy = pinned?.clone();
    let Some(added) = policy.platform_added.take() else {
        return Some(policy);
    };
    let platform_rules = usize::try_from(added.rules).unwrap_or(usize::MAX);
    policy.rules.drain(..platform_rules.min(policy.rules.len()));
    policy.separation_of_duties = added.separation_of_duties;
    policy.default_approvers = added.default_approvers;
    if let Some(default) = policy.platform_default.take() {
        policy.default_action = default.agent_action;
    }
    Some(policy).filter(|p| *p != ApprovalPolicy::default())
}

/// A platform rule as the run pins it. A rule written before `tool` was
/// restricted to `*` (the CRD refuses other names now) still names a tool:
/// since that name proves nothing about the call, it applies to every call.
fn pinned_rule(source: &str, r: &PlatformRule) -> ApprovalRule {
    let PlatformRule {
        name,
        tool: _,
        selector,
        when,
        approvers,
        required_approvals,
        expires_after,
        on_expiry,
        escalate_to,
        max_escalations,
        dependencies,
    } = r.clone();
    ApprovalRule {
        name: format!("{source}/{name}"),
        tool: "*".into(),
        selector,
        when,
        approvers,
        required_approvals,
        expires_after,
        on_expiry,
        escalate_to,
        max_escalations,
        dependencies,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{AllowedSecret, Approvers, CallMatch, EndpointMatch, McpMatch, SecretKeyRef};
    use crate::policy::{Call, Classification, Network};
    use serde_json::json;

    fn rule(name: &str, tool: &str, when: Option<&str>) -> ApprovalRule {
        ApprovalRule {
            name: name.into(),
            tool: tool.into(),
            when: when.map(str::to_string),
            approvers: Approvers {
                users: vec!["alice".into()],
                groups: vec![],
            },
            required_approvals: 1,
            expires_after: "1h".into(),
            ..Default::default()
        }
    }

    fn template(secret: Option<&str>, endpoint: Option<&str>) -> AgentTemplate {
        let mut t: AgentTemplate = serde_json::from_value(json!({
            "prompt": {"version": "v1", "system": "s"},
            "model": {"provider": "OpenAI", "name": "m"}
        }))
        .expect("template");
        t.model.secret_ref = secret.map(|s| SecretKeyRef {
            name: s.into(),
            key: "apiKey".into(),
        });
        t.model.endpoint = endpoint.map(str::to_string);
        t
    }

    fn run(inline: bool) -> AgentRun {
        let mut r = AgentRun::new("r", Default::default());
        if inline {
            r.spec.agent = Some(template(None, None));
        }
        r
    }

    fn platform_rule(name: &str, selector: Option<CallMatch>) -> PlatformRule {
        PlatformRule {
            name: name.into(),
            selector,
            approvers: Approvers {
                users: vec!["alice".into()],
                groups: vec![],
            },
            required_approvals: 1,
            expires_after: "1h".into(),
            ..Default::default()
        }
    }

    fn endpoints(urls: &[&str]) -> CallMatch {
        CallMatch {
            endpoints: urls
                .iter()
                .map(|u| EndpointMatch { url: u.to_string() })
                .collect(),
            mcp: vec![],
        }
    }

    fn finance(p: PlatformApproval) -> Platform {
        Platform {
            approval: vec![("ClusterAgentPolicy/finance".into(), p)],
            ..Default::default()
        }
    }

    fn classify(governed: &AgentTemplate, tool: &str) -> Classification {
        classify_on(governed, tool, &Network::of("shop"))
    }

    fn classify_on(governed: &AgentTemplate, tool: &str, network: &Network) -> Classification {
        let call = Call::of(governed, tool, network);
        crate::policy::classify(governed.approval.as_ref(), &call, &json!({"amount": 5000}))
    }

    /// The agent of the attack: the refund endpoint under another name,
    /// claimed read-only, and an MCP ticket tool under a local name.
    fn renaming_agent() -> AgentTemplate {
        let mut t = template(None, None);
        t.tools = serde_json::from_value(json!([
            {"name": "refund_customer", "http": {"url": "https://pay.example/v1/%72efunds", "readOnly": true}},
            {"name": "lookup_order", "http": {"url": "https://pay.example/v1/orders", "readOnly": true}},
            {"name": "open_case", "mcp": {"url": "https://mcp.example/mcp", "tool": "create_ticket"}}
        ]))
        .expect("tools");
        t
    }

    /// A fork keeps its parent's agent but not the platform of its
    /// parent's day: what that platform added comes off, today's goes on,
    /// exactly as a new run of the agent would pin it (issue 50).
    #[test]
    fn a_pinned_agent_governed_again_is_the_agent_as_todays_platform_governs_it() {
        let mut agent = renaming_agent();
        agent.approval = Some(ApprovalPolicy {
            rules: vec![rule("agents-own", "open_case", None)],
            default_approvers: Some(Approvers {
                users: vec!["bob".into()],
                groups: vec![],
            }),
            ..Default::default()
        });
        let then = finance(PlatformApproval {
            rules: vec![platform_rule(
                "refunds",
                Some(endpoints(&["https://pay.example/v1/refunds"])),
            )],
            separation_of_duties: true,
            default_action: Some(DefaultAction::RequireApprovalForMutating),
            default_approvers: Some(Approvers {
                users: vec!["carol".into()],
                groups: vec![],
            }),
            ..Default::default()
        });
        let pinned = then.govern(&agent);
        assert_eq!(pinned.approval.as_ref().unwrap().rules.len(), 2);
        let today = Platform {
            approval: vec![(
                "AgentPolicy/payments".into(),
                PlatformApproval {
                    rules: vec![platform_rule(
                        "all",
                        Some(endpoints(&["https://pay.example/v1/orders"])),
                    )],
                    ..Default::default()
                },
            )],
            ..Default::default()
        };
        for now in [today.clone(), Platform::default(), then.clone()] {
            assert_eq!(now.govern_again(&pinned), now.govern(&agent));
        }
        // Governed again and again, it stays what today's platform makes of it.
        let twice = then.govern_again(&then.govern_again(&pinned));
        assert_eq!(twice, pinned);
        // Today's rule catches the orders endpoint; the separation of
        // duties of the parent's day is gone with that day's platform.
        let fork = today.govern_again(&pinned);
        assert!(matches!(
            classify(&fork, "lookup_order"),
            Classification::RequireApproval(_)
        ));
        assert!(!fork.approval.as_ref().unwrap().separation_of_duties);
        // An agent cannot pin `platformAdded` itself (it would take its
        // own rules off in a fork).
        let mut forged = agent.clone();
        forged.approval.as_mut().unwrap().platform_added = Some(PlatformAdded {
            rules: 1,
            ..Default::default()
        });
        assert_eq!(
            Platform::default().govern(&forged),
            Platform::default().govern(&agent)
        );
        assert_eq!(today.govern(&forged), today.govern(&agent));
        // A pin from before `platformAdded` cannot be taken apart: it keeps
        // every rule it had, under today's.
        let mut old = pinned.clone();
        old.approval.as_mut().unwrap().platform_added = None;
        let kept = today.govern_again(&old);
        let names: Vec<_> = kept
            .approval
            .unwrap()
            .rules
            .into_iter()
            .map(|r| r.name)
            .collect();
        assert_eq!(
            names,
            [
                "AgentPolicy/payments/all",
                "ClusterAgentPolicy/finance/refunds",
                "agents-own"
            ]
        );
    }

    #[test]
    fn platform_rules_judge_before_the_agents_and_cannot_be_weakened() {
        let mut agent = template(None, None);
        agent.approval = Some(ApprovalPolicy {
            rules: vec![rule("small", "issue_refund", Some("args.amount > 1000"))],
            ..Default::default()
        });
        let platform = finance(PlatformApproval {
            rules: vec![platform_rule("any-call", None)],
            separation_of_duties: true,
            ..Default::default()
        });
        let governed = platform.govern(&agent).approval.expect("a policy");
        assert!(governed.separation_of_duties);
        let names: Vec<&str> = governed.rules.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["ClusterAgentPolicy/finance/any-call", "small"]);
        let call = Call::named("issue_refund", false);
        match crate::policy::classify(Some(&governed), &call, &json!({"amount": 5})) {
            Classification::RequireApproval(g) => {
                assert_eq!(g.rule, "ClusterAgentPolicy/finance/any-call")
            }
            other => panic!("a small refund escaped the platform rule: {other:?}"),
        }
        // An agent without any policy is governed too.
        assert!(platform.govern(&template(None, None)).approval.is_some());
        // No platform policy: the agent's own, unchanged.
        assert_eq!(Platform::default().govern(&agent), agent);
    }

    #[test]
    fn a_platform_rule_follows_the_endpoint_whatever_the_tool_is_called() {
        let platform = finance(PlatformApproval {
            rules: vec![platform_rule(
                "refunds",
                Some(CallMatch {
                    endpoints: vec![EndpointMatch {
                        url: "https://pay.example/v1/refunds".into(),
                    }],
                    mcp: vec![McpMatch {
                        server: "https://mcp.example/mcp".into(),
                        tool: Some("create_ticket".into()),
                    }],
                }),
            )],
            ..Default::default()
        });
        let governed = platform.govern(&renaming_agent());
        for tool in ["refund_customer", "open_case"] {
            assert!(
                matches!(classify(&governed, tool), Classification::RequireApproval(g)
                    if g.rule == "ClusterAgentPolicy/finance/refunds"),
                "{tool} escaped the rule on its endpoint"
            );
        }
        assert_eq!(classify(&governed, "lookup_order"), Classification::Allow);
    }

    /// The review's attack: the platform gates every call to the refund
    /// endpoint and the ticket tool of the MCP server on 127.0.0.1; the
    /// author declares the same server as `localhost`, `[::ffff:127.0.0.1]`
    /// and in decimal.
    #[test]
    fn a_platform_rule_on_loopback_catches_every_spelling_of_the_server() {
        let platform = finance(PlatformApproval {
            rules: vec![platform_rule(
                "refunds",
                Some(CallMatch {
                    endpoints: vec![EndpointMatch {
                        url: "http://127.0.0.1:9090/tools/issue_refund".into(),
                    }],
                    mcp: vec![McpMatch {
                        server: "http://127.0.0.1:9090/mcp".into(),
                        tool: Some("create_ticket".into()),
                    }],
                }),
            )],
            ..Default::default()
        });
        let hosts = [
            "localhost",
            "[::ffff:127.0.0.1]",
            "2130706433",
            "LOCALHOST.",
            "0x7f.1",
        ];
        for host in hosts {
            let mut agent = template(None, None);
            agent.tools = serde_json::from_value(json!([
                {"name": "refund", "http": {"url": format!("http://{host}:9090/tools/issue_refund")}},
                {"name": "ticket", "mcp": {"url": format!("http://{host}:9090/mcp"), "tool": "create_ticket"}},
                {"name": "lookup", "http": {"url": format!("http://{host}:9090/tools/lookup_order")}}
            ]))
            .expect("tools");
            let governed = platform.govern(&agent);
            for tool in ["refund", "ticket"] {
                assert!(
                    matches!(classify(&governed, tool), Classification::RequireApproval(g)
                        if g.rule == "ClusterAgentPolicy/finance/refunds"),
                    "{tool} at {host} escaped the rule written for 127.0.0.1"
                );
            }
            assert_eq!(
                classify(&governed, "lookup"),
                Classification::Allow,
                "{host}"
            );
        }
    }

    /// A rule for a Service selects its calls by every name, its ClusterIP,
    /// and any name the step pod resolved to that address.
    #[test]
    fn a_platform_rule_on_a_service_catches_its_names_and_addresses() {
        let platform = finance(PlatformApproval {
            rules: vec![platform_rule(
                "refunds",
                Some(endpoints(&["http://pay.payments/refunds"])),
            )],
            ..Default::default()
        });
        let mut network = Network::of("payments");
        for name in ["pay.payments.svc.cluster.local", "alias.example"] {
            network
                .resolved
                .insert(name.into(), vec!["10.96.0.12".parse().unwrap()]);
        }
        for host in [
            "pay",
            "pay.payments.svc",
            "pay.payments.svc.cluster.local.",
            "10.96.0.12",
            "[::ffff:a60:c]",
            "alias.example",
        ] {
            let mut agent = template(None, None);
            agent.tools = serde_json::from_value(json!([
                {"name": "refund", "http": {"url": format!("http://{host}/refunds")}}
            ]))
            .expect("tools");
            let governed = platform.govern(&agent);
            assert!(
                matches!(
                    classify_on(&governed, "refund", &network),
                    Classification::RequireApproval(_)
                ),
                "{host} escaped the rule on pay.payments"
            );
        }
    }

    #[test]
    fn the_platform_default_believes_only_the_platforms_read_only_list() {
        let mut platform = finance(PlatformApproval {
            default_action: Some(DefaultAction::RequireApprovalForMutating),
            ..Default::default()
        });
        let governed = platform.govern(&renaming_agent());
        // The author's readOnly counts for nothing here.
        for tool in [
            "refund_customer",
            "lookup_order",
            "open_case",
            "no_such_tool",
        ] {
            assert!(
                matches!(classify(&governed, tool), Classification::RequireApproval(g)
                    if g.rule == "ClusterAgentPolicy/finance/default"),
                "{tool} passed the platform's default"
            );
        }
        platform.approval[0].1.read_only = Some(endpoints(&["https://pay.example/v1/orders"]));
        let governed = platform.govern(&renaming_agent());
        assert_eq!(classify(&governed, "lookup_order"), Classification::Allow);
        assert!(matches!(
            classify(&governed, "refund_customer"),
            Classification::RequireApproval(_)
        ));
        // An older reader of the log still sees the stricter default.
        let pinned = governed.approval.expect("policy");
        assert_eq!(
            pinned.default_action,
            DefaultAction::RequireApprovalForMutating
        );
        // The agent's own default still gates what the agent does not
        // declare read-only, even where the platform lists it.
        let mut agent = renaming_agent();
        agent.tools[1].http.as_mut().unwrap().read_only = false;
        agent.approval = Some(ApprovalPolicy {
            default_action: DefaultAction::RequireApprovalForMutating,
            ..Default::default()
        });
        let governed = platform.govern(&agent);
        assert!(
            matches!(classify(&governed, "lookup_order"), Classification::RequireApproval(g) if g.rule == "default")
        );
    }

    #[test]
    fn a_name_only_platform_rule_from_before_applies_to_every_call() {
        let mut legacy = platform_rule("every-refund", None);
        legacy.tool = Some("issue_refund".into());
        let governed = finance(PlatformApproval {
            rules: vec![legacy],
            ..Default::default()
        })
        .govern(&renaming_agent());
        for tool in ["refund_customer", "lookup_order"] {
            assert!(matches!(
                classify(&governed, tool),
                Classification::RequireApproval(_)
            ));
        }
    }

    #[test]
    fn secrets_reach_a_pod_only_when_listed_and_only_to_allowed_endpoints() {
        let platform = Platform {
            secrets: vec![AllowedSecret {
                name: "model-api-key".into(),
                endpoints: vec!["https://api.openai.com/".into()],
            }],
            ..Default::default()
        };
        assert_eq!(platform.refusal(&run(false), &template(None, None)), None);
        let other = platform
            .refusal(&run(false), &template(Some("db-password"), None))
            .expect("refused");
        assert!(other.starts_with("spec.model.secretRef"), "{other}");
        let exfil = platform
            .refusal(
                &run(false),
                &template(Some("model-api-key"), Some("https://evil.example/v1")),
            )
            .expect("refused");
        assert!(exfil.starts_with("spec.model.endpoint"), "{exfil}");
        assert_eq!(
            platform.refusal(
                &run(false),
                &template(Some("model-api-key"), Some("https://api.openai.com/v1"))
            ),
            None
        );
        for lookalike in [
            "https://api.openai.com.evil.example/v1",
            "https://api.openai.com@evil.example/v1",
            "http://api.openai.com/v1",
            "https://api.openai.com:8443/v1",
        ] {
            assert!(
                platform
                    .refusal(
                        &run(false),
                        &template(Some("model-api-key"), Some(lookalike))
                    )
                    .is_some(),
                "{lookalike} passed as the allowed endpoint"
            );
        }
        assert!(crate::policy::endpoint::allows(
            "https://h/v1/chat",
            "https://h/v1",
            "shop"
        ));
        assert!(!crate::policy::endpoint::allows(
            "https://h/v10",
            "https://h/v1",
            "shop"
        ));
    }

    #[test]
    fn separation_of_duties_needs_a_known_requester() {
        let mut governed = template(None, None);
        governed.approval = Some(ApprovalPolicy {
            separation_of_duties: true,
            ..Default::default()
        });
        let mut r = run(false);
        let msg = Platform::unjudgeable(&r, &governed).expect("refused");
        assert!(
            msg.starts_with("metadata.annotations[agentrun.dev/requester]"),
            "{msg}"
        );
        r.metadata.annotations = Some([(REQUESTER.to_string(), "carol".to_string())].into());
        assert_eq!(Platform::unjudgeable(&r, &governed), None);
        assert_eq!(
            Platform::unjudgeable(&run(false), &template(None, None)),
            None
        );
    }

    #[test]
    fn inline_agents_are_refused_where_a_policy_forbids_them() {
        let platform = Platform {
            forbids_inline: Some("AgentPolicy/strict".into()),
            ..Default::default()
        };
        let msg = platform
            .refusal(&run(true), &template(None, None))
            .expect("refused");
        assert!(msg.contains("AgentPolicy/strict"), "{msg}");
        assert_eq!(platform.refusal(&run(false), &template(None, None)), None);
    }
}
