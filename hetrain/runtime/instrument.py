"""Per-stage compute timing, CPU emulation of slower GPUs, and a memory meter with a budget.

All three hook into a stage module from outside (forward hooks plus two identity autograd
functions that mark where the stage's backward starts and ends), so the model stays plain.

* Timing: forward and backward seconds of each micro-batch, summed per step.
* Emulated slowdown (``emulate.slowdown`` on a CPU node): each forward and backward (and the
  optimizer step, ``device_work``) is stretched to ``slowdown`` times the CPU time the rank's
  thread spent on it, by sleeping for whatever of that the wall clock has not already used.
  Counting CPU time rather than wall time makes the emulated device's speed independent of how
  many other emulated devices share this machine's cores: a rank that waited for a core has
  already spent part of its budget waiting, and sleeps less. The emulation is exact as long as every rank gets at least
  ``1 / slowdown`` of a core (cpu-emulated.yaml needs 1.5 of the 2 cores here).
* Memory: model states (parameters, gradients, optimizer state; exact, from the tensors) plus
  the activations saved for backward that are alive (tracked through saved-tensor hooks,
  de-duplicated by storage). On CPU there is no allocator to ask; on GPUs the meter reads
  ``torch.cuda.max_memory_allocated`` instead. Crossing ``memory_budget_gb`` raises
  ``DeviceOutOfMemory`` naming the device, which ends the whole job instead of hanging it.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from hetrain.errors import HetrainError
from hetrain.spec.specs import GB

# The phases of a step a traced rank reports a peak for, in order (``AllocationTracker.enter_phase``)
TRACED_PHASES = ("forward-backward", "sync", "step")


OP_KINDS = ("F", "B", "W")  # forward, backward (its input-gradient part under ZB-H1), weight gradient


class DeviceOutOfMemory(HetrainError):
    pass


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


class _OnBackward(torch.autograd.Function):
    """Identity in forward; calls ``callback`` when backward passes this point (the stage's output: backward
    starts; its input: backward is done)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, callback: Callable[[], None]) -> torch.Tensor:
        ctx.callback = callback
        # the same storage, not a view of it: ZB-H1's split backward detaches the stage's output in
        # place once its input gradient is out (``stage_backward_input``), which a view refuses
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.callback()
        return grad, None


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage a tensor's bytes live in (a DTensor's: its local shard's); None for meta tensors."""
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    return None if local.device.type == "meta" else local.untyped_storage()


