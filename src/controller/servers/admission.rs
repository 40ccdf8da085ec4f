//! The requester stamp as a mutating admission webhook, for API servers that
//! do not serve MutatingAdmissionPolicy (a beta API, off by default in
//! Kubernetes 1.34): `POST /stamp-requester` takes an `admission.k8s.io/v1`
//! AdmissionReview and answers with one carrying the same `uid`.
//!
//! It does what `config/requester-stamp`'s policy does, so either can be
//! installed:
//!
//! - an AgentRun CREATE without `metadata.annotations[agentrun.dev/requester]`
//!   gets it stamped with `request.userInfo.username` (a JSONPatch);
//! - the same for `agentrun.dev/requester-groups`, the creator's groups
//!   (`request.userInfo.groups`, one a line): what the controller's
//!   reviews for the requester ask with (a fork's read of its parent);
//! - a CREATE naming somebody else, or other groups, is refused (403), in the words of the
//!   ValidatingAdmissionPolicy `agentrun-run-requester`, which still checks
//!   every run whichever stamp is installed;
//! - an UPDATE that would drop the requester (a server-side apply whose
//!   manifest never carried it: the stamped field belongs to its manager)
//!   gets the old value back, so the validating policy does not refuse it;
//! - anything else is allowed untouched.
//!
//! The webhook is stateless: every replica serves it, leader or not. It
//! trusts the API server for `userInfo` (TLS from the chart; the API server
//! is the only client the configuration sends here).

use crate::refusal::Refusal;
use axum::Router;
use axum::body::Bytes;
use axum::extract::DefaultBodyLimit;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::api::{REQUESTER_ANNOTATION, REQUESTER_GROUPS_ANNOTATION, requester_groups};

/// Where the webhook configuration points the API server.
pub const PATH: &str = "/stamp-requester";
/// The API server caps a request body at 3 MiB (etcd's object limit is
/// 1.5 MiB, and a review carries the object once, or twice on UPDATE).
pub const MAX_BODY: usize = 3 * 1024 * 1024;

const REVIEW_API_VERSION: &str = "admission.k8s.io/v1";
const REVIEW_KIND: &str = "AdmissionReview";
const GROUP: &str = "agentrun.dev";
const KIND: &str = "AgentRun";

/// The router the controller's TLS server merges in.
pub fn router() -> Router {
    Router::new()
        .route(PATH, post(stamp))
        .layer(DefaultBodyLimit::max(MAX_BODY))
}

