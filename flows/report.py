"""Prefect artifacts for plans and runs: a table, a picture of the pipelines, progress, timings."""

from __future__ import annotations

import json
import statistics

from pydantic import ValidationError
from prefect.artifacts import (create_markdown_artifact, create_progress_artifact, create_table_artifact,
                               update_progress_artifact)

from hetrain.cost.costmodel import Estimate
from hetrain.cost.report import plan_rows
from hetrain.plan.schema import Plan
from hetrain.profiling.profile import ANALYTIC_NOTE, Profile


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
                 if pipe.eager else ", ZB-H1" if pipe.schedule_name == "zb-h1" else "")
        lines.append(f"pipeline {p}: {stages}   x {pipe.num_microbatches} micro-batches{eager}")
    lines.append("```")
    return "\n".join(lines)


def publish_plan(plan: Plan, est: Estimate, run_id: str, what: str, measured: bool = True) -> None:
    """The plan as a table and its pipelines; a plan of analytic costs says its times are not measured."""
    rows = [{**{k: v for k, v in r.items() if k not in ("num_blocks", "capacity GB")},
             "devices": ", ".join(r["devices"])} for r in plan_rows(plan, est)]
    create_table_artifact(rows, key=artifact_key(run_id, what, "plan"),
                          description=f"{what} plan of run {run_id}" + ("" if measured else f"; {ANALYTIC_NOTE}"))
    create_markdown_artifact(pipelines_markdown(plan, est, f"{what} plan of run {run_id}"),
                             key=artifact_key(run_id, what, "pipelines"), description="pipelines of the plan")


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
