"""Tied embeddings (Llama 3.2 1B/3B, the small Qwens): the LM head is the token embedding's weight.

One stage holding both ends holds one Parameter; where the ends sit on different ranks each keeps a
copy and the tied bucket (``SyncBucket.tied``: every first and last stage, per TP rank, Megatron's
embedding group across pipelines) sums their gradients. The slow tests train asymmetric plans and
compare with one process, as tests/test_runtime.py does for untied models.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckpt_helpers import dumped_state, run, sgd_reference
from conftest import EXAMPLES, run_cli
from hetrain.plan.layout import build_layout
from hetrain.plan.schema import Plan
from hetrain.runtime.model import GPT, HEAD_NAME, TIED_NAME
from hetrain.runtime.parallelize import bucket_params, norm_counted
from hetrain.spec.arithmetic import total_params
from hetrain.spec.specs import load_model

# Every switch of the block at once, so the equivalence runs below cover them under TP too: q/k/v bias split
# with its projection, q/k head norms whose gradient sums over the TP group, heads of 32 in a hidden size of 64
TIED = load_model(EXAMPLES / "models" / "llama-tiny.yaml").model_copy(
    update={"tie_embeddings": True, "qkv_bias": True, "qk_norm": True, "head_size": 32})
LR, CLIP, STEPS = 0.5, 1.0, 3


def tied_plan(tp: int, modes: tuple[str | None, str | None, str | None] = (None, None, None)) -> Plan:
    """Pipeline 0: two stages (blocks 0-2, 2-6: the embedding and the head on different ranks), 3
    micro-batches; pipeline 1: one stage holding both ends, 1 micro-batch. ``modes``: each stage's
    optimizer_state."""
    def stage(node: str, first: int, layers: list[int], mode: str | None) -> dict:
        return {"devices": [f"{node}/{first + j}" for j in range(tp)], "gpu": "cpu", "layers": layers,
                "optimizer_state": mode}

    return Plan.model_validate({
        "schema": "hetrain.plan/v1", "model": TIED.model_dump(), "cluster": "test", "global_batch_size": 8,
        "micro_batch_size": 2, "tp": tp,
        "pipelines": [{"num_microbatches": 3, "stages": [stage("a", 0, [0, 2], modes[0]),
                                                         stage("a", tp, [2, 6], modes[1])]},
                      {"num_microbatches": 1, "stages": [stage("b", 0, [0, 6], modes[2])]}]})


def test_one_stage_holds_one_weight_and_counts_it_once():
    whole = GPT(TIED)
    assert whole.head.weight is whole.tok_embedding.weight
    assert total_params(TIED) == sum(p.numel() for p in whole.parameters())
    first, last = GPT(TIED, (0, 2)), GPT(TIED, (2, 6))
    first.init_weights(3), last.init_weights(3), whole.init_weights(3)
    assert torch.equal(first.tok_embedding.weight, last.head.weight)  # the copies start alike
    assert torch.equal(last.head.weight, whole.head.weight)
    assert all(p is not last.head.weight for p in norm_counted(last, list(last.parameters())))  # counted on the first
    assert len(norm_counted(whole, list(whole.parameters()))) == len(list(whole.parameters()))


def test_the_cost_model_holds_the_tied_weight_once_on_a_stage_with_both_ends():
    from hetrain.cost.costmodel import CostModel
    from hetrain.spec.specs import ClusterSpec, TrainingSettings

    cluster = ClusterSpec.model_validate({"name": "c", "nodes": [{"name": "a", "gpu": "A100-80G", "count": 1,
                                                                  "intra_node_bandwidth_gbps": 100}]})
    cost = CostModel(cluster, TIED, TrainingSettings(global_batch_size=8))
    assert cost.stage_params(TIED.num_layers, True, True, 1) == total_params(TIED)
    untied = CostModel(cluster, TIED.model_copy(update={"tie_embeddings": None}), TrainingSettings(global_batch_size=8))
    both_ends = cost.stage_params(0, True, False, 1) + cost.stage_params(0, False, True, 1)
    assert both_ends == untied.stage_params(0, True, True, 1)  # on different stages: a copy each


def test_the_tied_bucket_holds_every_end_of_every_pipeline():
    layout = build_layout(tied_plan(2))
    tied = [b for b in layout.buckets if b.tied]
    # per TP rank: pipeline 0's first stage (ranks 0, 1), its last (2, 3), pipeline 1's one stage (4, 5)
    assert sorted(b.ranks for b in tied) == [(0, 2, 4), (1, 3, 5)]
    first, last, both = GPT(TIED, (0, 2)), GPT(TIED, (2, 6)), GPT(TIED)
    for rank, stage, want in ((0, first, first.tok_embedding.weight), (2, last, last.head.weight),
                              (4, both, both.head.weight)):
        params = [p for b in layout.buckets_of(rank) for p in bucket_params(stage, b)]
        assert sum(p is want for p in params) == 1  # in the tied bucket alone, once
    one_pipeline = Plan.model_validate(tied_plan(1).model_dump() | {"pipelines": [tied_plan(1).pipelines[0]],
                                                                     "global_batch_size": 6})
    assert [(b.ranks, b.tied) for b in build_layout(one_pipeline).buckets] == [((0, 1), True)]


def assert_close(got: dict, want: dict, what: str, tol: float = 1e-5) -> None:
    for name, tensor in got.items():
        ref = want[TIED_NAME if name == HEAD_NAME else name]  # a last stage's copy of the one weight
        rel = (tensor - ref).norm() / ref.norm().clamp_min(1e-12)
        assert rel < tol, f"{what} {name}: relative error {rel:.2e}"


@pytest.mark.slow
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


@pytest.mark.slow
def test_tied_plan_under_zero1_matches_one_process(tmp_path: Path):
    """The same plan at TP 1 with AdamW, every stage's state sharded (ZeRO-1): the blocks' state in
    shares, the tied weight's whole on each holder (its holders name it differently). Weights and losses
    are one process's (within what AdamW makes of float32 sums in another order, as tests/test_zero.py)."""
    from test_zero import ONE_PROCESS_TOL, reference as adamw_reference

    plan = tied_plan(1, ("sharded",) * 3)
    records = run(plan, tmp_path / "sharded", steps=STEPS, dump=True)
    want, losses = adamw_reference(plan, [r["lr"] for r in records])
    got = dumped_state(plan, tmp_path / "sharded")
    assert f"optim/{HEAD_NAME}/exp_avg" in got and f"optim/{TIED_NAME}/exp_avg" in got
    assert_close({n: t for n, t in got.items() if not n.startswith("optim/")}, want, "parameter", ONE_PROCESS_TOL)
    assert torch.equal(got[HEAD_NAME], got[TIED_NAME])  # the two copies stay one weight
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-5)