/// An incoming review: only the fields the stamp reads.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Review {
    api_version: String,
    kind: String,
    request: Option<Request>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Request {
    uid: String,
    kind: GroupVersionKind,
    operation: String,
    user_info: UserInfo,
    #[serde(default)]
    object: Option<Value>,
    #[serde(default)]
    old_object: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct GroupVersionKind {
    #[serde(default)]
    group: String,
    kind: String,
}

#[derive(Debug, Deserialize)]
struct UserInfo {
    #[serde(default)]
    username: String,
    #[serde(default)]
    groups: Vec<String>,
}

/// What the webhook answers one request with.
#[derive(Debug, PartialEq)]
enum Decision {
    Allow,
    Patch(json_patch::Patch),
    /// Refused: HTTP-like status code and the message the user sees.
    Deny(u16, String),
}

async fn stamp(body: Bytes) -> Response {
    match parse(&body) {
        Ok(request) => {
            let decision = decide(&request);
            if let Decision::Deny(code, message) = &decision {
                tracing::info!(uid = %request.uid, code, %message, "requester stamp refused a run");
            }
            (StatusCode::OK, axum::Json(respond(&request.uid, decision))).into_response()
        }
        // Without a review there is no uid to answer to: an HTTP error,
        // which the API server reports (and, failurePolicy Fail, refuses).
        Err(message) => (
            StatusCode::BAD_REQUEST,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            String::from(message),
        )
            .into_response(),
    }
}

/// The review's request, or why the body is not an `admission.k8s.io/v1`
/// AdmissionReview with one.
fn parse(body: &[u8]) -> Result<Request, Refusal> {
    let review: Review = serde_json::from_slice(body)
        .map_err(|e| format!("the body is not an {REVIEW_API_VERSION} {REVIEW_KIND}: {e}"))?;
    if review.api_version != REVIEW_API_VERSION || review.kind != REVIEW_KIND {
        return Err(format!(
            "apiVersion/kind: expected {REVIEW_API_VERSION} {REVIEW_KIND}, got {} {} (the webhook configuration must list admissionReviewVersions [v1])",
            review.api_version, review.kind
        ).into());
    }
    let request = review.request.ok_or_else(|| {
        format!("request: missing (an {REVIEW_KIND} sent to a webhook carries one)")
    })?;
    if request.uid.is_empty() {
        return Err("request.uid: empty (the response must echo it)".into());
    }
    Ok(request)
}

/// The stamp's decision for one request (no I/O: unit-tested below).
fn decide(request: &Request) -> Decision {
    if request.kind.group != GROUP || request.kind.kind != KIND {
        return Decision::Allow;
    }
    match request.operation.as_str() {
        "CREATE" => decide_create(request),
        "UPDATE" => keep_on_update(request),
        _ => Decision::Allow,
    }
}

fn decide_create(request: &Request) -> Decision {
    let user = request.user_info.username.as_str();
    let Some(object) = &request.object else {
        return Decision::Deny(
            400,
            "request.object: missing in a CREATE review; nothing to stamp".into(),
        );
    };
    if user.is_empty() {
        return Decision::Deny(
            400,
            format!(
                "request.userInfo.username is empty: metadata.annotations[{REQUESTER_ANNOTATION}] cannot be stamped"
            ),
        );
    }
    let groups = requester_groups(&request.user_info.groups);
    let mut missing = Vec::new();
    for (key, value, what) in [
        (REQUESTER_ANNOTATION, user, "your own user name"),
        (
            REQUESTER_GROUPS_ANNOTATION,
            groups.as_str(),
            "your own groups",
        ),
    ] {
        match annotation(object, key) {
            None => missing.push((key, value)),
            Some(named) if named == value => {}
            Some(named) => {
                return Decision::Deny(
                    403,
                    format!("metadata.annotations[{key}] must be {what} ({value}), not {named}"),
                );
            }
        }
    }
    match missing.is_empty() {
        true => Decision::Allow,
        false => Decision::Patch(add_annotations(object, &missing)),
    }
}

/// An UPDATE that drops a stamp gets the old value back (what the
/// MutatingAdmissionPolicy does). A changed value is left to the validating
/// policy, which refuses it.
fn keep_on_update(request: &Request) -> Decision {
    let (Some(object), Some(old)) = (&request.object, &request.old_object) else {
        return Decision::Allow;
    };
    let dropped: Vec<(&str, &str)> = [REQUESTER_ANNOTATION, REQUESTER_GROUPS_ANNOTATION]
        .into_iter()
        .filter(|key| annotation(object, key).is_none())
        .filter_map(|key| Some((key, annotation(old, key)?)))
        .collect();
    match dropped.is_empty() {
        true => Decision::Allow,
        false => Decision::Patch(add_annotations(object, &dropped)),
    }
}

/// The object's annotation `key`, when it has one (a string).
fn annotation<'a>(object: &'a Value, key: &str) -> Option<&'a str> {
    object.pointer("/metadata/annotations")?.get(key)?.as_str()
}

/// The JSONPatch adding `stamps` to `object`'s annotations, or as a new
/// annotations map when it has none (JSON Patch cannot add a member to a
/// missing object).
fn add_annotations(object: &Value, stamps: &[(&str, &str)]) -> json_patch::Patch {
    let has_map = object
        .pointer("/metadata/annotations")
        .is_some_and(Value::is_object);
    let ops: Vec<Value> = if has_map {
        stamps
            .iter()
            .map(|(key, value)| {
                json!({
                    "op": "add",
                    "path": format!("/metadata/annotations/{}", escape_pointer(key)),
                    "value": value,
                })
            })
            .collect()
    } else {
        let map: serde_json::Map<String, Value> = stamps
            .iter()
            .map(|(key, value)| (key.to_string(), json!(value)))
            .collect();
        vec![json!({"op": "add", "path": "/metadata/annotations", "value": map})]
    };
    serde_json::from_value(Value::Array(ops)).expect("a well-formed JSON Patch")
}

/// A JSON Pointer reference token (RFC 6901): `~` is `~0`, `/` is `~1`.
fn escape_pointer(token: &str) -> String {
    token.replace('~', "~0").replace('/', "~1")
}

