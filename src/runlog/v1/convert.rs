//! Conversions between the format-1 stored types and the types agentrun uses.
//! Each side is destructured in full, so a field added to either one stops
//! the build here until someone decides how it is stored (a new format).

use super::*;
use crate::{api, model, tools};

// --- The agent ---

impl From<api::AgentTemplate> for AgentTemplate {
    fn from(a: api::AgentTemplate) -> Self {
        // A container agent's container is stored beside this template
        // (`RunStarted.container`, format 2), its prompt empty.
        let api::AgentTemplate {
            prompt,
            container: _,
            model,
            tools,
            approval,
            budgets,
            context,
            retry,
        } = a;
        AgentTemplate {
            prompt: prompt.unwrap_or_default().into(),
            model: model.into(),
            tools: tools.into_iter().map(Into::into).collect(),
            approval: approval.map(Into::into),
            budgets: budgets.map(Into::into),
            context: context.map(Into::into),
            retry: retry.map(Into::into),
        }
    }
}

impl From<AgentTemplate> for api::AgentTemplate {
    fn from(a: AgentTemplate) -> Self {
        let AgentTemplate {
            prompt,
            model,
            tools,
            approval,
            budgets,
            context,
            retry,
        } = a;
        // The record holding this template sets `container` (format 2).
        let prompt = (!prompt.version.is_empty() || !prompt.system.is_empty()).then_some(prompt);
        api::AgentTemplate {
            prompt: prompt.map(Into::into),
            container: None,
            model: model.into(),
            tools: tools.into_iter().map(Into::into).collect(),
            approval: approval.map(Into::into),
            budgets: budgets.map(Into::into),
            context: context.map(Into::into),
            retry: retry.map(Into::into),
        }
    }
}

impl From<api::RetryPolicy> for RetryPolicy {
    fn from(r: api::RetryPolicy) -> Self {
        let api::RetryPolicy {
            max_attempts_without_progress,
            backoff_seconds,
            max_backoff_seconds,
        } = r;
        RetryPolicy {
            max_attempts_without_progress,
            backoff_seconds,
            max_backoff_seconds,
        }
    }
}

impl From<RetryPolicy> for api::RetryPolicy {
    fn from(r: RetryPolicy) -> Self {
        let RetryPolicy {
            max_attempts_without_progress,
            backoff_seconds,
            max_backoff_seconds,
        } = r;
        api::RetryPolicy {
            max_attempts_without_progress,
            backoff_seconds,
            max_backoff_seconds,
        }
    }
}

impl From<api::Prompt> for Prompt {
    fn from(p: api::Prompt) -> Self {
        let api::Prompt { version, system } = p;
        Prompt { version, system }
    }
}

impl From<Prompt> for api::Prompt {
    fn from(p: Prompt) -> Self {
        let Prompt { version, system } = p;
        api::Prompt { version, system }
    }
}

impl From<api::Provider> for Provider {
    fn from(p: api::Provider) -> Self {
        match p {
            api::Provider::OpenAI => Provider::OpenAI,
            api::Provider::Anthropic => Provider::Anthropic,
        }
    }
}

impl From<Provider> for api::Provider {
    fn from(p: Provider) -> Self {
        match p {
            Provider::OpenAI => api::Provider::OpenAI,
            Provider::Anthropic => api::Provider::Anthropic,
        }
    }
}

impl From<api::ModelSpec> for ModelSpec {
    fn from(m: api::ModelSpec) -> Self {
        let api::ModelSpec {
            provider,
            name,
            endpoint,
            secret_ref,
            prices,
            max_output_tokens,
        } = m;
        ModelSpec {
            provider: provider.into(),
            name,
            endpoint,
            secret_ref: secret_ref.map(Into::into),
            prices: prices.map(Into::into),
            max_output_tokens,
        }
    }
}

impl From<ModelSpec> for api::ModelSpec {
    fn from(m: ModelSpec) -> Self {
        let ModelSpec {
            provider,
            name,
            endpoint,
            secret_ref,
            prices,
            max_output_tokens,
        } = m;
        api::ModelSpec {
            provider: provider.into(),
            name,
            endpoint,
            secret_ref: secret_ref.map(Into::into),
            prices: prices.map(Into::into),
            max_output_tokens,
        }
    }
}

