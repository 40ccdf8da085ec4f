//! What a person's own tools share: the kubectl plugin (`cli`) and the
//! approver's console (`console`) act with the person's identity, decide
//! approvals the same way, and read and verify a run's log the same way.
//! Both sit above this module; it imports neither.

use anyhow::Context as _;
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use kube::api::{Api, PostParams};

use crate::api::{AgentRun, Approval};

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

    async fn run(&self, name: &str) -> anyhow::Result<AgentRun> {
        self.runs
            .get(name)
            .await
            .with_context(|| format!("no run {name:?} in namespace {:?}", self.ns))
    }
}

/// The caller's user name, as the API server sees it.
pub(crate) async fn whoami(client: &kube::Client) -> anyhow::Result<String> {
    Ok(whoami_with_groups(client).await?.0)
}

/// The caller's user name and groups, as the API server sees them.
pub(crate) async fn whoami_with_groups(
    client: &kube::Client,
) -> anyhow::Result<(String, Vec<String>)> {
    let api: Api<SelfSubjectReview> = Api::all(client.clone());
    let review = api
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await?;
    let user = review
        .status
        .and_then(|s| s.user_info)
        .context("the API server did not say who you are")?;
    let name = user
        .username
        .context("the API server did not say who you are")?;
    Ok((name, user.groups.unwrap_or_default()))
}
