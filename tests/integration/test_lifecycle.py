"""A run's lifecycle from the command line: re-run resumes, --restart archives, signals stop, bad plans and paths refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetrain.runtime.launch import worker_pids
from tests.helpers import ROOT, run_cli
from tests.helpers.training import asymmetric_plan, processes_of


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train(tmp_path: Path, *extra: str):
    return run_cli("train", "--plan", str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "run"),
                   "--lr", "3e-3", "--warmup-steps", "1", "--decay-steps", "10", *extra)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> tuple[Path, list[dict], str]:
    """A finished run of 6 steps without checkpoints, its plan in its own run directory (``--plan R/plan.json
    --run-dir R``): the directory, its records and its metrics file.

    Shared (three training runs fewer): the first test below compares a resumed run's curve with its
    records; the second re-runs it (refused, then ``--restart``, which archives it and keeps the plan
    the new run reads, then extends the new run).
    """
    run_dir = tmp_path_factory.mktemp("finished") / "R"
    run_dir.mkdir()
    asymmetric_plan(1).write(run_dir / "plan.json")
    r = _train_in(run_dir, "--steps", "6", "--no-checkpoints")
    assert r.returncode == 0, r.stderr
    return run_dir, _records(run_dir), (run_dir / "metrics.jsonl").read_text()


def _train_in(run_dir: Path, *extra: str):
    """``_train`` of the plan kept in the run directory itself."""
    return run_cli("train", "--plan", str(run_dir / "plan.json"), "--run-dir", str(run_dir),
                   "--lr", "3e-3", "--warmup-steps", "1", "--decay-steps", "10", *extra)


def test_rerun_resumes_and_continues_the_same_curve_and_a_local_remote_is_made_and_backed_up(tmp_path: Path,
                                                                                             finished_run):
    """The same command with more steps resumes after its newest checkpoint and trains the losses of a run
    that was never stopped. Its remote, a local directory that did not exist, is made as a local disk
    would be and holds the committed checkpoints, and the remote's probe leaves nothing behind."""
    from hetrain.checkpoint.store import CheckpointStore

    asymmetric_plan(1).write(tmp_path / "plan.json")
    backup = tmp_path / "backup" / "run"  # neither exists yet: a directory remote is made as for a local disk
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt" / "{node}"), "--checkpoint-every", "2",
            "--remote", f"file://{backup}"]
    r = _train(tmp_path, "--steps", "4", *ckpt)
    assert r.returncode == 0, r.stdout + r.stderr
    assert CheckpointStore(f"file://{backup}").committed_steps() == [1, 3]
    assert not [p for p in backup.iterdir() if p.name.startswith(".hetrain-probe")]
    r = _train(tmp_path, "--steps", "6", *ckpt)  # the same command, more steps: resumes after step 3
    assert r.returncode == 0, r.stderr
    assert "resuming after step 3" in r.stdout
    resumed = _records(tmp_path / "run")
    assert [x["step"] for x in resumed] == list(range(6))
    # an uninterrupted run of 6 steps (without checkpoints) has the same losses
    want = [x["loss"] for x in finished_run[1]]
    assert len(want) == 6
    assert max(abs(a["loss"] - b) / b for a, b in zip(resumed, want)) < 1e-5


