"""Predicted vs measured iteration time of many plans trained on the emulated cluster.

Why: the planner ranks plans by the cost model's predictions; if they miss what the runtime
does, it ranks blind. This trains each plan for real (gloo processes, the emulated device
speeds of examples/clusters/cpu-emulated.yaml) and puts the measured median step time next
to the prediction, the prediction made from a profile taken just before on this machine
(per-layer times, and the runtime's own per-step and per-micro-batch costs).

Plans per group: what the hetrain, megatron and whale planners choose, and hand-made ones
(a four-stage pipeline over every device, two pipelines of two stages across the node link, both
also under eager 1F1B (``hetrain.runtime.pipeline``: two more micro-batches in flight per
boundary, sends that overlap compute) and under ZB-H1 (backward split into input and weight
gradients, the weight gradients filling the drain), data-parallel on the fast node only, and TP 2 per node). Groups: gpt-tiny and gpt-small
on loopback, and gpt-small with its two nodes in network namespaces joined by a
``tc``-shaped link (``hetrain.testing.netbed``; needs root, else that group is skipped with
a note), where the cluster file says the link's rate and that each node has one NIC.

Every plan runs twice (``--rounds``: all plans once, then all again), and the faster run is
reported, each round's beside it: this machine is shared, and other work only slows a run
(one round put two runs of one plan 24 % apart).

Reported per plan: predicted and measured seconds per step, the error, and per group
whether the plan the hetrain planner chose was the measured fastest. Targets (issue 13):
every plan within 15 %, median within 10 %.

    python bench/predict_vs_measure.py [--steps 20] [--rounds 2] [--groups tiny,small,small-link] [--plans NAME,...]
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
from hetrain.plan.schema import Plan
from hetrain.profiling.profiler import gpus_from_cluster, profile_model, scale_profile
from hetrain.runtime.launch import launch
from hetrain.spec.specs import ClusterSpec, ModelSpec, TrainingSettings, load_cluster, load_model
from solver.planners.registry import make_plan

WARMUP_STEPS = 5
LINK_MBIT = 200  # the shaped group's node link: 25 MB/s, where gpt-small's sends and gradient sync show
SLOW_LINK_MBIT = 10  # 1.25 MB/s: a stage's send takes about as long as its compute (do sends overlap it?)
# hand-made plans whose sends cross the link, sync does not; in torch's 1F1B and in eager 1F1B (sends overlap compute)
MULTI_STAGE = ("pipeline of 4", "pipeline of 4, eager", "pipeline of 4, zb-h1", "pipeline of 4, gpipe",
               "2 x (fast -> slow)", "2 x (fast -> slow), eager", "2 x (fast -> slow), zb-h1",
               "2 x (fast -> slow), interleaved")
GROUPS = {  # name: (model file, global batch, shaped link in Mbit/s or None for loopback, plans or None for all)
    "tiny": ("gpt-tiny.yaml", 16, None, None),
    "small": ("gpt-small.yaml", 16, None, None),
    "small-link": ("gpt-small.yaml", 16, LINK_MBIT, None),
    "small-slowlink": ("gpt-small.yaml", 16, SLOW_LINK_MBIT, MULTI_STAGE),
}


def shaped_cluster(base: ClusterSpec, rate_mbit: float | None) -> ClusterSpec:
    """The emulated cluster as the cost model must see it: on a shaped bed, its link's rate and one NIC per node."""
    if rate_mbit is None:
        return base
    data = base.model_dump()
    data["inter_node_bandwidth_gbps"] = rate_mbit / 8 / 1000
    data["name"] = f"{base.name}-{rate_mbit:g}mbit"
    for node in data["nodes"]:
        node["nics"] = "one"
    return ClusterSpec.model_validate(data)


