//! Supervises one container: resolve its environment, start its process,
//! wait for it (or for the pod to stop), restart it per restartPolicy.

use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{info, warn};

use crate::{
    env::{self, Env},
    in_process,
    process::{self, Launch},
    status::{State, Terminated, now},
    supervision::{Event, Spec, StopRx, next_stop},
};

fn is_stopping(stop: &StopRx) -> bool {
    stop.borrow().is_some()
}

/// The command line, rewritten (`rewrite.rs`) and `$(VAR)`-expanded
/// against the final environment.
fn command_line(spec: &Spec, env: &Env) -> Result<(String, Vec<String>), String> {
    let c = &spec.container;
    let command: Vec<String> = c
        .command
        .iter()
        .flatten()
        .map(|s| env::expand(&spec.rewrite.apply(s), env))
        .collect();
    let args = c
        .args
        .iter()
        .flatten()
        .map(|s| env::expand(&spec.rewrite.apply(s), env));
    match command.split_first() {
        Some((program, rest)) => Ok((program.clone(), rest.iter().cloned().chain(args).collect())),
        None => match &spec.entrypoint {
            Some(entry) => Ok((entry.display().to_string(), args.collect())),
            None => Err(format!(
                "image {:?} has no entrypoint known to the process node: set command",
                c.image.as_deref().unwrap_or("")
            )),
        },
    }
}

/// Runs the container until it should not run again or the pod stops.
pub async fn supervise(spec: Spec, events: mpsc::UnboundedSender<Event>, mut stop: StopRx) {
    let slot = spec.slot;
    let send = |e: Event| {
        let _ = events.send(e);
    };
    let mut backoff = Duration::from_secs(1);
    loop {
        if is_stopping(&stop) {
            break;
        }
        let env = match env::resolve(
            &spec.ctx.client,
            &spec.pod,
            &spec.container,
            spec.base_env.clone(),
            &spec.rewrite,
        )
        .await
        {
            Ok(env) => env,
            Err(e) => {
                // As the kubelet: report and retry until the config exists.
                send(Event::State(
                    slot,
                    State::waiting("CreateContainerConfigError", Some(e.0)),
                ));
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(2)) => continue,
                    _ = next_stop(&mut stop) => break,
                }
            }
        };
        let launch = match launch_of(&spec, env) {
            Ok(launch) => launch,
            Err(message) => {
                let t = start_failure(127, message);
                send(Event::Exited(slot, t, false));
                break;
            }
        };

        let started = Instant::now();
        let term = start_and_wait(&spec, &launch, &mut stop, &send).await;
        let restarting = spec.restart.wants(term.exit_code) && !is_stopping(&stop);
        send(Event::Exited(slot, term, restarting));
        if !restarting {
            break;
        }
        let wait = crash_wait(backoff, started.elapsed());
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = next_stop(&mut stop) => break,
        }
        backoff = (wait * 2).min(Duration::from_secs(10));
    }
    send(Event::Done(slot));
}

/// How long a crashed container waits before it runs again: `backoff`,
/// doubled after each crash up to 10 s, but 1 s again after a run of more
/// than 10 s. Shorter than the kubelet's: tests wait on it.
fn crash_wait(backoff: Duration, ran: Duration) -> Duration {
    if ran > Duration::from_secs(10) {
        Duration::from_secs(1)
    } else {
        backoff
    }
}

/// The process the container runs, in its resolved environment `env`.
fn launch_of(spec: &Spec, env: Env) -> Result<Launch, String> {
    let (program, args) = command_line(spec, &env)?;
    Ok(Launch {
        program,
        args,
        env,
        cwd: spec.cwd.clone(),
        uid: spec.uid,
        gid: spec.gid,
        log: spec.log.clone(),
    })
}

/// Starts the container (a process, or a step pod's task in this one,
/// `in_process.rs`) and waits until it ends.
async fn start_and_wait(
    spec: &Spec,
    launch: &Launch,
    stop: &mut StopRx,
    send: &impl Fn(Event),
) -> Terminated {
    let in_process = spec
        .ctx
        .in_process_steps
        .as_ref()
        .and_then(|steps| Some((steps, in_process::step_args(spec, launch)?)));
    match in_process {
        Some((steps, args)) => in_process::run(spec, steps, args, stop, send).await,
        None => match process::spawn(launch) {
            Err(e) => {
                warn!(container = %spec.container.name, error = %e.message, "container failed to start");
                start_failure(e.exit_code, e.message)
            }
            Ok(child) => run(spec, child, stop, send).await,
        },
    }
}

fn start_failure(exit_code: i32, message: String) -> Terminated {
    Terminated {
        exit_code,
        reason: "StartError".into(),
        message: Some(message),
        started_at: None,
        finished_at: now(),
        pid: None,
    }
}

/// Waits for a started process; on stop, SIGTERM its group, SIGKILL at the deadline.
async fn run(
    spec: &Spec,
    mut child: tokio::process::Child,
    stop: &mut StopRx,
    send: &impl Fn(Event),
) -> Terminated {
    let pid = child.id().unwrap_or(0);
    let started_at = now();
    info!(
        pod = spec.pod.metadata.name.as_deref().unwrap_or(""), container = %spec.container.name, pid,
        "container started"
    );
    send(Event::State(
        spec.slot,
        State::Running {
            started_at: started_at.clone(),
            pid,
        },
    ));
    let status = tokio::select! {
        status = child.wait() => status,
        s = next_stop(stop) => {
            info!(container = %spec.container.name, pid, reason = ?s.reason, "stopping container");
            process::signal_group(pid, libc::SIGTERM);
            match tokio::time::timeout_at(s.deadline, child.wait()).await {
                Ok(status) => status,
                Err(_) => {
                    process::signal_group(pid, libc::SIGKILL);
                    child.wait().await
                }
            }
        }
    };
    // Whatever the leader left behind in its group dies with it.
    process::signal_group(pid, libc::SIGKILL);
    let code = match status {
        Ok(status) => process::exit_code(status),
        Err(e) => {
            warn!(pid, error = %e, "waiting for container process failed");
            255
        }
    };
    info!(pod = spec.pod.metadata.name.as_deref().unwrap_or(""), container = %spec.container.name, pid, exit_code = code, "container exited");
    let mut terminated = Terminated::exited(code, started_at, pid);
    terminated.message = fallback_message(spec, code);
    terminated
}

/// What a kubelet reports under `terminationMessagePolicy:
/// FallbackToLogsOnError` when the container wrote no termination file
/// (none exists here): the last lines of a failed container's log, at most
/// 80 lines and 2048 bytes.
fn fallback_message(spec: &Spec, code: i32) -> Option<String> {
    let wanted =
        spec.container.termination_message_policy.as_deref() == Some("FallbackToLogsOnError");
    if code == 0 || !wanted {
        return None;
    }
    let log = std::fs::read(&spec.log).ok()?;
    let text = String::from_utf8_lossy(&log);
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(80)..].join("\n");
    let mut start = tail.len().saturating_sub(2048);
    while !tail.is_char_boundary(start) {
        start += 1;
    }
    Some(tail[start..].to_string()).filter(|t| !t.is_empty())
}

#[cfg(test)]
mod tests {
    use super::crash_wait;
    use std::time::Duration;

    #[test]
    fn a_crash_loop_waits_longer_each_time_but_not_after_a_long_run() {
        let s = Duration::from_secs;
        assert_eq!(crash_wait(s(4), s(3)), s(4));
        assert_eq!(crash_wait(s(10), s(10)), s(10));
        assert_eq!(crash_wait(s(8), s(11)), s(1));
    }
}
