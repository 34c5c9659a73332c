"""Documents in, token ids out: the inputs and tokenizers ``hetrain data prepare`` reads.

Inputs, chosen by what the path is:

* a directory: a Hugging Face ``datasets`` dataset saved with ``save_to_disk`` (a
  ``DatasetDict`` too: ``split`` picks one), read through ``datasets.load_from_disk``;
* ``.jsonl`` / ``.ndjson`` / ``.json``: JSON lines, one object (one document) a line;
* ``.parquet``: one document a row, read a record batch at a time with ``pyarrow``;
* anything else: UTF-8 text, the whole file one document.

The text of a document is its ``field`` (a column or key; ``text`` by default). Tokenizers: a
``tokenizer.json`` file, or a directory holding one (a transformers model directory; its
``tokenizer_config.json`` names the end-of-document token), through the ``tokenizers``
library; a directory with only a slow (sentencepiece) tokenizer goes through transformers'
``AutoTokenizer`` where transformers is installed. No tokenizer: byte-level, one token per
byte, vocabulary 256 (all of it bytes, so no end-of-document token).

Encoding runs on every core: documents are gathered into batches of ``DOC_BATCH_BYTES`` and
handed to the tokenizers library's ``encode_batch_fast``, which spreads a batch over its own
thread pool (a plain text file is first cut at newlines into ``TEXT_PIECE_BYTES`` pieces, so
one big file is a batch of many pieces too).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetrain.errors import HetrainError

DOC_BATCH_BYTES = 4 << 20  # text per encode_batch call: hundreds of pieces for the thread pool, flat memory
CUT_SEARCH_BYTES = 4 << 10  # the first window ``_cut`` searches, at a piece's end
TEXT_PIECE_BYTES = 64 << 10  # a text file's pieces (cut at newlines): many per batch, each long enough to amortize
PARQUET_BATCH_ROWS = 1024  # rows per pyarrow record batch: a batch of short documents stays small in memory
JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
# Tried in order when neither --eos nor the tokenizer's config names the end-of-document token:
# GPT-2 and most BPE models, Llama 1/2 and T5, Llama 3, Gemma.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
NO_EOS = "none"  # --eos none: documents are joined without a separator
_SAFE_CUT = re.compile(rb"(?<=\S)\n(?=\S)|(?<=\S)(?= [A-Za-z])")  # see _cut


@dataclass
class Encoder:
    """A tokenizer as ``hetrain data prepare`` uses it: batches of texts to lists of ids."""

    name: str
    vocab_size: int
    eos_id: int | None
    encode_batch: Callable[[list[str | bytes]], list[list[int] | np.ndarray]]
    path: str | None  # the tokenizer's file or directory, absolute (an export copies it), None: byte-level


@dataclass
class Input:
    """One input: its size (what the progress bar counts) and its documents as they are read.

    ``pieces()`` yields ``(text, ends_document, bytes_read)``: ``bytes_read`` is how far into
    this input the piece reaches, an estimate from the row count for Parquet and datasets. A
    text file's pieces are its bytes as they are (byte-level data keeps bytes that are not UTF-8).
    """

    name: str
    size_bytes: int
    pieces: Callable[[], Iterator[tuple[str | bytes, bool, int]]]


def open_input(path: str | Path, field: str = "text", split: str = "train") -> Input:
    """The input at ``path`` by its kind; HetrainError naming the path when it cannot be one."""
    p = Path(path)
    if p.is_dir():
        return _dataset_input(p, field, split)
    if not p.is_file():
        raise HetrainError(f"--input {p}: file not found")
    if p.suffix in JSON_SUFFIXES:
        return Input(str(p), p.stat().st_size, lambda: _json_lines(p, field))
    if p.suffix == ".parquet":
        return _parquet_input(p, field)
    return Input(str(p), p.stat().st_size, lambda: _text_pieces(p))


def _cut(chunk: bytes) -> int:
    """Where to end a piece: the last place a pre-tokenizer splits anyway, else after the last newline.

    Such a place is a lone newline (non-space bytes on both sides) or a single space between a
    non-space byte and a letter: GPT-2's byte-level pattern and whitespace splitting both end a
    pre-token there, so pieces cut there encode as the whole file does (a run of whitespace is
    split differently at the end of a text, so no cut falls inside one unless there is no other).

    Searched from the end, in windows growing 8-fold (the lookbehinds see the byte before a window): a
    piece of prose has one within its last few KB, and a scan of all 64 KB in Python was 5 ms a piece,
    a tenth of the text path's time on two cores (issue 46).
    """
    window = CUT_SEARCH_BYTES
    while True:
        start = max(0, len(chunk) - window)
        last = None
        for last in _SAFE_CUT.finditer(chunk, start):
            pass
        if last is not None or start == 0:
            return last.end() if last is not None else chunk.rfind(b"\n") + 1
        window *= 8


def _text_pieces(p: Path) -> Iterator[tuple[bytes, bool, int]]:
    """The file in pieces cut at newlines (``_cut``: no word in two), the last one ending the document."""
    done, carry = 0, b""
    with p.open("rb") as f:
        while True:
            block = f.read(TEXT_PIECE_BYTES)
            done += len(block)
            chunk = carry + block
            cut = _cut(chunk) if block else len(chunk)
            chunk, carry = (chunk[:cut], chunk[cut:]) if cut else (b"", chunk)
            if chunk or not block:
                yield chunk, not block, done
            if not block:
                return


def _field_text(value: object, where: str, field: str, present: list[str] | None) -> str:
    if present is not None:
        raise HetrainError(f"{where}: no field '{field}' (fields: {', '.join(present) or 'none'}); "
                           f"name the text field with --field")
    if not isinstance(value, str):
        raise HetrainError(f"{where}: field '{field}' is {type(value).__name__}, expected a string of text")
    return value


def _json_lines(p: Path, field: str) -> Iterator[tuple[str, bool, int]]:
    done = 0
    with p.open("rb") as f:
        for number, line in enumerate(f, 1):
            done += len(line)
            if not line.strip():
                continue
            where = f"{p}: line {number}"
            try:
                doc = json.loads(line, parse_int=_line_int)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise HetrainError(f"{where}: not JSON ({e}); expected one JSON object a line") from None
            except _HostileLine as e:
                raise HetrainError(f"{where}: {e}; expected one JSON object a line") from None
            except RecursionError:
                raise HetrainError(f"{where}: JSON nested too deep to read; expected one JSON object a line") from None
            if not isinstance(doc, dict):
                raise HetrainError(f"{where}: expected a JSON object, got {type(doc).__name__}")
            missing = None if field in doc else [str(k) for k in doc]
            yield _utf8_text(_field_text(doc.get(field), where, field, missing), where, field), True, done


MAX_LINE_INT_DIGITS = 4300  # Python's own limit on converting digits to an int (sys.get_int_max_str_digits)


class _HostileLine(ValueError):
    """A JSON line no corpus writer makes (an integer of thousands of digits)."""


def _line_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_LINE_INT_DIGITS:
        raise _HostileLine(f"an integer of {digits} digits (at most {MAX_LINE_INT_DIGITS})")
    return int(text)


def _utf8_text(text: str, where: str, field: str) -> str:
    """The text, unless JSON's escapes made it no Unicode text (a lone surrogate such as "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise HetrainError(f"{where}: field '{field}' holds a lone surrogate {text[e.start]!a} at character "
                           f"{e.start} (a \\u escape of half a UTF-16 pair); expected Unicode text") from None
    return text


