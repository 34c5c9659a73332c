"""Reading the user's files and writing where the user pointed: one-line errors, nothing half-written.

Every input file of hetrain (cluster, model, plan, profile, run config) is small UTF-8 text;
anything else (a checkpoint shard, a corpus, a binary) is the wrong file and is named as such
instead of failing deep inside a parser. Every output path is checked *before* the work that
produces it (a plan, a profile, a training run), so a typo costs a second, not the work.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from hetrain.errors import HetrainError

MAX_INPUT_BYTES = 64 << 20  # specs, plans and profiles are kilobytes; 64 MB is a plan for ~100k GPUs
MAX_NESTING = 64  # a plan nests 6 deep; 64 is far past any file of ours and far short of Python's recursion limit
MAX_INT_DIGITS = 40  # 2**128 has 39 digits: a longer integer is no count of ours (and slow to parse)
# Values in a file once YAML's aliases are expanded: a 65,536-GPU cluster file of single-GPU nodes is ~500k;
# a 500-byte "billion laughs" file expands to 10^9 (each validation error would print them all).
MAX_EXPANDED_VALUES = 1_000_000


def read_text(path: str | Path) -> str:
    """The file's text; HetrainError naming the file when it is missing, a directory, huge or not UTF-8."""
    p = Path(path)
    if p.is_dir():
        raise HetrainError(f"{p}: is a directory, expected a file")
    if not p.is_file():
        raise HetrainError(f"{p}: file not found")
    size = p.stat().st_size
    if size > MAX_INPUT_BYTES:
        raise HetrainError(f"{p}: {size / 1e6:.0f} MB is not a hetrain spec, plan or profile (at most "
                           f"{MAX_INPUT_BYTES >> 20} MB); wrong file?")
    try:
        return p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise HetrainError(f"{p}: not a UTF-8 text file (byte {e.start}); expected YAML or JSON") from None
    except OSError as e:
        raise HetrainError(f"{p}: cannot read ({e.strerror or e})") from None


class _Refused(ValueError):
    """What the readers below refuse, with the reason."""


def _checked_int(text: str) -> int:
    if len(text.lstrip("+-")) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _unique_keys(pairs: list) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise _Refused(f"the key {key!r} is given twice")
        seen[key] = value
    return seen


def _bounded(data: Any) -> None:
    """Nesting at most ``MAX_NESTING`` deep and at most ``MAX_EXPANDED_VALUES`` values, counting each use of
    a shared (aliased) value again, as everything that walks the data later will; stops at the first excess."""
    stack, seen = [(data, 1)], 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if depth > MAX_NESTING:
            raise _Refused(f"nested more than {MAX_NESTING} deep")
        if seen > MAX_EXPANDED_VALUES:
            raise _Refused(f"more than {MAX_EXPANDED_VALUES:,} values once its aliases are expanded")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children)


def parse_json(text: str, source: str) -> Any:
    """JSON as every reader of ours takes it: no duplicate keys, no giant integers, bounded nesting.

    One HetrainError line naming ``source`` otherwise (never a traceback, never minutes of work).
    """
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys, parse_int=_checked_int)
        _bounded(data)
        return data
    except json.JSONDecodeError as e:
        raise HetrainError(f"{source}: line {e.lineno}, column {e.colno}: invalid JSON ({e.msg})") from None
    except _Refused as e:
        raise HetrainError(f"{source}: invalid JSON ({e})") from None
    except RecursionError:
        raise HetrainError(f"{source}: invalid JSON (nested more than {MAX_NESTING} deep)") from None


