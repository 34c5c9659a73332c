"""``hetrain node start``: this machine as a node of a cluster (Prefect worker, peer server, watcher)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from hetrain.checkpoint import PEER_TOKEN_ENV
from hetrain.cli.common import err, user_errors
from hetrain.errors import HetrainError
from hetrain.files import check_output_dir
from hetrain.recovery.preemption import MIN_POLL_S


@user_errors
def node_start(
    name: Annotated[str, typer.Option(help="this node's name in the cluster file")],
    pool: Annotated[str, typer.Option(help="Prefect work pool (process type) the deployments use")] = "hetrain",
    runs_root: Annotated[Path, typer.Option(help="where runs go on this machine's own disk")] = Path("runs"),
    peer_port: Annotated[int, typer.Option(min=0, max=65535, help="serve the runs' checkpoints to peers on this "
                                                                  "port (0: do not serve)")] = 8470,
    token_env: Annotated[str, typer.Option(help="environment variable holding the peers' bearer token")]
    = PEER_TOKEN_ENV,
    insecure: Annotated[bool, typer.Option("--insecure", help="serve checkpoints without a token (trusted "
                                                              "networks only)")] = False,
    cloud: Annotated[str | None, typer.Option(help="a spot node: watch this cloud's preemption notices (aws, gcp, "
                                                   "azure)")] = None,
    metadata_url: Annotated[str | None, typer.Option(help="the metadata endpoint's base URL (default: the "
                                                          "cloud's)")] = None,
    watch_poll_s: Annotated[float, typer.Option(min=MIN_POLL_S, max=60.0, help="seconds between metadata "
                                                                               "polls")] = 5.0,
    on_notice: Annotated[str, typer.Option(help="the watcher's hook, run once per active run on a notice")]
    = f"{sys.executable} -m flows.events",
):
    """Serve node NAME: create its work queue in POOL, run a Prefect worker on it and a peer server (until stopped).

    The train flow with ``launch=per-node`` sends each node its share of a plan through the work
    queue named after the node, so exactly one machine must run this for each node name. The
    peer server (``hetrain serve`` on RUNS_ROOT, every address) lets surviving nodes fetch this
    node's shards in a recovery. With ``--cloud`` (spot nodes) a watcher (``hetrain watch
    --runs-root --stop-after-checkpoint``) polls the metadata endpoint; on a notice the runs
    active on this node take an emergency checkpoint and stop there, and the hook emits the
    preemption event that starts the recovery flow. Reads PREFECT_API_URL like any Prefect
    command.
    """
    import os
    import subprocess

    _check_node_options(name, cloud, runs_root)
    _ensure_work_queue(name, pool)
    if peer_port and not os.environ.get(token_env) and not insecure:
        raise HetrainError(f"--peer-port {peer_port}: checkpoints hold the model's weights; set a bearer token in "
                           f"${token_env} (the same on every node), or pass --insecure on a trusted network, or "
                           f"--peer-port 0")
    runs_root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HETRAIN_NODE": name, "HETRAIN_RUNS_ROOT": str(runs_root.resolve())}
    children: list[subprocess.Popen] = []
    try:
        if peer_port:
            children.append(subprocess.Popen([sys.executable, "-m", "hetrain", "serve", "--root", str(runs_root),
                                              "--host", "0.0.0.0", "--port", str(peer_port), "--token-env", token_env,
                                              *(["--insecure"] if insecure else [])], env=env))
        if cloud:
            children.append(subprocess.Popen([sys.executable, "-m", "hetrain", "watch", "--node", name, "--cloud",
                                              cloud, "--runs-root", str(runs_root), "--poll-s", str(watch_poll_s),
                                              "--stop-after-checkpoint",
                                              *(["--metadata-url", metadata_url] if metadata_url else []),
                                              "--hook-command", on_notice], env=env))
        err.print(f"node {name}: worker on work queue '{name}' of pool '{pool}', runs under {runs_root.resolve()}"
                  + (f", peers served on port {peer_port}" if peer_port else "")
                  + (f", {cloud} preemption notices watched" if cloud else ""), highlight=False)
        children.append(subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool,
                                          "--work-queue", name, "--name", name], env=env))
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the children below, as on Ctrl-C
        code = children[-1].wait()
    except KeyboardInterrupt:
        code = 130
    finally:
        _stop_children(children)
    raise typer.Exit(code)


def _check_node_options(name: str, cloud: str | None, runs_root: Path) -> None:
    """``hetrain node start``'s name, cloud and runs root, and that a Prefect server is named: one line each."""
    import re
    import subprocess

    from hetrain.recovery.preemption import SOURCES
    from hetrain.spec.specs import NAME_PATTERN

    if not re.match(NAME_PATTERN, name):
        raise HetrainError(f"--name '{name}': expected a node name (letters, digits, '.', '_' or '-')")
    if name == "default":
        raise HetrainError("--name default: that is the pool's queue for the train and recover flows; "
                           "name the node as the cluster file does")
    if cloud is not None and cloud not in SOURCES:
        raise HetrainError(f"--cloud: expected one of {', '.join(SOURCES)}, got '{cloud}'")
    check_output_dir(runs_root, "--runs-root")
    api_url = subprocess.run([sys.executable, "-c", "from prefect.settings import PREFECT_API_URL as u; "
                              "print(u.value() or '')"], capture_output=True, text=True).stdout.strip()
    if not api_url:  # Prefect would start a server of its own, and the worker would never get the cluster's runs
        raise HetrainError("PREFECT_API_URL is not set: point it at the Prefect server's API (for example "
                           "http://control:4200/api) so this node's worker gets its runs")


def _ensure_work_queue(name: str, pool: str) -> None:
    """The node's work queue in ``pool`` (made, or already there)."""
    import subprocess

    made = subprocess.run([sys.executable, "-m", "prefect", "work-queue", "create", name, "--pool", pool],
                          capture_output=True, text=True)
    said = (made.stdout + made.stderr).strip()
    if made.returncode != 0 and "already exists" not in said:
        raise HetrainError(f"work queue '{name}' in pool '{pool}': {said.splitlines()[-1] if said else 'failed'}")


def _stop_children(children: list) -> None:
    """Stop the node's processes (the watcher takes SIGTERM for a notice: SIGINT stops it), killing what lingers."""
    import subprocess

    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGINT) if child.args[3:4] == ["watch"] else child.terminate()
    for child in children:
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
