"""``hetrain plan``, ``estimate`` and ``profile``: plans, their predictions and the measurements they use."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from hetrain.cli.common import MAX_THREADS, MAX_TIME_LIMIT_S, _int_list, err, labelled, out, user_errors
from hetrain.errors import HetrainError
from hetrain.cli.tables import _compact_table, plan_table, summary_line
from hetrain.files import check_output_file, write_text_atomic

if TYPE_CHECKING:
    from hetrain.spec.specs import ClusterSpec


def _settings(global_batch_size: int, micro_batch_size: int | None, tp: list[int] | None, precision: str,
              recompute: str, no_recompute: bool, grad_reduce: str = "fp32", formats: str = "bf16"):
    from hetrain.spec.specs import TrainingSettings

    if no_recompute and recompute not in ("auto", "none"):
        raise HetrainError(f"--no-recompute contradicts --recompute {recompute}: give one of them")
    try:
        return TrainingSettings.for_search("options", global_batch_size, micro_batch_size=micro_batch_size, tp=tp,
                                           precision=precision, grad_reduce=grad_reduce, formats=formats,
                                           activation_recompute="none" if no_recompute else recompute)
    except HetrainError as e:
        message = str(e)
        for field, option in _OPTION_OF_FIELD.items():
            message = message.replace(f"options: {field}", option)
        raise HetrainError(message) from None


FORMATS_HELP = ("number formats per stage: bf16 (every stage in --precision where its GPU has it, fp16 where a type "
                "has no bf16 tensor cores) or fastest (besides, fp8 on GPU types with fp8 tensor cores, e.g. H100, "
                "L40S, L4, on stages without TP: the blocks' linear layers in fp8 through torchao, bf16 around "
                "them; training follows the plan)")
_OPTION_OF_FIELD = {"global_batch_size": "--global-batch-size", "micro_batch_sizes[0]": "--micro-batch-size",
                    "tp_degrees": "--tp", "activation_recompute": "--recompute", "grad_reduce": "--grad-reduce",
                    "formats": "--formats"}


def capacity_line(cost, plan, est) -> str:
    """Where the plan spends the cluster's compute capacity (the useful-work bound's unit), largest first."""
    from hetrain.cost.report import CAPACITY_PARTS, where_time_goes

    shares = where_time_goes(cost, plan, est)
    # signed: with a measured profile a GPU faster than its catalog rate shows as a negative share
    rest = sorted(((v, k) for k, v in shares.items() if k != "useful" and abs(v) >= 0.005), reverse=True)
    return (f"of the cluster's compute capacity: {shares['useful']:.1%} useful work"
            + "".join(f", {v:.1%} {CAPACITY_PARTS[k]}" for v, k in rest))


def claim_line(plan) -> str:
    """What the plan's optimality covers (``solver.planners.hetrain.plan_hetrain``), where the planner says."""
    claim = (plan.solver.model_extra or {}).get("claim") if plan.solver else None
    return f"optimality: {claim}" if claim else ""


