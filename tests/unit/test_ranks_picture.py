"""``ranks.png`` stacks parts of each rank's step that add up to the step.

The runtime's ``idle_s`` is the schedule's and the sync's time not spent computing
(``Trainer._rank_records``: ``max(0, schedule_s + sync_s - compute_s)``), so it already holds
``sync_s``; stacking compute + idle + sync counted the sync twice and a slow rank's bar ran past
the step. The metrics here are written as the runtime writes them, from known parts.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from hetrain.pictures import RANK_PARTS, mean_rank_parts, rank_step_parts, write_run_pictures

STEP_S = 0.40
STARTUP_STEP_S = 2.5  # the first step pays for start-up: left out of the means
# (device, pipeline, stage, compute s, pipeline idle s, gradient sync s): what each rank did in a 0.40 s step;
# the rest of the step (optimizer step, waiting at the step's end) is what is left of 0.40 s
RANKS = [("slow/0", 0, 0, 0.30, 0.02, 0.06), ("slow/1", 0, 1, 0.28, 0.05, 0.06),
         ("fast/0", 1, 0, 0.10, 0.08, 0.20), ("fast/1", 1, 1, 0.09, 0.12, 0.15)]


def runtime_rank(rank: int, device: str, pipeline: int, stage: int, compute_s: float, wait_s: float,
                 sync_s: float) -> dict:
    """A rank's part of a step record, as ``Trainer._rank_records`` writes it from the step's timings."""
    schedule_s = compute_s + wait_s  # the pipeline schedule: its forwards and backwards and what waits between
    return {"rank": rank, "device": device, "pipeline": pipeline, "stage": stage, "tp_rank": 0,
            "compute_s": compute_s, "idle_s": max(0.0, schedule_s + sync_s - compute_s), "sync_s": sync_s,
            "peak_memory_gb": 0.5}


def write_metrics(path: Path, steps: int = 4) -> None:
    with path.open("w") as f:
        for step in range(steps):
            step_s = STARTUP_STEP_S if step == 0 else STEP_S
            record = {"step": step, "loss": 10.0 - step, "grad_norm": 1.0, "lr": 1e-3, "step_time_s": step_s,
                      "ranks": [runtime_rank(i, *r) for i, r in enumerate(RANKS)],
                      "tokens_per_s": 4096 / step_s, "time": 1.7e9 + step}
            f.write(json.dumps(record) + "\n")


def test_each_ranks_stacked_parts_add_up_to_its_step(tmp_path: Path):
    write_metrics(tmp_path / "metrics.jsonl")
    from hetrain.pictures import read_records

    records = read_records(tmp_path / "metrics.jsonl")
    # the fixture is the case the picture got wrong: the old stack ran past the step on some rank
    assert max(r["compute_s"] + r["idle_s"] + r["sync_s"] for r in records[-1]["ranks"]) > STEP_S + 0.1
    ranks, means, step_s = mean_rank_parts(records)
    assert step_s == pytest.approx(STEP_S)  # the start-up step is left out
    assert [r["device"] for r in ranks] == [r[0] for r in RANKS]
    for (device, _, _, compute_s, wait_s, sync_s), parts in zip(RANKS, means):
        assert list(parts) == [key for key, _, _ in RANK_PARTS]  # the order the bars stack them
        assert sum(parts.values()) == pytest.approx(STEP_S, abs=1e-9), device
        assert parts["compute"] == pytest.approx(compute_s), device
        assert parts["pipeline_idle"] == pytest.approx(wait_s), device
        assert parts["sync"] == pytest.approx(sync_s), device  # once, not inside the idle part too
        assert parts["rest"] == pytest.approx(STEP_S - compute_s - wait_s - sync_s), device


def test_a_rank_whose_timings_exceed_the_step_gets_no_negative_part():
    """Rank 0's step time against another rank's timings of one step can disagree by a little: no part goes
    below zero (the bar then ends slightly past the step rather than stacking a negative width)."""
    parts = rank_step_parts(runtime_rank(0, "d", 0, 0, 0.30, 0.10, 0.05), step_time_s=0.40)
    assert min(parts.values()) >= 0.0
    assert parts["rest"] == 0.0
    assert sum(parts.values()) == pytest.approx(0.45)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed")
def test_ranks_png_is_drawn_from_the_parts(tmp_path: Path):
    write_metrics(tmp_path / "metrics.jsonl")
    written, why = write_run_pictures(tmp_path / "metrics.jsonl", tmp_path)
    assert why is None
    assert tmp_path / "ranks.png" in written
    assert (tmp_path / "ranks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
