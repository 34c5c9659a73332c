"""A run's pictures, drawn from its ``metrics.jsonl`` when it ends: PNG files in the run directory.

* ``loss.png``: the loss (and the learning rate, on its own axis) by step;
* ``ranks.png``: where each rank's step time goes, averaged over the steps, in parts that add up
  to the step (``rank_step_parts``): computing (forward and backward), idle in the pipeline
  schedule (sending, receiving, waiting for other stages), the gradient sync between pipelines,
  and the rest (the optimizer step, waiting for the other ranks at the step's end); the ranks
  of a slow stage stand out at a glance;
* ``timeline-predicted.png`` (``write_timeline_png``): a plan's pipelines as the cost model plays
  them, op by op: each stage's forward and backward of each micro-batch, and the gaps between
  them (waiting for an activation or a gradient);
* ``timeline-measured.png`` (``measured_timeline``): the same chart of one step as the run
  measured it (``RUN/timeline/``, written by each stage's first rank at the launch's third step),
  to set beside the predicted one: where the plan's idle time really goes;
* ``recovery-from-step-N.png`` (``write_recovery_png``): a recovery report's phases in order;
* ``replay.png`` (``write_replay_png``): a replayed spot market (``hetrain simulate``): GPUs training
  and tokens trained over time, one line per strategy.

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
TIMELINE_PNG = "timeline-predicted.png"
MEASURED_TIMELINE_PNG = "timeline-measured.png"
# (label, colour) of each kind of op in a played pipeline (``hetrain.cost.pipeline.Op``)
OP_KINDS = {"F": ("forward", "tab:blue"), "B": ("backward", "tab:orange"), "W": ("weight gradient", "tab:green")}
MAX_TIMELINE_ROWS = 24  # stages drawn at most: beyond that the rows are too thin to read
LABEL_MIN_SHARE = 0.02  # an op wider than this share of the time axis gets its micro-batch written on it
# (part, label, colour) of ``rank_step_parts``, in the order the bars stack them
RANK_PARTS = (("compute", "compute", "tab:blue"),
              ("pipeline_idle", "pipeline idle (send, receive, wait)", "tab:orange"),
              ("sync", "gradient sync", "tab:green"),
              ("rest", "optimizer step, waiting at the step's end", "tab:gray"))


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


NO_MATPLOTLIB = "no pictures: matplotlib is not installed (pip install 'hetrain[plots]')"


def _pyplot():
    """matplotlib's pyplot drawing to files only (never a window, whatever the environment says); None without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_run_pictures(metrics: str | Path, out_dir: str | Path) -> tuple[list[Path], str | None]:
    """Draw ``loss.png`` and ``ranks.png`` of the records in ``metrics`` into ``out_dir``.

    Returns the files written and, when none could be, why (no matplotlib, no records).
    """
    plt = _pyplot()
    if plt is None:
        return [], NO_MATPLOTLIB
    from matplotlib.ticker import MaxNLocator

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
    step, rows = measured_timeline(out / "timeline")
    if rows:
        png, _ = write_timeline_png(rows, out / MEASURED_TIMELINE_PNG, f"measured: step {step} of the run")
        written += [png] if png is not None else []
    return written, None


def measured_timeline(directory: str | Path) -> tuple[int | None, list[tuple[str, list]]]:
    """(step, rows) of the measured step in ``directory`` (``RunDir.timeline``), as ``write_timeline_png`` draws them.

    Rows in pipeline and stage order, times from the earliest stage's start of the step. Only the
    newest launch's files count: a resumed run under another plan may have left other stages' files.
    """
    from hetrain.cost.pipeline import Op

    found = []
    for path in sorted(Path(directory).glob("p*-s*.json")):
        try:
            found.append(json.loads(read_text(path)))
        except (HetrainError, ValueError):
            continue  # a file being replaced, or not ours: the picture is drawn from the others
    found = [f for f in found if isinstance(f, dict) and isinstance(f.get("ops"), list)]
    if not found:
        return None, []
    step = max(f["step"] for f in found)
    found = sorted((f for f in found if f["step"] == step), key=lambda f: (f["pipeline"], f["stage"]))
    t0 = min(f["start"] for f in found)
    rows = [(f"p{f['pipeline']} s{f['stage']} {f['device']}",
             [Op(f["stage"], kind, mb, start - t0, end - t0) for kind, mb, start, end in f["ops"] if kind in OP_KINDS])
            for f in found]
    return step, rows


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