def private_temps(*paths: Path) -> list[Path]:
    """A new, empty temporary file beside each of ``paths`` that this process alone made (``O_EXCL``, a random name).

    What ``data prepare`` writes before renaming onto ``paths``: never a name fixed in advance, so a link
    planted there is never written through and an input of that name is never overwritten or removed.
    All or none: a failure removes the ones made.
    """
    import os
    import tempfile

    made: list[Path] = []
    try:
        for path in paths:
            fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            os.close(fd)
            made.append(Path(name))
            os.chmod(name, 0o666 & ~_umask())  # as an open() would have made it: the token file is for others too
    except OSError as e:
        for tmp in made:
            tmp.unlink(missing_ok=True)
        raise HetrainError(f"--out {paths[0]}: cannot write there ({e.strerror or e})") from None
    return made


def _umask() -> int:
    """This process's umask, read without setting it (``os.umask`` would change it for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022



def _parquet_input(p: Path, field: str) -> Input:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise HetrainError(f"--input {p}: Parquet needs pyarrow: pip install 'hetrain[data]'") from None
    try:
        parquet = pq.ParquetFile(p)
    except Exception as e:  # pyarrow raises its own ArrowInvalid, OSError, ...
        raise HetrainError(f"--input {p}: not a Parquet file pyarrow reads ({e})") from None
    names = parquet.schema_arrow.names
    if field not in names:
        _field_text(None, str(p), field, names)
    rows, size = max(1, parquet.metadata.num_rows), p.stat().st_size

    def pieces() -> Iterator[tuple[str, bool, int]]:
        seen = 0
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
            for value in batch.column(0).to_pylist():
                seen += 1
                yield _field_text(value, f"{p}: row {seen}", field, None), True, size * seen // rows
    return Input(str(p), size, pieces)


def _dataset_input(p: Path, field: str, split: str) -> Input:
    """A ``datasets`` dataset saved to disk; its size is that of its Arrow files."""
    if not any((p / marker).is_file() for marker in ("state.json", "dataset_dict.json")):
        raise HetrainError(f"--input {p}: a directory but not a datasets dataset saved to disk "
                           f"(no state.json or dataset_dict.json)")
    try:
        import datasets
    except ImportError:
        raise HetrainError(f"--input {p}: a saved dataset needs the datasets package: "
                           f"pip install 'hetrain[data]'") from None
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:  # datasets' own errors, pyarrow's, FileNotFoundError
        raise HetrainError(f"--input {p}: datasets cannot load it ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise HetrainError(f"--input {p}: no split '{split}' (splits: {', '.join(ds)}); choose one with --split")
        ds = ds[split]
    if field not in ds.column_names:
        _field_text(None, str(p), field, ds.column_names)
    size = sum(Path(f["filename"]).stat().st_size for f in ds.cache_files) or 1
    rows = max(1, len(ds))

    def pieces() -> Iterator[tuple[str, bool, int]]:
        seen = 0
        for batch in ds.select_columns([field]).iter(batch_size=PARQUET_BATCH_ROWS):
            for value in batch[field]:
                seen += 1
                yield _field_text(value, f"{p}: row {seen}", field, None), True, size * seen // rows
    return Input(str(p), size, pieces)


def batches(inputs: list[Input]) -> Iterator[tuple[list[str | bytes], list[bool], int]]:
    """``(texts, ends_document, bytes_read_of_all_inputs)`` in batches of about ``DOC_BATCH_BYTES``."""
    texts: list[str | bytes] = []
    ends: list[bool] = []
    before, held, done = 0, 0, 0
    for source in inputs:
        for text, end, read in source.pieces():
            texts.append(text)
            ends.append(end)
            held += len(text)
            done = before + read
            if held >= DOC_BATCH_BYTES:
                yield texts, ends, done
                texts, ends, held = [], [], 0
        before += source.size_bytes
        done = before
    if texts:
        yield texts, ends, done


def join_ids(ids: list[list[int] | np.ndarray], ends: list[bool], eos_id: int | None) -> np.ndarray:
    """One flat int64 array of the pieces' ids, ``eos_id`` after each piece that ends a document."""
    eos = np.array([eos_id], dtype=np.int64) if eos_id is not None else None
    parts = []
    for row, end in zip(ids, ends):
        parts.append(np.asarray(row, dtype=np.int64))
        if end and eos is not None:
            parts.append(eos)
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _as_text(piece: str | bytes) -> str:
    return piece if isinstance(piece, str) else piece.decode("utf-8", errors="replace")


