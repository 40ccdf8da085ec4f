//! The tool servers a container agent is served, and their names: one per
//! MCP server the Agent declares (by URL, in the order they first appear),
//! one more for its HTTP tools. A name is what the agent finds its server
//! by: the path `/mcp/{name}` on the loopback, and the variable
//! `AGENTRUN_MCP_{NAME}_URL` (upper case, `-` as `_`) the pod sets.
//!
//! A server is named by the first label of its host (`shop` for
//! `http://shop.tools.svc:8080/mcp`), `mcp` for an address, and the name
//! repeats with `-2`, `-3`... where two servers share it; the HTTP tools'
//! server is `tools` (or `tools-2` when an MCP server took that name).

use crate::api::ToolSpec;

/// One served tool server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolServer {
    pub name: String,
    /// The MCP server's URL; `None` for the HTTP tools' server.
    pub url: Option<String>,
    /// The Agent's names of its tools, in the Agent's order.
    pub tools: Vec<String>,
}

impl ToolServer {
    /// The variable that holds its loopback URL in the agent's container.
    pub fn env_name(&self) -> String {
        format!(
            "AGENTRUN_MCP_{}_URL",
            self.name.to_uppercase().replace('-', "_")
        )
    }

    /// Its URL on the loopback at `port`.
    pub fn local_url(&self, port: u16) -> String {
        format!("http://127.0.0.1:{port}/mcp/{}", self.name)
    }
}

/// The servers of `tools`, named.
pub fn tool_servers(tools: &[ToolSpec]) -> Vec<ToolServer> {
    let mut servers: Vec<ToolServer> = Vec::new();
    let mut http = Vec::new();
    for tool in tools {
        match &tool.mcp {
            Some(mcp) => match servers
                .iter_mut()
                .find(|s| s.url.as_deref() == Some(&mcp.url))
            {
                Some(server) => server.tools.push(tool.name.clone()),
                None => {
                    let name = unique(&servers, &label(&mcp.url));
                    servers.push(ToolServer {
                        name,
                        url: Some(mcp.url.clone()),
                        tools: vec![tool.name.clone()],
                    });
                }
            },
            None => http.push(tool.name.clone()),
        }
    }
    if !http.is_empty() {
        let name = unique(&servers, "tools");
        servers.push(ToolServer {
            name,
            url: None,
            tools: http,
        });
    }
    servers
}

/// The first label of the URL's host, in `[a-z0-9-]`; `mcp` for an
/// address or anything without a usable label.
fn label(url: &str) -> String {
    let host = url::Url::parse(url)
        .ok()
        .and_then(|u| match u.host() {
            Some(url::Host::Domain(d)) => Some(d.to_string()),
            _ => None,
        })
        .unwrap_or_default();
    let first: String = host
        .split('.')
        .next()
        .unwrap_or_default()
        .to_ascii_lowercase()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
        .take(40)
        .collect();
    let first = first.trim_matches('-');
    if first.is_empty() {
        "mcp".into()
    } else {
        first.to_string()
    }
}

fn unique(servers: &[ToolServer], base: &str) -> String {
    let taken = |n: &str| servers.iter().any(|s| s.name == n);
    if !taken(base) {
        return base.to_string();
    }
    (2..)
        .map(|i| format!("{base}-{i}"))
        .find(|n| !taken(n))
        .expect("some suffix is free")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str, mcp: Option<&str>) -> ToolSpec {
        let spec = match mcp {
            Some(url) => serde_json::json!({"name": name, "mcp": {"url": url}}),
            None => serde_json::json!({"name": name, "http": {"url": "http://refunds/x"}}),
        };
        serde_json::from_value(spec).unwrap()
    }

    #[test]
    fn servers_are_named_by_their_host_and_the_http_tools_share_one() {
        let tools = [
            tool("lookup", Some("http://shop.tools.svc:8080/mcp")),
            tool("refund", None),
            tool("ticket", Some("https://shop.example.com/mcp")),
            tool("weather", Some("http://10.0.0.7/mcp")),
            tool("order", Some("http://shop.tools.svc:8080/mcp")),
            tool("notify", None),
        ];
        let servers = tool_servers(&tools);
        let named: Vec<(&str, Vec<&str>)> = servers
            .iter()
            .map(|s| {
                (
                    s.name.as_str(),
                    s.tools.iter().map(String::as_str).collect(),
                )
            })
            .collect();
        assert_eq!(
            named,
            [
                ("shop", vec!["lookup", "order"]),
                ("shop-2", vec!["ticket"]),
                ("mcp", vec!["weather"]),
                ("tools", vec!["refund", "notify"]),
            ]
        );
        assert_eq!(servers[1].env_name(), "AGENTRUN_MCP_SHOP_2_URL");
        assert_eq!(
            servers[1].local_url(8790),
            "http://127.0.0.1:8790/mcp/shop-2"
        );
    }

    #[test]
    fn an_mcp_server_named_tools_moves_the_http_tools_to_tools_2() {
        let servers = tool_servers(&[tool("a", Some("http://tools/mcp")), tool("b", None)]);
        assert_eq!(servers[1].name, "tools-2");
        assert!(tool_servers(&[]).is_empty());
    }
}