@user_errors
def plan(
    model: Annotated[Path, typer.Option(help="model YAML file, or a model directory (a transformers Llama, "
                                             "an export) to plan for its --init-from")],
    global_batch_size: Annotated[int, typer.Option(help="sequences per optimizer step")],
    cluster: Annotated[Path | None, typer.Option(help="cluster YAML file (or --offers)")] = None,
    seq_length: Annotated[int | None, typer.Option(min=1, help="tokens per sequence to train at (default: the "
                                                               "model file's; for a transformers directory its "
                                                               "max_position_embeddings, at most 4096)")] = None,
    micro_batch_size: Annotated[int | None, typer.Option(help="fix the micro-batch size (default: search 1, 2, 4)")] = None,
    tp: Annotated[list[int] | None, typer.Option(help="allowed TP degrees (repeat; default 1 2 4 8)")] = None,
    precision: Annotated[str | None, typer.Option(help="bf16, fp16 or fp32 (default: fp32 on a cluster of emulated "
                                                        "CPU devices, bf16 on GPUs)")] = None,
    formats: Annotated[str, typer.Option(help=FORMATS_HELP)] = "bf16",
    grad_reduce: Annotated[str, typer.Option(help="dtype of the gradient all-reduce between pipelines: fp32, or "
                                                   "bf16 (half the bytes: where the sync binds, as on large "
                                                   "clusters with one NIC per node); training follows the plan")] = "fp32",
    recompute: Annotated[str, typer.Option(help="activation recompute: auto (the planner picks per stage: none "
                                                 "where memory allows, else selective, else full), none, selective or full")] = "auto",
    no_recompute: Annotated[bool, typer.Option("--no-recompute", help="keep all activations (= --recompute none)")] = False,
    planner: Annotated[str, typer.Option(help="hetrain (the MILP search seeded with the baselines' layouts and per-type "
                                                     "pipelines), milp (the search alone), "
                                                     "megatron, whale or exhaustive")] = "hetrain",
    profile: Annotated[Path | None, typer.Option(help="measured profile JSON (hetrain.profile/v1)")] = None,
    out_file: Annotated[Path | None, typer.Option("--out", help="write the plan JSON here")] = None,
    compare: Annotated[bool, typer.Option(help="also plan with megatron and whale and print one table")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan (or comparison) as JSON")] = False,
    time_limit: Annotated[float, typer.Option(min=0.1, max=MAX_TIME_LIMIT_S, help="seconds per MILP solve")] = 10.0,
    offers: Annotated[Path | None, typer.Option(help="offers YAML file: choose the GPUs to rent, then plan "
                                                     "over them (instead of --cluster)")] = None,
    objective: Annotated[str, typer.Option(help="with --offers: throughput (most expected tokens/s, within "
                                                "--budget-per-hour), cost (most tokens per dollar) or deadline "
                                                "(cheapest to train --tokens within --deadline hours)")] = "throughput",
    budget_per_hour: Annotated[float | None, typer.Option(min=0.0, max=1e9, help="with --offers: dollars per "
                                                                                "hour at most")] = None,
    tokens: Annotated[float | None, typer.Option(min=1.0, max=1e18, help="with --objective deadline: tokens "
                                                                        "to train")] = None,
    deadline: Annotated[float | None, typer.Option(min=1e-3, max=1e6, help="with --objective deadline: "
                                                                          "hours")] = None,
    cluster_out: Annotated[Path | None, typer.Option(help="with --offers: write the rented cluster file here "
                                                          "(default: beside --out, else ./rental-cluster.yaml)")] = None,
    on_demand_only: Annotated[bool, typer.Option("--on-demand-only", help="with --offers: rent no spot "
                                                                          "GPUs")] = False,
):
    """Find the fastest plan for a model on a mixed cluster, or choose the GPUs to rent from offers and plan them."""
    from hetrain.cli.offers import offers_request, plan_offers

    request = offers_request(cluster, compare, offers, objective, budget_per_hour, tokens, deadline, cluster_out,
                             on_demand_only)
    from hetrain.profiling.profile import load_profile
    from hetrain.spec.specs import load_cluster
    from solver.planners.registry import PLANNERS

    if planner not in PLANNERS:
        raise HetrainError(f"--planner: expected one of {', '.join(PLANNERS)}, got '{planner}'")
    cl = load_cluster(cluster) if request is None and cluster else None  # read once: 5,000 lines on 10,240 GPUs
    # the one rule (ClusterSpec.default_precision); rented GPUs are GPUs
    precision = precision or (cl.default_precision if cl is not None else "bf16")
    settings = _settings(global_batch_size, micro_batch_size, tp, precision, recompute, no_recompute, grad_reduce,
                         formats)
    prof = load_profile(profile) if profile else None
    if request is not None:
        return plan_offers(request, model, settings, prof, planner, time_limit, out_file, as_json, seq_length)
    _plan_cluster((cluster, cl), model, settings, prof, profile, planner, time_limit, out_file, compare, as_json,
                  seq_length)


def _plan_cluster(cluster_file: tuple[Path, ClusterSpec], model: Path, settings, prof, profile: Path | None,
                  planner: str, time_limit: float, out_file: Path | None, compare: bool, as_json: bool,
                  seq_length: int | None = None) -> None:
    """``hetrain plan --cluster``: plan (and with ``compare`` the baselines), write, print the table and claim;
    ``cluster_file``: the file and the cluster read from it."""
    from hetrain.cost.costmodel import CostModel
    from hetrain.spec.hf import load_any_model as load_model
    from hetrain.spec.hf import seq_length_note
    from solver.planners.registry import make_plan

    (cluster, cl), md = cluster_file, load_model(model, seq_length)
    note = seq_length_note(model, md) if seq_length is None else None
    if note:
        err.print(f"note: {note}", highlight=False, soft_wrap=True)
    if out_file:
        check_output_file(out_file, "--out", {"--cluster": cluster, "--model": model, "--profile": profile})

    names = [planner] + ([p for p in ("megatron", "whale") if p != planner] if compare else [])
    results = {}
    with err.status("planning...") as status:
        for name in names:
            status.update(f"planning with {name}...")
            try:
                results[name] = make_plan(name, cl, md, settings, prof, time_limit_s=time_limit,
                                          progress=lambda msg: status.update(f"{name}: {msg}"))
            except HetrainError as e:
                if name == planner:
                    raise
                results[name] = e
    main = results[planner]
    cost = CostModel(cl, md, settings, prof)  # for where the plan spends the capacity
    note = fp8_note(cl, settings, main.plan)
    if note:
        err.print(f"note: {note}", highlight=False, soft_wrap=True)
    if out_file:
        main.plan.write(out_file)
    rows = comparison_rows(results) if compare else None
    if as_json:
        print(main.plan.to_json() if rows is None else
              json.dumps({"plan": json.loads(main.plan.to_json()), "comparison": rows}, indent=2))
    else:
        out.print(plan_table(main.plan, main.estimate, f"{planner} plan for {md.name} on {cl.name}"))
        if rows is None:
            out.print(summary_line(main.plan, main.estimate), highlight=False)
        else:
            out.print(comparison_table(rows, f"{md.name} on {cl.name}, global batch {settings.global_batch_size}"))
        out.print(capacity_line(cost, main.plan, main.estimate), highlight=False)
        claim = claim_line(main.plan)
        if claim:
            out.print(claim, highlight=False)
        formats = formats_line(cl, md, settings, prof, main)
        if formats:
            out.print(formats, highlight=False)
    if prof is None:
        from hetrain.profiling.profile import analytic_note

        err.print(f"note: {analytic_note({n.gpu for n in cl.nodes})}", highlight=False, soft_wrap=True)
    if out_file:
        err.print(f"plan written to {out_file}", highlight=False)


def formats_line(cluster, model, settings, profile, result) -> str | None:
    """Where stages compute in another format than the plan's (fp16 on GPUs without bf16 tensor cores, fp8 under
    ``--formats fastest``): which, and the same plan's prediction had every stage been in the plan's format (fp16
    types forced into it on their CUDA cores, fp8 types in it at their tensor-core rate)."""
    from hetrain.cost.costmodel import CostModel

    own = sorted({(s.gpu, s.precision) for p in result.plan.pipelines for s in p.stages if s.precision})
    if not own:
        return None
    forced_types = {name: cluster.gpu_type(name).without_tensor_cores_for(settings.precision)
                    for name, fmt in own if fmt != "fp8"}
    forced = cluster.model_copy(update={"gpu_types": {**cluster.gpu_types, **forced_types}})
    plain = result.plan.model_copy(update={"pipelines": [
        pipe.model_copy(update={"stages": [s.model_copy(update={"precision": None}) for s in pipe.stages]})
        for pipe in result.plan.pipelines]})
    everywhere = CostModel(forced, model, settings.model_copy(update={"formats": None}), profile).estimate(plain)
    why = {"fp8": "fp8 tensor cores: its blocks' linear layers, --formats fastest"}
    said = ", ".join(f"{gpu} in {fmt} ({why.get(fmt, f'no {settings.precision} tensor cores')})" for gpu, fmt in own)
    return (f"number formats: {said}, the rest in {settings.precision}; this plan in {settings.precision} "
            f"everywhere would take {everywhere.iteration_time_s:.3f} s per iteration against "
            f"{result.estimate.iteration_time_s:.3f} s")


def fp8_note(cluster, settings, plan) -> str | None:
    """Why ``--formats fastest`` gave no stage fp8, where it did not (a note: the plan is still the fastest in the
    formats the cluster has)."""
    if settings.format_policy != "fastest" or any(s.precision == "fp8" for p in plan.pipelines for s in p.stages):
        return None
    if settings.precision != "bf16":
        return (f"--formats fastest: fp8 runs inside bf16 (bf16 around its linear layers); under --precision "
                f"{settings.precision} every stage stays {settings.precision}")
    with_fp8 = sorted({n.gpu for n in cluster.nodes if cluster.gpu_type(n.gpu).fp8_tflops is not None})
    if not with_fp8:
        return (f"--formats fastest: no GPU type of cluster '{cluster.name}' has fp8 tensor cores (no fp8_tflops in "
                f"the catalog or its gpu_types); the plan is bf16's")
    if plan.tp > 1:
        return (f"--formats fastest: the plan runs tp {plan.tp} and fp8 runs without tensor parallelism, so its "
                f"{', '.join(with_fp8)} stages stay bf16")
    return f"--formats fastest: the plan leaves the {', '.join(with_fp8)} GPUs, the ones with fp8, out"


def comparison_rows(results: dict) -> list[dict]:
    base = results.get("megatron")
    base_tps = base.estimate.tokens_per_s if base is not None and not isinstance(base, Exception) else None
    rows = []
    for name, r in results.items():
        if isinstance(r, Exception):
            rows.append({"planner": name, "error": str(r)})
            continue
        rows.append({
            "planner": name,
            "iteration_time_s": r.estimate.iteration_time_s,
            "tokens_per_s": r.estimate.tokens_per_s,
            "speedup_over_megatron": r.estimate.tokens_per_s / base_tps if base_tps else None,
            "min_headroom_gb": r.estimate.min_headroom_gb,
            "solve_s": r.plan.solver.wall_s,
            "tp": r.plan.tp, "micro_batch_size": r.plan.micro_batch_size,
            "pipelines": len(r.plan.pipelines),
        })
    return rows


def comparison_table(rows: list[dict], title: str) -> Table:
    table, names = _compact_table(title, [
        ("planner", "planner"), ("iteration s", "iteration\ns"), ("tokens/s", "tokens/s"),
        ("vs megatron", "vs\nmegatron"), ("min headroom GB", "min headroom\nGB"), ("solve s", "solve\ns"),
        ("layout", "layout")])
    for col in names:
        table.add_column(col, justify="left" if col in ("planner", "layout") else "right", no_wrap=col != "layout")
    for r in rows:
        if "error" in r:
            table.add_row(r["planner"], "-", "-", "-", "-", "-", Text(str(r['error']), style="red"))
            continue
        sp = r["speedup_over_megatron"]
        table.add_row(
            r["planner"], f"{r['iteration_time_s']:.3f}", f"{r['tokens_per_s']:,.0f}",
            f"{sp:.2f}x" if sp else "-", f"{r['min_headroom_gb']:.1f}", f"{r['solve_s']:.2f}",
            f"tp={r['tp']} mb={r['micro_batch_size']} pipelines={r['pipelines']}",
        )
    return table


@user_errors
def estimate(
    plan_file: Annotated[Path, typer.Option("--plan", help="plan JSON (hetrain.plan/v1)")],
    cluster: Annotated[Path, typer.Option(help="cluster YAML file")],
    profile: Annotated[Path | None, typer.Option(help="measured profile JSON")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the prediction as JSON")] = False,
):
    """Validate any plan against a cluster and predict its iteration time and memory."""
    from hetrain.cost.costmodel import CostModel
    from hetrain.plan.schema import load_plan, validate_plan
    from hetrain.profiling.profile import load_profile
    from hetrain.spec.specs import load_cluster

    cl = load_cluster(cluster)
    pl = load_plan(plan_file)
    try:
        validate_plan(pl, cl)
    except HetrainError as e:
        raise HetrainError(f"{plan_file}: {e}") from None
    cost = CostModel(cl, pl.model, pl.settings(), load_profile(profile) if profile else None)
    est = cost.estimate(pl)
    if as_json:
        print(json.dumps({**est.to_predicted(), "fits": not est.over_capacity()}, indent=2))
    else:
        pl = pl.model_copy(update={"solver": None})
        out.print(plan_table(pl, est, f"{plan_file} on {cl.name}"))
        out.print(summary_line(pl, est), highlight=False)
        out.print(capacity_line(cost, pl, est), highlight=False)
    if profile is None:  # the plan is priced analytically: say how far such figures fell from measured ones
        from hetrain.profiling.profile import analytic_note

        err.print(f"note: {analytic_note({st.gpu for p in pl.pipelines for st in p.stages})}", highlight=False,
                  soft_wrap=True)
    if est.over_capacity():
        try:
            cost.check_memory(est)
        except HetrainError as e:
            err.print(labelled("does not fit", e), highlight=False)
        raise typer.Exit(1)


@user_errors
def profile(
    model: Annotated[Path, typer.Option(help="model YAML file")],
    out_file: Annotated[Path, typer.Option("--out", help="where to write the profile JSON (hetrain.profile/v1)")],
    micro_batch_sizes: Annotated[str, typer.Option(help="comma-separated micro-batch sizes")] = "1,2,4",
    tp: Annotated[str, typer.Option(help="comma-separated TP degrees (each rank's shard is timed)")] = "1,2",
    gpu: Annotated[str | None, typer.Option(help="GPU type to file the entries under (default: this device)")] = None,
    cluster: Annotated[Path | None, typer.Option(help="file entries under each GPU type of this cluster, "
                                                       "scaled by its `emulate.slowdown` on CPU")] = None,
    precision: Annotated[str, typer.Option(help="bf16, fp16 or fp32 (CPU: fp32)")] = "fp32",
    no_recompute: Annotated[bool, typer.Option("--no-recompute", help="top-level entries without recompute, for readers of older profiles (every mode is measured under `recompute` either way)")] = False,
    threads: Annotated[int, typer.Option(min=1, max=MAX_THREADS, help="CPU threads, as each training rank uses")] = 1,
):
    """Measure per-layer forward/backward time and activation memory on this device."""
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from hetrain.profiling.profiler import gpus_from_cluster, profile_model
    from hetrain.spec.specs import load_cluster, load_model

    spec = load_model(model)
    from hetrain.spec.specs import MAX_MICRO_BATCH, MAX_TP_DEGREE

    mbs = _int_list(micro_batch_sizes, "--micro-batch-sizes", MAX_MICRO_BATCH)
    tps = _int_list(tp, "--tp", MAX_TP_DEGREE)
    check_output_file(out_file, "--out", {"--model": model, "--cluster": cluster})
    if cluster is not None and gpu is not None:
        raise HetrainError("give either --gpu or --cluster, not both")
    if cluster is not None:
        gpus = gpus_from_cluster(load_cluster(cluster))
        if torch.cuda.is_available():
            gpus = {name: 1.0 for name in gpus}  # emulation is for CPU runs only
    else:
        name = gpu or (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
        gpus = {name: 1.0}
    if not torch.cuda.is_available():
        torch.set_num_threads(threads)
    with Progress(TextColumn("[bold]profile"), BarColumn(), MofNCompleteColumn(), console=err) as bar:
        task = bar.add_task("profile", total=len(mbs) * len(tps))
        prof = profile_model(spec, gpus=gpus, micro_batch_sizes=mbs, tp_degrees=tps,
                             activation_recompute=not no_recompute, precision=precision,
                             progress=lambda done, total: bar.update(task, completed=done, total=total))
    write_text_atomic(out_file, prof.to_json() + "\n", "--out")
    table = Table(title=f"{spec.name} per micro-batch, one rank's TP shard", title_justify="left")
    for col in ("gpu", "tp", "micro-batch", "block fwd ms", "block bwd ms", "head fwd+bwd ms", "block act MB"):
        table.add_column(col, justify="left" if col == "gpu" else "right")
    for name, entries in prof.devices.items():
        for e in entries:
            table.add_row(name, str(e.tp), str(e.micro_batch_size), f"{e.block_forward_s * 1e3:.2f}",
                          f"{e.block_backward_s * 1e3:.2f}", f"{(e.head_forward_s + e.head_backward_s) * 1e3:.2f}",
                          f"{(e.block_activation_bytes or 0) / 1e6:.2f}")
    out.print(table)
    for name, o in prof.runtime.items():
        out.print(f"{name}: runtime overheads: {o.step_s * 1e3:.2f} ms per step, {o.microbatch_s * 1e3:.2f} ms per "
                  f"micro-batch and stage, {o.tp_block_s * 1e3:.2f} ms per block under TP, optimizer "
                  f"{(o.optimizer_s_per_param or 0) * 1e9:.2f} ns per parameter", highlight=False)
    out.print(f"profile written to {out_file}", highlight=False)
