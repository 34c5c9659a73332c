"""``hetrain train``: check the plan, prepare the run directory, launch the ranks and report the run."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

from hetrain.cli.common import _peer_urls, as_flags, err, labelled, out, say_note, user_errors
from hetrain.cli.options import model_options
from hetrain.config import TrainOptions
from hetrain.errors import HetrainError
from hetrain.files import check_output_dir
from hetrain.rundir import RunDir
from hetrain.spec.schedule import describe_extension


def _loaded_plan(plan_file: Path, model: Path | None):
    """The plan file, and the model file it must be for when given (one line naming both otherwise)."""
    from hetrain.plan.schema import load_plan
    from hetrain.spec.specs import load_model

    pl = load_plan(plan_file)
    if model is not None:
        spec = load_model(model)
        if spec != pl.model:
            raise HetrainError(f"{plan_file}: the plan is for model '{pl.model.name}', not the '{spec.name}' in {model}"
                               if spec.name != pl.model.name else
                               f"{plan_file}: the plan's '{pl.model.name}' differs from {model} "
                               f"({', '.join(k for k in spec.model_fields if getattr(spec, k) != getattr(pl.model, k))})")
    return pl


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
    """Train the plan's model under the plan: one process per device, forked by each node's agent (torchrun)."""
    from hetrain.run.request import RunDebug, RunRequest
    from hetrain.run.start import PLAN_FIELD, check_request

    request = RunRequest(plan=_loaded_plan(plan_file, model), run_dir=run_dir or Path("runs") / plan_file.stem,
                         options=options, cluster=cluster, run_id=run_id or "", metrics=metrics,
                         peers=_peer_urls(peer), resume=resume, restart=restart,
                         debug=RunDebug(dump_dir=dump_dir, trace_memory=trace_memory))
    pl = request.plan
    if options.precision is not None and pl.training is not None and options.precision != pl.training.precision:
        err.print(f"note: the plan was made for {pl.training.precision}; its predictions do not hold in "
                  f"{options.precision}", highlight=False)
    try:
        if print_launch:
            _print_launch(check_request(request), main_address)
            _note_analytic(pl)
            return
        result = _start_with_progress(request)
    except HetrainError as e:  # the library names the plan by its field; here it is a file the user named
        if str(e).startswith(PLAN_FIELD):
            raise HetrainError(f"{plan_file}: {str(e).removeprefix(PLAN_FIELD)}") from None
        raise
    _report_run(result.records, result.config, result.run_dir)


def _note_analytic(pl) -> None:
    """A plan made without a profile: its predicted times are not measured (said once the run is accepted)."""
    if pl.predicted is not None and pl.predicted.measured is False:
        from hetrain.profiling.profile import ANALYTIC_NOTE

        say_note(f"the plan's predicted times: {ANALYTIC_NOTE}")


def _print_launch(checked, main_address: str) -> None:
    from hetrain.runtime.launch import node_commands, write_config

    run_dir, config = checked.request.run_dir, checked.config
    existing = [f.name for f in (RunDir.of(run_dir).config, RunDir.of(run_dir).metrics, RunDir.of(run_dir).checkpoints)
                if f.exists() or f.is_symlink()]
    if existing:  # its config.json says where its checkpoints are: never rewritten by a printout
        raise HetrainError(f"--run-dir {run_dir}: holds a run already ({', '.join(existing)}); --print-launch writes "
                           f"a new run's config.json and never touches an existing run's; give a new --run-dir")
    check_output_dir(run_dir, "--run-dir")  # the config and the plan are written here; the nodes' paths are theirs
    checked.request.plan.write(config.plan)
    path = write_config(config, run_dir)
    out.print(f"# copy {run_dir} (config.json, plan.json) and the data to every node, then run there:")
    for cmd in node_commands(checked.layout, str(path), main_address, 29500, run_dir.name,
                             agent=["python", "-m", "hetrain.runtime.agent"]):
        out.print(f"# on {cmd.node}:\n{cmd.shell()}", highlight=False, soft_wrap=True)


def _start_with_progress(request):
    """Start the run under a progress bar (opened once its resume is decided); a signal stops every worker and
    exits 128 + its number."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from hetrain.run.request import RunHooks
    from hetrain.run.start import start_run

    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                        TimeRemainingColumn(), console=out, transient=False)
    tasks: list = []

    def on_start(prepared) -> None:
        from hetrain.plan.layout import build_layout

        config, pl = prepared.config, request.plan
        if prepared.archived is not None:
            err.print(f"previous run moved to {prepared.archived}", highlight=False)
        out.print(f"training {pl.model.name} on {build_layout(pl).world_size} processes "
                  f"({len(pl.pipelines)} pipelines, tp {pl.tp})"
                  + (f", resuming after step {prepared.resumed_step} up to step {config.steps}"
                     if prepared.resumed_step is not None else "")
                  + f"; run directory {request.run_dir}", highlight=False)
        _note_analytic(pl)
        progress.start()
        tasks.append(progress.add_task("train", total=config.steps, completed=config.start_step,
                                       info="starting processes"))

    received: list[int] = []

    def terminate(signum, _frame):  # Ctrl-C, SIGTERM, SIGHUP: stop every worker
        received.append(signum)
        raise KeyboardInterrupt

    # SIGINT too: a shell starts background jobs with SIGINT ignored, and `kill -INT` must still stop the run
    previous_handlers = {sig: signal.signal(sig, terminate) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        return start_run(request, RunHooks(on_start=on_start, on_record=_shown(progress, tasks, request),
                                        note=lambda line: err.print(as_flags(line), highlight=False, soft_wrap=True),
                                        warn=say_note))
    except KeyboardInterrupt:
        name = signal.Signals(received[0]).name if received else "interrupted"
        err.print(f"{name}: every training process of this run has been stopped; "
                  + ("the same command resumes it from its newest checkpoint" if request.options.checkpoints else
                     "it kept no checkpoints (--no-checkpoints), so --restart starts it over"))
        raise typer.Exit(128 + (received[0] if received else signal.SIGINT)) from None
    finally:
        progress.stop()
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)


