"""``hetrain train --init-from DIR``: a stage starts from pretrained weights instead of random ones.

``DIR`` is a transformers Llama directory (``config.json`` + ``model.safetensors``, or shards
with ``model.safetensors.index.json``) or a hetrain export; ``hetrain.spec.hf`` owns the names
and the files. Each rank opens the files with safetensors' lazy ``safe_open`` and reads only
what it holds: the parameters of its stage's blocks (and the embedding or head where it has
them), and of each tensor-parallel parameter only its own shard's rows or columns, found from
the DTensor's placements. A 70B checkpoint costs each rank its share, not 140 GB of reads.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hetrain.errors import HetrainError
from hetrain.runtime.parallelize import local_tensor
from hetrain.spec.hf import exported_name, weight_files
from hetrain.spec.specs import ModelSpec


def _shard_index(param: torch.Tensor) -> tuple[slice, ...]:
    """The global index range of this rank's part of ``param`` (all of it unless a DTensor shards it)."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


@torch.no_grad()
def load_pretrained(stage: nn.Module, spec: ModelSpec, directory: str | Path) -> int:
    """Copy ``directory``'s weights into ``stage``'s parameters (this rank's parts only); the bytes read.

    One line naming the file and tensor when one is missing or of another shape.
    """
    files = weight_files(directory)
    read_bytes = 0
    with contextlib.ExitStack() as opened:
        handles: dict[Path, object] = {}
        for name, param in stage.named_parameters():
            key = exported_name(spec, name)
            if key not in files:
                raise HetrainError(f"`init_from` {directory}: no tensor '{key}' (the model's {name})")
            path = files[key]
            if path not in handles:
                handles[path] = opened.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            lazy = handles[path].get_slice(key)
            shape = tuple(lazy.get_shape())
            if shape != tuple(param.shape):
                raise HetrainError(f"{path}: '{key}' is {list(shape)}, the model's {name} is {list(param.shape)}")
            part = lazy[_shard_index(param)]
            if part.is_floating_point() and not bool(torch.isfinite(part).all()):
                bad = int((~torch.isfinite(part)).sum())
                raise HetrainError(f"{path}: '{key}' holds {bad} non-finite values (NaN or infinity) of {part.numel()} "
                                   f"in this rank's part; expected finite weights")
            local = local_tensor(param)
            local.copy_(part.to(local.device))
            read_bytes += part.numel() * part.element_size()
    return read_bytes
