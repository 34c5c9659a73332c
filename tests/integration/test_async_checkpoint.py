"""Background checkpoints: training waits for a snapshot only, the commit protocol is unchanged."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from hetrain.checkpoint.manifest import step_name
from hetrain.checkpoint.store import CheckpointStore
from hetrain.config import CheckpointConfig
from hetrain.errors import HetrainError
from tests.helpers.training import plan, run

# Tensor parallel (DTensor state) on node a, one stage: two processes.
TP_PLAN = plan(2, [(8, [("a/0", [0, 6])])])
# Two single-device stages on nodes a and b.
PP_PLAN = plan(1, [(8, [("a/0", [0, 3]), ("b/0", [3, 6])])])


def whole_state(cfg: CheckpointConfig, step: int, out: Path) -> dict:
    """A committed step's tensors from every node's files, each DTensor's shards joined (DCP's own converter)."""
    joined = out.with_suffix("")
    joined.mkdir()
    for node in ("a", "b"):
        if (Path(cfg.node_root(node)) / step_name(step)).exists():
            for f in (Path(cfg.node_root(node)) / step_name(step)).iterdir():
                shutil.copyfile(f, joined / f.name)
    dcp_to_torch_save(str(joined), str(out))
    return torch.load(out, weights_only=False)


def flat(state: dict, prefix: str = "") -> dict:
    items = {}
    for key, value in state.items():
        if isinstance(value, dict):
            items.update(flat(value, f"{prefix}{key}."))
        else:
            items[prefix + str(key)] = value
    return items


def test_background_checkpoints_hold_what_synchronous_ones_hold(tmp_path: Path):
    """Each step's checkpoint is the state after that step, though training changed it while it was written."""
    steps = 3
    cfgs = {mode: CheckpointConfig(local_dir=str(tmp_path / mode / "nodes" / "{node}"), every_steps=1, keep=steps,
                                   background=mode == "background") for mode in ("sync", "background")}
    records = {mode: run(TP_PLAN, tmp_path / mode, steps=steps, checkpoint=cfg) for mode, cfg in cfgs.items()}
    assert [r["loss"] for r in records["sync"]] == [r["loss"] for r in records["background"]]
    # the background run reports every commit, in order, the last one's in the last record (the run ends with it)
    reported = [c["step"] for r in records["background"] for c in r.get("checkpoints_committed", [])]
    assert reported == list(range(steps)) and "checkpoints_committed" not in records["sync"][-1]
    assert records["background"][-1]["checkpoints_committed"][-1]["step"] == steps - 1
    assert CheckpointStore.for_node(cfgs["background"], "a").committed_steps() == list(range(steps))
    for step in range(steps):
        states = {mode: flat(whole_state(cfg, step, tmp_path / f"{mode}-{step}.pt")) for mode, cfg in cfgs.items()}
        assert states["sync"].keys() == states["background"].keys()
        assert any(k.endswith("exp_avg_sq") for k in states["sync"])
        for key, value in states["sync"].items():
            if key == "rng":  # one rank's CPU RNG state: under TP it differs from run to run in either mode
                continue      # (training draws nothing from it: the losses above are identical)
            other = states["background"][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), f"step {step}: {key} differs"
            else:
                assert value == other, f"step {step}: {key} differs"
        # and not merely equal to each other: the weights moved between steps
        if step:
            assert not torch.equal(states["sync"]["model.layers.0.mlp.w1.weight"],
                                   previous["model.layers.0.mlp.w1.weight"])
        previous = states["sync"]
    manifest = CheckpointStore.for_node(cfgs["background"], "a").read_manifest(steps - 1)
    assert manifest.plan == TP_PLAN


def test_a_failed_background_commit_fails_the_run_and_keeps_the_last_commit(tmp_path: Path):
    # wait: under the default skip, step 1's checkpoint may be skipped while step 0's commits, and never fail
    cfg = CheckpointConfig(local_dir=str(tmp_path / "nodes" / "{node}"), every_steps=1, keep=3, when_busy="wait")
    blocker = Path(cfg.node_root("b")) / step_name(1)  # a file where node b's step-1 directory must go
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a directory")
    with pytest.raises(HetrainError, match="checkpoint of step 1 not committed"):
        run(PP_PLAN, tmp_path / "run", steps=6, checkpoint=cfg)
    for node in ("a", "b"):
        assert CheckpointStore.for_node(cfg, node).committed_steps() == [0]
