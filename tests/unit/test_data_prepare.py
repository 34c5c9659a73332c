"""``hetrain data prepare`` on JSON lines, Parquet, saved datasets and text, with a BPE tokenizer trained here.

The tokenizer is a real byte-pair encoding trained in the test (the tokenizers library, a
vocabulary under the tiny model's 256), so the token files fit examples/models/gpt-tiny.yaml
and train end to end
(tests/integration/test_data_prepare.py).
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from hetrain.errors import HetrainError
from hetrain.runtime.data import open_tokens, prepare_tokens
from tests.helpers import run_cli
from tests.helpers.data import EOS, assert_documents_between_eos, documents, write_jsonl, write_parquet

tokenizers = pytest.importorskip("tokenizers")


def test_jsonl_parquet_and_a_saved_dataset_in_one_file(tmp_path: Path, bpe: Path):
    """Inputs of three kinds, in the order given, each document closed by the EOS id."""
    datasets = pytest.importorskip("datasets")
    a, b, c = documents(40, 2), documents(25, 3), documents(15, 4)
    write_jsonl(tmp_path / "a.jsonl", a)
    write_parquet(tmp_path / "b.parquet", b, field="body")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": c}),
                          "test": datasets.Dataset.from_dict({"body": ["unused"]})}).save_to_disk(tmp_path / "c")
    with pytest.raises(HetrainError, match="line 1: no field 'body' \\(fields: id, text\\)"):
        prepare_tokens([tmp_path / "a.jsonl"], tmp_path / "x.bin", bpe, field="body")
    seen = []
    meta = prepare_tokens([tmp_path / "b.parquet", tmp_path / "c"], tmp_path / "bc.bin", bpe, field="body",
                          progress=lambda done, total, tokens: seen.append((done, total, tokens)))
    assert_documents_between_eos(tmp_path / "bc.bin", bpe, b + c)
    assert seen[-1][0] == seen[-1][1] and seen[-1][2] == meta["num_tokens"]
    assert meta["sources"] == [str(tmp_path / "b.parquet"), str(tmp_path / "c")]
    prepare_tokens([tmp_path / "a.jsonl"], tmp_path / "a.bin", bpe)
    assert_documents_between_eos(tmp_path / "a.bin", bpe, a)


def test_a_tokenizer_directory_names_its_eos_and_text_files_are_one_document(tmp_path: Path, bpe: Path):
    """transformers' layout: tokenizer.json beside a tokenizer_config.json naming eos_token."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "tokenizer.json").write_bytes(bpe.read_bytes())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<unk>"}}))
    docs = documents(30, 5)
    (tmp_path / "t.txt").write_text("\n".join(docs))
    meta = prepare_tokens(tmp_path / "t.txt", tmp_path / "t.bin", model_dir)
    tok = tokenizers.Tokenizer.from_file(str(bpe))
    ids = np.fromfile(tmp_path / "t.bin", dtype=np.uint8).tolist()
    assert meta["eos_id"] == tok.token_to_id("<unk>") and ids[-1] == meta["eos_id"]
    assert ids[:-1] == tok.encode("\n".join(docs), add_special_tokens=False).ids
    with pytest.raises(HetrainError, match="--eos <nope>: not a token of"):
        prepare_tokens(tmp_path / "t.txt", tmp_path / "u.bin", bpe, eos="<nope>")


def test_a_big_text_file_in_pieces_encodes_as_one_encoding_of_it(tmp_path: Path):
    """A file of many pieces (real Python source: blank lines, long indented blocks), a byte-level
    BPE: the pieces are cut where the pre-tokenizer splits anyway, so the ids are exactly those of
    one encode call on the whole file (cuts at any newline gave 13 tokens fewer on 3 MB)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from hetrain.runtime.corpus import TEXT_PIECE_BYTES

    source = Path(sysconfig.get_paths()["stdlib"]) / "_pydecimal.py"
    if not source.is_file() or source.stat().st_size < 2 * TEXT_PIECE_BYTES:
        pytest.skip(f"{source}: not here, or too small for several pieces")
    text = source.read_text()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([text[:50_000]], trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "code.txt").write_text(text)
    meta = prepare_tokens(tmp_path / "code.txt", tmp_path / "code.bin", tmp_path / "tokenizer.json", eos="none")
    assert meta["dtype"] == "uint16"
    assert np.fromfile(tmp_path / "code.bin", np.uint16).tolist() == tok.encode(text, add_special_tokens=False).ids


def test_old_token_files_still_read_and_newer_schemas_are_refused(tmp_path: Path):
    """A v1 description (uint16) and a bare nanoGPT .bin read as before; a future schema is named."""
    ids = (np.arange(200) % 256).astype(np.uint16)
    ids.tofile(tmp_path / "v1.bin")
    (tmp_path / "v1.bin.json").write_text(json.dumps({"schema": "hetrain.tokens/v1", "dtype": "uint16"}))
    ids.tofile(tmp_path / "bare.bin")
    for name in ("v1.bin", "bare.bin"):
        assert np.asarray(open_tokens(tmp_path / name, 256)).tolist() == ids.tolist()
    (tmp_path / "v1.bin.json").write_text(json.dumps({"schema": "hetrain.tokens/v9", "dtype": "uint16"}))
    with pytest.raises(HetrainError, match="schema 'hetrain.tokens/v9' is not one this hetrain reads"):
        open_tokens(tmp_path / "v1.bin", 256)


def test_bad_inputs_are_one_line_errors(tmp_path: Path, bpe: Path):
    """Each names the file (and line or field) and what was expected; nothing is written."""
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n[1, 2]\n')
    (tmp_path / "num.jsonl").write_text('{"text": 3}\n')
    (tmp_path / "notparquet.parquet").write_text("hello")
    (tmp_path / "dir").mkdir()
    for name, eos, message in [
        ("bad.jsonl", None, "bad.jsonl: line 2: expected a JSON object, got list"),
        ("num.jsonl", None, "num.jsonl: line 1: field 'text' is int, expected a string"),
        ("notparquet.parquet", None, "not a Parquet file pyarrow reads"),
        ("dir", None, "not a datasets dataset saved to disk"),
        ("num.jsonl", EOS, "byte-level data \\(no --tokenizer\\) has no end-of-document token"),
    ]:
        with pytest.raises(HetrainError, match=message):
            prepare_tokens(tmp_path / name, tmp_path / "o.bin", eos=eos)
        assert not (tmp_path / "o.bin").exists()
    r = run_cli("data", "prepare", "--input", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o.bin"))
    assert r.returncode == 2 and "line 2: expected a JSON object" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "o.bin").exists()


def test_read_ahead_keeps_the_order_and_raises_the_readers_error_in_the_consumer():
    """``prepare_tokens`` reads the next batch while the tokenizer encodes one (``read_ahead``): the batches
    arrive in order, a reader's error (a bad JSON line) surfaces where the loop is, and a consumer that
    stops early (its own error) leaves no reader waiting."""
    from hetrain.runtime.data import read_ahead

    assert list(read_ahead(iter(range(50)))) == list(range(50))

    def failing():
        yield 1
        raise HetrainError("corpus.jsonl: line 2: not JSON")

    got = []
    with pytest.raises(HetrainError, match="line 2: not JSON"):
        for item in read_ahead(failing()):
            got.append(item)
    assert got == [1]
    for item in read_ahead(iter(range(1000))):
        if item == 3:
            break  # the generator's close stops the reader: no thread left blocked on a full queue
    import threading
    import time

    time.sleep(0.3)
    assert not [t for t in threading.enumerate() if t.name == "hetrain-read-ahead"]
