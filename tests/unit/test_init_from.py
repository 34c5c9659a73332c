"""``hetrain train --init-from``: pretrained weights in (transformers' Llama layout or a hetrain export),
read into plain stages in this process. The round trips through runs (a run's export read by a run under
another plan; transformers' save trained at TP 2) are in tests/integration/test_init_from.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hetrain.errors import HetrainError
from hetrain.runtime.data import TokenSource
from hetrain.runtime.model import GPT
from hetrain.runtime.pretrained import load_pretrained
from hetrain.spec.hf import SPEC_FILE, check_pretrained, exported_name, load_any_model, pretrained_spec
from hetrain.spec.specs import load_model
from tests.helpers import EXAMPLES
from tests.helpers.models import transformers_llama, write_transformers_dir
from tests.helpers.training import LLAMA_TINY as LLAMA


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
