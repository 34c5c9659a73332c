"""Tied embeddings trained: asymmetric plans whose ends sit on different ranks (TP 2, ZeRO-1) against one
process, as tests/integration/test_runtime.py does for untied models, and a checkpoint moved between a stage
holding both ends and a copy on each end, both ways; each checkpoint holds the tied weight once."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from hetrain.plan.layout import build_layout
from hetrain.plan.schema import Plan
from hetrain.runtime.model import HEAD_NAME, TIED_NAME
from tests.helpers import run_cli
from tests.helpers.models import TIED, tied_plan
from tests.helpers.training import ONE_PROCESS_TOL, adamw_reference, dumped_state, run, sgd_reference


LR, CLIP, STEPS = 0.5, 1.0, 3


def assert_close(got: dict, want: dict, what: str, tol: float = 1e-5) -> None:
    for name, tensor in got.items():
        ref = want[TIED_NAME if name == HEAD_NAME else name]  # a last stage's copy of the one weight
        rel = (tensor - ref).norm() / ref.norm().clamp_min(1e-12)
        assert rel < tol, f"{what} {name}: relative error {rel:.2e}"


def assert_stored_once(roots: list[Path], step: int) -> None:
    """The step's DCP index on each node: the tied weight and its optimizer state only under the embedding's name,
    one stored item per chunk (one per TP rank), and the shard files hold nothing the index does not point at (so
    no second copy was written under any name)."""
    from torch.distributed.checkpoint import FileSystemReader

    from hetrain.checkpoint.manifest import step_name

    files = sum(f.stat().st_size for root in roots for f in (root / step_name(step)).glob("__*.distcp"))
    for root in roots:
        metadata = FileSystemReader(str(root / step_name(step))).read_metadata()
        keys = metadata.state_dict_metadata
        assert not [k for k in keys if HEAD_NAME in k], sorted(k for k in keys if HEAD_NAME in k)
        weight = keys[f"model.{TIED_NAME}"]
        assert sum(math.prod(c.sizes) for c in weight.chunks) == weight.size.numel()
        assert len([i for i in metadata.storage_data if i.fqn == f"model.{TIED_NAME}"]) == len(weight.chunks)
        assert sum(info.length for info in metadata.storage_data.values()) == files


def test_tied_plan_at_tp2_matches_one_process(tmp_path: Path):
    """Embedding and head on different ranks of pipeline 0, on one rank of pipeline 1, TP 2 (the head's
    copy split by vocabulary like the embedding; the q/k norms' gradients summed over the TP group):
    gradients, parameters and losses of one process."""
    plan = tied_plan(2)
    plan.write(tmp_path / "plan.json")
    r = run_cli("train", "--plan", str(tmp_path / "plan.json"), "--steps", str(STEPS), "--optimizer", "sgd",
                "--lr", str(LR), "--max-grad-norm", str(CLIP), "--run-dir", str(tmp_path / "run"),
                "--dump-dir", str(tmp_path / "dump"))
    assert r.returncode == 0, r.stdout + r.stderr
    ref_grads, ref_params, ref_losses = sgd_reference(tied_plan(1), STEPS, LR, CLIP)
    copies = 0
    for role in build_layout(plan).roles:
        if role.tp_rank == 0:
            params = torch.load(tmp_path / "dump" / f"params-rank{role.rank}.pt")
            assert_close(torch.load(tmp_path / "dump" / f"grads-rank{role.rank}.pt"), ref_grads, "gradient")
            assert_close(params, ref_params, "parameter")
            copies += sum(n in (TIED_NAME, HEAD_NAME) for n in params)
    assert copies == 3  # pipeline 0's two ends, pipeline 1's one weight
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [rec["loss"] for rec in records] == pytest.approx(ref_losses, rel=1e-5)
    # the run's last checkpoint: both ends' vocabulary shards (DTensors at the same offsets) deduplicated by DCP
    assert_stored_once([tmp_path / "run" / "checkpoints" / node for node in ("a", "b")], STEPS - 1)


def test_tied_plan_under_zero1_matches_one_process(tmp_path: Path):
    """The same plan at TP 1 with AdamW, every stage's state sharded (ZeRO-1): the blocks' state in
    shares, the tied weight's whole on each holder (its holders name it differently). Weights and losses
    are one process's (within what AdamW makes of float32 sums in another order, as tests/integration/test_zero.py)."""
    from hetrain.config import CheckpointConfig

    plan = tied_plan(1, ("sharded",) * 3)
    records = run(plan, tmp_path / "sharded", steps=STEPS, dump=True,
                  checkpoint=CheckpointConfig(local_dir=str(tmp_path / "nodes" / "{node}"), every_steps=STEPS))
    want, losses = adamw_reference(plan, [r["lr"] for r in records])
    got = dumped_state(plan, tmp_path / "sharded")
    assert f"optim/{HEAD_NAME}/exp_avg" in got and f"optim/{TIED_NAME}/exp_avg" in got
    assert_close({n: t for n, t in got.items() if not n.startswith("optim/")}, want, "parameter", ONE_PROCESS_TOL)
    assert torch.equal(got[HEAD_NAME], got[TIED_NAME])  # the two copies stay one weight
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-5)
    assert_stored_once([tmp_path / "nodes" / node for node in ("a", "b")], STEPS - 1)


