"""Read DCP's ``.metadata`` without letting it run code: a restricted unpickler.

DCP writes its checkpoint index as a pickle, and ``pickle.load`` of a crafted file runs any
code it names. The file reaches a recovering node from a peer or a bucket, verified only
against a manifest from the same source, so a compromised spot node could hand over both.
Two designs were possible: sign manifests with a run key every node holds (HMAC), or never
unpickle anything but DCP's own metadata types. We do the second, because it needs no key
distribution, protects every way a checkpoint is read (a resume from a bucket, a scheduled run,
a copy a user brought by hand) and holds even if a node that had the key is the attacker.

``MetadataUnpickler`` admits only the classes a DCP index is made of (listed below, from
``torch.distributed.checkpoint.metadata`` and the filesystem storage info), ``torch.Size``
and torch's dtype, layout and memory-format constants; anything else is refused with the
module and name it asked for. After loading, every shard file the index points at must be
a plain ``__<rank>_<n>.distcp`` name, so a crafted index cannot read files outside the step
directory either.

The index is not the only pickle: DCP stores non-tensor values (the optimizer's param-group
settings) as ``torch.save`` bytes and its default load planner reads them with
``torch.load(weights_only=False)``. ``SafeLoadPlanner`` reads them with ``weights_only=True``
and refuses an index that declares as bytes an entry this rank holds as a tensor.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from hetrain.checkpoint.manifest import CHECKPOINT_FILE
from hetrain.errors import HetrainError

_DCP_TYPES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
}


class UnsafeMetadata(HetrainError):
    pass


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_TYPES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if name == "Size" or isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise UnsafeMetadata(f"checkpoint metadata asks for {module}.{name}, which is not a DCP metadata type")


def load_metadata(data: bytes, source: str) -> Metadata:
    """Unpickle a DCP index under the allowlist and check where it points; UnsafeMetadata otherwise."""
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeMetadata as e:
        raise UnsafeMetadata(f"{source}: {e}") from None
    except Exception as e:
        raise UnsafeMetadata(f"{source}: not a DCP metadata file ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeMetadata(f"{source}: holds a {type(metadata).__name__}, not DCP metadata")
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or not CHECKPOINT_FILE.fullmatch(relative) or relative == ".metadata":
            raise UnsafeMetadata(f"{source}: points at {relative!r}, not a shard file of its step directory")
    return metadata


class SafeFsspecReader(FsspecReader):
    """``FsspecReader`` whose ``read_metadata`` goes through ``load_metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f.read(), str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, with every non-tensor value read by ``torch.load(weights_only=True)``."""

    def create_local_plan(self):
        for fqn, md in self.metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata) and isinstance(self.state_dict.get(fqn), torch.Tensor):
                raise UnsafeMetadata(f"checkpoint entry {fqn} is stored as bytes, but it is a tensor")
        return super().create_local_plan()

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as e:
            raise UnsafeMetadata(f"checkpoint entry {fqn}: not a plain value ({type(e).__name__}: {e})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
