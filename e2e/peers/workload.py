"""Shared code of the Temporal and DBOS peers.

- the stand-in client: the model call (OpenAI chat completions) and the tool
  call (with a deterministic Idempotency-Key), plain synchronous `urllib`;
- the agent's fixed parts: the prompt, the tools offered, the gated tool;
- the command line both peers share (the contract in README.md);
- child-process handling (own process group, killed with the parent);
- process measurement from /proc (RSS, CPU of a process tree);
- the single JSON line of output.

Nothing here touches either engine, so the workflow sandboxes can import it.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Iterable

# --------------------------------------------------------------------------
# The agent

SYSTEM_PROMPT = "You are a careful refund agent."
MODEL = "gpt-bench"
API_KEY = "sk-bench"
GATED_TOOL = "issue_refund"

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Look up an order by its id.",
            "parameters": {
                "type": "object",
                "properties": {"orderId": {"type": "string"}},
                "required": ["orderId"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "issue_refund",
            "description": "Refund an amount of an order. Needs a person's approval.",
            "parameters": {
                "type": "object",
                "properties": {
                    "orderId": {"type": "string"},
                    "amount": {"type": "number"},
                },
                "required": ["orderId", "amount"],
                "additionalProperties": False,
            },
        },
    },
]


def initial_messages(run_id: str) -> list[dict[str, Any]]:
    """The conversation a run starts with; `[[run ID]]` attributes model calls to runs."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"Handle the refunds of the queue. [[run {run_id}]]"},
    ]