# libyaml's parser where PyYAML was built with it (its wheels are): a 10,240-GPU cluster file (5,000 lines) parses in
# 0.1 s where the pure-Python one takes 0.5 s, every command reading it. Its parser refuses nesting past 1,000
# levels itself; ``_bounded`` holds the data to MAX_NESTING after construction (the constructor is Python in both).
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _StrictYamlLoader(_SAFE_LOADER):
    """YAML's safe loader without duplicate keys (the last one silently won), integers of thousands of digits or
    unbounded nesting (``_bounded``); aliases stay (anchors for repeated node specs are common) but their expansion
    is bounded (``_bounded``: a 500-byte file must not expand to gigabytes)."""

    def construct_mapping(self, node, deep=False):
        # the keys written here, before a merge key ("<<: *base") brings in the ones it overrides
        written = [k for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"]
        keys = [self.construct_object(k, deep=True) for k in written]
        for i, key in enumerate(keys):
            if key in keys[:i]:
                raise _Refused(f"line {written[i].start_mark.line + 1}: the key {key!r} is given twice")
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        digits = str(node.value).replace("_", "").lstrip("+-")
        if len(digits) > MAX_INT_DIGITS:
            raise _Refused(f"line {node.start_mark.line + 1}: an integer of {len(digits)} digits "
                           f"(at most {MAX_INT_DIGITS})")
        return super().construct_yaml_int(node)


_StrictYamlLoader.add_constructor("tag:yaml.org,2002:int", _StrictYamlLoader.construct_yaml_int)


def parse_yaml(text: str, source: str) -> Any:
    """YAML as every reader of ours takes it (``_StrictYamlLoader``); one HetrainError line naming ``source``."""
    try:
        data = yaml.load(text, Loader=_StrictYamlLoader)  # noqa: S506 - a SafeLoader subclass
        _bounded(data)
        return data
    except _Refused as e:
        raise HetrainError(f"{source}: invalid YAML ({e})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise HetrainError(f"{source}: {where}invalid YAML ({problem})") from None
    except RecursionError:
        raise HetrainError(f"{source}: invalid YAML (nested more than {MAX_NESTING} deep)") from None


def read_versioned_json(path: str | Path, schema: str) -> dict:
    """A JSON file contract (``{"schema": "hetrain.<kind>/v1", ...}``): the object, or one line on what is wrong."""
    p = Path(path)
    data = parse_json(read_text(p), str(p))
    if not isinstance(data, dict) or data.get("schema") != schema:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise HetrainError(f"{p}: schema: expected '{schema}', got {got!r}")
    return data


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _probe_writable(directory: Path, what: str) -> None:
    """Create and remove a file in ``directory``: the one test that also catches read-only mounts for root."""
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".hetrain-write-test-")
    except OSError as e:
        raise HetrainError(f"{what}: cannot write in {directory} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(tmp)


def check_output_dir(path: str | Path, what: str) -> None:
    """HetrainError unless ``path`` is (or can be created as) a directory this process can write in.

    Nothing is created: the probe runs in the nearest existing ancestor.
    """
    p = Path(path).absolute()
    if p.exists() and not p.is_dir():
        raise HetrainError(f"{what} {path}: is a file, expected a directory")
    base = _nearest_existing(p)
    if not base.is_dir():
        raise HetrainError(f"{what} {path}: {base} is a file, not a directory")
    _probe_writable(base, f"{what} {path}")


def check_output_file(path: str | Path, what: str, inputs: dict[str, str | Path | None] | None = None) -> None:
    """HetrainError unless a file can be written at ``path`` (parents created when needed).

    An output replaces only a regular file (never a device, pipe or socket: as root, ``--out
    /dev/null`` would replace the real one), and never a file the same command reads:
    ``inputs`` maps each input option (``--text``) to its path.
    """
    p = Path(path)
    if p.is_dir():
        raise HetrainError(f"{what} {path}: is a directory, expected a file path")
    if p.exists() and not p.is_file():
        raise HetrainError(f"{what} {path}: is not a regular file (a device, pipe or socket); expected a file path")
    for option, source in (inputs or {}).items():
        if source is not None and p.exists() and Path(source).exists() and os.path.samefile(p, source):
            raise HetrainError(f"{what} {path}: is the {option} this command reads; choose another path")
    base = _nearest_existing(p.absolute().parent)
    if not base.is_dir():
        raise HetrainError(f"{what} {path}: {base} is a file, not a directory")
    _probe_writable(base, f"{what} {path}")


def write_text_atomic(path: str | Path, text: str, what: str = "output") -> None:
    """Write through a temporary file and a rename: a reader never sees half a file, a failure leaves none.

    A path that cannot be written is one HetrainError (callers that do expensive work first
    check it up front with ``check_output_file``; this does not probe again).
    """
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    except OSError as e:
        raise HetrainError(f"{what} {path}: cannot write there ({e.strerror or e})") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, p)
    except IsADirectoryError:
        Path(tmp).unlink(missing_ok=True)
        raise HetrainError(f"{what} {path}: is a directory, expected a file path") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
