"""A run's committed checkpoint as one consolidated ``model.safetensors``, whatever plan wrote it.

Training leaves DCP shards spread over the nodes (and the bucket), cut by the plan that
wrote them; what people do with a trained model is load it elsewhere (Hugging Face
``transformers``, vLLM). ``export_run`` reassembles a committed step (verified, from the
nodes' directories or peer servers, then the bucket), loads its model part into one whole
single-process model (DCP reshards: any plan, any TP degree), and writes:

* ``model.safetensors``: every weight, whole, in ``dtype``. Llama-family specs use the
  ``transformers`` ``LlamaForCausalLM`` names (``model.layers.N.self_attn.q_proj.weight``...;
  ``hetrain.spec.hf`` owns the mapping); GPT specs keep hetrain's names.
* ``config.json`` in the ``transformers`` layout of the spec's family (Llama, Mistral, Qwen 2, Qwen 3:
  Llama-arch specs only), with the token file's ``eos_token_id``/``bos_token_id``, and
  ``generation_config.json`` with them (``generate()`` stops at the data's EOS).
* ``hetrain-model.json``: the model spec, so ``load_export`` (and hetrain) can rebuild it.
* ``tokenizer.json`` (and its transformers config files) when the run's data was made with one
  (``hetrain data prepare --tokenizer``): the model and its tokenizer travel together; a bare
  ``tokenizer.json`` gets a ``tokenizer_config.json`` naming its EOS (also BOS and pad).

Files are written under temporary names and renamed when whole.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from hetrain.checkpoint import PEER_SILENCE_S
from hetrain.errors import HetrainError
from hetrain.spec.hf import HF_CONFIG, SPEC_FILE, WEIGHTS, exported_name, hf_config  # their owner
from hetrain.spec.specs import ModelSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SINGLE_PROCESS_WARNING = "torch.distributed is disabled"  # dcp.load's, whenever no process group is up


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")  # transformers' names


def tokenizer_files(data: str | None) -> dict[str, Path]:
    """The tokenizer the run's token file was made with (``hetrain data prepare --tokenizer``), by export name.

    ``tokenizer.json`` and, where they sit beside it (a transformers model directory), its
    ``tokenizer_config.json`` and ``special_tokens_map.json``; nothing for byte-level data, a file
    without a description or a tokenizer moved away since.
    """
    from hetrain.runtime.data import token_file_description

    meta = token_file_description(data) if data else None
    source = meta.get("tokenizer_path") if meta else None
    if not isinstance(source, str):
        return {}
    main = Path(source) if Path(source).is_file() else Path(source) / TOKENIZER_FILES[0]
    if not main.is_file():
        return {}
    return {TOKENIZER_FILES[0]: main} | {name: main.parent / name for name in TOKENIZER_FILES[1:]
                                         if (main.parent / name).is_file()}


GENERATION_CONFIG, TOKENIZER_CONFIG = "generation_config.json", "tokenizer_config.json"


def special_tokens(data: str | None) -> dict[str, int]:
    """``bos_token_id``/``eos_token_id`` of the run's token file: the EOS ``data prepare`` wrote between documents.

    The file has no BOS (documents are joined by EOS alone), so the model learned that a document starts
    after an EOS: the EOS is its BOS too, as in GPT-2. Empty for byte-level data or a file without one;
    without them transformers would fall back to its class's defaults (Llama's 1 and 2), not the data's.
    """
    from hetrain.runtime.data import token_file_description

    meta = token_file_description(data) if data else None
    eos = meta.get("eos_id") if meta else None
    if not isinstance(eos, int) or isinstance(eos, bool):
        return {}
    return {"bos_token_id": eos, "eos_token_id": eos}


def _stage_transformers_files(work: Path, staged: dict[str, Path], spec: ModelSpec, dtype: str,
                              data: str | None) -> None:
    """``config.json`` and ``generation_config.json`` with the data's special tokens, so ``generate()`` stops
    at the data's EOS; a ``tokenizer_config.json`` naming them where the tokenizer came without one (a bare
    ``tokenizer.json``: ``AutoTokenizer`` would load it with no eos or pad token)."""
    tokens = special_tokens(data)
    files = {HF_CONFIG: hf_config(spec, dtype, tokens)}
    if tokens:
        files[GENERATION_CONFIG] = {**tokens, "pad_token_id": tokens["eos_token_id"]}
    if tokens and TOKENIZER_FILES[0] in staged and TOKENIZER_CONFIG not in staged:
        from tokenizers import Tokenizer

        eos = Tokenizer.from_file(str(staged[TOKENIZER_FILES[0]])).id_to_token(tokens["eos_token_id"])
        files[TOKENIZER_CONFIG] = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eos, "eos_token": eos,
                                   "pad_token": eos, "model_max_length": spec.seq_length}
    for name, content in files.items():
        staged[name] = work / name
        staged[name].write_text(json.dumps(content, indent=2) + "\n")


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise HetrainError(f"--dtype: expected one of {', '.join(DTYPES)}, got '{dtype}'")


@dataclass
class ExportResult:
    out_dir: Path
    step: int
    num_params: int
    num_bytes: int
    files: list[str]


def consolidate(checkpoint_dir: str, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The model's weights, whole, from a reassembled (committed and verified) step directory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: DCP's wrapper of rank errors

    from hetrain.checkpoint.safe_metadata import SafeFsspecReader, SafeLoadPlanner
    from hetrain.runtime.model import GPT, HEAD_NAME

    model = GPT(spec)  # whole, on the CPU: DCP fills it from whatever shards the plan wrote
    # a tied head is the embedding's Parameter, which checkpoints hold once, under the embedding's name
    state = {"model": {n: t for n, t in model.state_dict().items() if not (spec.tied and n == HEAD_NAME)}}
    try:
        with warnings.catch_warnings():  # one process by design: DCP's warning that it is one says nothing to a user
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
            dcp.load(state, storage_reader=SafeFsspecReader(checkpoint_dir), planner=SafeLoadPlanner(), no_dist=True)
    except HetrainError:
        raise
    except (Exception, CheckpointException) as e:  # an index that does not fit the model (no code runs: safe unpickler)
        raise HetrainError(f"{checkpoint_dir}: the checkpoint's .metadata does not describe '{spec.name}' "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    return model.state_dict()  # loaded in place, the tied head with its embedding


def export_run(run_dir: Path, out_dir: Path, *, step: int | None = None, dtype: str = "fp32",
               timeout_s: float = PEER_SILENCE_S) -> ExportResult:
    """Export the run's newest committed step (or ``step``) into ``out_dir`` (see the module docstring)."""
    from safetensors.torch import save_file

    from hetrain.checkpoint.reassemble import NoCheckpoint, committed_by_source, reassemble, _manifest
    from hetrain.plan.schema import load_plan
    from hetrain.run.runs import load_run, sources_for

    check_dtype(dtype)
    config = load_run(run_dir)
    if config.checkpoint is None:
        raise HetrainError(f"--run {run_dir}: the run was started without checkpoints; nothing to export")
    plan = load_plan(config.plan)
    spec = plan.model
    peers, remote = sources_for(config, plan, [])
    holders, errors = committed_by_source(peers + ([remote] if remote else []), timeout_s)
    if not holders:
        raise NoCheckpoint(errors)
    chosen = max(holders) if step is None else step
    if chosen not in holders:
        raise HetrainError(f"--step {step}: not a committed step of run {run_dir} (committed: "
                           f"{', '.join(map(str, sorted(holders)))})")
    manifest = _manifest(chosen, holders[chosen], spec, timeout_s)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".export-", dir=out_dir))
    try:
        restored = work / "checkpoint"
        reassemble(manifest, peers, remote, str(restored), timeout_s=timeout_s)
        weights = consolidate(str(restored), spec)
        tensors = {exported_name(spec, name): t.detach().to(DTYPES[dtype]).contiguous() for name, t in weights.items()}
        staged = {WEIGHTS: work / WEIGHTS, SPEC_FILE: work / SPEC_FILE}
        save_file(tensors, str(staged[WEIGHTS]), metadata={"format": "pt", "hetrain_step": str(chosen),
                                                            "hetrain_arch": spec.arch})
        staged[SPEC_FILE].write_text(json.dumps(spec.model_dump(mode="json", exclude_none=True), indent=2) + "\n")
        # safetensors creates its file private (0600); the export is for others to read, like the files
        # written here through open(), whose mode the user's umask set
        os.chmod(staged[WEIGHTS], staged[SPEC_FILE].stat().st_mode & 0o777)
        for name, source in tokenizer_files(config.options.data).items():  # the tokenizer travels with the model
            staged[name] = work / name
            shutil.copyfile(source, staged[name])
        if spec.arch == "llama":
            _stage_transformers_files(work, staged, spec, dtype, config.options.data)
        for name, path in staged.items():  # whole files only, each renamed into place
            os.replace(path, out_dir / name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return ExportResult(out_dir, chosen, sum(t.numel() for t in tensors.values()),
                        sum(t.numel() * t.element_size() for t in tensors.values()), sorted(staged))


def load_export(out_dir: Path) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """The spec and hetrain-named weights of an export (``GPT(spec).load_state_dict(weights)`` takes them)."""
    from safetensors.torch import load_file

    from hetrain.spec.specs import parse_spec

    spec_path = out_dir / SPEC_FILE
    try:
        spec = parse_spec(ModelSpec, json.loads(spec_path.read_text()), str(spec_path))
    except (OSError, ValueError) as e:
        raise HetrainError(f"{spec_path}: {e}") from None
    exported = load_file(str(out_dir / WEIGHTS))
    from hetrain.runtime.model import GPT

    names: dict[str, list[str]] = {}  # a tied model's embedding and head: one exported tensor, two names
    for n in GPT(spec).state_dict():
        names.setdefault(exported_name(spec, n), []).append(n)
    unknown = sorted(set(exported) - set(names))
    missing = sorted(set(names) - set(exported))
    if unknown or missing:
        raise HetrainError(f"{out_dir / WEIGHTS}: not an export of {spec.name} "
                           f"({'unknown ' + unknown[0] if unknown else 'missing ' + missing[0]})")
    return spec, {n: v for k, v in exported.items() for n in names[k]}
