"""Metrics out: TensorBoard event files of a run's records, read back with TensorBoard's own reader."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hetrain.runtime.metrics import MetricsWriter
from tests.helpers.training import read_scalars

pytest.importorskip("tensorboard")


def record(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "lr": 0.1, "grad_norm": 1.0, "tokens_per_s": 100.0, "step_time_s": 0.5,
            "time": time.time(), "ranks": [{"rank": r, "device": f"a/{r}", "compute_s": 0.1 * (r + 1),
                                            "idle_s": 0.2, "sync_s": 0.01, "peak_memory_gb": 0.5}
                                           for r in range(2)]}


def test_a_resumed_run_shows_each_step_once(tmp_path: Path):
    """Steps 0-4, then a resume from step 3 writing 3-5 anew: TensorBoard keeps the resumed values."""
    first = MetricsWriter(tmp_path / "metrics.jsonl", tmp_path / "tensorboard", start_step=0)
    for step in range(5):
        first.write(record(step, 10.0 - step))
    first.close()
    resumed = MetricsWriter(None, tmp_path / "tensorboard", start_step=3)
    for step in range(3, 6):
        resumed.write(record(step, 100.0 + step))
    resumed.close()
    board = read_scalars(tmp_path / "tensorboard")
    assert board["loss"] == {0: 10.0, 1: 9.0, 2: 8.0, 3: 103.0, 4: 104.0, 5: 105.0}
    assert board["compute_s/rank1"][5] == pytest.approx(0.2)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5


def test_the_run_pictures_are_pngs_of_the_records(tmp_path: Path):
    """loss.png and ranks.png from a metrics file (a torn last line skipped), real PNGs of sensible size."""
    pytest.importorskip("matplotlib")
    from PIL import Image

    from hetrain.pictures import write_run_pictures

    lines = [json.dumps(record(step, 10.0 - step)) for step in range(6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 6, "lo')
    written, why_not = write_run_pictures(tmp_path / "metrics.jsonl", tmp_path)
    assert why_not is None and [p.name for p in written] == ["loss.png", "ranks.png"]
    for path in written:
        with Image.open(path) as image:
            assert image.format == "PNG" and image.width > 500 and image.height > 200
            colors = image.convert("RGB").getcolors(maxcolors=1 << 16)
            assert colors is not None and len(colors) > 10  # drawn, not blank
    (tmp_path / "empty.jsonl").write_text("")
    assert write_run_pictures(tmp_path / "empty.jsonl", tmp_path / "x") == ([], f"no pictures: "
                                                                             f"{tmp_path / 'empty.jsonl'} holds no "
                                                                             f"step records")
