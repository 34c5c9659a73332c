"""``hetrain train``: check the plan, prepare the run directory, launch the ranks and report the run."""

from __future__ import annotations

import contextlib

import signal
from pathlib import Path
from typing import Annotated

import typer

from hetrain.cli.common import _peer_urls, err, labelled, out, say_note, user_errors
from hetrain.cli.options import model_options
from hetrain.config import TrainOptions
from hetrain.errors import HetrainError
from hetrain.files import check_output_dir
from hetrain.rundir import RunDir
from hetrain.spec.schedule import describe_extension


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
    from hetrain.plan.schema import check_optimizer_state
    from hetrain.run.prepare import prepare_run

    pl = _checked_plan(plan_file, model, cluster)
    try:
        check_optimizer_state(pl, options.optimizer)
    except HetrainError as e:
        raise HetrainError(f"{plan_file}: {e}") from None
    layout = build_layout(pl)
    run_dir = run_dir or Path("runs") / plan_file.stem
    if not RUN_ID.match(run_id or run_dir.resolve().name):
        raise HetrainError(f"--run-id '{run_id or run_dir.resolve().name}': expected letters, digits, '.', '_' or "
                           f"'-' (at most 64), starting with a letter or digit")
    _check_inputs(options, pl)  # before their paths are resolved: a link loop is one line, not a traceback
    config = build_run_config(run_dir, plan_file, options, run_id=run_id, cluster=cluster, metrics=metrics,
                              peers=_peer_urls(peer), trace_memory=trace_memory,
                              dump_dir=str(dump_dir.resolve()) if dump_dir else None)
    config.check_formats(pl)
    if options.precision is not None and pl.training is not None and options.precision != pl.training.precision:
        err.print(f"note: the plan was made for {pl.training.precision}; its predictions do not hold in "
                  f"{options.precision}", highlight=False)
    if print_launch:
        _print_launch(config, layout, run_dir, main_address)
        _note_analytic(pl)
        return
    with contextlib.ExitStack() as held:  # the run directory's lock, until the run ends
        prepared = prepare_run(run_dir.resolve(), config, pl, list(layout.nodes), more_steps=options.more_steps,
                               resume=resume, restart=restart, warn=say_note, hold=held)
        if prepared.archived is not None:
            err.print(f"previous run moved to {prepared.archived}", highlight=False)
        config = prepared.config
        out.print(f"training {pl.model.name} on {layout.world_size} processes "
                  f"({len(pl.pipelines)} pipelines, tp {pl.tp})"
                  + (f", resuming after step {prepared.resumed_step} up to step {config.steps}"
                     if prepared.resumed_step is not None else "")
                  + f"; run directory {run_dir}", highlight=False)
        _note_analytic(pl)
        records = _launch_with_progress(config, layout, run_dir)
    _report_run(records, config, run_dir)


def _check_inputs(options: TrainOptions, pl) -> None:
    """Bad data or weights of another model: one line now, not one from every rank after the launch."""
    if options.data is not None:
        from hetrain.runtime.data import TokenSource

        TokenSource(pl.model.seq_length, pl.model.vocab_size, path=options.data)
    if options.init_from is not None:
        from hetrain.spec.hf import check_pretrained

        check_pretrained(options.init_from, pl.model)


def _note_analytic(pl) -> None:
    """A plan made without a profile: its predicted times are not measured (said once the run is accepted)."""
    if pl.predicted is not None and pl.predicted.measured is False:
        from hetrain.profiling.profile import ANALYTIC_NOTE

        say_note(f"the plan's predicted times: {ANALYTIC_NOTE}")


def _print_launch(config, layout, run_dir: Path, main_address: str) -> None:
    from hetrain.runtime.launch import node_commands, write_config

    existing = [f.name for f in (RunDir.of(run_dir).config, RunDir.of(run_dir).metrics, RunDir.of(run_dir).checkpoints)
                if f.exists() or f.is_symlink()]
    if existing:  # its config.json says where its checkpoints are: never rewritten by a printout
        raise HetrainError(f"--run-dir {run_dir}: holds a run already ({', '.join(existing)}); --print-launch writes "
                           f"a new run's config.json and never touches an existing run's; give a new --run-dir")
    check_output_dir(run_dir, "--run-dir")  # the config is written here; the nodes' paths are theirs
    path = write_config(config, run_dir.resolve())
    out.print(f"# copy {run_dir} (config.json), the plan and data to every node, then run there:")
    for cmd in node_commands(layout, str(path), main_address, 29500, run_dir.name):
        out.print(f"# on {cmd.node}:\n{cmd.shell()}", highlight=False, soft_wrap=True)


def _launch_with_progress(config, layout, run_dir: Path) -> list[dict]:
    """Launch the run under a progress bar; a signal stops every worker and exits 128 + its number."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from hetrain.runtime.launch import launch
    from hetrain.runtime.metrics import checkpoint_notes

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
            for note in checkpoint_notes(record):  # skipped, a long wait, the synchronous fallback
                progress.console.print(f"note: {note}", highlight=False, soft_wrap=True)
            for failure in record.get("backup_failed", []):  # as it happens, not only when the run ends
                progress.console.print(labelled("backup failed", f"{failure} ({config.checkpoint.remote_url})"),
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
