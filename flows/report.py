"""Prefect artifacts for plans and runs: a table, a picture of the pipelines, progress, timings, pictures.

Pictures (``hetrain.pictures`` draws them) are image artifacts whose URL is the PNG itself as a
``data:image/png;base64,...`` URL: Prefect's image artifact holds only a URL, and a run's files are
on the training machine, which the browser showing the UI cannot be assumed to reach. Both of
Prefect 3.8's UIs put the URL in an ``<img src>`` (and print it below, as the URL of the image),
so the picture travels in the Prefect database with the run's other artifacts.
"""

from __future__ import annotations

import base64
import json
import statistics
import tempfile
from pathlib import Path

from pydantic import ValidationError
from prefect.artifacts import (create_image_artifact, create_markdown_artifact, create_progress_artifact,
                               create_table_artifact, update_progress_artifact)

from hetrain.cost.costmodel import CostModel, Estimate
from hetrain.cost.report import plan_rows
from hetrain.pictures import (LOSS_PNG, MEASURED_TIMELINE_PNG, RANKS_PNG, TIMELINE_PNG, write_run_pictures,
                              write_timeline_png)
from hetrain.plan.schema import Plan
from hetrain.profiling.profile import ANALYTIC_NOTE, Profile

# What each picture of a run shows, as its artifact's description
RUN_PICTURES = {LOSS_PNG: "loss and learning rate by step",
                RANKS_PNG: "where each rank's step time goes: compute, idle in the pipeline schedule, gradient sync",
                MEASURED_TIMELINE_PNG: "each stage's forwards and backwards of one step as they ran (measured; "
                "beside the predicted timeline)"}


