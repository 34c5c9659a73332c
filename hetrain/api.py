"""hetrain from Python: plan, train, export and prepare data without the shell.

Each function is what the command of the same name does, through the same library calls
(``hetrain plan`` -> ``plan``, ``hetrain train`` -> ``train``, ...), minus the printing: it
returns what the command prints. ``import hetrain`` exposes them lazily, so the import stays
fast and torch, pydantic models and the planner load on first use::

    import hetrain

    result = hetrain.plan("examples/clusters/cpu-emulated.yaml", "examples/models/gpt-tiny.yaml",
                          global_batch_size=8, precision="fp32")
    print(result.estimate.tokens_per_s)
    records = hetrain.train(result.plan, "runs/notebook", cluster="examples/clusters/cpu-emulated.yaml",
                            steps=20, data="examples/data/tiny.txt")
    hetrain.export("runs/notebook", "exported/")

Errors in what the caller gave (a file that does not parse, a plan that does not fit the
cluster, a bad option) raise ``hetrain.HetrainError`` with the one line the CLI would print.

Like the CLI, this is the application layer: it may import the planners (``solver``), which
the library below it never does (.importlinter); the CLI and this module do not import each
other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetrain.checkpoint import PEER_SILENCE_S
from hetrain.errors import HetrainError

if TYPE_CHECKING:
    from hetrain.config import TrainOptions
    from hetrain.export import ExportResult
    from hetrain.plan.schema import Plan
    from hetrain.profiling.profile import Profile
    from hetrain.run.request import RunRequest
    from hetrain.spec.specs import ClusterSpec, ModelSpec
    from solver.search.common import PlanResult

PathLike = str | Path
_log = logging.getLogger("hetrain")  # what a run says at its start (number formats, a store that does not answer)


def load_cluster(path: PathLike) -> ClusterSpec:
    """A cluster YAML file (nodes, GPU types, bandwidths), checked."""
    from hetrain.spec.specs import load_cluster as load

    return load(path)


def load_model(path: PathLike) -> ModelSpec:
    """A model YAML file (architecture, sizes, vocabulary), or a model directory (a hetrain export, a
    transformers Llama: its ``config.json``), checked."""
    from hetrain.spec.hf import load_any_model

    return load_any_model(path)


def load_plan(path: PathLike) -> Plan:
    """A plan JSON file (``hetrain.plan/v1``), as ``hetrain plan --out`` writes it."""
    from hetrain.plan.schema import load_plan as load

    return load(path)


def load_profile(path: PathLike) -> Profile:
    """A measured profile JSON file (``hetrain.profile/v1``), as ``hetrain profile`` writes it."""
    from hetrain.profiling.profile import load_profile as load

    return load(path)


def _cluster(cluster: ClusterSpec | PathLike) -> ClusterSpec:
    return load_cluster(cluster) if isinstance(cluster, (str, Path)) else cluster


def _model(model: ModelSpec | PathLike) -> ModelSpec:
    return load_model(model) if isinstance(model, (str, Path)) else model


def _plan(plan: Plan | PathLike) -> Plan:
    return load_plan(plan) if isinstance(plan, (str, Path)) else plan


def plan(cluster: ClusterSpec | PathLike, model: ModelSpec | PathLike, global_batch_size: int, *,
         micro_batch_size: int | None = None, tp: Sequence[int] | None = None, precision: str | None = None,
         recompute: str = "auto", planner: str = "hetrain", profile: Profile | PathLike | None = None,
         time_limit_s: float = 10.0, progress: Callable[[str], None] | None = None,
         formats: str = "bf16") -> PlanResult:
    """The fastest plan for ``model`` on ``cluster`` (``hetrain plan``): ``.plan`` and its ``.estimate``.

    ``micro_batch_size`` fixes it (default: the planner searches 1, 2, 4); ``tp`` lists the
    tensor-parallel degrees allowed (default 1, 2, 4, 8); ``recompute`` is ``auto`` (per stage,
    as memory needs), ``none``, ``selective`` or ``full``; ``planner`` one of ``hetrain``
    (the MILP search seeded with the baselines' layouts), ``milp`` (the search alone),
    ``megatron``, ``whale``, ``exhaustive``; ``profile`` a measured profile (default: the GPU
    catalog's figures); ``formats`` the number-format policy, ``bf16`` (every stage in ``precision``
    where its GPU has it, fp16 where it has no bf16) or ``fastest`` (besides, fp8 on the stages whose
    GPU has fp8 tensor cores and that run without tensor parallelism; training follows the plan).
    ``result.plan.write(path)`` saves it for ``hetrain train --plan``.
    """
    from hetrain.spec.specs import TrainingSettings
    from solver.planners.registry import PLANNERS, make_plan

    if planner not in PLANNERS:
        raise HetrainError(f"planner: expected one of {', '.join(PLANNERS)}, got '{planner}'")
    the_cluster = _cluster(cluster)
    settings = TrainingSettings.for_search("plan()", global_batch_size, micro_batch_size=micro_batch_size, tp=tp,
                                           precision=precision or the_cluster.default_precision,
                                           activation_recompute=recompute, formats=formats)
    prof = load_profile(profile) if isinstance(profile, (str, Path)) else profile
    return make_plan(planner, the_cluster, _model(model), settings, prof, time_limit_s=time_limit_s,
                     progress=progress)


def check_plan(plan: Plan | PathLike, cluster: ClusterSpec | PathLike | None = None) -> Plan:
    """The plan, checked on its own and, given ``cluster``, against its devices and memory."""
    from hetrain.plan.schema import validate_plan, validate_plan_structure

    p = _plan(plan)
    if cluster is not None:
        validate_plan(p, _cluster(cluster))
    else:
        validate_plan_structure(p)
    return p


def train(plan: Plan | PathLike, run_dir: PathLike, options: TrainOptions | None = None, *,
          cluster: PathLike | None = None, resume: bool = False, restart: bool = False,
          on_record: Callable[[dict], None] | None = None, **option_values: Any) -> list[dict]:
    """Train under ``plan`` in ``run_dir`` on this machine (``hetrain train``); the per-step records.

    The options are ``hetrain train``'s (``TrainOptions``: ``steps``, ``data``, ``lr``,
    ``checkpoint_every``...), as an object or as keywords (``steps=20``). An existing run
    directory resumes from its newest committed checkpoint, as the command does; ``restart``
    archives it and starts over. ``cluster`` (a YAML path) checks the plan against it and
    applies its CPU emulation. ``on_record(record)`` sees each step's record as it is written
    to ``RUN_DIR/metrics.jsonl`` (TensorBoard files go to ``RUN_DIR/tensorboard``, and at the end
    ``loss.png`` and ``ranks.png`` into ``RUN_DIR``, where matplotlib is installed).
    """
    from hetrain.run.request import RunHooks
    from hetrain.run.start import start_run

    result = start_run(train_request(plan, run_dir, options, cluster=cluster, resume=resume, restart=restart,
                                     **option_values),
                       RunHooks(on_record=on_record, note=_log.info, warn=_log.warning))
    from hetrain.pictures import write_run_pictures
    from hetrain.rundir import RunDir

    write_run_pictures(RunDir(result.run_dir).metrics, result.run_dir)  # loss.png, ranks.png with matplotlib
    return result.records


def train_request(plan: Plan | PathLike, run_dir: PathLike, options: TrainOptions | None = None, *,
                  cluster: PathLike | None = None, resume: bool = False, restart: bool = False,
                  **option_values: Any) -> RunRequest:
    """The ``RunRequest`` that ``train`` starts (the options validated whole, so a keyword is checked as the
    command's option is)."""
    from pydantic import ValidationError

    from hetrain.config import TrainOptions
    from hetrain.run.request import RunRequest
    from hetrain.spec.specs import describe_validation_error

    try:
        opts = TrainOptions.model_validate({**(options.model_dump() if options else {}), **option_values})
    except ValidationError as e:
        raise HetrainError(describe_validation_error("train() options", e)) from None
    return RunRequest(plan=_plan(plan), run_dir=Path(run_dir), options=opts,
                      cluster=Path(cluster) if cluster else None, resume=resume, restart=restart)


def export(run_dir: PathLike, out_dir: PathLike, *, step: int | None = None, dtype: str = "fp32",
           timeout_s: float = PEER_SILENCE_S) -> ExportResult:
    """A run's committed checkpoint (the newest, or ``step``) as one ``model.safetensors`` (``hetrain export``).

    Whatever plan trained it; Llama-family models in transformers' names with a ``config.json``.
    ``load_export(out_dir)`` reads it back as a spec and hetrain-named weights.
    """
    from hetrain.export import export_run
    from hetrain.files import check_output_dir
    from hetrain.rundir import RunDir

    if not RunDir.of(run_dir).config.is_file():
        raise HetrainError(f"run_dir {run_dir}: no config.json (not a run directory)")
    check_output_dir(Path(out_dir), "out_dir")
    return export_run(Path(run_dir), Path(out_dir), step=step, dtype=dtype, timeout_s=timeout_s)


def load_export(out_dir: PathLike) -> tuple[ModelSpec, dict]:
    """An export's model spec and weights by hetrain's names: ``load_model_weights`` builds the model."""
    from hetrain.export import load_export as load

    return load(Path(out_dir))


def build_model(spec: ModelSpec | PathLike, weights: dict | None = None):
    """The whole model (a ``torch.nn.Module`` on the CPU) of ``spec``, with ``weights`` or freshly initialized."""
    from hetrain.runtime.model import GPT

    model = GPT(_model(spec))
    if weights is None:
        model.init_weights(0)
    else:
        model.load_state_dict(weights)
    return model


def prepare_data(inputs: PathLike | Sequence[PathLike], out: PathLike, tokenizer: PathLike | None = None, *,
                 field: str = "text", eos: str | None = None, split: str = "train") -> dict:
    """Tokenize text, JSON lines, Parquet or a saved ``datasets`` dataset into a token file (``hetrain data
    prepare``); its description (tokens, documents, dtype, vocabulary, end-of-document id)."""
    from hetrain.runtime.data import prepare_tokens

    return prepare_tokens(inputs, out, tokenizer, field=field, eos=eos, split=split)
