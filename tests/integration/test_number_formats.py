"""A plan whose stages compute in different number formats (fp16 where a GPU has no bf16): one step's gradients
against one process running the same formats block for block, and one loss scale for the whole step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hetrain.plan.layout import build_layout
from hetrain.plan.schema import Plan
from hetrain.runtime.data import TokenSource
from hetrain.runtime.model import GPT, lm_loss
from hetrain.runtime.precision import apply_mixed_precision
from tests.helpers import run_cli
from tests.helpers.training import plan, run

SPLIT = 3  # stage 0: blocks [0, 3) in fp16 (a V100's), stage 1: [3, 6) in bf16 (an A100's)


def _mixed_plan() -> Plan:
    p = plan(1, [(8, [("a/0", [0, SPLIT]), ("b/0", [SPLIT, 6])])])
    data = p.model_dump(mode="json", by_alias=True)
    data["pipelines"][0]["stages"][0]["precision"] = "fp16"
    data["pipelines"][0]["stages"][1]["precision"] = "bf16"
    return Plan.model_validate(data)


def _reference_grads(p: Plan, formats: tuple[str, str] = ("fp16", "bf16")) -> dict[str, torch.Tensor]:
    """One process, the whole global batch; blocks 0-2 under fp16 autocast, 3-5 under bf16, the boundary cast
    as the runtime casts it (``apply_mixed_precision`` on each half)."""
    model = GPT(p.model)
    model.init_weights(0)
    first, last = model.chunk(0, SPLIT), model.chunk(SPLIT, p.model.num_layers)
    apply_mixed_precision(first, formats[0], "cpu", is_last=False)
    apply_mixed_precision(last, formats[1], "cpu", is_last=True)
    seq = TokenSource(p.model.seq_length, p.model.vocab_size, seed=0).sequences(0, p.global_batch_size)
    lm_loss(last(first(seq[:, :-1])), seq[:, 1:]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return {n: q.grad for n, q in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def test_an_fp16_stage_beside_a_bf16_stage_matches_one_process_in_the_same_formats(tmp_path: Path):
    p = _mixed_plan()
    p.write(tmp_path / "plan.json")
    r = run_cli("train", "--plan", str(tmp_path / "plan.json"), "--steps", "2", "--optimizer", "sgd",
                "--run-dir", str(tmp_path / "run"), "--dump-dir", str(tmp_path / "dump"), "--no-checkpoints")
    assert r.returncode == 0, r.stdout + r.stderr
    got: dict[str, torch.Tensor] = {}
    for role in build_layout(p).roles:
        got.update(torch.load(tmp_path / "dump" / f"grads-rank{role.rank}.pt"))
    reference = _reference_grads(p)
    assert got.keys() == reference.keys()
    errors = {n: _rel(got[n], reference[n]) for n in got}
    assert max(errors.values()) < 3e-2, errors  # 16-bit rounding noise, as the bf16 equivalence test allows
    fp32 = _reference_grads(p, ("fp32", "fp32"))  # ... and really in 16 bits: not fp32's gradients
    assert max(_rel(got[n], fp32[n]) for n in got) > 1e-3
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("loss_scale" in rec for rec in records)  # the fp16 stage turned loss scaling on for the whole run


def _fp8_reference(p: Plan, fp8: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, micro-batch by micro-batch as the pipeline runs them (an fp8 cast's scale is per tensor, so
    per micro-batch): blocks 0-2 under bf16 autocast with their linear layers in fp8 through torchao's CPU
    emulation (``fp8``) or not, 3-5 in bf16; the step's loss and its clipped gradients."""
    from hetrain.runtime.fp8 import apply_fp8

    model = GPT(p.model)
    model.init_weights(0)
    first, last = model.chunk(0, SPLIT), model.chunk(SPLIT, p.model.num_layers)
    apply_mixed_precision(first, "bf16", "cpu", is_last=False)
    apply_mixed_precision(last, "bf16", "cpu", is_last=True)
    if fp8:
        apply_fp8(first, "bf16", torch.device("cpu"), tp=1)
    seq = TokenSource(p.model.seq_length, p.model.vocab_size, seed=0).sequences(0, p.global_batch_size)
    loss = 0.0
    for mb in seq.split(p.micro_batch_size):
        part = lm_loss(last(first(mb[:, :-1])), mb[:, 1:]) * (p.micro_batch_size / p.global_batch_size)
        part.backward()
        loss += float(part.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return loss, {n: q.grad for n, q in model.named_parameters()}


def test_an_fp8_stage_beside_a_bf16_stage_runs_float8_linears_on_its_ranks_only(tmp_path: Path):
    """The plan's first stage in fp8 (as `--formats fastest` writes it on an H100), the second in bf16: the fp8
    stage's ranks ran Float8Linear: every gradient is one process's with those linear layers in fp8 (torchao's CPU
    emulation), not bf16's; the loss is bf16's within fp8's rounding, and stays finite."""
    pytest.importorskip("torchao", reason="the fp8 extra (the test extra installs it)")
    data = _mixed_plan().model_dump(mode="json", by_alias=True)
    data["pipelines"][0]["stages"][0]["precision"] = "fp8"
    p = Plan.model_validate(data)
    records = run(p, tmp_path, 2, dump=True, optimizer="sgd")
    got: dict[str, torch.Tensor] = {}
    for role in build_layout(p).roles:
        got.update(torch.load(tmp_path / "dump" / f"grads-rank{role.rank}.pt"))
    fp8_loss, fp8 = _fp8_reference(p, fp8=True)
    bf16_loss, bf16 = _fp8_reference(p, fp8=False)
    linears = [n for n in got if n.startswith(tuple(f"layers.{i}." for i in range(SPLIT)))
               and n.endswith(".weight") and "norm" not in n]
    assert linears and max(_rel(got[n], fp8[n]) for n in got) < 1e-3  # the fp8 stage's own casts, block for block
    assert min(_rel(got[n], bf16[n]) for n in linears) > 1e-2  # ... and not bf16's
    assert records[0]["loss"] == pytest.approx(fp8_loss, rel=1e-4)
    assert records[0]["loss"] == pytest.approx(bf16_loss, rel=0.02) and all(math.isfinite(r["loss"]) for r in records)
    assert not any("loss_scale" in rec for rec in records)  # fp8's gradients are scaled per tensor, not the loss


def _final_params(dump: Path, p: Plan) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for role in build_layout(p).roles:
        got.update(torch.load(dump / f"params-rank{role.rank}.pt"))
    return got


def _checkpointed_loss_scale(run_dir: Path, step: int) -> float:
    """The loss scale the run's checkpoint of ``step`` carries on: the nodes' shards of the step read as one."""
    import shutil

    import torch.distributed.checkpoint as dcp

    whole = run_dir / "whole"
    for node in ("a", "b"):
        shutil.copytree(run_dir / "checkpoints" / node / f"step-{step:08d}", whole, dirs_exist_ok=True)
    state = {"train_state": {"loss_scale": torch.zeros((), dtype=torch.float64)}}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(whole)), no_dist=True)
    return float(state["train_state"]["loss_scale"])


