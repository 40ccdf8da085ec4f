#!/usr/bin/env python3
"""DBOS peer of the agentrun benchmark (contract: README.md).

The agent loop is a workflow (`agent_run`); every model call and every tool
call is a `@DBOS.step()` with retries; the approval of the gated tool is a
message on topic "approval" the workflow waits for with `DBOS.recv`, right
after `DBOS.set_event("awaiting_approval", tool_call_id)` tells a client that
it waits. The workflow id is the run id.

As in DBOS's queue-worker example, a worker process (`... worker`) launches
DBOS, registers the queue and executes the workflows; the driver is a
`DBOSClient` that enqueues runs on that queue, sends the approvals, reads
events and results. Each command (re)creates its system database on the
PostgreSQL server of --database-url, starts the worker, stops it at the end
(also on error or Ctrl-C) and prints one JSON object on its last stdout line.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from importlib import metadata
from typing import Any

import psycopg
from dbos import DBOS, DBOSClient, DBOSConfig, EnqueueOptions

import workload as wl

APP_NAME = "agentrun-bench"
QUEUE = "agent_runs"
WORKFLOW_NAME = "agent_run"
SYSTEM_DATABASE = "agentrun_peer_dbos"
APPROVAL_TOPIC = "approval"
AWAITING_EVENT = "awaiting_approval"
APPROVAL_TIMEOUT_S = 7 * 24 * 3600  # recv's default is 60 s; a person may take days


def _retryable(e: BaseException) -> bool:
    return not isinstance(e, wl.StandinError) or e.retryable


# --------------------------------------------------------------------------
# Steps


@DBOS.step(retries_allowed=True, interval_seconds=1.0, backoff_rate=2.0, max_attempts=6, should_retry=_retryable)
def call_model(standins: str, script: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    return wl.chat(standins, script, messages)


@DBOS.step(retries_allowed=True, interval_seconds=1.0, backoff_rate=2.0, max_attempts=6, should_retry=_retryable)
def call_tool(standins: str, tenant: str, run_id: str, name: str, arguments: Any, key: str) -> Any:
    return wl.call_tool(standins, tenant, run_id, name, arguments, key)


# --------------------------------------------------------------------------
# Workflow


@DBOS.workflow(name=WORKFLOW_NAME)
def agent_run(run_id: str, standins: str, script: str, tenant: str) -> str:
    messages = wl.initial_messages(run_id)
    turn = 0
    while True:
        message = call_model(standins, script, messages)
        messages.append(wl.assistant_message(message))
        calls = message.get("tool_calls") or []
        if not calls:
            return message.get("content") or ""
        for index, call in enumerate(calls):
            name = call["function"]["name"]
            if name == wl.GATED_TOOL:
                DBOS.set_event(AWAITING_EVENT, call["id"])
                decision = DBOS.recv(APPROVAL_TOPIC, timeout_seconds=APPROVAL_TIMEOUT_S)
                if decision is None:
                    decision = {"approve": False, "reason": "no decision in time"}
                if not decision.get("approve"):
                    messages.append(wl.rejected_message(call["id"], decision.get("reason", "")))
                    continue
            result = call_tool(
                standins, tenant, run_id, name, wl.parse_arguments(call), wl.idempotency_key(run_id, turn, index)
            )
            messages.append(wl.tool_message(call["id"], result))
        turn += 1


# --------------------------------------------------------------------------
# The worker process (hidden `worker` command)


def worker_main(args) -> None:
    stopping = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, lambda *_: stopping.set())
    config: DBOSConfig = {"name": APP_NAME, "system_database_url": args.system_database_url}
    DBOS(config=config)
    # Recovers this executor's pending workflows ("local" executor id) on launch.
    DBOS.launch()
    DBOS.register_queue(QUEUE)
    print(f"ready {os.getpid()}", flush=True)
    stopping.wait()
    try:
        DBOS.destroy()
    finally:
        # Workflows still blocked in recv hold executor threads: do not wait for them.
        os._exit(0)


# --------------------------------------------------------------------------
# The driver


def with_database(url: str, database: str) -> str:
    parts = urllib.parse.urlsplit(url)
    scheme = "postgresql" if parts.scheme in ("postgres", "postgresql") else parts.scheme
    return urllib.parse.urlunsplit((scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


class Env:
    """The system database, the worker process and a client; `close()` stops them."""

    def __init__(self, args):
        self.args = args
        self.admin_url = with_database(args.database_url, urllib.parse.urlsplit(args.database_url).path.lstrip("/") or "postgres")
        self.sys_url = with_database(args.database_url, SYSTEM_DATABASE)
        self.worker: subprocess.Popen | None = None
        self.client: DBOSClient | None = None
        self.postmaster: int | None = None
        self.versions: dict[str, str] = {}

    def admin(self, sql: str, *params) -> Any:
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            cur = conn.execute(sql, params or None)
            if cur.description is None:
                return None
            row = cur.fetchone()
            return row[0] if row else None

    def start(self) -> None:
        t0 = time.time()
        self.admin(f'DROP DATABASE IF EXISTS "{SYSTEM_DATABASE}" WITH (FORCE)')
        self.admin(f'CREATE DATABASE "{SYSTEM_DATABASE}"')
        self.versions = {
            "dbos": metadata.version("dbos"),
            "postgresql": self.admin("SHOW server_version"),
            "psycopg": metadata.version("psycopg"),
            "python": sys.version.split()[0],
        }
        port = urllib.parse.urlsplit(self.args.database_url).port or 5432
        self.postmaster = wl.listening_pid(port)
        if self.postmaster is None:
            wl.log(f"warning: no process found listening on port {port}: database figures will be 0")
        self.start_worker()
        wl.wait_ready_line(self.worker, "worker", 120)
        self.client = DBOSClient(
            system_database_url=self.sys_url, application_name=APP_NAME, system_database_pool_size=10
        )
        wl.log(f"database {SYSTEM_DATABASE} created, worker ready in {time.time() - t0:.1f} s")

    def start_worker(self) -> None:
        a = self.args
        argv = [
            sys.executable, os.path.abspath(__file__),
            "--standins", a.standins, "--script", a.script, "--tenant", a.tenant,
            "--database-url", a.database_url,
            "worker", "--system-database-url", self.sys_url,
        ]
        if self.worker is not None and self.worker.stdout is not None:
            self.worker.stdout.close()
        self.worker = wl.spawn(argv, stdout=subprocess.PIPE)

    def stored_bytes(self) -> int:
        return int(self.admin("SELECT pg_database_size(%s)", SYSTEM_DATABASE))

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.destroy()
            except Exception:  # noqa: BLE001
                pass
        wl.stop(self.worker)

    def enqueue(self, run_id: str):
        a = self.args
        options: EnqueueOptions = {"queue_name": QUEUE, "workflow_name": WORKFLOW_NAME, "workflow_id": run_id}
        return self.client.enqueue(options, run_id, a.standins, a.script, a.tenant)


POLL_S = 0.05  # how often the client polls for a workflow's result


def cmd_steps(env: Env, args) -> dict[str, Any]:
    runs: dict[str, dict[str, Any]] = {}
    handles = {}
    t0 = time.time()

    def start(run_id: str) -> None:
        runs[run_id] = {"start": time.time()}
        handles[run_id] = env.enqueue(run_id)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(start, args.runs))
    pending = dict(handles)
    while pending:
        done = env.client.wait_first(list(pending.values()), polling_interval_sec=POLL_S)
        run_id = done.get_workflow_id()
        runs[run_id]["end"] = time.time()
        runs[run_id]["result"] = done.get_result()
        del pending[run_id]
    return {"runs": {r: runs[r] for r in args.runs}, "wall_s": round(time.time() - t0, 3)}


def cmd_waiting(env: Env, args) -> dict[str, Any]:
    all_ids = list(dict.fromkeys(args.runs + args.decide))
    stored_before = env.stored_bytes()
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        handles = dict(zip(all_ids, pool.map(env.enqueue, all_ids)))
    wl.log(f"enqueued {len(all_ids)} runs in {time.time() - t0:.1f} s")

    # Readiness: the event the workflow sets right before recv, read again only
    # for runs not ready yet (timeout 0: no waiting inside get_event).
    pending = set(all_ids)

    def ready(run_id: str) -> bool:
        return env.client.get_event(run_id, AWAITING_EVENT, timeout_seconds=0) is not None

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        while pending:
            ids = sorted(pending)
            pending -= {r for r, ok in zip(ids, pool.map(ready, ids)) if ok}
            if pending:
                time.sleep(0.25)
    ready_s = round(time.time() - t0, 3)
    wl.log(f"all {len(all_ids)} runs waiting after {ready_s} s")
    stored_after = env.stored_bytes()

    meter = wl.IdleMeter(
        {"engine": [], "worker": [env.worker.pid], "database": [env.postmaster] if env.postmaster else []}
    )
    time.sleep(args.idle_seconds)
    idle = {"seconds": args.idle_seconds, **meter.finish()}
    wl.log(f"idle window: {idle}")

    decided: dict[str, float] = {}
    for run_id in args.decide:
        t = time.time()
        env.client.send(run_id, {"approve": True, "reason": "approved by the benchmark"}, topic=APPROVAL_TOPIC)
        decided[run_id] = t
        handles[run_id].get_result(polling_interval_sec=POLL_S)
    wl.log(f"{len(decided)} decided runs completed")

    left = [r for r in all_ids if r not in decided]
    t1 = time.time()
    if left:
        env.client.cancel_workflows(left)
    wl.log(f"cancelled {len(left)} waiting runs in {time.time() - t1:.1f} s")
    return {
        "decided": decided,
        "idle": idle,
        "stored_bytes": stored_after - stored_before,
        "stored_bytes_before": stored_before,
        "waiting_runs": len(all_ids),
        "ready_s": ready_s,
    }


def cmd_kill(env: Env, args) -> dict[str, Any]:
    delays = wl.kill_delays(args.seed, args.max_delay_ms, len(args.runs))
    runs: dict[str, dict[str, Any]] = {}
    kills: dict[str, float] = {}
    for run_id, delay in zip(args.runs, delays):
        start = time.time()
        handle = env.enqueue(run_id)
        time.sleep(delay)
        wl.kill_tree(env.worker, signal.SIGKILL)
        kills[run_id] = time.time()
        env.worker.wait()
        env.start_worker()
        wl.log(f"{run_id}: worker killed {delay:.3f} s after the start, new worker started")
        result = handle.get_result(polling_interval_sec=POLL_S)
        runs[run_id] = {"start": start, "end": time.time(), "result": result}
        wl.log(f"{run_id}: completed {runs[run_id]['end'] - kills[run_id]:.1f} s after the kill")
    return {"kills": kills, "runs": runs}


COMMANDS = {"steps": cmd_steps, "waiting": cmd_waiting, "kill": cmd_kill}


def main() -> int:
    args = wl.build_parser("dbos", database=True).parse_args()
    if args.command == "worker":
        if not args.system_database_url:
            print("worker needs --system-database-url", file=sys.stderr)
            return 2
        worker_main(args)
        return 0
    wl.install_signal_handlers()
    env = Env(args)
    try:
        env.start()
        out = COMMANDS[args.command](env, args)
        out = {"system": "dbos", "command": args.command, "versions": env.versions, **out}
    except KeyboardInterrupt:
        print("dbos_peer: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        print(f"dbos_peer: {args.command} failed: {e}", file=sys.stderr)
        return 1
    finally:
        env.close()
    wl.emit(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
