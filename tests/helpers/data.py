"""Corpora for ``hetrain data prepare``: documents of random words, written as JSON lines or Parquet, the BPE
tokenizer trained on them (a vocabulary under gpt-tiny's 256, so the token files train the tiny model and fit
in uint8), and the check that a token file is each document's encoding closed by the end-of-document id."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

EOS = "<|endoftext|>"
BPE_VOCAB = 200  # under gpt-tiny's 256: the token files train the tiny model, and fit in uint8
WORDS = ("the cat sat on a mat while dogs ran far away from home under grey skies and "
         "every river sang softly to stones").split()


def documents(count: int, seed: int) -> list[str]:
    """Sentences of random words, documents of different lengths (some a single word)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30))) for _ in range(count)]


def train_bpe(path: Path) -> Path:
    """A tokenizer.json at ``path``: BPE on whitespace-split words, trained on documents of ``documents``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(documents(200, seed=1), trainers.BpeTrainer(vocab_size=BPE_VOCAB,
                                                                        special_tokens=["<unk>", EOS]))
    tok.save(str(path))
    return path


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
    return path


def write_parquet(path: Path, docs: list[str], field: str = "text") -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({field: docs, "n": list(range(len(docs)))}), path, row_group_size=7)
    return path


def assert_documents_between_eos(token_file: Path, tokenizer: Path, docs: list[str]) -> None:
    """The file is each document's own encoding followed by the end-of-document id, in order."""
    import tokenizers

    from hetrain.runtime.data import open_tokens

    tok = tokenizers.Tokenizer.from_file(str(tokenizer))
    meta = json.loads(token_file.with_name(token_file.name + ".json").read_text())
    eos_id = tok.token_to_id(EOS)
    assert meta["eos_id"] == eos_id and meta["dtype"] == "uint8" and meta["documents"] == len(docs)
    ids = np.asarray(open_tokens(token_file, BPE_VOCAB)).tolist()
    want = [t for d in docs for t in tok.encode(d, add_special_tokens=False).ids + [eos_id]]
    assert ids == want
    assert ids.count(eos_id) == len(docs)