impl From<api::SecretKeyRef> for SecretKeyRef {
    fn from(s: api::SecretKeyRef) -> Self {
        let api::SecretKeyRef { name, key } = s;
        SecretKeyRef { name, key }
    }
}

impl From<SecretKeyRef> for api::SecretKeyRef {
    fn from(s: SecretKeyRef) -> Self {
        let SecretKeyRef { name, key } = s;
        api::SecretKeyRef { name, key }
    }
}

impl From<api::Prices> for Prices {
    fn from(p: api::Prices) -> Self {
        let api::Prices {
            input_per_million,
            output_per_million,
        } = p;
        Prices {
            input_per_million,
            output_per_million,
        }
    }
}

impl From<Prices> for api::Prices {
    fn from(p: Prices) -> Self {
        let Prices {
            input_per_million,
            output_per_million,
        } = p;
        api::Prices {
            input_per_million,
            output_per_million,
        }
    }
}

impl From<api::ToolSpec> for ToolSpec {
    fn from(t: api::ToolSpec) -> Self {
        let api::ToolSpec {
            name,
            description,
            input_schema,
            http,
            mcp,
        } = t;
        ToolSpec {
            name,
            description,
            input_schema,
            http: http.map(Into::into),
            mcp: mcp.map(Into::into),
        }
    }
}

impl From<ToolSpec> for api::ToolSpec {
    fn from(t: ToolSpec) -> Self {
        let ToolSpec {
            name,
            description,
            input_schema,
            http,
            mcp,
        } = t;
        api::ToolSpec {
            name,
            description,
            input_schema,
            http: http.map(Into::into),
            mcp: mcp.map(Into::into),
        }
    }
}

impl From<api::HttpTool> for HttpTool {
    fn from(h: api::HttpTool) -> Self {
        let api::HttpTool {
            url,
            idempotent,
            lookup,
            read_only,
            timeout,
        } = h;
        HttpTool {
            url,
            idempotent,
            lookup,
            read_only,
            timeout,
        }
    }
}

impl From<HttpTool> for api::HttpTool {
    fn from(h: HttpTool) -> Self {
        let HttpTool {
            url,
            idempotent,
            lookup,
            read_only,
            timeout,
        } = h;
        api::HttpTool {
            url,
            idempotent,
            lookup,
            read_only,
            timeout,
        }
    }
}

impl From<api::McpTool> for McpTool {
    fn from(m: api::McpTool) -> Self {
        let api::McpTool {
            url,
            tool,
            idempotent,
        } = m;
        McpTool {
            url,
            tool,
            idempotent,
        }
    }
}

impl From<McpTool> for api::McpTool {
    fn from(m: McpTool) -> Self {
        let McpTool {
            url,
            tool,
            idempotent,
        } = m;
        api::McpTool {
            url,
            tool,
            idempotent,
        }
    }
}

impl From<api::NotifyFormat> for NotifyFormat {
    fn from(f: api::NotifyFormat) -> Self {
        match f {
            api::NotifyFormat::Json => NotifyFormat::Json,
            api::NotifyFormat::Slack => NotifyFormat::Slack,
            api::NotifyFormat::Teams => NotifyFormat::Teams,
        }
    }
}

impl From<NotifyFormat> for api::NotifyFormat {
    fn from(f: NotifyFormat) -> Self {
        match f {
            NotifyFormat::Json => api::NotifyFormat::Json,
            NotifyFormat::Slack => api::NotifyFormat::Slack,
            NotifyFormat::Teams => api::NotifyFormat::Teams,
        }
    }
}

impl From<api::OnExpiry> for OnExpiry {
    fn from(o: api::OnExpiry) -> Self {
        match o {
            api::OnExpiry::Escalate => OnExpiry::Escalate,
            api::OnExpiry::Fail => OnExpiry::Fail,
            api::OnExpiry::Alternative => OnExpiry::Alternative,
            api::OnExpiry::ReturnToAgent => OnExpiry::ReturnToAgent,
        }
    }
}

