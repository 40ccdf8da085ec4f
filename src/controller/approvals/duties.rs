//! Separation of duties by person, not by name: under
//! `separationOfDuties`, a decision by anyone who could act as the run's
//! requester does not count. The admission policy refuses such a decision
//! with the deciding request's whole identity (`authorizer` in
//! crds/admission.yaml); the controller, as its second line, asks the API
//! server the same questions with a SubjectAccessReview for the approver's
//! user name (a decision carries no groups, so powers held only through a
//! group are the admission policy's to see).

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::Api;
use kube::api::PostParams;

use crate::api::Approval;
use crate::controller::error::Error;

/// What lets a person act as a ServiceAccount of a namespace: (API group,
/// resource, subresource, verb, whether the question names the account).
/// Creating a workload or reading Secrets comes with creating pods in the
/// built-in roles; the admission policy's cost budget keeps the list short.
/// Kept equal to the admission policy's list (a test compares them).
pub const ACT_AS_SERVICE_ACCOUNT: &[(&str, &str, &str, &str, bool)] = &[
    ("", "serviceaccounts", "token", "create", true),
    ("", "serviceaccounts", "", "impersonate", true),
    ("", "pods", "", "create", false),
];
/// `system:serviceaccount:NS:NAME` as (NS, NAME).
pub fn service_account(requester: &str) -> Option<(&str, &str)> {
    let rest = requester.strip_prefix("system:serviceaccount:")?;
    let (ns, name) = rest.split_once(':')?;
    (!ns.is_empty() && !name.is_empty() && !name.contains(':')).then_some((ns, name))
}

/// The questions whose yes means `approver` could act as `requester`.
pub fn questions(requester: &str) -> Vec<ResourceAttributes> {
    let Some((ns, name)) = service_account(requester) else {
        return vec![ResourceAttributes {
            resource: Some("users".into()),
            verb: Some("impersonate".into()),
            name: Some(requester.to_string()),
            ..Default::default()
        }];
    };
    ACT_AS_SERVICE_ACCOUNT
        .iter()
        .map(|&(group, resource, sub, verb, named)| ResourceAttributes {
            group: Some(group.into()),
            resource: Some(resource.into()),
            subresource: (!sub.is_empty()).then(|| sub.into()),
            verb: Some(verb.into()),
            namespace: Some(ns.into()),
            name: named.then(|| name.into()),
            ..Default::default()
        })
        .collect()
}

/// Whether the API server says `approver` could act as `requester`.
async fn could_act_as(
    client: &kube::Client,
    approver: &str,
    requester: &str,
) -> Result<bool, Error> {
    let api: Api<SubjectAccessReview> = Api::all(client.clone());
    for attributes in questions(requester) {
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(approver.to_string()),
                resource_attributes: Some(attributes),
                ..Default::default()
            },
            ..Default::default()
        };
        let answer = api
            .create(&PostParams::default(), &review)
            .await
            .map_err(|source| Error::Read {
                what: "subject access review (separation of duties)",
                source,
            })?;
        if answer.status.is_some_and(|s| s.allowed) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// `found` without the decisions of approvers who could act as its
/// requester, when it asks for separation of duties.
pub async fn without_stand_ins(
    client: &kube::Client,
    mut found: Approval,
) -> Result<Approval, Error> {
    let spec = &found.spec;
    let Some(requester) = spec.requester.clone().filter(|_| spec.separation_of_duties) else {
        return Ok(found);
    };
    let mut kept = Vec::with_capacity(spec.decisions.len());
    for d in std::mem::take(&mut found.spec.decisions) {
        if d.approver == requester || !could_act_as(client, &d.approver, &requester).await? {
            // The requester's own entry is refused by `evaluate` already.
            kept.push(d);
        } else {
            tracing::warn!(approver = %d.approver, %requester, "a decision by someone who could act as the requester does not count");
        }
    }
    found.spec.decisions = kept;
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_account_requester_is_read_from_its_user_name() {
        assert_eq!(
            service_account("system:serviceaccount:shop:pipeline"),
            Some(("shop", "pipeline"))
        );
        for not_one in [
            "alice",
            "system:serviceaccount:shop",
            "system:serviceaccount::x",
            "system:serviceaccount:a:b:c",
        ] {
            assert_eq!(service_account(not_one), None, "{not_one}");
        }
        let user = questions("dave");
        assert_eq!(user.len(), 1);
        assert_eq!(user[0].verb.as_deref(), Some("impersonate"));
        assert_eq!(user[0].resource.as_deref(), Some("users"));
        assert_eq!(user[0].name.as_deref(), Some("dave"));
    }

    /// The controller and the admission policy ask the same questions.
    #[test]
    fn the_admission_policy_asks_what_the_controller_asks() {
        let policy = include_str!("../../../crds/admission.yaml");
        let start = policy
            .find("name: agentrun-approval-duties")
            .expect("the admission policy's rule");
        let rule = &policy[start..];
        let rule = &rule[rule.find("validations:").unwrap()..];
        let rule = &rule[..rule.find("---").unwrap()];
        let mut asked = 0;
        for &(group, resource, sub, verb, _) in ACT_AS_SERVICE_ACCOUNT {
            let mut q = format!("authorizer.group('{group}').resource('{resource}')");
            if !sub.is_empty() {
                q.push_str(&format!(".subresource('{sub}')"));
            }
            assert!(rule.contains(&q), "the admission policy does not ask {q}");
            assert!(rule.contains(&format!("check('{verb}')")));
            asked += 1;
        }
        assert_eq!(
            rule.matches(".check(").count(),
            asked + 1,
            "one more for users"
        );
    }
}