/// The AdmissionReview answering request `uid`.
fn respond(uid: &str, decision: Decision) -> Value {
    let response = match decision {
        Decision::Allow => json!({"uid": uid, "allowed": true}),
        Decision::Patch(patch) => {
            let bytes = serde_json::to_vec(&patch).expect("a patch serializes");
            json!({
                "uid": uid,
                "allowed": true,
                "patchType": "JSONPatch",
                "patch": base64::engine::general_purpose::STANDARD.encode(bytes),
            })
        }
        Decision::Deny(code, message) => json!({
            "uid": uid,
            "allowed": false,
            "status": {
                "status": "Failure",
                "code": code,
                "reason": if code == 403 { "Forbidden" } else { "BadRequest" },
                "message": message,
            },
        }),
    };
    json!({"apiVersion": REVIEW_API_VERSION, "kind": REVIEW_KIND, "response": response})
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use tower::ServiceExt as _;

    /// The request of the Kubernetes documentation's example
    /// (extensible-admission-controllers, "Request"): an UPDATE of a
    /// Deployment's scale subresource, with every field a v1 review carries.
    fn docs_example() -> Value {
        json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                "kind": {"group": "autoscaling", "version": "v1", "kind": "Scale"},
                "resource": {"group": "apps", "version": "v1", "resource": "deployments"},
                "subResource": "scale",
                "requestKind": {"group": "autoscaling", "version": "v1", "kind": "Scale"},
                "requestResource": {"group": "apps", "version": "v1", "resource": "deployments"},
                "requestSubResource": "scale",
                "name": "my-deployment",
                "namespace": "my-namespace",
                "operation": "UPDATE",
                "userInfo": {
                    "username": "admin",
                    "uid": "014fbff9a07c",
                    "groups": ["system:authenticated", "my-admin-group"],
                    "extra": {"some-key": ["some-value1", "some-value2"]}
                },
                "object": {"apiVersion": "autoscaling/v1", "kind": "Scale"},
                "oldObject": {"apiVersion": "autoscaling/v1", "kind": "Scale"},
                "options": {"apiVersion": "meta.k8s.io/v1", "kind": "UpdateOptions"},
                "dryRun": false
            }
        })
    }

    /// The same shape, for an AgentRun CREATE by `user` of `object`.
    fn agentrun_create(user: &str, object: Value) -> Value {
        let mut review = docs_example();
        let r = &mut review["request"];
        r["uid"] = json!("1b4e28ba-2fa1-11d2-883f-0016d3cca427");
        r["kind"] = json!({"group": "agentrun.dev", "version": "v1alpha1", "kind": "AgentRun"});
        r["resource"] =
            json!({"group": "agentrun.dev", "version": "v1alpha1", "resource": "agentruns"});
        r["requestKind"] = r["kind"].clone();
        r["requestResource"] = r["resource"].clone();
        let m = r.as_object_mut().unwrap();
        m.remove("subResource");
        m.remove("requestSubResource");
        m.remove("oldObject");
        r["name"] = json!("refund-order-1042");
        r["operation"] = json!("CREATE");
        r["userInfo"]["username"] = json!(user);
        r["object"] = object;
        r["options"] = json!({"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"});
        review
    }

    fn run(annotations: Option<Value>) -> Value {
        let mut run = json!({
            "apiVersion": "agentrun.dev/v1alpha1",
            "kind": "AgentRun",
            "metadata": {"name": "refund-order-1042", "namespace": "my-namespace"},
            "spec": {"input": "Refund order 1042.", "agentRef": {"name": "refund-assistant"}}
        });
        if let Some(a) = annotations {
            run["metadata"]["annotations"] = a;
        }
        run
    }

    /// POSTs `body` to the router; the status and the body as JSON (or text).
    async fn post_review(body: Vec<u8>) -> (StatusCode, Value) {
        let response = router()
            .oneshot(
                axum::http::Request::post(PATH)
                    .header("content-type", "application/json")
                    .body(Body::from(body))
                    .unwrap(),
            )
            .await
            .unwrap();
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        let value = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        (status, value)
    }

    /// The response's patch, decoded, applied to `object`.
    fn apply_patch(response: &Value, object: &Value) -> Value {
        assert_eq!(response["patchType"], "JSONPatch", "{response}");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(response["patch"].as_str().expect("a base64 patch"))
            .expect("base64");
        let patch: json_patch::Patch = serde_json::from_slice(&bytes).expect("a JSON Patch");
        let mut patched = object.clone();
        json_patch::patch(&mut patched, &patch).expect("the patch applies");
        patched
    }

    #[tokio::test]
    async fn the_docs_example_is_answered_with_its_uid_and_allowed_untouched() {
        let (status, review) = post_review(docs_example().to_string().into_bytes()).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(review["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(review["kind"], "AdmissionReview");
        assert_eq!(
            review["response"],
            json!({"uid": "705ab4f5-6393-11e8-b7cc-42010a800002", "allowed": true})
        );
    }

    #[tokio::test]
    async fn a_run_without_annotations_gets_the_creators_name() {
        let object = run(None);
        let (status, review) = post_review(
            agentrun_create("alice", object.clone())
                .to_string()
                .into_bytes(),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        let response = &review["response"];
        assert_eq!(response["uid"], "1b4e28ba-2fa1-11d2-883f-0016d3cca427");
        assert_eq!(response["allowed"], true);
        let patched = apply_patch(response, &object);
        assert_eq!(
            patched["metadata"]["annotations"],
            json!({"agentrun.dev/requester": "alice", "agentrun.dev/requester-groups": "system:authenticated\nmy-admin-group"})
        );
        assert_eq!(
            patched["spec"], object["spec"],
            "only the annotation changes"
        );
    }

    #[tokio::test]
    async fn a_run_with_other_annotations_keeps_them_and_gets_the_requester() {
        let object = run(Some(json!({"team": "finance", "a~b/c": "x"})));
        let user = "system:serviceaccount:argocd:argocd-application-controller";
        let (_, review) = post_review(
            agentrun_create(user, object.clone())
                .to_string()
                .into_bytes(),
        )
        .await;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(review["response"]["patch"].as_str().unwrap())
            .unwrap();
        let ops: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(
            ops[0]["path"], "/metadata/annotations/agentrun.dev~1requester",
            "`/` is escaped as ~1 in the pointer"
        );
        let patched = apply_patch(&review["response"], &object);
        assert_eq!(
            patched["metadata"]["annotations"],
            json!({"team": "finance", "a~b/c": "x", "agentrun.dev/requester": user, "agentrun.dev/requester-groups": "system:authenticated\nmy-admin-group"})
        );
    }

    #[tokio::test]
    async fn a_run_naming_its_creator_is_allowed_as_is() {
        let object = run(Some(
            json!({"agentrun.dev/requester": "alice", "agentrun.dev/requester-groups": "system:authenticated\nmy-admin-group"}),
        ));
        let (_, review) =
            post_review(agentrun_create("alice", object).to_string().into_bytes()).await;
        assert_eq!(
            review["response"],
            json!({"uid": "1b4e28ba-2fa1-11d2-883f-0016d3cca427", "allowed": true})
        );
    }

    #[tokio::test]
    async fn a_run_naming_somebody_else_is_refused_naming_the_field_and_both_users() {
        let object = run(Some(json!({"agentrun.dev/requester": "bob"})));
        let (status, review) =
            post_review(agentrun_create("alice", object).to_string().into_bytes()).await;
        assert_eq!(
            status,
            StatusCode::OK,
            "a refusal is a review, not an HTTP error"
        );
        let response = &review["response"];
        assert_eq!(response["uid"], "1b4e28ba-2fa1-11d2-883f-0016d3cca427");
        assert_eq!(response["allowed"], false);
        assert!(response.get("patch").is_none());
        assert_eq!(response["status"]["code"], 403);
        assert_eq!(
            response["status"]["message"],
            "metadata.annotations[agentrun.dev/requester] must be your own user name (alice), not bob"
        );
    }

    #[tokio::test]
    async fn a_run_naming_groups_other_than_its_creators_is_refused_naming_the_field() {
        for forged in [
            "system:masters",
            "system:authenticated\nmy-admin-group\nsystem:masters",
            "",
        ] {
            let object = run(Some(json!({"agentrun.dev/requester-groups": forged})));
            let (_, review) =
                post_review(agentrun_create("alice", object).to_string().into_bytes()).await;
            let response = &review["response"];
            assert_eq!(response["allowed"], false, "{forged:?}");
            assert_eq!(response["status"]["code"], 403);
            let message = response["status"]["message"].as_str().unwrap();
            assert!(
                message.starts_with(
                    "metadata.annotations[agentrun.dev/requester-groups] must be your own groups"
                ),
                "{message}"
            );
        }
    }

    #[tokio::test]
    async fn an_update_that_drops_the_groups_gets_them_back() {
        let old = run(Some(
            json!({"agentrun.dev/requester": "alice", "agentrun.dev/requester-groups": "system:authenticated\nmy-admin-group"}),
        ));
        let mut review = agentrun_create(
            "flux",
            run(Some(json!({"agentrun.dev/requester": "alice"}))),
        );
        review["request"]["operation"] = json!("UPDATE");
        review["request"]["oldObject"] = old.clone();
        let (_, answer) = post_review(review.to_string().into_bytes()).await;
        let patched = apply_patch(&answer["response"], &review["request"]["object"]);
        assert_eq!(
            patched["metadata"]["annotations"],
            old["metadata"]["annotations"]
        );
    }

    #[tokio::test]
    async fn an_update_that_drops_the_requester_gets_it_back_and_others_pass() {
        let old = run(Some(json!({"agentrun.dev/requester": "alice"})));
        let mut review = agentrun_create("flux", run(Some(json!({"x": "y"}))));
        review["request"]["operation"] = json!("UPDATE");
        review["request"]["oldObject"] = old;
        let (_, answer) = post_review(review.to_string().into_bytes()).await;
        let patched = apply_patch(&answer["response"], &review["request"]["object"]);
        assert_eq!(
            patched["metadata"]["annotations"],
            json!({"x": "y", "agentrun.dev/requester": "alice"}),
            "the creator's name is kept, not the updater's"
        );

        // Kept as is: no patch (a change is the validating policy's to refuse).
        review["request"]["object"] = run(Some(json!({"agentrun.dev/requester": "mallory"})));
        let (_, answer) = post_review(review.to_string().into_bytes()).await;
        assert_eq!(answer["response"]["allowed"], true);
        assert!(answer["response"].get("patch").is_none());

        // DELETE carries no object.
        review["request"]["operation"] = json!("DELETE");
        review["request"]["object"] = Value::Null;
        let (_, answer) = post_review(review.to_string().into_bytes()).await;
        assert_eq!(answer["response"]["allowed"], true);
    }

    #[tokio::test]
    async fn other_kinds_are_allowed_untouched() {
        let mut review = agentrun_create("alice", json!({"metadata": {}}));
        review["request"]["kind"] =
            json!({"group": "agentrun.dev", "version": "v1alpha1", "kind": "Approval"});
        let (_, answer) = post_review(review.to_string().into_bytes()).await;
        assert_eq!(answer["response"]["allowed"], true);
        assert!(answer["response"].get("patch").is_none());
    }

    #[tokio::test]
    async fn malformed_reviews_are_a_400_naming_what_is_wrong() {
        for (body, names) in [
            (b"not json".to_vec(), "is not an admission.k8s.io/v1 AdmissionReview"),
            (
                json!({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": docs_example()["request"]})
                    .to_string()
                    .into_bytes(),
                "apiVersion/kind",
            ),
            (
                json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"})
                    .to_string()
                    .into_bytes(),
                "request: missing",
            ),
            (
                json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "u"}})
                    .to_string()
                    .into_bytes(),
                "missing field",
            ),
        ] {
            let (status, answer) = post_review(body).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
            assert!(answer.as_str().unwrap().contains(names), "{answer}");
        }
        // A CREATE without an object, or without a user, is refused as bad.
        let mut review = agentrun_create("alice", Value::Null);
        review["request"].as_object_mut().unwrap().remove("object");
        let (_, answer) = post_review(review.to_string().into_bytes()).await;
        assert_eq!(answer["response"]["allowed"], false);
        assert_eq!(answer["response"]["status"]["code"], 400);
        let (_, answer) =
            post_review(agentrun_create("", run(None)).to_string().into_bytes()).await;
        assert_eq!(answer["response"]["status"]["code"], 400);
        assert!(
            answer["response"]["status"]["message"]
                .as_str()
                .unwrap()
                .contains("request.userInfo.username")
        );
    }

    #[tokio::test]
    async fn bodies_beyond_the_limit_are_refused() {
        let mut review = agentrun_create("alice", run(None));
        review["request"]["object"]["spec"]["input"] = json!("x".repeat(MAX_BODY));
        let (status, _) = post_review(review.to_string().into_bytes()).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    }
}