impl From<OnExpiry> for api::OnExpiry {
    fn from(o: OnExpiry) -> Self {
        match o {
            OnExpiry::Escalate => api::OnExpiry::Escalate,
            OnExpiry::Fail => api::OnExpiry::Fail,
            OnExpiry::Alternative => api::OnExpiry::Alternative,
            OnExpiry::ReturnToAgent => api::OnExpiry::ReturnToAgent,
        }
    }
}

impl From<api::DefaultAction> for DefaultAction {
    fn from(d: api::DefaultAction) -> Self {
        match d {
            api::DefaultAction::Allow => DefaultAction::Allow,
            api::DefaultAction::RequireApprovalForMutating => {
                DefaultAction::RequireApprovalForMutating
            }
        }
    }
}

impl From<DefaultAction> for api::DefaultAction {
    fn from(d: DefaultAction) -> Self {
        match d {
            DefaultAction::Allow => api::DefaultAction::Allow,
            DefaultAction::RequireApprovalForMutating => {
                api::DefaultAction::RequireApprovalForMutating
            }
        }
    }
}

impl From<api::ApprovalPolicy> for ApprovalPolicy {
    fn from(p: api::ApprovalPolicy) -> Self {
        let api::ApprovalPolicy {
            rules,
            default_action,
            default_approvers,
            separation_of_duties,
            notify_webhook,
            platform_default,
            notify_format,
            platform_added,
        } = p;
        ApprovalPolicy {
            rules: rules.into_iter().map(Into::into).collect(),
            default_action: default_action.into(),
            default_approvers: default_approvers.map(Into::into),
            separation_of_duties,
            notify_webhook,
            platform_default: platform_default.map(Into::into),
            notify_format: notify_format.map(Into::into),
            platform_added: platform_added.map(Into::into),
        }
    }
}

impl From<ApprovalPolicy> for api::ApprovalPolicy {
    fn from(p: ApprovalPolicy) -> Self {
        let ApprovalPolicy {
            rules,
            default_action,
            default_approvers,
            separation_of_duties,
            notify_webhook,
            platform_default,
            notify_format,
            platform_added,
        } = p;
        api::ApprovalPolicy {
            rules: rules.into_iter().map(Into::into).collect(),
            default_action: default_action.into(),
            default_approvers: default_approvers.map(Into::into),
            separation_of_duties,
            notify_webhook,
            platform_default: platform_default.map(Into::into),
            notify_format: notify_format.map(Into::into),
            platform_added: platform_added.map(Into::into),
        }
    }
}

impl From<api::ApprovalRule> for ApprovalRule {
    fn from(r: api::ApprovalRule) -> Self {
        let api::ApprovalRule {
            name,
            tool,
            selector,
            when,
            approvers,
            required_approvals,
            expires_after,
            on_expiry,
            escalate_to,
            max_escalations,
            dependencies,
        } = r;
        ApprovalRule {
            name,
            tool,
            selector: selector.map(Into::into),
            when,
            approvers: approvers.into(),
            required_approvals,
            expires_after,
            on_expiry: on_expiry.into(),
            escalate_to: escalate_to.map(Into::into),
            max_escalations,
            dependencies: dependencies.into_iter().map(Into::into).collect(),
        }
    }
}

impl From<ApprovalRule> for api::ApprovalRule {
    fn from(r: ApprovalRule) -> Self {
        let ApprovalRule {
            name,
            tool,
            selector,
            when,
            approvers,
            required_approvals,
            expires_after,
            on_expiry,
            escalate_to,
            max_escalations,
            dependencies,
        } = r;
        api::ApprovalRule {
            name,
            tool,
            selector: selector.map(Into::into),
            when,
            approvers: approvers.into(),
            required_approvals,
            expires_after,
            on_expiry: on_expiry.into(),
            escalate_to: escalate_to.map(Into::into),
            max_escalations,
            dependencies: dependencies.into_iter().map(Into::into).collect(),
        }
    }
}

impl From<api::PlatformDefault> for PlatformDefault {
    fn from(d: api::PlatformDefault) -> Self {
        let api::PlatformDefault { agent_action, by } = d;
        PlatformDefault {
            agent_action: agent_action.into(),
            by: by.into_iter().map(Into::into).collect(),
        }
    }
}

