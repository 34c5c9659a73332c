"""Training on small CPU clusters for the tests: hand-written plans, runs, what a run dumps and writes,
the one-process references a run is checked against, an S3 bucket on loopback, and the old run a
notice-window switch starts from."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from hetrain.config import CheckpointConfig, RunConfig
from hetrain.errors import HetrainError
from hetrain.plan.layout import build_layout
from hetrain.plan.schema import Plan
from hetrain.rundir import RUN_DIR_ENV
from hetrain.runtime.data import TokenSource
from hetrain.runtime.launch import launch
from hetrain.runtime.model import GPT, lm_loss
from hetrain.spec.schedule import LRSchedule
from hetrain.spec.specs import load_model
from tests.helpers import EXAMPLES

GPT_TINY = EXAMPLES / "models" / "gpt-tiny.yaml"
LLAMA_TINY = EXAMPLES / "models" / "llama-tiny.yaml"
TINY = load_model(GPT_TINY)
GLOBAL_BATCH = 8
# the cluster of the hand-written three-node plans (a: 2 devices, b: 1, spot c: 1), for re-planning
CLUSTER_YAML = """
name: three-nodes
inter_node_bandwidth_gbps: 1.0
collective_latency_us: 2000
gpu_types:
  cpu: {tflops: 0.02, fp32_tflops: 0.01, memory_gb: 6, memory_bandwidth_gbps: 10, efficiency: 1.0}
nodes:
  - {name: a, gpu: cpu, count: 2, intra_node_bandwidth_gbps: 2.0}
  - {name: b, gpu: cpu, count: 1, intra_node_bandwidth_gbps: 2.0}
  - {name: c, gpu: cpu, count: 1, intra_node_bandwidth_gbps: 2.0, spot: true}
"""


# -- plans ------------------------------------------------------------------------------------------------------------
def plan(tp: int, pipelines: list[tuple[int, list[tuple[str, list[int]]]]], micro_batch_size: int = 1) -> Plan:
    """``pipelines``: (micro-batches, [(first device, [lo, hi])...]); a stage's devices are tp consecutive ones."""

    def devices(first: str) -> list[str]:
        node, index = first.split("/")
        return [f"{node}/{int(index) + j}" for j in range(tp)]

    return Plan.model_validate({
        "schema": "hetrain.plan/v1", "model": TINY.model_dump(), "cluster": "test",
        "global_batch_size": GLOBAL_BATCH, "micro_batch_size": micro_batch_size, "tp": tp,
        "pipelines": [{"num_microbatches": m,
                       "stages": [{"devices": devices(d), "gpu": "cpu", "layers": layers} for d, layers in stages]}
                      for m, stages in pipelines],
    })


def asymmetric_plan(tp: int, global_batch_size: int = 8, micro_batch_size: int = 2, model: Path = GPT_TINY) -> Plan:
    """Pipeline 0: two stages, 2 + 4 blocks, 3 micro-batches; pipeline 1: one stage, 1 micro-batch.

    Each stage recomputes differently (selective, none, full), as the planner may choose per stage.
    """
    spec = load_model(model)

    def stage(node: str, first: int, layers: list[int], recompute: str) -> dict:
        return {"devices": [f"{node}/{first + j}" for j in range(tp)], "gpu": "cpu", "layers": layers,
                "recompute": recompute}

    return Plan.model_validate({
        "schema": "hetrain.plan/v1", "model": spec.model_dump(), "cluster": "test",
        "global_batch_size": global_batch_size, "micro_batch_size": micro_batch_size, "tp": tp,
        "pipelines": [
            {"num_microbatches": 3, "stages": [stage("a", 0, [0, 2], "selective"), stage("a", tp, [2, 6], "none")]},
            {"num_microbatches": 1, "stages": [stage("b", 0, [0, 6], "full")]},
        ],
    })


def with_modes(p: Plan, modes: list[list[str | None]]) -> Plan:
    """``p`` with ``modes[pipeline][stage]`` as each stage's optimizer_state."""
    pipes = [pipe.model_copy(update={"stages": [st.model_copy(update={"optimizer_state": m})
                                                for st, m in zip(pipe.stages, ms)]})
             for pipe, ms in zip(p.pipelines, modes)]
    return p.model_copy(update={"pipelines": pipes})


# The ZeRO tests' plans. TP 2, two pipelines cut differently (blocks 0-2 + 2-6 beside 0-6): three gradient
# buckets per TP rank
ASYM_TP2 = plan(2, [(2, [("a/0", [0, 2]), ("a/2", [2, 6])]), (2, [("a/4", [0, 6])])], micro_batch_size=2)
# TP 1, two pipelines, the second on the lower ranks: a bucket's group ranks in the other order than its shares
ASYM_TP1 = plan(1, [(2, [("a/2", [0, 6])]), (2, [("a/0", [0, 3]), ("a/1", [3, 6])])], micro_batch_size=2)


