"""Local-first sharded checkpoints with a manifest that commits them.

Layout, under each node's checkpoint root (any fsspec URL; ``{node}`` in the configured root
is replaced by the node name, so emulated nodes on one machine get separate directories)::

    <root>/step-00000120/__3_0.distcp     shards written by torch.distributed.checkpoint
    <root>/step-00000120/.metadata        DCP's index (copied to every node)
    <root>/step-00000120/manifest.json    written last, atomically: the commit

Every rank writes its own DCP shard into its node's directory (``FsspecWriter`` per rank,
each pointed at its node's root; DCP only cares that the coordinator's ``.metadata`` names
each file relative to the checkpoint). When ``dcp.save`` has returned on every rank, the
ranks gather each file's size and SHA-256, and rank 0 builds the manifest: step, plan,
model, and every file with the nodes that hold it. Each node's first rank writes the
``.metadata`` and then the manifest into its directory (temporary name, then rename). A
directory without a manifest is an unfinished save and is never loaded; the newest
committed step is. Older steps beyond ``keep`` are removed manifest first. This module says what a
manifest is and checks an untrusted one; ``store.CheckpointStore`` lists, reads, writes and prunes under a root.

What is saved (``torch.distributed.checkpoint.state_dict`` with flattened optimizer state, so
every key names a parameter and loading works into any other TP/PP/DP layout): the model,
the optimizer (AdamW moments and step counts, or nothing for SGD), and the torch RNG state
(one copy: the ranks' RNG states share a key, so rank 0's is kept; the runtime draws no
random numbers after initialisation).
The data sampler is a pure function of the step, so the manifest's ``step`` is its position.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from typing import Any, Literal

import fsspec
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError, field_validator, model_validator

from hetrain.errors import HetrainError
from hetrain.plan.schema import Plan
from hetrain.spec.arithmetic import total_params
from hetrain.spec.specs import ModelSpec

MANIFEST = "manifest.json"
METADATA = ".metadata"
CHECKPOINT_SCHEMA = "hetrain.checkpoint/v1"
_STEP_PREFIX = "step-"


# What a step directory may hold: DCP's index and its shards (``__<rank>_<n>.distcp``), nothing
# else and nowhere else. A manifest comes from a peer or a bucket and is untrusted: a path that
# is not one of these is refused, never normalised into place (no '/', no '..', no absolute path).
CHECKPOINT_FILE = re.compile(r"\.metadata|__[0-9]{1,6}_[0-9]{1,6}\.distcp")  # whole names: use fullmatch
STEP_DIR = re.compile(re.escape(_STEP_PREFIX) + r"([0-9]+)")  # a step directory's whole name (ASCII digits only)
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# What a checkpoint of a model can weigh: fp32 weights and AdamW's two fp32 moments are 12 bytes a parameter;
# twice that again for what DCP may store beside them. A manifest claiming more lies (a peer streaming zeros
# until the disk is full), and is refused before anything is fetched.
MAX_STATE_BYTES_PER_PARAM = 32
CHECKPOINT_EXTRA_BYTES = 256 << 20  # RNG states, the train state, DCP's index: megabytes, whatever the model


def max_checkpoint_bytes(model: ModelSpec) -> int:
    """The most a committed checkpoint of ``model`` can hold, all files together."""
    return total_params(model) * MAX_STATE_BYTES_PER_PARAM + CHECKPOINT_EXTRA_BYTES


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str  # relative to the step directory
    size: NonNegativeInt
    sha256: str
    nodes: list[str]  # nodes whose checkpoint root holds it

    @field_validator("path")
    @classmethod
    def _confined(cls, v: str) -> str:
        if not CHECKPOINT_FILE.fullmatch(v):
            raise ValueError(f"{v!r} is not a checkpoint file name (.metadata or __<rank>_<n>.distcp)")
        return v

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, v: str) -> str:
        if not SHA256_HEX.fullmatch(v):
            raise ValueError("expected 64 lowercase hex digits")
        return v


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_: Literal["hetrain.checkpoint/v1"] = Field(CHECKPOINT_SCHEMA, alias="schema")
    run_id: str
    step: NonNegativeInt  # the last completed step; training resumes at step + 1
    model: ModelSpec
    plan: Plan
    optimizer: str
    created_s: float = Field(default_factory=time.time)
    files: list[FileEntry]

    @model_validator(mode="after")
    def _files_once_and_bounded(self) -> Manifest:
        paths = [f.path for f in self.files]
        if len(set(paths)) != len(paths):
            twice = next(p for p in paths if paths.count(p) > 1)
            raise ValueError(f"files: {twice} is listed twice")
        bound = max_checkpoint_bytes(self.model)
        if self.total_bytes > bound:
            raise ValueError(f"files: {self.total_bytes / 1e9:.3g} GB in all, more than a checkpoint of "
                             f"'{self.model.name}' can hold ({bound / 1e9:.3g} GB)")
        return self

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, indent=1)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def step_name(step: int) -> str:
    return f"{_STEP_PREFIX}{step:08d}"


def step_of_dir(name: str) -> int | None:
    """The step a directory named ``name`` holds (``step-00000120``: 120), None for any other name."""
    m = STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(fs: fsspec.AbstractFileSystem, path: str, chunk_bytes: int = 8 << 20) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def parse_manifest(text: str | bytes, source: str) -> Manifest:
    try:
        return Manifest.model_validate_json(text)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "manifest"
        raise HetrainError(f"{source}: {where}: {first['msg']}") from None


def write_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write under a temporary name, then rename: readers see the old file or the whole new one."""
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"  # unique: several nodes may share one root
    fs.pipe_file(tmp, data)
    fs.mv(tmp, path)


def build_manifest(run_id: str, step: int, plan: Plan, optimizer: str,
                   per_rank: list[tuple[str, list[tuple[str, int, str]]]],
                   metadata: tuple[int, str]) -> Manifest:
    """``per_rank``: (node, [(path, size, sha256)]) from every rank; ``metadata``: size and hash of .metadata."""
    files: dict[str, FileEntry] = {}
    for node, entries in per_rank:
        for path, size, digest in entries:
            entry = files.get(path)
            if entry is None:
                files[path] = FileEntry(path=path, size=size, sha256=digest, nodes=[node])
            elif node not in entry.nodes:
                entry.nodes.append(node)
    nodes = sorted({node for node, _ in per_rank})
    files[METADATA] = FileEntry(path=METADATA, size=metadata[0], sha256=metadata[1], nodes=nodes)
    return Manifest(run_id=run_id, step=step, model=plan.model, plan=plan, optimizer=optimizer,
                    files=sorted(files.values(), key=lambda f: f.path))


def dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()
