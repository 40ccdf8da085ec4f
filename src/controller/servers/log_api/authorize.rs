//! May this person do this? One SubjectAccessReview per question, asked of
//! the API server (so reading a log is ordinary RBAC: `get`, `list` or
//! `watch` on `runlogs` in the namespace), answers kept briefly so a
//! paging client does not cost one review per page.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::Api;
use kube::api::PostParams;

use super::front_proxy::User;
use crate::api::runlog::{LOG_GROUP, LOG_VERSION, RUNLOGS};

/// A question: `verb` on `runlogs` (named `name`, when given) in `namespace`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Question {
    pub verb: &'static str,
    pub namespace: String,
    pub name: Option<String>,
}

/// The API server's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    Allowed,
    /// Refused; the text says what was missing.
    Denied(String),
}

/// Answers remembered, with when they were given.
type Answers = HashMap<(User, Question), (Answer, Instant)>;

/// Asks SubjectAccessReviews, remembering answers for `ttl`.
#[derive(Clone)]
pub struct Authorizer {
    client: kube::Client,
    ttl: Duration,
    cache: Arc<Mutex<Answers>>,
}

/// Answers remembered at most; the cache is emptied when it is full (a
/// flood of distinct users costs reviews, never memory).
const MAX_CACHED: usize = 10_000;

/// The API server did not answer whether someone may ask: the caller
/// answers 503, never a yes.
#[derive(Debug, thiserror::Error)]
#[error("creating a SubjectAccessReview: {0}")]
pub struct ReviewError(kube::Error);

impl Authorizer {
    pub fn new(client: kube::Client, ttl: Duration) -> Authorizer {
        Authorizer {
            client,
            ttl,
            cache: Default::default(),
        }
    }

    /// How long an answer is remembered.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Whether `user` may ask `question`; an API failure is an error (the
    /// caller answers 503, never a yes).
    pub async fn check(&self, user: &User, question: &Question) -> Result<Answer, ReviewError> {
        let key = (user.clone(), question.clone());
        if let Some((answer, at)) = self.cache.lock().expect("not poisoned").get(&key)
            && at.elapsed() < self.ttl
        {
            return Ok(answer.clone());
        }
        let answer = self.review(user, question).await?;
        let mut cache = self.cache.lock().expect("not poisoned");
        if cache.len() >= MAX_CACHED {
            cache.clear();
        }
        cache.insert(key, (answer.clone(), Instant::now()));
        Ok(answer)
    }

    async fn review(&self, user: &User, q: &Question) -> Result<Answer, ReviewError> {
        let api: Api<SubjectAccessReview> = Api::all(self.client.clone());
        let review = SubjectAccessReview {
            spec: review_spec(user, q),
            ..Default::default()
        };
        let reviewed = api
            .create(&PostParams::default(), &review)
            .await
            .map_err(ReviewError)?;
        let status = reviewed.status.unwrap_or_default();
        Ok(if status.allowed && !status.denied.unwrap_or(false) {
            Answer::Allowed
        } else {
            Answer::Denied(denial(user, q, status.reason.as_deref()))
        })
    }
}

fn review_spec(user: &User, q: &Question) -> SubjectAccessReviewSpec {
    SubjectAccessReviewSpec {
        user: Some(user.name.clone()),
        uid: user.uid.clone(),
        groups: Some(user.groups.clone()),
        extra: (!user.extra.is_empty()).then(|| user.extra.clone()),
        resource_attributes: Some(ResourceAttributes {
            group: Some(LOG_GROUP.into()),
            version: Some(LOG_VERSION.into()),
            resource: Some(RUNLOGS.into()),
            verb: Some(q.verb.into()),
            namespace: Some(q.namespace.clone()),
            name: q.name.clone(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The refusal as a person reads it: who, which verb on what, where.
fn denial(user: &User, q: &Question, reason: Option<&str>) -> String {
    let what = match &q.name {
        Some(name) => format!("runlogs.{LOG_GROUP} {name:?}"),
        None => format!("runlogs.{LOG_GROUP}"),
    };
    let mut text = format!(
        "{what} is forbidden: User {:?} cannot {} resource \"runlogs\" in API group {LOG_GROUP:?} in the namespace {:?} (bind the ClusterRole agentrun-log-reader there)",
        user.name, q.verb, q.namespace
    );
    if let Some(reason) = reason.filter(|r| !r.is_empty()) {
        text.push_str(": ");
        text.push_str(reason);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_review_asks_exactly_the_verb_resource_and_namespace_of_the_request() {
        let user = User {
            name: "alice".into(),
            groups: vec!["finance".into()],
            ..Default::default()
        };
        let q = Question {
            verb: "watch",
            namespace: "shop".into(),
            name: Some("r1".into()),
        };
        let spec = review_spec(&user, &q);
        let attrs = spec.resource_attributes.unwrap();
        assert_eq!(spec.user.as_deref(), Some("alice"));
        assert_eq!(spec.groups.unwrap(), ["finance"]);
        assert_eq!(attrs.group.as_deref(), Some(LOG_GROUP));
        assert_eq!(attrs.resource.as_deref(), Some("runlogs"));
        assert_eq!(attrs.verb.as_deref(), Some("watch"));
        assert_eq!(attrs.namespace.as_deref(), Some("shop"));
        assert_eq!(attrs.name.as_deref(), Some("r1"));
        let text = denial(&user, &q, None);
        assert!(text.contains("cannot watch resource \"runlogs\""), "{text}");
        assert!(text.contains("\"shop\""), "{text}");
    }
}
