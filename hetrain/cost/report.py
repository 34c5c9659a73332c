"""A predicted plan as rows (one per stage): what the CLI's table and the flows' artifact both show."""

from __future__ import annotations

from hetrain.cost.costmodel import Estimate
from hetrain.plan.schema import Plan


def plan_rows(plan: Plan, est: Estimate) -> list[dict]:
    """pipeline, stage, gpu, devices, blocks, recompute, micro-batches, stage ms, peak GB (and the device's capacity)."""
    settings = plan.settings()
    rows = []
    for p, (pipe, pest) in enumerate(zip(plan.pipelines, est.pipelines)):
        for k, (stage, stage_s) in enumerate(zip(pipe.stages, pest.stage_s)):
            lo, hi = stage.layers
            rows.append({"pipeline": p, "stage": k, "gpu": stage.gpu, "devices": list(stage.devices),
                         "blocks": f"{lo}-{hi}", "num_blocks": hi - lo,
                         "recompute": settings.stage_recompute(stage.recompute), "micro-batches": pipe.num_microbatches,
                         "stage ms": round(stage_s * 1e3, 2),
                         "peak GB": round(max(est.peak_memory_gb[d] for d in stage.devices), 2),
                         "capacity GB": est.capacity_gb[stage.devices[0]]})
    return rows
