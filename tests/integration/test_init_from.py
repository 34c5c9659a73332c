"""``hetrain train --init-from`` through runs: a run's export, read by a run under another plan (TP 2 and two
stages), gives the same loss and the same gradients as the export's weights in one process; transformers' own
Llama save trains from transformers' loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hetrain.plan.schema import Plan
from hetrain.runtime.data import TokenSource
from hetrain.runtime.model import GPT, lm_loss
from hetrain.spec.hf import pretrained_spec
from hetrain.spec.specs import load_model
from tests.helpers import run_cli
from tests.helpers.models import transformers_llama
from tests.helpers.training import LLAMA_TINY as LLAMA


def two_stage_tp2_plan(spec) -> Plan:
    stage = lambda first, layers: {"devices": [f"a/{first}", f"a/{first + 1}"], "gpu": "cpu", "layers": layers}
    return Plan.model_validate({
        "schema": "hetrain.plan/v1", "model": spec.model_dump(), "cluster": "test", "global_batch_size": 8,
        "micro_batch_size": 2, "tp": 2, "pipelines": [{"num_microbatches": 4, "stages": [stage(0, [0, 4]),
                                                                                        stage(2, [4, 6])]}]})


def one_device_plan(spec) -> Plan:
    return Plan.model_validate({
        "schema": "hetrain.plan/v1", "model": spec.model_dump(), "cluster": "test", "global_batch_size": 8,
        "micro_batch_size": 2, "tp": 1,
        "pipelines": [{"num_microbatches": 4, "stages": [{"devices": ["a/0"], "gpu": "cpu", "layers": [0, 6]}]}]})


def test_export_then_init_from_under_another_plan_gives_the_same_loss_and_gradients(tmp_path: Path):
    """Train llama-tiny a step on one device, export it, start a TP 2 x two-stage run from the
    export: its first loss and every rank's first gradients are those of the export's weights in
    one process (the logits, sharded by vocabulary over two ranks, go into both)."""
    from hetrain.export import load_export

    spec = load_model(LLAMA)
    one_device_plan(spec).write(tmp_path / "a.json")
    # seed 1: the export is not the weights run B would draw itself (seed 0), so ignoring --init-from fails
    r = run_cli("train", "--plan", str(tmp_path / "a.json"), "--steps", "1", "--seed", "1", "--run-dir",
                str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr
    r = run_cli("export", "--run", str(tmp_path / "a"), "--out", str(tmp_path / "export"))
    assert r.returncode == 0 and "Warning" not in r.stderr, r.stderr
    plan = two_stage_tp2_plan(spec)
    plan.write(tmp_path / "b.json")
    r = run_cli("train", "--plan", str(tmp_path / "b.json"), "--steps", "1", "--optimizer", "sgd", "--init-from",
                str(tmp_path / "export"), "--run-dir", str(tmp_path / "b"), "--dump-dir", str(tmp_path / "dump"))
    assert r.returncode == 0, r.stderr

    _, weights = load_export(tmp_path / "export")
    model = GPT(spec)
    model.load_state_dict(weights)
    seq = TokenSource(spec.seq_length, spec.vocab_size, seed=0).sequences(0, plan.global_batch_size)
    loss = lm_loss(model(seq[:, :-1]), seq[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    record = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(record["loss"] - loss.item()) <= 1e-5 * loss.item()
    seen = set()
    for rank in (0, 2):  # each stage's TP rank 0 dumps its parameters' whole gradients
        for name, grad in torch.load(tmp_path / "dump" / f"grads-rank{rank}.pt").items():
            want = dict(model.named_parameters())[name].grad
            assert (grad - want).norm() <= 1e-5 * want.norm(), name
            seen.add(name)
    assert seen == set(weights)


def test_a_llama_transformers_made_trains_from_its_loss_at_tp2_in_two_stages(tmp_path: Path):
    """The first loss of a TP 2 x two-stage run started from transformers' own save is transformers'
    loss on the same batch (the vocabulary-sharded logits of two ranks make it)."""
    theirs = transformers_llama(tmp_path / "hf")
    spec = pretrained_spec(tmp_path / "hf", 32)
    plan = two_stage_tp2_plan(spec)
    plan.write(tmp_path / "b.json")
    r = run_cli("train", "--plan", str(tmp_path / "b.json"), "--steps", "1", "--init-from", str(tmp_path / "hf"),
                "--run-dir", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    seq = TokenSource(spec.seq_length, spec.vocab_size, seed=0).sequences(0, plan.global_batch_size)
    with torch.no_grad():
        want = lm_loss(theirs(input_ids=seq[:, :-1]).logits, seq[:, 1:]).item()
    record = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(record["loss"] - want) <= 1e-5 * want
