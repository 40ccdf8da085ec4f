//! Logging setup shared by every binary: JSON logs for machines, plain for
//! people, a log level that can be changed while the process runs, and
//! OpenTelemetry traces when an OTLP endpoint is configured ([`trace`]).

use crate::refusal::Refusal;
use std::sync::{Mutex, OnceLock};

use tracing_subscriber::{EnvFilter, Layer as _, Registry, fmt, prelude::*, reload};

pub mod trace;

/// The reload handle of the installed filter, and the directives it holds.
struct Level {
    handle: reload::Handle<EnvFilter, Registry>,
    directives: Mutex<String>,
}

static LEVEL: OnceLock<Level> = OnceLock::new();

/// Installs the global subscriber. `RUST_LOG` sets the level of the logs
/// (default `info`); `AGENTRUN_LOG_FORMAT=json` switches to structured JSON
/// lines, each with the fields of its spans (`run`, `namespace`, `step`...).
/// With an OTLP endpoint configured, spans are exported too ([`trace`]),
/// whatever the log level; `service` names this process in them.
pub fn init(service: &str) {
    let directives = std::env::var("RUST_LOG")
        .ok()
        .filter(|d| !d.trim().is_empty() && EnvFilter::try_new(d).is_ok())
        .unwrap_or_else(|| "info".into());
    let (filter, handle) = reload::Layer::new(EnvFilter::new(&directives));
    let json = std::env::var(LOG_FORMAT_ENV).is_ok_and(|f| f == "json");
    let logs = if json {
        fmt::layer()
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .with_filter(filter)
            .boxed()
    } else {
        fmt::layer()
            .with_writer(std::io::stderr)
            // Colours only on a terminal: a container's log is a file.
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_filter(filter)
            .boxed()
    };
    let installed = tracing_subscriber::registry()
        .with(logs)
        .with(trace::layer(service))
        .try_init();
    if installed.is_ok() {
        let _ = LEVEL.set(Level {
            handle,
            directives: Mutex::new(directives),
        });
    }
}

/// What step Jobs inherit from the controller's environment: the log format
/// (their logs read like the controller's) and the OpenTelemetry settings of
/// [`trace::step_env`].
pub fn step_env() -> Vec<(String, String)> {
    let format = std::env::var(LOG_FORMAT_ENV)
        .ok()
        .filter(|f| !f.is_empty())
        .map(|f| (LOG_FORMAT_ENV.to_string(), f));
    format.into_iter().chain(trace::step_env()).collect()
}

const LOG_FORMAT_ENV: &str = "AGENTRUN_LOG_FORMAT";

/// The filter directives in force (`RUST_LOG` syntax), if [`init`] ran.
pub fn log_level() -> Option<String> {
    let level = LEVEL.get()?;
    Some(
        level
            .directives
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone(),
    )
}

/// Replaces the filter with `directives` (`RUST_LOG` syntax, e.g. `debug` or
/// `info,agentrun=debug`) without restarting the process.
pub fn set_log_level(directives: &str) -> Result<(), Refusal> {
    let directives = directives.trim();
    if directives.is_empty() {
        return Err("empty log level: send e.g. `debug` or `info,agentrun=debug`".into());
    }
    let filter = EnvFilter::try_new(directives).map_err(|e| format!("{directives:?}: {e}"))?;
    let level = LEVEL
        .get()
        .ok_or_else(|| "logging is not initialised in this process".to_string())?;
    level.handle.reload(filter).map_err(|e| e.to_string())?;
    *level.directives.lock().unwrap_or_else(|e| e.into_inner()) = directives.to_string();
    tracing::info!(level = directives, "log level changed");
    Ok(())
}
