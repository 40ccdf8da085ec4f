//! Step pods run in process (`--in-process-steps`): a container that runs
//! `agentrun step` from the `agentrun` image is not spawned as a process but
//! run as a task calling the library's runner, `agentrun::step::runner`,
//! with the arguments the process would have read from its environment
//! (resolved and rewritten as for a process: a container agent's runner
//! serves on its pod's own loopback address, `loopback.rs`).
//!
//! Everything the step does goes through the same step-log gateway, with the
//! pod's own token, and the pod's status is reported exactly as for a
//! process: Running, then terminated with the exit code the `step`
//! subcommand would have had (0, 1 on an error, 3 when its lease was taken
//! over). Only the process boundary is simulated, so that a 2-core machine
//! can hold 1,000 step pods at once (the scale benchmark). Deleting the pod
//! aborts the task (exit code 143, as SIGTERM kills the real process).
//!
//! A pod armed with a failpoint (`AGENTRUN_FAILPOINT`) still runs as a
//! process: failpoints abort or freeze the whole process they are read in.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use agentrun::step::runner::{LEASE_LOST_EXIT_CODE, StepArgs, StepError};
use agentrun::store::{self, RemoteStore, StepStore};
use tokio::runtime::Handle;
use tracing::info;

use crate::{
    env::Env,
    image::image_name,
    process::Launch,
    status::{State, Terminated, now},
    supervision::{Event, Spec, StopRx, next_stop},
};

/// The runtime step tasks run on: its own threads, below the control
/// plane's priority like pod processes (`process::spawn`), so that 1,000
/// runners never starve the node's own pod bookkeeping.
pub fn runtime() -> anyhow::Result<Handle> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("step-pods")
        .on_thread_start(|| {
            // On Linux, PRIO_PROCESS with who = 0 sets the calling thread's nice value.
            // SAFETY: setpriority(2) on the calling thread only.
            unsafe {
                libc::setpriority(libc::PRIO_PROCESS, 0, 10);
            }
        })
        .enable_all()
        .build()?;
    let handle = rt.handle().clone();
    // Lives as long as the node: dropping a runtime inside another blocks.
    Box::leak(Box::new(rt));
    Ok(handle)
}

/// The step arguments of `launch` if it is `agentrun step` (from the
/// `agentrun` image's binary) and can run in process; `None` runs it as a
/// process.
pub fn step_args(spec: &Spec, launch: &Launch) -> Option<(StepArgs, Option<String>)> {
    let image = spec.container.image.as_deref().unwrap_or("");
    if image_name(image) != "agentrun" {
        return None;
    }
    let program = std::path::Path::new(&launch.program).file_name()?;
    if program != "agentrun" || launch.args.first().map(String::as_str) != Some("step") {
        return None;
    }
    // `agentrun step` with flags of its own: leave them to clap, in a process.
    if launch.args.len() > 1 {
        return None;
    }
    let env = &launch.env;
    if env.get("AGENTRUN_FAILPOINT").is_some_and(|f| !f.is_empty()) {
        return None;
    }
    let args = from_env(env)?;
    let token = env.get(store::STORE_TOKEN_ENV).map(str::to_string);
    Some((args, token))
}

/// `StepArgs` as clap builds them from the environment (the controller's
/// Job sets every one of these; see `src/controller/job.rs`).
fn from_env(env: &Env) -> Option<StepArgs> {
    let get = |name: &str| env.get(name).filter(|v| !v.is_empty()).map(str::to_string);
    Some(StepArgs {
        run_uid: get("AGENTRUN_RUN_UID")?,
        run_name: get("AGENTRUN_RUN_NAME").unwrap_or_default(),
        store_url: get(store::STORE_URL_ENV)?,
        log_anchor: get("AGENTRUN_LOG_ANCHOR"),
        controller_key: get("AGENTRUN_CONTROLLER_KEY"),
        signed_from: get("AGENTRUN_SIGNED_FROM").map_or(Some(0), |v| v.parse().ok())?,
        bound_from: get("AGENTRUN_BOUND_FROM").map_or(Some(0), |v| v.parse().ok())?,
        signing_keys: get("AGENTRUN_SIGNING_KEYS"),
        model_api_key: get("AGENTRUN_MODEL_API_KEY"),
        worker: get("POD_NAME").unwrap_or_else(|| "local".into()),
        attempt: get("AGENTRUN_ATTEMPT").map_or(Some(1), |v| v.parse().ok())?,
        time_slice_seconds: get("AGENTRUN_TIME_SLICE_SECONDS")
            .map_or(Some(60), |v| v.parse().ok())?,
        step_timeout_seconds: get("AGENTRUN_STEP_TIMEOUT_SECONDS").and_then(|v| v.parse().ok()),
        loopback_addr: get("AGENTRUN_LOOPBACK_ADDR"),
        runner_key: get("AGENTRUN_RUNNER_KEY"),
    })
}

