"""The tables and lines ``hetrain plan`` and ``hetrain plan --offers`` print a plan with."""

from __future__ import annotations

from rich import box
from rich.table import Table

from hetrain.cli.common import out

NARROW_TABLE_COLUMNS = 100  # in a terminal narrower than this, headers take two lines so that cells fit whole


def _compact_table(title: str, headers: list[tuple[str, str]]) -> tuple[Table, list[str]]:
    """A table with a rule under the header only and one space between columns; the headers' wide
    or two-line names (``(wide, narrow)``) by the terminal's width. A boxed, padded table of ten
    columns cut every cell at 80 columns."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=0)
    narrow = out.width < NARROW_TABLE_COLUMNS
    return table, [n if narrow else w for w, n in headers]


# a pipeline's schedule beside its micro-batches, short enough for 80 columns (1F1B, the default, says nothing)
SCHEDULE_TAG = {"eager-1f1b": "eager", "zb-h1": "zb", "interleaved-1f1b": "v=", "gpipe": "gpipe", "deepspeed-1f1b": "deepspeed"}


def plan_table(plan, est, title: str) -> Table:
    """One row a stage; numbers never wrap, and long names of GPUs and devices wrap instead of being cut. Each
    stage's optimizer state in a column of its own, or in a narrow terminal (where one more column does not fit)
    under its recompute, where it keeps less than the whole (sharded, offloaded)."""
    headers = [("pipeline", "pipe-\nline"), ("stage", "stage"), ("gpu", "gpu"), ("devices", "devices"),
               ("blocks", "blocks"), ("recompute", "recompute"), ("optimizer state", None),
               ("micro-batches", "micro\nbatches"), ("in flight", "in\nflight"), ("stage ms", "stage\nms"),
               ("memory GB", "memory\nGB")]
    table, names = _compact_table(title, headers)
    own_column = names[6] is not None
    for i, col in enumerate(names):
        if col is not None:
            table.add_column(col, justify="left" if i in (2, 3, 5, 6) else "right", no_wrap=i not in (2, 3, 4, 5),
                             overflow="fold")
    from hetrain.cost.report import plan_rows

    rows = plan_rows(plan, est)
    for i, r in enumerate(rows):
        first, last = r["stage"] == 0, i + 1 == len(rows) or rows[i + 1]["stage"] == 0
        state = r["optimizer state"]
        kept = [state] if own_column else []
        recompute = r["recompute"] if own_column or state == "replicated" else f"{r['recompute']}\n{state}"
        gpu = f"{r['gpu']} {r['format']}" if r["own format"] else r["gpu"]  # fp16 where the type has no bf16
        table.add_row(str(r["pipeline"]) if first else "", str(r["stage"]), gpu, _compact_devices(r["devices"]),
                      f"{r['blocks']} ({r['num_blocks']})", recompute, *kept,
                      (str(r["micro-batches"]) + ("" if r["schedule"] == "1f1b" else f" {SCHEDULE_TAG[r['schedule']]}")
                       + str(r.get("virtual stages") or ""))
                      if first else "",
                      str(r["in flight"]) + (f" + {r['weight pending']} W" if r["weight pending"] else ""),
                      f"{r['stage ms']:.1f}", f"{r['peak GB']:.1f}/{r['capacity GB']:.0f}", end_section=last)
    return table


def _compact_devices(devices: list[str]) -> str:
    node = devices[0].split("/")[0]
    idx = [d.split("/")[1] for d in devices]
    return f"{node}/{idx[0]}" if len(idx) == 1 else f"{node}/{{{','.join(idx)}}}"


def summary_line(plan, est) -> str:
    s = plan.solver
    gap = f", gap {s.gap:.2g}" if s and s.gap is not None else ""
    solver = f"; {s.planner} planner {s.status}{gap}, {s.wall_s:.2f} s" if s else ""
    return (
        f"tp={plan.tp} micro-batch={plan.micro_batch_size} pipelines={len(plan.pipelines)}: "
        f"iteration {est.iteration_time_s:.3f} s, {est.tokens_per_s:,.0f} tokens/s, "
        f"tightest memory headroom {est.min_headroom_gb:.1f} GB{solver}"
    )
