"""A predicted plan as rows (one per stage): what the CLI's table and the flows' artifact both show."""

from __future__ import annotations

from hetrain.cost.costmodel import CostModel, Estimate
from hetrain.plan.schema import Plan
from hetrain.spec.arithmetic import block_forward_flops, head_forward_flops


def plan_rows(plan: Plan, est: Estimate) -> list[dict]:
    """pipeline, stage, gpu, devices, blocks, recompute, optimizer state, micro-batches, in flight, stage ms, peak GB
    (and the device's capacity). ``in flight``: micro-batches the stage keeps (eager 1F1B's count, else 1F1B's S - k); ``weight
    pending``: those ZB-H1 keeps waiting for their weight gradient; ``schedule``: the pipeline's (``virtual stages``:
    its chunks per device under interleaved 1F1B, else None; a row is then a chunk, its peak GB its device's)."""
    settings = plan.settings()
    rows = []
    for p, (pipe, pest) in enumerate(zip(plan.pipelines, est.pipelines)):
        for k, (stage, stage_s) in enumerate(zip(pipe.stages, pest.stage_s)):
            lo, hi = stage.layers
            rows.append({"pipeline": p, "stage": k, "gpu": stage.gpu, "devices": list(stage.devices),
                         "blocks": f"{lo}-{hi}", "num_blocks": hi - lo,
                         "recompute": settings.stage_recompute(stage.recompute),
                         "optimizer state": stage.optimizer_state or "replicated",
                         "format": stage.precision or settings.precision, "own format": stage.precision is not None,
                         "micro-batches": pipe.num_microbatches,
                         "in flight": pipe.in_flight(k), "weight pending": pipe.weight_pending(k),
                         "schedule": pipe.schedule_name, "virtual stages": pipe.virtual_stages,
                         "stage ms": round(stage_s * 1e3, 2),
                         "peak GB": round(max(est.peak_memory_gb[d] for d in stage.devices), 2),
                         "capacity GB": est.capacity_gb[stage.devices[0]]})
    return rows


# where_time_goes: the categories, in the order tables show them, with their labels
CAPACITY_PARTS = {"useful": "useful work", "recompute": "recompute", "other_stage_work": "TP + embedding + overheads",
                  "sends": "sends", "imbalance": "stage imbalance", "fill_drain": "1F1B fill + drain",
                  "pipelines_done_early": "pipelines done early", "sync_optimizer_step": "sync + optimizer + step",
                  "unused_gpus": "GPUs left out"}


def where_time_goes(cost: CostModel, plan: Plan, est: Estimate) -> dict[str, float]:
    """Shares of the cluster's compute capacity over one predicted iteration, summing to 1.

    Capacity = sum over the cluster's GPUs of achievable FLOP/s x iteration time, the unit of
    the useful-work bound (``CostModel.upper_bound_tokens_per_s(useful_work=True)``), so the
    ``useful`` share is exactly the plan's tokens/s over that bound. Each GPU's seconds are
    weighted by its FLOP/s and split into: its blocks' (and head's) forward + backward FLOPs
    at its achievable rate (``useful``); what its stage's recompute mode adds over none
    (``recompute``); the rest of its stage's per-micro-batch time (TP all-reduces and dispatch,
    the embedding, the runtime's per-micro-batch work,
    and a profile's departure from the nominal rate: ``other_stage_work``); waiting for its
    sends (``sends``; under eager 1F1B, where sends overlap compute, what the steady state takes
    beyond the slowest stage's compute); waiting on a slower stage in the steady state (``imbalance``); the
    pipeline's fill and drain (``fill_drain``); its pipeline finishing before the slowest
    (``pipelines_done_early``); gradient sync, the optimizer step, the fixed per-step work and
    waiting for the slowest GPU's (``sync_optimizer_step``); and GPUs the plan leaves out.
    Without a profile every share is >= 0. With one, stage times are measured: a GPU faster than
    its catalog rate makes ``other_stage_work`` negative (and a noisy measurement ``recompute``),
    while the shares still add to 1 and ``useful`` stays the plan's share of the bound.
    """
    cl = cost.cluster
    rate = {node.name: cost.gpu_flops_per_s(node.gpu) for node in cl.nodes}
    node_of = cl.node_of
    T = est.iteration_time_s
    parts = dict.fromkeys(CAPACITY_PARTS, 0.0)
    used = set()
    for pipe, pest in zip(plan.pipelines, est.pipelines):
        for k in range(pipe.depth):
            F = rate[node_of[pipe.stages[k].devices[0]]]
            seconds = _device_seconds(cost, plan, pipe, pest, k, F)
            seconds["pipelines_done_early"] = est.pipeline_s - pest.time_s
            seconds["sync_optimizer_step"] = T - est.pipeline_s
            for d in pipe.stages[k].devices:
                used.add(d)
                for part, s in seconds.items():
                    parts[part] += s * F
    parts["unused_gpus"] = sum(T * rate[node_of[d.name]] for d in cl.devices if d.name not in used)
    capacity = T * sum(rate[node_of[d.name]] for d in cl.devices)
    return {part: v / capacity for part, v in parts.items()}


def _device_seconds(cost: CostModel, plan: Plan, pipe, pest, k: int, flops_per_s: float) -> dict[str, float]:
    """Seconds of one device of stage k of a pipeline in the step, by part (``where_time_goes``): over its
    chunks (one unless interleaved), its work per micro-batch w_k the sum of theirs."""
    cl, m, st = cost.cluster, cost.model, cost.settings
    t, b = plan.tp, plan.micro_batch_size
    S, mb, tau = len(pipe.stages), pipe.num_microbatches, pest.bottleneck_s
    useful = recompute = 0.0
    for j in pipe.chunks_of(k):
        stage = pipe.stages[j]
        blocks = stage.layers[1] - stage.layers[0]
        flops = 3 * blocks * block_forward_flops(m, b) / t + (3 * head_forward_flops(m, b) / t if j == S - 1 else 0.0)
        useful += mb * flops / flops_per_s
        intra = cl.node_by_name[cl.node_of[stage.devices[0]]].intra_node_bandwidth_gbps
        mode = st.stage_recompute(stage.recompute)
        recompute += mb * blocks * (cost.unit_costs(stage.gpu, intra, t, b, mode, fmt=stage.precision).block_s
                                    - cost.unit_costs(stage.gpu, intra, t, b, "none", fmt=stage.precision).block_s)
    work = sum(pest.stage_s[j] for j in pipe.chunks_of(k))
    if pipe.schedule_name == "1f1b":  # 1F1B: a stage waits for its own sends
        sends = (pest.p2p_s[k - 1] if k > 0 else 0.0) + (pest.p2p_s[k] if k < S - 1 else 0.0)
        own = work + sends
        waits = {"sends": mb * sends, "imbalance": (mb - 1) * (tau - own), "fill_drain": pest.time_s - (mb - 1) * tau - own}
    else:  # eager 1F1B, ZB-H1, interleaved and GPipe, played out: what the sends still cost is a steady state above
        # the slowest device (eager's overlap compute; GPipe's wait, each after its receive is posted), the rest of
        # the device's idle time is fill and drain
        slowest = max(sum(pest.stage_s[j] for j in pipe.chunks_of(d)) for d in range(pipe.depth))
        waits = {"sends": (mb - 1) * max(0.0, tau - slowest), "imbalance": (mb - 1) * max(0.0, min(tau, slowest) - work)}
        waits["fill_drain"] = pest.time_s - mb * work - waits["sends"] - waits["imbalance"]
    return {"useful": useful, "recompute": recompute, "other_stage_work": mb * work - useful - recompute, **waits}
