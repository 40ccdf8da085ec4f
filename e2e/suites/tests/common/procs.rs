//! Processes of this machine seen from outside, through `/proc`: CPU time
//! and resident memory, for the benchmarks' cost figures.

pub fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no memory effects.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}

/// utime, stime, cutime, cstime of a process, in clock ticks (zeros once
/// it is gone).
pub fn proc_times(pid: u32) -> [f64; 4] {
    let fields = stat_fields(pid);
    let num = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    [num(11), num(12), num(13), num(14)]
}

/// The fields of `/proc/PID/stat` after the command name.
fn stat_fields(pid: u32) -> Vec<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    after.split_whitespace().map(str::to_string).collect()
}

pub fn ppid(pid: u32) -> u32 {
    stat_fields(pid)
        .get(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Every process id now.
pub fn all_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The processes of the real node's pod `uid` (its containers', pause
/// included): those whose cgroup path names the pod, as the kubelet writes
/// it with either cgroup driver (`pod<uid>`, or `pod<uid with _>.slice`).
pub fn pod_pids(uid: &str) -> Vec<u32> {
    let cgroupfs = format!("pod{uid}");
    let systemd = format!("pod{}", uid.replace('-', "_"));
    all_pids()
        .into_iter()
        .filter(|p| {
            let cg = std::fs::read_to_string(format!("/proc/{p}/cgroup")).unwrap_or_default();
            cg.contains(&cgroupfs) || cg.contains(&systemd)
        })
        .collect()
}

/// The PostgreSQL servers' processes (postmasters and backends).
pub fn postgres_pids() -> Vec<u32> {
    let comm = |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    all_pids()
        .into_iter()
        .filter(|p| comm(*p).trim() == "postgres")
        .collect()
}

/// CPU seconds used so far by `pids`; a process whose parent is not among
/// them (a postmaster) also counts its reaped children (exited backends).
pub fn cpu_seconds(pids: &[u32]) -> f64 {
    let ticks: f64 = pids
        .iter()
        .map(|pid| {
            let t = proc_times(*pid);
            let root = !pids.contains(&ppid(*pid));
            t[0] + t[1] + if root { t[2] + t[3] } else { 0.0 }
        })
        .sum();
    ticks / clock_ticks()
}

/// A `/proc/<pid>/status` field in kB (VmRSS, VmHWM).
pub fn status_kb(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// The proportional memory of `pids` together (`Pss` of
/// `/proc/PID/smaps_rollup`: pages shared by N processes count 1/N each,
/// so PostgreSQL's shared buffers count once), in bytes.
pub fn pss_bytes(pids: &[u32]) -> f64 {
    pids.iter()
        .map(|p| {
            std::fs::read_to_string(format!("/proc/{p}/smaps_rollup"))
                .unwrap_or_default()
                .lines()
                .find_map(|l| l.strip_prefix("Pss:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
                .unwrap_or(0.0)
                * 1024.0
        })
        .sum()
}

/// The process of the local control plane's component `name` (`etcd`,
/// `apiserver`, `node`...), from the pid files `e2e/cluster` keeps.
pub fn cluster_pid(name: &str) -> Option<u32> {
    let dir = std::env::var("AGENTRUN_CLUSTER_DIR").unwrap_or_default();
    std::fs::read_to_string(format!("{dir}/pids/{name}"))
        .ok()
        .and_then(|p| p.trim().parse().ok())
}
