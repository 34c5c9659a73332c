"""Plan quality: tokens/s of hetrain, megatron and whale vs the upper bound, per model x cluster.

The upper bound is the sum over GPUs of what each would reach training alone at the cost
model's efficiency (no memory limit, no communication, no bubble), counting forward and
backward only (the useful-work bound): recompute is a cost, not work. hetrain picks each
stage's activation recompute (none, selective, full); beside it, the same planner with full
recompute on every stage (what every plan was before per-stage recompute), and the modes the
chosen plan's stages run. Megatron and whale get the best single mode for all stages. A second
table says where each hetrain plan's share of the bound goes (``hetrain.cost.report.where_time_goes``):
the plan-space limits. Prints the tables, writes bench/results/plan_quality.json.
"""

from __future__ import annotations

from collections import Counter

from _common import ROOT, generated_cluster, print_table, write_results

from hetrain.cost.costmodel import CostModel
from hetrain.cost.report import CAPACITY_PARTS, where_time_goes
from hetrain.errors import NoPlanError
from hetrain.spec.specs import TrainingSettings, load_cluster, load_model
from solver.planners.registry import make_plan

CASES = [
    ("paper-12gpu", "gpt-6.7b", 512),
    ("paper-12gpu", "gpt-13b", 512),
    ("paper-3types", "gpt-6.7b", 512),
    ("paper-3types", "gpt-13b", 512),
    ("paper-3types", "gpt-30b", 512),
    ("paper-32gpu", "gpt-13b", 512),
    ("paper-32gpu", "gpt-30b", 512),
    ("hethub-4types", "gpt-13b", 512),
    ("hethub-4types", "gpt-30b", 512),
    # Llama-shaped (grouped-query attention, SwiGLU, 8192-token sequences)
    ("paper-3types", "llama-3-8b", 512),
    ("hethub-4types", "llama-3-8b", 512),
    # large clusters with small batches per GPU (issue 34); gen-: bench/_common.generated_cluster
    ("large-1024", "gpt-30b", 512),
    ("large-1024", "gpt-30b", 2048),
    ("gen-10240x8", "gpt-30b", 8192),
]
# above this many GPUs the full-recompute comparison is left out (it plans the cluster a second time)
FULL_RECOMPUTE_UP_TO_GPUS = 2048


def cluster_named(name: str):
    if name.startswith("gen-"):
        gpus, types = (int(x) for x in name[4:].split("x"))
        return generated_cluster(gpus, types)
    return load_cluster(ROOT / f"examples/clusters/{name}.yaml")


def main() -> None:
    rows = []
    for cluster_name, model_name, gbs in CASES:
        cluster = cluster_named(cluster_name)
        model = load_model(ROOT / f"examples/models/{model_name}.yaml")
        settings = TrainingSettings(global_batch_size=gbs)
        cost = CostModel(cluster, model, settings)
        useful = cost.upper_bound_tokens_per_s(useful_work=True)
        row = {"cluster": cluster_name, "model": model_name, "gpus": cluster.num_devices, "gbs": gbs,
               "useful_work_bound": useful}
        for planner in ("hetrain", "megatron", "whale"):
            try:
                r = make_plan(planner, cluster, model, settings)
                row[planner] = r.estimate.tokens_per_s
                if planner == "hetrain":
                    row["solve_s"] = r.plan.solver.wall_s
                    row["scope"] = r.plan.solver.model_extra.get("scope", "")
                    row["layout"] = f"tp{r.plan.tp} mb{r.plan.micro_batch_size} x{len(r.plan.pipelines)}"
                    modes = Counter(st.recompute for p in r.plan.pipelines for st in p.stages)
                    row["recompute"] = " ".join(f"{m}:{n}" for m, n in sorted(modes.items()))
                    row["capacity"] = where_time_goes(cost, r.plan, r.estimate)
            except NoPlanError:
                row[planner] = 0.0
        full = settings.model_copy(update={"activation_recompute": "full"})
        try:
            row["hetrain_full"] = make_plan("hetrain", cluster, model, full).estimate.tokens_per_s \
                if cluster.num_devices <= FULL_RECOMPUTE_UP_TO_GPUS else float("nan")
        except NoPlanError:
            row["hetrain_full"] = 0.0
        row["vs_full"] = row["hetrain"] / row["hetrain_full"] if row["hetrain_full"] else float("nan")
        row["of_useful_bound"] = row["hetrain"] / useful
        for base in ("megatron", "whale"):  # a ratio only where both planners found a plan
            ratio = row["hetrain"] / row[base] if row[base] and row["hetrain"] else None
            row[f"vs_{base}"] = ratio
            row[f"vs_{base}_text"] = f"{ratio:.2f}x" if ratio else "no plan fits"
        rows.append(row)
        print(f"{cluster_name} {model_name}: hetrain {row['hetrain']:,.0f} tok/s ({row['of_useful_bound']:.0%} of the "
              f"useful-work bound; {row['vs_full']:.2f}x full recompute everywhere)", flush=True)
    print_table(
        "Plan quality (predicted tokens/s; global batch in sequences of the model's length)",
        rows,
        [("cluster", "cluster"), ("model", "model"), ("GPUs", "gpus"), ("global batch", "gbs"), ("useful-work bound", "{useful_work_bound:,.0f}"),
         ("hetrain", "{hetrain:,.0f}"), ("hetrain / bound", "{of_useful_bound:.1%}"),
         ("full recompute", "{hetrain_full:,.0f}"), ("vs full", "{vs_full:.2f}x"), ("stages by recompute", "recompute"),
         ("megatron", "{megatron:,.0f}"), ("whale", "{whale:,.0f}"), ("vs megatron", "vs_megatron_text"),
         ("vs whale", "vs_whale_text"), ("hetrain layout", "layout"), ("plan from", "scope"), ("solve s", "{solve_s:.2f}")],
    )
    shown = [r | {f"cap_{k}": r["capacity"][k] for k in CAPACITY_PARTS} for r in rows if "capacity" in r]
    print_table(
        "Where hetrain's plan spends the cluster's compute capacity (share of achievable FLOP/s x iteration time;"
        " 'useful work' = hetrain / bound)",
        shown, [("cluster", "cluster"), ("model", "model")]
        + [(label, f"{{cap_{k}:.1%}}") for k, label in CAPACITY_PARTS.items()],
    )
    print(f"\nwrote {write_results('plan_quality', rows)}")


if __name__ == "__main__":
    main()
