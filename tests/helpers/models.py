"""Models for the tests of pretrained weights, families and tied embeddings: models as transformers 5 makes
and saves them (small configs, no hub), hetrain's weights written in transformers' layout, and llama-tiny
with its embedding tied to its head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hetrain.plan.schema import Plan
from hetrain.runtime.model import GPT
from hetrain.spec.hf import WEIGHTS_INDEX, exported_name, hf_config
from hetrain.spec.specs import load_model
from tests.helpers.training import LLAMA_TINY

# -- the families people bring ----------------------------------------------------------------------------------------
SEQ = 32
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=131072, rms_norm_eps=1e-6)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # shorter than SEQ: the scaling shows
FAMILIES = {
    "llama-3.1": ("LlamaConfig", {"rope_parameters": LLAMA3}),
    "llama-3.2": ("LlamaConfig", {"rope_parameters": LLAMA3 | {"factor": 32.0}, "tie_word_embeddings": True}),
    "qwen-2.5": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen-3": ("Qwen3Config", {"head_dim": 32}),  # 4 heads of 32 in a hidden size of 64
    "mistral": ("MistralConfig", {"sliding_window": None}),
}


def transformers_model(directory: Path, family: str):
    """``family``'s model as transformers makes and saves it, every weight moved off its init (zero biases, unit
    norms would hide a missing bias or norm)."""
    transformers = pytest.importorskip("transformers")
    config_class, extra = FAMILIES[family]
    torch.manual_seed(3)
    config = getattr(transformers, config_class)(**(BASE | extra))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(directory))
    return model


def transformers_llama(directory: Path, rope_theta: float = 500000.0):
    """A Llama that transformers made and saved (its own init, its own config.json: transformers 5
    writes the rotary base inside ``rope_parameters``), at llama-tiny's size."""
    transformers = pytest.importorskip("transformers")
    config = hf_config(load_model(LLAMA_TINY), "fp32")
    config["rope_parameters"]["rope_theta"] = config["rope_theta"] = rope_theta  # Llama 3's base, not the default
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    model.save_pretrained(str(directory))
    return model


def write_transformers_dir(directory: Path, model: GPT, shards: int = 1) -> Path:
    """transformers' layout of ``model``: config.json and one model.safetensors, or ``shards`` files and an index."""
    from safetensors.torch import save_file

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


# -- tied embeddings --------------------------------------------------------------------------------------------------
# Every switch of the block at once, so the equivalence runs cover them under TP too: q/k/v bias split with its
# projection, q/k head norms whose gradient sums over the TP group, heads of 32 in a hidden size of 64
TIED = load_model(LLAMA_TINY).model_copy(
    update={"tie_embeddings": True, "qkv_bias": True, "qk_norm": True, "head_size": 32})


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
