"""The one place a run starts: check -> config -> prepare (lock, resume) -> write the plan -> launch.

``hetrain train``, ``hetrain.train(...)``, the train flow and the per-node flow build a
``RunRequest`` and call ``start_run`` (a recovery continues a run from its reassembled step with the
run's own config and launches it directly: there is nothing to check or decide). Everything a bad
input can break is checked in ``check_request`` before anything is written or any process starts (a bad token file or the
weights of another model are one line here, not an error from every rank after the launch).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from hetrain.config import RunConfig, TrainOptions, build_run_config, describe_precision
from hetrain.errors import HetrainError
from hetrain.plan.layout import Layout, build_layout
from hetrain.rundir import RunDir
from hetrain.run.prepare import prepare_run
from hetrain.run.request import RunHooks, RunRequest, RunResult
from hetrain.spec.specs import ModelSpec


PLAN_FIELD = "`plan`: "  # how a check of the plan begins its message (the CLI says the plan's file instead)


@dataclass
class CheckedRun:
    """A request that passed every check: the layout its ranks take and the config they will read."""

    request: RunRequest
    layout: Layout
    config: RunConfig


def check_request(request: RunRequest) -> CheckedRun:
    """Every check a run's inputs get before anything is written; the config its ranks would read."""
    from hetrain.plan.schema import check_optimizer_state, check_runnable, validate_plan, validate_plan_structure

    plan, options = request.plan, request.options
    try:
        if request.cluster is not None:
            from hetrain.spec.specs import load_cluster

            validate_plan(plan, load_cluster(request.cluster))
        else:
            validate_plan_structure(plan)
        check_runnable(plan)
        check_optimizer_state(plan, options.optimizer)
    except HetrainError as e:
        raise HetrainError(f"{PLAN_FIELD}{e}") from None
    check_inputs(request.options, request.plan.model)  # before their paths are resolved: a link loop is one line, not a traceback
    config = build_run_config(request.run_dir, request.plan_file or RunDir(request.run_dir).plan, options,
                              run_id=request.run_id, cluster=request.cluster, metrics=request.metrics,
                              peers=request.peers, trace_memory=request.debug.trace_memory,
                              dump_dir=str(request.debug.dump_dir) if request.debug.dump_dir else None)
    config.check_formats(plan)
    layout = build_layout(plan)
    if request.on_node is not None and request.on_node.node not in layout.nodes:
        raise HetrainError(f"node '{request.on_node.node}': the plan has no ranks there (its nodes: "
                           f"{', '.join(layout.nodes)})")
    return CheckedRun(request, layout, config)


def check_inputs(options: TrainOptions, model: ModelSpec) -> None:
    """Bad data or weights of another model: one line now, not one from every rank after the launch (the flow
    also asks before it profiles and plans)."""
    if options.data is not None:
        from hetrain.runtime.data import TokenSource

        TokenSource(model.seq_length, model.vocab_size, path=options.data)
    if options.init_from is not None:
        from hetrain.spec.hf import check_pretrained

        check_pretrained(options.init_from, model)


def start_run(request: RunRequest, hooks: RunHooks | None = None) -> RunResult:
    """Start (or resume, or restart) the requested run and train it to its end; its records and config.

    The run directory stays locked from the checks' end to the launch's, so a second start of the
    same run is refused while this one trains.
    """
    hooks = hooks or RunHooks()
    checked = check_request(request)
    plan, run_dir, on_node = request.plan, request.run_dir, request.on_node
    with contextlib.ExitStack() as held:
        prepared = prepare_run(run_dir, checked.config, plan, [on_node.node] if on_node else list(checked.layout.nodes),
                               more_steps=request.options.more_steps, resume=request.resume, restart=request.restart,
                               start_over_without_checkpoint=request.start_over_without_checkpoint,
                               new_only=on_node is not None, warn=hooks.warn, hold=held)
        plan.write(Path(prepared.config.plan))
        if hooks.note is not None:
            hooks.note(describe_precision(prepared.config, plan))
        if hooks.on_start is not None:
            hooks.on_start(prepared)
        from hetrain.runtime.launch import launch, launch_node

        if on_node is not None:
            records = launch_node(prepared.config, checked.layout, run_dir, on_node.node, on_node.rendezvous,
                                  local_address=on_node.local_address, on_record=hooks.on_record,
                                  stop_event=hooks.stop_event)
        else:
            records = launch(prepared.config, checked.layout, run_dir, on_record=hooks.on_record,
                             stop_event=hooks.stop_event)
    return RunResult(records, prepared.config, run_dir, prepared.resumed_step, prepared.archived)
