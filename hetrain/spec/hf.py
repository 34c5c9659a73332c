"""transformers' Llama layout, both ways: hetrain's parameter names and model spec <-> ``config.json`` and
the tensor names of ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` and
``Qwen3ForCausalLM`` (one block with switches, ``FAMILY_CLASSES``). Torch-free: the export writes through it, ``hetrain train
--init-from`` and ``load_model`` read through it.

The runtime's rotary convention is transformers' (``rotate_half``), so no weight is permuted
either way; GPT specs keep hetrain's names (GPT-2's own layout differs: fused, transposed, with
biases), and their exports carry ``hetrain-model.json`` instead of a ``config.json``.
"""

from __future__ import annotations

import errno
import json
import struct
from pathlib import Path, PurePosixPath
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
ARCHITECTURE_FIELDS = ("arch", "num_layers", "hidden_size", "num_heads", "kv_heads", "head_dim", "ffn_size",
                       "vocab_size", "rope_base", "rope_scaling", "eps", "qkv_bias", "qk_norm", "tied")

# hetrain's parameter names -> transformers' names (per block, then the ends), one layout for every family
LLAMA_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wq.bias": "self_attn.q_proj.bias",  # qkv_bias (Qwen 2)
    "attn.wk.bias": "self_attn.k_proj.bias",
    "attn.wv.bias": "self_attn.v_proj.bias",
    "attn.q_norm.weight": "self_attn.q_norm.weight",  # qk_norm (Qwen 3)
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}
LLAMA_ENDS = {"tok_embedding.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "head.weight": "lm_head.weight"}
TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# transformers' model_type -> its class; each is the Llama block with the switches ``_family_switches`` reads
FAMILY_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}
# transformers options hetrain's block does not have: a config that sets them is another model
UNSUPPORTED_IF_SET = {"mlp_bias": False, "hidden_act": "silu"}


def exported_name(spec: ModelSpec, name: str) -> str:
    """The name ``name`` (a parameter of ``hetrain.runtime.model.GPT``) has in an export (transformers' for
    Llama-family specs). A tied head is the embedding (transformers saves the one tensor under its name)."""
    if spec.arch != "llama":
        return name
    if name == "head.weight" and spec.tied:
        return LLAMA_ENDS["tok_embedding.weight"]
    if name in LLAMA_ENDS:
        return LLAMA_ENDS[name]
    _, index, rest = name.split(".", 2)  # layers.<i>.<rest>
    return f"model.layers.{index}.{LLAMA_BLOCK[rest]}"


def family_of(spec: ModelSpec) -> str:
    """The transformers family a Llama-arch spec is exported as: its ``family``, else the one its switches make."""
    family = spec.family or ("qwen3" if spec.qk_norm else "qwen2" if spec.qkv_bias else "llama")
    switches = {"qkv_bias": bool(spec.qkv_bias), "qk_norm": bool(spec.qk_norm)}
    if switches != {"qkv_bias": family == "qwen2", "qk_norm": family == "qwen3"}:
        raise HetrainError(f"model '{spec.name}': family {family} has qkv_bias {family == 'qwen2'} and qk_norm "
                           f"{family == 'qwen3'}, the spec {switches['qkv_bias']} and {switches['qk_norm']}")
    return family


def hf_config(spec: ModelSpec, dtype: str, special_tokens: dict[str, int] | None = None) -> dict:
    """``config.json`` for transformers' class of the spec's family; ``special_tokens``: ``bos_token_id``,
    ``eos_token_id`` (the token file's), so ``generate()`` stops where the data's documents end."""
    family = family_of(spec)
    rope = {"rope_type": "default", "rope_theta": spec.rope_base}
    if spec.rope_scaling is not None:
        rope = spec.rope_scaling.model_dump(exclude={"type"}) | {"rope_type": spec.rope_scaling.type,
                                                                "rope_theta": spec.rope_base}
    config = {
        "architectures": [FAMILY_CLASSES[family]], "model_type": family, "hidden_act": "silu",
        "hidden_size": spec.hidden_size, "intermediate_size": spec.ffn_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size, "max_position_embeddings": spec.seq_length, "rope_theta": spec.rope_base,
        "rope_parameters": rope, "rms_norm_eps": spec.eps, "tie_word_embeddings": spec.tied,
        "torch_dtype": TORCH_DTYPE_NAMES[dtype], **(special_tokens or {}),
    }
    if family in ("llama", "qwen3"):  # the families whose attention_bias would also put one on o
        config |= {"attention_bias": False}
    if family == "llama":
        config |= {"mlp_bias": False}
    if family in ("qwen2", "qwen3"):
        config |= {"use_sliding_window": False}
    if family == "mistral":
        config |= {"sliding_window": spec.sliding_window}
    return config


