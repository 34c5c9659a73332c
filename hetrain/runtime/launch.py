"""Start the processes of a plan: one ``hetrain.runtime.agent`` (torchrun, workers forked preloaded) per node.

One machine (the emulated cluster, or one GPU node): a single agent with one process per device of
the plan. Several machines: one command per node, against a c10d rendezvous on the first node, which
takes a different ``--nproc-per-node`` on each node (accelerate would run ``num_processes /
num_machines`` everywhere). Each process learns its node from ``HETRAIN_NODE`` and its device from
``LOCAL_RANK``, so rendezvous order does not matter. The agent is torchrun's own launcher whose
workers fork from a process that imported them once (``hetrain.runtime.agent`` says why);
``python -m hetrain.runtime.worker`` still runs under a plain ``torchrun`` or ``accelerate launch``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hetrain.config import RunConfig
from hetrain.errors import HetrainError, TransientError
from hetrain.files import write_text_atomic
from hetrain.plan.layout import Layout
from hetrain.rundir import CONFIG, RUN_DIR_ENV, RunDir
from hetrain.processes import owner_token
from hetrain.runtime.lifeline import TRAIN_PID_ENV, tied_argv

AGENT = [sys.executable, "-m", "hetrain.runtime.agent"]
MONITOR_S = "0.2"  # how often the agent looks at its workers: a failed rank stops the run within this


@dataclass(frozen=True)
class NodeCommand:
    node: str
    env: dict[str, str]
    argv: list[str]

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{env} {shlex.join(self.argv)}".strip()


def local_command(layout: Layout, config_path: str, port: int) -> NodeCommand:
    """All ranks on this machine, under one agent."""
    argv = [*AGENT, "--nnodes", "1", "--nproc-per-node", str(layout.world_size), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--monitor-interval", MONITOR_S, config_path]
    return NodeCommand("*", {}, argv)


def node_commands(layout: Layout, config_path: str, main_address: str, port: int, run_id: str,
                  agent: list[str] | None = None, local_addresses: dict[str, str] | None = None) -> list[NodeCommand]:
    """One command per node of the plan; run each on its node (the first node hosts the rendezvous).

    ``agent``: the argv that starts ``hetrain.runtime.agent`` there (default: this interpreter's;
    a printout for other machines says ``python``). ``local_addresses`` gives each node the address its
    agent advertises (``--local-addr``), for hosts whose name does not resolve to the address the other
    nodes reach.
    """
    counts = {node: len(ranks) for node, ranks in layout.nodes.items()}
    out = []
    for k, (node, count) in enumerate(counts.items()):
        argv = [*(agent or AGENT), "--nnodes", str(len(counts)), "--nproc-per-node", str(count),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{main_address}:{port}", "--rdzv-id", run_id,
                "--monitor-interval", MONITOR_S]
        if local_addresses and node in local_addresses:
            # and say who hosts the rendezvous store: torch guesses it from the host name otherwise
            argv += ["--local-addr", local_addresses[node], "--rdzv-conf", f"is_host={int(k == 0)}"]
        out.append(NodeCommand(node, {"HETRAIN_NODE": node}, argv + [config_path]))
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(config: RunConfig, run_dir: Path, name: str = CONFIG) -> Path:
    path = run_dir / name
    write_text_atomic(path, config.model_dump_json(indent=2) + "\n", "run config")
    return path


def follow_metrics(path: Path, proc: subprocess.Popen | _FirstExit, poll_s: float = 0.2, pos: int = 0,
                   stop: threading.Event | None = None) -> Iterator[dict]:
    """Yield metric records as rank 0 appends them after byte ``pos``, until the launch exits or ``stop`` is set."""
    while True:
        done = proc.poll() is not None or (stop is not None and stop.is_set())
        if path.exists():
            with path.open() as f:
                f.seek(pos)
                while line := f.readline():
                    if not line.endswith("\n"):
                        break
                    pos += len(line.encode())
                    yield json.loads(line)
        if done:
            return
        time.sleep(poll_s)


_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]: )?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)): (.+)$")


def _worker_error(log: Path) -> str | None:
    """The one line a user needs from the workers' output: a rank's own error, else its first exception.

    Workers print user errors as ``hetrain: error: ...``. Anything else (a disk that filled, a
    library's failure) ends a traceback with ``SomeError: message``; the first one is the cause,
    the later ones are other ranks noticing that a peer is gone.
    """
    if not log.exists():
        return None
    lines = log.read_text(errors="replace").splitlines()
    for line in lines:
        if "hetrain: error: " in line:
            return line.split("hetrain: error: ", 1)[1]
    for line in lines:
        match = _EXCEPTION_LINE.match(line.strip())
        if match and not match.group(1).endswith("KeyboardInterrupt"):
            return f"{match.group(1)}: {match.group(2)} (full output in {log})"
    return None


# How long a stopped launcher's own helpers (the fork server, the resource tracker) get to follow it out before
# they are killed: they exit within milliseconds of it when all is well
GROUP_EXIT_S = 5.0


def stop(procs: list[subprocess.Popen], run_dir: Path, grace_s: float = 10.0, config_name: str = CONFIG) -> None:
    """Interrupt the launchers (they stop their workers), all at once, then make sure no worker survives.

    Each signal goes to every launcher still running before any is waited for, so the nodes of
    one run get their grace period together.
    """
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        running = [p for p in procs if p.poll() is None]
        if not running:
            break
        for proc in running:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        for proc in running:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    _empty_groups([p.pid for p in procs])
    for pid in worker_pids(run_dir, config_name):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _empty_groups(pgids: list[int], timeout_s: float = GROUP_EXIT_S, poll_s: float = 0.05) -> None:
    """Wait until no process is left in the launchers' process groups (each launcher leads its own): its fork
    server and resource tracker end a moment after it, and a stopped run must leave nothing behind; what is still
    there after ``timeout_s`` is killed."""
    _until_gone(lambda: [g for g in pgids if _group_alive(g)], os.killpg, timeout_s, poll_s)


def _until_gone(alive_now: Callable[[], list[int]], kill: Callable[[int, int], None], timeout_s: float,
                poll_s: float) -> list[int]:
    """Poll ``alive_now`` until it is empty or ``timeout_s`` has passed; SIGKILL (``kill``) what is left, returned."""
    deadline = time.monotonic() + timeout_s
    while (alive := alive_now()) and time.monotonic() < deadline:
        time.sleep(poll_s)
    for target in alive:
        try:
            kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return alive


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal is still a member
        return True


def worker_pids(run_dir: Path, config_name: str | None = CONFIG) -> list[int]:
    """PIDs of this run's workers that are still alive (checked against their command line).

    ``config_name``: those of one launch (the run's, or a warm start's); None: of every launch
    of the run (a switched run trains under its warm start's config until it is switched again).
    """
    return RunDir.of(run_dir).live_workers(config_name)


def wait_for_workers_to_exit(run_dir: Path, timeout_s: float, poll_s: float = 0.2,
                             pids: list[int] | None = None) -> int:
    """Wait until no worker of the run in ``run_dir`` is alive (a run that is winding down); kill stragglers.

    ``pids``: only these of its workers (a switch waits for the old plan's, not the new one's).
    Returns how many had to be killed. Two launches of one run must never overlap.
    """
    def alive_now() -> list[int]:
        now = worker_pids(run_dir, None)
        return now if pids is None else [p for p in now if p in pids]

    return len(_until_gone(alive_now, os.kill, timeout_s, poll_s))


def _drop_records_from(metrics: Path, step: int) -> None:
    """Keep only the records of steps before ``step`` (atomically), so a resumed run's metrics never repeat a step."""
    kept = []
    for line in metrics.read_text().splitlines(keepends=True):
        try:
            if line.endswith("\n") and json.loads(line)["step"] < step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    write_text_atomic(metrics, "".join(kept), "--metrics")


class RunStopped(HetrainError):
    """``launch`` was told to stop (e.g. the emulated node went away at its preemption deadline)."""

    def __init__(self, records: list[dict]) -> None:
        last = records[-1]["step"] if records else None
        super().__init__(f"training stopped after step {last}" if records else "training stopped before its first step")
        self.records = records


def _start_launchers(cmds: list[NodeCommand], logs: list[Path], run_dir: Path, procs: list[subprocess.Popen]) -> None:
    """Start each node's launcher, logging to its log, into ``procs`` as it starts (what a failure stops)."""
    for cmd, log in zip(cmds, logs):
        with log.open("w") as log_f:
            # the launcher dies with this process (the kernel's parent-death signal), the workers with the
            # launcher and with this process (hetrain.runtime.lifeline): a kill -9 here leaves none training
            env = {**os.environ, **cmd.env, RUN_DIR_ENV: str(run_dir), TRAIN_PID_ENV: owner_token()}
            procs.append(subprocess.Popen(tied_argv(cmd.argv), stdout=log_f, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))


def launch(config: RunConfig, layout: Layout, run_dir: Path,
           on_record: Callable[[dict], None] | None = None, stop_event: threading.Event | None = None,
           commands: Callable[[Path], list[NodeCommand]] | None = None, config_name: str = CONFIG) -> list[dict]:
    """Run training; returns the metric records. Raises HetrainError on failure.

    By default every rank runs on this machine under one agent (``local_command``). ``commands``
    (given the written config's path) returns instead one command per node, each already
    wrapped to run where that node is (``hetrain.testing.netbed`` runs them in network
    namespaces); they are supervised as one run: the first that fails stops the others.
    Setting ``stop_event`` stops every process of the run and raises ``RunStopped``.

    A warm start (``config.standby_file``) runs beside the run's current processes, under its
    own ``config_name``: it leaves the metrics file to them and returns only its own records,
    those from the step its switch names.
    """
    run_dir = run_dir.resolve()
    if config.metrics is None:
        config = config.model_copy(update={"metrics": str(RunDir(run_dir).metrics)})
    metrics = Path(config.metrics)
    standby = Path(config.standby_file) if config.standby_file else None
    start_pos = _prepare_metrics(metrics, config, standby)
    if config.backup_status_file:
        Path(config.backup_status_file).unlink(missing_ok=True)  # this launch's account, not the last one's
    config_path = write_config(config, run_dir, config_name)
    cmds = commands(config_path) if commands is not None else [local_command(layout, str(config_path), free_port())]
    # a warm start's launcher writes beside the running plan's log, not over it
    logs = [RunDir(run_dir).launch_log(config_name, None if len(cmds) == 1 else c.node) for c in cmds]
    records: list[dict] = []
    procs: list[subprocess.Popen] = []
    try:
        _start_launchers(cmds, logs, run_dir, procs)
        watch = _FirstExit(procs)
        first_step = None if standby is None else -1
        stopped = False
        for record in follow_metrics(metrics, watch, pos=start_pos, stop=stop_event):
            if first_step == -1:  # not switched yet: the old plan's records
                first_step = _switch_step(standby)
            if first_step is not None and (first_step == -1 or record["step"] < first_step):
                continue
            records.append(record)
            if on_record:
                on_record(record)
            if record.get("stopped"):  # the run ended at its emergency checkpoint; later records are a new plan's
                stopped = True
                break
        if stop_event is not None and stop_event.is_set() and watch.poll() is None:
            stop(procs, run_dir, config_name=config_name)
            raise RunStopped(records)
        if stopped:  # its ranks are finishing the checkpoint's upload: how they end still counts
            for p in procs:
                p.wait()
    except BaseException:
        stop(procs, run_dir, config_name=config_name)
        raise
    _end(procs, logs, run_dir, config_name)
    return records


def _prepare_metrics(metrics: Path, config: RunConfig, standby: Path | None) -> int:
    """Where this launch's records start in the metrics file: a fresh run moves an earlier attempt's aside (never
    deleted), a resumed one drops the records after its checkpoint (trained again) and appends, a warm start
    (``standby``) reads on from the end while the old plan's rank 0 still appends."""
    metrics.parent.mkdir(parents=True, exist_ok=True)
    if standby is None and config.resume_from is None:
        if metrics.exists():
            metrics.replace(metrics.with_name(f"{metrics.stem}-{time.strftime('%Y%m%dT%H%M%S')}{metrics.suffix}"))
    elif standby is None and metrics.exists():
        _drop_records_from(metrics, config.start_step)
    return metrics.stat().st_size if metrics.exists() else 0


def _end(procs: list[subprocess.Popen], logs: list[Path], run_dir: Path, config_name: str) -> None:
    """Wait for every process of a run that ended; if one node failed, stop the others (they would wait for it
    forever) and raise the cause found in the logs (the failed nodes' first: the first launcher to exit may be a
    peer noticing the loss), else a retryable error naming the log."""
    failed = [(p, log) for p, log in zip(procs, logs) if p.poll() is not None and p.returncode != 0]
    if not failed:
        for p in procs:
            p.wait()
        return
    stop(procs, run_dir, config_name=config_name)
    proc, log = failed[0]
    ordered = dict.fromkeys([lg for _, lg in failed] + logs)
    reason = next((r for r in map(_worker_error, ordered) if r), None)
    if reason:
        raise HetrainError(reason)
    raise TransientError(f"training failed (exit {proc.returncode}); the workers' output is in {log}")


def _switch_step(standby: Path) -> int:
    """The first step a warm start trains (-1 before its switch is written)."""
    try:
        return int(json.loads(standby.read_text()).get("start_step", -1))
    except (OSError, ValueError, TypeError, AttributeError):
        return -1


def launch_node(config: RunConfig, layout: Layout, run_dir: Path, node: str, rendezvous: str,
                local_address: str | None = None, on_record: Callable[[dict], None] | None = None,
                stop_event: threading.Event | None = None) -> list[dict]:
    """Run ``node``'s ranks of the plan on this machine, under torchrun, against a c10d rendezvous.

    Every node of the plan runs this at once (the train flow starts one node-level flow run
    per node through that node's work queue); ``rendezvous`` (``host:port``) is on the plan's
    first node, whose torchrun hosts the store. ``local_address`` is the address this node's
    agent advertises, where the host name does not resolve to one the other nodes reach.
    Returns rank 0's metric records (none on the other nodes). A rank failing anywhere fails
    every node: their collectives break, and each node's launch stops its own processes.
    """
    if node not in layout.nodes:
        raise HetrainError(f"node '{node}': the plan has no ranks there (its nodes: {', '.join(layout.nodes)})")
    host, _, port = rendezvous.rpartition(":")
    if not host or not port.isdigit():
        raise HetrainError(f"rendezvous '{rendezvous}': expected host:port")
    # always say who hosts the store and what to advertise: torch's guess from the host name fails where
    # the cluster's names are not the machines' host names
    addresses = {node: local_address or node}

    def commands(config_path: Path) -> list[NodeCommand]:
        every = node_commands(layout, str(config_path), host, int(port), config.run_id, local_addresses=addresses)
        return [c for c in every if c.node == node]

    return launch(config, layout, run_dir, on_record=on_record, stop_event=stop_event, commands=commands)


class _FirstExit:
    """Several processes as one for ``follow_metrics``: done when all have exited or any has failed."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.procs = procs

    def poll(self) -> int | None:
        codes = [p.poll() for p in self.procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        return None if None in codes else 0

