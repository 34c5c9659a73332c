"""The backup's retry rule and the remote probe, without training (fast)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetrain.checkpoint.backup import PROBE_NAME, is_permanent, probe_remote, with_retries
from hetrain.config import CheckpointConfig
from hetrain.errors import HetrainError


class NoCredentialsError(Exception):  # botocore's name: matched by name, botocore is s3fs's business
    pass


@pytest.mark.parametrize("error", [FileNotFoundError("The specified bucket does not exist"), PermissionError("denied"),
                                   NotADirectoryError("x"), NoCredentialsError("Unable to locate credentials")])
def test_errors_a_retry_meets_again_are_raised_at_once(error):
    calls = []

    def fail():
        calls.append(1)
        raise error

    with pytest.raises(type(error)):
        with_retries("upload", fail, retries=5, first_delay_s=0.001)
    assert len(calls) == 1 and is_permanent(error)


def test_other_errors_are_retried_until_they_pass():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset by peer")
        return "ok"

    assert with_retries("upload", flaky, retries=5, first_delay_s=0.001) == "ok" and len(calls) == 3


def test_the_probe_leaves_nothing_behind_and_names_the_url(tmp_path: Path):
    target = tmp_path / "backups" / "run"
    probe_remote(CheckpointConfig(local_dir=str(tmp_path / "ckpt"), remote_url=f"file://{target}"))
    assert target.is_dir() and not [p for p in target.iterdir() if p.name.startswith(PROBE_NAME)]
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(HetrainError, match=f"--remote file://{blocker}/run: cannot write there"):
        probe_remote(CheckpointConfig(local_dir=str(tmp_path / "ckpt"), remote_url=f"file://{blocker}/run"))
    assert blocker.read_text() == "not a directory"


def test_train_state_is_named_and_old_positional_checkpoints_still_load(tmp_path: Path):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from hetrain.checkpoint.save import load_training_state, training_state
    from hetrain.spec.schedule import LRSchedule

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = LRSchedule.for_run(30)
    named = {**schedule.to_state(), "loss_scale": torch.tensor(1024.0, dtype=torch.float64),
             "good_steps": torch.tensor(7.0, dtype=torch.float64)}
    dcp.save(training_state(model, opt, named), storage_writer=FsspecWriter(str(tmp_path / "new")))
    old = torch.tensor([schedule.lr, schedule.lr_min, schedule.warmup_steps, schedule.decay_steps, 512.0, 3.0],
                       dtype=torch.float64)  # what checkpoints held before the names
    dcp.save(training_state(model, opt, old), storage_writer=FsspecWriter(str(tmp_path / "old")))

    new_state = load_training_state(str(tmp_path / "new"), model, opt)
    assert LRSchedule.from_state(new_state) == schedule and new_state["loss_scale"] == 1024.0
    old_state = load_training_state(str(tmp_path / "old"), model, opt)
    assert old_state["loss_scale"] == 512.0 and old_state["good_steps"] == 3.0
    restored = LRSchedule.from_state(old_state)
    assert restored.total_steps is None and restored.planned_steps == 30 and restored.lr_at(5) == schedule.lr_at(5)


def test_a_store_that_does_not_answer_is_a_warning_not_a_refusal(tmp_path: Path, monkeypatch, botocore_tries_once):
    """Down for now (nothing listens): the run starts and its uploads retry; misconfigured stores refuse."""
    from hetrain.runtime.launch import free_port

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    down = CheckpointConfig(local_dir=str(tmp_path / "ckpt"), remote_url="s3://bucket/run",
                            remote_options={"endpoint_url": f"http://127.0.0.1:{free_port()}"})
    said = probe_remote(down)
    assert said.startswith("--remote s3://bucket/run does not answer (EndpointConnectionError")
    assert "training starts and each checkpoint's upload retries (5 times)" in said
