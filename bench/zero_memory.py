"""Traced peak memory per stage with the optimizer state replicated, sharded (ZeRO-1) and offloaded.

One small asymmetric plan on CPU processes (gloo), each rank's every allocation counted
(``--trace-memory``, ``hetrain.runtime.instrument.AllocationTracker``), on a model whose
weights outweigh its activations (wide blocks, short sequences), so the optimizer state shows;
beside each traced peak, the cost model's prediction for the same plan (``Estimate.peak_memory_gb``
less the framework reserve, which the tracer does not see) and their ratio: the issue's target is
within 10 %; and each phase's peak (forward-backward, the gradient sync, the optimizer step), the
cost model's alternatives beyond the states. Prints a table (MB per rank, the ratios) and writes bench/results/zero_memory.json.

    python bench/zero_memory.py [--steps 2]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _common import ROOT, print_table, write_results

from hetrain.config import RunConfig
from hetrain.cost.costmodel import CostModel
from hetrain.plan.layout import build_layout
from hetrain.plan.schema import Plan
from hetrain.runtime.instrument import TRACED_PHASES
from hetrain.runtime.launch import launch
from hetrain.spec.specs import ClusterSpec, load_model

MODES = ("replicated", "sharded", "offloaded")
MB = 1e6


def the_plan(mode: str) -> Plan:
    """Two pipelines on one node: blocks 0-2 + 2-4 (5 micro-batches) beside 0-4 (3): buckets of two replicas."""
    tiny = load_model(ROOT / "examples" / "models" / "gpt-tiny.yaml")
    model = tiny.model_copy(update={"hidden_size": 256, "num_layers": 4, "seq_length": 32})

    def stage(device: str, layers: list[int]) -> dict:
        return {"devices": [device], "gpu": "cpu", "layers": layers, "optimizer_state": mode}

    return Plan.model_validate({
        "schema": "hetrain.plan/v1", "model": model.model_dump(), "cluster": "bench", "global_batch_size": 16,
        "micro_batch_size": 2, "tp": 1,
        "pipelines": [{"num_microbatches": 5, "stages": [stage("a/0", [0, 2]), stage("a/1", [2, 4])]},
                      {"num_microbatches": 3, "stages": [stage("a/2", [0, 4])]}]})


# The bench's one node as the cost model sees it: CPU ranks (emulated, so foreach AdamW's temporaries count), memory
# to spare; speeds do not enter memory
BENCH_CLUSTER = {"name": "bench", "inter_node_bandwidth_gbps": 1.0,
                 "gpu_types": {"cpu": {"tflops": 0.02, "fp32_tflops": 0.01, "memory_gb": 64, "memory_bandwidth_gbps": 10,
                                       "efficiency": 1.0}},
                 "nodes": [{"name": "a", "gpu": "cpu", "count": 3, "intra_node_bandwidth_gbps": 2.0,
                            "emulate": {"slowdown": 1.0}}]}


def predicted_mb(mode: str) -> dict[str, float]:
    """The cost model's peak per device of the plan in ``mode``, as the runtime runs it on CPU (fp32, no recompute),
    less the framework reserve (the CUDA context and allocator the tracer has no part of)."""
    plan = the_plan(mode)
    settings = plan.settings().model_copy(update={"precision": "fp32", "activation_recompute": "none",
                                                  "framework_reserve_gb": 0.0})
    est = CostModel(ClusterSpec.model_validate(BENCH_CLUSTER), plan.model, settings).estimate(plan)
    return {device: gb * 1e9 / MB for device, gb in est.peak_memory_gb.items()}


def param_mb(plan: Plan, layers: tuple[int, int]) -> float:
    """fp32 parameter MB of a stage (its AdamW state is twice that, replicated)."""
    from hetrain.runtime.model import GPT

    return sum(p.numel() for p in GPT(plan.model, tuple(layers)).parameters()) * 4 / MB


def traced_peaks(mode: str, steps: int, work: Path) -> list[dict]:
    plan = the_plan(mode)
    work.mkdir(parents=True, exist_ok=True)
    plan.write(work / "plan.json")
    config = RunConfig(plan=str(work / "plan.json"), steps=steps, trace_memory=True)
    last = launch(config, build_layout(plan), work / "run")[-1]
    return [{"device": r["device"], "pipeline": r["pipeline"], "stage": r["stage"],
             "layers": plan.pipelines[r["pipeline"]].stages[r["stage"]].layers,
             "peak_mb": r["peak_memory_gb"] * 1e9 / MB,
             **{f"{phase}_mb": gb * 1e9 / MB for phase, gb in r["peak_memory_by_phase_gb"].items()}}
            for r in last["ranks"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        peaks = {mode: traced_peaks(mode, args.steps, Path(tmp) / mode) for mode in MODES}
    predicted = {mode: predicted_mb(mode) for mode in MODES}
    rows = []
    for i, base in enumerate(peaks["replicated"]):
        row = {k: base[k] for k in ("device", "pipeline", "stage")}
        row["layers"] = f"{base['layers'][0]}-{base['layers'][1]}"
        row["params_mb"] = param_mb(the_plan("replicated"), base["layers"])
        for mode in MODES:
            row[f"{mode}_mb"] = peaks[mode][i]["peak_mb"]
            row.update({f"{mode}_{phase}_mb": peaks[mode][i][f"{phase}_mb"] for phase in TRACED_PHASES})
            row[f"{mode}_predicted_mb"] = predicted[mode][base["device"]]
            row[f"{mode}_fit"] = row[f"{mode}_predicted_mb"] / row[f"{mode}_mb"]
        row["sharded_ratio"] = row["sharded_mb"] / row["replicated_mb"]
        row["offloaded_ratio"] = row["offloaded_mb"] / row["replicated_mb"]
        rows.append(row)
    print_table("Traced peak per rank (MB; CPU tracer, gpt-tiny widened to hidden 256, 4 blocks, seq 32)", rows, [
        ("device", "device"), ("pipeline.stage", "{pipeline}.{stage}"), ("blocks", "layers"),
        ("fp32 params MB", "{params_mb:.1f}"),
        ("replicated MB", "{replicated_mb:.1f}"), ("sharded MB", "{sharded_mb:.1f}"),
        ("offloaded MB", "{offloaded_mb:.1f}"), ("sharded / replicated", "{sharded_ratio:.3f}"),
        ("offloaded / replicated", "{offloaded_ratio:.3f}")])
    print_table("Traced peak per phase of a step, MB (what each holds beyond the states: activations, the sync's "
                "chunk, the step's temporaries)", rows, [("device", "device"), ("blocks", "layers")] + [
                    (f"{mode} {phase}", f"{{{mode}_{phase}_mb:.1f}}") for mode in MODES for phase in TRACED_PHASES])
    print_table("Predicted (cost model) against traced peak per rank, MB; target: predicted / traced within 0.9-1.1",
                rows, [("device", "device"), ("blocks", "layers")] + [
                    (f"{mode} {what}", f"{{{mode}_{key}:{fmt}}}") for mode in MODES
                    for what, key, fmt in (("predicted", "predicted_mb", ".1f"), ("/ traced", "fit", ".3f"))])
    print(f"\nwrote {write_results('zero_memory', rows)}")


if __name__ == "__main__":
    main()
