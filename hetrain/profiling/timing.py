"""How the profiler times a layer and counts what it keeps: the clocks, the precision, the device's queue.

Apart from ``profiler`` (what is measured: which modules, at which sizes, filed how) because
how a measurement is taken is its own question, shared with ``overheads``:

* On a GPU: the mean wall-clock time (``time.perf_counter``) of ``repeats`` runs issued back
  to back after ``warmup`` runs, synchronised only around the batch, as a training step
  overlaps kernel launches with the GPU's work.
* On CPU: the median of ``repeats`` runs of the CPU seconds of the profiling thread
  (``time.thread_time``), which is what an emulated CPU device is charged for
  (``hetrain.runtime.instrument``) and, unlike wall time, does not count the moments other
  processes of this shared machine held the core.
* Precision: ``fp32`` runs plain fp32; ``bf16``/``fp16`` run forward under ``torch.autocast``
  with that dtype (parameters stay fp32), as the runtime runs them.
* Memory: ``kept_bytes`` follows every storage a forward creates and counts those still alive
  when it returns, which is what the block keeps for backward.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Literal

import torch
from torch import nn

from hetrain.runtime.instrument import StageMeter
from hetrain.runtime.model import run_block

Precision = Literal["bf16", "fp16", "fp32"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def sync(device: torch.device) -> None:
    """Wait for the device's queue: a GPU's kernels run after Python issued them, a CPU's already ran."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device, precision: Precision) -> contextlib.AbstractContextManager:
    """The runtime's autocast for ``precision`` (none for fp32), without the weight cache it also runs without."""
    dtype = DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=False)  # as the runtime runs it


def time_fwd_bwd(
    forward: Callable[[], torch.Tensor],
    backward: Callable[[torch.Tensor], None],
    device: torch.device,
    precision: Precision,
    warmup: int,
    repeats: int,
) -> tuple[float, float]:
    """Forward and backward seconds of one run: medians on CPU, back-to-back means on a GPU."""
    if device.type == "cuda":
        return _time_fwd_bwd_pipelined(forward, backward, device, precision, warmup, repeats)
    fwd: list[float] = []
    bwd: list[float] = []
    clock = time.thread_time  # what an emulated CPU device is charged for
    # a CPU rank's stage meter counts every tensor saved for backward through Python hooks, inside
    # the compute it is charged for (20-30 % of a gpt-tiny block): time the block with them too
    counting = StageMeter(nn.Module(), "profiler").saved_tensor_hooks
    for i in range(warmup + repeats):
        t0 = clock()
        with autocast(device, precision), counting():
            out = forward()
        t1 = clock()
        backward(out)
        t2 = clock()
        del out
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd)


def _time_fwd_bwd_pipelined(
    forward: Callable[[], torch.Tensor],
    backward: Callable[[torch.Tensor], None],
    device: torch.device,
    precision: Precision,
    warmup: int,
    repeats: int,
) -> tuple[float, float]:
    """GPU timing as training sees it: runs issued back to back, synchronised only around the batch.

    Synchronising around every forward and backward (as the CPU path does) charges each run
    the kernel-launch latency and the idle GPU while Python issues the first kernels; in a
    training step the CPU runs ahead of the GPU and hides both, which made profile-fed
    predictions about 24 % slower than measured steps on an H100. Here ``repeats`` forwards
    are timed back to back, then ``repeats`` forward + backward pairs; backward is the difference.
    """
    for _ in range(warmup):
        with autocast(device, precision):
            out = forward()
        backward(out)
        del out
    sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        with autocast(device, precision):
            out = forward()
        del out
    sync(device)
    fwd = (time.perf_counter() - started) / repeats
    started = time.perf_counter()
    for _ in range(repeats):
        with autocast(device, precision):
            out = forward()
        backward(out)
        del out
    sync(device)
    both = (time.perf_counter() - started) / repeats
    return fwd, max(both - fwd, 0.0)


def kept_bytes(run: Callable[[], torch.Tensor], params: Iterable[torch.Tensor], x: torch.Tensor,
                device: torch.device, precision: Precision) -> int:
    """Bytes ``run``'s forward leaves alive for backward, its input included: what one block keeps per micro-batch.

    Every storage an op creates during the forward is followed (weakly); those still alive
    once the forward returned, but for its output, are what autograd (or selective recompute's
    cache, which saved-tensor hooks do not see) keeps. The input is counted too: every mode
    keeps it (the first norm saves it, or the checkpoint recomputes from it). Parameters and
    views of them are left out, as in ``StageMeter``; ``x``, the tensor ``run`` feeds the block
    (a view of it is the input), is counted once, as fp32. The graph is dropped without backward.
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    param_ptrs = {p.untyped_storage().data_ptr() for p in params} | {x.untyped_storage().data_ptr()}
    created: dict[int, tuple[weakref.ref, int]] = {}

    class _Follow(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    st = t.untyped_storage()
                    ptr = st.data_ptr()
                    prev = created.get(ptr)
                    # an allocator (CUDA's caching one) hands a freed block's address to the next tensor
                    if ptr not in param_ptrs and st.nbytes() and (prev is None or prev[0]() is None):
                        created[ptr] = (weakref.ref(st), st.nbytes())
            return out

    with autocast(device, precision), _Follow():
        out = run()
    out_ptr = out.untyped_storage().data_ptr()
    kept = sum(n for ptr, (ref, n) in created.items() if ptr != out_ptr and ref() is not None)
    del out
    return kept + x.numel() * 4  # the block input: the fp32 residual stream


def time_split_backward(block: nn.Module, x0: torch.Tensor, gy: torch.Tensor, device: torch.device,
                         precision: Precision, warmup: int, repeats: int) -> tuple[float, float]:
    """(input + weight gradient, weight gradient alone) seconds of one block's backward split as ZB-H1
    runs it (``stage_backward_input``, then ``stage_backward_weight``, no recompute): the split walks
    the graph twice, which costs more than one backward on a CPU."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    clock = time.thread_time if device.type == "cpu" else time.perf_counter
    leaf: list[torch.Tensor] = []
    weight: list[float] = []

    def forward() -> torch.Tensor:
        leaf[:] = [x0.detach().requires_grad_()]
        return run_block(block, leaf[0], "none")

    def split(y: torch.Tensor) -> None:
        groups = stage_backward_input([y], [gy], leaf, block.parameters())[1]
        sync(device)
        started = clock()
        stage_backward_weight(block.parameters(), groups)
        sync(device)
        weight.append(clock() - started)

    both = time_fwd_bwd(forward, split, device, precision, warmup, repeats)[1]
    return both, statistics.median(weight[warmup:]) if len(weight) > warmup else statistics.median(weight)