# -- runs and what they leave -----------------------------------------------------------------------------------------
def run(p: Plan, directory: Path, steps: int, *, start_step: int = 0, checkpoint: CheckpointConfig | None = None,
        resume_from: str | None = None, dump: bool = False, **extra) -> list[dict]:
    """Train ``p`` with AdamW from ``start_step`` up to ``steps``; returns the metric records.

    The LR schedule is fixed (not derived from ``steps``), so runs of different lengths share it.
    """
    directory.mkdir(parents=True, exist_ok=True)
    extra = {"lr": 1e-2, "warmup_steps": 1, "decay_steps": 8, **extra}
    p.write(directory / "plan.json")
    config = RunConfig(plan=str(directory / "plan.json"), steps=steps, start_step=start_step,
                       checkpoint=checkpoint, resume_from=resume_from,
                       dump_dir=str(directory / "dump") if dump else None, **extra)
    return launch(config, build_layout(p), directory / "run")


def processes_of(run_dir: Path) -> list[tuple[int, str]]:
    """Every live process whose command line or environment names ``run_dir``: hetrain train, its launcher, and
    what the launcher started (the workers fork from its fork server: they carry its command line and its
    environment, where ``RUN_DIR_ENV`` names the run)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace")
            environ = (entry / "environ").read_bytes().decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if (str(run_dir) in argv or f"{RUN_DIR_ENV}={run_dir}\0" in environ) and state != "Z":
            found.append((int(entry.name), argv.replace("\0", " ")[:200]))
    return found


def processes_left(run_dir: Path, within_s: float = 5.0) -> list[tuple[int, str]]:
    """What of the run's processes still lives ``within_s`` after its launch returned (an agent's fork server and
    the stdlib's resource tracker end just after their agent)."""
    deadline = time.monotonic() + within_s
    while (left := processes_of(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def dumped_state(p: Plan, directory: Path) -> dict[str, torch.Tensor]:
    """Whole parameters and optimizer tensors dumped at the end of a run, one copy per name."""
    state: dict[str, torch.Tensor] = {}
    for role in build_layout(p).roles:
        if role.tp_rank == 0:
            for name, tensor in torch.load(directory / "dump" / f"params-rank{role.rank}.pt").items():
                if name in state:
                    assert torch.equal(state[name], tensor), f"replicas of {name} differ"
                state[name] = tensor
    return state


def metrics(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "run" / "metrics.jsonl").read_text().splitlines()]


EVERY_SCALAR = 0  # EventAccumulator's size guidance: keep every event, not a reservoir sample


def read_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """Every scalar in the event files of ``directory``, as TensorBoard loads them: tag -> step -> value.

    No step may appear twice in a tag (TensorBoard would draw both points).
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": EVERY_SCALAR})
    acc.Reload()
    board = {}
    for tag in acc.Tags()["scalars"]:
        steps = [e.step for e in acc.Scalars(tag)]
        assert len(steps) == len(set(steps)), f"{tag}: steps {steps}"
        board[tag] = {e.step: e.value for e in acc.Scalars(tag)}
    return board


def assert_board_matches_metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    """The run's TensorBoard scalars are its metrics.jsonl records, step for step, every rank's too."""
    from hetrain.runtime.metrics import RANK_SCALARS, scalars

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    board = read_scalars(run_dir / "tensorboard")
    ranks = {r["rank"] for r in records[0]["ranks"]}
    want_tags = {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"}
    want_tags |= {f"{name}/rank{r}" for name in RANK_SCALARS for r in ranks}
    assert want_tags <= set(board), sorted(want_tags - set(board))
    for record in records:
        for tag, value in scalars(record).items():
            assert board[tag][record["step"]] == pytest.approx(value, rel=1e-6), (tag, record["step"])
    return board


def assert_measured_timeline(run_dir: Path, stages: int, microbatches: int) -> None:
    """A run's measured step (RUN/timeline, one file per stage): every stage ran each micro-batch's forward
    and backward once, in order, inside the step; a micro-batch's forward reached stage k+1 only after
    stage k finished it, and its backward came back the other way; the picture of it is drawn."""
    from hetrain.pictures import MEASURED_TIMELINE_PNG, measured_timeline

    step, rows = measured_timeline(run_dir / "timeline")
    assert step is not None and len(rows) == stages, rows
    ends = {}
    for k, (label, ops) in enumerate(rows):
        assert label.startswith(f"p0 s{k} ")
        for kind in "FB":
            mine = [op for op in ops if op.kind == kind]
            assert [op.microbatch for op in mine] == list(range(microbatches)), (label, kind)
            assert all(0 <= op.start_s <= op.end_s for op in mine)
            ends |= {(k, kind, op.microbatch): (op.start_s, op.end_s) for op in mine}
    for k in range(stages - 1):
        for m in range(microbatches):
            assert ends[(k + 1, "F", m)][0] >= ends[(k, "F", m)][1]  # the activation came from stage k
            assert ends[(k, "B", m)][0] >= ends[(k + 1, "B", m)][1]  # the gradient came from stage k + 1
    if importlib.util.find_spec("matplotlib"):
        assert (run_dir / MEASURED_TIMELINE_PNG).stat().st_size > 5_000


# -- one process, the whole global batch: what a distributed run must equal ------------------------------------------
# Weights after AdamW steps: Adam divides by the root of the squared-gradient average, which magnifies the
# last bits of small gradients (a replicated plan is 3.8e-5 off one process, its worst tensor).
ONE_PROCESS_TOL = 1e-4


def sgd_reference(plan: Plan, steps: int, lr: float, clip: float) -> tuple[dict, dict, list[float]]:
    """One process, the whole global batch at once: gradients of step 0, parameters after, losses."""
    model = GPT(plan.model)
    model.init_weights(0)
    source = TokenSource(plan.model.seq_length, plan.model.vocab_size, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    schedule = LRSchedule.for_run(steps, lr)  # the runtime's default schedule: warmup, then cosine
    grads, losses = {}, []
    for step in range(steps):
        opt.param_groups[0]["lr"] = schedule.lr_at(step)
        seq = source.sequences(step * plan.global_batch_size, plan.global_batch_size)
        loss = lm_loss(model(seq[:, :-1]), seq[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def adamw_reference(p: Plan, lrs: list[float], clip: float = 1.0) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the whole global batch, ``torch.optim.AdamW`` at the runs' learning rates, clipped at
    ``clip`` (RunConfig's max_grad_norm: clipping is on in every run compared with it)."""
    model = GPT(p.model)
    model.init_weights(0)
    source = TokenSource(p.model.seq_length, p.model.vocab_size, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lrs[0], weight_decay=0.0, foreach=True)
    losses = []
    for step, lr in enumerate(lrs):
        opt.param_groups[0]["lr"] = lr
        seq = source.sequences(step * p.global_batch_size, p.global_batch_size)
        loss = lm_loss(model(seq[:, :-1]), seq[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {n: t.detach().clone() for n, t in model.named_parameters()}, losses


# -- an S3 bucket on loopback -----------------------------------------------------------------------------------------
@contextmanager
def moto_bucket(bucket: str) -> Iterator[tuple[str, object]]:
    """A moto S3 server on loopback with ``bucket``: (endpoint, s3fs filesystem).

    Its credentials reach the training processes through the environment. moto keeps one state
    per process: test modules sharing a process need bucket names of their own.
    """
    import s3fs
    from moto.server import ThreadedMotoServer

    from hetrain.runtime.launch import free_port

    mp = pytest.MonkeyPatch()
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        mp.setenv(k, v)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        fs = s3fs.S3FileSystem(endpoint_url=endpoint)
        fs.mkdir(bucket)
        yield endpoint, fs
    finally:
        server.stop()
        mp.undo()


# -- the old run of a notice-window switch (test_notice_switch, test_live_switch) ------------------------------------
# Nodes a (two devices), b and spot node c; c gets the notice.
OLD = plan(1, [(5, [("a/0", [0, 2]), ("b/0", [2, 6])]), (3, [("a/1", [0, 4]), ("c/0", [4, 6])])])
OLD_STEPS = 10_000  # the old plan would train this long: it is switched away from long before
AFTER = 3  # steps the new plan trains after the switch


def planner(cluster, model, settings):
    """hetrain's planner, as recovery calls it: the plan for the nodes left."""
    from solver.planners.registry import make_plan

    return make_plan("hetrain", cluster, model, settings).plan


def start_old_run(tmp_path: Path, s3, name: str, bucket: str, peers: dict | None = None,
                  every_steps: int = 100) -> tuple[threading.Thread, dict, CheckpointConfig, Path]:
    """``OLD`` training in a thread towards ``OLD_STEPS``, checkpointing to the nodes' disks and to
    s3://``bucket``/``name``; returns once it has trained a couple of steps: (thread, its outcome, the
    checkpoint config, the run directory)."""
    endpoint, _ = s3
    (tmp_path / "cluster.yaml").write_text(CLUSTER_YAML)
    cfg = CheckpointConfig(local_dir=str(tmp_path / "nodes" / "{node}"), every_steps=every_steps, keep=2,
                           remote_url=f"s3://{bucket}/{name}", remote_options={"endpoint_url": endpoint},
                           peers=peers or {})
    run_dir = tmp_path / "old" / "run"
    out: dict = {}

    def train() -> None:
        try:
            out["records"] = run(OLD, tmp_path / "old", steps=OLD_STEPS, checkpoint=cfg,
                                 cluster=str(tmp_path / "cluster.yaml"),
                                 request_file=str(run_dir / "checkpoint.request"))
        except HetrainError as e:
            out["error"] = e

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # training for a couple of steps
        assert time.monotonic() < deadline and thread.is_alive(), "the old plan did not start training"
        time.sleep(0.2)
    return thread, out, cfg, run_dir
