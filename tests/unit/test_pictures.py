"""The plan's predicted timeline: the cost model's plays traced op by op, and the picture drawn from them.

The trace is what ``hetrain.pictures.write_timeline_png`` draws and Prefect shows (``flows.report``);
it must be the play the cost model prices, not a drawing of its own: the same end, each stage's ops
in order without overlap, and each op after the message it waits for.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hetrain.cost.costmodel import CostModel
from hetrain.cost.pipeline import eager_pipeline_s, one_f_one_b_play_s
from hetrain.spec.specs import TrainingSettings, load_cluster, load_model
from tests.helpers import ROOT

# A mixed pipeline: a slow first stage, a fast middle one, a slow last one; sends not free
STAGE_S, BACKWARD_S, P2P_S = [3.0, 1.0, 2.0], [2.0, 0.6, 1.3], [0.2, 0.3]
MICROBATCHES = 6


def check_trace(ops, num_stages: int, kinds: str, end_s: float) -> None:
    """Every stage ran each kind once per micro-batch, in order, one at a time; the last op ends at ``end_s``;
    a forward starts after the previous stage's forward of its micro-batch has been sent, a backward after the
    next stage's backward of it."""
    ends = {(op.stage, op.kind, op.microbatch): op.end_s for op in ops}
    for k in range(num_stages):
        mine = [op for op in ops if op.stage == k]
        assert sorted((op.kind, op.microbatch) for op in mine) == sorted(
            (kind, i) for kind in kinds for i in range(MICROBATCHES))
        for a, b in zip(mine, mine[1:]):
            assert a.start_s < a.end_s <= b.start_s + 1e-12  # played in order, never two at once
    for op in ops:
        if op.kind == "F" and op.stage > 0:
            assert op.start_s >= ends[(op.stage - 1, "F", op.microbatch)] + P2P_S[op.stage - 1] - 1e-12
        if op.kind == "B" and op.stage < num_stages - 1:
            assert op.start_s >= ends[(op.stage + 1, "B", op.microbatch)] + P2P_S[op.stage] - 1e-12
    assert max(op.end_s for op in ops) == pytest.approx(end_s)


def test_the_plays_trace_their_ops():
    ops: list = []
    total = one_f_one_b_play_s(STAGE_S, BACKWARD_S, P2P_S, MICROBATCHES, trace=ops)
    check_trace(ops, 3, "FB", total)
    ops = []
    _, total, _ = eager_pipeline_s(STAGE_S, BACKWARD_S, P2P_S, [4, 2, 1], MICROBATCHES, trace=ops)
    check_trace(ops, 3, "FB", total)
    ops = []
    _, total, _ = eager_pipeline_s(STAGE_S, BACKWARD_S, P2P_S, [3, 2, 1], MICROBATCHES, weight_s=[0.8, 0.2, 0.5],
                                   trace=ops)
    check_trace(ops, 3, "FBW", total)
    # tracing changes nothing
    assert eager_pipeline_s(STAGE_S, BACKWARD_S, P2P_S, [4, 2, 1], MICROBATCHES)[1] == pytest.approx(
        eager_pipeline_s(STAGE_S, BACKWARD_S, P2P_S, [4, 2, 1], MICROBATCHES, trace=[])[1])


def test_a_plans_timeline_is_its_estimate_played_and_drawn(tmp_path: Path):
    """A real plan (the 3-type paper cluster: eager 1F1B over five stages): the timeline of each pipeline ends
    where its estimate does, and the picture is a PNG with something drawn on it."""
    pytest.importorskip("matplotlib")
    from PIL import Image

    from hetrain.pictures import write_timeline_png
    from solver.planners.registry import make_plan

    cl = load_cluster(ROOT / "examples/clusters/paper-3types.yaml")
    spec = load_model(ROOT / "examples/models/gpt-6.7b.yaml")
    settings = TrainingSettings(global_batch_size=64)
    result = make_plan("hetrain", cl, spec, settings, None)
    plan, est, cost = result.plan, result.estimate, CostModel(cl, spec, settings, None)
    assert {p.schedule_name for p in plan.pipelines} - {"1f1b"}  # a played schedule, priced op by op
    rows = []
    for p, pipe in enumerate(plan.pipelines):
        ops = cost.timeline(plan, est, p)
        assert len(ops) >= 2 * len(pipe.stages) * pipe.num_microbatches
        assert max(op.end_s for op in ops) <= est.pipelines[p].time_s + 1e-9
        if pipe.schedule_name != "1f1b":
            assert max(op.end_s for op in ops) == pytest.approx(est.pipelines[p].time_s)
        rows += [(f"p{p} s{k}", [op for op in ops if op.stage == k]) for k in range(len(pipe.stages))]
    png, why_not = write_timeline_png(rows, tmp_path / "timeline.png", "predicted")
    assert why_not is None and png == tmp_path / "timeline.png"
    with Image.open(png) as image:
        assert image.format == "PNG" and image.width > 800 and image.height > 300
        colors = image.convert("RGB").getcolors(maxcolors=1 << 16)
        assert colors is not None and len(colors) > 10  # drawn, not blank
    assert write_timeline_png([("p0 s0", [])], tmp_path / "none.png", "nothing") == (
        None, "no timeline: the pipelines have no ops")


def test_a_recovery_report_is_drawn_phase_by_phase_with_the_fetch_by_source(tmp_path: Path):
    from hetrain.pictures import recovery_rows, write_recovery_png

    report = {"lost_nodes": ["c"], "checkpoint_step": 9, "bytes_from_peers": 3_000_000, "bytes_from_remote": 1_000_000,
              "timings_s": {"replan_s": 0.5, "fetch_s": 2.0, "startup_s": 4.0, "load_s": 1.0, "first_step_s": 0.5,
                            "train_s": 30.0},  # train_s is the whole resumed run, not a phase
              "files": [{"source": "b", "bytes": 2_000_000, "seconds": 0.4},
                        {"source": "b", "bytes": 1_000_000, "seconds": 0.7},
                        {"source": "s3", "bytes": 1_000_000, "seconds": 1.9}]}
    rows = recovery_rows(report)
    assert [(label.split(":")[0].strip(), start, end) for label, start, end, _ in rows] == [
        ("re-plan for the survivors", 0.0, 0.5), ("fetch the checkpoint", 0.5, 2.5), ("from b", 0.5, 1.2),
        ("from s3", 0.5, 2.4), ("old ranks exit, new ones start", 2.5, 6.5), ("load the checkpoint", 6.5, 7.5),
        ("first step", 7.5, 8.0)]
    assert rows[2][0] == "  from b: 2 files, 3.0 MB"
    pytest.importorskip("matplotlib")
    png, why_not = write_recovery_png(report, tmp_path / "r.png")
    assert why_not is None and png.stat().st_size > 5_000
    assert write_recovery_png({"timings_s": {}}, tmp_path / "none.png") == (
        None, "no recovery timeline: the report times no phase")
