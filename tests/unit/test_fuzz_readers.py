"""Fuzzing the readers of untrusted input (Hypothesis): specs, plans, profiles, manifests and token files.

Whatever the bytes, a reader returns what it reads or raises ``HetrainError`` (never another
exception, never minutes of work); through the command line that is exit 2, one ``error:``
line and nothing written. Deadlines bound each example's time. The examples are few (the
suite's budget); ``HYPOTHESIS_PROFILE=deep`` runs many more.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetrain.checkpoint.manifest import parse_manifest
from hetrain.cli import main
from hetrain.errors import HetrainError
from hetrain.plan.schema import load_plan
from hetrain.profiling.profile import load_profile
from hetrain.runtime.data import TokenSource
from hetrain.spec.specs import load_cluster, load_model
from tests.helpers import EXAMPLES

settings.register_profile("suite", max_examples=40, deadline=3000, derandomize=True,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.register_profile("deep", max_examples=2000, deadline=3000,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))

CLUSTER = EXAMPLES / "clusters" / "cpu-emulated.yaml"
MODEL = EXAMPLES / "models" / "gpt-tiny.yaml"

# JSON-like values: what YAML and JSON files decode to, nested a few levels, with the edge scalars
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                          max_size=5), max_leaves=20)


def mutated(base: dict) -> st.SearchStrategy:
    """A real file's fields with some replaced by arbitrary values, some removed, some added."""
    keys = sorted(base)
    return st.tuples(st.dictionaries(st.sampled_from(keys), values, max_size=3),
                     st.lists(st.sampled_from(keys), max_size=2, unique=True),
                     st.dictionaries(st.text(max_size=10), values, max_size=2)).map(
        lambda t: {**{k: v for k, v in base.items() if k not in t[1]}, **t[0], **t[2]})


@contextmanager
def scratch() -> Iterator[Path]:
    """A fresh directory for one example, removed after it: hundreds of examples leave none behind
    (``tmp_path_factory.mktemp`` kept one per example until pytest's cleanup of old runs)."""
    with tempfile.TemporaryDirectory(prefix="hetrain-fuzz-") as d:
        yield Path(d)


def _reads_or_refuses(read, path: Path) -> None:
    try:
        read(path)
    except HetrainError as e:
        assert str(e) and "\n" not in str(e)


@given(data=st.binary(max_size=2000))
def test_any_bytes_as_a_model_or_cluster_file(data):
    with scratch() as d:
        path = d / "x.yaml"
        path.write_bytes(data)
        _reads_or_refuses(load_model, path)
        _reads_or_refuses(load_cluster, path)


@given(doc=mutated(yaml.safe_load(MODEL.read_text())))
def test_a_model_file_with_fields_of_any_value(doc):
    with scratch() as d:
        path = d / "model.yaml"
        path.write_text(yaml.safe_dump(doc))
        _reads_or_refuses(load_model, path)


@given(doc=mutated(yaml.safe_load(CLUSTER.read_text())))
def test_a_cluster_file_with_fields_of_any_value(doc):
    with scratch() as d:
        path = d / "cluster.yaml"
        path.write_text(yaml.safe_dump(doc))
        _reads_or_refuses(load_cluster, path)


@pytest.fixture(scope="module")
def plan_doc(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    old = sys.argv
    sys.argv = ["hetrain", "plan", "--cluster", str(CLUSTER), "--model", str(MODEL), "--global-batch-size", "16",
                "--out", str(out)]
    try:
        assert main() == 0
    finally:
        sys.argv = old
    return json.loads(out.read_text())


def test_plans_profiles_and_manifests_with_fields_of_any_value(plan_doc):
    @given(doc=mutated(plan_doc), raw=st.binary(max_size=500))
    def check(doc, raw):
        with scratch() as d:
            (d / "plan.json").write_text(json.dumps(doc))
            _reads_or_refuses(load_plan, d / "plan.json")
            (d / "profile.json").write_text(json.dumps({**doc, "schema": "hetrain.profile/v1"}))
            _reads_or_refuses(load_profile, d / "profile.json")
        manifest = {"schema": "hetrain.checkpoint/v1", "run_id": "r", "step": 1, "model": doc.get("model"),
                    "plan": doc, "optimizer": "adamw", "files": doc.get("pipelines")}
        for text in (json.dumps(manifest), raw):
            try:
                parse_manifest(text, "peer x")
            except HetrainError as e:
                assert "\n" not in str(e)

    check()


@given(tokens=st.binary(max_size=600), meta=st.one_of(st.none(), values, st.binary(max_size=60)))
def test_token_files_of_any_bytes_and_description(tokens, meta):
    with scratch() as d:
        (d / "x.bin").write_bytes(tokens)
        if isinstance(meta, bytes):
            (d / "x.bin.json").write_bytes(meta)
        elif meta is not None:
            (d / "x.bin.json").write_text(json.dumps(meta))
        try:
            source = TokenSource(8, 256, path=d / "x.bin")
            batch = source.sequences(0, 2)
            assert int(batch.max()) < 256 and np.asarray(batch).shape == (2, 9)
        except HetrainError as e:
            assert "\n" not in str(e)


@given(data=st.binary(max_size=1500), which=st.sampled_from(["--cluster", "--model"]))
def test_the_command_line_on_any_bytes_is_exit_2_one_line_nothing_written(capsys, data, which):
    with scratch() as d:
        bad = d / "bad.yaml"
        bad.write_bytes(data)
        args = {"--cluster": str(CLUSTER), "--model": str(MODEL), which: str(bad)}
        old = sys.argv
        sys.argv = ["hetrain", "plan", *[x for kv in args.items() for x in kv], "--global-batch-size", "16",
                    "--out", str(d / "out" / "plan.json")]
        try:
            rc = main()
        finally:
            sys.argv = old
        captured = capsys.readouterr()
        if rc == 0:  # the bytes happened to be a valid file
            return
        lines = [line for line in captured.err.splitlines() if line.strip()]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), captured.err
        assert not (d / "out").exists()


# -- issue 48: JSON lines for `data prepare` (nesting, integers, escapes, surrogates) ---------------------------------
json_line_parts = st.one_of(st.just("["), st.just("]"), st.just("{"), st.just("}"), st.just('"'), st.just(","),
                            st.just(":"), st.just("\\ud800"), st.just("\\udfff"), st.just("\\u0000"),
                            st.just('"text"'), st.integers(min_value=0, max_value=10**60).map(str),
                            st.text(max_size=8))


@given(lines=st.lists(st.one_of(values.map(lambda v: json.dumps({"text": v}) if not isinstance(v, str) else
                                           json.dumps({"text": v})),
                                st.lists(json_line_parts, max_size=30).map("".join),
                                st.integers(min_value=1, max_value=3000).map(lambda n: '{"text": ' + "[" * n)),
                      min_size=1, max_size=4))
def test_json_lines_of_any_shape_prepare_or_refuse_in_one_line(lines):
    from hetrain.runtime.data import prepare_tokens

    with scratch() as d:
        (d / "c.jsonl").write_text("\n".join(lines) + "\n", errors="surrogatepass")
        try:
            meta = prepare_tokens(d / "c.jsonl", d / "out.bin")
            assert meta["num_tokens"] == (d / "out.bin").stat().st_size > 0
        except HetrainError as e:
            assert str(e) and "\n" not in str(e)
            assert sorted(p.name for p in d.iterdir()) == ["c.jsonl"]
