"""The cost model against Sailor's measured runs on the MIT cluster (RTX 3090, RTX 2080 Ti, Titan RTX nodes).

Why: the planner's promise rests on the cost model ranking plans as a real mixed cluster does. Each of the
artifact's plans (converted by ``bench/sailor_convert.py`` into ``tests/fixtures/sailor_mit``) goes through what
``hetrain estimate --profile`` runs (the plan checked against the cluster, then ``CostModel.estimate`` fed the
converted measured profile); the table sets each prediction beside the measured iteration time, and per group
of plans on the same number of nodes whether the plan predicted fastest is the one that was. The plans say the
schedule the runs ran, DeepSpeed's pipeline engine (``deepspeed-1f1b``); beside it, what the same plan would take
under torch's 1F1B, which hetrain runs. No training: a second.

    python bench/sailor_mit.py [--fixture tests/fixtures/sailor_mit] [--analytic]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from _common import ROOT, print_table

FIXTURE = ROOT / "tests" / "fixtures" / "sailor_mit"


def predict(fixture: Path = FIXTURE, measured_profile: bool = True) -> list[dict]:
    """Per run: the measured figures (``measured.json``) with the prediction and its error beside them."""
    from hetrain.cost.costmodel import CostModel
    from hetrain.plan.schema import load_plan, validate_plan
    from hetrain.profiling.profile import load_profile
    from hetrain.spec.specs import load_cluster

    cluster = load_cluster(fixture / "cluster.json")
    profile = load_profile(fixture / "profile.json") if measured_profile else None
    rows = []
    for run in json.loads((fixture / "measured.json").read_text())["runs"]:
        plan = load_plan(fixture / "plans" / f"{run['plan']}.json")
        validate_plan(plan, cluster)
        model = CostModel(cluster, plan.model, plan.settings(), profile)
        est = model.estimate(plan)
        torch_1f1b = plan.model_copy(update={"pipelines": [p.model_copy(update={"schedule": "1f1b"})
                                                           for p in plan.pipelines]})
        rows.append({**run, "predicted_s": est.iteration_time_s, "pipeline_s": est.pipeline_s,
                     "torch_1f1b_s": model.estimate(torch_1f1b).iteration_time_s,
                     "post_s": est.post_s, "error": est.iteration_time_s / run["iteration_s"] - 1,
                     "predicted_peak_gb": max(est.peak_memory_gb.values())})
    return rows


def group_verdicts(rows: list[dict]) -> dict[int, dict]:
    """Per group of plans on the same nodes (more than one plan, none suspect): the really fastest plan and the
    one predicted fastest."""
    out = {}
    for group in sorted({r["group"] for r in rows}):
        runs = [r for r in rows if r["group"] == group and "suspect" not in r]
        if len(runs) < 2:
            continue
        real = min(runs, key=lambda r: r["iteration_s"])["plan"]
        predicted = min(runs, key=lambda r: r["predicted_s"])["plan"]
        out[group] = {"fastest": real, "predicted_fastest": predicted, "right": real == predicted}
    return out


def median_abs_error(rows: list[dict]) -> float:
    return statistics.median(abs(r["error"]) for r in rows if "suspect" not in r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", type=Path, default=FIXTURE)
    ap.add_argument("--analytic", action="store_true", help="without the measured profile (FLOPs at the catalog's)")
    args = ap.parse_args()
    rows = predict(args.fixture, measured_profile=not args.analytic)
    verdicts = group_verdicts(rows)
    for r in rows:
        v = verdicts.get(r["group"])
        r["mark"] = "" if v is None else ("fastest" if r["plan"] == v["fastest"] else "") + (
            " (predicted fastest)" if r["plan"] == v["predicted_fastest"] else "")
        r["note"] = "suspect: left out" if "suspect" in r else ""
    print_table(f"Sailor's MIT runs, {'analytic' if args.analytic else 'measured profile'}", rows, [
        ("nodes", "{group}"), ("plan", "{plan}"), ("pipelines x stages", "{pipelines} x {stages}"),
        ("measured s", "{iteration_s:.1f}"), ("predicted s", "{predicted_s:.1f}"), ("error", "{error:+.1%}"),
        ("of it: sync + step s", "{post_s:.1f}"), ("as torch's 1F1B s", "{torch_1f1b_s:.1f}"), ("measured grad reduce s", "{grad_reduce_s:.1f}"),
        ("ranking", "mark"), ("", "note")])
    right = sum(v["right"] for v in verdicts.values())
    print(f"\nfastest plan predicted fastest in {right} of {len(verdicts)} groups; "
          f"median |error| {median_abs_error(rows):.1%} over {sum('suspect' not in r for r in rows)} runs")


if __name__ == "__main__":
    main()
