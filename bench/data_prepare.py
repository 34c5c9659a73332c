"""Tokenizing throughput: `hetrain data prepare` (batches on every core) against the single-chunk path.

The corpus is real text: the Python standard library's source files, one document each, up to
``--mb`` megabytes, written as one text file, as JSON lines and as Parquet. The tokenizer is a
byte-level BPE (GPT-2's pre-tokenizer, ``--vocab`` entries) trained on the corpus's first
megabytes before anything is timed. Each path runs in its own process, one after another:

* single-chunk: the path before batching (hetrain 1c73372's ``prepare_tokens``), one
  ``Tokenizer.encode`` call a megabyte at a time, chunks cut at a newline, on one core;
* text / jsonl / parquet: ``prepare_tokens`` now, ``encode_batch_fast`` on batches of
  ``DOC_BATCH_BYTES``, which the tokenizers library spreads over its thread pool (every core);
* text, one thread: the same with ``TOKENIZERS_PARALLELISM=false``: what batching alone gives;
* tokenizers library (jsonl): the bare library, every JSON line's document in one ``encode_batch_fast``
  call on every core, EOS between them: the bound (the "time vs library" column; issue 46 asks <= 1.3x).

The paths run in turn, ``--repeats`` rounds (the machine is shared and noisy: a slow minute
then falls on every path, not on one); each row gives the median and the best of its rounds.
Prints a table, writes bench/results/data_prepare.json. The speed-up from threads is bounded
by the cores the machine has free (``os.cpu_count()`` is printed with the table).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from _common import ROOT, print_table, write_results

import numpy as np

SINGLE_CHUNK_BYTES = 1 << 20  # the old path's chunk, as it was
TRAIN_TOKENIZER_BYTES = 4 << 20  # enough text for a realistic merge table, trained in seconds


def build_corpus(directory: Path, megabytes: float) -> list[str]:
    """The standard library's .py files, sorted by path, until ``megabytes`` of text."""
    docs, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        docs.append(text)
        size += len(text.encode())
        if size >= megabytes * (1 << 20):
            break
    (directory / "corpus.txt").write_text("".join(docs))
    (directory / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs}), directory / "corpus.parquet")
    return docs


def train_tokenizer(directory: Path, docs: list[str], vocab: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    sample, size = [], 0
    for d in docs:
        sample.append(d)
        size += len(d)
        if size > TRAIN_TOKENIZER_BYTES:
            break
    tok.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def single_chunk(text: Path, out: Path, tokenizer: Path) -> int:
    """The path before batching, as it was: one encode call per megabyte, cut after the last newline."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    count = 0
    with text.open("rb") as f, out.open("wb") as w:
        carry = b""
        while True:
            block = f.read(SINGLE_CHUNK_BYTES)
            chunk = carry + block
            if block:
                cut = chunk.rfind(b"\n") + 1
                chunk, carry = (chunk[:cut], chunk[cut:]) if cut else (b"", chunk)
            else:
                carry = b""
            if chunk:
                ids = np.asarray(tok.encode(chunk.decode("utf-8", errors="replace"), add_special_tokens=False).ids)
                ids.astype(np.uint16).tofile(w)
                count += ids.size
            if not block:
                return count


def library_batch(jsonl: Path, out: Path, tokenizer: Path) -> int:
    """The bare ``tokenizers`` library on the JSON lines: every document in one ``encode_batch_fast`` call (its
    thread pool on every core), an EOS after each, written as uint16: the speed ``data prepare`` is held to."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    eos = tok.token_to_id("<|endoftext|>")
    docs = [json.loads(line)["text"] for line in jsonl.read_text(encoding="utf-8").splitlines()]
    ids = [np.append(np.asarray(e.ids, dtype=np.uint16), eos) for e in tok.encode_batch_fast(docs)]
    joined = np.concatenate(ids)
    joined.tofile(out)
    return int(joined.size)


def measure_one(mode: str, directory: Path) -> dict:
    """Run one path in this process; the time covers reading, encoding and writing."""
    from hetrain.runtime.data import prepare_tokens

    tokenizer, source = directory / "tokenizer.json", {"jsonl": "corpus.jsonl", "parquet": "corpus.parquet"}
    if mode == "parquet":
        import pyarrow.parquet  # noqa: F401  (imported before the clock, like torch for the others)
    start = time.perf_counter()
    if mode == "single-chunk":
        tokens = single_chunk(directory / "corpus.txt", directory / f"{mode}.bin", tokenizer)
    elif mode == LIBRARY:
        tokens = library_batch(directory / "corpus.jsonl", directory / "library.bin", tokenizer)
    else:
        meta = prepare_tokens(directory / source.get(mode, "corpus.txt"), directory / f"{mode}.bin", tokenizer)
        tokens = meta["num_tokens"]
    return {"mode": mode, "seconds": time.perf_counter() - start, "tokens": tokens}


LIBRARY = "tokenizers library (jsonl)"
MODES = [("single-chunk", {}), ("text, one thread", {"TOKENIZERS_PARALLELISM": "false"}), ("text", {}),
         ("jsonl", {}), ("parquet", {}), (LIBRARY, {})]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=8.0, help="megabytes of text in the corpus")
    ap.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every path, in turn")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # a child: one measurement, JSON on stdout
        print(json.dumps(measure_one(args.one.replace("text, one thread", "text"), args.dir)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        docs = build_corpus(directory, args.mb)
        train_tokenizer(directory, docs, args.vocab)
        text_bytes = (directory / "corpus.txt").stat().st_size
        times: dict[str, list[float]] = {mode: [] for mode, _ in MODES}
        tokens: dict[str, int] = {}
        for _ in range(args.repeats):
            for mode, env in MODES:
                r = subprocess.run([sys.executable, __file__, "--one", mode, "--dir", str(directory)], check=True,
                                   capture_output=True, text=True,
                                   env={**os.environ, **env, "PYTHONPATH": str(ROOT)})
                one = json.loads(r.stdout)
                times[mode].append(one["seconds"])
                tokens[mode] = one["tokens"]
        rows = []
        for mode, _ in MODES:
            seconds = statistics.median(times[mode])
            rows.append({"mode": mode, "seconds": seconds, "best_s": min(times[mode]), "rounds_s": times[mode],
                         "tokens": tokens[mode], "mb_per_s": text_bytes / (1 << 20) / seconds,
                         "ktokens_per_s": tokens[mode] / seconds / 1e3,
                         "speedup": statistics.median(times["single-chunk"]) / seconds,
                         "vs_library": seconds / statistics.median(times[LIBRARY])})
    title = (f"hetrain data prepare: {text_bytes / (1 << 20):.1f} MB of Python source, {len(docs)} documents, "
             f"byte-level BPE of {args.vocab}, {os.cpu_count()} cores")
    print_table(title, rows, [("path", "mode"), ("median s", "{seconds:.1f}"), ("best s", "{best_s:.1f}"),
                              ("tokens", "{tokens:,}"),
                              ("MB/s", "{mb_per_s:.2f}"), ("k tokens/s", "{ktokens_per_s:.0f}"),
                              ("speed-up (median)", "{speedup:.2f}x"), ("time vs library", "{vs_library:.2f}x")])
    print(f"\nwrote {write_results('data_prepare', rows)}")


if __name__ == "__main__":
    main()
