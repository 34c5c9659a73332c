"""Host-memory buffers for a rank's checkpoint snapshot, made before the first checkpoint is due.

Why: a background checkpoint stalls training only for a copy of the rank's state into host
memory. Into memory that is already allocated, paged in and (on a GPU) pinned, that copy runs at
the host link's speed (55 GB/s for 18 GB on an H200 node, 0.35 s); into fresh pageable memory it
ran at 1.4 GB/s (13.5 s), and allocating and pinning 18 GB when the first checkpoint was due
stalled that checkpoint 17 s. So the buffers are made once, before the first step (the
optimizer's state is made then too: ``Checkpointer.prepare``). A GPU's are made in a background
thread while the first steps run, in pieces small enough that training's own CUDA calls get
through between them; a checkpoint due before they are ready waits for them
(``checkpoint_buffers_waited_s``, a console note past a second). A state trained on the host's
cores has its buffers made before the first step, in the caller: a background thread there
takes the same cores from the steps beside it, so it saves no time, and on this project's 2-core
VM (4.6 GB, bench/checkpoint_large.py) it made the first checkpoint wait 0.2-7 s for it. A state
that does not fit the host-memory budget is saved synchronously instead (``Snapshot.fits``),
stated once in the log and in the metrics.

The buffers live in one anonymous mapping (page-aligned, pinned a range at a time), each tensor
a storage of its own over its bytes of it: torch's pinned caching allocator would round every block
up to a power of two (an 18 GB state could take 36 GB), and DCP's writer clones a tensor whose
storage is larger than itself, so views of one big tensor would be copied again at every commit.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed._state_dict_utils import _copy_state_dict
from torch.distributed.tensor import DTensor

log = logging.getLogger("hetrain.checkpoint")

PAGE_BYTES = 4096  # cudaHostRegister pins whole pages: chunks start on page boundaries so none overlap
ALIGN_BYTES = 64  # each view starts on a cache line (and satisfies every dtype's alignment)
# Pinning (or paging in) 256 MB at a time: about 50 ms per piece at the 5 GB/s page-locking runs,
# so training's CUDA calls wait at most that long behind the driver's lock.
CHUNK_BYTES = 256 << 20
# Of the memory the machine has available when a run starts, what a node's snapshots may take by
# default (the rest is the data loader's, the page cache's and the commit's).
DEFAULT_HOST_SHARE = 0.8


@dataclass(frozen=True)
class _Slot:
    """One tensor of the state: where its bytes go in the arena, and how to rebuild its type."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    spec: object | None  # a DTensor's spec: the snapshot keeps DTensors DTensors (DCP's save plan needs them)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def state_bytes(state) -> int:
    """Bytes of every tensor in a (nested) state dict, a DTensor's local shard only."""
    total = 0
    for value in _leaves(state):
        local = value._local_tensor if isinstance(value, DTensor) else value
        total += local.numel() * local.element_size()
    return total


def _leaves(state):
    if isinstance(state, dict):
        for value in state.values():
            yield from _leaves(value)
    elif isinstance(state, torch.Tensor):
        yield state