class StageMeter:
    def __init__(
        self,
        module: nn.Module,
        device_name: str,
        *,
        slowdown: float = 1.0,
        memory_budget_gb: float | None = None,
        count_saved: bool = True,
        watched: list[nn.Module] | None = None,
    ) -> None:
        self.module = module
        # Saved-tensor hooks make autograd keep what they packed until the graph is destroyed
        # (the schedule holds the last output's graph until the next forward): one micro-batch
        # of activations more. Only CPU ranks, which have no allocator to ask, count this way.
        self.count_saved = count_saved
        self.device_name = device_name
        self.slowdown = slowdown
        self.memory_budget_gb = memory_budget_gb
        self.compute_s = 0.0  # this step, including the emulated slowdown
        self.forward_s = 0.0
        self.backward_s = 0.0
        self.state_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, list[int]] = {}  # storage ptr -> [bytes, tensors of it saved and not yet used]
        self._live_bytes = 0
        self._param_ptrs: set[int] = set()
        self._forward_started = (0.0, 0.0)  # (wall, thread CPU) seconds
        self._backward_started: tuple[float, float] | None = None
        self._saved_ctx: torch.autograd.graph.saved_tensors_hooks | None = None
        # while a step is recorded (``record_timeline``): [kind, micro-batch, start, end] per op, wall-clock s
        self._events: list[list] | None = None
        self._ops_seen: dict[str, int] = {}  # ops of each kind so far in the recorded step (``record_timeline``)
        for stage in watched or [module]:
            self._watch(stage)

    def _watch(self, stage: nn.Module) -> None:
        """Time and count the forwards and backwards of ``stage``, one the rank runs (an interleaved rank runs
        several chunk views of ``module``, one at a time)."""
        stage.register_forward_pre_hook(self._pre_forward)
        stage.register_forward_hook(self._post_forward)
        embedding = getattr(stage, "tok_embedding", None)
        if embedding is not None:  # the first stage's input is token ids: mark the end on the embedding output
            embedding.register_forward_hook(lambda _m, _a, out: _OnBackward.apply(out, self._backward_done))

    # -- memory
    def set_model_states(self, optimizer_state_factor: float) -> None:
        """Bytes of parameters + gradients + optimizer state, before the first step allocates them."""
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.module.parameters()]
        self._param_ptrs = {t.untyped_storage().data_ptr() for t in local}
        param_bytes = sum(t.numel() * t.element_size() for t in local)
        self.state_bytes = int(param_bytes * (2 + optimizer_state_factor))
        self.peak_bytes = max(self.peak_bytes, self.state_bytes)
        self._check("for parameters, gradients and optimizer state")

    def _check(self, what: str) -> None:
        if self.memory_budget_gb is None:
            return
        used = self.state_bytes + self._live_bytes
        if used > self.memory_budget_gb * GB:
            raise DeviceOutOfMemory(
                f"device {self.device_name} is out of memory: needs {used / GB:.3f} GB {what}, "
                f"its budget is {self.memory_budget_gb:g} GB"
            )

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        """Count a saved tensor's storage from forward until backward has used it.

        Released when backward unpacks it, which is when autograd would free it without these
        hooks: the count is what a GPU holds, not what the hooks make this process hold.
        """
        storage = _storage(t)
        if storage is None or storage.data_ptr() in self._param_ptrs:
            return t
        ptr = storage.data_ptr()
        entry = self._live.get(ptr)
        if entry is None:
            self._live[ptr] = [storage.nbytes(), 1]
            self._live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.state_bytes + self._live_bytes)
        else:
            entry[1] += 1
        return t

    def saved_tensor_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks that count saved tensors, as a context manager (a CPU rank's forward runs inside them;
        the profiler times blocks inside them too, since they cost a CPU rank's compute time)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        storage = _storage(t)
        entry = self._live.get(storage.data_ptr()) if storage is not None else None
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self._live_bytes -= entry[0]
                del self._live[storage.data_ptr()]
        return t

    # -- timing and slowdown
    def _pre_forward(self, _module: nn.Module, args: tuple) -> tuple | None:
        self._forward_started = _now()
        if self.count_saved:
            self._saved_ctx = self.saved_tensor_hooks()
            self._saved_ctx.__enter__()
        x = args[0]
        if torch.is_grad_enabled() and x.is_floating_point() and x.requires_grad:
            return (_OnBackward.apply(x, self._backward_done), *args[1:])
        return None

    def _post_forward(self, _module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        if self._saved_ctx is not None:
            self._saved_ctx.__exit__(None, None, None)
            self._saved_ctx = None
        took_s = self._stretch(self._forward_started)
        self.forward_s += took_s
        self._event("F", took_s)
        self._check("for activations in flight")
        if torch.is_grad_enabled() and out.requires_grad:
            out = _OnBackward.apply(out, self._backward_begin)
        return out

    def _backward_begin(self) -> None:
        self._backward_started = _now()

    def _backward_done(self) -> None:
        if self._backward_started is None:
            return
        took_s = self._stretch(self._backward_started)
        self.backward_s += took_s
        self._event("B", took_s)
        self._backward_started = None

    @contextlib.contextmanager
    def device_work(self) -> Iterator[None]:
        """Work the device does outside forward and backward (the optimizer step), stretched like them.

        On a GPU the optimizer runs on the GPU; on an emulated one it must run at the emulated
        speed too, or four ranks stepping at once on two cores wait for each other, which the
        profile (one process) cannot see.
        """
        started = _now()
        yield
        self._stretch(started)

    @contextlib.contextmanager
    def weight_work(self) -> Iterator[None]:
        """A backward's weight-gradient part run on its own (ZB-H1's W, ``hetrain.runtime.pipeline``):
        backward time, stretched like the rest (the hooks see only a backward that crosses the stage's input)."""
        started = _now()
        yield
        took_s = self._stretch(started)
        self.backward_s += took_s
        self._event("W", took_s)

    # -- the measured timeline of one step
    def record_timeline(self) -> None:
        """Record when each forward and backward of the next step runs (``take_timeline``)."""
        self._events = []
        self._ops_seen = dict.fromkeys(OP_KINDS, 0)

    def take_timeline(self) -> list[list]:
        """The recorded step's ops, [kind, micro-batch, start, end] in wall-clock (epoch) seconds; stops recording.

        Epoch seconds, not this process's monotonic clock: the ranks of other nodes write theirs
        too, and the picture lines them up (to NTP's precision across machines).
        """
        events, self._events = self._events or [], None
        return events

    def _event(self, kind: str, took_s: float) -> None:
        """An op that just ended, numbered in its kind's order: every schedule here runs the forwards,
        the backwards and the weight gradients of a stage each in micro-batch order."""
        if self._events is None:
            return
        end = time.time()
        self._events.append([kind, self._ops_seen[kind], end - took_s, end])
        self._ops_seen[kind] += 1

    def _stretch(self, started: tuple[float, float]) -> float:
        """Wall seconds since ``started``, after sleeping up to ``slowdown`` x the CPU seconds used."""
        wall_s, cpu_s = time.perf_counter() - started[0], time.thread_time() - started[1]
        if self.slowdown > 1.0:
            target_s = self.slowdown * cpu_s
            if target_s > wall_s:
                time.sleep(target_s - wall_s)
                return target_s
        return wall_s

    def take_step_stats(self) -> dict[str, float]:
        """This step's compute seconds and the peak memory so far; resets the step counters."""
        stats = {"forward_s": self.forward_s, "backward_s": self.backward_s,
                 "compute_s": self.forward_s + self.backward_s, "peak_memory_gb": self.peak_gb()}
        self.forward_s = self.backward_s = 0.0
        return stats

    def peak_gb(self) -> float:
        if torch.cuda.is_available() and next(self.module.parameters()).is_cuda:
            return torch.cuda.max_memory_allocated() / GB
        return self.peak_bytes / GB


class AllocationTracker:
    """Peak bytes of tensor storage a rank holds, counted like a device allocator would on a CPU rank.

    ``torch.cuda.max_memory_allocated`` answers this on GPUs; a CPU has no allocator to ask, so
    this dispatch mode sees every op's outputs, counts each new storage once (DTensors by
    their local shard) and forgets it when the storage is freed (storages keep their Python
    object, so a weak reference follows the C++ lifetime). It counts what the meter above
    cannot see: gradients being formed, activations recomputed in backward, logits, pipeline
    buffers, optimizer temporaries. ``baseline`` (the parameters and whatever state exists before
    tracking starts) is counted once in every reading, by storage: a view of a parameter that an
    op returns (the transpose a linear layer takes of its weight) is not a new allocation, and
    counting it as one added a second copy of every weight. Opt-in (``RunConfig.trace_memory``):
    a Python call per op slows a CPU rank down.

    Each step's phases (``TRACED_PHASES``: forward and backward, the gradient sync, the optimizer
    step) keep their own peak (``phase_peak_bytes``), because each holds different transients on
    top of the model states (activations; the sync's flat bucket; the step's temporaries) and the
    cost model prices them as alternatives, not a sum.
    """

    def __init__(self, baseline: list[torch.Tensor]) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        for t in baseline:  # never freed while the rank trains: no finalizer
            storage = _storage(t)
            if storage is not None:
                self._seen[storage] = storage.nbytes()
        self.baseline_bytes = sum(self._seen.values())
        self.live_bytes = 0
        self.peak_bytes = self.baseline_bytes
        self.phase: str | None = None
        self.phase_peak_bytes: dict[str, int] = {}

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._record(out)
                return out

        self.mode = _Mode()

    def _record(self, out) -> None:
        for t in tree_leaves(out):
            storage = _storage(t) if isinstance(t, torch.Tensor) else None
            if storage is None or storage in self._seen:
                continue
            nbytes = storage.nbytes()
            self._seen[storage] = nbytes
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.baseline_bytes + self.live_bytes)
            if self.phase is not None:
                self.phase_peak_bytes[self.phase] = max(self.phase_peak_bytes[self.phase],
                                                        self.baseline_bytes + self.live_bytes)
            weakref.finalize(storage, self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def enter_phase(self, phase: str) -> None:
        """Count what follows toward ``phase``'s peak (starting from what is live now)."""
        self.phase = phase
        self.phase_peak_bytes[phase] = max(self.phase_peak_bytes.get(phase, 0), self.baseline_bytes + self.live_bytes)

    def __enter__(self) -> AllocationTracker:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)