def test_an_overflow_on_the_fp16_stage_skips_the_step_on_every_rank_and_halves_the_scale(tmp_path: Path,
                                                                                           monkeypatch):
    """The fp16 stage's gradients overflow at step 1 (``FAULT_OVERFLOW`` on its rank): the step is skipped on
    every rank (the parameters are those of a run that stopped after step 0, on the bf16 stage too) and the scale
    the run carries on is half the one it used."""
    from hetrain.runtime.trainer import FAULT_OVERFLOW

    p = _mixed_plan()
    p.write(tmp_path / "plan.json")
    constant_lr = ["--optimizer", "sgd", "--lr", "0.01", "--lr-min", "0.01", "--warmup-steps", "0"]

    def train(name: str, steps: int, *extra: str) -> list[dict]:
        r = run_cli("train", "--plan", str(tmp_path / "plan.json"), "--steps", str(steps), *constant_lr,
                    "--run-dir", str(tmp_path / name), "--dump-dir", str(tmp_path / f"dump-{name}"), *extra)
        assert r.returncode == 0, r.stdout + r.stderr
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    fp16_rank = next(role.rank for role in build_layout(p).roles if role.stage == 0)
    monkeypatch.setenv(FAULT_OVERFLOW, f"{fp16_rank}:1")
    overflowed = train("overflowed", 2, "--checkpoint-every", "100")
    monkeypatch.delenv(FAULT_OVERFLOW)
    stopped = train("stopped", 1, "--no-checkpoints")
    assert [r.get("skipped", False) for r in overflowed] == [False, True]
    assert math.isinf(overflowed[1]["grad_norm"]) or math.isnan(overflowed[1]["grad_norm"])
    used = overflowed[1]["loss_scale"]
    assert _checkpointed_loss_scale(tmp_path / "overflowed", 1) == used / 2
    got, want = _final_params(tmp_path / "dump-overflowed", p), _final_params(tmp_path / "dump-stopped", p)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in got), [n for n in got if not torch.equal(got[n], want[n])]
