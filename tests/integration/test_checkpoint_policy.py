"""A checkpoint due while the previous one still commits: skipped (the default) or waited for, alike on every rank."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from hetrain.checkpoint.store import CheckpointStore
from hetrain.checkpoint.reassemble import Source, find_latest, reassemble
from hetrain.checkpoint.save import FAULT_SLOW_COMMIT
from hetrain.config import CheckpointConfig
from tests.helpers.training import plan, run

# Two single-device stages on nodes a and b; only rank 1's commits are slow, so the ranks must agree.
PP_PLAN = plan(1, [(8, [("a/0", [0, 3]), ("b/0", [3, 6])])])
SLOW_COMMIT_S = 1.5
STEPS = 6


def _run(tmp_path: Path, monkeypatch, when_busy: str) -> tuple[CheckpointConfig, list[dict]]:
    monkeypatch.setenv(FAULT_SLOW_COMMIT, f"1:{SLOW_COMMIT_S}")
    cfg = CheckpointConfig(local_dir=str(tmp_path / "nodes" / "{node}"), every_steps=1, keep=2, when_busy=when_busy)
    return cfg, run(PP_PLAN, tmp_path / "run", steps=STEPS, checkpoint=cfg)


def test_skip_keeps_training_going_and_the_newest_commit_loadable(tmp_path: Path, monkeypatch):
    cfg, records = _run(tmp_path, monkeypatch, "skip")
    skipped = [r["step"] for r in records if "checkpoint_skipped" in r]
    saved = [r["step"] for r in records if "checkpoint_s" in r]
    assert skipped and saved and not set(skipped) & set(saved)
    assert STEPS - 1 in saved  # the run's last checkpoint is never skipped
    for r in records:
        if "checkpoint_skipped" in r:
            assert r["checkpoint_skipped"]["in_flight_step"] in saved
        if "checkpoint_s" in r and r["step"] != STEPS - 1:
            assert r["checkpoint_s"] < SLOW_COMMIT_S / 2, r  # nobody waited for the slow commit
    for node in ("a", "b"):
        assert CheckpointStore.for_node(cfg, node).committed_steps()[-1] == STEPS - 1
    # the newest committed checkpoint verifies (every file's hash, taken as it was written) and loads
    peers = [Source(n, cfg.node_root(n)) for n in "ab"]
    manifest = find_latest(peers)[0]
    reassemble(manifest, peers, None, str(tmp_path / "restore"))
    dcp_to_torch_save(str(tmp_path / "restore"), str(tmp_path / "whole.pt"))
    state = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert any(k.startswith("model") or "layers" in str(k) for k in state)


def test_wait_shows_the_wait_in_the_metrics(tmp_path: Path, monkeypatch):
    cfg, records = _run(tmp_path, monkeypatch, "wait")
    assert not any("checkpoint_skipped" in r for r in records)
    assert [r["step"] for r in records if "checkpoint_s" in r] == list(range(STEPS))
    waited = [r.get("checkpoint_waited_s", 0.0) for r in records[1:]]
    assert max(waited) > SLOW_COMMIT_S / 2
