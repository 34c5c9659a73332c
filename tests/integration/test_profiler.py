"""The profiler on gpt-tiny: entries per (GPU type, tp, micro-batch), emulated slowdowns,
activation bytes, the JSON round trip, and the cost model using what was measured."""

from __future__ import annotations

import pytest
import torch

from hetrain.cost.costmodel import CostModel
from hetrain.errors import HetrainError
from hetrain.plan.schema import PipelinePlan, Plan, StagePlan, validate_plan
from hetrain.profiling.profile import load_profile
from hetrain.profiling.profiler import gpus_from_cluster, profile_entry, profile_model, shard_block
from hetrain.runtime.model import Block
from hetrain.spec.arithmetic import selective_activation_bytes
from hetrain.spec.specs import ClusterSpec, TrainingSettings, load_cluster, load_model
from tests.helpers import EXAMPLES

SPEC = load_model(EXAMPLES / "models" / "gpt-tiny.yaml")
CLUSTER = load_cluster(EXAMPLES / "clusters" / "cpu-emulated.yaml")
CPU = torch.device("cpu")
MBS, TPS = [1, 2], [1, 2]
TIMES = ("block_forward_s", "block_backward_s", "embed_forward_s", "embed_backward_s",
         "head_forward_s", "head_backward_s")
FAST, SLOW = "cpu-fast", "cpu-slow"


@pytest.fixture(scope="module")
def gpus() -> dict[str, float]:
    return gpus_from_cluster(CLUSTER)


@pytest.fixture(scope="module")
def profile(gpus):
    return profile_model(SPEC, gpus=gpus, micro_batch_sizes=MBS, tp_degrees=TPS, activation_recompute=True,
                         device=CPU, warmup=1, repeats=3)


def test_gpus_from_cluster_reads_emulate():
    gpus = gpus_from_cluster(CLUSTER)
    expected = {n.gpu: (n.emulate.slowdown if n.emulate else 1.0) for n in CLUSTER.nodes}
    assert gpus == expected
    assert set(gpus) == {FAST, SLOW}
    assert gpus[SLOW] > gpus[FAST]


def test_gpus_from_cluster_rejects_disagreeing_nodes():
    data = CLUSTER.model_dump()
    data["nodes"].append({**data["nodes"][0], "name": "fast2", "emulate": {"slowdown": 7.0}})
    cluster = ClusterSpec.model_validate(data)
    with pytest.raises(HetrainError, match="cpu-fast.*fast2"):
        gpus_from_cluster(cluster)


def test_entries_for_every_type_tp_and_micro_batch(profile, gpus):
    assert profile.model == SPEC
    assert profile.activation_recompute is True and profile.precision == "fp32"
    assert profile.head_split  # tp 2 entries time one rank's vocabulary shard of the head
    assert set(profile.devices) == set(gpus)
    for gpu in gpus:
        assert len(profile.devices[gpu]) == len(TPS) * len(MBS)
        for t in TPS:
            for b in MBS:
                entry = profile.lookup(gpu, t, b)
                assert entry is not None, (gpu, t, b)
                for k in TIMES:
                    assert getattr(entry, k) > 0, (gpu, t, b, k)
                # ZB-H1's split backward: the weight gradient is part of the split's input + weight
                assert 0 < entry.block_weight_backward_s < entry.block_split_backward_s, (gpu, t, b)


def test_slow_type_is_derived_by_its_slowdown(profile, gpus):
    ratio = gpus[SLOW] / gpus[FAST]
    for t in TPS:
        for b in MBS:
            fast, slow = profile.lookup(FAST, t, b), profile.lookup(SLOW, t, b)
            for k in (*TIMES, "block_split_backward_s", "block_weight_backward_s"):
                assert getattr(slow, k) == pytest.approx(ratio * getattr(fast, k), rel=1e-12)
            assert slow.block_activation_bytes == fast.block_activation_bytes


def test_activation_bytes_per_recompute_mode(profile):
    s, h = SPEC.seq_length, SPEC.hidden_size
    for t in TPS:
        for b in MBS:
            e = profile.lookup(FAST, t, b)
            kept = {mode: r.block_activation_bytes for mode, r in e.recompute.items()}
            assert set(kept) == {"none", "selective", "full"}
            # Full recompute keeps only the block input: b s h fp32 values (the profile's own mode, at top level).
            assert kept["full"] == e.block_activation_bytes == b * s * h * 4
            assert kept["full"] < kept["selective"] < kept["none"]
            # fp32 at tp 1 has no casts and no all-reduced copies: selective keeps exactly what the formula counts.
            settings = TrainingSettings(global_batch_size=16, precision="fp32")
            if t == 1:
                assert kept["selective"] == selective_activation_bytes(SPEC, settings, t, b)
    # A TP shard keeps less than the whole block (the attention and MLP insides are split).
    assert profile.lookup(FAST, 2, 1).recompute["none"].block_activation_bytes < \
        profile.lookup(FAST, 1, 1).recompute["none"].block_activation_bytes


