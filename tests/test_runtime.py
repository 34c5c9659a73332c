"""The runtime on real gloo processes started by `hetrain train` through accelerate launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import EXAMPLES, run_cli
from hetrain.data import TokenSource
from hetrain.layout import build_layout
from hetrain.model import GPT, lm_loss
from hetrain.plan import Plan
from hetrain.specs import load_model

TINY = EXAMPLES / "models" / "gpt-tiny.yaml"
LR, CLIP, STEPS = 0.5, 1.0, 3


def asymmetric_plan(tp: int, global_batch_size: int = 8, micro_batch_size: int = 2) -> Plan:
    """Pipeline 0: two stages, 2 + 4 blocks, 3 micro-batches; pipeline 1: one stage, 1 micro-batch."""
    spec = load_model(TINY)

    def stage(node: str, first: int, layers: list[int]) -> dict:
        return {"devices": [f"{node}/{first + j}" for j in range(tp)], "gpu": "cpu", "layers": layers}

    return Plan.model_validate({
        "schema": "hetrain.plan/v1", "model": spec.model_dump(), "cluster": "test",
        "global_batch_size": global_batch_size, "micro_batch_size": micro_batch_size, "tp": tp,
        "pipelines": [
            {"num_microbatches": 3, "stages": [stage("a", 0, [0, 2]), stage("a", tp, [2, 6])]},
            {"num_microbatches": 1, "stages": [stage("b", 0, [0, 6])]},
        ],
    })


def reference(plan: Plan, steps: int) -> tuple[dict, dict, list[float]]:
    """One process, the whole global batch at once: gradients of step 0, parameters after, losses."""
    model = GPT(plan.model)
    model.init_weights(0)
    source = TokenSource(plan.model.seq_length, plan.model.vocab_size, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads, losses = {}, []
    for step in range(steps):
        seq = source.sequences(step * plan.global_batch_size, plan.global_batch_size)
        loss = lm_loss(model(seq[:, :-1]), seq[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def assert_close(got: dict, want: dict, what: str) -> None:
    assert got, f"no {what} dumped"
    for name, tensor in got.items():
        ref = want[name]
        rel = (tensor - ref).norm() / ref.norm().clamp_min(1e-12)
        assert rel < 1e-5, f"{what} {name}: relative error {rel:.2e}"


@pytest.mark.parametrize("tp", [1, 2])
def test_asymmetric_plan_matches_single_process(tmp_path: Path, tp: int):
    plan = asymmetric_plan(tp)
    plan.write(tmp_path / "plan.json")
    dump = tmp_path / "dump"
    r = run_cli("train", "--plan", str(tmp_path / "plan.json"), "--model", str(TINY), "--steps", str(STEPS),
                "--optimizer", "sgd", "--lr", str(LR), "--max-grad-norm", str(CLIP),
                "--run-dir", str(tmp_path / "run"), "--dump-dir", str(dump))
    assert r.returncode == 0, r.stdout + r.stderr
    ref_grads, ref_params, ref_losses = reference(plan, STEPS)

    layout = build_layout(plan)
    holders: dict[str, int] = {}
    for role in layout.roles:
        if role.tp_rank:
            continue
        grads = torch.load(dump / f"grads-rank{role.rank}.pt")
        params = torch.load(dump / f"params-rank{role.rank}.pt")
        assert_close(grads, ref_grads, f"gradient on {role.device}")
        assert_close(params, ref_params, f"parameter on {role.device}")
        for name in params:
            holders[name] = holders.get(name, 0) + 1
    # every parameter is held, and checked, once per pipeline
    assert holders == {name: 2 for name in ref_params}

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    for rec, want in zip(records, ref_losses):
        assert abs(rec["loss"] - want) <= 1e-5 * abs(want)