def spec_from_hf_config(config: Any, source: str, name: str, seq_length: int | None = None) -> ModelSpec:
    """The model spec of a transformers ``config.json`` of a family hetrain runs (``FAMILY_CLASSES``), named
    ``name``, to train at ``seq_length`` (``default_seq_length`` where None). One line naming the key or the
    family when it is not one hetrain runs."""
    if not isinstance(config, dict):
        raise HetrainError(f"{source}: expected a JSON object (transformers' config.json)")
    family = config.get("model_type")
    if family not in FAMILY_CLASSES:
        raise HetrainError(f"{source}: model_type: {family!r} is not a family hetrain runs "
                           f"({', '.join(FAMILY_CLASSES)})")
    for key, plain in UNSUPPORTED_IF_SET.items():
        if config.get(key) is not None and config[key] != plain:
            raise HetrainError(f"{source}: {key}: hetrain's Llama block has {plain!r}, the model {config[key]!r}")
    rope_theta, rope_scaling = _rope(config, source)
    fields = {"name": name, "arch": "llama", "family": family, "num_layers": config.get("num_hidden_layers"),
              "hidden_size": config.get("hidden_size"), "num_heads": config.get("num_attention_heads"),
              "num_kv_heads": config.get("num_key_value_heads"), "ffn_hidden_size": config.get("intermediate_size"),
              "vocab_size": config.get("vocab_size"), "rope_theta": rope_theta, "rope_scaling": rope_scaling,
              "norm_eps": config.get("rms_norm_eps"), "tie_embeddings": config.get("tie_word_embeddings"),
              "seq_length": seq_length or default_seq_length(config)}
    fields |= _family_switches(config, family, source)
    return parse_spec(ModelSpec, {k: v for k, v in fields.items() if v is not None}, source)


# Planning from a transformers directory without --seq-length: its max_position_embeddings is the longest
# context the model reads (Llama 3.1/3.2: 131072), not a length to train at; this many tokens at most
DEFAULT_PRETRAINED_SEQ_LENGTH = 4096


def default_seq_length(config: dict) -> Any:
    """The sequence length to train a transformers model at when none is asked: its context, at most
    ``DEFAULT_PRETRAINED_SEQ_LENGTH`` (``hetrain plan`` says which it took)."""
    longest = config.get("max_position_embeddings")
    if isinstance(longest, int) and not isinstance(longest, bool) and longest > DEFAULT_PRETRAINED_SEQ_LENGTH:
        return DEFAULT_PRETRAINED_SEQ_LENGTH
    return longest


def _family_switches(config: dict, family: str, source: str) -> dict:
    """The ``ModelSpec`` switches of a family's config: q/k/v bias (Qwen 2 always has it), q/k norms (Qwen 3),
    the head size where it is not hidden / heads, the attention window. One line for what the block lacks."""
    bias = config.get("attention_bias")
    if family != "qwen2" and bias:  # Llama's, Mistral's and Qwen 3's attention_bias also puts one on o
        raise HetrainError(f"{source}: attention_bias: true (a bias on q, k, v and o) is not in hetrain's block, "
                           f"which has the q/k/v bias of Qwen 2")
    head_dim, heads, hidden = config.get("head_dim"), config.get("num_attention_heads"), config.get("hidden_size")
    explicit = head_dim is not None and not (isinstance(heads, int) and heads and head_dim * heads == hidden)
    window = config.get("sliding_window")
    if family != "mistral" and not config.get("use_sliding_window"):
        window = None  # Qwen's window applies only where use_sliding_window says so
    return {"qkv_bias": True if family == "qwen2" else None, "qk_norm": True if family == "qwen3" else None,
            "head_size": head_dim if explicit else None, "sliding_window": window}