def hand_plans(model: ModelSpec, cluster: ClusterSpec, global_batch: int) -> dict[str, Plan]:
    """Plans a person might write: they cover the shapes the planners' choices do not."""
    L = model.num_layers
    fast, slow = "cpu-fast", "cpu-slow"

    def plan(tp: int, micro_batch: int, pipelines: list[tuple[int, list[tuple[list[str], str, int]]]],
             in_flight: list[int] | None = None, schedule: str | None = None) -> Plan:
        """``in_flight`` per stage (the same for every pipeline): eager 1F1B; None: torch's 1F1B (or ``schedule``)."""
        pipes = []
        for m, stages in pipelines:
            at, out = 0, []
            for k, (devices, gpu, blocks) in enumerate(stages):
                out.append({"devices": devices, "gpu": gpu, "layers": [at, at + blocks], "recompute": "none"}
                           | ({"in_flight": in_flight[k]} if in_flight else {}))
                at += blocks
            assert at == L, (at, L)
            pipes.append({"num_microbatches": m, "stages": out} | ({"schedule": schedule} if schedule else {}))
        return Plan.model_validate({"schema": "hetrain.plan/v1", "model": model.model_dump(), "cluster": cluster.name,
                                    "global_batch_size": global_batch, "micro_batch_size": micro_batch, "tp": tp,
                                    "pipelines": pipes})

    slow_blocks = max(1, L // 8)  # a quarter of the speed: the slow devices take the fewest blocks
    fast_a = (L - 2 * slow_blocks) // 2
    fast_b = L - 2 * slow_blocks - fast_a
    two_thirds = round(L * 2 / 3)
    four = [(global_batch, [(["fast/0"], fast, fast_a), (["fast/1"], fast, fast_b),
                            (["slow/0"], slow, slow_blocks), (["slow/1"], slow, slow_blocks)])]
    pairs = [(global_batch // 4, [(["fast/0"], fast, two_thirds), (["slow/0"], slow, L - two_thirds)]),
             (global_batch // 4, [(["fast/1"], fast, two_thirds), (["slow/1"], slow, L - two_thirds)])]
    even = 2 * round(L / 3)  # gpt-tiny's 6 blocks: 4 + 2, as pairs; gpt-small's 8: 6 + 2 (pairs' 5 + 3 do not halve)
    even_pairs = [(m, [(devices, gpu, even if gpu == fast else L - even) for devices, gpu, _ in stages])
                  for m, stages in pairs]
    return {
        "pipeline of 4": plan(1, 1, four),
        "pipeline of 4, eager": plan(1, 1, four, in_flight=[7, 5, 3, 1]),  # two more in flight per boundary
        "2 x (fast -> slow)": plan(1, 2, pairs),
        "2 x (fast -> slow), eager": plan(1, 2, pairs, in_flight=[3, 1]),
        "pipeline of 4, zb-h1": plan(1, 1, four, schedule="zb-h1"),
        "2 x (fast -> slow), zb-h1": plan(1, 2, pairs, schedule="zb-h1"),
        # GPipe (all forwards, then all backwards), as a slow type's pipeline with fewer micro-batches than stages
        # runs it; here at the other plans' micro-batch of 1 (a larger one is priced from a profile taken at 1, a
        # difference of its own)
        "pipeline of 4, gpipe": plan(1, 1, four, schedule="gpipe"),
        # interleaved 1F1B, two chunks per device (the fast one's about 2/3 of the blocks, the slow one's the rest,
        # each an even number, halved)
        "2 x (fast -> slow), interleaved": _interleaved(plan(1, 2, even_pairs), 2),
        # two pipelines of different depth: three stages beside one
        "3 stages + 1, zb-h1": plan(1, 1, [(global_batch * 3 // 4, [(["fast/0"], fast, L - 2 * slow_blocks),
                                                                  (["slow/0"], slow, slow_blocks),
                                                                  (["slow/1"], slow, slow_blocks)]),
                                          (global_batch - global_batch * 3 // 4, [(["fast/1"], fast, L)])],
                                     schedule="zb-h1"),
        "fast node only": plan(1, 2, [(global_batch // 4, [(["fast/0"], fast, L)]),
                                      (global_batch // 4, [(["fast/1"], fast, L)])]),
        "tp2 per node": plan(2, 2, [(global_batch * 2 // 3 // 2, [(["fast/0", "fast/1"], fast, L)]),
                                    (global_batch // 2 - global_batch * 2 // 3 // 2, [(["slow/0", "slow/1"], slow, L)])]),
    }


def _interleaved(plan: Plan, v: int) -> Plan:
    """``plan`` with every pipeline on interleaved 1F1B, v chunks per device (``PipelinePlan.interleave``)."""
    return plan.model_copy(update={"pipelines": [p.interleave(v) for p in plan.pipelines]})


def measure(plan: Plan, cluster_file: Path, steps: int, work: Path, name: str, bed=None) -> list[dict]:
    """The run's metric records after the warm-up steps."""
    path = work / f"{name}.json"
    plan.write(path)
    config = RunConfig(plan=str(path), cluster=str(cluster_file), steps=steps)
    layout = build_layout(plan)
    commands = bed.launch_commands(layout, name) if bed is not None else None
    return launch(config, layout, work / name, commands=commands)[WARMUP_STEPS:]


def compute_ratios(plan: Plan, est, profile, records: list[dict]) -> dict[str, float]:
    """Per GPU type: the compute its ranks measured per step over what the profile predicted for them.

    The stage meter's compute (forward and backward, emulation's stretch included) against the
    stage times less the runtime's per-micro-batch work: how fast the emulated devices really
    ran, beside how fast they ran when profiled (this shared machine's load drifts).
    """
    measured: dict[str, list[float]] = {}
    predicted: dict[str, list[float]] = {}
    for p, (pipe, pest) in enumerate(zip(plan.pipelines, est.pipelines)):
        for k in range(pipe.depth):  # a device's compute is its chunks' (one unless interleaved)
            stage = pipe.stages[k]
            o = profile.runtime.get(stage.gpu)
            compute = sum(pest.stage_s[j] - (o.microbatch_s if o else 0.0) for j in pipe.chunks_of(k)) \
                * pipe.num_microbatches
            for d in stage.devices:
                ranks = [x["compute_s"] for r in records for x in r["ranks"] if x["device"] == d]
                measured.setdefault(stage.gpu, []).append(statistics.median(ranks))
                predicted.setdefault(stage.gpu, []).append(compute)
    return {g: sum(measured[g]) / sum(predicted[g]) for g in measured}


def if_sends_overlapped(plan: Plan, est) -> float:
    """The estimate's iteration time had sends overlapped compute (tau = max(max c_k, max 2 e_k)), as the
    cost model assumed before it was measured: the pipelines' part recomputed, the rest as estimated."""
    if any(p.eager or p.interleaved for p in plan.pipelines):
        return est.iteration_time_s  # eager and interleaved 1F1B: the estimate already has them overlap
    pipes = []
    for pipe, pe in zip(plan.pipelines, est.pipelines):
        tau = max(max(pe.stage_s), max((2 * e for e in pe.p2p_s), default=0.0))
        pipes.append((pipe.num_microbatches - 1) * tau + sum(pe.stage_s) + 2 * sum(pe.p2p_s))
    return est.iteration_time_s - est.pipeline_s + max(pipes)


def take_profile(model: ModelSpec, base: ClusterSpec):
    return profile_model(model, gpus=gpus_from_cluster(base), micro_batch_sizes=[1, 2, 4], tp_degrees=[1, 2],
                         activation_recompute=False, repeats=15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default=str(ROOT / "examples" / "clusters" / "cpu-emulated.yaml"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--groups", default=",".join(GROUPS))
    ap.add_argument("--plans", default=None, help="only these plans, names separated by | (e.g. "
                    "'pipeline of 4|pipeline of 4, zb-h1'; the planners' are hetrain, megatron, whale)")
    ap.add_argument("--rounds", type=int, default=2, help="runs per plan (every plan once, then again); "
                    "the faster run is reported")
    args = ap.parse_args()
    if args.rounds < 1 or args.steps <= WARMUP_STEPS:
        ap.error(f"expected --rounds >= 1 and --steps > {WARMUP_STEPS} (the warm-up steps)")

    import torch
    import yaml

    from hetrain.testing import netbed

    torch.set_num_threads(1)  # as each training rank does
    base = load_cluster(args.cluster)
    rows, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for group in args.groups.split(","):
            model_file, global_batch, rate, only = GROUPS[group]
            if rate is not None:
                ok, why = netbed.available()
                if not ok:
                    notes.append(f"{group}: skipped ({why})")
                    continue
            model = load_model(ROOT / "examples" / "models" / model_file)
            cluster = shaped_cluster(base, rate)
            cluster_file = work / f"{cluster.name}.yaml"
            cluster_file.write_text(yaml.safe_dump(cluster.model_dump(mode="json"), sort_keys=False))
            settings = TrainingSettings(global_batch_size=global_batch, precision="fp32", micro_batch_sizes=[1, 2, 4],
                                        tp_degrees=[1, 2])
            print(f"{group}: profiling {model.name} and planning ...", flush=True)
            profile = take_profile(model, base)
            plans = {} if only else {name: make_plan(name, cluster, model, settings, profile).plan
                                     for name in ("hetrain", "megatron", "whale")}
            plans.update({n: p for n, p in hand_plans(model, cluster, global_batch).items() if not only or n in only})
            if args.plans:
                wanted = [n.strip() for n in args.plans.split("|")]
                plans = {n: p for n, p in plans.items() if n in wanted}
            bed = netbed.NetBed(list(cluster.node_by_name), rate_mbit=rate).up() if rate is not None else None
            group_rows = []
            runs: dict[str, list[tuple]] = {}  # plan name: (measured s, estimate, profile, records) per round
            try:
                for round_ in range(args.rounds):
                    for name, plan in plans.items():
                        # profiled again right before each run: the prediction and the run share the machine's load
                        profile = take_profile(model, base)
                        est = CostModel(cluster, model, settings, profile).estimate(plan)
                        if est.over_capacity():
                            continue
                        run = f"{group}-{name}-{round_}".replace(" ", "_").replace(">", "").replace("(", "").replace(")", "")
                        records = measure(plan, cluster_file, args.steps, work, run, bed)
                        measured = statistics.median(r["step_time_s"] for r in records)
                        runs.setdefault(name, []).append((measured, est, profile, records))
                        print(f"{group}: {name} (round {round_ + 1}): predicted {est.iteration_time_s:.4f} s, "
                              f"measured {measured:.4f} s", flush=True)
            finally:
                if bed is not None:
                    bed.down()
            for name in plans:
                if len(runs.get(name, [])) < args.rounds:
                    notes.append(f"{group}: {name} skipped in {args.rounds - len(runs.get(name, []))} of "
                                 f"{args.rounds} rounds (needs more memory than the emulated devices have)")
            for name, plan_runs in runs.items():
                plan = plans[name]
                # the faster round: this shared machine's other work only ever slows a run down
                measured, est, profile, records = min(plan_runs, key=lambda r: r[0])
                ratios = compute_ratios(plan, est, profile, records)
                scaled = CostModel(cluster, model, settings, scale_profile(profile, ratios)).estimate(plan)
                at_measured_speed = scaled.iteration_time_s
                overlapped = if_sends_overlapped(plan, scaled)
                row = {"group": group, "model": model.name, "link": f"{rate:g} Mbit/s" if rate else "loopback",
                       "plan": name, "layout": describe(plan), "predicted_s": est.iteration_time_s,
                       "multi_stage": any(len(p.stages) > 1 for p in plan.pipelines),
                       "eager": any(p.eager for p in plan.pipelines),
                       "zero_bubble": any(p.schedule_name == "zb-h1" for p in plan.pipelines),
                       "interleaved": any(p.interleaved for p in plan.pipelines),
                       "measured_s": measured, "rounds_s": [r[0] for r in plan_runs],
                       "rounds_text": " / ".join(f"{r[0]:.4f}" for r in plan_runs),
                       "error_pct": 100 * (est.iteration_time_s - measured) / measured,
                       "compute_ratio": ratios,
                       "compute_ratio_text": " ".join(f"{g.removeprefix('cpu-')} {r:.2f}" for g, r in ratios.items()),
                       "at_measured_speed_s": at_measured_speed,
                       "if_overlapped_s": overlapped,
                       "error_if_overlapped_pct": 100 * (overlapped - measured) / measured,
                       "error_at_measured_speed_pct": 100 * (at_measured_speed - measured) / measured}
                print(f"{group}: {name}: predicted {est.iteration_time_s:.4f} s, measured {measured:.4f} s "
                      f"({row['error_pct']:+.1f} %); devices ran at {row['compute_ratio_text']} x their "
                      f"profile; at that speed predicted {at_measured_speed:.4f} s "
                      f"({row['error_at_measured_speed_pct']:+.1f} %)", flush=True)
                group_rows.append(row)
            by_measured = sorted(group_rows, key=lambda r: r["measured_s"])
            by_predicted = sorted(group_rows, key=lambda r: r["predicted_s"])
            for r in group_rows:
                r["measured_rank"] = by_measured.index(r) + 1
                r["predicted_rank"] = by_predicted.index(r) + 1
            rows += group_rows
            chosen = next((r for r in group_rows if r["plan"] == "hetrain"), None)
            if chosen is None:
                continue
            fastest = by_measured[0]
            if fastest is chosen:
                verdict = "yes"
            elif same_plan(plans[fastest["plan"]], plans["hetrain"]):
                verdict = f"yes, {fastest['plan']} chose the same plan (two runs of it differ by run-to-run noise)"
            else:
                verdict = "no"
            notes.append(f"{group}: the planner's choice was the measured fastest: {verdict} "
                         f"(fastest: {fastest['plan']}, {fastest['measured_s']:.4f} s; hetrain's plan "
                         f"{chosen['measured_s']:.4f} s, {chosen['measured_s'] / fastest['measured_s']:.2f}x)")

    print_table("Predicted vs measured seconds per step (median after "
                f"{WARMUP_STEPS} warm-up steps of {args.steps}, the faster of {args.rounds} rounds; each plan "
                "profiled right before its run)", rows,
                [("group", "group"), ("link", "link"), ("plan", "plan"), ("layout", "layout"),
                 ("predicted s", "{predicted_s:.4f}"), ("measured s", "{measured_s:.4f}"),
                 ("each round s", "rounds_text"),
                 ("error", "{error_pct:+.1f} %"), ("devices' speed vs profile", "compute_ratio_text"),
                 ("predicted at that speed", "{at_measured_speed_s:.4f}"),
                 ("error at that speed", "{error_at_measured_speed_pct:+.1f} %"),
                 ("at that speed if sends overlapped", "{error_if_overlapped_pct:+.1f} %"),
                 ("rank predicted", "predicted_rank"), ("rank measured", "measured_rank")])
    for key, label in (("error_pct", "predicted"), ("error_at_measured_speed_pct", "at the devices' measured speed")):
        errors = [abs(r[key]) for r in rows]
        if errors:
            print(f"\n{label}: {len(rows)} plans, median |error| {statistics.median(errors):.1f} %, "
                  f"max {max(errors):.1f} %, within 15 %: {sum(e <= 15 for e in errors)} of {len(errors)}")
    # plans with multi-stage pipelines under torch's 1F1B: their sends matter
    piped = [r for r in rows if r["multi_stage"] and not r["eager"] and not r.get("zero_bubble")]
    if piped:
        for key, label in (("error_at_measured_speed_pct", "sends block (the cost model)"),
                           ("error_if_overlapped_pct", "sends overlap compute")):
            errors = [abs(r[key]) for r in piped]
            print(f"{len(piped)} plans with pipeline sends, at the devices' measured speed, if {label}: median |error| "
                  f"{statistics.median(errors):.1f} %, max {max(errors):.1f} %")
    eager = [r for r in rows if r["eager"]]
    if eager:
        errors = [abs(r["error_pct"]) for r in eager]
        print(f"{len(eager)} plans under eager 1F1B (sends overlap compute): median |error| "
              f"{statistics.median(errors):.1f} %, max {max(errors):.1f} %")
    zero_bubble = [r for r in rows if r.get("zero_bubble")]
    if zero_bubble:
        errors = [abs(r["error_pct"]) for r in zero_bubble]
        print(f"{len(zero_bubble)} plans under ZB-H1: median |error| {statistics.median(errors):.1f} %, "
              f"max {max(errors):.1f} %")
    for note in notes:
        print(f"- {note}")
    print(f"\nresults: {write_results('predict_vs_measure', rows)}")


def same_plan(a: Plan, b: Plan) -> bool:
    """The same devices, blocks, recompute and micro-batches per stage (pipelines in any order)."""
    def key(plan: Plan) -> tuple:
        return (plan.tp, plan.micro_batch_size, sorted(p.model_dump_json() for p in plan.pipelines))
    return key(a) == key(b)


def describe(plan: Plan) -> str:
    """tp, micro-batch, and per pipeline its stages (node x blocks), micro-batches and eager 1F1B's counts."""
    def pipeline(p) -> str:
        eager = f" in flight {'/'.join(str(s.in_flight) for s in p.stages)}" if p.eager else \
            (f" {p.schedule_name}" if p.schedule_name in ("zb-h1", "gpipe") else
             f" interleaved v={p.virtual_stages}" if p.interleaved else "")
        return "+".join(f"{s.devices[0].split('/')[0]}x{s.layers[1] - s.layers[0]}" for s in p.stages) \
            + f" ({p.num_microbatches}{eager})"
    return f"tp{plan.tp} mb{plan.micro_batch_size} " + " / ".join(pipeline(p) for p in plan.pipelines)


if __name__ == "__main__":
    main()
