"""The runtime on real gloo processes started by `hetrain train` through accelerate launch."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hetrain.plan.layout import build_layout
from hetrain.plan.schema import Plan
from hetrain.runtime.launch import free_port, worker_pids
from hetrain.runtime.model import lm_loss
from hetrain.spec.specs import load_model
from tests.helpers import EXAMPLES, ROOT, run_cli, spawn_ranks
from tests.helpers.training import asymmetric_plan, processes_left, sgd_reference

TINY = EXAMPLES / "models" / "gpt-tiny.yaml"
LR, CLIP, STEPS = 0.5, 1.0, 3


def assert_close(got: dict, want: dict, what: str) -> None:
    assert got, f"no {what} dumped"
    for name, tensor in got.items():
        ref = want[name]
        rel = (tensor - ref).norm() / ref.norm().clamp_min(1e-12)
        assert rel < 1e-5, f"{what} {name}: relative error {rel:.2e}"


@pytest.mark.parametrize("model,tp", [("gpt-tiny", 1), ("gpt-tiny", 2), ("llama-tiny", 2)])
def test_asymmetric_plan_matches_single_process(tmp_path: Path, model: str, tp: int):
    """Llama's block too: grouped-query attention split by key/value heads, SwiGLU's gate and up
    column-wise, rotary positions computed on every stage."""
    spec_file = EXAMPLES / "models" / f"{model}.yaml"
    train_and_match_single_process(tmp_path, asymmetric_plan(tp, model=spec_file), spec_file)


def test_eager_1f1b_matches_single_process(tmp_path: Path):
    """Eager 1F1B (``hetrain.runtime.pipeline``): three stages keeping 5, 3 and 1 micro-batches in
    flight, sends not waited on and receives posted ahead, beside a one-stage pipeline; the
    same gradients, parameters and losses as one process (a wrong pairing of early receives
    would hang or mix micro-batches up)."""
    spec = load_model(TINY)

    def stage(device: str, layers: list[int], in_flight: int) -> dict:
        return {"devices": [device], "gpu": "cpu", "layers": layers, "in_flight": in_flight}

    plan = Plan.model_validate({
        "schema": "hetrain.plan/v1", "model": spec.model_dump(), "cluster": "test",
        "global_batch_size": 8, "micro_batch_size": 1, "tp": 1,
        "pipelines": [
            {"num_microbatches": 6, "stages": [stage("a/0", [0, 2], 5), stage("a/1", [2, 4], 3),
                                               stage("a/2", [4, 6], 1)]},
            {"num_microbatches": 2, "stages": [stage("b/0", [0, 6], 1)]},
        ],
    })
    train_and_match_single_process(tmp_path, plan, TINY)


def _one_device_stage(device: str, layers: list[int], recompute: str = "none") -> dict:
    return {"devices": [device], "gpu": "cpu", "layers": layers, "recompute": recompute}


def _tiny_plan(pipelines: list[dict]) -> Plan:
    """gpt-tiny, global batch 8 of micro-batches of 1, TP 1, over ``pipelines``."""
    return Plan.model_validate({"schema": "hetrain.plan/v1", "model": load_model(TINY).model_dump(), "cluster": "test",
                                "global_batch_size": 8, "micro_batch_size": 1, "tp": 1, "pipelines": pipelines})


def test_zero_bubble_h1_matches_single_process(tmp_path: Path):
    """ZB-H1 (``hetrain.runtime.pipeline.ScheduleZeroBubbleH1``) on an asymmetric plan: a pipeline of three
    stages splitting their backward (stage k running its weight gradients k backwards late) beside one
    of two whose last stage recomputes (its backward runs whole); the same gradients, parameters and
    losses as one process (a weight gradient run twice, never, or on the wrong micro-batch's graph
    would show)."""
    stage = _one_device_stage
    plan = _tiny_plan([
        {"num_microbatches": 5, "schedule": "zb-h1",
         "stages": [stage("a/0", [0, 2]), stage("a/1", [2, 4]), stage("a/2", [4, 6])]},
        {"num_microbatches": 3, "schedule": "zb-h1", "stages": [stage("b/0", [0, 3]), stage("b/1", [3, 6], "full")]},
    ])
    train_and_match_single_process(tmp_path, plan, TINY)


def test_gpipe_with_fewer_microbatches_than_stages_matches_single_process(tmp_path: Path):
    """GPipe (torch's ``ScheduleGPipe``), the schedule of a pipeline given fewer micro-batches than stages (a slow
    type's, ``solver.planners.typed``): three stages, one recomputing, with 2 micro-batches beside a 1F1B pipeline of
    two stages with 6; the same gradients, parameters and losses as one process (a micro-batch lost or run
    twice in the fill would show)."""
    stage = _one_device_stage
    plan = _tiny_plan([
        {"num_microbatches": 2, "schedule": "gpipe",
         "stages": [stage("a/0", [0, 2]), stage("a/1", [2, 4], "selective"), stage("a/2", [4, 6])]},
        {"num_microbatches": 6, "stages": [stage("b/0", [0, 3]), stage("b/1", [3, 6])]},
    ])
    assert plan.pipelines[0].depth > plan.pipelines[0].num_microbatches
    train_and_match_single_process(tmp_path, plan, TINY)


def test_zero_bubble_h1_under_tensor_parallelism_matches_single_process(tmp_path: Path):
    """ZB-H1 on the TP 2 asymmetric plan: the second stage (no recompute) splits its backward over
    DTensor blocks, the vocabulary-split head's weight gradient waits for W too."""
    plan = asymmetric_plan(2)
    plan = plan.model_copy(update={"pipelines": [p.model_copy(update={"schedule": "zb-h1"}) for p in plan.pipelines]})
    train_and_match_single_process(tmp_path, plan, TINY)


def interleaved_plan(tp: int) -> Plan:
    """Pipeline 0: interleaved 1F1B on two stages of devices, two chunks each, of unequal blocks (1, 2, 1, 2),
    4 micro-batches, its devices recomputing differently; pipeline 1: one stage, 1F1B, 4 micro-batches."""
    spec = load_model(TINY)

    def stage(node: str, first: int, layers: list[int], recompute: str = "none") -> dict:
        return {"devices": [f"{node}/{first + j}" for j in range(tp)], "gpu": "cpu", "layers": layers,
                "recompute": recompute}

    chunks = [stage("a", 0, [0, 1], "selective"), stage("a", tp, [1, 3]), stage("a", 0, [3, 4], "selective"),
              stage("a", tp, [4, 6])]
    return Plan.model_validate({
        "schema": "hetrain.plan/v1", "model": spec.model_dump(), "cluster": "test",
        "global_batch_size": 8, "micro_batch_size": 1, "tp": tp,
        "pipelines": [{"num_microbatches": 4, "schedule": "interleaved-1f1b", "virtual_stages": 2, "stages": chunks},
                      {"num_microbatches": 4, "stages": [stage("b", 0, [0, 6], "full")]}],
    })


@pytest.mark.parametrize("tp", [1, 2])
def test_interleaved_1f1b_matches_single_process(tmp_path: Path, tp: int):
    """Interleaved 1F1B (torch's ``ScheduleInterleaved1F1B`` over each rank's chunk views) on an asymmetric
    plan: a device holding blocks 0 and 3 (embedding included) syncs each with the one-stage pipeline's
    device in its own bucket; the same gradients, parameters and losses as one process (a chunk's
    parameters missed by the optimizer, the sync or the dump, or a micro-batch run on the wrong chunk,
    would show). Under TP 2 every chunk scatters and gathers its sends."""
    train_and_match_single_process(tmp_path, interleaved_plan(tp), TINY)


def train_and_match_single_process(tmp_path: Path, plan: Plan, spec_file: Path) -> None:
    """Train ``plan`` for a few SGD steps and compare with ``reference``: every rank's gradients of step 0,
    its parameters after, and the losses."""
    plan.write(tmp_path / "plan.json")
    dump = tmp_path / "dump"
    r = run_cli("train", "--plan", str(tmp_path / "plan.json"), "--model", str(spec_file), "--steps", str(STEPS),
                "--optimizer", "sgd", "--lr", str(LR), "--max-grad-norm", str(CLIP),
                "--run-dir", str(tmp_path / "run"), "--dump-dir", str(dump))
    assert r.returncode == 0, r.stdout + r.stderr
    ref_grads, ref_params, ref_losses = sgd_reference(plan, STEPS, LR, CLIP)

    layout = build_layout(plan)
    holders: dict[str, int] = {}
    for role in layout.roles:
        if role.tp_rank:
            continue
        grads = torch.load(dump / f"grads-rank{role.rank}.pt")
        params = torch.load(dump / f"params-rank{role.rank}.pt")
        assert_close(grads, ref_grads, f"gradient on {role.device}")
        assert_close(params, ref_params, f"parameter on {role.device}")
        for name in params:
            holders[name] = holders.get(name, 0) + 1
    # every parameter is held, and checked, once per pipeline
    assert holders == {name: len(plan.pipelines) for name in ref_params}

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    for rec, want in zip(records, ref_losses):
        assert abs(rec["loss"] - want) <= 1e-5 * abs(want)


def test_tp_ranks_follow_rank_order_whatever_order_a_plan_lists_a_stage_in():
    """DTensor shards by the rank in the TP group, and sends and gradient buckets pair ranks by TP rank:
    a stage listed as [a/1, a/0] gets the same layout as [a/0, a/1]."""
    ordered = asymmetric_plan(2)
    data = ordered.model_dump(by_alias=True)
    for pipe in data["pipelines"]:
        for stage in pipe["stages"]:
            stage["devices"].reverse()
    shuffled = build_layout(Plan.model_validate(data))
    want = build_layout(ordered)
    assert shuffled.roles == want.roles and shuffled.tp_groups == want.tp_groups
    assert shuffled.pp_groups == want.pp_groups and shuffled.buckets == want.buckets
    assert [r.tp_rank for r in want.roles if r.pipeline == 0 and r.stage == 0] == [0, 1]


# --------------------------------------------------------------------------- the vocabulary-split loss


def _vocab_parallel_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from torch.distributed.device_mesh import init_device_mesh

    from hetrain.runtime.loss import vocab_parallel_lm_loss, vocab_shard
    from hetrain.runtime.parallelize import VocabParallelEmbedding

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    for vocab in VOCABS:
        logits, targets = _vocab_case(vocab)
        start, count = vocab_shard(vocab, world, rank)
        mine = logits[..., start:start + count].clone().requires_grad_()
        loss = vocab_parallel_lm_loss(mine, targets, start, dist.group.WORLD, scale=0.25)
        loss.backward()
        # the embedding split the same way; two micro-batches' lookups before either's backward, as 1F1B runs
        # them, the second under bf16 autocast (the stage's forward runs under it; the sum stays fp32)
        embedding = VocabParallelEmbedding(_vocab_embedding(vocab), mesh)
        first = embedding(targets)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            second = embedding(targets.flip(0))
        (first * _EMBED_GRADS[0] + second * _EMBED_GRADS[1]).sum().backward()
        torch.save({"loss": loss.detach(), "grad": mine.grad, "start": start, "count": count,
                    "looked_up": torch.stack((first, second)).detach(),
                    "embedding_grad": embedding.weight.grad.to_local()}, f"{out}/v{vocab}-rank{rank}.pt")
    dist.barrier()  # no rank tears gloo down while another is still in a collective
    dist.destroy_process_group()


_EMBED_GRADS = (torch.linspace(-1, 1, 6), torch.linspace(2, 0, 6))


def _vocab_embedding(vocab: int) -> torch.nn.Embedding:
    return torch.nn.Embedding(vocab, 6, _weight=torch.randn(vocab, 6, generator=torch.Generator().manual_seed(7)))


# over three ranks DTensor splits 11 columns 4 + 4 + 3, and 4 columns 2 + 2 + 0 (a rank with none)
VOCABS = (11, 4)


def _vocab_case(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(vocab)
    return torch.randn(2, 5, vocab, generator=gen) * 3, torch.randint(vocab, (2, 5), generator=gen)


def test_vocab_parallel_loss_and_embedding_match_the_whole_vocabulary(tmp_path: Path):
    """Each rank's loss is the whole vocabulary's, each rank's gradient its columns' of the whole one;
    each rank's embedding lookup is the whole table's, its weight gradient its rows' of the whole one."""
    from hetrain.runtime.loss import vocab_parallel_lm_loss

    spawn_ranks(_vocab_parallel_worker, (3, free_port(), str(tmp_path)), nprocs=3)
    for vocab, counts in zip(VOCABS, ([4, 4, 3], [2, 2, 0])):
        logits, targets = _vocab_case(vocab)
        logits.requires_grad_()
        want = lm_loss(logits, targets, scale=0.25)
        want.backward()
        got = [torch.load(tmp_path / f"v{vocab}-rank{r}.pt") for r in range(3)]
        assert [g["count"] for g in got] == counts
        for g in got:
            assert torch.allclose(g["loss"], want, rtol=1e-6)
            assert torch.allclose(g["grad"], logits.grad[..., g["start"]:g["start"] + g["count"]], atol=1e-7)
        whole = _vocab_embedding(vocab)
        first, second = whole(targets), whole(targets.flip(0))
        (first * _EMBED_GRADS[0] + second * _EMBED_GRADS[1]).sum().backward()
        for g in got:
            assert g["looked_up"].dtype == torch.float32
            assert torch.allclose(g["looked_up"], torch.stack((first, second)))
            assert torch.allclose(g["embedding_grad"], whole.weight.grad[g["start"]:g["start"] + g["count"]], atol=1e-6)
        # without a group: one rank's share of the work, the whole loss when it holds every column
        assert torch.allclose(vocab_parallel_lm_loss(logits.detach(), targets, 0, None, scale=0.25), want, rtol=1e-6)


# --------------------------------------------------------------------------- emulated cluster and bad input


def test_an_emulated_device_steps_its_optimizer_at_its_own_speed():
    """The optimizer step runs on the device: on an emulated one it is stretched like forward and backward."""
    from hetrain.runtime.instrument import StageMeter

    slowdown = 3.0
    meter = StageMeter(torch.nn.Linear(2, 2), "d", slowdown=slowdown)
    wall, cpu = time.perf_counter(), time.thread_time()
    with meter.device_work():
        while time.thread_time() - cpu < 0.05:  # 50 ms of this thread's CPU
            pass
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    assert wall >= slowdown * cpu * 0.99


CLUSTER = EXAMPLES / "clusters" / "cpu-emulated.yaml"


@pytest.fixture(scope="module")
def emulated_plan(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    r = run_cli("plan", "--cluster", str(CLUSTER), "--model", str(TINY), "--global-batch-size", "8",
                "--precision", "fp32", "--out", str(path))
    assert r.returncode == 0, r.stderr
    return path


def test_emulated_cluster_trains_50_steps_and_loss_falls(tmp_path: Path, emulated_plan: Path):
    """The planner's plan for the emulated cluster trains to the end, the loss of its last 5 steps under 0.8 of its
    first 5 (0.76 measured at 50 steps; 0.54 at 100, which took 10 s more of the suite)."""
    r = run_cli("train", "--plan", str(emulated_plan), "--cluster", str(CLUSTER), "--steps", "50",
                "--lr", "3e-3", "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stdout + r.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 50
    first = sum(r["loss"] for r in records[:5]) / 5
    last = sum(r["loss"] for r in records[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    rec = records[-1]
    assert {r["device"] for r in rec["ranks"]} == {"fast/0", "fast/1", "slow/0", "slow/1"}
    assert all(r["compute_s"] > 0 and r["peak_memory_gb"] > 0 for r in rec["ranks"])
    assert rec["tokens_per_s"] > 0
    # nothing of the launch outlives it: agent, its fork server, workers
    assert not processes_left(tmp_path / "run"), processes_left(tmp_path / "run")


def test_world_size_must_match_the_plan(tmp_path: Path):
    plan = asymmetric_plan(1)  # 3 devices
    plan.write(tmp_path / "plan.json")
    (tmp_path / "config.json").write_text(json.dumps({"plan": str(tmp_path / "plan.json"), "steps": 1}))
    env = {**os.environ, "ACCELERATE_USE_CPU": "true"}
    r = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                        "--main_process_port", str(free_port()), "-m", "hetrain.runtime.worker",
                        str(tmp_path / "config.json")], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0
    assert "the plan uses 3 devices, one process each, but 2 processes were launched" in r.stderr


def test_plan_for_another_model_is_refused(tmp_path: Path):
    asymmetric_plan(1).write(tmp_path / "plan.json")
    r = run_cli("train", "--plan", str(tmp_path / "plan.json"), "--model", str(EXAMPLES / "models" / "gpt-13b.yaml"))
    assert r.returncode == 2
    assert "the plan is for model 'gpt-tiny', not the 'gpt-13b'" in r.stderr


def test_tp_must_divide_hidden_size_and_heads(tmp_path: Path):
    data = json.loads(asymmetric_plan(1).to_json())
    for pipe in data["pipelines"]:
        for stage in pipe["stages"]:
            node, i = stage["devices"][0].split("/")
            stage["devices"] = [f"{node}/{3 * int(i) + j}" for j in range(3)]
    data["tp"] = 3
    (tmp_path / "plan.json").write_text(json.dumps(data))
    r = run_cli("train", "--plan", str(tmp_path / "plan.json"))
    assert r.returncode == 2
    assert "tp 3 must divide hidden_size 64 and num_heads 4" in r.stderr


def test_emulated_memory_budget_too_small_names_the_device(tmp_path: Path, emulated_plan: Path):
    small = CLUSTER.read_text().replace("memory_gb: 2}", "memory_gb: 0.001}")
    assert small != CLUSTER.read_text()
    (tmp_path / "cluster.yaml").write_text(small)
    r = run_cli("train", "--plan", str(emulated_plan), "--cluster", str(tmp_path / "cluster.yaml"), "--steps", "5",
                "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert re.search(r"device slow/[01] is out of memory: needs [0-9.]+ GB .*its budget is 0.001 GB", r.stderr), r.stderr
    assert not worker_pids(tmp_path / "run")


def test_ctrl_c_leaves_no_stray_processes(tmp_path: Path, emulated_plan: Path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hetrain", "train", "--plan", str(emulated_plan), "--cluster",
                             str(CLUSTER), "--steps", "100000", "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.5)
    assert metrics.exists(), proc.communicate(timeout=30)[0]
    assert len(list((run_dir / "pids").glob("*.pid"))) == 4
    proc.send_signal(signal.SIGINT)
    try:  # the launcher gets 10 s to stop its workers, then SIGTERM and SIGKILL: 20 s, more on a loaded machine
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        for pid in worker_pids(run_dir):  # never leave a failed test's workers training on
            os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"hetrain train did not stop on Ctrl-C: {proc.communicate(timeout=30)[0][-2000:]}")
    assert proc.returncode != 0
    time.sleep(0.5)
    assert not worker_pids(run_dir)


class _RecordingStage:
    """Stands in for a PipelineStage: records the order in which the schedule posts its messages."""

    def __init__(self, index: int, num_stages: int, log: list):
        self.stage_index, self.num_stages, self.log = index, num_stages, log
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.has_backward = True

    def clear_runtime_states(self):
        pass

    def get_fwd_recv_ops(self, i):
        return [("act", self.stage_index - 1, i)]

    def get_fwd_send_ops(self, i):
        return [] if self.is_last else [("act", self.stage_index, i)]

    def get_bwd_recv_ops(self, i):
        return [("grad", self.stage_index, i)]

    def get_bwd_send_ops(self, i):
        return [] if self.is_first else [("grad", self.stage_index - 1, i)]

    def forward_one_chunk(self, i, *args, **kwargs):
        return None

    def backward_one_chunk(self, i, **kwargs):
        pass

    def perform_reduce_grad(self, scale):
        pass


@pytest.mark.parametrize("in_flight,count", [([5, 3, 1], 6), ([7, 5, 4, 2, 1], 9), ([4, 3, 2, 1], 4), ([3, 1], 3)])
def test_eager_1f1b_posts_each_boundary_in_one_order_on_both_sides(monkeypatch, in_flight: list[int], count: int):
    """NCCL runs a pair of ranks' sends and receives on one stream, in order: the two stages of a
    boundary must post its messages in the same order or both wait forever (gloo, which the
    training tests run on, does not show it). Each side's order, recorded, is the same, and is
    the one the cost model plays (``eager_pipeline_s``)."""
    import hetrain.runtime.pipeline as pipeline
    from hetrain.cost.pipeline import eager_pipeline_s
    from hetrain.plan.eager import boundary_order

    log: list = []
    monkeypatch.setattr(pipeline, "_batch_p2p", lambda ops, desc=None: [log.append((current[0], op)) for op in ops])
    monkeypatch.setattr(pipeline, "_wait_batch_p2p", lambda work: None)
    current = [0]
    S = len(in_flight)
    for k in range(S):
        current[0] = k
        schedule = pipeline.ScheduleEager1F1B(_RecordingStage(k, S, log), count, in_flight, k)
        schedule._initialize_stage = lambda *a, **kw: None
        schedule._step_microbatches()
    for b in range(S - 1):  # boundary b | b + 1: the messages with that boundary's index
        upstream = [op for k, op in log if k == b and op[1] == b]
        downstream = [op for k, op in log if k == b + 1 and op[1] == b]
        assert upstream == downstream, f"boundary {b}: {upstream} vs {downstream}"
        assert upstream == [(kind, b, i) for kind, i in boundary_order(in_flight[b], in_flight[b + 1], count)]
    # the cost model plays the same orders to the end (it raises where a stage would wait forever)
    eager_pipeline_s([1.0] * S, [0.6] * S, [0.3] * (S - 1), in_flight, count)
