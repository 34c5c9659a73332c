"""Preemption notices from a local fake of each cloud's documented metadata endpoint, SIGTERM,
and the emergency checkpoint the ranks take when asked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hetrain.checkpoint.store import CheckpointStore
from hetrain.config import CheckpointConfig
from hetrain.recovery.preemption import AwsSpot, AzureScheduledEvents, GcpPreempted, PreemptionWatcher
from hetrain.testing.fakecloud import FakeCloudMetadata
from tests.helpers import ROOT
from tests.helpers.training import plan, run


@pytest.fixture
def fake():
    f = FakeCloudMetadata().start()
    yield f
    f.stop()


def test_aws_imdsv2_spot_instance_action(fake):
    source = AwsSpot(fake.url("n1"))
    assert source.poll() is None
    deadline = fake.preempt("n1", 120)
    assert AwsSpot(fake.url("n2")).poll() is None  # only n1 is preempted
    notice = source.poll()
    assert notice.cloud == "aws" and notice.action == "terminate" and notice.deadline == deadline
    assert 100 < notice.seconds_left() <= 120


def test_gcp_preempted(fake):
    source = GcpPreempted(fake.url("n1"))
    assert source.poll() is None
    fake.preempt("n1", 30)
    notice = source.poll()
    assert notice.cloud == "gcp" and 25 < notice.seconds_left() <= 30


def test_azure_scheduled_events_preempt(fake):
    source = AzureScheduledEvents(fake.url("n1"))
    reboot = {"EventId": "1", "EventType": "Reboot", "NotBefore": ""}
    fake.notices["n1"] = {"azure": [reboot]}
    assert source.poll() is None
    when = fake.preempt("n1", 45)
    fake.notices["n1"]["azure"].insert(0, reboot)
    notice = source.poll()
    assert notice.cloud == "azure" and notice.deadline == when


@pytest.mark.parametrize("seconds_ahead,expect_checkpoint", [(120, True), (5, False)])
def test_watcher_requests_a_checkpoint_when_the_deadline_allows(fake, tmp_path: Path, seconds_ahead,
                                                                 expect_checkpoint):
    calls = []
    request = tmp_path / "checkpoint.request"
    watcher = PreemptionWatcher(AwsSpot(fake.url("spot-1")), "spot-1", request_file=request, min_checkpoint_s=10,
                                on_notice=lambda n, c: calls.append((n, c)), poll_s=0.05, log=lambda m: None)
    thread = threading.Thread(target=watcher.run)
    thread.start()
    time.sleep(0.3)
    assert not calls and not request.exists()  # no notice yet: polling on
    fake.preempt("spot-1", seconds_ahead, action="stop")
    thread.join(5)
    assert not thread.is_alive()
    assert len(calls) == 1 and calls[0][1] is expect_checkpoint and calls[0][0].action == "stop"
    assert request.exists() is expect_checkpoint
    assert not watcher.handle(calls[0][0])  # fires once


@pytest.mark.parametrize("recovery_asks", [False, True])
def test_a_deferred_checkpoint_goes_to_the_hook_at_once_and_is_asked_for_if_nobody_did(fake, tmp_path: Path,
                                                                                     recovery_asks):
    """A notice long enough for a switch: the hook runs at once, no checkpoint asked; the watcher asks
    ``min_checkpoint_s`` before the deadline only when the recovery (here: the test) has not."""
    calls = []
    request = tmp_path / "checkpoint.request"
    (tmp_path / "checkpoint.request.done-3").write_text("")  # an earlier notice's answer: not this one's
    watcher = PreemptionWatcher(AwsSpot(fake.url("spot-1")), "spot-1", request_file=request, min_checkpoint_s=10,
                                on_notice=lambda n, c: calls.append((time.monotonic(), c)), poll_s=0.05,
                                log=lambda m: None, defer_checkpoint_s=5)
    fake.preempt("spot-1", 12)
    asked = time.monotonic()
    thread = threading.Thread(target=watcher.run)
    thread.start()
    thread.join(5)
    assert len(calls) == 1 and calls[0][1] is False and calls[0][0] - asked < 2  # at once, no checkpoint
    assert not request.exists() and not list(tmp_path.glob("*.done-*"))
    if recovery_asks:  # the switch asked and the ranks answered at step 7
        (tmp_path / "checkpoint.request.done-7").write_text("")
    watcher.deferred.join(10)
    assert request.exists() is not recovery_asks
    if not recovery_asks:
        assert time.monotonic() - asked > 1  # at the deadline less min_checkpoint_s, not at once


def test_sigterm_counts_as_a_notice_and_runs_the_hook(fake, tmp_path: Path):
    hook_out = tmp_path / "hook.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetrain", "watch", "--node", "spot-1", "--cloud", "aws", "--metadata-url", fake.url("spot-1"),
         "--run", str(tmp_path / "run"), "--poll-s", "0.5", "--wait-checkpoint-s", "0.5",
         "--hook-command", f'echo "$HETRAIN_NODE $HETRAIN_NOTICE" > {hook_out}'],
        cwd=ROOT, stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()
    assert "watching aws" in line, line
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=30)[1]
    assert proc.returncode == 0, rest
    node, notice = hook_out.read_text().split(" ", 1)
    assert node == "spot-1" and json.loads(notice)["cloud"] == "signal"
    assert (tmp_path / "run" / "checkpoint.request").exists()
    assert "emergency checkpoint not confirmed" in rest  # nothing was training


def test_a_node_watcher_checkpoints_the_runs_active_on_the_node_and_hooks_each(fake, tmp_path: Path):
    """`hetrain watch --runs-root` (what `hetrain node start --cloud` runs): on a notice, each run whose
    ranks run on the node now (marked by its node flow, its process alive) is asked for a checkpoint and
    gets the hook with its step and what the node flow recorded; finished or crashed runs are left alone."""
    from hetrain.recovery.preemption import active_runs, mark_active
    from hetrain.rundir import ACTIVE_MARKER as ACTIVE_FILE

    root = tmp_path / "runs"
    for name in ("live", "crashed", "done"):
        (root / name).mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (root / "crashed" / ACTIVE_FILE).write_text(json.dumps({"pid": dead.pid, "run_id": "crashed"}))
    hook_out = tmp_path / "hooks.txt"
    with mark_active(root / "live", {"run_id": "live", "recover": {"launch": "per-node", "cluster": "c.yaml"}}):
        assert [d.name for d, _ in active_runs(root)] == ["live"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "hetrain", "watch", "--node", "spot-1", "--cloud", "aws", "--metadata-url",
             fake.url("spot-1"), "--runs-root", str(root), "--poll-s", "0.5", "--wait-checkpoint-s", "20",
             "--hook-command", f'echo "$HETRAIN_RUN_ID $HETRAIN_CHECKPOINT_STEP $HETRAIN_RUN_INFO" >> {hook_out}'],
            cwd=ROOT, stderr=subprocess.PIPE, text=True)
        assert "watching aws" in proc.stderr.readline()
        fake.preempt("spot-1", 60)
        request = root / "live" / "checkpoint.request"
        deadline = time.monotonic() + 20
        while not request.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.replace(request, root / "live" / "checkpoint.request.done-7")  # as the run's node leader answers
        rest = proc.communicate(timeout=30)[1]
    assert proc.returncode == 0, rest
    assert not (root / "live" / ACTIVE_FILE).exists() and active_runs(root) == []
    (line,) = hook_out.read_text().splitlines()
    run_id, step, info = line.split(" ", 2)
    assert (run_id, step) == ("live", "7") and json.loads(info)["recover"]["cluster"] == "c.yaml"
    assert not (root / "crashed" / "checkpoint.request").exists() and not (root / "done" / "checkpoint.request").exists()
    assert "live: emergency checkpoint committed at step 7" in rest


def test_a_stopped_watcher_is_no_notice(fake, tmp_path: Path):
    """`hetrain node start` stops its watcher with SIGINT: no hook (SIGTERM is the cloud's notice)."""
    hook_out = tmp_path / "hook.txt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetrain", "watch", "--node", "n", "--cloud", "aws", "--metadata-url", fake.url("n"),
         "--runs-root", str(tmp_path), "--poll-s", "0.5", "--hook-command", f"touch {hook_out}"],
        cwd=ROOT, stderr=subprocess.PIPE, text=True)
    assert "watching aws" in proc.stderr.readline()
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    assert proc.returncode == 130 and not hook_out.exists()


