//! `agentrun agent-shim -- COMMAND ARGS`: what wraps a container agent's
//! own command in its container (docs/container-agents.md). It waits until
//! the runner beside it answers on loopback (the two containers start
//! together), runs the command as its child with the signals the kubelet
//! sends passed on, then tells the runner how the agent ended (its exit
//! code and the result file it wrote) and exits with the same code.
//!
//! It holds nothing secret: the key it sends opens only this pod's loopback
//! endpoints, and the agent beside it could send the same report itself;
//! an agent choosing its own result is no more than its code already can.

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use crate::wire::loopback::{AgentExit, EXIT_PATH, READY_PATH, STOP_PATH};

/// Where the runner listens and how it is opened (set by the controller).
#[derive(clap::Args, Debug, Clone)]
pub struct ShimArgs {
    /// The runner's loopback URL (`http://127.0.0.1:PORT`).
    #[arg(long, env = "AGENTRUN_RUNNER_URL")]
    pub runner_url: String,
    /// The pod's loopback key (also the agent's `OPENAI_API_KEY`).
    #[arg(long, env = "AGENTRUN_RUNNER_KEY", hide_env_values = true)]
    pub runner_key: String,
    /// The file the agent may write its result to.
    #[arg(long, env = "AGENTRUN_RESULT_FILE")]
    pub result_file: Option<PathBuf>,
    /// How long to wait for the runner before giving up.
    #[arg(long, default_value_t = 120)]
    pub wait_seconds: u64,
    /// The agent's command and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// Largest result read from the result file; past it the runner is told
/// the result was too large (and records that, not a cut result).
pub const MAX_RESULT_BYTES: usize = 1 << 20;

/// Where the step pod's init container puts the shim for the agent's
/// container (an `emptyDir` both mount).
#[derive(clap::Args, Debug, Clone)]
pub struct InstallArgs {
    /// The directory to copy this binary into (as `agentrun`).
    pub dir: PathBuf,
}

/// Copies the running binary into `dir` as `agentrun`, executable: the
/// agent's image need not hold anything of agentrun's.
pub fn install(args: &InstallArgs) -> Result<PathBuf, ShimError> {
    let to = args.dir.join("agentrun");
    let from = std::env::current_exe().map_err(ShimError::Install)?;
    std::fs::copy(&from, &to).map_err(ShimError::Install)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o555))
        .map_err(ShimError::Install)?;
    Ok(to)
}