def rank_step_parts(rank: dict, step_time_s: float) -> dict[str, float]:
    """One rank's seconds of one step in parts that add up to ``step_time_s`` (``RANK_PARTS``' order).

    The runtime's ``idle_s`` is the schedule's and the sync's time not spent computing
    (``Trainer._rank_records``), so it already holds ``sync_s``: stacked as it is beside
    ``sync_s`` it counted the sync twice and a slow rank's bar ran past the step. The pipeline's
    own idle is ``idle_s - sync_s``; what the step has besides (the optimizer step, the step's
    all-reduce, where a fast rank waits for the slowest) is the rest, never below zero. The
    step time is rank 0's: every rank ends each step at the same all-reduce, so each one's steps
    take as long on average.
    """
    compute_s, idle_s, sync_s = (float(rank.get(k, 0.0)) for k in ("compute_s", "idle_s", "sync_s"))
    parts = {"compute": compute_s, "pipeline_idle": max(0.0, idle_s - sync_s), "sync": sync_s}
    parts["rest"] = max(0.0, step_time_s - sum(parts.values()))
    return parts


def mean_rank_parts(records: list[dict]) -> tuple[list[dict], list[dict[str, float]], float]:
    """(the ranks, each rank's mean ``rank_step_parts`` over the steps, the mean step seconds) that ``ranks.png`` draws.

    The first step is left out when there are others: it pays for start-up (allocations, communicators).
    """
    ranks = records[-1]["ranks"]
    steps = records[1:] or records
    step_s = sum(float(s.get("step_time_s", 0.0)) for s in steps) / len(steps)
    means = []
    for i in range(len(ranks)):
        parts = [rank_step_parts(s["ranks"][i], float(s.get("step_time_s", 0.0)))
                 for s in steps if len(s.get("ranks", [])) > i]
        means.append({key: sum(p[key] for p in parts) / max(1, len(parts)) for key, _, _ in RANK_PARTS})
    return ranks, means, step_s


