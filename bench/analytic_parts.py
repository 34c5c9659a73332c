"""The analytic cost model against a measured profile, part by part: where an unprofiled plan's time goes wrong.

Why: on one H200 the analytic step of the 1.5B Llama came out 14 % fast (0.559 s against 0.647 s measured) while
the profile-fed one was 2.7 % slow, and the GPT 1.4B's analytic step 5 % slow: one efficiency does not fit both
(issue 51). The parts of a micro-batch on one stage (a block's forward and backward, the embedding, the head, the
runtime's own work) and the optimizer step per parameter, analytic beside measured, say which default is off.
Runs anywhere on a profile's file: on a GPU machine after ``hetrain profile`` (``bench/gpu_check.sh analytic``),
here on a committed profile (Sailor's RTX 3090 nodes). Prints a table, writes bench/results/analytic_parts.json.

    python bench/analytic_parts.py --profile P --cluster C --model M [--gpu TYPE] [--micro-batch-size B] [--tp T]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _common import print_table, write_results

# (part, what it is): the ``UnitCosts`` fields compared, per micro-batch on one TP rank but the optimizer's
PARTS = [("block_s", "a block, forward + backward"), ("block_bwd_s", "a block, backward"),
         ("embed_s", "the embedding, forward + backward"), ("head_s", "the head and loss, forward + backward"),
         ("microbatch_s", "the runtime's own work per micro-batch"),
         ("opt_s_per_param", "the optimizer step, per parameter")]


def parts(profile_path: Path, cluster_path: Path, model_path: Path, gpu: str | None, micro_batch_size: int,
          tp: int) -> tuple[list[dict], dict]:
    """Per part: analytic seconds, measured (the profile's), their ratio; and the whole model's micro-batch on one
    stage (every block, the embedding and the head) both ways."""
    from hetrain.cost.costmodel import CostModel
    from hetrain.profiling.profile import load_profile
    from hetrain.spec.specs import TrainingSettings, load_cluster, load_model

    profile, cluster, model = load_profile(profile_path), load_cluster(cluster_path), load_model(model_path)
    gpu = gpu or sorted(profile.devices)[0]
    node = next(n for n in cluster.nodes if n.gpu == gpu)
    settings = TrainingSettings(global_batch_size=micro_batch_size, precision=profile.precision,
                                activation_recompute="none", micro_batch_sizes=[micro_batch_size], tp_degrees=[tp])
    units = {}
    for name, prof in (("analytic", None), ("measured", profile)):
        units[name] = CostModel(cluster, model, settings, prof).unit_costs(
            gpu, node.intra_node_bandwidth_gbps, tp, micro_batch_size, "none")
    # the runtime's own work and the optimizer step come from the profile's overheads; without them the cost
    # model falls back on its analytic figures, which are then no measurement
    overheads = profile.runtime.get(gpu)
    unmeasured = {"microbatch_s", "opt_s_per_param"} if overheads is None else \
        {"opt_s_per_param"} if overheads.optimizer_s_per_param is None else set()
    rows = []
    for field, what in PARTS:
        a, m = getattr(units["analytic"], field), getattr(units["measured"], field)
        if field in unmeasured:
            m = None
        rows.append({"part": what, "analytic_s": a, "measured_s": m, "ratio": a / m if m else None})
    whole = {name: model.num_layers * u.block_s + u.embed_s + u.head_s + u.microbatch_s for name, u in units.items()}
    rows.append({"part": f"the model's micro-batch ({model.num_layers} blocks, both ends)",
                 "analytic_s": whole["analytic"], "measured_s": whole["measured"],
                 "ratio": whole["analytic"] / whole["measured"]})
    return rows, {"gpu": gpu, "model": model.name, "precision": profile.precision, "micro_batch_size": micro_batch_size,
                  "tp": tp}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, required=True)
    ap.add_argument("--cluster", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--gpu", help="the profile's GPU type (default: its first)")
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    rows, case = parts(args.profile, args.cluster, args.model, args.gpu, args.micro_batch_size, args.tp)
    for r in rows:
        r["ratio_text"] = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        r["measured_text"] = "not in the profile" if r["measured_s"] is None else f"{r['measured_s']:.4g}"
    print_table(f"Analytic vs measured, part by part: {case['model']} on {case['gpu']}, {case['precision']}, "
                f"micro-batch {case['micro_batch_size']}, TP {case['tp']}", rows,
                [("part", "part"), ("analytic s", "{analytic_s:.4g}"), ("measured s", "measured_text"),
                 ("analytic / measured", "ratio_text")])
    for r in rows:
        r.update(case)
    print(f"\nresults: {write_results('analytic_parts', rows)}")


if __name__ == "__main__":
    main()
