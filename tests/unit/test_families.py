"""The families people bring, as transformers 5 makes them (small configs, no hub): Llama 3.1 (rotary
scaling), Llama 3.2 (tied), Qwen 2.5 (q/k/v bias, tied), Qwen 3 (q/k norm, head size not hidden / heads),
Mistral. Each loads into hetrain's one block with transformers' logits, and hetrain's weights written as
the family's export load back into transformers with hetrain's logits. The trainings from a family's save
are in tests/integration/test_families.py.
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
from hetrain.spec.arithmetic import total_params
from hetrain.spec.hf import exported_name, hf_config, pretrained_spec
from tests.helpers import EXAMPLES, run_cli
from tests.helpers.models import FAMILIES, SEQ, transformers_model

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_transformers_made_gives_its_logits_in_hetrain(tmp_path: Path, family: str):
    theirs = transformers_model(tmp_path / "hf", family)
    spec = pretrained_spec(tmp_path / "hf", SEQ)
    ours = GPT(spec)
    load_pretrained(ours, spec, tmp_path / "hf")
    assert total_params(spec) == sum(p.numel() for p in theirs.parameters())  # tied: the one weight once
    tokens = TokenSource(SEQ, spec.vocab_size, seed=0).sequences(0, 2)
    with torch.no_grad():
        want, got = theirs(input_ids=tokens).logits, ours(tokens)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_hetrain_weights_written_as_the_family_load_in_transformers(tmp_path: Path, family: str):
    """The other way: hetrain's own weights, written as the export writes them (its config.json and names)."""
    transformers_model(tmp_path / "hf", family)
    spec = pretrained_spec(tmp_path / "hf", SEQ)
    ours = GPT(spec)
    ours.init_weights(11)
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config(spec, "fp32", {"bos_token_id": 0, "eos_token_id": 0})))
    save_file({exported_name(spec, n): t.contiguous() for n, t in ours.state_dict().items()},
              str(out / "model.safetensors"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(loaded).__name__ == json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"][0]
    assert loaded.config.eos_token_id == 0
    tokens = TokenSource(SEQ, spec.vocab_size, seed=1).sequences(0, 2)
    with torch.no_grad():
        want, got = ours(tokens), loaded(input_ids=tokens).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("change,expected", [
    ({"model_type": "gemma2"}, "model_type: 'gemma2' is not a family hetrain runs (llama, mistral, qwen2, qwen3)"),
    ({"sliding_window": 16}, "sliding_window: expected at least seq_length 32 (sliding-window attention is not "
                             "supported), got 16"),
    ({"attention_bias": True}, "attention_bias: true (a bias on q, k, v and o) is not in hetrain's block"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type: hetrain's Llama block has 'default' and "
                                                                "'llama3' rotary positions, the model 'yarn'"),
])
def test_what_the_block_lacks_is_one_line_naming_it(tmp_path: Path, change: dict, expected: str):
    transformers_model(tmp_path / "hf", "mistral")
    config = json.loads((tmp_path / "hf" / "config.json").read_text()) | change
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HetrainError, match=expected.replace("(", r"\(").replace(")", r"\)")) as e:
        pretrained_spec(tmp_path / "hf", SEQ)
    assert "\n" not in str(e.value)


def test_a_checkpoints_context_is_not_the_length_trained_at(tmp_path: Path):
    """Llama 3.2 reads 131072 tokens; planned without --seq-length it trains at 4096, with it at the asked."""
    transformers_model(tmp_path / "hf", "llama-3.2")
    assert pretrained_spec(tmp_path / "hf").seq_length == 4096
    assert pretrained_spec(tmp_path / "hf", 2048).seq_length == 2048


def test_plan_trains_at_the_asked_length_and_refuses_a_family_it_lacks_in_one_line(tmp_path: Path):
    """``hetrain plan --seq-length`` (the model directory's context is 131072 tokens); a Gemma directory is
    refused with exit 2 in one line naming its family."""
    transformers_model(tmp_path / "hf", "llama-3.2")
    cluster = str(EXAMPLES / "clusters" / "cpu-emulated.yaml")
    r = run_cli("plan", "--model", str(tmp_path / "hf"), "--cluster", cluster, "--global-batch-size", "8",
                "--seq-length", "64", "--out", str(tmp_path / "plan.json"), "--time-limit", "1")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "plan.json").read_text())["model"]["seq_length"] == 64
    config = json.loads((tmp_path / "hf" / "config.json").read_text()) | {"model_type": "gemma"}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    r = run_cli("plan", "--model", str(tmp_path / "hf"), "--cluster", cluster, "--global-batch-size", "8")
    assert r.returncode == 2 and "'gemma' is not a family hetrain runs" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