impl From<api::PlatformAdded> for PlatformAdded {
    fn from(a: api::PlatformAdded) -> Self {
        let api::PlatformAdded {
            rules,
            separation_of_duties,
            default_approvers,
        } = a;
        PlatformAdded {
            rules,
            separation_of_duties,
            default_approvers: default_approvers.map(Into::into),
        }
    }
}

impl From<PlatformAdded> for api::PlatformAdded {
    fn from(a: PlatformAdded) -> Self {
        let PlatformAdded {
            rules,
            separation_of_duties,
            default_approvers,
        } = a;
        api::PlatformAdded {
            rules,
            separation_of_duties,
            default_approvers: default_approvers.map(Into::into),
        }
    }
}

impl From<api::PlatformReadOnly> for PlatformReadOnly {
    fn from(r: api::PlatformReadOnly) -> Self {
        let api::PlatformReadOnly { policy, read_only } = r;
        PlatformReadOnly {
            policy,
            read_only: read_only.map(Into::into),
        }
    }
}

impl From<api::CallMatch> for CallMatch {
    fn from(m: api::CallMatch) -> Self {
        let api::CallMatch { endpoints, mcp } = m;
        CallMatch {
            endpoints: endpoints
                .into_iter()
                .map(|api::EndpointMatch { url }| EndpointMatch { url })
                .collect(),
            mcp: mcp
                .into_iter()
                .map(|api::McpMatch { server, tool }| McpMatch { server, tool })
                .collect(),
        }
    }
}

impl From<PlatformDefault> for api::PlatformDefault {
    fn from(d: PlatformDefault) -> Self {
        let PlatformDefault { agent_action, by } = d;
        api::PlatformDefault {
            agent_action: agent_action.into(),
            by: by.into_iter().map(Into::into).collect(),
        }
    }
}

impl From<PlatformReadOnly> for api::PlatformReadOnly {
    fn from(r: PlatformReadOnly) -> Self {
        let PlatformReadOnly { policy, read_only } = r;
        api::PlatformReadOnly {
            policy,
            read_only: read_only.map(Into::into),
        }
    }
}

impl From<CallMatch> for api::CallMatch {
    fn from(m: CallMatch) -> Self {
        let CallMatch { endpoints, mcp } = m;
        api::CallMatch {
            endpoints: endpoints
                .into_iter()
                .map(|EndpointMatch { url }| api::EndpointMatch { url })
                .collect(),
            mcp: mcp
                .into_iter()
                .map(|McpMatch { server, tool }| api::McpMatch { server, tool })
                .collect(),
        }
    }
}

impl From<api::Dependency> for Dependency {
    fn from(d: api::Dependency) -> Self {
        let api::Dependency { name, lookup } = d;
        Dependency { name, lookup }
    }
}

impl From<Dependency> for api::Dependency {
    fn from(d: Dependency) -> Self {
        let Dependency { name, lookup } = d;
        api::Dependency { name, lookup }
    }
}

impl From<api::Approvers> for Approvers {
    fn from(a: api::Approvers) -> Self {
        let api::Approvers { users, groups } = a;
        Approvers { users, groups }
    }
}

impl From<Approvers> for api::Approvers {
    fn from(a: Approvers) -> Self {
        let Approvers { users, groups } = a;
        api::Approvers { users, groups }
    }
}

impl From<api::Budgets> for Budgets {
    fn from(b: api::Budgets) -> Self {
        let api::Budgets {
            max_tokens,
            max_cost_usd,
            max_steps,
            on_exhausted,
            approvers,
            required_approvals,
            expires_after,
        } = b;
        Budgets {
            max_tokens,
            max_cost_usd,
            max_steps,
            on_exhausted: match on_exhausted {
                api::OnExhausted::Fail => None,
                api::OnExhausted::Ask => Some(OnExhausted::Ask),
            },
            approvers: approvers.map(Into::into),
            required_approvals,
            expires_after,
        }
    }
}