@pytest.mark.slow
def test_a_tied_checkpoint_moves_between_one_weight_and_a_copy_on_each_end(tmp_path: Path):
    """Saved where one stage holds both ends (the optimizer state under the embedding's name only), resumed where
    the ends are on different ranks (the head's copy takes the same state): the step after equals the run that
    never moved."""
    from hetrain.checkpoint.manifest import step_name
    from hetrain.config import CheckpointConfig

    def one_plan(stages: list[tuple[str, list[int]]]) -> Plan:
        return Plan.model_validate({
            "schema": "hetrain.plan/v1", "model": TIED.model_dump(), "cluster": "test", "global_batch_size": 8,
            "micro_batch_size": 2, "tp": 1, "pipelines": [{"num_microbatches": 4, "stages": [
                {"devices": [d], "gpu": "cpu", "layers": layers} for d, layers in stages]}]})

    whole, split = one_plan([("a/0", [0, 6])]), one_plan([("a/0", [0, 3]), ("b/0", [3, 6])])
    cfg = CheckpointConfig(local_dir=str(tmp_path / "nodes" / "{node}"), every_steps=2)
    straight = run(whole, tmp_path / "straight", steps=3)
    run(whole, tmp_path / "save", steps=2, checkpoint=cfg)
    moved = run(split, tmp_path / "moved", steps=3, start_step=2,
                resume_from=str(Path(cfg.node_root("a")) / step_name(1)))
    assert moved[0]["step"] == 2
    assert moved[0]["loss"] == pytest.approx(straight[2]["loss"], rel=1e-5)