def assistant_message(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message to append, as the model returned it (content + tool_calls)."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    return out


def tool_message(tool_call_id: str, result: Any) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": tool_call_id, "content": json.dumps(result)}


def rejected_message(tool_call_id: str, reason: str) -> dict[str, Any]:
    return tool_message(
        tool_call_id, {"rejected": True, "reason": reason or "rejected by a person"}
    )


def idempotency_key(run_id: str, turn: int, index: int) -> str:
    """Deterministic per (run, turn, call index): a retried call reuses it."""
    return f"{run_id}:{turn}:{index}"


def parse_arguments(tool_call: dict[str, Any]) -> Any:
    raw = tool_call.get("function", {}).get("arguments") or "{}"
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return {"_raw": raw}


# --------------------------------------------------------------------------
# The stand-in client


class StandinError(Exception):
    """An HTTP error answer (or no answer) from a stand-in."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status

    @property
    def retryable(self) -> bool:
        # No answer, 5xx, 408 and 429 are worth retrying; other 4xx are bugs.
        return self.status is None or self.status >= 500 or self.status in (408, 409, 429)


def http_json(
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 120.0,
) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        request.add_header(k, v)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:500].decode(errors="replace")
        raise StandinError(f"{method} {url}: HTTP {e.code}: {detail}", e.code) from None
    except (urllib.error.URLError, OSError) as e:
        raise StandinError(f"{method} {url}: {e}") from None
    if not raw:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise StandinError(f"{method} {url}: answer is not JSON: {raw[:200]!r}", 502) from None


def chat(standins: str, script: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """One model call; returns choices[0].message."""
    answer = http_json(
        "POST",
        f"{standins.rstrip('/')}/scripts/{script}/v1/chat/completions",
        {"model": MODEL, "messages": messages, "tools": TOOLS},
        {"Authorization": f"Bearer {API_KEY}"},
    )
    try:
        return answer["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise StandinError(f"model answer without choices[0].message: {answer!r:.300}", 502) from None


def call_tool(
    standins: str, tenant: str, run_id: str, name: str, arguments: Any, key: str
) -> Any:
    """One tool call, once per idempotency key."""
    return http_json(
        "POST",
        f"{standins.rstrip('/')}/tools/{tenant}/{name}",
        arguments,
        {"Idempotency-Key": key, "X-Agentrun-Run": run_id},
    )


# --------------------------------------------------------------------------
# Command line (identical for both peers; see README.md)


def build_parser(system: str, database: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"{system}_peer.py", description=f"{system} peer of the agentrun benchmark")
    p.add_argument("--standins", required=True, help="stand-in server base URL")
    p.add_argument("--script", required=True, help="model script id")
    p.add_argument("--tenant", required=True, help="tool tenant")
    if database:
        p.add_argument("--database-url", required=True, help="PostgreSQL superuser URL")
    p.add_argument("--work-dir", default=None, help="scratch directory")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("steps", help="run runs concurrently to completion")
    s.add_argument("--runs", required=True, type=id_list)

    w = sub.add_parser("waiting", help="runs waiting for approval; idle cost; decisions")
    w.add_argument("--runs", required=True, type=id_list)
    w.add_argument("--decide", required=True, type=id_list)
    w.add_argument("--idle-seconds", required=True, type=float)

    k = sub.add_parser("kill", help="SIGKILL the worker during each run")
    k.add_argument("--runs", required=True, type=id_list)
    k.add_argument("--seed", required=True, type=int)
    k.add_argument("--max-delay-ms", required=True, type=float)

    # Hidden: the worker process the commands start.
    wk = sub.add_parser("worker", help=argparse.SUPPRESS)
    wk.add_argument("--address", default=None, help=argparse.SUPPRESS)
    wk.add_argument("--task-queue", default=None, help=argparse.SUPPRESS)
    wk.add_argument("--system-database-url", default=None, help=argparse.SUPPRESS)
    return p


def id_list(text: str) -> list[str]:
    ids = [x.strip() for x in text.split(",") if x.strip()]
    if len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError("duplicate run ids")
    return ids


def kill_delays(seed: int, max_delay_ms: float, n: int) -> list[float]:
    """Seconds to wait before each kill: uniform in [0, max_delay_ms) ms, seeded."""
    rng = random.Random(seed)
    return [rng.random() * max_delay_ms / 1000.0 for _ in range(n)]


# --------------------------------------------------------------------------
# Output and logging


def log(*parts: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, file=sys.stderr, flush=True)


def emit(obj: dict[str, Any]) -> None:
    """The one JSON object on the last stdout line."""
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------
# Child processes

_PR_SET_PDEATHSIG = 1


def _child_setup() -> None:
    # The child dies with this process (SIGKILL when the parent thread exits),
    # so a driver killed hard leaves nothing behind.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass


def spawn(argv: list[str], *, stdout=None, env: dict[str, str] | None = None, cwd: str | None = None) -> subprocess.Popen:
    """Start a child in its own process group (so its whole tree can be killed)."""
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=None,  # inherited: the children's logs go to our stderr
        env=env,
        cwd=cwd,
        start_new_session=True,
        preexec_fn=_child_setup,
    )


def kill_tree(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal the child's process group (its whole tree)."""
    if proc.poll() is not None and sig != signal.SIGKILL:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def stop(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    """SIGTERM the tree, SIGKILL it if it has not ended in `timeout` seconds."""
    if proc is None:
        return
    if proc.poll() is None:
        kill_tree(proc, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    kill_tree(proc, signal.SIGKILL)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def wait_ready_line(proc: subprocess.Popen, what: str, timeout: float) -> str:
    """Read the child's stdout until a line starting with 'ready'."""
    import selectors

    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    buf = b""
    fd = proc.stdout.fileno()
    while time.monotonic() < deadline:
        if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            raise RuntimeError(f"{what} exited before it was ready (exit code {proc.wait()})")
        buf += chunk
        for line in buf.split(b"\n")[:-1]:
            if line.startswith(b"ready"):
                sel.close()
                return line.decode()
    sel.close()
    raise RuntimeError(f"{what} not ready after {timeout:.0f} s")


def install_signal_handlers() -> None:
    """SIGTERM/SIGHUP end the command like Ctrl-C, so `finally` blocks stop the children."""

    def handler(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt(f"signal {signum}")

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, handler)


# Ports handed to children (the Temporal server) come from below the kernel's
# ephemeral range: a port from bind(0), closed again, may be taken by any
# connection or server before the child binds it. (The Rust harness uses
# 26000-29999, e2e/'s fixed ports are 23790 and 25432-25433.)
_PORTS = itertools.count(os.getpid() % 1000)


def free_port() -> int:
    for _ in range(1000):
        port = 24000 + next(_PORTS) % 1000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 24000-24999 on 127.0.0.1")


# --------------------------------------------------------------------------
# Process measurement (/proc)

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(ppid, utime+stime seconds) of a live process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    fields = data[data.rindex(")") + 2 :].split()
    ppid = int(fields[1])
    utime, stime = int(fields[11]), int(fields[12])
    return ppid, (utime + stime) / _CLK_TCK


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def process_tree(roots: Iterable[int]) -> list[int]:
    """The live processes of the trees rooted at `roots`."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        st = _stat(int(name))
        if st is not None:
            children.setdefault(st[0], []).append(int(name))
    out: list[int] = []
    todo = [r for r in roots if r and os.path.exists(f"/proc/{r}")]
    seen: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def cpu_by_pid(roots: Iterable[int]) -> dict[int, float]:
    out = {}
    for pid in process_tree(roots):
        st = _stat(pid)
        if st is not None:
            out[pid] = st[1]
    return out


def rss_of(roots: Iterable[int]) -> int:
    return sum(_rss_bytes(pid) for pid in process_tree(roots))


def pss_of(roots: Iterable[int]) -> int:
    return sum(_pss_bytes(pid) for pid in process_tree(roots))


class IdleMeter:
    """RSS at the end and CPU seconds over a window, per group of process trees.

    `rss_bytes` sums VmRSS (the contract's figure: shared pages, e.g.
    PostgreSQL's shared buffers, count once per process); `pss_bytes` adds the
    proportional set size, which counts a shared page once in all."""

    def __init__(self, groups: dict[str, list[int]]):
        self.groups = groups
        self.before = {g: cpu_by_pid(r) for g, r in groups.items()}

    def finish(self) -> dict[str, dict[str, float]]:
        rss: dict[str, float] = {}
        pss: dict[str, float] = {}
        cpu: dict[str, float] = {}
        for g, roots in self.groups.items():
            after = cpu_by_pid(roots)
            # A process born during the window counts from zero.
            cpu[g] = round(sum(t - self.before[g].get(pid, 0.0) for pid, t in after.items()), 3)
            rss[g] = rss_of(roots)
            pss[g] = pss_of(roots)
        return {"rss_bytes": rss, "cpu_seconds": cpu, "pss_bytes": pss}


def listening_pid(port: int) -> int | None:
    """The pid of the process listening on TCP `port` (via /proc/net/tcp socket inodes)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    local, state, inode = cols[1], cols[3], cols[9]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                        inodes.add(inode)
        except OSError:
            continue
    if not inodes:
        return None
    candidates = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{name}/fd"):
                target = os.readlink(f"/proc/{name}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    candidates.append(int(name))
                    break
        except OSError:
            continue
    if not candidates:
        return None
    # The listener's parent chain: pick the top-most one holding the socket.
    cset = set(candidates)
    for pid in candidates:
        st = _stat(pid)
        if st is not None and st[0] not in cset:
            return pid
    return candidates[0]