impl From<Budgets> for api::Budgets {
    fn from(b: Budgets) -> Self {
        let Budgets {
            max_tokens,
            max_cost_usd,
            max_steps,
            on_exhausted,
            approvers,
            required_approvals,
            expires_after,
        } = b;
        api::Budgets {
            max_tokens,
            max_cost_usd,
            max_steps,
            on_exhausted: match on_exhausted {
                None | Some(OnExhausted::Fail) => api::OnExhausted::Fail,
                Some(OnExhausted::Ask) => api::OnExhausted::Ask,
            },
            approvers: approvers.map(Into::into),
            required_approvals,
            expires_after,
        }
    }
}

impl From<api::ContextSettings> for ContextSettings {
    fn from(c: api::ContextSettings) -> Self {
        let api::ContextSettings {
            max_tokens,
            recent_steps,
        } = c;
        ContextSettings {
            max_tokens,
            recent_steps,
        }
    }
}

impl From<ContextSettings> for api::ContextSettings {
    fn from(c: ContextSettings) -> Self {
        let ContextSettings {
            max_tokens,
            recent_steps,
        } = c;
        api::ContextSettings {
            max_tokens,
            recent_steps,
        }
    }
}

// --- Tools and model replies ---

impl From<model::ToolDef> for ToolDef {
    fn from(t: model::ToolDef) -> Self {
        let model::ToolDef {
            name,
            description,
            input_schema,
        } = t;
        ToolDef {
            name,
            description,
            input_schema,
        }
    }
}

impl From<ToolDef> for model::ToolDef {
    fn from(t: ToolDef) -> Self {
        let ToolDef {
            name,
            description,
            input_schema,
        } = t;
        model::ToolDef {
            name,
            description,
            input_schema,
        }
    }
}

impl From<tools::McpCatalog> for McpCatalog {
    fn from(c: tools::McpCatalog) -> Self {
        McpCatalog(c.into_iter().map(|(k, v)| (k, v.into())).collect())
    }
}

impl From<McpCatalog> for tools::McpCatalog {
    fn from(c: McpCatalog) -> Self {
        c.0.into_iter().map(|(k, v)| (k, v.into())).collect()
    }
}

impl From<tools::McpToolInfo> for McpToolInfo {
    fn from(t: tools::McpToolInfo) -> Self {
        let tools::McpToolInfo {
            name,
            description,
            input_schema,
            annotations,
        } = t;
        McpToolInfo {
            name,
            description,
            input_schema,
            annotations: annotations.into(),
        }
    }
}

impl From<McpToolInfo> for tools::McpToolInfo {
    fn from(t: McpToolInfo) -> Self {
        let McpToolInfo {
            name,
            description,
            input_schema,
            annotations,
        } = t;
        tools::McpToolInfo {
            name,
            description,
            input_schema,
            annotations: annotations.into(),
        }
    }
}

impl From<tools::McpAnnotations> for McpAnnotations {
    fn from(a: tools::McpAnnotations) -> Self {
        let tools::McpAnnotations {
            read_only_hint,
            destructive_hint,
            idempotent_hint,
            open_world_hint,
        } = a;
        McpAnnotations {
            read_only_hint,
            destructive_hint,
            idempotent_hint,
            open_world_hint,
        }
    }
}

impl From<McpAnnotations> for tools::McpAnnotations {
    fn from(a: McpAnnotations) -> Self {
        let McpAnnotations {
            read_only_hint,
            destructive_hint,
            idempotent_hint,
            open_world_hint,
        } = a;
        tools::McpAnnotations {
            read_only_hint,
            destructive_hint,
            idempotent_hint,
            open_world_hint,
        }
    }
}

impl From<model::ModelResponse> for ModelResponse {
    fn from(r: model::ModelResponse) -> Self {
        let model::ModelResponse {
            text,
            tool_calls,
            usage,
            model_id,
            stop_reason,
        } = r;
        ModelResponse {
            text,
            tool_calls: tool_calls.into_iter().map(Into::into).collect(),
            usage: usage.into(),
            model_id,
            stop_reason,
        }
    }
}

