"""Runs by name: ``<runs_root>/<run_id>`` holds a run's config, plans, metrics and checkpoints.

Finding a run by name, reading its config, where its checkpoints can be read from, and whether its
newest checkpoint reached the remote store: what starting, resuming, recovering and exporting a
run all ask.
"""

from __future__ import annotations

import json
from pathlib import Path

from hetrain.checkpoint.reassemble import Source
from hetrain.checkpoint.store import CheckpointStore
from hetrain.config import RUN_ID, RunConfig
from hetrain.errors import HetrainError
from hetrain.plan.schema import Plan
from hetrain.rundir import CHECKPOINTS, RunDir
from hetrain.spec.specs import ClusterSpec


def run_dir_of(runs_root: str | Path, run_id: str) -> Path:
    if not RUN_ID.match(run_id):
        raise HetrainError(f"run_id '{run_id}': expected letters, digits, '.', '_' or '-' (at most 64)")
    return Path(runs_root).resolve() / run_id


def sources_for(config: RunConfig, plan: Plan, lost_nodes: list[str],
                use_peers: bool = True) -> tuple[list[Source], Source | None]:
    """Where a run's checkpoints can be read: the surviving nodes' roots (or peer servers), then its remote store."""
    ckpt = config.checkpoint
    if ckpt is None:
        raise HetrainError(f"{config.plan}: the run was started without checkpoints; nothing to recover from")
    nodes = list(dict.fromkeys(d.split("/")[0] for d in plan.devices()))
    peers = [Source(node, CheckpointStore.for_peer(ckpt, node)) for node in nodes if node not in lost_nodes] \
        if use_peers else []
    store = CheckpointStore.for_remote(ckpt)
    remote = Source("remote", store, remote=True) if store is not None else None
    return peers, remote


def served_roots(cluster: ClusterSpec, peer_port: int, run_id: str) -> dict[str, str]:
    """Where each node of ``cluster`` serves run ``run_id``'s checkpoint root to its peers: ``hetrain node start``'s
    peer server at ``peer_port`` serves the node's runs root, so a run's root is ``<run_id>/checkpoints/<node>``
    below it (``RunDir``'s layout); none when ``peer_port`` is 0."""
    if not peer_port:
        return {}
    return {n.name: f"http://{n.host}:{peer_port}/{run_id}/{CHECKPOINTS}/{n.name}" for n in cluster.nodes}


def load_run(run_dir: Path, missing: str | None = None) -> RunConfig:
    """The config of the run in ``run_dir``; ``missing`` is the message when it has none."""
    path = RunDir(run_dir).config
    if not path.is_file():
        raise HetrainError(missing or f"--run {run_dir}: no config.json there (is it the run directory of "
                                      f"hetrain train?)")
    return RunConfig.load(path)


def existing_run(runs_root: str | Path, run_id: str) -> tuple[Path, RunConfig]:
    run_dir = run_dir_of(runs_root, run_id)
    return run_dir, load_run(run_dir, f"unknown run '{run_id}': {RunDir(run_dir).config} does not exist")


EXIT_NOT_BACKED_UP = 3  # `hetrain train`: trained and checkpointed locally, but the remote store lacks the newest


def backup_problem(config: RunConfig) -> str | None:
    """One line when the run's newest checkpoint did not reach its remote store (None when it did, or no store)."""
    ckpt = config.checkpoint
    if ckpt is None or not ckpt.remote_url or not config.backup_status_file:
        return None
    path = Path(config.backup_status_file)
    if not path.is_file():
        return (f"rank 0 did not report on the backup to {ckpt.remote_url} (it stopped before the end); "
                f"check that the store holds the newest step before relying on it")
    try:
        status = json.loads(path.read_text())
    except ValueError:
        return f"{path}: unreadable backup status"
    newest = status.get("newest_local_step")
    failed = status.get("failed") or []
    if newest is not None and newest in status.get("uploaded_steps", []):
        return None if not failed else (f"{len(failed)} earlier backup(s) to {ckpt.remote_url} failed (first: step "
                                        f"{failed[0]['step']}: {failed[0]['error']}); the newest, step {newest}, is "
                                        f"there")
    why = next((f["error"] for f in failed if f["step"] == newest), None)
    if why is None and newest in status.get("unfinished_steps", []):
        why = f"still uploading after {ckpt.upload_timeout_s:g} s"
    return (f"step {newest} did not reach {ckpt.remote_url} ({why or 'not uploaded'}); it is committed on the "
            f"nodes' disks, so a recovery without a surviving node would go back to an older step")