def test_rerun_without_checkpoints_is_refused_restart_archives_and_the_new_run_checkpoints_by_default_and_extends(
        finished_run):
    """A finished run without checkpoints, run again: refused (one line), untouched. `--plan R/plan.json --run-dir R
    --restart`: the old run goes to the archive, the plan stays where the new run reads it and the archive gets a
    copy. The new run, given no checkpoint option at all, checkpoints by default; the same command without
    `--restart` and with more steps resumes after its checkpoint and stretches the learning-rate decay."""
    from hetrain.checkpoint.store import CheckpointStore
    from hetrain.spec.schedule import LRSchedule

    run_dir, _, before = finished_run
    assert (run_dir / "metrics.jsonl").read_text() == before
    r = _train_in(run_dir, "--steps", "6", "--no-checkpoints")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "holds a previous run (config.json, metrics.jsonl with 6 steps) with no committed checkpoint" in r.stderr
    assert "--restart" in r.stderr and (run_dir / "metrics.jsonl").read_text() == before
    argv = ["train", "--plan", str(run_dir / "plan.json"), "--run-dir", str(run_dir), "--lr", "3e-3"]
    r = run_cli(*argv, "--steps", "4", "--restart")  # no checkpoint option, no schedule option
    assert r.returncode == 0, r.stderr
    (archived,) = (run_dir / "archive").iterdir()
    assert (archived / "metrics.jsonl").read_text() == before
    assert (run_dir / "plan.json").is_file() and (archived / "plan.json").is_file()
    assert [x["step"] for x in _records(run_dir)] == [0, 1, 2, 3]
    roots = sorted((run_dir / "checkpoints").iterdir())
    assert roots and all(CheckpointStore(str(root)).committed_steps() == [3] for root in roots)
    r = run_cli(*argv, "--steps", "8")  # the same command, a longer run: resumes after step 3
    assert r.returncode == 0, r.stderr
    assert "planned for 4 steps and now trains to 8" in r.stdout
    records = _records(run_dir)
    planned = LRSchedule.for_run(4, lr=3e-3)
    extended = planned.extended_to(8)
    assert [x["step"] for x in records] == list(range(8))
    assert [x["lr"] for x in records[4:]] == pytest.approx([extended.lr_at(s) for s in range(4, 8)])
    assert records[4]["lr"] > 2 * planned.lr_min  # not the floor the 4-step run ended at
    assert records[4]["lr_schedule_extended"]["to_steps"] == 8


def test_metrics_path_that_is_not_a_metrics_file_is_never_touched(tmp_path: Path):
    asymmetric_plan(1).write(tmp_path / "plan.json")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the corpus\n" * 100)
    r = _train(tmp_path, "--steps", "2", "--metrics", str(corpus), "--data", str(corpus))
    assert r.returncode == 2 and f"--metrics {corpus}: is the --data this command reads" in r.stderr
    r = _train(tmp_path, "--steps", "2", "--metrics", str(corpus))
    assert r.returncode == 2 and "is not a hetrain metrics file" in r.stderr
    assert corpus.read_text() == "the corpus\n" * 100


def test_plan_whose_micro_batches_do_not_add_up_is_refused_without_a_cluster(tmp_path: Path):
    data = json.loads(asymmetric_plan(1).to_json())
    data["pipelines"][0]["num_microbatches"] += 1  # 5 micro-batches of 2 for a batch of 8
    (tmp_path / "plan.json").write_text(json.dumps(data))
    r = _train(tmp_path, "--steps", "1")
    assert r.returncode == 2
    assert "pipelines process 5 micro-batches but global batch 8 / micro-batch 2 = 4" in r.stderr
    assert not (tmp_path / "run").exists()


def test_sigterm_stops_every_worker_and_a_second_train_is_refused_meanwhile(tmp_path: Path):
    asymmetric_plan(1).write(tmp_path / "plan.json")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hetrain", "train", "--plan", str(tmp_path / "plan.json"),
                             "--steps", "100000", "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.5)
    assert len(list((run_dir / "pids").glob("*.pid"))) == 3
    # a second `hetrain train` on the same run directory while it runs: refused, the running one untouched
    second = run_cli("train", "--plan", str(tmp_path / "plan.json"), "--steps", "100000", "--run-dir", str(run_dir))
    assert second.returncode == 2 and second.stderr.strip().splitlines() == [
        f"error: --run-dir {run_dir}: another hetrain train is running this run (pid {proc.pid}); wait for it, stop "
        f"it, or choose another run directory"], second.stderr
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "SIGTERM: every training process of this run has been stopped" in stderr
    time.sleep(0.5)
    assert not worker_pids(run_dir)


