"""Deterministic global batches, split among pipelines by their micro-batch counts.

Sequence ``i`` of step ``s`` is a pure function of (seed, s, i), so the global batch of a
step is the same whatever the plan, and resuming at step ``s`` needs nothing but ``s``.
Pipeline ``p`` takes the contiguous slice of the global batch after the pipelines before it.

Data files, all read through ``np.memmap`` (a 100 GB corpus costs page cache, not RAM; each
rank touches only the windows of its own pipeline's slice):

* ``.bin``: a flat array of token ids, nanoGPT's ``train.bin`` or Megatron's ``.bin`` without
  its index. The dtype comes from the ``<file>.json`` that ``hetrain data prepare`` writes
  beside it (``hetrain.tokens/v2``; v1 files read the same), else uint16 when the vocabulary
  fits, uint32 otherwise.
* ``.npy``: a 1-D array of unsigned (or non-negative signed) integers; numpy's header gives the dtype.
* anything else: text, one token per byte (byte-level, vocabulary 256).

The corpus is cut into windows of ``seq_length + 1`` tokens, one every ``seq_length`` tokens
(each target sequence overlaps the next window's first input by one token), and every epoch
visits them in a fresh order: an affine permutation ``k -> (a k + c) mod windows`` with ``a``
coprime to the count, drawn from (seed, epoch). It needs O(1) memory at any corpus size,
where a stored permutation of a 100 GB corpus would take 200 MB on every rank.
"""

from __future__ import annotations

import json
import math
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from hetrain.errors import HetrainError
from hetrain.files import check_output_file, parse_json, read_text

# The description's versions. v2 (written now) is v1 plus the dtype uint8 and the fields eos_id,
# documents, sources and tokenizer_path; a v1 reader reads every v2 file but a uint8 one, which it
# refuses by name.
TOKENS_SCHEMA = "hetrain.tokens/v2"
TOKENS_SCHEMAS_READ = ("hetrain.tokens/v1", TOKENS_SCHEMA)
TOKEN_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}
VOCAB_CHECK_TOKENS = 1 << 20  # ids checked when the file is opened; every batch read is checked too


