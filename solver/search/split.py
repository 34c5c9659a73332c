"""Layer splits: how many blocks each stage of a pipeline holds, and in which mode.

A stage of k blocks takes its fixed time plus k times its mode's seconds per block, within what that mode's
memory holds. The split minimises the pipeline's bottleneck stage time, ties broken towards less total work
(``split_layers_modes``); ``split_layers_batch`` gives the same answers for many pipelines at once in numpy, which
is how the templates of a space are built (``solver.search.templates``).
"""

from __future__ import annotations

import heapq
import math

import numpy as np

# re-estimates of split_layers_modes' bulk threshold (each re-reads the per-block seconds at the
# block counts the last one implies): on the benchmark templates two leave ~4 of ~34 blocks to the heap
BULK_REFINES = 2


def split_layers(
    num_layers: int, block_s: list[float], extra_s: list[float], max_blocks: list[int]
) -> list[int] | None:
    """Blocks per stage minimising max_k(n_k block_s[k] + extra_s[k]) with 1 <= n_k <= max_blocks[k]."""
    found = split_layers_modes(num_layers, [[(b, c)] for b, c in zip(block_s, max_blocks)], extra_s)
    return None if found is None else found[0]


def _stage_table(opts: list[tuple[float, int]], limit: int) -> tuple[list[float], list[tuple[float, int]]]:
    """One stage's modes with their block limits capped at ``limit``, and per block count n the
    seconds per block of the fastest mode holding n (inf where none does)."""
    modes = [(b, min(max(c, 0), limit)) for b, c in opts]
    per_block, filled = [math.inf] * (limit + 2), 0
    for b, c in sorted(modes):  # fastest first: it serves every count it holds that no faster mode does
        if c > filled:
            per_block[filled + 1:c + 1] = [b] * (c - filled)
            filled = c
    return per_block, modes


def split_layers_modes(
    num_layers: int, options: list[list[tuple[float, int]]], extra_s: list[float],
    tables: dict | None = None,
) -> tuple[list[int], list[int]] | None:
    """Blocks and a mode per stage minimising the slowest stage, each stage within its mode's memory.

    ``options[k]`` lists stage k's modes as (seconds per block, most blocks that fit). Stage k
    holding n blocks takes f_k(n) = extra_s[k] + n x (the fastest mode that holds n), which
    never falls as n grows, so handing out blocks one at a time, each to the stage it leaves
    fastest, takes the L smallest values of the merged sequences: its largest is the least
    bottleneck ``tau`` any split reaches. (This replaced a binary search over every candidate
    value in numpy, which gave the same splits 1.8x slower on templates of a few stages.) At
    ``tau`` each stage then takes as many blocks as its best mode allows, surplus blocks go
    back from the slowest stages (least total work), and each stage runs the fastest mode that
    holds what it kept. Returns (blocks, mode index per stage), or None when the stages cannot
    hold the model.

    The hand-out goes in two steps with the same result as one block at a time: every value
    below a threshold ``v0`` (the continuous balance point, one block lower) is taken at
    once when they number at most the blocks to hand out, since one at a time takes them all
    before any other value; a heap hands out the few left. ``tables``: a cache of the
    per-stage tables (``_stage_table``) across calls with the same options.
    """
    S, L = len(options), num_layers
    if S == 0 or S > L:
        return None
    most = [max(c for _, c in opts) for opts in options]
    if min(most) < 1 or sum(most) < L:
        return None
    limit = L - S + 1  # no stage holds more than L - (S - 1) blocks (every other holds one)
    fastest, modes = _stage_tables(options, limit, tables)
    tau = max(fastest[k][1] + extra_s[k] for k in range(S))  # every stage holds a block
    if tau == math.inf:
        return None
    handed = _hand_out(fastest, extra_s, L - S, limit, tau)
    if handed is None:
        return None
    held, tau = handed
    return _split_at(options, modes, extra_s, held, tau, L)


def _stage_tables(options: list[list[tuple[float, int]]], limit: int,
                  tables: dict | None) -> tuple[list[list[float]], list[list[tuple[float, int]]]]:
    """Per stage ``_stage_table`` (fastest[k][n]: seconds per block of stage k's fastest mode holding n blocks, and
    its modes capped at ``limit``), from the cache ``tables`` where given."""
    fastest, modes = [], []
    for opts in options:
        if tables is None:
            found = _stage_table(opts, limit)
        else:
            key = (tuple(opts), limit)
            found = tables.get(key)
            if found is None:
                found = tables[key] = _stage_table(opts, limit)
        fastest.append(found[0])
        modes.append(found[1])
    return fastest, modes


