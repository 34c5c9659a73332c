"""Optimizer state sharded (ZeRO-1) or offloaded across the replicas of each layer (``hetrain.runtime.zero``),
without training: the plan rule that the holders of a layer agree, `hetrain train`'s refusals before any
process starts, which weights are gathered rounded, and the row shares. The trainings (the same parameters and
losses as one process, checkpoints that reshard, the traced memory) are in tests/integration/test_zero.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from hetrain.errors import HetrainError
from hetrain.plan.schema import validate_plan_structure
from hetrain.runtime.model import GPT
from hetrain.runtime.zero import autocast_only, row_range
from hetrain.spec.specs import load_model
from tests.helpers import EXAMPLES, run_cli
from tests.helpers.training import ASYM_TP1, ASYM_TP2, plan, with_modes


def test_only_the_projections_weights_are_gathered_rounded():
    """``autocast_only``: the weights only ``nn.Linear`` holds (a GPT's and a Llama's projections and LM head),
    not the norms, the embeddings, or a weight tied to an embedding."""
    for arch in ("gpt-tiny", "llama-tiny"):
        model = GPT(load_model(EXAMPLES / "models" / f"{arch}.yaml"))
        names = {n for n, _ in model.named_parameters()}
        rounded = {n for n, p in model.named_parameters() if id(p) in autocast_only(model)}
        assert rounded == {n for n in names if re.search(r"\.w[qkvo123]\.weight$|^head\.weight$", n)}, arch
        assert all(re.search(r"embedding\.weight$|norm\.(weight|bias)$", n) for n in names - rounded), arch
    tied = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    tied[1].weight = tied[0].weight
    assert autocast_only(tied) == set()


def test_holders_of_a_block_must_agree_on_sharding():
    """Blocks 0-1 are held by pipelines[0].stages[0] (sharded) and pipelines[1].stages[0] (replicated)."""
    p = with_modes(ASYM_TP2, [["sharded", "sharded"], [None]])
    with pytest.raises(HetrainError, match=r"^pipelines\[0\]\.stages\[0\] has optimizer_state sharded but "
                                           r"pipelines\[1\]\.stages\[0\], which also holds block 0, keeps it "
                                           r"replicated: every stage"):
        validate_plan_structure(p)
    validate_plan_structure(with_modes(ASYM_TP2, [["offloaded", "sharded"], ["sharded"]]))
    validate_plan_structure(with_modes(ASYM_TP2, [["offloaded", None], [None]]))  # offloaded whole, on the host
    validate_plan_structure(with_modes(ASYM_TP2, [["replicated", None], [None]]))
    # one pipeline: the stage is its layers' only holder, any mode goes
    validate_plan_structure(with_modes(plan(1, [(8, [("a/0", [0, 3]), ("a/1", [3, 6])])]), [["offloaded", None]]))


def test_train_refuses_sharded_state_without_adamw_and_a_plan_whose_holders_disagree(tmp_path: Path):
    """`hetrain train`: one line naming the plan file and the stage, exit code 2, before any process starts."""
    with_modes(ASYM_TP1, [["sharded"], ["sharded", "sharded"]]).write(tmp_path / "sharded.json")
    r = run_cli("train", "--plan", str(tmp_path / "sharded.json"), "--optimizer", "sgd", "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert re.search(r"sharded\.json: pipelines\[0\]\.stages\[0\]: optimizer_state sharded is for the adamw "
                     r"optimizer .*, not sgd", r.stderr), r.stderr
    with_modes(ASYM_TP1, [["sharded"], ["sharded", None]]).write(tmp_path / "mixed.json")
    r = run_cli("train", "--plan", str(tmp_path / "mixed.json"), "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert re.search(r"mixed\.json: pipelines\[0\]\.stages\[0\] has optimizer_state sharded but "
                     r"pipelines\[1\]\.stages\[1\], which also holds block 3", r.stderr), r.stderr
    assert not (tmp_path / "r").exists()


def test_row_shares_partition_each_parameter():
    """The shares of a parameter's rows cover them once, in share order, ceil-sized (the last short or empty)."""
    for rows in (1, 5, 7, 64):
        for shares in (1, 2, 3, 4):
            ranges = [row_range(rows, shares, s) for s in range(shares)]
            assert [r for lo, hi in ranges for r in range(lo, hi)] == list(range(rows))
            assert max(hi - lo for lo, hi in ranges) == -(-rows // shares)