def test_ranks_take_an_emergency_checkpoint_when_asked(tmp_path: Path):
    p = plan(1, [(4, [("a/0", [0, 6])]), (4, [("b/0", [0, 3]), ("b/1", [3, 6])])])
    request = tmp_path / "checkpoint.request"
    request.write_text("{}")  # a notice arrived before the first step
    cfg = CheckpointConfig(local_dir=str(tmp_path / "nodes" / "{node}"), every_steps=1000)
    records = run(p, tmp_path / "train", steps=3, checkpoint=cfg, request_file=str(request))
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "checkpoint_s" in records[0] and "checkpoint_s" not in records[1]
    assert not request.exists() and (tmp_path / "checkpoint.request.done-0").exists()
    for node in ("a", "b"):
        assert CheckpointStore.for_node(cfg, node).committed_steps() == [0, 2]  # the emergency one and the final one
    assert os.path.getsize(tmp_path / "checkpoint.request.done-0") == 2


def test_a_node_watchers_request_ends_the_run_at_the_checkpoint(tmp_path: Path):
    """A node's watcher asks the ranks to stop after the emergency checkpoint (the recovery resumes
    from it): every rank stops at that step, whichever node saw the request."""
    p = plan(1, [(4, [("a/0", [0, 6])]), (4, [("b/0", [0, 3]), ("b/1", [3, 6])])])
    request = tmp_path / "checkpoint.request"
    request.write_text(json.dumps({"cloud": "aws", "action": "terminate", "stop": True}))
    cfg = CheckpointConfig(local_dir=str(tmp_path / "nodes" / "{node}"), every_steps=1000)
    records = run(p, tmp_path / "train", steps=5, checkpoint=cfg, request_file=str(request))
    assert [r["step"] for r in records] == [0] and records[0]["stopped"] == "preemption notice"
    assert (tmp_path / "checkpoint.request.done-0").exists()
    for node in ("a", "b"):
        assert CheckpointStore.for_node(cfg, node).committed_steps() == [0]  # the emergency one only: the run ended


