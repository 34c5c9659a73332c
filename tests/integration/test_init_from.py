"""A trained Llama's export and ``hetrain train --init-from`` through runs: the export of a run under TP 2 in two
stages holds what its ranks held, in transformers' layout; read by a run under another plan (TP 2 and two other
stages), it gives the same loss and the same gradients as the export's weights in one process; transformers' own
Llama save trains from transformers' loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hetrain.plan.schema import Plan
from hetrain.runtime.data import TokenSource
from hetrain.runtime.model import GPT, lm_loss
from hetrain.spec.hf import pretrained_spec
from hetrain.spec.specs import load_model
from tests.helpers import run_cli
from tests.helpers.models import transformers_llama
from tests.helpers.training import LLAMA_TINY as LLAMA
from tests.helpers.training import dumped_state, plan, run


def two_stage_tp2_plan(spec) -> Plan:
    stage = lambda first, layers: {"devices": [f"a/{first}", f"a/{first + 1}"], "gpu": "cpu", "layers": layers}
    return Plan.model_validate({
        "schema": "hetrain.plan/v1", "model": spec.model_dump(), "cluster": "test", "global_batch_size": 8,
        "micro_batch_size": 2, "tp": 2, "pipelines": [{"num_microbatches": 4, "stages": [stage(0, [0, 4]),
                                                                                        stage(2, [4, 6])]}]})


@pytest.fixture(scope="module")
def trained_export(tmp_path_factory) -> tuple[Path, Plan, Path, str]:
    """llama-tiny trained 2 steps under TP 2 in two pipeline stages on nodes a and b, its ranks' state dumped, and
    ``hetrain export`` of the run: (directory, plan, export directory, the export command's output).

    Shared: the round trip below checks the export against the ranks' state, the init-from test starts a
    run under another plan from it (one training run and one export fewer)."""
    from hetrain.config import CheckpointConfig

    tmp_path = tmp_path_factory.mktemp("llama-export")
    spec = load_model(LLAMA)
    base = plan(2, [(8, [("a/0", [0, 3]), ("b/0", [3, 6])])])
    p = Plan.model_validate({**json.loads(base.to_json()), "model": spec.model_dump(mode="json", exclude_none=True)})
    cfg = CheckpointConfig(local_dir=str(tmp_path / "nodes" / "{node}"), every_steps=1000)
    run(p, tmp_path / "train", steps=2, checkpoint=cfg, dump=True)
    out = tmp_path / "export"
    r = run_cli("export", "--run", str(tmp_path / "train" / "run"), "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Warning" not in r.stderr, r.stderr
    return tmp_path, p, out, r.stdout


def test_export_of_a_trained_llama_round_trips_exactly(trained_export):
    """Trained under TP 2 in two pipeline stages, exported from the node directories' DCP shards into one
    safetensors file in transformers' Llama layout: every weight equal to what the ranks held at the end,
    and a fresh single-process model loaded from it gives the same logits."""
    from safetensors import safe_open

    from hetrain.export import HF_CONFIG, WEIGHTS, load_export

    tmp_path, p, out, stdout = trained_export
    spec = load_model(LLAMA)
    assert "exported step 1" in stdout
    got_spec, weights = load_export(out)
    assert got_spec == spec
    trained = {n: t for n, t in dumped_state(p, tmp_path / "train").items() if not n.startswith("optim/")}
    assert weights.keys() == trained.keys()
    for name, tensor in trained.items():
        assert torch.equal(weights[name], tensor), name
    with safe_open(str(out / WEIGHTS), "pt") as f:
        names = set(f.keys())
    assert {"model.embed_tokens.weight", "model.layers.5.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
            "model.norm.weight", "lm_head.weight"} <= names
    config = json.loads((out / HF_CONFIG).read_text())
    assert (config["num_key_value_heads"], config["intermediate_size"], config["model_type"]) == (2, 128, "llama")
    fresh, held = GPT(spec), GPT(spec)
    fresh.load_state_dict(weights)
    held.load_state_dict(trained)
    ids = torch.randint(0, spec.vocab_size, (2, spec.seq_length))
    assert torch.equal(fresh(ids), held(ids))
    assert [x.name for x in out.iterdir() if x.name.startswith(".")] == []  # no staging left


def test_export_then_init_from_under_another_plan_gives_the_same_loss_and_gradients(tmp_path: Path, trained_export):
    """llama-tiny trained under TP 2 in two stages and exported (the fixture), a TP 2 x two-stage run of other
    cuts started from the export: its first loss and every rank's first gradients are those of the export's
    weights in one process (the logits, sharded by vocabulary over two ranks, go into both)."""
    from hetrain.export import load_export

    spec = load_model(LLAMA)
    # trained weights: not the ones run B would draw itself (seed 0), so ignoring --init-from fails
    export = trained_export[2]
    plan = two_stage_tp2_plan(spec)
    plan.write(tmp_path / "b.json")
    r = run_cli("train", "--plan", str(tmp_path / "b.json"), "--steps", "1", "--optimizer", "sgd", "--init-from",
                str(export), "--run-dir", str(tmp_path / "b"), "--dump-dir", str(tmp_path / "dump"))
    assert r.returncode == 0, r.stderr

    _, weights = load_export(export)
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