def _hand_out(fastest: list[list[float]], e: list[float], need: int, limit: int,
              tau: float) -> tuple[list[int], float] | None:
    """The blocks each stage holds once ``need`` more than one each are handed out, one at a time to the stage it
    leaves fastest, and the bottleneck ``tau`` that reaches; None where the stages cannot hold them. Below the
    balance point in bulk (``_bulk``) where that hands out no more than ``need``, the few left from a heap."""
    S = len(fastest)
    held = [1] * S
    if need > S and min(f[1] for f in fastest) > 0:
        bulk = _bulk(fastest, e, need, limit)
        if sum(bulk) - S <= need:
            for k in range(S):
                if bulk[k] > 1:
                    tau = max(tau, bulk[k] * fastest[k][bulk[k]] + e[k])
            need -= sum(bulk) - S
            held = bulk
    if need:
        offers = [((held[k] + 1) * fastest[k][held[k] + 1] + e[k], k) for k in range(S)]
        heapq.heapify(offers)
        for _ in range(need):
            value, k = heapq.heappop(offers)
            if value == math.inf:
                return None
            held[k] += 1
            tau = max(tau, value)
            n = held[k] + 1
            heapq.heappush(offers, (n * fastest[k][n] + e[k], k))
    return held, tau


def _bulk(fastest: list[list[float]], e: list[float], need: int, limit: int) -> list[int]:
    """Per stage the largest n (at least 1) with f_k(n) below the threshold ``v0``: the blocks one at a time would
    hand it before any value at ``v0`` or above.

    A stage holding about n blocks at b seconds each takes (v - e_k) / b - 1 more blocks below v: ``v0`` is the v
    where they add up to ``need``, with b re-read at the counts it implies (``BULK_REFINES`` times)."""
    per_block = [f[1] for f in fastest]
    for _ in range(BULK_REFINES + 1):
        v0 = (need + sum(1 + ek / b for ek, b in zip(e, per_block))) / sum(1 / b for b in per_block)
        guess = [min(limit, max(1, int((v0 - ek) / b))) for ek, b in zip(e, per_block)]
        per_block = [fastest[k][n] if fastest[k][n] < math.inf else per_block[k] for k, n in enumerate(guess)]
    bulk = []
    for k in range(len(fastest)):  # walking from the guess
        pb, ek, n = fastest[k], e[k], guess[k]
        while n > 1 and n * pb[n] + ek >= v0:
            n -= 1
        while n < limit and (n + 1) * pb[n + 1] + ek < v0:
            n += 1
        bulk.append(n)
    return bulk


def _split_at(options: list[list[tuple[float, int]]], modes: list[list[tuple[float, int]]], e: list[float],
              held: list[int], tau: float, num_layers: int) -> tuple[list[int], list[int]]:
    """The split at the bottleneck ``tau``: each stage takes as many blocks as its best mode holds within it, the
    surplus goes back from the slowest stages (least total work), and each stage runs the fastest mode that holds
    what it kept. (blocks, mode index) per stage."""
    S = len(options)
    at_tau = []  # per stage: the most blocks a mode holds within tau (ties to the least recompute), its per-block s
    for k in range(S):
        ek = e[k]
        takes = [c if b <= 0 else min(c, math.floor((tau - ek) / b + 1e-9)) for b, c in modes[k]]
        i = takes.index(max(takes))
        # never fewer than the greedy pass handed out (it fits within tau; rounding may say one less)
        at_tau.append((max(takes[i], held[k]), modes[k][i][0]))
    n = [blocks for blocks, _ in at_tau]
    surplus = sum(n) - num_layers
    for k in sorted(range(S), key=lambda k: -at_tau[k][1]):
        give = min(surplus, n[k] - 1)
        n[k] -= give
        surplus -= give
    chosen = []
    for k in range(S):
        best_i, best_b = -1, math.inf
        for i, (b, c) in enumerate(options[k]):
            if c >= n[k] and b < best_b:
                best_i, best_b = i, b
        chosen.append(best_i)
    return n, chosen


