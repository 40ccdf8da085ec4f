//! Container environment, resolved the way the kubelet does it.
//!
//! Order: the node's base variables (PATH, HOME, KUBECONFIG), then `envFrom`
//! in order, then `env` in order, later entries overriding earlier ones.
//! `$(VAR)` in `env` values refers to variables defined before it; in
//! `command`/`args` it refers to the final environment.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod, Secret};
use kube::api::Api;

use crate::rewrite::SpecRewrite;

/// Why an environment could not be built; the kubelet reports this as
/// `CreateContainerConfigError` and keeps retrying.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct EnvError(pub String);

/// An ordered environment: later `set`s replace earlier ones in place.
#[derive(Debug, Default, Clone)]
pub struct Env {
    vars: Vec<(String, String)>,
}

impl Env {
    pub fn set(&mut self, name: &str, value: String) {
        match self.vars.iter_mut().find(|(n, _)| n == name) {
            Some(slot) => slot.1 = value,
            None => self.vars.push((name.to_string(), value)),
        }
    }
    pub fn get(&self, name: &str) -> Option<&str> {
        self.vars
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
    pub fn vars(&self) -> &[(String, String)] {
        &self.vars
    }
}

/// Expands `$(VAR)` references like the kubelet: `$$` escapes a `$`, unknown
/// references are left as written.
pub fn expand(input: &str, env: &Env) -> String {
    let mut out = String::with_capacity(input.len());
    let mut rest = input;
    while let Some(pos) = rest.find('$') {
        out.push_str(&rest[..pos]);
        let after = &rest[pos + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(body) = after.strip_prefix('(') {
            match body.find(')') {
                Some(end) => {
                    let name = &body[..end];
                    match env.get(name) {
                        Some(v) => out.push_str(v),
                        None => {
                            out.push_str("$(");
                            out.push_str(name);
                            out.push(')');
                        }
                    }
                    rest = &body[end + 1..];
                }
                None => {
                    out.push_str("$(");
                    rest = body;
                }
            }
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// Values of ConfigMaps and Secrets, fetched once per container start.
struct Sources<'a> {
    client: &'a kube::Client,
    namespace: &'a str,
    config_maps: BTreeMap<String, Option<BTreeMap<String, String>>>,
    secrets: BTreeMap<String, Option<BTreeMap<String, String>>>,
}

impl Sources<'_> {
    async fn config_map(
        &mut self,
        name: &str,
    ) -> Result<Option<&BTreeMap<String, String>>, EnvError> {
        if !self.config_maps.contains_key(name) {
            let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), self.namespace);
            let cm = api
                .get_opt(name)
                .await
                .map_err(|e| EnvError(format!("reading configmap {name:?}: {e}")))?;
            let data = cm.map(|cm| {
                let mut data = cm.data.unwrap_or_default();
                for (k, v) in cm.binary_data.unwrap_or_default() {
                    data.insert(k, String::from_utf8_lossy(&v.0).into_owned());
                }
                data
            });
            self.config_maps.insert(name.to_string(), data);
        }
        Ok(self.config_maps.get(name).and_then(Option::as_ref))
    }

    async fn secret(&mut self, name: &str) -> Result<Option<&BTreeMap<String, String>>, EnvError> {
        if !self.secrets.contains_key(name) {
            let api: Api<Secret> = Api::namespaced(self.client.clone(), self.namespace);
            let secret = api
                .get_opt(name)
                .await
                .map_err(|e| EnvError(format!("reading secret {name:?}: {e}")))?;
            let data = secret.map(|s| {
                let mut data: BTreeMap<String, String> = s
                    .data
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| (k, String::from_utf8_lossy(&v.0).into_owned()))
                    .collect();
                data.extend(s.string_data.unwrap_or_default());
                data
            });
            self.secrets.insert(name.to_string(), data);
        }
        Ok(self.secrets.get(name).and_then(Option::as_ref))
    }
}