def artifact_key(*parts: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    raw = "-".join(parts).lower()
    return "".join(c if c.isalnum() else "-" for c in raw).strip("-")[:100]


def pipelines_markdown(plan: Plan, est: Estimate, title: str) -> str:
    """One line per pipeline: its stages left to right, with GPUs, blocks and its share of the batch."""
    lines = [f"## {title}", "",
             f"{plan.model.name}, global batch {plan.global_batch_size}, micro-batch {plan.micro_batch_size}, "
             f"tp {plan.tp}; predicted {est.iteration_time_s:.3f} s/iteration, {est.tokens_per_s:,.0f} tokens/s", "",
             "```"]
    for p, pipe in enumerate(plan.pipelines):
        stages = "  ->  ".join(f"[{'+'.join(s.devices)} {s.gpu} | blocks {s.layers[0]}-{s.layers[1]}]"
                               for s in pipe.stages)
        eager = (f", eager 1F1B in flight {'/'.join(str(s.in_flight) for s in pipe.stages)}"
                 if pipe.eager else ", ZB-H1" if pipe.schedule_name == "zb-h1"
                 else ", GPipe" if pipe.schedule_name == "gpipe" else "")
        lines.append(f"pipeline {p}: {stages}   x {pipe.num_microbatches} micro-batches{eager}")
    lines.append("```")
    return "\n".join(lines)


def publish_plan(plan: Plan, est: Estimate, run_id: str, what: str, measured: bool = True,
                 cost: CostModel | None = None) -> str | None:
    """The plan as a table and its pipelines; a plan of analytic costs says its times are not measured.

    With the ``cost`` model that made ``est``, also the picture of its pipelines' timeline as the cost
    model plays them (``publish_timeline``). Returns why there is no picture, if there is none.
    """
    rows = [{**{k: v for k, v in r.items() if k not in ("num_blocks", "capacity GB")},
             "devices": ", ".join(r["devices"])} for r in plan_rows(plan, est)]
    create_table_artifact(rows, key=artifact_key(run_id, what, "plan"),
                          description=f"{what} plan of run {run_id}" + ("" if measured else f"; {ANALYTIC_NOTE}"))
    create_markdown_artifact(pipelines_markdown(plan, est, f"{what} plan of run {run_id}"),
                             key=artifact_key(run_id, what, "pipelines"), description="pipelines of the plan")
    return publish_timeline(plan, est, cost, run_id, what) if cost is not None else None


def png_data_url(path: Path) -> str:
    """The PNG file as a ``data:`` URL: the picture itself, for an image artifact (see the module's docstring)."""
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def publish_picture(path: Path, key: str, description: str) -> None:
    """A PNG file as an image artifact (a new version of ``key`` each time)."""
    create_image_artifact(image_url=png_data_url(path), key=key, description=description)


def publish_timeline(plan: Plan, est: Estimate, cost: CostModel, run_id: str, what: str) -> str | None:
    """The plan's pipelines as the cost model plays them, one row a stage (slowest pipeline on top); why not, if not.

    Predicted only: the runtime records each rank's per-step totals, not when each micro-batch ran.
    """
    order = sorted(range(len(plan.pipelines)), key=lambda p: -est.pipelines[p].time_s)
    rows = []
    for p in order:
        ops = cost.timeline(plan, est, p)
        for k, stage in enumerate(plan.pipelines[p].stages):
            rows.append((f"p{p} s{k} {'+'.join(stage.devices)}", [op for op in ops if op.stage == k]))
    title = (f"{what} plan of run {run_id}, predicted: {plan.pipelines[order[0]].schedule_name}, "
             f"{est.pipeline_s:.3f} s of pipelines per step")
    with tempfile.TemporaryDirectory(prefix="hetrain-timeline-") as tmp:
        png, why_not = write_timeline_png(rows, Path(tmp) / TIMELINE_PNG, title)
        if png is not None:
            publish_picture(png, artifact_key(run_id, what, "timeline"),
                            f"{what} plan: each stage's forwards and backwards per micro-batch as the cost model "
                            f"plays them (predicted; the run's measured step is its timeline-measured picture)")
    return why_not


def publish_run_pictures(run_id: str, metrics: Path, run_dir: Path) -> str | None:
    """Draw the run's pictures into its directory from its ``metrics`` (``hetrain.pictures``) and publish them.

    Keys ``<run>-loss`` and ``<run>-ranks``: each call adds a version, so the UI shows the newest
    and keeps the earlier ones. Returns why there are none, if there are none.
    """
    written, why_not = write_run_pictures(metrics, run_dir)
    for png in written:
        publish_picture(png, artifact_key(run_id, png.stem), f"run {run_id}: {RUN_PICTURES[png.name]}")
    return why_not


def publish_timing(run_id: str, predicted_s: float, records: list[dict], warmup: int = 3) -> dict:
    """Predicted vs measured iteration time (median step after ``warmup`` steps)."""
    steps = [r["step_time_s"] for r in records[warmup:]] or [r["step_time_s"] for r in records]
    measured = statistics.median(steps) if steps else float("nan")
    row = {"predicted s": round(predicted_s, 4), "measured s": round(measured, 4),
           "error %": round(100 * (predicted_s - measured) / measured, 1) if steps else None,
           "steps measured": len(steps)}
    create_table_artifact([row], key=artifact_key(run_id, "iteration-time"),
                          description="predicted vs measured iteration time")
    return row


class Progress:
    """A progress artifact that follows the steps of a training run.

    It is updated when the whole percentage changes, not every step: a step can take
    milliseconds, and each update is a write to the Prefect server's database, which every
    worker and flow run of the cluster shares.
    """

    def __init__(self, run_id: str, first_step: int, last_step: int) -> None:
        self.first, self.total = first_step, max(1, last_step - first_step)
        self.shown = 0
        self.id = create_progress_artifact(0.0, key=artifact_key(run_id, "progress"),
                                           description=f"training {run_id}: steps {first_step}-{last_step - 1}")

    def update(self, step: int) -> None:
        percent = min(100.0, 100.0 * (step + 1 - self.first) / self.total)
        if int(percent) > self.shown or percent == 100.0:
            self.shown = int(percent)
            update_progress_artifact(self.id, percent)


PROFILE_FENCE = JSON_FENCE = "```json"


def publish_json(data: dict, key: str, title: str) -> None:
    """Exact JSON for a parent flow run on another machine, as a markdown artifact people can read too."""
    create_markdown_artifact(f"## {title}\n\n{JSON_FENCE}\n{json.dumps(data, indent=2)}\n```\n", key=key,
                             description=title)


def json_from_markdown(text: object, source: str, what: str) -> dict:
    """What ``publish_json`` wrote; HetrainError naming ``source`` when there is none or it is not JSON."""
    from hetrain.errors import HetrainError

    if not isinstance(text, str) or JSON_FENCE not in text:
        raise HetrainError(f"{source}: no {what} in the node run's artifacts")
    try:
        data = json.loads(text.split(JSON_FENCE, 1)[1].rsplit("```", 1)[0])
    except ValueError as e:
        raise HetrainError(f"{source}: not a valid {what} ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise HetrainError(f"{source}: not a valid {what} (expected a JSON object)")
    return data


def publish_profile(profile: Profile, gpu: str, node: str) -> None:
    """A node's profile of its GPU type: a table to read, and the exact JSON for the parent flow."""
    rows = [{"tp": e.tp, "micro-batch": e.micro_batch_size, "block fwd ms": round(1e3 * e.block_forward_s, 3),
             "block bwd ms": round(1e3 * e.block_backward_s, 3),
             "activation MB": round((e.block_activation_bytes or 0) / 1e6, 1)} for e in profile.devices[gpu]]
    create_table_artifact(rows, key=artifact_key("profile", gpu, node), description=f"{gpu} measured on node {node}")
    publish_json(json.loads(profile.to_json()), key=artifact_key("profile", gpu, node, "json"),
                 title=f"{gpu} measured on node {node}")


def model_from_markdown(text: object, source: str, model, what: str):
    """A pydantic ``model`` from what ``publish_json`` wrote, validated (it comes from another machine)."""
    from hetrain.errors import HetrainError

    data = json_from_markdown(text, source, what)
    try:
        return model.from_dict(data) if hasattr(model, "from_dict") else model.model_validate(data)
    except ValidationError as e:
        raise HetrainError(f"{source}: not a valid {what} ({str(e).splitlines()[0]})") from None


def profile_from_markdown(text: object, source: str) -> Profile:
    """The profile ``publish_profile`` wrote, validated."""
    return model_from_markdown(text, source, Profile, "profile")