def split_layers_batch(
    num_layers: int, jobs: list[tuple[list[list[tuple[float, int]]], list[float]]]
) -> list[tuple[list[int], list[int]] | None]:
    """``split_layers_modes(num_layers, options, extra_s)`` for each (options, extra_s), in numpy, same answers.

    Jobs of the same depth (and modes per stage) are solved together. The one-block-at-a-time
    hand-out takes the ``need = L - S`` smallest values f_k(n), n >= 2, in (value, stage) order;
    at once: the need-th smallest value t (a partition) bounds them, every value below t is
    taken, and of the values equal to t the first stages take what is left (the heap pops
    equal values stage by stage). The rest is split_layers_modes' arithmetic elementwise, in
    the same order, so the same floats.
    """
    L = num_layers
    out: list = [None] * len(jobs)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (options, _) in enumerate(jobs):
        widths = {len(o) for o in options}
        if len(widths) != 1 or not options:  # stages with different numbers of modes: one by one
            out[i] = split_layers_modes(L, options, jobs[i][1])
            continue
        groups.setdefault((len(options), widths.pop()), []).append(i)
    for (S, _), idx in groups.items():
        if S > L:
            continue
        for i, found in zip(idx, _split_group(jobs, idx, S, L)):
            out[i] = found
    return out


def _split_group(jobs: list[tuple[list[list[tuple[float, int]]], list[float]]], idx: list[int], S: int,
                 L: int) -> list[tuple[list[int], list[int]] | None]:
    """``split_layers_batch`` for its jobs ``idx``, all of S stages with as many modes each: ``split_layers_modes``'
    arithmetic elementwise over the jobs, in the same order, so the same floats."""
    opt = np.array([jobs[i][0] for i in idx], dtype=float)  # (N, S, modes, 2)
    B, C = opt[..., 0], opt[..., 1]
    e = np.array([jobs[i][1] for i in idx], dtype=float)  # (N, S)
    ok = (C.max(axis=2) >= 1).all(axis=1) & (C.max(axis=2).sum(axis=1) >= L)
    limit = L - S + 1
    cap = np.minimum(np.maximum(C, 0), limit)
    n = np.arange(1, limit + 2, dtype=float)
    # per_block[n]: the least seconds per block of the modes holding n blocks (inf if none)
    per_block = np.where(cap[..., None] >= n, B[..., None], np.inf).min(axis=2)  # (N, S, limit + 1)
    f = n * per_block + e[..., None]
    tau = f[:, :, 0].max(axis=1)
    need = L - S
    held = np.ones((len(idx), S))
    if need > 0:
        V = f[:, :, 1:limit]  # n = 2 .. limit
        t = np.partition(V.reshape(len(idx), -1), need - 1, axis=1)[:, need - 1]
        ok &= np.isfinite(t)
        less = (V < t[:, None, None]).sum(axis=2)
        eq = (V == t[:, None, None]).sum(axis=2)
        left = need - less.sum(axis=1)
        take_eq = np.clip(left[:, None] - (np.cumsum(eq, axis=1) - eq), 0, eq)
        held = 1 + less + take_eq
        tau = np.maximum(tau, t)
    ok &= np.isfinite(tau)
    with np.errstate(divide="ignore", invalid="ignore"):
        fit = np.floor((tau[:, None, None] - e[..., None]) / B + 1e-9)
    takes = np.where(B <= 0, cap, np.minimum(cap, fit))
    mode = takes.argmax(axis=2)[..., None]
    blocks = np.maximum(np.take_along_axis(takes, mode, axis=2)[..., 0], held)
    per = np.take_along_axis(B, mode, axis=2)[..., 0]
    # surplus blocks go back from the slowest stages first (stable: ties in stage order)
    surplus = blocks.sum(axis=1) - L
    order = np.argsort(-per, axis=1, kind="stable")
    spare = np.take_along_axis(blocks, order, axis=1) - 1
    give = np.clip(surplus[:, None] - (np.cumsum(spare, axis=1) - spare), 0, spare)
    np.put_along_axis(blocks, order, np.take_along_axis(blocks, order, axis=1) - give, axis=1)
    chosen = np.where(C >= blocks[..., None], B, np.inf).argmin(axis=2)
    blocks_l, chosen_l = blocks.astype(int).tolist(), chosen.tolist()
    return [(blocks_l[r], chosen_l[r]) if ok[r] else None for r in range(len(idx))]
