"""``hetrain train --init-from``: pretrained weights in (transformers' Llama layout or a hetrain export).

The fast tests read into plain stages in this process; the slow one is the round trip: a run's
export, read by a run under another plan (TP 2 and two stages), gives the same loss and the
same gradients as the export's weights in one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import EXAMPLES, run_cli
from hetrain.errors import HetrainError
from hetrain.plan.schema import Plan
from hetrain.runtime.data import TokenSource
from hetrain.runtime.model import GPT, lm_loss
from hetrain.runtime.pretrained import load_pretrained
from hetrain.spec.hf import (SPEC_FILE, WEIGHTS_INDEX, check_pretrained, exported_name, hf_config, load_any_model,
                             pretrained_spec)
from hetrain.spec.specs import load_model

LLAMA = EXAMPLES / "models" / "llama-tiny.yaml"


def write_transformers_dir(directory: Path, model: GPT, shards: int = 1) -> Path:
    """transformers' layout of ``model``: config.json and one model.safetensors, or ``shards`` files and an index."""
    directory.mkdir(parents=True, exist_ok=True)
    spec = model.spec
    (directory / "config.json").write_text(json.dumps(hf_config(spec, "fp32")))
    tensors = {exported_name(spec, n): t.detach().contiguous() for n, t in model.state_dict().items()}
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
        return directory
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(directory / file))
        weight_map |= {n: file for n in part}
    (directory / WEIGHTS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


@pytest.mark.parametrize("shards", [1, 3])
def test_a_stage_reads_only_its_tensors(tmp_path: Path, shards: int):
    """The last stage of a two-stage cut (blocks 2-5, norm, head) gets exactly the full model's values
    of its parameters and reads nothing else; the spec comes from config.json."""
    spec = load_model(LLAMA)
    full = GPT(spec)
    full.init_weights(7)
    d = write_transformers_dir(tmp_path / "llama", full, shards)
    theirs = pretrained_spec(d, spec.seq_length)
    check_pretrained(d, spec)  # the same architecture, defaults filled in
    assert theirs.name == "llama" and theirs.seq_length == spec.seq_length
    assert load_any_model(d / "config.json") == load_any_model(d) == theirs  # `hetrain plan --model DIR`
    stage = GPT(spec, [2, 6])
    stage.init_weights(0)
    read = load_pretrained(stage, spec, d)
    want = full.state_dict()
    for name, t in stage.state_dict().items():
        assert torch.equal(t, want[name]), name
    assert read == sum(t.numel() * t.element_size() for t in stage.state_dict().values())


def test_a_gpt_export_directory_reloads(tmp_path: Path):
    """A GPT export (hetrain's names, hetrain-model.json; no transformers layout) is a model directory too."""
    spec = load_model(EXAMPLES / "models" / "gpt-tiny.yaml")
    full = GPT(spec)
    full.init_weights(3)
    d = tmp_path / "gpt"
    d.mkdir()
    (d / SPEC_FILE).write_text(json.dumps(spec.model_dump(mode="json", exclude_none=True)))
    save_file({n: t.contiguous() for n, t in full.state_dict().items()}, str(d / "model.safetensors"))
    assert load_any_model(d) == spec
    check_pretrained(d, spec)
    stage = GPT(spec, [0, 3])
    load_pretrained(stage, spec, d)
    assert all(torch.equal(t, full.state_dict()[n]) for n, t in stage.state_dict().items())


def test_weights_of_another_model_are_one_line(tmp_path: Path):
    spec = load_model(LLAMA)
    wider = spec.model_copy(update={"hidden_size": 128, "ffn_hidden_size": 256})
    other = GPT(wider)
    d = write_transformers_dir(tmp_path / "wide", other)
    with pytest.raises(HetrainError, match="its model is not the plan's 'llama-tiny' \\(hidden_size 64 vs 128, "
                                           "ffn_size 128 vs 256\\); plan for it with --model"):
        check_pretrained(d, spec)
    model = GPT(spec)
    d = write_transformers_dir(tmp_path / "small", model)
    tensors = {exported_name(spec, n): t.contiguous() for n, t in model.state_dict().items()
               if n != "layers.3.mlp.w2.weight"}
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(HetrainError, match="no tensor 'model.layers.3.mlp.down_proj.weight'"):
        load_pretrained(GPT(spec, [2, 6]), spec, d)


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


@pytest.mark.slow
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


def transformers_llama(directory: Path, rope_theta: float = 500000.0):
    """A Llama that transformers made and saved (its own init, its own config.json: transformers 5
    writes the rotary base inside ``rope_parameters``), at llama-tiny's size."""
    transformers = pytest.importorskip("transformers")
    config = hf_config(load_model(LLAMA), "fp32")
    config["rope_parameters"]["rope_theta"] = config["rope_theta"] = rope_theta  # Llama 3's base, not the default
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    model.save_pretrained(str(directory))
    return model


def test_a_llama_transformers_made_gives_its_logits_in_hetrain(tmp_path: Path):
    theirs = transformers_llama(tmp_path / "hf")
    spec = pretrained_spec(tmp_path / "hf", 32)
    assert spec.rope_base == 500000.0  # read from rope_parameters
    ours = GPT(spec)
    load_pretrained(ours, spec, tmp_path / "hf")
    tokens = TokenSource(spec.seq_length, spec.vocab_size, seed=0).sequences(0, 4)
    with torch.no_grad():
        want = theirs(input_ids=tokens).logits
        got = ours(tokens)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_a_rope_hetrain_does_not_have_is_one_line(tmp_path: Path):
    transformers_llama(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HetrainError, match="rope_parameters.rope_type: hetrain's Llama block has 'default' and "
                                           "'llama3' rotary positions, the model 'yarn'"):
        pretrained_spec(tmp_path / "hf")


@pytest.mark.slow
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
