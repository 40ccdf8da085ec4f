//! What a person's own tools share: the kubectl plugin (`cli`) and the
//! approver's console (`console`) act with the person's identity, decide
//! approvals the same way, and read and verify a run's log the same way.
//! Both sit above this module; it imports neither.

use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use kube::api::{Api, PostParams};

use crate::api::{AgentRun, Approval};

/// What went wrong acting as the person.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("no run {name:?} in namespace {ns:?}")]
    NoRun {
        name: String,
        ns: String,
        #[source]
        source: kube::Error,
    },
    /// A request the API server answered with an error, passed on as it said it.
    #[error(transparent)]
    Api(#[from] kube::Error),
    #[error("the API server did not say who you are")]
    Unknown,
}

pub mod approvals;
pub mod log;

/// What every subcommand works with.
pub struct Kube {
    pub(crate) client: kube::Client,
    pub(crate) ns: String,
    pub(crate) approvals: Api<Approval>,
    pub(crate) runs: Api<AgentRun>,
}

impl Kube {
    /// Acting as `client`'s user in namespace `ns`.
    pub(crate) fn new(client: kube::Client, ns: &str) -> Kube {
        Kube {
            approvals: Api::namespaced(client.clone(), ns),
            runs: Api::namespaced(client.clone(), ns),
            client,
            ns: ns.to_string(),
        }
    }

    async fn run(&self, name: &str) -> Result<AgentRun, ClientError> {
        self.runs
            .get(name)
            .await
            .map_err(|source| ClientError::NoRun {
                name: name.to_string(),
                ns: self.ns.clone(),
                source,
            })
    }
}

/// The caller's user name, as the API server sees it.
pub(crate) async fn whoami(client: &kube::Client) -> Result<String, ClientError> {
    Ok(whoami_with_groups(client).await?.0)
}

/// The caller's user name and groups, as the API server sees them.
pub(crate) async fn whoami_with_groups(
    client: &kube::Client,
) -> Result<(String, Vec<String>), ClientError> {
    let api: Api<SelfSubjectReview> = Api::all(client.clone());
    let review = api
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await?;
    let user = review
        .status
        .and_then(|s| s.user_info)
        .ok_or(ClientError::Unknown)?;
    let name = user.username.ok_or(ClientError::Unknown)?;
    Ok((name, user.groups.unwrap_or_default()))
}

/// The fork of `parent` as created: `spec.forkOf`, the parent's input
/// (the task is the copied log's; the field is required) and the run's
/// own settings left to their defaults.
pub fn fork_of(
    parent: &crate::api::AgentRun,
    run: &str,
    at: u64,
    agent: Option<String>,
    name: Option<String>,
) -> crate::api::AgentRun {
    let metadata = kube::api::ObjectMeta {
        generate_name: name.is_none().then(|| format!("{run}-fork-")),
        name,
        ..Default::default()
    };
    let spec = crate::api::AgentRunSpec {
        fork_of: Some(crate::api::ForkOf {
            run: run.to_string(),
            seq: at,
            agent,
            budget: Default::default(),
            replace: None,
        }),
        input: parent.spec.input.clone(),
        deadline: parent.spec.deadline.clone(),
        step_timeout: parent.spec.step_timeout.clone(),
        store: parent.spec.store.clone(),
        ..Default::default()
    };
    crate::api::AgentRun {
        metadata,
        spec,
        status: None,
    }
}
