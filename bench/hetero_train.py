"""Measured training throughput on the emulated mixed cluster: hetrain's plan vs Megatron's.

Why: the planner's claims are predictions; this trains both plans for real (gloo processes,
emulated device speeds) side by side in one run and reports measured tokens/s, their ratio
(target: hetrain >= 1.3x megatron), and how close the cost model's prediction is to the
measured iteration time after profiling (target: within 10 %).

Steps: profile the model under each emulated GPU type, plan with that profile (hetrain and
megatron planners), then train each plan ``--steps`` steps, alternating plans ``--repeats``
times because this machine is shared and noisy; the median step time after warm-up counts.
The load on this shared machine drifts by 10-20 % over minutes, so before every repeat the
model is profiled again and each plan's prediction for that repeat comes from the fresh
profile (the plans stay fixed); the predicted column is the mean over repeats.

    python bench/hetero_train.py [--steps 25] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _common import ROOT, print_table, write_results

from hetrain.config import RunConfig
from hetrain.cost.costmodel import CostModel
from hetrain.plan.layout import build_layout
from hetrain.profiling.profiler import gpus_from_cluster, profile_model
from hetrain.runtime.launch import launch
from hetrain.spec.specs import TrainingSettings, load_cluster, load_model
from solver.planners.registry import make_plan

WARMUP_STEPS = 5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default=str(ROOT / "examples" / "clusters" / "cpu-emulated.yaml"))
    ap.add_argument("--model", default=str(ROOT / "examples" / "models" / "gpt-small.yaml"))
    ap.add_argument("--global-batch-size", type=int, default=48)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)  # as each training rank does
    cluster, model = load_cluster(args.cluster), load_model(args.model)
    settings = TrainingSettings(global_batch_size=args.global_batch_size, precision="fp32", micro_batch_sizes=[1, 2, 4],
                                tp_degrees=[1, 2])

    def measure_profile():
        return profile_model(model, gpus=gpus_from_cluster(cluster), micro_batch_sizes=settings.micro_batch_sizes,
                             tp_degrees=settings.tp_degrees, activation_recompute=settings.activation_recompute != "none",
                             repeats=9)

    profile = measure_profile()
    plans = {name: make_plan(name, cluster, model, settings, profile) for name in ("hetrain", "megatron")}

    step_times: dict[str, list[float]] = {name: [] for name in plans}
    predicted: dict[str, list[float]] = {name: [] for name in plans}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            if rep > 0:
                profile = measure_profile()
            cost = CostModel(cluster, model, settings, profile)
            for name, result in plans.items():
                predicted[name].append(cost.estimate(result.plan).iteration_time_s)
                plan_path = Path(tmp) / f"{name}.json"
                result.plan.write(plan_path)
                config = RunConfig(plan=str(plan_path), cluster=args.cluster, steps=args.steps)
                records = launch(config, build_layout(result.plan), Path(tmp) / f"{name}-{rep}")
                step_times[name] += [r["step_time_s"] for r in records[WARMUP_STEPS:]]
                print(f"repeat {rep}: {name} predicted {predicted[name][-1]:.4f} s, "
                      f"median step so far {statistics.median(step_times[name]):.4f} s", flush=True)

    tokens = args.global_batch_size * model.seq_length
    rows = []
    base = statistics.median(step_times["megatron"])
    for name, result in plans.items():
        plan = result.plan
        measured = statistics.median(step_times[name])
        predicted_s = statistics.mean(predicted[name])
        rows.append({
            "planner": name,
            "layout": f"tp={plan.tp} mb={plan.micro_batch_size} "
                      + " / ".join("+".join(f"{s.devices[0].split('/')[0]}x{s.layers[1] - s.layers[0]}"
                                            for s in p.stages) + f" ({p.num_microbatches} mb)" for p in plan.pipelines),
            "devices": len(plan.devices()),
            "predicted_s": predicted_s,
            "predicted_per_repeat_s": predicted[name],
            "measured_s": measured,
            "error_pct": 100 * (predicted_s - measured) / measured,
            "tokens_per_s": tokens / measured,
            "speedup": base / measured,
            "steps_measured": len(step_times[name]),
        })
    print_table(
        f"Measured on {cluster.name}, {model.name}, global batch {args.global_batch_size} "
        f"(median step after {WARMUP_STEPS} warm-up steps, {args.repeats} alternating runs of {args.steps} steps)",
        rows,
        [("planner", "planner"), ("plan", "layout"), ("devices", "devices"),
         ("predicted s", "{predicted_s:.4f}"), ("measured s", "{measured_s:.4f}"),
         ("prediction error", "{error_pct:+.1f} %"), ("tokens/s", "{tokens_per_s:,.0f}"),
         ("vs megatron", "{speedup:.2f}x")],
    )
    print(f"\nresults: {write_results('hetero_train', rows)}")


if __name__ == "__main__":
    main()
