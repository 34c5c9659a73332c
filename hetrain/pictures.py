"""A run's pictures, drawn from its ``metrics.jsonl`` when it ends: PNG files in the run directory.

* ``loss.png``: the loss (and the learning rate, on its own axis) by step;
* ``ranks.png``: where each rank's step time goes, averaged over the steps: computing (forward
  and backward), idle in the pipeline schedule (sending, receiving, waiting for other stages)
  and the gradient sync between pipelines; the ranks of a slow stage stand out at a glance.

matplotlib is optional (``pip install 'hetrain[plots]'``): without it no picture is drawn and
the run is none the worse (``write_run_pictures`` says why in what it returns). Torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path

from hetrain.errors import HetrainError
from hetrain.files import read_text

LOSS_PNG = "loss.png"
RANKS_PNG = "ranks.png"
PNG_DPI = 110  # about 700 x 400 pixels at the sizes below: sharp in a browser, a few tens of kB
RANK_PARTS = (("compute_s", "compute", "tab:blue"), ("idle_s", "idle (send, receive, wait)", "tab:orange"),
              ("sync_s", "gradient sync", "tab:green"))


def read_records(metrics: str | Path) -> list[dict]:
    """The step records of a metrics file (lines that are not a record are skipped: a run killed mid-write)."""
    records = []
    for line in read_text(metrics).splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and "loss" in record:
            records.append(record)
    return records


def write_run_pictures(metrics: str | Path, out_dir: str | Path) -> tuple[list[Path], str | None]:
    """Draw ``loss.png`` and ``ranks.png`` of the records in ``metrics`` into ``out_dir``.

    Returns the files written and, when none could be, why (no matplotlib, no records).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never a window, whatever the environment says
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return [], "no pictures: matplotlib is not installed (pip install 'hetrain[plots]')"
    try:
        records = read_records(metrics)
    except HetrainError as e:
        return [], f"no pictures: {e}"
    if not records:
        return [], f"no pictures: {metrics} holds no step records"
    out = Path(out_dir)
    written = [_loss_png(plt, MaxNLocator, records, out / LOSS_PNG)]
    if records[-1].get("ranks"):
        written.append(_ranks_png(plt, records, out / RANKS_PNG))
    return written, None


def _loss_png(plt, MaxNLocator, records: list[dict], path: Path) -> Path:  # noqa: N803 (matplotlib's class)
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(steps, [r["loss"] for r in records], color="tab:blue", label="loss")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("loss", color="tab:blue")
    ax.grid(alpha=0.3)
    lr = ax.twinx()
    lr.plot(steps, [r.get("lr", float("nan")) for r in records], color="tab:gray", linestyle="--", label="lr")
    lr.set_ylabel("learning rate", color="tab:gray")
    ax.set_title(f"loss, steps {steps[0]}-{steps[-1]}")
    fig.tight_layout()
    fig.savefig(path, dpi=PNG_DPI)
    plt.close(fig)
    return path


def _ranks_png(plt, records: list[dict], path: Path) -> Path:
    """Each rank's mean seconds per step by part, one horizontal bar a rank (rank 0 on top)."""
    ranks = records[-1]["ranks"]
    steps = records[1:] or records  # the first step pays for start-up (allocations, communicators)
    labels = [f"rank {r['rank']} {r.get('device', '')} (p{r.get('pipeline', '?')} s{r.get('stage', '?')})"
              for r in ranks]
    fig, ax = plt.subplots(figsize=(6.4, 1.0 + 0.35 * len(ranks)))
    left = [0.0] * len(ranks)
    for key, label, color in RANK_PARTS:
        widths = [sum(s["ranks"][i].get(key, 0.0) for s in steps if len(s.get("ranks", [])) > i) / len(steps)
                  for i in range(len(ranks))]
        ax.barh(range(len(ranks)), widths, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(range(len(ranks)), labels, fontsize=8)
    ax.invert_yaxis()
    first, last = steps[0]["step"], steps[-1]["step"]
    ax.set_xlabel(f"seconds per step (mean of steps {first}-{last})" if last > first else f"seconds in step {first}")
    # below the axis, outside the bars (bbox_inches="tight" makes room for it)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=len(RANK_PARTS), frameon=False)
    ax.set_title("where each rank's step goes")
    fig.savefig(path, dpi=PNG_DPI, bbox_inches="tight")
    plt.close(fig)
    return path
