"""Measure per-layer costs of a GPT on the local device and write them as a ``Profile``.

What is measured, for each (TP degree ``tp``, micro-batch size ``b``), one micro-batch at a time:

* one transformer block, forward and backward, under each activation recompute mode the
  planner may choose per stage (``recompute``: none, selective, full), run through
  ``hetrain.runtime.model.run_block`` exactly as ``GPT.forward`` runs it; the top-level
  ``block_backward_s`` is the profile's own mode (full with ``activation_recompute``, else none),
  for readers of older profiles;
* the embedding (token + position lookup and their sum) and the head (final LayerNorm, LM
  head and the loss), forward and backward;
* ``block_activation_bytes`` per mode: bytes one block keeps alive for backward for one
  micro-batch, its input included (``timing.kept_bytes``: the storages its forward creates that
  outlive it, which also sees selective recompute's cache). With full recompute that is just
  the block input (the checkpoint keeps it to recompute from).

How each is timed (medians of CPU seconds on CPU, back-to-back means on a GPU) and how the
kept bytes are counted is ``hetrain.profiling.timing``'s.

Tensor parallelism: for ``tp > 1`` the profiler times the shard ONE rank computes, on this
single device, with NO communication: a block whose attention has ``num_heads / tp`` heads
(``hidden_size / tp`` wide q/k/v, the output projection reading ``hidden_size / tp``) and
whose MLP is ``ffn_size / tp`` wide, the column/row split ``hetrain.runtime.parallelize.parallelize_stage``
applies. The all-reduces are added by the cost model from the cluster's links. The head is
split by vocabulary the same way: one rank's ``vocab_size / tp`` columns and its share of
``vocab_parallel_lm_loss``. The runtime splits the token embedding by vocabulary too, but
every rank still looks up every token (zeros for the other ranks' rows), so the lookup is
measured whole, once per micro-batch size.

Emulated GPU types (``emulate.slowdown`` on a CPU node): the runtime makes such a rank sleep
``(slowdown - 1)`` times each compute (and optimizer step) it just did, so they take
``slowdown`` times the measured time. The profiler predicts that by multiplying the measured
times by ``slowdown`` (it does not sleep); activation bytes are unchanged.

Precision: ``fp32`` runs plain fp32; ``bf16``/``fp16`` run forward under ``torch.autocast``
with that dtype (parameters stay fp32; ``timing.autocast``). Threads: whatever ``torch.set_num_threads`` the
caller left (CPU ranks of ``hetrain train`` run with ``threads_per_rank``, 1 by default).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from hetrain.errors import HetrainError
from hetrain.profiling.profile import Profile, ProfileEntry, RecomputeEntry, RuntimeOverheads
from hetrain.profiling.timing import DTYPES, Precision, kept_bytes, time_fwd_bwd, time_split_backward
from hetrain.runtime.model import final_norm, init_parameter, lm_loss, make_block, run_block
from hetrain.runtime.loss import vocab_parallel_lm_loss, vocab_shard
from hetrain.spec.arithmetic import block_params
from hetrain.spec.specs import RECOMPUTE_MODES, ClusterSpec, ModelSpec


# --------------------------------------------------------------------------- modules


def tp_valid(spec: ModelSpec, tp: int) -> bool:
    """Whether the runtime can split this model ``tp`` ways (tp divides hidden_size and num_heads)."""
    return spec.tp_divides(tp)


def shard_block(spec: ModelSpec, tp: int) -> nn.Module:
    """The part of one transformer block that one rank of a ``tp``-way TP group holds.

    q/k/v project to ``hidden_size / tp`` (``num_heads / tp`` heads; ``Attention`` derives the
    head count from that width), ``wo`` reads it back to ``hidden_size``; the MLP is
    ``ceil(ffn_size / tp)`` wide (the largest shard when ``tp`` does not divide it, as a
    DTensor shard on rank 0). LayerNorms stay whole, as in the runtime.
    """
    if not tp_valid(spec, tp):
        raise HetrainError(
            f"tp {tp} must divide {spec.split_sizes()} of {spec.name}"
        )
    block = make_block(spec)
    if tp > 1:
        h, bias = spec.hidden_size, bool(spec.qkv_bias)  # Qwen 2's q/k/v bias, split with its projection
        hs = (spec.q_size if spec.arch == "llama" else h) // tp
        ks, fs = spec.kv_size // tp, -(-spec.ffn_size // tp)
        attn, mlp = block.attn, block.mlp
        attn.wq = nn.Linear(h, hs, bias=bias)
        attn.wk, attn.wv = (nn.Linear(h, ks, bias=bias) for _ in range(2))  # kv_heads / tp heads (llama)
        attn.wo = nn.Linear(hs, h, bias=False)
        mlp.w1 = nn.Linear(h, fs, bias=False)
        if spec.arch == "llama":
            mlp.w3 = nn.Linear(h, fs, bias=False)
        mlp.w2 = nn.Linear(fs, h, bias=False)
    _init(block)
    return block


class _Embedding(nn.Module):
    """Token (+ learned position, GPT) embedding, computed as ``GPT.forward`` does."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.tok_embedding = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.pos_embedding = nn.Embedding(spec.seq_length, spec.hidden_size) if spec.arch == "gpt" else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embedding(ids)
        if self.pos_embedding is None:
            return x
        return x + self.pos_embedding(torch.arange(ids.shape[1], device=ids.device))


