"""The ``hetrain`` command line (typer + rich)."""

from __future__ import annotations

import functools
import json
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from hetrain.cli_options import model_options
from hetrain.config import TrainOptions
from hetrain.errors import HetrainError
from hetrain.files import check_output_dir, check_output_file, write_text_atomic
from hetrain.recovery.preemption import MIN_POLL_S
from hetrain.rundir import CONFIG, RunDir
from hetrain.spec.schedule import describe_extension

# Option bounds, each far beyond any meaning: past them a typo hangs or exhausts memory instead of failing.
MAX_TIME_LIMIT_S = 24 * 3600.0  # one MILP solve
MAX_TIMEOUT_S = 3600.0  # a peer silent for an hour is gone
MAX_THREADS = 1024

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Train large models on mixed, preemptible GPUs.")
out = Console()
err = Console(stderr=True)


def user_errors(fn):
    """Turn HetrainError into one red line on stderr and exit code 2, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except HetrainError as e:
            err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None

    return wrapper


def _settings(global_batch_size: int, micro_batch_size: int | None, tp: list[int] | None, precision: str,
              recompute: str, no_recompute: bool):
    from hetrain.spec.specs import TrainingSettings, describe_validation_error
    from pydantic import ValidationError

    if no_recompute and recompute not in ("auto", "none"):
        raise HetrainError(f"--no-recompute contradicts --recompute {recompute}: give one of them")
    kwargs: dict = {"global_batch_size": global_batch_size, "precision": precision,
                    "activation_recompute": "none" if no_recompute else recompute}
    if micro_batch_size is not None:
        kwargs["micro_batch_sizes"] = [micro_batch_size]
    if tp:
        kwargs["tp_degrees"] = tp
    try:
        settings = TrainingSettings(**kwargs)
    except ValidationError as e:
        message = describe_validation_error("options", e)
        for field, option in _OPTION_OF_FIELD.items():
            message = message.replace(f"options: {field}", option)
        raise HetrainError(message) from None
    if micro_batch_size is not None:
        settings.check_batch(micro_batch_size)
    return settings


_OPTION_OF_FIELD = {"global_batch_size": "--global-batch-size", "micro_batch_sizes[0]": "--micro-batch-size",
                    "tp_degrees": "--tp", "activation_recompute": "--recompute"}


def plan_table(plan, est, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("pipeline", "stage", "gpu", "devices", "blocks", "recompute", "micro-batches", "in flight", "stage ms",
                "memory GB"):
        table.add_column(col, justify="right" if col not in ("gpu", "devices", "recompute") else "left")
    from hetrain.cost.report import plan_rows

    rows = plan_rows(plan, est)
    for i, r in enumerate(rows):
        first, last = r["stage"] == 0, i + 1 == len(rows) or rows[i + 1]["stage"] == 0
        table.add_row(str(r["pipeline"]) if first else "", str(r["stage"]), r["gpu"], _compact_devices(r["devices"]),
                      f"{r['blocks']} ({r['num_blocks']})", r["recompute"], str(r["micro-batches"]) if first else "",
                      str(r["in flight"]), f"{r['stage ms']:.1f}", f"{r['peak GB']:.1f} / {r['capacity GB']:.0f}", end_section=last)
    return table


def _compact_devices(devices: list[str]) -> str:
    node = devices[0].split("/")[0]
    idx = [d.split("/")[1] for d in devices]
    return f"{node}/{idx[0]}" if len(idx) == 1 else f"{node}/{{{','.join(idx)}}}"


def capacity_line(cost, plan, est) -> str:
    """Where the plan spends the cluster's compute capacity (the useful-work bound's unit), largest first."""
    from hetrain.cost.report import CAPACITY_PARTS, where_time_goes

    shares = where_time_goes(cost, plan, est)
    # signed: with a measured profile a GPU faster than its catalog rate shows as a negative share
    rest = sorted(((v, k) for k, v in shares.items() if k != "useful" and abs(v) >= 0.005), reverse=True)
    return (f"of the cluster's compute capacity: {shares['useful']:.1%} useful work"
            + "".join(f", {v:.1%} {CAPACITY_PARTS[k]}" for v, k in rest))


def summary_line(plan, est) -> str:
    s = plan.solver
    solver = f"; {s.planner} planner {s.status}, gap {s.gap:.2g}, {s.wall_s:.2f} s" if s else ""
    return (
        f"tp={plan.tp} micro-batch={plan.micro_batch_size} pipelines={len(plan.pipelines)}: "
        f"iteration {est.iteration_time_s:.3f} s, {est.tokens_per_s:,.0f} tokens/s, "
        f"tightest memory headroom {est.min_headroom_gb:.1f} GB{solver}"
    )


@app.command()
@user_errors
def plan(
    cluster: Annotated[Path, typer.Option(help="cluster YAML file")],
    model: Annotated[Path, typer.Option(help="model YAML file")],
    global_batch_size: Annotated[int, typer.Option(help="sequences per optimizer step")],
    micro_batch_size: Annotated[int | None, typer.Option(help="fix the micro-batch size (default: search 1, 2, 4)")] = None,
    tp: Annotated[list[int] | None, typer.Option(help="allowed TP degrees (repeat; default 1 2 4 8)")] = None,
    precision: Annotated[str, typer.Option(help="bf16, fp16 or fp32")] = "bf16",
    recompute: Annotated[str, typer.Option(help="activation recompute: auto (the planner picks per stage: none "
                                                 "where memory allows, else selective, else full), none, selective or full")] = "auto",
    no_recompute: Annotated[bool, typer.Option("--no-recompute", help="keep all activations (= --recompute none)")] = False,
    planner: Annotated[str, typer.Option(help="hetrain (the MILP planner, also 'milp'), megatron, whale or exhaustive")] = "hetrain",
    profile: Annotated[Path | None, typer.Option(help="measured profile JSON (hetrain.profile/v1)")] = None,
    out_file: Annotated[Path | None, typer.Option("--out", help="write the plan JSON here")] = None,
    compare: Annotated[bool, typer.Option(help="also plan with megatron and whale and print one table")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan (or comparison) as JSON")] = False,
    time_limit: Annotated[float, typer.Option(min=0.1, max=MAX_TIME_LIMIT_S, help="seconds per MILP solve")] = 10.0,
):
    """Find the fastest plan for a model on a mixed cluster."""
    from hetrain.cost.costmodel import CostModel
    from hetrain.profiling.profile import load_profile
    from hetrain.spec.specs import load_cluster, load_model
    from solver.planner import PLANNERS, make_plan

    if planner not in PLANNERS:
        raise HetrainError(f"--planner: expected one of {', '.join(PLANNERS)}, got '{planner}'")
    cl, md = load_cluster(cluster), load_model(model)
    settings = _settings(global_batch_size, micro_batch_size, tp, precision, recompute, no_recompute)
    prof = load_profile(profile) if profile else None
    if out_file:
        check_output_file(out_file, "--out")

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
    if out_file:
        main.plan.write(out_file)
    if compare:
        rows = comparison_rows(results)
        if as_json:
            print(json.dumps({"plan": json.loads(main.plan.to_json()), "comparison": rows}, indent=2))
        else:
            out.print(plan_table(main.plan, main.estimate, f"{planner} plan for {md.name} on {cl.name}"))
            out.print(comparison_table(rows, f"{md.name} on {cl.name}, global batch {global_batch_size}"))
            out.print(capacity_line(cost, main.plan, main.estimate), highlight=False)
    elif as_json:
        print(main.plan.to_json())
    else:
        out.print(plan_table(main.plan, main.estimate, f"{planner} plan for {md.name} on {cl.name}"))
        out.print(summary_line(main.plan, main.estimate), highlight=False)
        out.print(capacity_line(cost, main.plan, main.estimate), highlight=False)
    if prof is None:
        from hetrain.profiling.profile import ANALYTIC_NOTE

        err.print(f"note: {ANALYTIC_NOTE}", highlight=False, soft_wrap=True)
    if out_file:
        err.print(f"plan written to {out_file}", highlight=False)


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
    table = Table(title=title, title_justify="left")
    for col in ("planner", "iteration s", "tokens/s", "vs megatron", "min headroom GB", "solve s", "layout"):
        table.add_column(col, justify="left" if col in ("planner", "layout") else "right")
    for r in rows:
        if "error" in r:
            table.add_row(r["planner"], "-", "-", "-", "-", "-", f"[red]{r['error']}[/]")
            continue
        sp = r["speedup_over_megatron"]
        table.add_row(
            r["planner"], f"{r['iteration_time_s']:.3f}", f"{r['tokens_per_s']:,.0f}",
            f"{sp:.2f}x" if sp else "-", f"{r['min_headroom_gb']:.1f}", f"{r['solve_s']:.2f}",
            f"tp={r['tp']} mb={r['micro_batch_size']} pipelines={r['pipelines']}",
        )
    return table


@app.command()
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
    if est.over_capacity():
        try:
            cost.check_memory(est)
        except HetrainError as e:
            err.print(f"[bold red]does not fit:[/] {e}", highlight=False)
        raise typer.Exit(1)


def _int_list(text: str, option: str, most: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise HetrainError(f"{option}: expected comma-separated integers, got '{text}'") from None
    if not values or min(values) < 1 or max(values) > most:
        raise HetrainError(f"{option}: expected integers from 1 to {most}, got '{text}'")
    return values


@app.command()
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
    check_output_file(out_file, "--out")
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


def _checked_plan(plan_file: Path, model: Path | None, cluster: Path | None):
    """The plan, checked against the model and cluster files when given (one line naming the plan otherwise)."""
    from hetrain.plan.schema import load_plan, validate_plan, validate_plan_structure
    from hetrain.spec.specs import load_cluster, load_model

    pl = load_plan(plan_file)
    if model is not None:
        spec = load_model(model)
        if spec != pl.model:
            raise HetrainError(f"{plan_file}: the plan is for model '{pl.model.name}', not the '{spec.name}' in {model}"
                               if spec.name != pl.model.name else
                               f"{plan_file}: the plan's '{pl.model.name}' differs from {model} "
                               f"({', '.join(k for k in spec.model_fields if getattr(spec, k) != getattr(pl.model, k))})")
    try:
        if cluster is not None:
            validate_plan(pl, load_cluster(cluster))
        else:
            validate_plan_structure(pl)
    except HetrainError as e:
        raise HetrainError(f"{plan_file}: {e}") from None
    return pl


@app.command()
@user_errors
@model_options(TrainOptions, into="options")
def train(
    plan_file: Annotated[Path, typer.Option("--plan", help="plan JSON (hetrain.plan/v1)")],
    options: TrainOptions,
    model: Annotated[Path | None, typer.Option(help="model YAML; must be the model the plan is for")] = None,
    cluster: Annotated[Path | None, typer.Option(help="cluster YAML: checks the plan, applies `emulate` on CPU")] = None,
    metrics: Annotated[Path | None, typer.Option(help="per-step JSONL (default RUN_DIR/metrics.jsonl)")] = None,
    run_dir: Annotated[Path | None, typer.Option(help="run directory (default runs/<plan name>)")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="require a resume: fail unless --run-dir has a committed "
                                                          "checkpoint (an existing run resumes anyway)")] = False,
    restart: Annotated[bool, typer.Option("--restart", help="start an existing run over from step 0; its files "
                                                            "are moved to RUN_DIR/archive/<time>, never deleted")] = False,
    print_launch: Annotated[bool, typer.Option(help="print the per-node launch commands and exit")] = False,
    main_address: Annotated[str, typer.Option(help="rendezvous host for --print-launch")] = "NODE0_ADDRESS",
    dump_dir: Annotated[Path | None, typer.Option(hidden=True, help="tests: dump gradients and parameters")] = None,
    trace_memory: Annotated[bool, typer.Option(hidden=True, help="CPU: count every allocation for the peak "
                                                                  "memory (slow; tests and benchmarks)")] = False,
    peer: Annotated[list[str] | None, typer.Option(help="NODE=URL where a node's checkpoint root is served "
                                                         "(hetrain serve); repeatable")] = None,
    run_id: Annotated[str | None, typer.Option(help="run name in checkpoints (default: the run directory's name)")] = None,
):
    """Train the plan's model under the plan: one process per device, through accelerate launch."""
    from hetrain.config import RUN_ID, build_run_config
    from hetrain.plan.layout import build_layout
    from hetrain.recovery.runs import prepare_run

    pl = _checked_plan(plan_file, model, cluster)
    layout = build_layout(pl)
    run_dir = run_dir or Path("runs") / plan_file.stem
    if not RUN_ID.match(run_id or run_dir.resolve().name):
        raise HetrainError(f"--run-id '{run_id or run_dir.resolve().name}': expected letters, digits, '.', '_' or "
                           f"'-' (at most 64), starting with a letter or digit")
    config = build_run_config(run_dir, plan_file, options, run_id=run_id, cluster=cluster, metrics=metrics,
                              peers=_peer_urls(peer), trace_memory=trace_memory,
                              dump_dir=str(dump_dir.resolve()) if dump_dir else None)
    if options.data is not None:
        from hetrain.runtime.data import TokenSource

        TokenSource(pl.model.seq_length, pl.model.vocab_size, path=options.data)  # bad data: one line now, not per rank
    if options.precision is not None and pl.training is not None and options.precision != pl.training.precision:
        err.print(f"note: the plan was made for {pl.training.precision}; its predictions do not hold in "
                  f"{options.precision}", highlight=False)
    if print_launch:
        _print_launch(config, layout, run_dir, main_address)
        return
    prepared = prepare_run(run_dir.resolve(), config, pl, list(layout.nodes), more_steps=options.more_steps,
                           resume=resume, restart=restart,
                           warn=lambda w: err.print(f"[yellow]note:[/] {w}", highlight=False, soft_wrap=True))
    if prepared.archived is not None:
        err.print(f"previous run moved to {prepared.archived}", highlight=False)
    config = prepared.config
    out.print(f"training {pl.model.name} on {layout.world_size} processes "
              f"({len(pl.pipelines)} pipelines, tp {pl.tp})"
              + (f", resuming after step {prepared.resumed_step} up to step {config.steps}"
                 if prepared.resumed_step is not None else "")
              + f"; run directory {run_dir}", highlight=False)
    records = _launch_with_progress(config, layout, run_dir)
    _report_run(records, config, run_dir)