def _rope(config: dict, source: str) -> tuple[Any, dict | None]:
    """The rotary base and Llama 3.1's scaling: transformers 5 writes both in ``rope_parameters``, 4 the base at
    the top and the scaling in ``rope_scaling``.

    Missed, a Llama 3 (base 500000) would silently train with the default 10000 and be another model.
    """
    rope = config.get("rope_parameters", config.get("rope_scaling"))
    if rope is None:
        return config.get("rope_theta"), None
    if not isinstance(rope, dict):
        raise HetrainError(f"{source}: rope_parameters: expected an object, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", config.get("rope_theta"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise HetrainError(f"{source}: rope_parameters.rope_type: hetrain's Llama block has 'default' and 'llama3' "
                           f"rotary positions, the model {kind!r}")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return theta, {"type": "llama3", **{k: rope[k] for k in keys if rope.get(k) is not None}}


def pretrained_spec(directory: str | Path, seq_length: int | None = None) -> ModelSpec:
    """The spec of a model directory: an export's ``hetrain-model.json``, else transformers' ``config.json``."""
    d = Path(directory)
    if not _exists(d):
        raise HetrainError(f"{d}: not found; expected a model directory")
    if _exists(d / SPEC_FILE):
        return parse_spec(ModelSpec, parse_json(read_text(d / SPEC_FILE), str(d / SPEC_FILE)), str(d / SPEC_FILE))
    if _exists(d / HF_CONFIG):
        config = parse_json(read_text(d / HF_CONFIG), str(d / HF_CONFIG))
        return spec_from_hf_config(config, str(d / HF_CONFIG), d.resolve().name, seq_length)
    raise HetrainError(f"{d}: no {SPEC_FILE} (a hetrain export) or {HF_CONFIG} (a transformers model) in it")


def load_any_model(path: str | Path, seq_length: int | None = None) -> ModelSpec:
    """A model YAML file, or a model directory (an export, a transformers model) or its ``config.json``, to
    train at ``seq_length`` (``hetrain plan --seq-length``; default the file's: ``default_seq_length`` for a
    transformers config, whose ``max_position_embeddings`` is the context it reads, not a length to train at)."""
    p = Path(path)
    directory = p if p.is_dir() else p.parent if p.name in (HF_CONFIG, SPEC_FILE) else None
    spec = pretrained_spec(directory, seq_length) if directory is not None else load_model(p)
    if seq_length is None or spec.seq_length == seq_length:
        return spec
    return parse_spec(ModelSpec, spec.model_dump(exclude_none=True) | {"seq_length": seq_length},
                      f"--seq-length {seq_length} for {p}")


def seq_length_note(path: str | Path, spec: ModelSpec) -> str | None:
    """What ``hetrain plan`` says when it trains a transformers model at less than its context unasked."""
    p = Path(path)
    config = (p if p.is_dir() else p.parent) / HF_CONFIG
    if not config.is_file() or (p / SPEC_FILE).is_file():
        return None
    longest = parse_json(read_text(config), str(config)).get("max_position_embeddings")
    if not isinstance(longest, int) or longest <= spec.seq_length:
        return None
    return (f"planned at {spec.seq_length} tokens a sequence; {config.name}'s max_position_embeddings {longest} is "
            f"the context the model reads (choose with --seq-length)")


def safetensors_names(path: Path) -> list[str]:
    """The tensor names in a safetensors file, from its header alone (8 bytes of length, then a JSON object).

    Checked as safetensors' own loader checks it, in one line naming the file: at most 100 MB, an object
    (of bounded nesting) whose every tensor has a dtype, a shape and data offsets inside the file.
    """
    try:
        size = _present(path).stat().st_size
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(SAFETENSORS_HEADER_MAX_BYTES, size - 8):
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            text = f.read(length).decode("utf-8")
    except (OSError, struct.error, ValueError) as e:
        raise HetrainError(f"{path}: not a safetensors file ({e})") from None
    header = parse_json(text, f"{path}: header")
    if not isinstance(header, dict):
        raise HetrainError(f"{path}: not a safetensors file (its header is {type(header).__name__}, expected an "
                           f"object of tensors)")
    data = size - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and isinstance(entry.get("shape"), list)
                and all(type(n) is int and n >= 0 for n in entry["shape"]) and isinstance(offsets, list)
                and len(offsets) == 2 and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1] <= data):
            raise HetrainError(f"{path}: not a safetensors file (tensor {name!r}: expected dtype, shape and data "
                               f"offsets inside the file's {data} bytes of data)")
    return [k for k in header if k != "__metadata__"]