impl From<ModelResponse> for model::ModelResponse {
    fn from(r: ModelResponse) -> Self {
        let ModelResponse {
            text,
            tool_calls,
            usage,
            model_id,
            stop_reason,
        } = r;
        model::ModelResponse {
            text,
            tool_calls: tool_calls.into_iter().map(Into::into).collect(),
            usage: usage.into(),
            model_id,
            stop_reason,
        }
    }
}

impl From<model::ToolCall> for ToolCall {
    fn from(c: model::ToolCall) -> Self {
        let model::ToolCall {
            id,
            name,
            arguments,
        } = c;
        ToolCall {
            id,
            name,
            arguments,
        }
    }
}

impl From<ToolCall> for model::ToolCall {
    fn from(c: ToolCall) -> Self {
        let ToolCall {
            id,
            name,
            arguments,
        } = c;
        model::ToolCall {
            id,
            name,
            arguments,
        }
    }
}

impl From<model::TokenUsage> for TokenUsage {
    fn from(u: model::TokenUsage) -> Self {
        let model::TokenUsage {
            input_tokens,
            output_tokens,
        } = u;
        TokenUsage {
            input_tokens,
            output_tokens,
        }
    }
}

impl From<TokenUsage> for model::TokenUsage {
    fn from(u: TokenUsage) -> Self {
        let TokenUsage {
            input_tokens,
            output_tokens,
        } = u;
        model::TokenUsage {
            input_tokens,
            output_tokens,
        }
    }
}

impl From<tools::ToolOutcome> for ToolOutcome {
    fn from(o: tools::ToolOutcome) -> Self {
        match o {
            tools::ToolOutcome::Ok(value) => ToolOutcome::Ok(value),
            tools::ToolOutcome::Failed { observation } => ToolOutcome::Failed { observation },
        }
    }
}

impl From<ToolOutcome> for tools::ToolOutcome {
    fn from(o: ToolOutcome) -> Self {
        match o {
            ToolOutcome::Ok(value) => tools::ToolOutcome::Ok(value),
            ToolOutcome::Failed { observation } => tools::ToolOutcome::Failed { observation },
        }
    }
}

// --- Approvals ---

impl From<api::ObservedResult> for ObservedResult {
    fn from(o: api::ObservedResult) -> Self {
        let api::ObservedResult { seq, tool, summary } = o;
        ObservedResult { seq, tool, summary }
    }
}

impl From<ObservedResult> for api::ObservedResult {
    fn from(o: ObservedResult) -> Self {
        let ObservedResult { seq, tool, summary } = o;
        api::ObservedResult { seq, tool, summary }
    }
}

impl From<api::DependencyVersion> for DependencyVersion {
    fn from(d: api::DependencyVersion) -> Self {
        let api::DependencyVersion { name, version } = d;
        DependencyVersion { name, version }
    }
}

impl From<DependencyVersion> for api::DependencyVersion {
    fn from(d: DependencyVersion) -> Self {
        let DependencyVersion { name, version } = d;
        api::DependencyVersion { name, version }
    }
}

impl From<api::ApprovalKind> for ApprovalKind {
    fn from(k: api::ApprovalKind) -> Self {
        match k {
            api::ApprovalKind::Call => ApprovalKind::Call,
            api::ApprovalKind::Reconcile => ApprovalKind::Reconcile,
            api::ApprovalKind::Budget => ApprovalKind::Budget,
        }
    }
}

impl From<ApprovalKind> for api::ApprovalKind {
    fn from(k: ApprovalKind) -> Self {
        match k {
            ApprovalKind::Call => api::ApprovalKind::Call,
            ApprovalKind::Reconcile => api::ApprovalKind::Reconcile,
            ApprovalKind::Budget => api::ApprovalKind::Budget,
        }
    }
}

impl From<api::Verdict> for Verdict {
    fn from(v: api::Verdict) -> Self {
        match v {
            api::Verdict::Approve => Verdict::Approve,
            api::Verdict::Reject => Verdict::Reject,
            api::Verdict::Edit => Verdict::Edit,
        }
    }
}

