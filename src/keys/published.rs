//! The controller's public keys, published for auditors: a ConfigMap
//! ([`CONFIGMAP`]) in the controller's own namespace, readable by anyone
//! the chart lets read it (public keys are not secrets), written by the
//! controller at start (server-side apply: every replica writes the same).
//!
//! `data`: `current` = the id of the key signing now; one entry per key,
//! `<key id>` = hex Ed25519 public key (the current one and the ones a
//! rotation retired, whose signatures still verify). A key id is computed
//! from its key ([`crate::store::key_id`]), so a reader checks the pairing.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};

use crate::store::{KeyError, PublicKey, RecordVerifier, key_id};

/// Name of the ConfigMap (fixed, so `kubectl agentrun verify` finds it
/// knowing only the namespace).
pub const CONFIGMAP: &str = "agentrun-controller-keys";
/// The `data` entry naming the current key.
const CURRENT: &str = "current";

/// The ConfigMap's `data` for `keys` (the current one is the one not retired).
pub fn data(keys: &RecordVerifier) -> BTreeMap<String, String> {
    let mut data: BTreeMap<String, String> = keys
        .keys()
        .iter()
        .map(|k| (k.id.clone(), k.to_hex()))
        .collect();
    if let Some(current) = keys.keys().iter().find(|k| !k.retired) {
        data.insert(CURRENT.into(), current.id.clone());
    }
    data
}

/// Why the published keys could not be read.
#[derive(Debug, thiserror::Error)]
pub enum PublishedError {
    #[error("reading the controller's public keys (ConfigMap {namespace}/{CONFIGMAP}): {error}")]
    Read {
        namespace: String,
        error: kube::Error,
    },
    #[error(
        "no ConfigMap {namespace}/{CONFIGMAP}: the controller publishes its public keys there \
         (pass --controller-namespace if it runs elsewhere)"
    )]
    Missing { namespace: String },
    #[error("ConfigMap {CONFIGMAP}: no `{CURRENT}` entry")]
    NoCurrent,
    #[error("ConfigMap {CONFIGMAP} entry {id}: {error}")]
    Entry { id: String, error: KeyError },
    #[error("ConfigMap {CONFIGMAP} entry {id}: the key's id is {actual}, not {id}")]
    WrongId { id: String, actual: String },
    #[error("ConfigMap {CONFIGMAP}: the current key {0} is not published")]
    CurrentNotPublished(String),
    #[error("ConfigMap {CONFIGMAP}: {0}")]
    Keys(KeyError),
}

/// The keys a ConfigMap's `data` publishes; an error names the entry.
pub fn parse(data: &BTreeMap<String, String>) -> Result<RecordVerifier, PublishedError> {
    let current = data.get(CURRENT).ok_or(PublishedError::NoCurrent)?;
    let mut keys = Vec::new();
    for (id, hex) in data.iter().filter(|(k, _)| k.as_str() != CURRENT) {
        let key =
            PublicKey::from_hex(hex, id != current).map_err(|error| PublishedError::Entry {
                id: id.clone(),
                error,
            })?;
        if key_id(&key.key) != *id {
            return Err(PublishedError::WrongId {
                id: id.clone(),
                actual: key.id,
            });
        }
        keys.push(key);
    }
    if !keys.iter().any(|k| !k.retired) {
        return Err(PublishedError::CurrentNotPublished(current.clone()));
    }
    keys.sort_by_key(|k| k.retired);
    RecordVerifier::new(keys).map_err(PublishedError::Keys)
}

/// Writes the ConfigMap in `namespace`.
pub async fn publish(
    client: &kube::Client,
    namespace: &str,
    keys: &RecordVerifier,
) -> Result<(), kube::Error> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let cm = serde_json::json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": CONFIGMAP,
            "labels": {"app.kubernetes.io/managed-by": "agentrun", "app.kubernetes.io/component": "controller"},
        },
        "data": data(keys),
    });
    api.patch(
        CONFIGMAP,
        &PatchParams::apply(crate::api::FIELD_MANAGER).force(),
        &Patch::Apply(cm),
    )
    .await
    .map(|_| ())
}

/// Publishes in the background until it succeeds (a missing RBAC rule or
/// a namespace still being created is logged, not fatal: runs go on, and
/// `verify` says it finds no keys).
pub fn spawn_publish(client: kube::Client, namespace: String, keys: RecordVerifier) {
    tokio::spawn(async move {
        let mut wait = std::time::Duration::from_secs(1);
        loop {
            match publish(&client, &namespace, &keys).await {
                Ok(()) => {
                    tracing::info!(%namespace, configmap = CONFIGMAP, keys = keys.keys().len(), "published the controller's public keys");
                    return;
                }
                Err(e) => {
                    tracing::warn!(%namespace, configmap = CONFIGMAP, error = %e, "publishing the controller's public keys; retrying");
                }
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(std::time::Duration::from_secs(60));
        }
    });
}

/// Reads the keys published in `namespace`.
pub async fn read(
    client: &kube::Client,
    namespace: &str,
) -> Result<RecordVerifier, PublishedError> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let cm = api
        .get_opt(CONFIGMAP)
        .await
        .map_err(|error| PublishedError::Read {
            namespace: namespace.into(),
            error,
        })?;
    let cm = cm.ok_or_else(|| PublishedError::Missing {
        namespace: namespace.into(),
    })?;
    parse(&cm.data.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::RecordSigner;

    #[test]
    fn published_keys_round_trip_and_check_their_ids() {
        let (new, old) = (
            RecordSigner::from_seed(&[1; 32]),
            RecordSigner::from_seed(&[2; 32]),
        );
        let keys = RecordVerifier::new(vec![new.public_key(false), old.public_key(true)]).unwrap();
        let d = data(&keys);
        assert_eq!(d[CURRENT], new.key_id());
        assert_eq!(parse(&d).unwrap().keys(), keys.keys());
        let mut swapped = d.clone();
        swapped.insert(new.key_id().into(), old.public_key_hex());
        assert!(
            parse(&swapped)
                .unwrap_err()
                .to_string()
                .contains("the key's id is")
        );
        let mut no_current = d.clone();
        no_current.insert(CURRENT.into(), "0000".into());
        assert!(
            parse(&no_current)
                .unwrap_err()
                .to_string()
                .contains("not published")
        );
        assert!(
            parse(&BTreeMap::new())
                .unwrap_err()
                .to_string()
                .contains("no `current`")
        );
    }
}