/// Builds the full environment of `container` on top of `base`, every
/// value taken from the pod's spec or its sources rewritten (`rewrite.rs`).
pub async fn resolve(
    client: &kube::Client,
    pod: &Pod,
    container: &Container,
    base: Env,
    rewrite: &SpecRewrite,
) -> Result<Env, EnvError> {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let mut sources = Sources {
        client,
        namespace,
        config_maps: BTreeMap::new(),
        secrets: BTreeMap::new(),
    };
    let mut env = base;

    for from in container.env_from.iter().flatten() {
        let prefix = from.prefix.as_deref().unwrap_or("");
        let (kind, name, optional, data) = if let Some(r) = &from.config_map_ref {
            let data = sources.config_map(&r.name).await?.cloned();
            ("configmap", r.name.as_str(), r.optional, data)
        } else if let Some(r) = &from.secret_ref {
            let data = sources.secret(&r.name).await?.cloned();
            ("secret", r.name.as_str(), r.optional, data)
        } else {
            continue;
        };
        match data {
            Some(data) => {
                for (k, v) in data {
                    env.set(&format!("{prefix}{k}"), rewrite.apply(&v));
                }
            }
            None if optional == Some(true) => {}
            None => return Err(EnvError(format!("{kind} {name:?} not found"))),
        }
    }

    for var in container.env.iter().flatten() {
        let value = match &var.value_from {
            None => expand(&rewrite.apply(var.value.as_deref().unwrap_or("")), &env),
            Some(from) => rewrite.apply(&{
                if let Some(r) = &from.config_map_key_ref {
                    let value = sources.config_map(&r.name).await?;
                    match key_value("configmap", &r.name, &r.key, r.optional, value)? {
                        Some(v) => v,
                        None => continue,
                    }
                } else if let Some(r) = &from.secret_key_ref {
                    let value = sources.secret(&r.name).await?;
                    match key_value("secret", &r.name, &r.key, r.optional, value)? {
                        Some(v) => v,
                        None => continue,
                    }
                } else if let Some(r) = &from.field_ref {
                    field_value(pod, &r.field_path).ok_or_else(|| {
                        EnvError(format!("unsupported fieldRef {:?}", r.field_path))
                    })?
                } else {
                    tracing::warn!(var = %var.name, "unsupported valueFrom source; variable left unset");
                    continue;
                }
            }),
        };
        env.set(&var.name, value);
    }
    Ok(env)
}

/// The downward-API fields a process can ask for through `fieldRef`.
fn field_value(pod: &Pod, path: &str) -> Option<String> {
    let meta = &pod.metadata;
    let spec = pod.spec.as_ref();
    let subscript = |prefix: &str, map: Option<&BTreeMap<String, String>>| {
        let key = path.strip_prefix(prefix)?.strip_suffix("']")?;
        Some(map.and_then(|m| m.get(key)).cloned().unwrap_or_default())
    };
    Some(match path {
        "metadata.name" => meta.name.clone().unwrap_or_default(),
        "metadata.namespace" => meta.namespace.clone().unwrap_or_default(),
        "metadata.uid" => meta.uid.clone().unwrap_or_default(),
        "spec.nodeName" => spec.and_then(|s| s.node_name.clone()).unwrap_or_default(),
        "spec.serviceAccountName" => spec
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_else(|| "default".into()),
        // Every pod of this node lives on the loopback address.
        "status.podIP" | "status.podIPs" | "status.hostIP" | "status.hostIPs" => "127.0.0.1".into(),
        _ => {
            return subscript("metadata.labels['", meta.labels.as_ref())
                .or_else(|| subscript("metadata.annotations['", meta.annotations.as_ref()));
        }
    })
}

/// One key of a ConfigMap or Secret (`data` as read, `None` if it does not
/// exist): `Ok(None)` when it is missing but optional.
fn key_value(
    kind: &str,
    name: &str,
    key: &str,
    optional: Option<bool>,
    data: Option<&BTreeMap<String, String>>,
) -> Result<Option<String>, EnvError> {
    match (data.map(|d| d.get(key).cloned()), optional) {
        (Some(Some(v)), _) => Ok(Some(v)),
        (_, Some(true)) => Ok(None),
        (None, _) => Err(EnvError(format!("{kind} {name:?} not found"))),
        (Some(None), _) => Err(EnvError(format!(
            "key {key:?} not found in {kind} {name:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Env {
        let mut e = Env::default();
        for (k, v) in pairs {
            e.set(k, (*v).to_string());
        }
        e
    }

    #[test]
    fn expands_like_the_kubelet() {
        let e = env(&[("A", "1"), ("B", "two")]);
        assert_eq!(expand("$(A)-$(B)", &e), "1-two");
        assert_eq!(expand("$$(A)", &e), "$(A)");
        assert_eq!(expand("$(MISSING)", &e), "$(MISSING)");
        assert_eq!(expand("$A $((6*7))", &e), "$A $((6*7))");
        assert_eq!(expand("cost: $5", &e), "cost: $5");
        assert_eq!(expand("open $(A", &e), "open $(A");
    }

    #[test]
    fn later_sets_override_in_place() {
        let mut e = env(&[("A", "1"), ("B", "2")]);
        e.set("A", "3".into());
        assert_eq!(
            e.vars(),
            &[("A".into(), "3".into()), ("B".into(), "2".into())]
        );
    }
}