def _shown(progress, tasks: list, request):
    """Each step's record on the progress bar, and what the user should see as it happens."""
    from hetrain.runtime.metrics import checkpoint_notes

    def show(record: dict) -> None:
        progress.update(tasks[0], completed=record["step"] + 1,
                        info=f"loss {record['loss']:.3f}  {record['tokens_per_s']:,.0f} tok/s")
        if "lr_schedule_extended" in record:
            progress.console.print(f"note: {describe_extension(record['lr_schedule_extended'], record['step'])}",
                                   highlight=False, soft_wrap=True)
        for note in checkpoint_notes(record):  # skipped, a long wait, the synchronous fallback
            progress.console.print(f"note: {note}", highlight=False, soft_wrap=True)
        for failure in record.get("backup_failed", []):  # as it happens, not only when the run ends
            progress.console.print(labelled("backup failed", f"{failure} ({request.options.remote})"),
                                   highlight=False, soft_wrap=True)

    return show


def _report_run(records: list[dict], config, run_dir: Path) -> None:
    """The run's last line, and exit 3 when its newest checkpoint did not reach the remote store."""
    from hetrain.run.runs import EXIT_NOT_BACKED_UP, backup_problem

    if records:
        tail = records[len(records) // 2:] or records
        mean_tps = sum(r["tokens_per_s"] for r in tail) / len(tail)
        out.print(f"done: {len(records)} steps, loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}, "
                  f"{mean_tps:,.0f} tokens/s (second half); metrics in {config.metrics or RunDir.of(run_dir).metrics}"
                  + (f", curves: tensorboard --logdir {config.tensorboard_dir}" if config.tensorboard_dir else ""),
                  highlight=False)
    from hetrain.pictures import write_run_pictures

    pictures, why_not = write_run_pictures(config.metrics or RunDir.of(run_dir).metrics, run_dir)
    if pictures:
        out.print(f"pictures: {', '.join(str(p) for p in pictures)}", highlight=False, soft_wrap=True)
    elif records:
        say_note(why_not)
    problem = backup_problem(config)
    if problem:  # trained, and the checkpoints are on the nodes' disks, but not (all) in the remote store
        err.print(labelled("backup", problem), highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_NOT_BACKED_UP)
