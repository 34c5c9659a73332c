"""``hetrain data prepare`` then ``hetrain train --data``: a JSON-lines corpus and a Parquet file, tokenized
by a BPE tokenizer trained here (tests/conftest.py's ``bpe``), train end to end on two pipeline stages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetrain.runtime.data import TokenSource
from hetrain.runtime.model import GPT, lm_loss
from tests.helpers import run_cli
from tests.helpers.data import assert_documents_between_eos, documents, write_jsonl, write_parquet
from tests.helpers.training import TINY, assert_board_matches_metrics, assert_measured_timeline, metrics, plan

pytest.importorskip("tokenizers")


def test_a_jsonl_corpus_and_a_parquet_file_train_end_to_end(tmp_path: Path, bpe: Path):
    """`hetrain data prepare` of both into one file, then `hetrain train --data` on two pipeline
    stages: the run's first loss is the loss of the same initial model on the file's first
    global batch, computed here in one process (one run, to spend the wall time once). The
    run's TensorBoard files hold its records (read by TensorBoard's reader), its measured
    timeline is causal, and its export
    carries the tokenizer."""
    docs = documents(150, 6)
    r = run_cli("data", "prepare", "--input", str(write_jsonl(tmp_path / "c.jsonl", docs[:90])),
                "--input", str(write_parquet(tmp_path / "c.parquet", docs[90:])), "--out", str(tmp_path / "c.bin"),
                "--tokenizer", str(bpe))
    assert r.returncode == 0, r.stderr
    assert_documents_between_eos(tmp_path / "c.bin", bpe, docs)
    p = plan(1, [(8, [("a/0", [0, 3]), ("a/1", [3, 6])])])
    p.write(tmp_path / "plan.json")
    r = run_cli("train", "--plan", str(tmp_path / "plan.json"), "--data", str(tmp_path / "c.bin"), "--steps", "2",
                "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    losses = [m["loss"] for m in metrics(tmp_path) if "loss" in m]
    model = GPT(TINY)
    model.init_weights(0)
    seq = TokenSource(TINY.seq_length, TINY.vocab_size, seed=0, path=tmp_path / "c.bin").sequences(0, 8)
    with torch.no_grad():
        want = lm_loss(model(seq[:, :-1]), seq[:, 1:]).item()
    assert len(losses) == 2 and abs(losses[0] - want) < 1e-4 * want
    assert_board_matches_metrics(tmp_path / "run")
    assert (tmp_path / "run" / "loss.png").is_file() and (tmp_path / "run" / "ranks.png").is_file()
    assert_measured_timeline(tmp_path / "run", stages=2, microbatches=8)
    r = run_cli("export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "export"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "export" / "tokenizer.json").read_bytes() == bpe.read_bytes()  # it travels with the model