def _template(state, offset: list[int]):
    """The state's structure with each tensor replaced by its ``_Slot`` (offsets counted into ``offset[0]``)."""
    if isinstance(state, dict):
        return {key: _template(value, offset) for key, value in state.items()}
    if not isinstance(state, torch.Tensor):
        return state
    local = state._local_tensor if isinstance(state, DTensor) else state
    slot = _Slot(tuple(local.shape), local.dtype, offset[0], state._spec if isinstance(state, DTensor) else None)
    offset[0] += -(-_nbytes(slot.shape, slot.dtype) // ALIGN_BYTES) * ALIGN_BYTES
    return slot


def _layout(template) -> list:
    if isinstance(template, dict):
        return [(key, _layout(value)) for key, value in template.items()]
    if isinstance(template, _Slot):
        return [template.shape, template.dtype, template.spec is not None]
    return type(template).__name__


class Arena:
    """One anonymous mapping (page-aligned), paged in (and pinned on a GPU) a chunk at a time.

    Each buffer is a tensor over its own bytes of the mapping (``torch.frombuffer``), not a view
    of one big tensor: DCP's writer clones a tensor whose storage is larger than itself before
    saving it (a second copy of the whole state per commit), and ``torch.save`` would write the
    whole storage otherwise.
    """

    def __init__(self, nbytes: int, pin: bool) -> None:
        # pinned memory from torch's caching allocator would round the size up to a power of two
        self._map = mmap.mmap(-1, max(nbytes, PAGE_BYTES))
        self.nbytes = nbytes
        self.pin = pin
        self._pinned: list[int] = []

    def prepare(self) -> None:
        """Page every chunk in (a write), then pin it on a GPU machine: the first copy then runs at full speed."""
        for begin in range(0, self.nbytes, CHUNK_BYTES):
            piece = torch.frombuffer(self._map, dtype=torch.uint8, count=min(CHUNK_BYTES, self.nbytes - begin),
                                     offset=begin)
            piece.zero_()
            if self.pin:
                self._register(piece)

    def _register(self, piece: torch.Tensor) -> None:
        cudart = torch.cuda.cudart()
        code = int(cudart.cudaHostRegister(piece.data_ptr(), piece.numel(), 0))
        if code != 0:
            raise RuntimeError(f"pinning {piece.numel() / 1e9:.2f} GB of host memory failed (cudaError {code})")
        ptr = piece.data_ptr()
        self._pinned.append(ptr)
        weakref.finalize(self, _unregister, ptr)

    def view(self, slot: _Slot) -> torch.Tensor:
        count = math.prod(slot.shape)
        if count == 0:
            return torch.empty(slot.shape, dtype=slot.dtype)
        return torch.frombuffer(self._map, dtype=slot.dtype, count=count, offset=slot.offset).view(slot.shape)

    @property
    def pinned(self) -> bool:
        return bool(self._pinned)


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # the process is ending; the kernel unpins with the mapping
        pass


def _buffers(template, arena: Arena):
    """The snapshot's state dict: ``template``'s structure, each tensor a view of ``arena``."""
    if isinstance(template, dict):
        return {key: _buffers(value, arena) for key, value in template.items()}
    if not isinstance(template, _Slot):
        return template
    local = arena.view(template)
    if template.spec is None:
        return local
    return DTensor(local, template.spec, requires_grad=False)


def host_available_bytes() -> int | None:
    """MemAvailable of this machine (Linux), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Snapshot:
    """A rank's training state copied to host memory, into buffers made once and kept.

    ``prepare(state)`` makes the buffers for ``state``'s shape (a GPU state's in a background thread,
    a host state's before it returns); ``take`` copies into them (waiting for a background preparation
    if it is still going, which the caller's stall then shows). A state whose shape changed since is
    given new buffers at once (the old behaviour).
    ``budget_bytes``: the most this rank's buffers may take; a state above it ``fits`` no more.
    """

    def __init__(self, budget_bytes: int | None = None, ranks_on_node: int = 1) -> None:
        self.budget_bytes = budget_bytes
        self.ranks_on_node = ranks_on_node
        self._buffers: dict | None = None
        self._layout: list | None = None
        # The arena must live as long as its views: it unpins its pages when collected, and the views alone
        # keep the memory but not the pinning (measured on an H200: the copy then ran at 13 GB/s, not 55).
        self._arena: Arena | None = None
        self._thread: threading.Thread | None = None
        self.prepare_s: float | None = None  # how long making the buffers took (None: not made, or it failed)
        self.waited_s = 0.0  # of the last ``take``: waiting for the preparation

    def fits(self, state) -> bool:
        return self.budget_bytes is None or state_bytes(state) <= self.budget_bytes

    def prepare(self, state) -> None:
        """Make the buffers for ``state``'s shape (nothing is copied): a GPU's in the background (returns at
        once), a host state's now (its training would share the cores with a background thread)."""
        if self._thread is not None or self._arena is not None or not self.fits(state):
            return
        offset = [0]
        template = _template(state, offset)
        pin = any(t.is_cuda for t in _leaves(state))
        if not pin:
            with self._cores():  # training waits for it: it pages in at the speed a take copies
                self._make(template, offset[0], pin)
            return
        self._thread = threading.Thread(target=self._make, args=(template, offset[0], pin), daemon=True,
                                        name="hetrain-snapshot-buffers")
        self._thread.start()

    def _make(self, template, nbytes: int, pin: bool) -> None:
        started = time.perf_counter()
        try:
            arena = Arena(nbytes, pin)
            arena.prepare()
            self._buffers, self._layout, self._arena = _buffers(template, arena), _layout(template), arena
            self.prepare_s = time.perf_counter() - started
            log.info("checkpoint snapshot buffers ready: %.2f GB %s in %.2f s", nbytes / 1e9,
                     "pinned" if pin else "paged in", self.prepare_s)
        except Exception as e:  # a failed pin: take() makes them the old way, at the checkpoint
            log.warning("preparing the checkpoint's snapshot buffers failed (%s); they are made at the first "
                        "checkpoint instead", e)

    def take(self, state: dict) -> dict:
        """Copy ``state`` into the buffers (on a GPU: all copies landed before returning)."""
        waiting = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
        self.waited_s = time.perf_counter() - waiting
        on_gpu = any(t.is_cuda for t in _leaves(state))
        offset = [0]
        template = _template(state, offset)
        if _layout(template) != self._layout:
            arena = Arena(offset[0], on_gpu)
            if on_gpu:
                arena.prepare()
            self._buffers, self._layout, self._arena = _buffers(template, arena), _layout(template), arena
        with contextlib.nullcontext() if on_gpu else self._cores():
            copied = _copy_state_dict(state, self._buffers, non_blocking=on_gpu)
        if on_gpu:
            torch.cuda.synchronize()  # the copies must land before training changes the weights
        return copied

    @contextlib.contextmanager
    def _cores(self) -> Iterator[None]:
        """Every core of the rank's share for a host copy training waits for (memcpy-bound; a CPU rank trains on
        ``threads_per_rank`` threads, 1 by default: on one, 4.6 GB paged in in 13.3 s, on both cores 6.4 s)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(max(threads, cpu_count() // max(1, self.ranks_on_node)))
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    @property
    def pinned(self) -> bool:
        """Whether the prepared buffers are pinned (a GPU's copy then runs at the host link's speed)."""
        return self._arena is not None and self._arena.pinned


def default_budget_bytes(ranks_on_node: int, host_memory_gb: float | None) -> int | None:
    """One rank's share of the node's snapshot budget: ``host_memory_gb`` (the user's, for the node) or
    ``DEFAULT_HOST_SHARE`` of the memory available now; None when neither is known (no limit)."""
    if host_memory_gb is not None:
        node = host_memory_gb * 1e9
    else:
        available = host_available_bytes()
        if available is None:
            return None
        node = available * DEFAULT_HOST_SHARE
    return int(node / max(1, ranks_on_node))


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