def _ranks_png(plt, records: list[dict], path: Path) -> Path:
    """Each rank's mean seconds per step by part, one horizontal bar a rank (rank 0 on top), the mean step marked."""
    ranks, means, step_s = mean_rank_parts(records)
    steps = records[1:] or records
    labels = [f"rank {r['rank']} {r.get('device', '')} (p{r.get('pipeline', '?')} s{r.get('stage', '?')})"
              for r in ranks]
    fig, ax = plt.subplots(figsize=(6.4, 1.0 + 0.35 * len(ranks)))
    left = [0.0] * len(ranks)
    for key, label, color in RANK_PARTS:
        widths = [m[key] for m in means]
        ax.barh(range(len(ranks)), widths, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, widths)]
    if step_s > 0:
        ax.axvline(step_s, color="black", linestyle="--", linewidth=0.8, label=f"step ({step_s:.3g} s)")
    ax.set_yticks(range(len(ranks)), labels, fontsize=8)
    ax.invert_yaxis()
    first, last = steps[0]["step"], steps[-1]["step"]
    ax.set_xlabel(f"seconds per step (mean of steps {first}-{last})" if last > first else f"seconds in step {first}")
    # below the axis, outside the bars (bbox_inches="tight" makes room for it)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2, frameon=False)
    ax.set_title("where each rank's step goes")
    fig.savefig(path, dpi=PNG_DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def write_timeline_png(rows: list[tuple[str, list]], path: str | Path, title: str) -> tuple[Path | None, str | None]:
    """A Gantt chart of played pipelines: one row a stage, ``rows`` as (label, its ops), top to bottom.

    Each op (``hetrain.cost.pipeline.Op``: kind, micro-batch, start and end seconds) is a bar in its
    kind's colour with its micro-batch written on it where it is wide enough; white space is time
    the stage waits. Returns the file, or None and why (no matplotlib, nothing to draw).
    """
    plt = _pyplot()
    if plt is None:
        return None, NO_MATPLOTLIB
    rows = rows[:MAX_TIMELINE_ROWS]
    end = max((op.end_s for _, ops in rows for op in ops), default=0.0)
    if end <= 0:
        return None, "no timeline: the pipelines have no ops"
    fig, ax = plt.subplots(figsize=(9.6, 1.6 + 0.4 * len(rows)), layout="constrained")
    for y, (_, ops) in enumerate(rows):
        for op in ops:
            width = op.end_s - op.start_s
            ax.barh(y, width, left=op.start_s, height=0.7, color=OP_KINDS[op.kind][1], edgecolor="white", linewidth=0.5)
            if width >= LABEL_MIN_SHARE * end:
                ax.text(op.start_s + width / 2, y, str(op.microbatch), ha="center", va="center", fontsize=7,
                        color="white")
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel("seconds into the step (micro-batch numbers on the bars; white: waiting)")
    kinds = {op.kind for _, ops in rows for op in ops}
    handles = [plt.Rectangle((0, 0), 1, 1, color=color) for kind, (_, color) in OP_KINDS.items() if kind in kinds]
    # below the whole figure (constrained layout makes room): clear of the bars and the title at any size
    fig.legend(handles, [label for kind, (label, _) in OP_KINDS.items() if kind in kinds], fontsize=8,
               loc="outside lower center", ncol=3, frameon=False)
    ax.set_title(title, fontsize=10)
    out = Path(path)
    fig.savefig(out, dpi=PNG_DPI)
    plt.close(fig)
    return out, None


RECOVERY_PNG_SUFFIX = ".png"  # beside RUN/recovery-from-step-N.json, the same name
# The phases a recovery report may time (``hetrain.recovery``), in the order they happen, and their colour:
# a notice-window switch re-plans, warms the new ranks up beside the old ones, takes the emergency
# checkpoint and moves it (live or fetched); a restart re-plans, fetches, starts the ranks and loads.
RECOVERY_PHASES = (("replan_s", "re-plan for the survivors", "tab:purple"),
                   ("warm_start_s", "start the new ranks (old ones train on)", "tab:gray"),
                   ("checkpoint_s", "emergency checkpoint", "tab:red"),
                   ("live_s", "live transfer, memory to memory", "tab:cyan"),
                   ("fetch_s", "fetch the checkpoint", "tab:olive"),
                   ("commit_wait_s", "wait for the old ranks' commit", "tab:red"),
                   ("startup_s", "old ranks exit, new ones start", "tab:gray"),
                   ("load_s", "load the checkpoint", "tab:brown"),
                   ("first_step_s", "first step", "tab:blue"))


def recovery_rows(report: dict) -> list[tuple[str, float, float, str]]:
    """(label, start, end, colour) of each timed phase of a recovery report, one after the other from 0,
    and under the fetch one row per source (its files' bytes; the bar as long as its slowest file)."""
    timings = report.get("timings_s") or {}
    rows, t = [], 0.0
    for key, label, colour in RECOVERY_PHASES:
        took = timings.get(key)
        if not isinstance(took, (int, float)) or took <= 0:
            continue
        rows.append((label, t, t + took, colour))
        if key == "fetch_s":
            by_source: dict[str, list[dict]] = {}
            for f in report.get("files") or []:
                by_source.setdefault(str(f.get("source")), []).append(f)
            for source, files in sorted(by_source.items()):
                size_mb = sum(f.get("bytes", 0) for f in files) / 1e6
                slowest = max(f.get("seconds", 0.0) for f in files)
                rows.append((f"  from {source}: {len(files)} files, {size_mb:.1f} MB", t, t + slowest, "tab:green"))
        t += took
    return rows


def write_recovery_png(report: dict, path: str | Path) -> tuple[Path | None, str | None]:
    """A recovery's phases as a Gantt chart (``recovery_rows``); the file, or None and why not."""
    plt = _pyplot()
    if plt is None:
        return None, NO_MATPLOTLIB
    rows = recovery_rows(report)
    if not rows:
        return None, "no recovery timeline: the report times no phase"
    fig, ax = plt.subplots(figsize=(9.6, 1.4 + 0.35 * len(rows)), layout="constrained")
    for y, (_, start, end, colour) in enumerate(rows):
        ax.barh(y, end - start, left=start, height=0.7, color=colour)
        ax.text(end, y, f" {end - start:.2f} s", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [label for label, *_ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(end for _, _, end, _ in rows) * 1.12)
    ax.set_xlabel("seconds from the start of the recovery")
    lost = ", ".join(report.get("lost_nodes") or []) or "none"
    down = (report.get("timings_s") or {}).get("downtime_s")
    ax.set_title(f"recovery from step {report.get('checkpoint_step')}: lost {lost}; "
                 f"{report.get('bytes_from_peers', 0) / 1e6:.1f} MB from peers, "
                 f"{report.get('bytes_from_remote', 0) / 1e6:.1f} MB from the bucket"
                 + (f"; training stopped {down:.1f} s" if isinstance(down, (int, float)) else ""), fontsize=10)
    out = Path(path)
    fig.savefig(out, dpi=PNG_DPI)
    plt.close(fig)
    return out, None


REPLAY_PNG = "replay.png"
# line style of each simulated strategy (``hetrain.recovery.simulate.STRATEGIES``), any other solid
STRATEGY_STYLES = {"hetrain": "-", "bucket restarts": "--", "on-demand": ":"}


def write_replay_png(results: list[dict], path: str | Path, title: str) -> tuple[Path | None, str | None]:
    """A replayed spot market, first replay of each (candidate, strategy): GPUs training and tokens trained over time.

    ``results`` are ``hetrain.recovery.simulate.simulate``'s rows, each with its
    ``timeline_first_replay`` of (seconds, GPUs training, GPUs rented, tokens) points. One line
    style a strategy; one colour a candidate (a strategy, when there is one candidate). Returns the file,
    or None and why (no matplotlib).
    """
    plt = _pyplot()
    if plt is None:
        return None, NO_MATPLOTLIB
    fig, (gpus_ax, tokens_ax) = plt.subplots(2, 1, figsize=(8.0, 6.0), sharex=True, layout="constrained")
    several = len({r["candidate"] for r in results}) > 1  # then a colour a candidate, else a colour a strategy
    colour_key = "candidate" if several else "strategy"
    colours = {c: f"C{i}" for i, c in enumerate(dict.fromkeys(r[colour_key] for r in results))}
    for r in results:
        points = r["timeline_first_replay"]
        hours = [p[0] / 3600 for p in points]
        label = f"{r['candidate']}: {r['strategy']}" if several else r["strategy"]
        style = dict(color=colours[r[colour_key]], linestyle=STRATEGY_STYLES.get(r["strategy"], "-"))
        gpus_ax.step(hours, [p[1] for p in points], where="post", label=label, **style)
        tokens_ax.plot(hours, [p[3] / 1e9 for p in points], label=label, **style)
    gpus_ax.set_ylabel("GPUs training")
    gpus_ax.grid(alpha=0.3)
    gpus_ax.set_title(title, fontsize=10)
    tokens_ax.set_ylabel("tokens trained (billions)")
    tokens_ax.set_xlabel("hours into the replayed market (0 GPUs: recovering, or waiting for nodes)")
    tokens_ax.grid(alpha=0.3)
    fig.legend(*gpus_ax.get_legend_handles_labels(), fontsize=8, loc="outside lower center", ncol=3, frameon=False)
    out = Path(path)
    fig.savefig(out, dpi=PNG_DPI)
    plt.close(fig)
    return out, None
