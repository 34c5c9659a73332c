"""Recovery inside a notice window: the deadline guard's fallback, and two nodes leaving at once, one gone early.

A switch with time to spare, started by two preemption events at once through the recovery
flow and checked against a cold restart of the same plan change, is in test_flows.py. The old
run these tests (and test_live_switch.py's) switch away from is ``tests.helpers.training.start_old_run``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hetrain.recovery.proactive import recover_in_notice_window
from hetrain.runtime.launch import worker_pids
from tests.helpers.training import AFTER, moto_bucket, planner, start_old_run

BUCKET = "hetrain-notice"  # moto's state is one per process: not test_recovery's bucket


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on loopback with this module's bucket: (endpoint, filesystem)."""
    with moto_bucket(BUCKET) as found:
        yield found


def test_a_notice_too_short_falls_back_to_a_restart_and_loses_nothing(tmp_path: Path, s3):
    thread, old, cfg, run_dir = start_old_run(tmp_path, s3, "short", BUCKET)
    # 5 s left: less than the switch's reserve, so no warm start is tried
    result = recover_in_notice_window(run_dir, ["c"], planner, deadline=time.time() + 5, steps_after=AFTER,
                                      cluster_file=tmp_path / "cluster.yaml", timeout_s=5, switch_reserve_s=20)
    thread.join(60)  # its ranks were stopped at the deadline, still uploading: the old run may end failed
    assert not result.switched and "the switch needs more than 20 s" in result.why_not
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = result.step  # the emergency checkpoint was still taken, and the restart resumed from it
    assert metrics[step]["step"] == step and metrics[step].get("stopped")
    assert [r["step"] for r in result.records] == list(range(step + 1, step + 1 + AFTER))
    assert [r["step"] for r in metrics] == list(range(step + 1 + AFTER))
    assert not worker_pids(run_dir, None)  # no rank of either launch is left


def test_two_notices_at_once_and_a_leaving_node_gone_before_the_fetch(tmp_path: Path, s3):
    """b and c get notices at once; c's peer server is already gone when the survivors ask.

    One switch takes both out: b's shards come from b (still up), c's from the bucket; nothing
    wrong is loaded, and the new plan trains on a alone.
    """
    thread, old, cfg, run_dir = start_old_run(tmp_path, s3, "gone", BUCKET, peers={"c": "http://127.0.0.4:9"})
    result = recover_in_notice_window(run_dir, ["b", "c"], planner, deadline=time.time() + 120, steps_after=AFTER,
                                      cluster_file=tmp_path / "cluster.yaml", timeout_s=2)
    thread.join(60)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = result.step
    assert metrics[step].get("stopped")  # resumed from the emergency checkpoint, not an older step
    # switched (the bucket had c's shard in time) or restarted once it had: either way c's from the bucket
    sources = {f.path: f.source for f in result.fetch.files}
    assert sources["__3_0.distcp"] == "remote", result.why_not
    if result.switched:  # b was still up and asked before the bucket
        assert sources["__2_0.distcp"] == "b" and result.bytes_from()["leaving"] > 0
    assert {d.split("/")[0] for d in result.plan.devices()} == {"a"}
    assert [r["step"] for r in result.records] == list(range(step + 1, step + 1 + AFTER))
    assert [r["step"] for r in metrics] == list(range(step + 1 + AFTER))
    assert not worker_pids(run_dir, None)
    # the run's config is the new plan's: a later notice or resume starts from it
    assert json.loads((run_dir / "config.json").read_text())["plan"] == str(result.plan_path)
