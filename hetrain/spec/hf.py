"""transformers' Llama layout, both ways: hetrain's parameter names and model spec <-> ``config.json`` and
``LlamaForCausalLM``'s tensor names. Torch-free: the export writes through it, ``hetrain train
--init-from`` and ``load_model`` read through it.

The runtime's rotary convention is transformers' (``rotate_half``), so no weight is permuted
either way; GPT specs keep hetrain's names (GPT-2's own layout differs: fused, transposed, with
biases), and their exports carry ``hetrain-model.json`` instead of a ``config.json``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from hetrain.errors import HetrainError
from hetrain.files import parse_json, read_text
from hetrain.spec.specs import ModelSpec, load_model, parse_spec

# A model directory's files: an export writes the first, third and fourth (config.json for Llama);
# transformers writes config.json and the weights, sharded ones with an index naming each tensor's file.
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
HF_CONFIG = "config.json"
SPEC_FILE = "hetrain-model.json"
SAFETENSORS_HEADER_MAX_BYTES = 100 << 20  # safetensors' own limit on the JSON header
# What must agree between a plan's model and the weights it starts from (the name and the sequence
# length may differ: rotary positions have no table; GPT's learned positions are checked by shape).
# Compared as the runtime uses them (defaults filled in: a YAML without norm_eps is the config's 1e-05).
ARCHITECTURE_FIELDS = ("arch", "num_layers", "hidden_size", "num_heads", "kv_heads", "ffn_size", "vocab_size",
                       "rope_base", "eps")

# hetrain's parameter names -> transformers' LlamaForCausalLM names (per block, then the ends)
LLAMA_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}
LLAMA_ENDS = {"tok_embedding.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "head.weight": "lm_head.weight"}
TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# transformers' Llama options hetrain's block does not have: a config that sets them is another model
UNSUPPORTED_IF_SET = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "rope_scaling": None}


def exported_name(spec: ModelSpec, name: str) -> str:
    """The name ``name`` (a parameter of ``hetrain.runtime.model.GPT``) has in an export (transformers' for Llama)."""
    if spec.arch != "llama":
        return name
    if name in LLAMA_ENDS:
        return LLAMA_ENDS[name]
    _, index, rest = name.split(".", 2)  # layers.<i>.<rest>
    return f"model.layers.{index}.{LLAMA_BLOCK[rest]}"


def hf_config(spec: ModelSpec, dtype: str) -> dict:
    """``config.json`` for ``transformers``' ``LlamaForCausalLM``."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": spec.hidden_size, "intermediate_size": spec.ffn_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size, "max_position_embeddings": spec.seq_length, "rope_theta": spec.rope_base,
        "rms_norm_eps": spec.eps, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": TORCH_DTYPE_NAMES[dtype],
    }


def spec_from_hf_config(config: Any, source: str, name: str, seq_length: int | None = None) -> ModelSpec:
    """The model spec of a transformers Llama ``config.json`` (``name`` for it; ``seq_length`` to train at,
    default the config's ``max_position_embeddings``). One line naming the key when it is not one hetrain runs."""
    if not isinstance(config, dict):
        raise HetrainError(f"{source}: expected a JSON object (transformers' config.json)")
    if config.get("model_type") != "llama":
        raise HetrainError(f"{source}: model_type: expected 'llama' (transformers' Llama layout), "
                           f"got {config.get('model_type')!r}")
    for key, plain in UNSUPPORTED_IF_SET.items():
        if config.get(key, plain) != plain:
            raise HetrainError(f"{source}: {key}: hetrain's Llama block has {plain!r}, the model {config[key]!r}")
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * config.get("num_attention_heads", 0) != config.get("hidden_size"):
        raise HetrainError(f"{source}: head_dim: expected hidden_size / num_attention_heads, got {head_dim}")
    rope_theta = _rope_theta(config, source)
    fields = {"name": name, "arch": "llama", "num_layers": config.get("num_hidden_layers"),
              "hidden_size": config.get("hidden_size"), "num_heads": config.get("num_attention_heads"),
              "num_kv_heads": config.get("num_key_value_heads"), "ffn_hidden_size": config.get("intermediate_size"),
              "vocab_size": config.get("vocab_size"), "rope_theta": rope_theta,
              "norm_eps": config.get("rms_norm_eps"), "tie_embeddings": config.get("tie_word_embeddings"),
              "seq_length": seq_length or config.get("max_position_embeddings")}
    return parse_spec(ModelSpec, {k: v for k, v in fields.items() if v is not None}, source)


def _rope_theta(config: dict, source: str) -> Any:
    """The rotary base: transformers 5 writes it in ``rope_parameters`` (with the rope's type), 4 at the top.

    Missed, a Llama 3 (base 500000) would silently train with the default 10000 and be another model.
    """
    rope = config.get("rope_parameters")
    if rope is None:
        return config.get("rope_theta")
    if not isinstance(rope, dict):
        raise HetrainError(f"{source}: rope_parameters: expected an object, got {rope!r}")
    if rope.get("rope_type", "default") != "default":
        raise HetrainError(f"{source}: rope_parameters.rope_type: hetrain's Llama block has 'default' rotary "
                           f"positions, the model {rope['rope_type']!r}")
    return rope.get("rope_theta", config.get("rope_theta"))


def pretrained_spec(directory: str | Path, seq_length: int | None = None) -> ModelSpec:
    """The spec of a model directory: an export's ``hetrain-model.json``, else transformers' ``config.json``."""
    d = Path(directory)
    if (d / SPEC_FILE).is_file():
        return parse_spec(ModelSpec, parse_json(read_text(d / SPEC_FILE), str(d / SPEC_FILE)), str(d / SPEC_FILE))
    if (d / HF_CONFIG).is_file():
        config = parse_json(read_text(d / HF_CONFIG), str(d / HF_CONFIG))
        return spec_from_hf_config(config, str(d / HF_CONFIG), d.resolve().name, seq_length)
    raise HetrainError(f"{d}: no {SPEC_FILE} (a hetrain export) or {HF_CONFIG} (a transformers model) in it")


def load_any_model(path: str | Path) -> ModelSpec:
    """A model YAML file, or a model directory (an export, a transformers Llama) or its ``config.json``."""
    p = Path(path)
    if p.is_dir():
        return pretrained_spec(p)
    if p.name == HF_CONFIG or p.name == SPEC_FILE:
        return pretrained_spec(p.parent)
    return load_model(p)


def safetensors_names(path: Path) -> list[str]:
    """The tensor names in a safetensors file, from its header alone (8 bytes of length, then JSON)."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > SAFETENSORS_HEADER_MAX_BYTES:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as e:
        raise HetrainError(f"{path}: not a safetensors file ({e})") from None
    return [k for k in header if k != "__metadata__"]


def weight_files(directory: str | Path) -> dict[str, Path]:
    """Each tensor's file in a model directory: the sharded layout's index, else the one ``model.safetensors``."""
    d = Path(directory)
    if (d / WEIGHTS_INDEX).is_file():
        index = parse_json(read_text(d / WEIGHTS_INDEX), str(d / WEIGHTS_INDEX))
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise HetrainError(f"{d / WEIGHTS_INDEX}: weight_map: expected an object of tensor name -> file name")
        files = {name: d / file for name, file in weight_map.items()}
        missing = sorted({str(f) for f in files.values() if not f.is_file()})
        if missing:
            raise HetrainError(f"{d / WEIGHTS_INDEX}: names {missing[0]}, which is not there")
        return files
    if (d / WEIGHTS).is_file():
        return {name: d / WEIGHTS for name in safetensors_names(d / WEIGHTS)}
    raise HetrainError(f"{d}: no {WEIGHTS} or {WEIGHTS_INDEX} in it")


def check_pretrained(directory: str | Path, spec: ModelSpec, option: str = "--init-from") -> None:
    """One line unless the weights in ``directory`` are of ``spec``'s architecture (the plan's model)."""
    theirs = pretrained_spec(directory, spec.seq_length)
    differ = [f"{f} {getattr(spec, f)} vs {getattr(theirs, f)}" for f in ARCHITECTURE_FIELDS
              if getattr(spec, f) != getattr(theirs, f)]
    if spec.arch == "gpt" and spec.seq_length != theirs.seq_length:
        differ.append(f"seq_length {spec.seq_length} vs {theirs.seq_length} (learned positions)")
    if differ:
        raise HetrainError(f"{option} {directory}: its model is not the plan's '{spec.name}' "
                           f"({', '.join(differ)}); plan for it with --model {directory}")
    weight_files(directory)
