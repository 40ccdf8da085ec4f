//! The real node of `e2e/cluster up --node=real`: its name, its address and
//! the test image it has.

use std::net::IpAddr;
use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::Api;

pub const NODE: &str = "agentrun-real";

/// The test image `e2e/realnode/images.sh` builds and `e2e/cluster up
/// --node=real` imports (a static busybox with its applets on PATH).
pub fn test_image() -> String {
    if let Some(image) = std::env::var("AGENTRUN_REALNODE_TEST_IMAGE")
        .ok()
        .filter(|v| !v.is_empty())
    {
        return image;
    }
    let path = super::root().join("e2e/realnode/images.sh");
    let script = path.display();
    let out = Command::new(&path)
        .arg("paths")
        .output()
        .unwrap_or_else(|e| panic!("running {script} paths: {e}"));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("TEST_IMAGE=").map(str::to_string))
        .unwrap_or_else(|| panic!("{script} paths names no TEST_IMAGE"))
}

/// The real node's InternalIP (the bridge's address), once it is Ready.
pub async fn node_ip(client: &kube::Client) -> IpAddr {
    let nodes: Api<Node> = Api::all(client.clone());
    super::wait_for(
        &format!("node {NODE} Ready with an InternalIP"),
        Duration::from_secs(60),
        || async {
            let node = match nodes.get_opt(NODE).await {
                Ok(Some(n)) => n,
                Ok(None) => {
                    return Err(format!(
                        "no node {NODE}: is the cluster up with --node=real?"
                    ));
                }
                Err(e) => return Err(e.to_string()),
            };
            let status = node.status.unwrap_or_default();
            let ready = status
                .conditions
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            let ip = status
                .addresses
                .unwrap_or_default()
                .into_iter()
                .find(|a| a.type_ == "InternalIP")
                .and_then(|a| a.address.parse::<IpAddr>().ok());
            match (ready, ip) {
                (true, Some(ip)) => Ok(ip),
                (ready, ip) => Err(format!("Ready {ready}, InternalIP {ip:?}")),
            }
        },
    )
    .await
}