def token_dtype_for(vocab_size: int) -> str:
    """The dtype of a ``.bin`` without a description: nanoGPT's and Megatron's rule, never uint8."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def smallest_token_dtype(vocab_size: int) -> str:
    """The dtype ``prepare_tokens`` writes: the smallest that holds every id (byte-level data in one byte)."""
    return next(name for name, t in TOKEN_DTYPES.items() if vocab_size - 1 <= np.iinfo(t).max)


def open_tokens(path: str | Path, vocab_size: int) -> np.ndarray:
    """The file's token ids as a read-only memory map; HetrainError naming the file when it is not one."""
    p = Path(path)
    if not p.is_file():
        raise HetrainError(f"{p}: data file not found")
    if p.suffix == ".npy":
        try:
            tokens = np.load(p, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise HetrainError(f"{p}: not a readable .npy array ({e})") from None
        if tokens.ndim != 1 or tokens.dtype.kind not in "ui" or tokens.dtype.itemsize > 8:
            raise HetrainError(f"{p}: expected a 1-D array of integer token ids, got {tokens.dtype} "
                               f"with shape {tokens.shape}")
        return tokens
    if p.suffix != ".bin":
        if vocab_size < 256:
            raise HetrainError(f"{p}: byte-level data needs vocab_size >= 256, the model has {vocab_size}")
        return np.memmap(p, dtype=np.uint8, mode="r") if p.stat().st_size else np.zeros(0, np.uint8)
    meta_path = p.with_name(p.name + ".json")
    dtype_name = token_dtype_for(vocab_size)
    if meta_path.is_file():
        meta = parse_json(read_text(meta_path), str(meta_path))
        if not isinstance(meta, dict) or "dtype" not in meta:
            raise HetrainError(f"{meta_path}: expected JSON with a 'dtype' field ({TOKENS_SCHEMA})")
        schema = meta.get("schema", TOKENS_SCHEMAS_READ[0])
        if schema not in TOKENS_SCHEMAS_READ:
            raise HetrainError(f"{meta_path}: schema {schema!r} is not one this hetrain reads "
                               f"({', '.join(TOKENS_SCHEMAS_READ)}); was it written by a newer hetrain?")
        dtype_name = meta["dtype"]
        if not isinstance(dtype_name, str) or dtype_name not in TOKEN_DTYPES:
            raise HetrainError(f"{meta_path}: dtype: expected one of {', '.join(TOKEN_DTYPES)}, got {dtype_name!r}")
    itemsize = np.dtype(TOKEN_DTYPES[dtype_name]).itemsize
    size = p.stat().st_size
    if size % itemsize:
        raise HetrainError(f"{p}: {size} bytes is not a whole number of {dtype_name} token ids; "
                           f"is the file of another dtype?")
    if size == 0:
        return np.zeros(0, TOKEN_DTYPES[dtype_name])
    return np.memmap(p, dtype=TOKEN_DTYPES[dtype_name], mode="r")


def token_file_description(path: str | Path) -> dict | None:
    """The description ``prepare_tokens`` wrote beside a token file; None when there is none or it is no JSON object."""
    meta_path = Path(path).with_name(Path(path).name + ".json")
    if not meta_path.is_file():
        return None
    try:
        meta = parse_json(read_text(meta_path), str(meta_path))
    except HetrainError:
        return None
    return meta if isinstance(meta, dict) else None


def check_ids(tokens: np.ndarray, vocab_size: int, source: str, offset: int = 0) -> None:
    """HetrainError naming the first id >= ``vocab_size`` (or negative) in ``tokens``."""
    if tokens.size == 0:
        return
    high, low = int(tokens.max()), int(tokens.min())
    if high >= vocab_size or low < 0:
        bad = int(np.flatnonzero((tokens >= vocab_size) | (tokens < 0))[0])
        raise HetrainError(f"{source}: token id {int(tokens[bad])} at position {offset + bad} is outside the model's "
                           f"vocabulary (vocab_size {vocab_size}); was the file made with another tokenizer or dtype?")


class TokenSource:
    """Sequences of ``seq_length + 1`` tokens (inputs plus the shifted targets)."""

    def __init__(self, seq_length: int, vocab_size: int, seed: int = 0, path: str | Path | None = None) -> None:
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.path = str(path) if path is not None else None
        self.tokens: np.ndarray | None = None
        self._epoch: tuple[int, int, int] | None = None
        if path is not None:
            self.tokens = open_tokens(path, vocab_size)
            if len(self.tokens) < seq_length + 1:
                raise HetrainError(f"{path}: {len(self.tokens)} tokens, shorter than one sequence "
                                   f"(seq_length + 1 = {seq_length + 1})")
            check_ids(np.asarray(self.tokens[:VOCAB_CHECK_TOKENS]), vocab_size, str(path))
            self.windows = (len(self.tokens) - seq_length - 1) // seq_length + 1

    def sequences(self, first: int, count: int) -> torch.Tensor:
        """Global sequences ``[first, first + count)`` as a ``(count, seq_length + 1)`` int64 tensor."""
        if self.tokens is None:
            return torch.stack([self._synthetic(i) for i in range(first, first + count)])
        n = self.seq_length + 1
        rows = []
        for i in range(first, first + count):
            epoch, k = divmod(i, self.windows)
            start = self._window(epoch, k) * self.seq_length
            row = np.asarray(self.tokens[start:start + n])
            check_ids(row, self.vocab_size, self.path, start)
            rows.append(torch.from_numpy(row.astype(np.int64)))
        return torch.stack(rows)

    def _window(self, epoch: int, k: int) -> int:
        """Position of the ``k``-th window visited in ``epoch`` (a permutation of ``range(windows)``)."""
        w = self.windows
        if self._epoch is None or self._epoch[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            a = int(rng.integers(1, max(2, w)))
            while math.gcd(a, w) != 1:
                a += 1
            self._epoch = (epoch, a, int(rng.integers(0, w)))
        _, a, c = self._epoch
        return (a * k + c) % w

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


T = TypeVar("T")
READ_AHEAD_BATCHES = 1  # batches read and parsed while the tokenizer encodes the one before: one keeps memory flat


def read_ahead(items: Iterator[T], depth: int = READ_AHEAD_BATCHES) -> Iterator[T]:
    """``items``, produced by a thread up to ``depth`` ahead of the consumer.

    ``data prepare``'s reading (JSON parsing, Parquet columns, UTF-8 decoding) is Python that holds the GIL;
    the tokenizers library releases it while it encodes a batch on every core. In turn, the cores wait for
    the reader between batches; side by side they do not. The reader's error is raised in the consumer.
    """
    done = object()
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def offer(entry: tuple) -> bool:
        """Put ``entry`` once there is room; False once the consumer has stopped."""
        while not stop.is_set():
            try:
                slots.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not offer((item, None)):
                    return
            offer((done, None))
        except BaseException as e:  # noqa: BLE001  (handed to the consumer as it was)
            offer((done, e))

    reader = threading.Thread(target=produce, name="hetrain-read-ahead", daemon=True)
    reader.start()
    try:
        while True:
            item, error = slots.get()
            if error is not None:
                raise error
            if item is done:
                return
            yield item
    finally:  # the consumer stopped early (an error): let the reader go
        stop.set()


def prepare_tokens(inputs: str | Path | Sequence[str | Path], out: str | Path,
                   tokenizer: str | Path | None = None, field: str = "text", eos: str | None = None,
                   split: str = "train", progress: Callable[[int, int, int], None] | None = None) -> dict:
    """Tokenize text, JSON lines, Parquet and saved ``datasets`` into a flat ``.bin`` plus its description.

    The inputs are read in order (hetrain.runtime.corpus) and encoded in batches on every core,
    ``eos`` (by default the tokenizer's own end-of-document token) after each document. The
    ids go out in the smallest dtype that holds the vocabulary. Written under temporary names
    and renamed: a reader never sees half a file. ``progress(bytes_read, total_bytes, tokens)``
    is called after every batch.
    """
    from hetrain.runtime.corpus import batches, join_ids, load_encoder, open_input, private_temps

    paths = [Path(inputs)] if isinstance(inputs, (str, Path)) else [Path(i) for i in inputs]
    dst = Path(out)
    if not paths:
        raise HetrainError("--input: expected at least one file or dataset directory")
    if dst.suffix != ".bin":
        raise HetrainError(f"--out {dst}: expected a .bin file name")
    sources = [open_input(p, field, split) for p in paths]
    read = {f"--input {p}": p for p in paths} | {"--tokenizer": tokenizer}
    check_output_file(dst, "--out", read)
    check_output_file(dst.with_suffix(".bin.json"), "--out's description", read)
    encoder = load_encoder(tokenizer, eos)
    dtype = smallest_token_dtype(encoder.vocab_size)
    total = sum(s.size_bytes for s in sources)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp_bin, tmp_meta = private_temps(dst, dst.with_name(dst.name + ".json"))  # ours alone: no link followed
    count, max_id, documents = 0, -1, 0
    try:
        with tmp_bin.open("wb") as w:
            for texts, ends, done in read_ahead(batches(sources)):
                ids = join_ids(encoder.encode_batch(texts), ends, encoder.eos_id)
                documents += sum(ends)
                if ids.size:
                    max_id = max(max_id, int(ids.max()))
                    if max_id > np.iinfo(TOKEN_DTYPES[dtype]).max:
                        raise HetrainError(f"--tokenizer {encoder.name}: token id {max_id} is past its vocabulary "
                                           f"of {encoder.vocab_size}")
                    ids.astype(TOKEN_DTYPES[dtype]).tofile(w)
                    count += ids.size
                if progress:
                    progress(done, total, count)
        if not count:  # a token file of nothing: training would refuse it later, so refuse it now
            raise HetrainError(f"--input {', '.join(map(str, paths))}: no tokens ({documents} documents, all empty); "
                               f"expected text to tokenize")
        meta = {"schema": TOKENS_SCHEMA, "dtype": dtype, "num_tokens": count, "vocab_size": encoder.vocab_size,
                "max_id": max_id, "eos_id": encoder.eos_id, "documents": documents, "tokenizer": encoder.name,
                "tokenizer_path": encoder.path,
                "source": ", ".join(s.name for s in sources), "sources": [s.name for s in sources]}
        tmp_meta.write_text(json.dumps(meta, indent=2) + "\n")
        tmp_meta.replace(dst.with_name(dst.name + ".json"))  # first: a reader of the .bin finds its dtype
        tmp_bin.replace(dst)
    except BaseException:
        tmp_bin.unlink(missing_ok=True)
        tmp_meta.unlink(missing_ok=True)
        raise
    return meta


def pipeline_slices(num_microbatches: list[int], micro_batch_size: int) -> list[tuple[int, int]]:
    """(offset, count) of each pipeline's sequences within the global batch."""
    out, offset = [], 0
    for n in num_microbatches:
        out.append((offset, n * micro_batch_size))
        offset += n * micro_batch_size
    return out
