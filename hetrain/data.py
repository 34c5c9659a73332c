"""Deterministic global batches, split among pipelines by their micro-batch counts.

Sequence ``i`` of step ``s`` is a pure function of (seed, s, i), so the global batch of a
step is the same whatever the plan, and resuming at step ``s`` needs nothing but ``s``.
Pipeline ``p`` takes the contiguous slice of the global batch after the pipelines before it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hetrain.errors import HetrainError


class TokenSource:
    """Sequences of ``seq_length + 1`` tokens (inputs plus the shifted targets)."""

    def __init__(self, seq_length: int, vocab_size: int, seed: int = 0, path: str | Path | None = None) -> None:
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.tokens: np.ndarray | None = None
        self._perm: tuple[int, np.ndarray] | None = None
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise HetrainError(f"{p}: data file not found")
            self.tokens = np.fromfile(p, dtype=np.uint8)  # byte-level tokens
            if vocab_size < 256:
                raise HetrainError(f"{p}: byte-level data needs vocab_size >= 256, the model has {vocab_size}")
            if len(self.tokens) < seq_length + 2:
                raise HetrainError(f"{p}: {len(self.tokens)} bytes, need at least seq_length + 2 = {seq_length + 2}")

    def sequences(self, first: int, count: int) -> torch.Tensor:
        """Global sequences ``[first, first + count)`` as a ``(count, seq_length + 1)`` int64 tensor."""
        if self.tokens is None:
            return torch.stack([self._synthetic(i) for i in range(first, first + count)])
        n = self.seq_length + 1
        windows = (len(self.tokens) - n) // self.seq_length + 1
        rows = []
        for i in range(first, first + count):
            epoch, k = divmod(i, windows)
            start = int(self._permutation(epoch, windows)[k]) * self.seq_length
            rows.append(torch.from_numpy(self.tokens[start:start + n].astype(np.int64)))
        return torch.stack(rows)

    def _permutation(self, epoch: int, windows: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(windows))
        return self._perm[1]

    def _synthetic(self, index: int) -> torch.Tensor:
        """Arithmetic progressions mod vocab with a random start and stride: learnable in context."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start, stride = torch.randint(0, self.vocab_size, (1,), generator=gen), torch.randint(1, 8, (1,), generator=gen)
        return (start + stride * torch.arange(self.seq_length + 1)) % self.vocab_size


class PipelineSampler:
    """A pipeline's share of every global batch: ``num_microbatches * micro_batch_size`` sequences."""

    def __init__(self, source: TokenSource, global_batch_size: int, offset: int, count: int) -> None:
        self.source = source
        self.global_batch_size = global_batch_size
        self.offset = offset
        self.count = count

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets for ``step`` (0-based), each ``(count, seq_length)``."""
        seq = self.source.sequences(step * self.global_batch_size + self.offset, self.count)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def pipeline_slices(num_microbatches: list[int], micro_batch_size: int) -> list[tuple[int, int]]:
    """(offset, count) of each pipeline's sequences within the global batch."""
    out, offset = [], 0
    for n in num_microbatches:
        out.append((offset, n * micro_batch_size))
        offset += n * micro_batch_size
    return out