def _as_bytes(piece: str | bytes) -> np.ndarray:
    return np.frombuffer(piece if isinstance(piece, bytes) else piece.encode("utf-8"), dtype=np.uint8)


def load_encoder(tokenizer: str | Path | None, eos: str | None = None) -> Encoder:
    """The tokenizer at ``tokenizer`` (None: byte-level) with its end-of-document token resolved."""
    if tokenizer is None:
        if eos not in (None, NO_EOS):
            raise HetrainError(f"--eos {eos}: byte-level data (no --tokenizer) has no end-of-document token; "
                               f"every id of its 256 is a byte")
        return Encoder("bytes", 256, None, lambda texts: [_as_bytes(t) for t in texts], None)
    p = Path(tokenizer)
    file = p / "tokenizer.json" if p.is_dir() else p
    if p.is_dir() and not file.is_file():
        return _transformers_encoder(p, eos)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise HetrainError("--tokenizer needs the tokenizers package: pip install 'hetrain[data]'") from None
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust library raises a plain Exception
        raise HetrainError(f"--tokenizer {file}: not a tokenizer.json the tokenizers library reads ({e})") from None
    named = eos if eos is not None else _configured_eos(p if p.is_dir() else p.parent)
    eos_id = _resolve_eos(named, tok.token_to_id, str(file), eos is not None)

    def encode(texts: list[str | bytes]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch_fast([_as_text(t) for t in texts], add_special_tokens=False)]
    return Encoder(str(file), tok.get_vocab_size(with_added_tokens=True), eos_id, encode, str(file.resolve()))