def _print_launch(config, layout, run_dir: Path, main_address: str) -> None:
    from hetrain.runtime.launch import node_commands, write_config

    check_output_dir(run_dir, "--run-dir")  # the config is written here; the nodes' paths are theirs
    path = write_config(config, run_dir.resolve())
    out.print(f"# copy {run_dir} (config.json), the plan and data to every node, then run there:")
    for cmd in node_commands(layout, str(path), main_address, 29500, run_dir.name):
        out.print(f"# on {cmd.node}:\n{cmd.shell()}", highlight=False, soft_wrap=True)


def _launch_with_progress(config, layout, run_dir: Path) -> list[dict]:
    """Launch the run under a progress bar; a signal stops every worker and exits 128 + its number."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from hetrain.runtime.launch import launch

    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                        TimeRemainingColumn(), console=out, transient=False)
    with progress:
        task = progress.add_task("train", total=config.steps, completed=config.start_step, info="starting processes")

        def show(record: dict) -> None:
            progress.update(task, completed=record["step"] + 1,
                            info=f"loss {record['loss']:.3f}  {record['tokens_per_s']:,.0f} tok/s")
            if "lr_schedule_extended" in record:
                progress.console.print(f"note: {describe_extension(record['lr_schedule_extended'], record['step'])}",
                                       highlight=False, soft_wrap=True)
            for failure in record.get("backup_failed", []):  # as it happens, not only when the run ends
                progress.console.print(f"[bold red]backup failed:[/] {failure} ({config.checkpoint.remote_url})",
                                       highlight=False, soft_wrap=True)

        received: list[int] = []

        def terminate(signum, _frame):  # Ctrl-C, SIGTERM, SIGHUP: stop every worker
            received.append(signum)
            raise KeyboardInterrupt

        # SIGINT too: a shell starts background jobs with SIGINT ignored, and `kill -INT` must still stop the run
        previous_handlers = {sig: signal.signal(sig, terminate)
                             for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            return launch(config, layout, run_dir, on_record=show)
        except KeyboardInterrupt:
            name = signal.Signals(received[0]).name if received else "interrupted"
            err.print(f"{name}: every training process of this run has been stopped; "
                      + ("the same command resumes it from its newest checkpoint" if config.checkpoint else
                         "it kept no checkpoints (--no-checkpoints), so --restart starts it over"))
            raise typer.Exit(128 + (received[0] if received else signal.SIGINT)) from None
        finally:
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)


def _report_run(records: list[dict], config, run_dir: Path) -> None:
    """The run's last line, and exit 3 when its newest checkpoint did not reach the remote store."""
    from hetrain.recovery.runs import EXIT_NOT_BACKED_UP, backup_problem

    if records:
        tail = records[len(records) // 2:] or records
        mean_tps = sum(r["tokens_per_s"] for r in tail) / len(tail)
        out.print(f"done: {len(records)} steps, loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}, "
                  f"{mean_tps:,.0f} tokens/s (second half); metrics in {config.metrics or RunDir.of(run_dir).metrics}",
                  highlight=False)
    problem = backup_problem(config)
    if problem:  # trained, and the checkpoints are on the nodes' disks, but not (all) in the remote store
        err.print(f"[bold red]backup:[/] {problem}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_NOT_BACKED_UP)


def _peer_urls(peers: list[str] | None) -> dict[str, str]:
    peer_urls = {}
    for item in peers or []:
        node, sep, url = item.partition("=")
        if not sep or not node or not url:
            raise HetrainError(f"--peer: expected NODE=URL, got '{item}'")
        peer_urls[node] = url
    return peer_urls


@app.command()
@user_errors
def serve(
    root: Annotated[Path, typer.Option(help="this node's checkpoint root")],
    host: Annotated[str, typer.Option(help="address to listen on (peers on other machines: 0.0.0.0 or this "
                                           "node's address)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port")] = 8470,
    token_env: Annotated[str, typer.Option(help="environment variable holding the bearer token (unset: no token)")]
    = "HETRAIN_PEER_TOKEN",
    insecure: Annotated[bool, typer.Option("--insecure", help="serve beyond loopback without a token")] = False,
):
    """Serve this node's checkpoints read-only over HTTP for peers' recovery."""
    import os

    import uvicorn

    from hetrain.checkpoint.peer import make_app

    token = os.environ.get(token_env) or None
    loopback = host == "localhost" or host.startswith("127.") or host == "::1"
    if not token and not loopback and not insecure:
        raise HetrainError(f"--host {host}: checkpoints hold the model's weights; set a bearer token in ${token_env} "
                           f"to serve beyond loopback (or pass --insecure on a trusted network)")
    err.print(f"serving {root} on http://{host}:{port} ({'bearer token required' if token else 'no token'})")
    uvicorn.run(make_app(root, token), host=host, port=port, log_level="warning")


@app.command()
@user_errors
def recover(
    run: Annotated[Path, typer.Option(help="run directory of hetrain train (holds config.json)")],
    lost_nodes: Annotated[str, typer.Option(help="comma-separated names of the nodes that are gone")],
    cluster: Annotated[Path | None, typer.Option(help="new cluster file (e.g. with replacement nodes)")] = None,
    steps: Annotated[int | None, typer.Option(min=1, help="train until this step (default: as before)")] = None,
    planner: Annotated[str, typer.Option(help="planner for the survivors")] = "hetrain",
    timeout_s: Annotated[float, typer.Option(min=0.1, max=MAX_TIMEOUT_S,
                                             help="seconds before a silent peer counts as gone")] = 10.0,
    no_peers: Annotated[bool, typer.Option("--no-peers", help="fetch everything from the remote store")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
):
    """Re-plan without the lost nodes, reassemble the last checkpoint (peers first), resume training."""
    from rich.progress import BarColumn, Progress, TextColumn

    from hetrain.recovery.recover import recover as do_recover
    from solver.planner import make_plan

    lost = [n.strip() for n in lost_nodes.split(",") if n.strip()]
    if not lost:
        raise HetrainError("--lost-nodes: expected at least one node name")

    def plan_for(cl, model, settings):
        return make_plan(planner, cl, model, settings).plan

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                  console=err, transient=True) as bar:
        task = bar.add_task("recover", total=1.0, info="")
        result = do_recover(
            run, lost, plan_for, cluster_file=cluster, steps=steps, timeout_s=timeout_s, use_peers=not no_peers,
            on_progress=lambda what, frac: bar.update(task, description=what, completed=frac, info=""),
            on_record=lambda r: bar.update(task, description="train", completed=1.0,
                                           info=f"step {r['step']} loss {r['loss']:.3f}"))
    by_kind = result.bytes_by_kind()
    summary = {"run": str(result.run_dir), "lost_nodes": lost, "checkpoint_step": result.step,
               "resumed_at": result.step + 1, "plan": str(result.plan_path), "timings_s": result.timings_s,
               "bytes_from_peers": by_kind["peers"], "bytes_from_remote": by_kind["remote"],
               "steps_trained": len(result.records), "warnings": result.fetch.warnings()}
    for warning in result.fetch.warnings():  # why a peer or a newer step was not used: never silent
        err.print(f"[yellow]note:[/] {warning}", highlight=False, soft_wrap=True)
    if json_out:
        out.print_json(json.dumps(summary))
        return
    table = Table(title=f"recovered {run} from step {result.step} without {', '.join(lost)}", title_justify="left")
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    for k, v in result.timings_s.items():
        table.add_row(k.removesuffix("_s"), f"{v:.2f}")
    out.print(table)
    out.print(f"fetched {by_kind['peers'] / 1e6:.1f} MB from peers, {by_kind['remote'] / 1e6:.1f} MB from the "
              f"remote store; new plan {result.plan_path}; trained {len(result.records)} steps", highlight=False)


@app.command()
@user_errors
def switch(
    run: Annotated[Path, typer.Option(help="run directory of the running run (holds config.json)")],
    leaving_nodes: Annotated[str, typer.Option(help="comma-separated nodes that got a preemption notice")],
    deadline: Annotated[str, typer.Option(help="when they go: ISO 8601 (UTC without a zone) or seconds from now")],
    cluster: Annotated[Path | None, typer.Option(help="new cluster file (e.g. with replacement nodes)")] = None,
    steps: Annotated[int | None, typer.Option(min=1, help="train until this step (default: as before)")] = None,
    planner: Annotated[str, typer.Option(help="planner for the nodes that stay")] = "hetrain",
    switch_reserve_s: Annotated[float, typer.Option(min=0.0, max=MAX_TIMEOUT_S, help=(
        "fall back to a restart unless the new ranks are ready this long before the deadline"))] = 20.0,
    timeout_s: Annotated[float, typer.Option(min=0.1, max=MAX_TIMEOUT_S,
                                             help="seconds before a silent peer counts as gone")] = 10.0,
    json_out: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
):
    """Inside a notice window: start the new plan beside the running one, checkpoint, switch (training pauses for seconds)."""
    import time as _time

    from hetrain.recovery.preemption import parse_utc
    from hetrain.recovery.proactive import recover_in_notice_window
    from solver.planner import make_plan

    leaving = [n.strip() for n in leaving_nodes.split(",") if n.strip()]
    if not leaving:
        raise HetrainError("--leaving-nodes: expected at least one node name")
    try:
        when = _time.time() + float(deadline)
    except ValueError:
        try:
            when = parse_utc(deadline).timestamp()
        except ValueError:
            raise HetrainError(f"--deadline '{deadline}': expected an ISO 8601 time or seconds from now") from None

    def plan_for(cl, model, settings):
        return make_plan(planner, cl, model, settings).plan

    result = recover_in_notice_window(run, leaving, plan_for, when, cluster_file=cluster, steps=steps,
                                      timeout_s=timeout_s, switch_reserve_s=switch_reserve_s,
                                      on_progress=lambda line: err.print(line, highlight=False))
    summary = {"run": str(result.run_dir), "leaving_nodes": leaving, "switched": result.switched,
               "why_not": result.why_not, "checkpoint_step": result.step, "resumed_at": result.step + 1,
               "plan": str(result.plan_path), "timings_s": result.timings_s,
               "bytes_from": result.bytes_from(), "steps_trained": len(result.records),
               "warnings": result.fetch.warnings()}
    for warning in result.fetch.warnings():
        err.print(f"[yellow]note:[/] {warning}", highlight=False, soft_wrap=True)
    if json_out:
        out.print_json(json.dumps(summary))
        return
    how = "switched" if result.switched else f"restarted ({result.why_not})"
    table = Table(title=f"{run}: {how} at step {result.step} without {', '.join(leaving)}", title_justify="left")
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    for k, v in result.timings_s.items():
        if v is not None:
            table.add_row(k.removesuffix("_s"), f"{v:.2f}")
    out.print(table)
    b = result.bytes_from()
    out.print(f"fetched {b['staying'] / 1e6:.1f} MB from the nodes that stay, {b['leaving'] / 1e6:.1f} MB from the "
              f"leaving nodes, {b['remote'] / 1e6:.1f} MB from the remote store; new plan {result.plan_path}; "
              f"trained {len(result.records)} steps", highlight=False)


@app.command()
@user_errors
def export(
    run: Annotated[Path, typer.Option(help="run directory (holds config.json)")],
    out_dir: Annotated[Path, typer.Option("--out", help="directory for model.safetensors (+ config.json)")],
    step: Annotated[int | None, typer.Option(min=0, help="a committed step (default: the newest)")] = None,
    dtype: Annotated[str, typer.Option(help="fp32 (as trained: exact), bf16 or fp16")] = "fp32",
    timeout_s: Annotated[float, typer.Option(min=0.1, max=MAX_TIMEOUT_S,
                                             help="seconds before a silent peer counts as gone")] = 10.0,
):
    """Write a run's committed checkpoint as one model.safetensors (+ a transformers config.json for Llama)."""
    from hetrain.export import check_dtype, export_run

    check_dtype(dtype)
    if not RunDir.of(run).config.is_file():
        raise HetrainError(f"--run {run}: no {CONFIG} (not a run directory)")
    check_output_dir(out_dir, "--out")
    result = export_run(run, out_dir, step=step, dtype=dtype, timeout_s=timeout_s)
    out.print(f"exported step {result.step} of {run}: {result.num_params:,} parameters, "
              f"{result.num_bytes / 1e6:.1f} MB {dtype} -> {', '.join(str(out_dir / f) for f in result.files)}",
              highlight=False, soft_wrap=True)


@app.command()
@user_errors
def restore(
    run: Annotated[Path, typer.Option(help="this node's copy of the run directory (holds config.json)")],
    node: Annotated[str, typer.Option(help="this node's name in the run's plan")],
    lost_nodes: Annotated[str, typer.Option(help="comma-separated names of the nodes that are gone")],
    still_up: Annotated[str, typer.Option(help="lost nodes still inside their notice window (asked after the "
                                               "survivors, before the remote store)")] = "",
    timeout_s: Annotated[float, typer.Option(min=0.1, max=MAX_TIMEOUT_S,
                                             help="seconds before a silent peer counts as gone")] = 10.0,
    no_peers: Annotated[bool, typer.Option("--no-peers", help="fetch everything from the remote store")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
):
    """On one surviving node: the run's newest committed checkpoint into RUN/restore/step-N, this node's disk first.

    What the node holds is read from its own checkpoint directory (verified), the rest from the
    other survivors' peer servers, then the remote store; every survivor runs this at once
    (the recover flow's ``launch=per-node`` does it through ``hetrain-node-restore``).
    """
    import time

    from hetrain.recovery.recover import restore_run_on_node

    lost = [n.strip() for n in lost_nodes.split(",") if n.strip()]
    if not lost:
        raise HetrainError("--lost-nodes: expected at least one node name")
    if not RunDir.of(run).config.is_file():
        raise HetrainError(f"--run {run}: no {CONFIG} (not a run directory of this node)")
    started = time.perf_counter()
    report, _, _ = restore_run_on_node(run, node, lost, timeout_s=timeout_s, use_peers=not no_peers,
                                       still_up=[n.strip() for n in still_up.split(",") if n.strip()])
    seconds = time.perf_counter() - started
    kinds = report.by_kind(node)
    for warning in report.warnings():
        err.print(f"[yellow]note:[/] {warning}", highlight=False, soft_wrap=True)
    summary = {"node": node, "step": report.step, "dest": str(RunDir.of(run).restored(report.step)), "seconds": seconds,
               "local_bytes": kinds["local"], "peer_bytes": kinds["peers"], "bucket_bytes": kinds["remote"],
               "by_source": report.by_source()}
    if json_out:
        out.print_json(json.dumps(summary))
        return
    table = Table(title=f"node {node}: step {report.step} of {run} restored in {seconds:.2f} s", title_justify="left")
    for col in ("source", "MB"):
        table.add_column(col, justify="left" if col == "source" else "right")
    for source, size in report.by_source().items():
        table.add_row("this node's disk" if source == node else source, f"{size / 1e6:.1f}")
    out.print(table)


@app.command()
@user_errors
def watch(
    node: Annotated[str, typer.Option(help="this node's name in the cluster file")],
    cloud: Annotated[str, typer.Option(help="aws, gcp or azure")],
    run: Annotated[Path | None, typer.Option(help="run directory: ask its ranks for an emergency checkpoint")] = None,
    runs_root: Annotated[Path | None, typer.Option(help="this node's runs root: every run active on the node at "
                                                        "the notice checkpoints (what `hetrain node start` does)")]
    = None,
    metadata_url: Annotated[str | None, typer.Option(help="metadata endpoint base URL (default: the cloud's)")] = None,
    poll_s: Annotated[float, typer.Option(min=MIN_POLL_S, max=60.0, help="seconds between polls (at least "
                                                                         f"{MIN_POLL_S:g}: the endpoint is shared)")] = 5.0,
    min_checkpoint_s: Annotated[float, typer.Option(min=0.0, help="skip the checkpoint when less time is left")] = 10.0,
    wait_checkpoint_s: Annotated[float, typer.Option(min=0.0, max=MAX_TIMEOUT_S,
                                                     help="after a request, wait this long for the checkpoint "
                                                          "(never past the notice's deadline)")] = 60.0,
    stop_after_checkpoint: Annotated[bool, typer.Option(
        "--stop-after-checkpoint", help="the runs end at the emergency checkpoint (the recovery resumes them "
                                        "from it) instead of training until the node goes")] = False,
    defer_checkpoint_s: Annotated[float | None, typer.Option(
        min=0.0, help="a notice leaving more seconds than this calls the hook at once and leaves the checkpoint to "
                      "the recovery it starts (a notice-window switch asks for it when its new ranks are ready); "
                      "asked for here --min-checkpoint-s before the deadline if nobody has")] = None,
    hook_command: Annotated[str | None, typer.Option(
        help="shell command run on a notice (once per active run with --runs-root); gets HETRAIN_NOTICE (JSON), "
             "HETRAIN_NODE, HETRAIN_CHECKPOINT_STEP, and HETRAIN_RUN_DIR, HETRAIN_RUN_ID, HETRAIN_RUN_INFO (JSON)")]
    = None,
):
    """Watch for a spot preemption notice (or SIGTERM); checkpoint and call a hook when one comes."""
    import os
    import subprocess

    from hetrain.recovery.preemption import SOURCES, PreemptionWatcher, active_runs, wait_for_checkpoint

    if cloud not in SOURCES:
        raise HetrainError(f"--cloud: expected one of {', '.join(SOURCES)}, got '{cloud}'")
    if run is not None and runs_root is not None:
        raise HetrainError("--run and --runs-root: give one (a run, or every run active on this node)")
    if runs_root is not None and not runs_root.is_dir():
        raise HetrainError(f"--runs-root {runs_root}: not a directory")
    # (run directory, what its node flow recorded) for each run the notice concerns
    runs: list[tuple[Path, dict]] = [(run.resolve(), {})] if run else []

    def request_files() -> list[Path]:
        if runs_root is not None:
            runs[:] = [(d.resolve(), info) for d, info in active_runs(runs_root)]
        return [RunDir(d).checkpoint_request for d, _ in runs]

    def on_notice(notice, checkpoint: bool) -> None:
        left = notice.seconds_left()
        wait_s = wait_checkpoint_s if left is None else max(0.0, min(wait_checkpoint_s, left))
        for run_dir, info in runs or [(None, {})]:
            request = RunDir(run_dir).checkpoint_request if run_dir else None
            step = wait_for_checkpoint(request, wait_s) if request in watcher.requested else None
            if request in watcher.requested:
                err.print(f"{run_dir.name}: emergency checkpoint "
                          f"{'committed at step ' + str(step) if step is not None else 'not confirmed'}",
                          highlight=False)
            if hook_command:
                env = {**os.environ, "HETRAIN_NOTICE": json.dumps(notice.to_dict()), "HETRAIN_NODE": node,
                       "HETRAIN_CHECKPOINT_STEP": "" if step is None else str(step),
                       "HETRAIN_RUN_DIR": str(run_dir or ""), "HETRAIN_RUN_ID": run_dir.name if run_dir else "",
                       "HETRAIN_RUN_INFO": json.dumps(info)}
                done = subprocess.run(hook_command, shell=True, env=env, check=False)
                if done.returncode != 0:
                    err.print(f"hook for {run_dir.name if run_dir else 'the notice'} exited {done.returncode}",
                              highlight=False)

    watcher = PreemptionWatcher(SOURCES[cloud](metadata_url), node,
                                request_file=request_files if runs_root is not None else
                                (RunDir(runs[0][0]).checkpoint_request if runs else None),
                                min_checkpoint_s=min_checkpoint_s, on_notice=on_notice, poll_s=poll_s,
                                log=lambda msg: err.print(msg, highlight=False),
                                stop_after_checkpoint=stop_after_checkpoint, defer_checkpoint_s=defer_checkpoint_s)
    watcher.install_sigterm()
    # SIGINT stops the watcher (how `hetrain node start` stops it), even when this process was started
    # with SIGINT ignored (a background job of a non-interactive shell, nohup scripts)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    err.print(f"watching {cloud} preemption notices for node {node}"
              + (f" (runs under {runs_root})" if runs_root else ""), highlight=False)
    try:
        notice = watcher.run()
        if watcher.deferred is not None:  # the fallback request, if no recovery asks before it
            watcher.deferred.join()
    except KeyboardInterrupt:  # stopped (`hetrain node start` stops its watcher so): not a notice
        raise typer.Exit(130) from None
    raise typer.Exit(0 if notice is not None else 1)


node_app = typer.Typer(no_args_is_help=True, help="Run this machine as a node of a cluster.")
app.add_typer(node_app, name="node")


@node_app.command("start")
@user_errors
def node_start(
    name: Annotated[str, typer.Option(help="this node's name in the cluster file")],
    pool: Annotated[str, typer.Option(help="Prefect work pool (process type) the deployments use")] = "hetrain",
    runs_root: Annotated[Path, typer.Option(help="where runs go on this machine's own disk")] = Path("runs"),
    peer_port: Annotated[int, typer.Option(min=0, max=65535, help="serve the runs' checkpoints to peers on this "
                                                                  "port (0: do not serve)")] = 8470,
    token_env: Annotated[str, typer.Option(help="environment variable holding the peers' bearer token")]
    = "HETRAIN_PEER_TOKEN",
    insecure: Annotated[bool, typer.Option("--insecure", help="serve checkpoints without a token (trusted "
                                                              "networks only)")] = False,
    cloud: Annotated[str | None, typer.Option(help="a spot node: watch this cloud's preemption notices (aws, gcp, "
                                                   "azure)")] = None,
    metadata_url: Annotated[str | None, typer.Option(help="the metadata endpoint's base URL (default: the "
                                                          "cloud's)")] = None,
    watch_poll_s: Annotated[float, typer.Option(min=MIN_POLL_S, max=60.0, help="seconds between metadata "
                                                                               "polls")] = 5.0,
    on_notice: Annotated[str, typer.Option(help="the watcher's hook, run once per active run on a notice")]
    = f"{sys.executable} -m flows.events",
):
    """Serve node NAME: create its work queue in POOL, run a Prefect worker on it and a peer server (until stopped).

    The train flow with ``launch=per-node`` sends each node its share of a plan through the work
    queue named after the node, so exactly one machine must run this for each node name. The
    peer server (``hetrain serve`` on RUNS_ROOT, every address) lets surviving nodes fetch this
    node's shards in a recovery. With ``--cloud`` (spot nodes) a watcher (``hetrain watch
    --runs-root --stop-after-checkpoint``) polls the metadata endpoint; on a notice the runs
    active on this node take an emergency checkpoint and stop there, and the hook emits the
    preemption event that starts the recovery flow. Reads PREFECT_API_URL like any Prefect
    command.
    """
    import os
    import re
    import subprocess

    from hetrain.spec.specs import NAME_PATTERN

    if not re.match(NAME_PATTERN, name):
        raise HetrainError(f"--name '{name}': expected a node name (letters, digits, '.', '_' or '-')")
    if name == "default":
        raise HetrainError("--name default: that is the pool's queue for the train and recover flows; "
                           "name the node as the cluster file does")
    from hetrain.recovery.preemption import SOURCES

    if cloud is not None and cloud not in SOURCES:
        raise HetrainError(f"--cloud: expected one of {', '.join(SOURCES)}, got '{cloud}'")
    check_output_dir(runs_root, "--runs-root")
    api_url = subprocess.run([sys.executable, "-c", "from prefect.settings import PREFECT_API_URL as u; "
                              "print(u.value() or '')"], capture_output=True, text=True).stdout.strip()
    if not api_url:  # Prefect would start a server of its own, and the worker would never get the cluster's runs
        raise HetrainError("PREFECT_API_URL is not set: point it at the Prefect server's API (for example "
                           "http://control:4200/api) so this node's worker gets its runs")
    prefect = [sys.executable, "-m", "prefect"]
    made = subprocess.run([*prefect, "work-queue", "create", name, "--pool", pool], capture_output=True, text=True)
    said = (made.stdout + made.stderr).strip()
    if made.returncode != 0 and "already exists" not in said:
        raise HetrainError(f"work queue '{name}' in pool '{pool}': {said.splitlines()[-1] if said else 'failed'}")
    if peer_port and not os.environ.get(token_env) and not insecure:
        raise HetrainError(f"--peer-port {peer_port}: checkpoints hold the model's weights; set a bearer token in "
                           f"${token_env} (the same on every node), or pass --insecure on a trusted network, or "
                           f"--peer-port 0")
    runs_root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HETRAIN_NODE": name, "HETRAIN_RUNS_ROOT": str(runs_root.resolve())}
    children = []
    try:
        if peer_port:
            children.append(subprocess.Popen([sys.executable, "-m", "hetrain", "serve", "--root", str(runs_root),
                                              "--host", "0.0.0.0", "--port", str(peer_port), "--token-env", token_env,
                                              *(["--insecure"] if insecure else [])], env=env))
        if cloud:
            children.append(subprocess.Popen([sys.executable, "-m", "hetrain", "watch", "--node", name, "--cloud",
                                              cloud, "--runs-root", str(runs_root), "--poll-s", str(watch_poll_s),
                                              "--stop-after-checkpoint",
                                              *(["--metadata-url", metadata_url] if metadata_url else []),
                                              "--hook-command", on_notice], env=env))
        err.print(f"node {name}: worker on work queue '{name}' of pool '{pool}', runs under {runs_root.resolve()}"
                  + (f", peers served on port {peer_port}" if peer_port else "")
                  + (f", {cloud} preemption notices watched" if cloud else ""), highlight=False)
        children.append(subprocess.Popen([*prefect, "worker", "start", "--pool", pool, "--work-queue", name,
                                          "--name", name], env=env))
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the children below, as on Ctrl-C
        code = children[-1].wait()
    except KeyboardInterrupt:
        code = 130
    finally:
        for child in children:
            if child.poll() is None:  # the watcher takes SIGTERM for a notice: SIGINT stops it
                child.send_signal(signal.SIGINT) if child.args[3:4] == ["watch"] else child.terminate()
        for child in children:
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
    raise typer.Exit(code)


data_app = typer.Typer(no_args_is_help=True, help="Prepare training data.")
app.add_typer(data_app, name="data")


@data_app.command("prepare")
@user_errors
def data_prepare(
    text: Annotated[Path, typer.Option(help="text file (UTF-8)")],
    out_file: Annotated[Path, typer.Option("--out", help="token file to write (.bin; a .bin.json describes it)")],
    tokenizer: Annotated[Path | None, typer.Option(help="Hugging Face tokenizer.json (default: byte-level, "
                                                        "one token per byte)")] = None,
):
    """Tokenize a text file into a flat token file for `hetrain train --data`."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from hetrain.runtime.data import prepare_tokens

    with Progress(TextColumn("[bold]tokenize"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=err, transient=True) as bar:
        task = bar.add_task("tokenize", total=None)
        meta = prepare_tokens(text, out_file, tokenizer,
                              progress=lambda done, total: bar.update(task, completed=done, total=total))
    table = Table(title=f"{out_file}", title_justify="left")
    for col in ("tokens", "dtype", "vocabulary", "largest id", "tokenizer"):
        table.add_column(col, justify="left" if col == "tokenizer" else "right")
    table.add_row(f"{meta['num_tokens']:,}", meta["dtype"], f"{meta['vocab_size']:,}", str(meta["max_id"]),
                  meta["tokenizer"])
    out.print(table)


def _cli_exceptions() -> tuple[type, ...]:
    """Click's exception base: typer >= 0.20 vendors click (``typer._click``), older typer uses click itself."""
    found = []
    for module in ("typer._click.exceptions", "click.exceptions"):
        try:
            found.append(__import__(module, fromlist=["ClickException"]).ClickException)
        except ImportError:
            pass
    return tuple(found)


def main() -> int:
    """The console script: typer's usage errors (a bad option value) as one line and exit code 2, like ours."""
    try:
        return app(standalone_mode=False) or 0
    except _cli_exceptions() as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # `hetrain` or `hetrain data` alone: the help
            e.show()
            return 0
        err.print(f"[bold red]error:[/] {e.format_message()}", highlight=False, soft_wrap=True)
        return e.exit_code
    except typer.Abort:
        err.print("aborted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
