"""Shared by the checkpoint and recovery tests: hand-written plans on small CPU clusters, runs, dumps."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from conftest import EXAMPLES
from hetrain.config import CheckpointConfig, RunConfig
from hetrain.plan.layout import build_layout
from hetrain.plan.schema import Plan
from hetrain.runtime.data import TokenSource
from hetrain.runtime.launch import launch
from hetrain.runtime.model import GPT, lm_loss
from hetrain.spec.schedule import LRSchedule
from hetrain.spec.specs import load_model

TINY = load_model(EXAMPLES / "models" / "gpt-tiny.yaml")
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


@contextmanager
def moto_bucket(bucket: str) -> Iterator[tuple[str, object]]:
    """A moto S3 server on loopback with ``bucket``: (endpoint, s3fs filesystem).

    Its credentials reach the training processes through the environment. moto keeps one state
    per process: test modules sharing a process need bucket names of their own.
    """
    import pytest
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
