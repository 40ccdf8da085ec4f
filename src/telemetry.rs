//! Logging setup shared by every binary: JSON logs for machines, plain for people.

use tracing_subscriber::{EnvFilter, fmt, prelude::*};

/// Installs the global subscriber. `RUST_LOG` sets the level (default `info`);
/// `AGENTRUN_LOG_FORMAT=json` switches to structured JSON lines.
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("AGENTRUN_LOG_FORMAT").is_ok_and(|f| f == "json");
    let registry = tracing_subscriber::registry().with(filter);
    if json {
        registry
            .with(fmt::layer().json().with_current_span(true))
            .init();
    } else {
        registry
            .with(fmt::layer().with_writer(std::io::stderr))
            .init();
    }
}