/// Opens the store the way `store::open` would, with the pod's token
/// instead of the process environment's.
async fn open_store(
    url: &str,
    token: Option<&str>,
) -> Result<Arc<dyn StepStore>, store::StoreError> {
    let scheme = url.split_once(':').map(|(s, _)| s.to_ascii_lowercase());
    match (scheme.as_deref(), token) {
        // Same timeout as `store::open` gives the gateway client.
        (Some("http" | "https"), Some(token)) => Ok(Arc::new(RemoteStore::new(
            url,
            token,
            store::OpenOptions::default().acquire_timeout + Duration::from_secs(20),
        )?)),
        _ => store::open(url).await,
    }
}

/// A number for the container's id (`process://N`): above any real pid.
fn task_id() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(1_000_000_000);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn log_line(spec: &Spec, line: &str) {
    use std::io::Write as _;
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&spec.log)
    {
        let _ = writeln!(
            f,
            "{} [process node, in-process step] {line}",
            chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
        );
    }
}

/// Runs the step task until it ends or the pod stops; the container's end.
pub async fn run(
    spec: &Spec,
    steps: &Handle,
    (args, token): (StepArgs, Option<String>),
    stop: &mut StopRx,
    send: &impl Fn(Event),
) -> Terminated {
    let id = task_id();
    let started_at = now();
    let pod = spec.pod.metadata.name.as_deref().unwrap_or("").to_string();
    info!(pod = %pod, container = %spec.container.name, id, "container started (in process)");
    log_line(spec, "runner started");
    send(Event::State(
        spec.slot,
        State::Running {
            started_at: started_at.clone(),
            pid: id,
        },
    ));
    let mut task = steps.spawn(async move {
        let store = open_store(&args.store_url, token.as_deref()).await?;
        Ok::<(), anyhow::Error>(agentrun::step::runner::run_on(args, store).await?)
    });
    // The message is what `agentrun step` writes to its termination log
    // (src/main.rs): its error, or its panic.
    let (code, outcome, message) = tokio::select! {
        joined = &mut task => match joined {
            Ok(Ok(())) => (0, "finished".to_string(), None),
            Ok(Err(e)) if e.downcast_ref::<StepError>().is_some_and(StepError::lease_lost) => {
                (LEASE_LOST_EXIT_CODE, format!("stopped: {e:#}"), Some(format!("{e:#}")))
            }
            Ok(Err(e)) => (1, format!("failed: {e:#}"), Some(format!("{e:#}"))),
            // Rust's exit code for a panicking main.
            Err(e) if e.is_panic() => {
                let payload = e.into_panic();
                let text = payload
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                (101, "panicked".to_string(), Some(format!("panicked: {text}")))
            }
            Err(_) => (137, "cancelled".to_string(), None),
        },
        s = next_stop(stop) => {
            task.abort();
            let _ = task.await;
            (128 + libc::SIGTERM, format!("aborted ({:?})", s.reason), None)
        }
    };
    log_line(spec, &format!("runner {outcome}; exit code {code}"));
    info!(pod = %pod, container = %spec.container.name, id, exit_code = code, "container exited (in process)");
    let mut terminated = Terminated::exited(code, started_at, id);
    terminated.message = message;
    terminated
}
