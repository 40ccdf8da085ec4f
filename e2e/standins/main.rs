//! `agentrun-standins`: stand-ins for what cannot be reached from here, as
//! real HTTP servers speaking the real wire formats: a scripted model server
//! (OpenAI chat completions and Anthropic Messages), an HTTP tool server with
//! idempotency keys, and a small MCP server. One address serves all three.

mod mcp;
mod model;
mod tools;

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "agentrun-standins",
    about = "Scripted model, tool and MCP servers for agentrun's tests"
)]
struct Cli {
    /// Address to listen on (loopback only by default).
    #[arg(long, default_value = "127.0.0.1:18080")]
    addr: std::net::SocketAddr,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    agentrun::telemetry::init("agentrun-standins");
    let cli = Cli::parse();
    let app = axum::Router::new()
        .merge(model::router())
        .merge(tools::router())
        .merge(mcp::router());
    let listener = tokio::net::TcpListener::bind(cli.addr).await?;
    // Tests read this line to learn the port when started with port 0.
    println!("listening on {}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