#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    #[error("installing the agent shim")]
    Install(#[source] std::io::Error),
    #[error("the runner at {url} did not answer within {seconds} s")]
    RunnerNotReady { url: String, seconds: u64 },
    #[error("the runner at {url} is gone (it listened, then refused); the agent was not started")]
    RunnerGone { url: String },
    #[error("starting the agent's command {command:?}")]
    Start {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("waiting for the agent's command")]
    Wait(#[source] std::io::Error),
    #[error("reporting the agent's exit to the runner")]
    Report(#[source] reqwest::Error),
}

/// How long a runner that never answered may take to start listening.
const NEVER_SEEN: Duration = Duration::from_secs(30);

/// How long a stopped agent is given between SIGTERM and SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Runs the agent and reports how it ended; returns its exit code. When
/// the runner says the step is over (a call waits for a human, the run
/// diverged or ends), the agent is stopped and the shim exits 0: the
/// agent did not fail, it was stopped. When the runner is gone, the agent
/// is stopped too (nothing would answer it) and the shim exits with the
/// agent's code.
pub async fn run(args: ShimArgs) -> Result<i32, ShimError> {
    let http = reqwest::Client::new();
    wait_for_runner(&http, &args).await?;
    let (status, stop) = run_child(&args.command, runner_stop(&http, &args)).await?;
    let exit = AgentExit {
        code: code_of(status),
        ..read_result(args.result_file.as_deref())
    };
    if stop == Some(Stop::Asked) {
        // Told, not failed; the runner needs no report (it may be gone).
        let _ = report(&http, &args, &exit).await;
        return Ok(0);
    }
    // The container's exit code is the agent's whether or not the runner
    // heard: the kubelet reports it, and a runner that did not record the
    // end has the next pod run the agent again.
    if let Err(e) = report(&http, &args, &exit).await {
        tracing::warn!(error = %e, code = exit.code, "the runner did not take the agent's report");
    }
    Ok(exit.code)
}

/// Why the shim stopped the agent.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Stop {
    /// The runner said the step is over.
    Asked,
    /// The runner is gone.
    RunnerGone,
}

/// Resolves when the runner says the step is over, or cannot be reached.
async fn runner_stop(http: &reqwest::Client, args: &ShimArgs) -> Stop {
    let url = format!("{}{STOP_PATH}", args.runner_url);
    match http.get(&url).bearer_auth(&args.runner_key).send().await {
        Ok(r) if r.status().is_success() => Stop::Asked,
        // A runner without the path never asks.
        Ok(_) => std::future::pending().await,
        Err(_) => Stop::RunnerGone,
    }
}

/// Waits until the runner serves the agent. The runner listens from its
/// start (a request waits in its queue, timing out here, until it
/// serves): refused after that, the runner is gone and the agent never
/// starts.
async fn wait_for_runner(http: &reqwest::Client, args: &ShimArgs) -> Result<(), ShimError> {
    let url = format!("{}{READY_PATH}", args.runner_url);
    let start = tokio::time::Instant::now();
    let deadline = start + Duration::from_secs(args.wait_seconds);
    // The kubelet starts the runner's container before the agent's: a
    // runner never reached in this long died before the shim looked.
    let never_seen = start + NEVER_SEEN.min(Duration::from_secs(args.wait_seconds));
    let mut seen = false;
    loop {
        let asked = http
            .get(&url)
            .bearer_auth(&args.runner_key)
            .timeout(Duration::from_secs(2))
            .send()
            .await;
        match asked {
            Ok(r) if r.status().is_success() => return Ok(()),
            Ok(_) => seen = true,
            Err(e) if e.is_timeout() => seen = true,
            Err(e) if e.is_connect() && (seen || tokio::time::Instant::now() >= never_seen) => {
                return Err(ShimError::RunnerGone {
                    url: args.runner_url.clone(),
                });
            }
            Err(_) => {}
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(ShimError::RunnerNotReady {
                url: args.runner_url.clone(),
                seconds: args.wait_seconds,
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs the command with this process's stdio, passing on SIGTERM and
/// SIGINT (the kubelet stops the container by signalling the shim), and
/// stops it when `stop` resolves (SIGTERM, then SIGKILL after a grace).
async fn run_child(
    command: &[String],
    stop: impl Future<Output = Stop>,
) -> Result<(ExitStatus, Option<Stop>), ShimError> {
    let (program, args) = command.split_first().expect("clap requires a command");
    let mut child = tokio::process::Command::new(program)
        .args(args)
        .spawn()
        .map_err(|source| ShimError::Start {
            command: command.join(" "),
            source,
        })?;
    let pid = child.id();
    let mut term = signal(tokio::signal::unix::SignalKind::terminate());
    let mut int = signal(tokio::signal::unix::SignalKind::interrupt());
    let mut stop = std::pin::pin!(stop);
    let stopped = loop {
        tokio::select! {
            status = child.wait() => return Ok((status.map_err(ShimError::Wait)?, None)),
            _ = term.recv() => pass_on(pid, libc::SIGTERM),
            _ = int.recv() => pass_on(pid, libc::SIGINT),
            why = &mut stop => break why,
        }
    };
    tracing::info!(?stopped, "stopping the agent");
    pass_on(pid, libc::SIGTERM);
    let status = match tokio::time::timeout(STOP_GRACE, child.wait()).await {
        Ok(status) => status,
        Err(_) => {
            pass_on(pid, libc::SIGKILL);
            child.wait().await
        }
    };
    Ok((status.map_err(ShimError::Wait)?, Some(stopped)))
}

fn signal(kind: tokio::signal::unix::SignalKind) -> tokio::signal::unix::Signal {
    tokio::signal::unix::signal(kind).expect("a signal handler can be installed")
}

fn pass_on(pid: Option<u32>, signal: libc::c_int) {
    if let Some(pid) = pid.and_then(|p| libc::pid_t::try_from(p).ok()) {
        // SAFETY: kill(2) with our own child's pid and a valid signal.
        unsafe {
            libc::kill(pid, signal);
        }
    }
}

fn code_of(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1)
}

/// The result file's text, or why it cannot be read (none written: none).
fn read_result(path: Option<&std::path::Path>) -> AgentExit {
    let mut exit = AgentExit {
        code: 0,
        result: None,
        result_unreadable: None,
    };
    let Some(bytes) = path.and_then(|p| std::fs::read(p).ok()) else {
        return exit;
    };
    if bytes.len() > MAX_RESULT_BYTES {
        exit.result_unreadable = Some(format!(
            "the result file holds {} bytes, more than {MAX_RESULT_BYTES}",
            bytes.len()
        ));
        return exit;
    }
    match String::from_utf8(bytes) {
        Ok(text) => exit.result = Some(text),
        Err(_) => exit.result_unreadable = Some("the result file is not UTF-8 text".into()),
    }
    exit
}

/// Tells the runner, a few times if it does not answer at once.
async fn report(
    http: &reqwest::Client,
    args: &ShimArgs,
    exit: &AgentExit,
) -> Result<(), ShimError> {
    let url = format!("{}{EXIT_PATH}", args.runner_url);
    let mut last = None;
    for attempt in 0..5u32 {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
        }
        match http
            .post(&url)
            .bearer_auth(&args.runner_key)
            .json(exit)
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
        {
            Ok(_) => return Ok(()),
            Err(e) => last = Some(e),
        }
    }
    Err(ShimError::Report(last.expect("at least one attempt")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    use axum::Json;
    use axum::http::{HeaderMap, StatusCode};
    use axum::routing::{get, post};

    /// A runner stand-in: ready once `ready` is set, noting reports; it
    /// asks the agent to stop once `stop` is notified.
    #[derive(Clone, Default)]
    struct Runner {
        ready: Arc<Mutex<bool>>,
        exits: Arc<Mutex<Vec<AgentExit>>>,
        stop: Arc<tokio::sync::Notify>,
    }

    fn authorized(headers: &HeaderMap) -> bool {
        headers.get("authorization").and_then(|v| v.to_str().ok()) == Some("Bearer pod-key")
    }

    async fn serve(runner: Runner) -> String {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let (r1, r2, r3) = (runner.clone(), runner.clone(), runner);
        let app = axum::Router::new()
            .route(
                STOP_PATH,
                get(move |h: HeaderMap| async move {
                    if !authorized(&h) {
                        return StatusCode::UNAUTHORIZED;
                    }
                    r3.stop.notified().await;
                    StatusCode::OK
                }),
            )
            .route(
                READY_PATH,
                get(move |h: HeaderMap| async move {
                    if authorized(&h) && *r1.ready.lock().unwrap() {
                        StatusCode::OK
                    } else {
                        StatusCode::SERVICE_UNAVAILABLE
                    }
                }),
            )
            .route(
                EXIT_PATH,
                post(
                    move |h: HeaderMap, Json(exit): Json<AgentExit>| async move {
                        if !authorized(&h) {
                            return StatusCode::UNAUTHORIZED;
                        }
                        r2.exits.lock().unwrap().push(exit);
                        StatusCode::NO_CONTENT
                    },
                ),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        url
    }

    fn args(url: &str, result_file: PathBuf, script: &str) -> ShimArgs {
        ShimArgs {
            runner_url: url.into(),
            runner_key: "pod-key".into(),
            result_file: Some(result_file),
            wait_seconds: 10,
            command: vec!["sh".into(), "-c".into(), script.into()],
        }
    }

    /// The agent starts only once the runner is ready; its exit code and
    /// result file reach the runner; the shim ends with the same code.
    #[tokio::test]
    async fn the_agent_runs_once_the_runner_is_ready_and_its_end_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let runner = Runner::default();
        let url = serve(runner.clone()).await;
        let started = dir.path().join("started");
        let result = dir.path().join("result");
        let script = format!(
            "touch {}; printf 'refunded 300' > {}; exit 3",
            started.display(),
            result.display()
        );
        let shim = tokio::spawn(run(args(&url, result, &script)));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!started.exists(), "the agent waits for the runner");
        *runner.ready.lock().unwrap() = true;
        assert_eq!(shim.await.unwrap().unwrap(), 3);
        assert!(started.exists());
        let exits = runner.exits.lock().unwrap().clone();
        assert_eq!(
            exits,
            [AgentExit {
                code: 3,
                result: Some("refunded 300".into()),
                result_unreadable: None
            }]
        );
    }

    #[tokio::test]
    async fn an_agent_ended_by_a_signal_reports_128_plus_it_and_a_huge_result_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let runner = Runner::default();
        *runner.ready.lock().unwrap() = true;
        let url = serve(runner.clone()).await;
        let result = dir.path().join("result");
        std::fs::write(&result, vec![b'x'; MAX_RESULT_BYTES + 1]).unwrap();
        let code = run(args(&url, result, "kill -TERM $$")).await.unwrap();
        assert_eq!(code, 128 + libc::SIGTERM);
        let exit = runner.exits.lock().unwrap()[0].clone();
        assert_eq!(exit.result, None);
        assert!(
            exit.result_unreadable
                .unwrap()
                .contains("more than 1048576")
        );
    }

    /// The runner says the step is over (a call waits for a human): the
    /// agent, still running, is stopped and the shim ends well.
    #[tokio::test]
    async fn an_agent_the_runner_stops_is_stopped_and_the_shim_exits_0() {
        let dir = tempfile::tempdir().unwrap();
        let runner = Runner::default();
        *runner.ready.lock().unwrap() = true;
        let url = serve(runner.clone()).await;
        let started = dir.path().join("started");
        let script = format!("touch {}; sleep 60; exit 5", started.display());
        let shim = tokio::spawn(run(args(&url, dir.path().join("result"), &script)));
        for _ in 0..200 {
            if started.exists() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert!(started.exists(), "the agent started");
        runner.stop.notify_one();
        let code = tokio::time::timeout(Duration::from_secs(5), shim)
            .await
            .expect("the agent is stopped at once, not after its sleep")
            .unwrap()
            .unwrap();
        assert_eq!(code, 0);
    }

    #[test]
    fn the_shim_installs_itself_executable_into_the_shared_directory() {
        let dir = tempfile::tempdir().unwrap();
        let to = install(&InstallArgs {
            dir: dir.path().to_path_buf(),
        })
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&to).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o555);
        let ours = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        assert!(
            std::fs::read(&to).unwrap() == ours,
            "a copy of the running binary"
        );
    }

    /// A runner that listened (its requests waited) and then died: the
    /// agent is never started and the shim ends at once, not after its wait.
    #[tokio::test]
    async fn a_runner_that_listened_then_died_is_gone_and_the_agent_never_starts() {
        let dir = tempfile::tempdir().unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let started = dir.path().join("started");
        let script = format!("touch {}", started.display());
        let mut a = args(&url, dir.path().join("result"), &script);
        a.wait_seconds = 60;
        let shim = tokio::spawn(run(a));
        tokio::time::sleep(Duration::from_millis(2500)).await;
        drop(listener);
        let e = tokio::time::timeout(Duration::from_secs(10), shim)
            .await
            .expect("the shim ends once the runner is gone")
            .unwrap()
            .unwrap_err();
        assert!(matches!(e, ShimError::RunnerGone { .. }), "{e}");
        assert!(!started.exists(), "the agent never started");
    }

    #[tokio::test]
    async fn a_runner_that_never_answers_is_an_error_naming_it() {
        let runner = Runner::default();
        let url = serve(runner).await;
        let mut a = args(&url, PathBuf::from("/nonexistent"), "exit 0");
        a.wait_seconds = 0;
        let e = run(a).await.unwrap_err();
        assert!(matches!(e, ShimError::RunnerNotReady { .. }), "{e}");
    }
}
