//! The discovery documents the aggregator and kubectl read: the group, its
//! version and the one resource. Served without authorization, as the API
//! server serves its own (they say what exists, not what anyone holds).

use serde_json::{Value, json};

use crate::api::runlog::{LOG_API_VERSION, LOG_GROUP, LOG_VERSION, RUNLOGS};

/// `/apis`: the legacy APIGroupList. A request that asks for the
/// aggregated form (`as=APIGroupDiscoveryList`: the aggregator, which
/// decodes a 200 as that form only) gets `None`: answered 406, the
/// aggregator then reads the legacy documents below.
pub fn apis(accept: &str) -> Option<Value> {
    if accept.contains("APIGroupDiscoveryList") {
        return None;
    }
    Some(json!({
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [group()],
    }))
}

/// `/apis/log.agentrun.dev`: the APIGroup.
pub fn group() -> Value {
    let version = json!({"groupVersion": LOG_API_VERSION, "version": LOG_VERSION});
    json!({
        "kind": "APIGroup",
        "apiVersion": "v1",
        "name": LOG_GROUP,
        "versions": [version.clone()],
        "preferredVersion": version,
    })
}

/// `/apis/log.agentrun.dev/v1alpha1`: the APIResourceList.
pub fn resources() -> Value {
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": LOG_API_VERSION,
        "resources": [{
            "name": RUNLOGS,
            "singularName": "runlog",
            "namespaced": true,
            "kind": "RunLog",
            "verbs": ["get", "list", "watch"],
            "shortNames": ["arlog"],
        }],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_aggregated_form_alone_is_declined_so_the_aggregator_reads_the_legacy_one() {
        let aggregated = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList";
        assert!(apis(aggregated).is_none());
        assert!(apis(&format!("{aggregated},application/json")).is_none());
        assert!(apis("application/json").is_some());
        assert!(apis("").is_some());
        let list = resources();
        assert_eq!(list["resources"][0]["name"], "runlogs");
        assert_eq!(
            list["resources"][0]["verbs"],
            json!(["get", "list", "watch"])
        );
    }
}