@pytest.mark.parametrize("cloud,answer", [
    ("aws", '[{"action": "terminate"}]'),  # a JSON list
    ("aws", '{"action": "terminate"}'),  # no time
    ("aws", '{"action": "terminate", "time": "soon"}'),  # a time that is not one
    ("aws", "<html>proxy error</html>"),  # not JSON at all
    ("azure", '{"Events": {"EventType": "Preempt"}}'),  # Events not a list
    ("azure", '{"Events": ["Preempt"]}'),  # an event that is not an object
    ("azure", "[]"),
    ("gcp", "MAYBE"),
], ids=["aws-list", "aws-no-time", "aws-bad-time", "aws-html", "azure-events-dict", "azure-event-str", "azure-list",
        "gcp-maybe"])
def test_an_answer_that_cannot_be_read_counts_as_a_notice_with_the_shortest_deadline(fake, cloud, answer):
    from hetrain.recovery.preemption import SHORTEST_NOTICE_S

    source = {"aws": AwsSpot, "gcp": GcpPreempted, "azure": AzureScheduledEvents}[cloud](fake.url("n1"))
    assert source.poll() is None
    fake.answer("n1", cloud, answer)
    notice = source.poll()
    assert notice is not None and notice.cloud == cloud and notice.action == "unreadable"
    assert SHORTEST_NOTICE_S - 5 < notice.seconds_left() <= SHORTEST_NOTICE_S
    assert notice.detail["answer"] == answer[:500] and notice.detail["error"]


def test_times_without_a_zone_are_utc(fake):
    fake.answer("n1", "aws", '{"action": "stop", "time": "2030-01-01T00:00:00"}')
    notice = AwsSpot(fake.url("n1")).poll()
    assert notice.action == "stop" and notice.deadline.isoformat() == "2030-01-01T00:00:00+00:00"
    fake.answer("n1", "azure", json.dumps({"Events": [{"EventType": "Preempt",
                                                       "NotBefore": "Tue, 01 Jan 2030 00:00:00"}]}))
    notice = AzureScheduledEvents(fake.url("n1")).poll()
    assert notice.deadline.isoformat() == "2030-01-01T00:00:00+00:00"


def test_a_run_directory_that_cannot_take_the_request_still_reaches_the_hook(fake, tmp_path: Path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    calls, logged = [], []
    watcher = PreemptionWatcher(GcpPreempted(fake.url("n1")), "n1", request_file=blocker / "checkpoint.request",
                                on_notice=lambda n, c: calls.append(c), poll_s=0.05, log=logged.append)
    fake.preempt("n1", 30)
    notice = watcher.run()
    assert notice is not None and calls == [False]
    assert "cannot request a checkpoint" in logged[-1] and str(blocker) in logged[-1]