class _Head(nn.Module):
    """Final norm + untied LM head (one TP rank's vocabulary columns); the caller applies the loss."""

    def __init__(self, spec: ModelSpec, tp: int = 1) -> None:
        super().__init__()
        self.norm = final_norm(spec)
        self.head = nn.Linear(spec.hidden_size, vocab_shard(spec.vocab_size, tp, 0)[1], bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


@torch.no_grad()
def _init(module: nn.Module, seed: int = 0) -> None:
    """Same distribution as ``GPT.init_weights`` (the values only matter for realistic numerics)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in module.named_parameters():
        init_parameter(name, param, gen)


# --------------------------------------------------------------------------- public API


def _check_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_precision(precision: str) -> Precision:
    if precision not in DTYPES:
        raise HetrainError(f"precision: expected one of {', '.join(DTYPES)}, got {precision!r}")
    return precision  # type: ignore[return-value]


def _measure(
    spec: ModelSpec,
    tp: int,
    micro_batch_size: int,
    *,
    activation_recompute: bool,
    device: torch.device,
    precision: Precision,
    warmup: int,
    repeats: int,
    ends: tuple[float, float, float, float] | None = None,
) -> ProfileEntry:
    """One entry on the real device (slowdown 1). ``ends``: embed/head times already measured (this tp's head)."""
    b, s, h = micro_batch_size, spec.seq_length, spec.hidden_size
    gen = torch.Generator().manual_seed(1234 + 7 * b)

    # One transformer block (the TP shard of one rank), under each recompute mode.
    block = shard_block(spec, tp).to(device)
    x0 = (torch.randn(b, s, h, generator=gen)).to(device)
    gy = (torch.randn(b, s, h, generator=gen) * 1e-3).to(device)
    per_mode: dict[str, tuple[float, float, int]] = {}
    for mode in RECOMPUTE_MODES:
        def block_fwd(mode=mode) -> torch.Tensor:
            # A fresh leaf each run, like a received stage input: its gradient is computed too.
            return run_block(block, x0.detach().requires_grad_(), mode)

        fwd_s, bwd_s = time_fwd_bwd(block_fwd, lambda y: y.backward(gy), device, precision, warmup, repeats)
        per_mode[mode] = (fwd_s, bwd_s, kept_bytes(block_fwd, block.parameters(), x0, device, precision))
    split_s, weight_s = time_split_backward(block, x0, gy, device, precision, warmup, repeats)
    del block
    own = "full" if activation_recompute else "none"
    block_fwd_s = per_mode["none"][0]  # the forward every mode runs (selective's policy adds its own dispatch)
    # a mode's extra forward cost (selective's dispatch) is charged to its backward; never less than
    # the backward itself (on a loaded machine the modes' forwards may time in the wrong order)
    recompute = {mode: RecomputeEntry(block_backward_s=max(f + b_ - block_fwd_s, b_), block_activation_bytes=kept)
                 for mode, (f, b_, kept) in per_mode.items()}
    block_bwd_s = recompute[own].block_backward_s
    act_bytes = recompute[own].block_activation_bytes

    if ends is None:
        ends = _measure_ends(spec, b, device=device, precision=precision, warmup=warmup, repeats=repeats,
                             tps=[tp])[tp]
    embed_fwd_s, embed_bwd_s, head_fwd_s, head_bwd_s = ends
    return ProfileEntry(
        tp=tp,
        micro_batch_size=b,
        block_forward_s=block_fwd_s,
        block_backward_s=block_bwd_s,
        embed_forward_s=embed_fwd_s,
        embed_backward_s=embed_bwd_s,
        head_forward_s=head_fwd_s,
        head_backward_s=head_bwd_s,
        block_activation_bytes=act_bytes,
        recompute=recompute,
        block_split_backward_s=split_s,
        block_weight_backward_s=weight_s,
    )


def _measure_ends(
    spec: ModelSpec, b: int, *, device: torch.device, precision: Precision, warmup: int, repeats: int,
    tps: Iterable[int] = (1,),
) -> dict[int, tuple[float, float, float, float]]:
    """Per TP degree: embedding and head (norm + LM head + loss) forward/backward seconds for one micro-batch.

    The embedding is the same whole lookup at every ``tp`` (measured once); the head is one
    rank's vocabulary shard with its part of the split loss (``vocab_parallel_lm_loss`` without
    the collectives, which the cost model adds), the whole head and ``lm_loss`` at tp 1.
    """
    s, h, V = spec.seq_length, spec.hidden_size, spec.vocab_size
    gen = torch.Generator().manual_seed(4321 + 7 * b)
    ids = torch.randint(V, (b, s), generator=gen).to(device)
    targets = torch.randint(V, (b, s), generator=gen).to(device)

    embed = _Embedding(spec)
    _init(embed)
    embed.to(device)
    g_embed = (torch.randn(b, s, h, generator=gen) * 1e-3).to(device)
    embed_fwd_s, embed_bwd_s = time_fwd_bwd(
        lambda: embed(ids), lambda y: y.backward(g_embed), device, precision, warmup, repeats
    )
    del embed

    x0 = torch.randn(b, s, h, generator=gen).to(device)
    ends = {}
    for tp in sorted(set(tps)):
        head = _Head(spec, tp)
        _init(head)
        head.to(device)

        def head_fwd(head=head, tp=tp) -> torch.Tensor:
            logits = head(x0.detach().requires_grad_())
            return lm_loss(logits, targets) if tp == 1 else vocab_parallel_lm_loss(logits, targets, 0, None)

        head_fwd_s, head_bwd_s = time_fwd_bwd(head_fwd, lambda loss: loss.backward(), device, precision, warmup,
                                               repeats)
        del head
        ends[tp] = (embed_fwd_s, embed_bwd_s, head_fwd_s, head_bwd_s)
    return ends


def profiling_bytes(spec: ModelSpec, b: int) -> float:
    """A lower bound on what profiling micro-batch ``b`` holds at once (the head's step dominates).

    The LM head's fp32 weight and gradient, its input, the logits and their gradient (softmax
    keeps one more copy), and one unsharded block's weights, gradients and saved activations.
    """
    s, h, V = spec.seq_length, spec.hidden_size, spec.vocab_size
    head = 4.0 * (2 * V * h + 2 * b * s * h + 3 * b * s * V)
    block = 4.0 * (2 * block_params(spec) + b * s * (6 * h + 2 * spec.ffn_size))
    return max(head, block)


def available_bytes(device: torch.device) -> float:
    """Free memory on ``device``: the CUDA allocator's free bytes, or the machine's MemAvailable on CPU."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


def _check_fits(spec: ModelSpec, mbs: list[int], device: torch.device) -> None:
    """Refuse sizes that would exhaust the device before starting (the kernel's OOM killer is no error message)."""
    free = available_bytes(device)
    for b in mbs:
        need = profiling_bytes(spec, b)
        if need > free:
            raise HetrainError(f"micro-batch size {b}: profiling {spec.name} at it needs at least {need / 1e9:.1f} GB, "
                               f"{device.type} has {free / 1e9:.1f} GB free; choose smaller micro-batch sizes")


def _scaled(entry: ProfileEntry, slowdown: float) -> ProfileEntry:
    if slowdown == 1.0:
        return entry.model_copy()
    times = {
        k: getattr(entry, k) * slowdown
        for k in ("block_forward_s", "block_backward_s", "embed_forward_s", "embed_backward_s",
                  "head_forward_s", "head_backward_s")
    }
    times |= {k: getattr(entry, k) * slowdown for k in ("block_split_backward_s", "block_weight_backward_s")
              if getattr(entry, k) is not None}
    times["recompute"] = {mode: r.model_copy(update={"block_backward_s": r.block_backward_s * slowdown})
                          for mode, r in entry.recompute.items()}
    return entry.model_copy(update=times)


OVERHEADS_TIMEOUT_S = 600  # about 5 s on a CPU here; a wedged device must not hang profiling


def _overheads(device: torch.device, precision: Precision) -> RuntimeOverheads:
    """The runtime's overheads (``hetrain.profiling.overheads``), measured in a fresh process with this one's threads.

    Its own process: it needs a process group, and it runs the trainer, which the control
    plane that calls the profiler (CLI, flows) never imports.
    """
    import os
    import subprocess
    import sys

    argv = [sys.executable, "-m", "hetrain.profiling.overheads", "--device", str(device), "--precision", precision,
            "--threads", str(torch.get_num_threads())]
    env = None
    if device.type == "cuda" and device.index:  # the child sees only this device, as its cuda:0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible.split(",")[device.index] if visible else str(device.index)}
    try:
        result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=OVERHEADS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise HetrainError(f"measuring the runtime's overheads took over {OVERHEADS_TIMEOUT_S} s") from None
    out = result.stdout.strip().splitlines()
    if result.returncode != 0 or not out:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise HetrainError(f"measuring the runtime's overheads failed: {last}")
    return RuntimeOverheads.model_validate_json(out[-1])


def scale_profile(profile: Profile, factors: dict[str, float]) -> Profile:
    """The profile with each GPU type's compute times multiplied by ``factors[type]`` (absent: 1).

    For what-if predictions: a type whose devices ran at another speed than profiled (a
    benchmark's diagnosis of how much of a prediction's error is the devices' speed).
    """
    return profile.model_copy(update={"devices": {
        gpu: [_scaled(e, factors.get(gpu, 1.0)) for e in entries] for gpu, entries in profile.devices.items()}})


def profile_entry(
    spec: ModelSpec,
    tp: int,
    micro_batch_size: int,
    *,
    activation_recompute: bool,
    device: torch.device,
    slowdown: float = 1.0,
    warmup: int = 2,
    repeats: int = 5,
    precision: Precision = "fp32",
) -> ProfileEntry:
    """Measure one ``ProfileEntry``: the TP shard of one rank, one micro-batch, no communication.

    Times are medians over ``repeats`` runs after ``warmup`` runs, multiplied by ``slowdown``
    (the compute stretch the runtime applies to emulated CPU devices by sleeping
    ``(slowdown - 1)`` times each compute; no sleeping here). ``block_activation_bytes`` is
    what one block keeps for backward per in-flight micro-batch (just its input under
    ``activation_recompute``). See the module docstring for details.
    """
    if micro_batch_size < 1:
        raise HetrainError(f"micro-batch size: expected an integer >= 1, got {micro_batch_size}")
    if not slowdown > 0:
        raise HetrainError(f"slowdown: expected a positive number, got {slowdown}")
    if warmup < 0 or repeats < 1:
        raise HetrainError(f"expected warmup >= 0 and repeats >= 1, got warmup {warmup}, repeats {repeats}")
    entry = _measure(
        spec, tp, micro_batch_size, activation_recompute=activation_recompute, device=_check_device(device),
        precision=_check_precision(precision), warmup=warmup, repeats=repeats,
    )
    return _scaled(entry, slowdown)


def profile_model(
    spec: ModelSpec,
    *,
    gpus: dict[str, float],
    micro_batch_sizes: Iterable[int],
    tp_degrees: Iterable[int],
    activation_recompute: bool = True,
    precision: Precision = "fp32",
    device: torch.device | str | None = None,
    progress: Callable[[int, int], None] | None = None,
    warmup: int = 2,
    repeats: int = 5,
    overheads: bool = True,
) -> Profile:
    """Profile ``spec`` on the local device for every (tp, micro-batch size), under each GPU type.

    ``gpus`` maps the GPU type name to write entries under to its slowdown factor (1.0 for
    the real device; ``gpus_from_cluster`` reads them from a cluster's ``emulate`` settings).
    Each (tp, b) is measured once, on ``device`` (default: the current CUDA device, else CPU);
    every type's entry is that measurement with times multiplied by its slowdown.

    TP degrees that do not divide ``hidden_size`` and ``num_heads`` are skipped (the runtime
    cannot run them; the cost model falls back to FLOP estimates there); if none is left this
    raises ``HetrainError``. ``progress(done, total)`` is called after each measurement.
    With ``overheads``, the runtime's own costs are measured too (``hetrain.profiling.overheads``,
    a few seconds) and filed under every type: they are the host's, which emulation does not slow.
    """
    mbs, tps = _check_request(spec, gpus, micro_batch_sizes, tp_degrees, warmup, repeats)
    dev = _check_device(device)
    prec = _check_precision(precision)
    _check_fits(spec, mbs, dev)

    total, done = len(tps) * len(mbs), 0
    devices: dict[str, list[ProfileEntry]] = {name: [] for name in gpus}
    for b in mbs:
        ends = _measure_ends(spec, b, device=dev, precision=prec, warmup=warmup, repeats=repeats, tps=tps)
        for t in tps:
            entry = _measure(
                spec, t, b, activation_recompute=activation_recompute, device=dev, precision=prec,
                warmup=warmup, repeats=repeats, ends=ends[t],
            )
            for name, slowdown in gpus.items():
                devices[name].append(_scaled(entry, slowdown))
            done += 1
            if progress is not None:
                progress(done, total)
    for entries in devices.values():
        entries.sort(key=lambda e: (e.tp, e.micro_batch_size))
    runtime = _runtime_overheads(gpus, dev, prec) if overheads else {}
    return Profile(model=spec, precision=prec, activation_recompute=activation_recompute, devices=devices,
                   runtime=runtime, head_split=True)


def _check_request(spec: ModelSpec, gpus: dict[str, float], micro_batch_sizes: Iterable[int],
                   tp_degrees: Iterable[int], warmup: int, repeats: int) -> tuple[list[int], list[int]]:
    """The micro-batch sizes and the TP degrees the runtime can run, sorted; HetrainError naming what is wrong."""
    if not gpus:
        raise HetrainError("expected at least one GPU type to profile")
    for name, slowdown in gpus.items():
        if not slowdown > 0:
            raise HetrainError(f"GPU type '{name}': slowdown: expected a positive number, got {slowdown}")
    mbs = sorted(set(micro_batch_sizes))
    if not mbs or mbs[0] < 1:
        raise HetrainError(f"micro-batch sizes: expected integers >= 1, got {mbs}")
    requested = sorted(set(tp_degrees))
    tps = [t for t in requested if tp_valid(spec, t)]
    if not tps:
        raise HetrainError(
            f"no TP degree among {', '.join(map(str, requested)) or '(none)'} divides {spec.split_sizes()} of "
            f"{spec.name}"
        )
    if warmup < 0 or repeats < 1:
        raise HetrainError(f"expected warmup >= 0 and repeats >= 1, got warmup {warmup}, repeats {repeats}")
    return mbs, tps


def _runtime_overheads(gpus: dict[str, float], dev: torch.device, prec: Precision) -> dict[str, RuntimeOverheads]:
    """The runtime's own costs, measured once and filed under every type. DTensor's dispatch runs inside the stage's
    forward and backward, which emulation stretches, and so does the optimizer step (the device's own work,
    ``StageMeter.device_work``): those two scale by the type's slowdown."""
    measured = _overheads(dev, prec)
    return {name: measured.model_copy(update={
        "tp_block_s": measured.tp_block_s * slowdown,
        "optimizer_s_per_param": (measured.optimizer_s_per_param * slowdown
                                  if measured.optimizer_s_per_param is not None else None)})
        for name, slowdown in gpus.items()}


def gpus_from_cluster(cluster: ClusterSpec) -> dict[str, float]:
    """GPU type -> emulated slowdown of its nodes (1.0 where a node has no ``emulate``).

    Raises ``HetrainError`` when nodes of one type are emulated with different slowdowns (one
    profile entry per type cannot describe both). Emulation only applies to CPU runs: when
    profiling on a GPU, the runtime ignores ``emulate`` and so should the caller.
    """
    seen: dict[str, dict[float, list[str]]] = {}
    for node in cluster.nodes:
        slowdown = node.emulate.slowdown if node.emulate is not None else 1.0
        seen.setdefault(node.gpu, {}).setdefault(slowdown, []).append(node.name)
    out: dict[str, float] = {}
    for gpu, by_slowdown in seen.items():
        if len(by_slowdown) > 1:
            detail = "; ".join(f"{', '.join(nodes)}: {s:g}" for s, nodes in sorted(by_slowdown.items()))
            raise HetrainError(
                f"{cluster.name}: nodes of GPU type '{gpu}' are emulated with different slowdowns ({detail}); "
                "give each slowdown its own GPU type"
            )
        (out[gpu],) = by_slowdown
    return out