def test_no_checkpoints_cannot_be_combined_with_a_checkpoint_place(tmp_path: Path):
    asymmetric_plan(1).write(tmp_path / "plan.json")
    r = _train(tmp_path, "--steps", "2", "--no-checkpoints", "--remote", str(tmp_path / "backup"))
    assert r.returncode == 2 and "checkpoints is off: cannot be given with remote" in r.stderr
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def s3_endpoint():
    """An S3 API on loopback (moto server mode) with one bucket, 'lifecycle-backups'."""
    from tests.helpers.training import moto_bucket

    with moto_bucket("lifecycle-backups") as (endpoint, _):
        yield endpoint


def test_a_missing_bucket_is_one_line_before_any_step(tmp_path: Path, s3_endpoint):
    asymmetric_plan(1).write(tmp_path / "plan.json")
    r = _train(tmp_path, "--steps", "2", "--remote", "s3://no-such-bucket/run", "--remote-endpoint", s3_endpoint)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: --remote s3://no-such-bucket/run: cannot write there (no such bucket or directory); expected an "
        "existing bucket or directory this machine's credentials can write to"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# -- issue 48: a killed run stops training --------------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _newest_committed(run_dir: Path) -> int | None:
    from hetrain.checkpoint.store import CheckpointStore

    per_node = [set(CheckpointStore(str(root)).committed_steps()) for root in (run_dir / "checkpoints").iterdir()] \
        if (run_dir / "checkpoints").is_dir() else []
    both = set.intersection(*per_node) if len(per_node) == 2 else set()
    return max(both) if both else None


def test_kill_9_of_train_its_group_or_its_launcher_leaves_nothing_training_and_a_rerun_resumes(tmp_path: Path):
    """Each kill ends every process of the run within 5 s; the next round, an immediate re-run of the same command,
    resumes after the newest step committed before it (no orphan commits a later one meanwhile)."""
    asymmetric_plan(1).write(tmp_path / "plan.json")
    run_dir = (tmp_path / "run").resolve()
    argv = [sys.executable, "-m", "hetrain", "train", "--plan", str(tmp_path / "plan.json"), "--run-dir", str(run_dir),
            "--checkpoint-every", "1", "--steps", "100000"]
    resumed_after = None
    for target in ("launcher", "group", "process"):
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                start_new_session=True)  # its own group, as a shell's job: killpg reaches only it
        try:
            deadline = time.monotonic() + 120
            first = resumed_after if resumed_after is not None else -1
            while (_newest_committed(run_dir) or -1) < first + 2 and time.monotonic() < deadline:
                assert proc.poll() is None, proc.communicate()[0]
                time.sleep(0.2)
            assert (_newest_committed(run_dir) or -1) >= first + 2, "no new checkpoint in 120 s"
            launchers = _children(proc.pid)
            # train, launcher, its fork server, 3 workers
            assert len(launchers) == 1 and len(processes_of(run_dir)) >= 5
            if target == "launcher":
                os.kill(launchers[0], signal.SIGKILL)
            elif target == "group":
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                os.kill(proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            output = proc.communicate(timeout=30)[0]
            while processes_of(run_dir) and time.monotonic() < killed + 5:
                time.sleep(0.1)
            assert not processes_of(run_dir), (target, processes_of(run_dir), output[-2000:])
        finally:
            if proc.poll() is None:
                proc.kill()
        newest = _newest_committed(run_dir)
        time.sleep(1.0)
        assert _newest_committed(run_dir) == newest  # nothing trains on: no step is committed after the kill
        if target == "launcher":  # hetrain train saw its launcher die: one line, and it stopped every worker
            assert proc.returncode == 2 and "Traceback" not in output, output[-2000:]
        if resumed_after is not None:  # an immediate re-run of the same command: resumed where the kill left it
            assert f"resuming after step {resumed_after} " in output, output[-2000:]
        resumed_after = newest
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(len(steps))) and steps[-1] >= resumed_after, steps  # each step once: no overlap