def test_a_tied_checkpoint_moves_between_one_weight_and_a_copy_on_each_end(tmp_path: Path):
    """Saved where one stage holds both ends (the optimizer state under the embedding's name only), resumed where
    the ends are on different ranks (the head's copy takes the same state; its stage's optimizer state offloaded,
    ZeRO's ShardedAdamW), saved there (the weight once) and resumed on one stage again: each step after a move
    equals the run that never moved."""
    from hetrain.checkpoint.manifest import step_name
    from hetrain.config import CheckpointConfig

    def one_plan(stages: list[tuple[str, list[int], str | None]]) -> Plan:
        return Plan.model_validate({
            "schema": "hetrain.plan/v1", "model": TIED.model_dump(), "cluster": "test", "global_batch_size": 8,
            "micro_batch_size": 2, "tp": 1, "pipelines": [{"num_microbatches": 4, "stages": [
                {"devices": [d], "gpu": "cpu", "layers": layers, "optimizer_state": mode}
                for d, layers, mode in stages]}]})

    whole = one_plan([("a/0", [0, 6], None)])
    split = one_plan([("a/0", [0, 3], None), ("b/0", [3, 6], "offloaded")])
    # the run that never moves also leaves the step-1 checkpoint the first move starts from (every 2 steps, the
    # three it commits kept): one run fewer than a separate save
    cfg = CheckpointConfig(local_dir=str(tmp_path / "nodes" / "{node}"), every_steps=2, keep=3)
    split_cfg = cfg.model_copy(update={"local_dir": str(tmp_path / "split" / "{node}")})
    straight = run(whole, tmp_path / "straight", steps=6, checkpoint=cfg)
    moved = run(split, tmp_path / "moved", steps=4, start_step=2, checkpoint=split_cfg,
                resume_from=str(Path(cfg.node_root("a")) / step_name(1)))
    # two steps each: the second's loss is after an update with the moved optimizer state
    assert [r["step"] for r in moved] == [2, 3]
    assert [r["loss"] for r in moved] == pytest.approx([r["loss"] for r in straight[2:4]], rel=1e-5)
    assert_stored_once([tmp_path / "split" / node for node in ("a", "b")], 3)
    for node in ("a", "b"):  # the nodes' shards of the step in one directory (reassemble's job in a run)
        shutil.copytree(Path(split_cfg.node_root(node)) / step_name(3), tmp_path / "both", dirs_exist_ok=True)
    back = run(whole, tmp_path / "back", steps=6, start_step=4, resume_from=str(tmp_path / "both"))
    assert [r["step"] for r in back] == [4, 5]
    assert [r["loss"] for r in back] == pytest.approx([r["loss"] for r in straight[4:6]], rel=1e-5)