def _present(path: Path) -> Path:
    """``path`` if it exists; one line for a symbolic link that loops or leads nowhere (``is_file`` says only False)."""
    try:
        path.stat()
    except OSError as e:
        if path.is_symlink():
            raise HetrainError(f"{path}: a symbolic link that {'loops' if e.errno == errno.ELOOP else 'leads nowhere'}, "
                               f"expected a file") from None
        raise
    return path


def _exists(path: Path) -> bool:
    try:
        return _present(path).exists()
    except FileNotFoundError:
        return False


def _confined(directory: Path, name: str, source: Path) -> Path:
    """``directory / name``, refused unless ``name`` stays inside ``directory`` (no absolute path, no ``..``).

    The names of an index are confined; the files themselves may be links (a Hugging Face cache's snapshot
    links each file to its blob), as the directory the user named holds them.
    """
    parts = PurePosixPath(name).parts
    if not name or PurePosixPath(name).is_absolute() or "\\" in name or any(p in ("..", ".") for p in parts):
        raise HetrainError(f"{source}: weight_map names {name!r}, outside the directory; expected a file name in "
                           f"{directory}")
    return directory / name


def weight_files(directory: str | Path) -> dict[str, Path]:
    """Each tensor's file in a model directory: the sharded layout's index, else the one ``model.safetensors``.

    Only files inside ``directory`` (an index naming ``../other/...`` is refused), each header checked
    (``safetensors_names``), each tensor of the index in the file it names.
    """
    d = Path(directory)
    if _exists(d / WEIGHTS_INDEX):
        index = parse_json(read_text(d / WEIGHTS_INDEX), str(d / WEIGHTS_INDEX))
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise HetrainError(f"{d / WEIGHTS_INDEX}: weight_map: expected an object of tensor name -> file name")
        files = {name: _confined(d, file, d / WEIGHTS_INDEX) for name, file in weight_map.items()}
        missing = sorted({str(f) for f in files.values() if not _exists(f)})
        if missing:
            raise HetrainError(f"{d / WEIGHTS_INDEX}: names {missing[0]}, which is not there")
        held = {f: set(safetensors_names(f)) for f in set(files.values())}
        absent = next((name for name, f in files.items() if name not in held[f]), None)
        if absent is not None:
            raise HetrainError(f"{d / WEIGHTS_INDEX}: names {files[absent]} for tensor {absent!r}, which it lacks")
        return files
    if _exists(d / WEIGHTS):
        return {name: d / WEIGHTS for name in safetensors_names(d / WEIGHTS)}
    raise HetrainError(f"{d}: no {WEIGHTS} or {WEIGHTS_INDEX} in it")


def _architecture(spec: ModelSpec) -> dict[str, Any]:
    """The fields that make the weights' meaning, as the runtime reads them (a switch left out is off)."""
    values = {f: getattr(spec, f) for f in ARCHITECTURE_FIELDS}
    return values | {"qkv_bias": bool(spec.qkv_bias), "qk_norm": bool(spec.qk_norm)}


def check_pretrained(directory: str | Path, spec: ModelSpec, option: str = "`init_from`") -> None:
    """One line unless the weights in ``directory`` are of ``spec``'s architecture (the plan's model)."""
    theirs = pretrained_spec(directory, spec.seq_length)
    mine, its = _architecture(spec), _architecture(theirs)
    derived = {"head_dim"} if spec.head_size is None and theirs.head_size is None else set()  # hidden / heads
    differ = [f"{f} {mine[f]} vs {its[f]}" for f in ARCHITECTURE_FIELDS if mine[f] != its[f] and f not in derived]
    if spec.arch == "gpt" and spec.seq_length != theirs.seq_length:
        differ.append(f"seq_length {spec.seq_length} vs {theirs.seq_length} (learned positions)")
    if differ:
        raise HetrainError(f"{option} {directory}: its model is not the plan's '{spec.name}' "
                           f"({', '.join(differ)}); plan for it with --model {directory}")
    weight_files(directory)
