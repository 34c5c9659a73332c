"""The live notice-window switch: the state goes from the old ranks' memory to the new ranks', verified.

Real gloo processes on both sides. A run switched live continues with the same losses as the same
new plan resumed from the emergency checkpoint on disk; an old rank that dies mid-transfer and a
corrupted slice each end in the disk path with nothing lost (the transfer's own refusals, a
stall's included, are in test_live_transfer.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hetrain.checkpoint.live import FAULT_LIVE
from hetrain.checkpoint.reassemble import Source, reassemble
from hetrain.recovery.proactive import recover_in_notice_window
from hetrain.rundir import live_offer_file
from hetrain.runtime.launch import worker_pids
from tests.helpers.training import AFTER, OLD_STEPS, moto_bucket, planner, run, start_old_run

BUCKET = "hetrain-live"  # moto's state is one per process: not test_notice_switch's bucket


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on loopback with this module's bucket: (endpoint, filesystem)."""
    with moto_bucket(BUCKET) as found:
        yield found


def metric_steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_live_switch_trains_on_as_a_restore_from_disk_would(tmp_path: Path, s3):
    # Checkpoints only when asked and at the end: with keep=2, a periodic one among the new plan's
    # steps (e.g. step 99 after a switch at step 97) would prune the emergency step from the nodes.
    thread, _, cfg, run_dir = start_old_run(tmp_path, s3, "live", every_steps=OLD_STEPS, bucket=BUCKET)
    result = recover_in_notice_window(run_dir, ["c"], planner, deadline=time.time() + 120, steps_after=AFTER,
                                      cluster_file=tmp_path / "cluster.yaml", timeout_s=5, live=True)
    thread.join(60)
    assert result.switched and result.live["ok"], result.live
    step = result.step
    offer = json.loads(live_offer_file(run_dir / "checkpoint.request").read_text())
    assert offer["step"] == step and 0 < result.live["bytes"]
    assert [r["step"] for r in result.records] == list(range(step + 1, step + 1 + AFTER))
    assert [r["step"] for r in metric_steps(run_dir)] == list(range(step + 1 + AFTER))
    assert not worker_pids(run_dir, None)
    # the emergency checkpoint still reached every node's disk, behind the switch
    nodes = [Source(n, cfg.node_root(n)) for n in ("a", "b", "c")]
    restored = reassemble(nodes[0].manifest(step, 5), nodes, None, str(tmp_path / "restored"))
    # the same new plan resumed from that checkpoint on disk trains the same steps to the same losses
    disk = run(result.plan, tmp_path / "disk", steps=step + 1 + AFTER, start_step=step + 1,
               resume_from=restored.dest, cluster=str(tmp_path / "cluster.yaml"))
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in disk] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in result.records]


@pytest.mark.parametrize("fault", ["kill", "corrupt"])
def test_a_failed_live_transfer_falls_back_and_loses_nothing(tmp_path: Path, s3, fault, monkeypatch):
    """Old plan rank 0 (which always serves part of the state) dies mid-slice or flips a byte.

    A corrupted transfer takes the disk path from the emergency step, which the old ranks commit
    once released (a stalled one ends the same way: its refusal is in test_live_transfer.py). A rank that dies mid-transfer takes its state with it: the run
    restarts from the newest step committed before (checkpoints every few steps here), losing
    nothing that was committed.
    """
    monkeypatch.setenv(FAULT_LIVE, f"{fault}:0")  # read by the old ranks' servers only
    thread, _, _, run_dir = start_old_run(tmp_path, s3, f"live-{fault}", every_steps=5 if fault == "kill" else 100,
                                          bucket=BUCKET)
    result = recover_in_notice_window(run_dir, ["c"], planner, deadline=time.time() + 120, steps_after=AFTER,
                                      cluster_file=tmp_path / "cluster.yaml", timeout_s=5, live=True,
                                      live_timeout_s=3)
    thread.join(60)
    offer = json.loads(live_offer_file(run_dir / "checkpoint.request").read_text())
    assert "__0_0.distcp" in offer["files"]  # rank 0 served a slice: the fault was on the path
    why = {"kill": "after", "corrupt": "SHA-256"}[fault]
    assert not result.live["ok"] and why in result.live["why"], result.live
    step, end = result.step, offer["step"] + 1 + AFTER
    if fault == "kill":  # restarted from the newest committed step, the steps after it trained again
        assert not result.switched and step < offer["step"] and (step + 1) % 5 == 0, result.why_not
    else:  # the disk path from the emergency step the old plan offered, then committed
        assert result.switched and step == offer["step"], result.why_not
        assert metric_steps(run_dir)[step].get("stopped")
    assert [r["step"] for r in result.records] == list(range(step + 1, end))
    assert [r["step"] for r in metric_steps(run_dir)] == list(range(end))
    assert not worker_pids(run_dir, None)