def _configured_eos(directory: Path) -> str | None:
    """``eos_token`` of a transformers ``tokenizer_config.json`` beside the tokenizer, if there is one."""
    config = directory / "tokenizer_config.json"
    try:
        token = json.loads(config.read_text()).get("eos_token") if config.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        raise HetrainError(f"{config}: expected a JSON object (transformers' tokenizer_config.json)") from None
    if isinstance(token, dict):  # transformers writes AddedToken as {"content": ..., ...}
        token = token.get("content")
    return token if isinstance(token, str) else None


def _resolve_eos(named: str | None, token_to_id: Callable[[str], int | None], where: str, explicit: bool) -> int | None:
    if named == NO_EOS:
        return None
    if named is not None:
        found = token_to_id(named)
        if found is None:
            raise HetrainError(f"--eos {named}: not a token of {where}" if explicit else
                               f"{where}: its tokenizer_config.json names eos_token {named!r}, which it lacks; "
                               f"name one with --eos")
        return found
    for candidate in EOS_CANDIDATES:
        found = token_to_id(candidate)
        if found is not None:
            return found
    raise HetrainError(f"{where}: no end-of-document token found (tried {', '.join(EOS_CANDIDATES)}); "
                       f"name one with --eos TOKEN, or --eos {NO_EOS} to join documents without one")


def _transformers_encoder(p: Path, eos: str | None) -> Encoder:
    """A directory with no ``tokenizer.json``: a slow tokenizer, which only transformers reads."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise HetrainError(f"--tokenizer {p}: no tokenizer.json in the directory; a slow (sentencepiece) "
                           f"tokenizer needs transformers: pip install 'hetrain[hf]'") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, ImportError for a missing backend
        raise HetrainError(f"--tokenizer {p}: transformers cannot load it ({e})") from None
    named = eos if eos is not None else tok.eos_token
    eos_id = _resolve_eos(named, lambda t: tok.convert_tokens_to_ids(t) if t in tok.get_vocab() else None,
                          str(p), eos is not None)

    def encode(texts: list[str | bytes]) -> list[list[int]]:
        return list(tok([_as_text(t) for t in texts], add_special_tokens=False)["input_ids"])
    return Encoder(str(p), len(tok), eos_id, encode, str(p.resolve()))
