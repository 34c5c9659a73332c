"""One owner for a run's start (``hetrain.run``): the CLI, the Python API and the train flow hand the same
``RunRequest`` to ``start_run``, and bad inputs given to the flow are one line before it profiles or plans."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from typer.testing import CliRunner

import flows.train
import hetrain
import hetrain.run.start
from hetrain.cli import app
from hetrain.config import TrainOptions
from hetrain.errors import HetrainError

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "examples/clusters/cpu-emulated.yaml"
MODEL = ROOT / "examples/models/gpt-tiny.yaml"
DATA = ROOT / "examples/data/tiny.txt"


class Reached(Exception):
    """Raised by the stand-in for start_run once it has the request: nothing trains in these tests."""


def test_the_cli_the_api_and_the_flow_hand_start_run_the_same_request(tmp_path, monkeypatch):
    plan = hetrain.plan(CLUSTER, MODEL, global_batch_size=8, time_limit_s=5).plan
    plan_file = tmp_path / "p.json"
    plan.write(plan_file)
    seen = []

    def reached(request, hooks=None):
        seen.append(request)
        raise Reached

    monkeypatch.setattr(hetrain.run.start, "start_run", reached)
    monkeypatch.setattr(flows.train, "start_run", reached)
    monkeypatch.setattr(flows.train, "get_run_logger", lambda: logging.getLogger("test"))
    run_dir = tmp_path / "runs" / "same"
    result = CliRunner().invoke(app, ["train", "--plan", str(plan_file), "--cluster", str(CLUSTER), "--run-dir",
                                      str(run_dir), "--steps", "7", "--lr", "0.001", "--data", str(DATA)])
    assert isinstance(result.exception, Reached), result.output
    with pytest.raises(Reached):
        hetrain.train(plan_file, run_dir, cluster=CLUSTER, steps=7, lr=0.001, data=str(DATA))
    with pytest.raises(Reached):
        flows.train.train_run.fn("same", str(tmp_path / "runs"), json.loads(plan.to_json()), str(CLUSTER),
                                 TrainOptions(steps=7, lr=0.001, data=str(DATA)), None, "aws", 1.0)
    cli, api, flow = seen
    assert cli == api
    assert cli.run_dir == run_dir.resolve() and cli.run_id == "same" and cli.options.lr == 0.001
    # the one difference, by design: a scheduled run whose last attempt left no checkpoint starts over
    assert flow.start_over_without_checkpoint and not cli.start_over_without_checkpoint
    assert flow.model_copy(update={"start_over_without_checkpoint": False}) == cli


@pytest.mark.parametrize("bad", ["data", "init_from"])
def test_the_flow_refuses_bad_data_or_weights_in_one_line_before_it_profiles(tmp_path, monkeypatch, bad):
    profiled = []
    monkeypatch.setattr(flows.train, "profile", lambda *a, **k: profiled.append(a))
    if bad == "data":
        path = tmp_path / "short.bin"
        path.write_bytes(b"\x01\x00" * 3)
    else:  # the weights of another model: a transformers config of another width
        path = tmp_path / "other"
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 48,
                                                      "num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "intermediate_size": 96, "vocab_size": 300}))
    with pytest.raises(HetrainError) as e:
        flows.train.train.fn(options=TrainOptions(**{bad: str(path)}), runs_root=str(tmp_path / "runs"))
    assert str(path.name) in str(e.value) and "\n" not in str(e.value)
    assert not profiled and not (tmp_path / "runs").exists()