impl From<Verdict> for api::Verdict {
    fn from(v: Verdict) -> Self {
        match v {
            Verdict::Approve => api::Verdict::Approve,
            Verdict::Reject => api::Verdict::Reject,
            Verdict::Edit => api::Verdict::Edit,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::super::*;
    use crate::replay::Entry;
    use crate::{api, model, tools};

    fn fixture() -> Vec<Entry> {
        let records: Vec<Value> =
            serde_json::from_str(include_str!("../testdata/format1.json")).unwrap();
        records
            .iter()
            .enumerate()
            .map(|(i, r)| Entry::decode(i as u64, r["kind"].as_str().unwrap(), &r["payload"]))
            .collect::<Result<_, _>>()
            .unwrap()
    }

    /// Stored -> ours -> stored gives back the same value, and so does
    /// ours -> stored -> ours: nothing is lost on either side.
    fn both_ways<S, T>(stored: &S)
    where
        S: Clone + PartialEq + std::fmt::Debug + From<T>,
        T: Clone + PartialEq + std::fmt::Debug + From<S>,
    {
        let ours = T::from(stored.clone());
        assert_eq!(&S::from(ours.clone()), stored);
        assert_eq!(T::from(S::from(ours.clone())), ours);
    }

    #[test]
    fn a_full_agent_converts_to_the_api_type_and_back_losslessly() {
        let Entry::RunStarted(started) = &fixture()[0] else {
            panic!("the fixture starts with a RunStarted")
        };
        let agent = api::AgentTemplate::from(started.agent.clone());
        // The fixture's first agent sets every optional field.
        let model = &agent.model;
        assert!(model.endpoint.is_some() && model.secret_ref.is_some());
        assert!(model.prices.is_some() && model.max_output_tokens.is_some());
        assert!(agent.approval.is_some() && agent.budgets.is_some());
        assert!(agent.context.is_some() && agent.retry.is_some());
        assert!(agent.tools.iter().any(|t| t.http.is_some()));
        assert!(agent.tools.iter().any(|t| t.mcp.is_some()));
        both_ways::<AgentTemplate, api::AgentTemplate>(&started.agent);
    }

    #[test]
    fn every_stored_value_of_the_fixture_survives_a_round_trip() {
        for step in fixture() {
            match &step {
                Entry::RunStarted(s) => {
                    both_ways::<AgentTemplate, api::AgentTemplate>(&s.agent);
                    s.tools
                        .iter()
                        .for_each(both_ways::<ToolDef, model::ToolDef>);
                    both_ways::<McpCatalog, tools::McpCatalog>(&s.mcp);
                }
                Entry::VersionChanged(v) => {
                    both_ways::<AgentTemplate, api::AgentTemplate>(&v.agent);
                    v.tools
                        .iter()
                        .for_each(both_ways::<ToolDef, model::ToolDef>);
                    both_ways::<McpCatalog, tools::McpCatalog>(&v.mcp);
                }
                Entry::ModelCall(m) => {
                    both_ways::<ModelResponse, model::ModelResponse>(&m.response)
                }
                Entry::Summary(s) => both_ways::<ModelResponse, model::ModelResponse>(&s.response),
                Entry::ToolResult(r) => both_ways::<ToolOutcome, tools::ToolOutcome>(&r.outcome),
                Entry::ApprovalRequested(r) => {
                    r.observations
                        .iter()
                        .for_each(both_ways::<ObservedResult, api::ObservedResult>);
                    r.dependencies
                        .iter()
                        .for_each(both_ways::<DependencyVersion, api::DependencyVersion>);
                    both_ways::<ApprovalKind, api::ApprovalKind>(&r.kind);
                    both_ways::<Approvers, api::Approvers>(&r.gate.approvers);
                    both_ways::<OnExpiry, api::OnExpiry>(&r.gate.on_expiry);
                    r.gate
                        .dependencies
                        .iter()
                        .for_each(both_ways::<Dependency, api::Dependency>);
                }
                Entry::ApprovalDecided(d) => {
                    for decision in &d.decisions {
                        both_ways::<Verdict, api::Verdict>(&decision.verdict);
                    }
                    d.on_expiry
                        .iter()
                        .for_each(both_ways::<OnExpiry, api::OnExpiry>);
                }
                _ => {}
            }
        }
    }
}