def test_profile_entry_slowdown_and_shard_shapes():
    entry = profile_entry(SPEC, 2, 1, activation_recompute=False, device=CPU, slowdown=3.0, warmup=0, repeats=1)
    assert entry.tp == 2 and entry.micro_batch_size == 1 and entry.block_forward_s > 0
    block = shard_block(SPEC, 2)
    h, f = SPEC.hidden_size, SPEC.ffn_size
    assert block.attn.wq.weight.shape == (h // 2, h) and block.attn.wo.weight.shape == (h, h // 2)
    assert block.mlp.w1.weight.shape == (f // 2, h) and block.mlp.w2.weight.shape == (h, f // 2)
    full = sum(p.numel() for p in Block(SPEC).parameters())
    norms = 4 * h
    assert sum(p.numel() for p in block.parameters()) - norms == (full - norms) // 2
    y = block(torch.randn(2, SPEC.seq_length, h))
    assert y.shape == (2, SPEC.seq_length, h)


def test_invalid_tp_degrees(gpus):
    with pytest.raises(HetrainError, match="3, 5"):
        profile_model(SPEC, gpus=gpus, micro_batch_sizes=[1], tp_degrees=[3, 5], device=CPU, warmup=0, repeats=1)
    calls = []
    p = profile_model(SPEC, gpus={"cpu": 1.0}, micro_batch_sizes=[1], tp_degrees=[1, 3], device=CPU,
                      warmup=0, repeats=1, progress=lambda done, total: calls.append((done, total)))
    assert [(e.tp, e.micro_batch_size) for e in p.devices["cpu"]] == [(1, 1)]
    assert calls == [(1, 1)]


def test_runtime_overheads_measured_per_type(profile, gpus):
    """The runtime's own costs, from running the real trainer: the host's, but what runs on the device
    (DTensor's dispatch inside forward and backward, the optimizer step) is stretched."""
    fast, slow = profile.runtime[FAST], profile.runtime[SLOW]
    assert 0 < fast.microbatch_s < 0.1 and 0 <= fast.step_s < 1.0
    assert 0 < fast.optimizer_s_per_param < 1e-6  # AdamW on CPU: about 10 ns per parameter here
    assert (slow.step_s, slow.microbatch_s) == (fast.step_s, fast.microbatch_s)
    assert fast.tp_block_s > 0
    for stretched in ("tp_block_s", "optimizer_s_per_param"):
        assert getattr(slow, stretched) == pytest.approx(getattr(fast, stretched) * gpus[SLOW] / gpus[FAST])


def test_tp_dispatch_is_measured_on_two_ranks_and_a_failing_rank_says_which(tmp_path):
    """The CPU TP figure comes from two processes forming a real gloo group; when one fails, the
    error names it and its own last line, and no rank is left running."""
    import subprocess

    from hetrain.profiling.overheads import cpu_tp_block_overhead_s

    ok, bad = tmp_path / "ok", tmp_path / "bad"
    ok.mkdir()
    bad.mkdir()
    assert cpu_tp_block_overhead_s("fp32", ok) > 0
    with pytest.raises(RuntimeError, match=r"rank 0 failed \(exit 1\): KeyError: 'nonsense'"):
        cpu_tp_block_overhead_s("nonsense", bad)
    left = subprocess.run(["pgrep", "-f", f"--tp-store {bad}"], capture_output=True, text=True).stdout
    assert not left.strip()


def test_json_round_trip(profile, tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(profile.to_json())
    loaded = load_profile(path)
    assert loaded == profile


def _plan(t: int, b: int) -> Plan:
    """Two one-stage pipelines: all 6 blocks on a fast TP group and on a slow one."""
    def stage(node: str, gpu: str) -> StagePlan:
        return StagePlan(devices=[f"{node}/{j}" for j in range(t)], gpu=gpu, layers=(0, SPEC.num_layers))

    m = 16 // b // 2
    return Plan(model=SPEC, cluster=CLUSTER.name, global_batch_size=16, micro_batch_size=b, tp=t,
                pipelines=[PipelinePlan(num_microbatches=m, stages=[stage("fast", FAST)]),
                           PipelinePlan(num_microbatches=m, stages=[stage("slow", SLOW)])])


@pytest.mark.parametrize("t", TPS)
@pytest.mark.parametrize("b", MBS)
def test_cost_model_uses_measured_times(profile, gpus, t, b):
    settings = TrainingSettings(global_batch_size=16, precision="fp32")
    cost = CostModel(CLUSTER, SPEC, settings, profile)
    plan = _plan(t, b)
    validate_plan(plan, CLUSTER)
    est = cost.estimate(plan)
    fast_s, slow_s = est.pipelines[0].stage_s[0], est.pipelines[1].stage_s[0]

    def compute(gpu: str) -> float:
        e = profile.lookup(gpu, t, b)
        return SPEC.num_layers * (e.block_forward_s + e.block_backward_s) + sum(
            getattr(e, k) for k in TIMES[2:])

    runtime = profile.runtime
    if t == 1:  # no communication inside a stage: the measured compute and the runtime's work per micro-batch
        assert fast_s == pytest.approx(compute(FAST) + runtime[FAST].microbatch_s, rel=1e-9)
        assert slow_s == pytest.approx(compute(SLOW) + runtime[SLOW].microbatch_s, rel=1e-9)
    else:  # TP all-reduces come on top, the same on both nodes (same intra-node bandwidth), and DTensor's dispatch
        assert fast_s > compute(FAST)
        dispatch = SPEC.num_layers * 4 / 3 * (runtime[SLOW].tp_block_s - runtime[FAST].tp_block_s)  # full recompute
        assert slow_s - fast_s == pytest.approx(compute(SLOW) - compute(FAST) + dispatch, rel=1e-9)
    # One stage, no bubbles: the pipeline takes its micro-batches times the measured stage time.
    m = plan.pipelines[0].num_microbatches
    assert est.pipelines[0].time_s == pytest.approx(m * fast_s, rel=1e-9)
    # Memory kept per in-flight micro-batch per block is the measured block input.
    unit = cost.unit_costs(FAST, CLUSTER.node_by_name["fast"].intra_node_bandwidth_gbps, t, b)
    assert unit.block_act_bytes == profile.lookup(FAST, t, b).block_activation_bytes


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_cost_model_uses_each_modes_measurement(profile, mode):
    settings = TrainingSettings(global_batch_size=16, precision="fp32", activation_recompute=mode)
    cost = CostModel(CLUSTER, SPEC, settings, profile)
    for b in MBS:
        measured = profile.lookup(FAST, 1, b)
        unit = cost.unit_costs(FAST, 2.0, 1, b)
        assert unit.recompute == mode
        assert unit.block_act_bytes == measured.recompute[mode].block_activation_bytes
        assert unit.block_s == pytest.approx(measured.block_forward_s + measured.recompute[mode].block_backward_s)
        # and a stage that records its own mode is priced by it, whatever the settings say
        stage_units = CostModel(CLUSTER, SPEC, settings.model_copy(update={"activation_recompute": "auto"}),
                                profile).unit_costs(FAST, 2.0, 1, b, mode)
        assert stage_units == unit


def test_cost_model_rejects_profile_of_another_model(profile):
    other = SPEC.model_copy(update={"num_layers": 3})
    with pytest.raises(HetrainError, match="gpt-tiny"):
        CostModel(CLUSTER, other, TrainingSettings(global_batch_size=16, precision="fp32"), profile)


def test_profiles_from_several_nodes_merge_one_type_each(profile):
    """Each node profiles its own GPU type; the parts are checked before they are merged."""
    from hetrain.profiling.profile import merge_profiles

    parts = [profile.model_copy(update={"devices": {gpu: entries}, "runtime": {gpu: profile.runtime[gpu]}})
             for gpu, entries in profile.devices.items()]
    merged = merge_profiles(parts)
    assert merged.devices == profile.devices and merged.runtime == profile.runtime
    with pytest.raises(HetrainError, match="profiled twice"):
        merge_profiles(parts + parts[:1])
    with pytest.raises(HetrainError, match="differ in 'precision'"):
        merge_profiles([parts[0], parts[1].model_copy(update={"precision": "bf16"})])


def test_a_profile_from_another_node_is_validated(profile):
    """A node run's artifact is untrusted: anything but a valid profile is one line naming the source."""
    from flows.report import PROFILE_FENCE, profile_from_markdown

    text = f"## x\n\n{PROFILE_FENCE}\n{profile.to_json()}\n```\n"
    assert profile_from_markdown(text, "node a").devices == profile.devices
    for bad in (None, "no profile here", f"{PROFILE_FENCE}\n{{\"schema\": 1}}\n```", f"{PROFILE_FENCE}\nnot json```"):
        with pytest.raises(HetrainError, match="^node a: "):
            profile_from_markdown(bad, "node a")
