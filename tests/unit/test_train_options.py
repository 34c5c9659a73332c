"""One declaration of a training run's options: `hetrain train` and the train flow take the same model (fast)."""

from __future__ import annotations

import inspect

import pytest
import typer.main

from hetrain.cli import app
from hetrain.config import TrainOptions
from tests.helpers import run_cli

# The command line users script against: a change here is a change to the interface (torchtitan freezes its CLI too).
FROZEN_TRAIN_OPTIONS = [
    "--checkpoint-dir", "--checkpoint-every", "--checkpoint-host-memory-gb", "--checkpoint-when-busy", "--checkpoints",
    "--cluster", "--compile", "--data", "--decay-steps", "--dump-dir", "--fp8", "--init-from", "--keep", "--lr", "--lr-min", "--main-address", "--max-grad-norm", "--metrics", "--model",
    "--more-steps", "--no-checkpoints", "--no-print-launch", "--no-trace-memory", "--optimizer", "--peer", "--plan",
    "--precision", "--print-launch", "--remote", "--remote-endpoint", "--restart", "--resume", "--run-dir", "--run-id",
    "--seed", "--steps", "--sync-checkpoints", "--trace-memory", "--upload-retries", "--warmup-steps"]


def _train_command():
    return typer.main.get_command(app).commands["train"]


def test_the_train_command_line_is_frozen():
    cmd = _train_command()
    assert sorted(o for p in cmd.params for o in p.opts + p.secondary_opts) == FROZEN_TRAIN_OPTIONS


def test_every_option_of_a_run_is_a_cli_option_with_the_same_default_and_the_flow_takes_the_model():
    from flows.train import train as train_flow

    cli = {p.name: p for p in _train_command().params}
    for name, info in TrainOptions.model_fields.items():
        assert name in cli, name
        assert cli[name].default == info.default, name
        assert (info.description or "") in (cli[name].help or ""), name
    flow_params = inspect.signature(train_flow.fn).parameters
    assert flow_params["options"].annotation in (TrainOptions, "TrainOptions")
    assert flow_params["options"].default == TrainOptions()
    # nothing of a run's options is declared again beside the model
    assert not set(flow_params) & set(TrainOptions.model_fields)


@pytest.mark.parametrize("args, expected", [
    (["--lr", "0"], "--lr: input should be greater than 0, got 0.0"),
    (["--no-checkpoints", "--remote", "s3://b/r"], "options: checkpoints is off: cannot be given with remote"),
    (["--optimizer", "lion"], "'lion' is not one of 'adamw', 'sgd'"),
])
def test_a_bad_option_is_one_line_naming_it(tmp_path, args, expected):
    from tests.helpers.training import asymmetric_plan

    asymmetric_plan(1).write(tmp_path / "plan.json")
    r = run_cli("train", "--plan", str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "run"), *args)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert expected in r.stderr
    assert not (tmp_path / "run").exists()
