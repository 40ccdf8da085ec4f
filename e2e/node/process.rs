//! One container = one local process in its own process group.
//!
//! The group is what a container's cgroup is to a real runtime: signals go to
//! the whole group so that `sh -c 'sleep 100'` dies with its children, and the
//! group is killed when its leader exits, as a runtime kills what remains in
//! a container whose main process is gone.

use std::{
    fs::OpenOptions,
    os::unix::{fs::PermissionsExt as _, process::CommandExt as _},
    path::{Path, PathBuf},
    process::{ExitStatus, Stdio},
};

use crate::env::Env;

/// Everything needed to start a container process.
#[derive(Debug, Clone)]
pub struct Launch {
    pub program: String,
    pub args: Vec<String>,
    pub env: Env,
    pub cwd: PathBuf,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub log: PathBuf,
}

/// A process that could not be started, with the exit code a shell would use.
#[derive(Debug)]
pub struct StartError {
    pub exit_code: i32,
    pub message: String,
}

impl StartError {
    fn not_found(message: String) -> Self {
        Self {
            exit_code: 127,
            message,
        }
    }
    fn cannot_execute(message: String) -> Self {
        Self {
            exit_code: 126,
            message,
        }
    }
}

/// Finds `program` the way execvp would, in the container's own PATH, so that
/// "not found" and "not executable" are reported precisely.
fn resolve_program(program: &str, env: &Env, cwd: &Path) -> Result<PathBuf, StartError> {
    if program.is_empty() {
        return Err(StartError::not_found("empty command".into()));
    }
    if program.contains('/') {
        let path = cwd.join(program);
        return match std::fs::metadata(&path) {
            Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => Ok(path),
            Ok(_) => Err(StartError::cannot_execute(format!(
                "{program}: permission denied"
            ))),
            Err(_) => Err(StartError::not_found(format!(
                "{program}: no such file or directory"
            ))),
        };
    }
    let mut found_not_executable = false;
    for dir in env
        .get("PATH")
        .unwrap_or("")
        .split(':')
        .filter(|d| !d.is_empty())
    {
        let candidate = Path::new(dir).join(program);
        if let Ok(m) = std::fs::metadata(&candidate) {
            if m.is_file() && m.permissions().mode() & 0o111 != 0 {
                return Ok(candidate);
            }
            found_not_executable = true;
        }
    }
    if found_not_executable {
        Err(StartError::cannot_execute(format!(
            "{program}: permission denied"
        )))
    } else {
        Err(StartError::not_found(format!(
            "{program}: executable file not found in $PATH"
        )))
    }
}

/// Starts the process, stdout and stderr appended to the container log.
pub fn spawn(launch: &Launch) -> Result<tokio::process::Child, StartError> {
    let program = resolve_program(&launch.program, &launch.env, &launch.cwd)?;
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&launch.log)
        .map_err(|e| {
            StartError::cannot_execute(format!("opening log {}: {e}", launch.log.display()))
        })?;
    let log_err = log
        .try_clone()
        .map_err(|e| StartError::cannot_execute(format!("duplicating log handle: {e}")))?;

    let mut cmd = std::process::Command::new(&program);
    cmd.args(&launch.args)
        .env_clear()
        .envs(launch.env.vars().iter().map(|(k, v)| (k, v)))
        .current_dir(&launch.cwd)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err)
        .process_group(0);
    if let Some(gid) = launch.gid {
        cmd.gid(gid);
    }
    if let Some(uid) = launch.uid {
        cmd.uid(uid);
    }
    let node_pid = std::process::id();
    // SAFETY: only async-signal-safe libc calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            // If the node dies without cleaning up (SIGKILL), take the process
            // down with it instead of leaking it. Runs after setuid, which
            // would otherwise clear the setting.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != node_pid as libc::pid_t {
                return Err(std::io::Error::other("process node exited"));
            }
            // Pods yield the CPU to the control plane (API server, the
            // operator and its step-log gateway), as a real node's workloads
            // live in their own cgroups on other machines: 200 step processes
            // on this one machine must not starve the components they call.
            libc::setpriority(libc::PRIO_PROCESS, 0, 10);
            Ok(())
        });
    }
    tokio::process::Command::from(cmd).spawn().map_err(|e| {
        let message = format!("{}: {e}", program.display());
        match e.kind() {
            std::io::ErrorKind::NotFound => StartError::not_found(message),
            _ => StartError::cannot_execute(message),
        }
    })
}

/// Sends `signal` to every process of the group; false if none is left.
pub fn signal_group(pgid: u32, signal: libc::c_int) -> bool {
    let Ok(pgid) = libc::pid_t::try_from(pgid) else {
        return false;
    };
    if pgid <= 1 {
        return false; // never signal init or "every process"
    }
    // SAFETY: kill(2) with a negative pid signals a process group.
    unsafe { libc::kill(-pgid, signal) == 0 }
}

/// Kills processes a previous run of the node left behind (it was killed
/// before it could stop them): anything whose working dir or HOME is inside
/// `pods_dir`, where every container process starts.
pub fn kill_leftovers(pods_dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let own = std::process::id();
    let inside = |p: &Path| p.starts_with(pods_dir);
    let mut killed = 0;
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == own {
            continue;
        }
        let cwd_inside = std::fs::read_link(entry.path().join("cwd")).is_ok_and(|c| inside(&c));
        let home_inside = std::fs::read(entry.path().join("environ")).is_ok_and(|env| {
            env.split(|b| *b == 0)
                .filter_map(|kv| kv.strip_prefix(b"HOME="))
                .any(|home| inside(Path::new(&*String::from_utf8_lossy(home))))
        });
        if (cwd_inside || home_inside)
            && let Ok(pid) = libc::pid_t::try_from(pid)
        {
            // SAFETY: plain kill(2) of one process.
            if unsafe { libc::kill(pid, libc::SIGKILL) } == 0 {
                killed += 1;
            }
        }
    }
    killed
}

/// The exit code a shell would show: 128 + signal for a killed process.
pub fn exit_code(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt as _;
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(255)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_in_container_path() {
        let mut env = Env::default();
        env.set("PATH", "/nonexistent:/bin:/usr/bin".into());
        let sh = resolve_program("sh", &env, Path::new("/")).expect("sh on PATH");
        assert!(sh.ends_with("sh"));
        let err = resolve_program("no-such-binary-agentrun", &env, Path::new("/")).unwrap_err();
        assert_eq!(err.exit_code, 127);
        let err = resolve_program("/etc/passwd", &env, Path::new("/")).unwrap_err();
        assert_eq!(err.exit_code, 126);
    }
}
