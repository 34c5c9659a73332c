"""Pipeline schedules beyond 1F1B in the plan file and the planner: ZB-H1 (zero bubble)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetrain.errors import HetrainError
from hetrain.plan.eager import zero_bubble_order
from hetrain.plan.schema import PipelinePlan, Plan, StagePlan, load_plan, validate_plan_structure
from hetrain.spec.specs import ModelSpec

MODEL = ModelSpec(name="m", num_layers=4, hidden_size=64, num_heads=4, seq_length=32, vocab_size=256)


def _plan(schedule: str | None, counts=(None, None, None, None), microbatches: int = 8) -> Plan:
    stages = [StagePlan(devices=[f"n/{k}"], gpu="T4", layers=(k, k + 1), in_flight=c) for k, c in enumerate(counts)]
    return Plan(model=MODEL, cluster="c", global_batch_size=microbatches, micro_batch_size=1, tp=1,
                pipelines=[PipelinePlan(num_microbatches=microbatches, stages=stages, schedule=schedule)])


def _a100_v100(global_batch_size: int):
    """(model, cluster, settings): an 8-block model on a node of 4 A100s and one of 2 V100s, no recompute."""
    from hetrain.spec.specs import ClusterSpec, TrainingSettings

    model = ModelSpec(name="m", num_layers=8, hidden_size=2048, num_heads=16, seq_length=1024, vocab_size=32000)
    cluster = ClusterSpec.model_validate({
        "name": "c", "inter_node_bandwidth_gbps": 200,
        "nodes": [{"name": "a", "gpu": "A100-80G", "count": 4, "intra_node_bandwidth_gbps": 300},
                  {"name": "b", "gpu": "V100-32G", "count": 2, "intra_node_bandwidth_gbps": 150}]})
    return model, cluster, TrainingSettings(global_batch_size=global_batch_size, activation_recompute=False)


def _stages(node: str, gpu: str, cuts: list[int]) -> list[StagePlan]:
    """One stage per GPU of ``node`` in turn, blocks ``cuts[k]`` to ``cuts[k + 1]``."""
    return [StagePlan(devices=[f"{node}/{k}"], gpu=gpu, layers=(lo, hi)) for k, (lo, hi) in enumerate(zip(cuts, cuts[1:]))]


def test_a_plan_without_a_schedule_means_what_it_meant():
    assert _plan(None).pipelines[0].schedule_name == "1f1b"
    eager = _plan(None, (7, 5, 3, 1)).pipelines[0]
    assert eager.schedule_name == "eager-1f1b" and eager.eager
    zb = _plan("zb-h1").pipelines[0]
    assert zb.schedule_name == "zb-h1" and not zb.eager
    assert [zb.in_flight(k) for k in range(4)] == [4, 3, 2, 1] and [zb.weight_pending(k) for k in range(4)] == [0, 1, 2, 3]
    # written out and read back: the field is kept where set, and absent (old files) where not
    assert "schedule" not in _plan(None).to_json()
    assert Plan.model_validate_json(_plan("zb-h1").to_json()).pipelines[0].schedule == "zb-h1"


def test_schedules_are_checked_in_one_line(tmp_path: Path):
    validate_plan_structure(_plan("zb-h1"))
    validate_plan_structure(_plan("eager-1f1b", (7, 5, 3, 1)))
    for schedule, counts, message in (
            ("zb-h1", (7, 5, 3, 1), r"pipelines\[0\]\.stages\[0\]: in_flight is for schedule eager-1f1b, not zb-h1"),
            ("1f1b", (None, 5, 3, 1), r"pipelines\[0\]\.stages\[1\]: in_flight is for schedule eager-1f1b, not 1f1b"),
            ("eager-1f1b", (None,) * 4, r"pipelines\[0\]: schedule eager-1f1b needs in_flight on every stage")):
        with pytest.raises(HetrainError, match=message):
            validate_plan_structure(_plan(schedule, counts))
    data = json.loads(_plan(None).to_json())
    data["pipelines"][0]["schedule"] = "zb-h2"
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(HetrainError) as err:
        load_plan(tmp_path / "plan.json")
    assert "pipelines[0].schedule" in str(err.value) and "got 'zb-h2'" in str(err.value) and "\n" not in str(err.value)


def test_gpipe_takes_fewer_micro_batches_than_stages_and_holds_them_all():
    """The one schedule a pipeline with fewer micro-batches than stages may run (torch's 1F1B refuses it): the
    check says so in one line, GPipe holds every micro-batch on every stage, and the count sets the schedule."""
    with pytest.raises(HetrainError, match=r"^pipelines\[0\]: 3 micro-batches for 4 stages; the 1F1B schedules "
                                           r"need at least one per stage \(schedule gpipe takes fewer\)$"):
        validate_plan_structure(_plan(None, microbatches=3))
    gpipe = _plan("gpipe", microbatches=3)
    validate_plan_structure(gpipe)
    assert [gpipe.pipelines[0].in_flight(k) for k in range(4)] == [3, 3, 3, 3]
    with pytest.raises(HetrainError, match=r"in_flight is for schedule eager-1f1b, not gpipe"):
        validate_plan_structure(_plan("gpipe", (7, 5, 3, 1)))
    pipe = _plan(None).pipelines[0]
    assert pipe.with_microbatches(3).schedule == "gpipe"
    assert pipe.with_microbatches(3).with_microbatches(4).schedule is None  # 1F1B: the same time, fewer held
    zb = _plan("zb-h1").pipelines[0]
    assert zb.with_microbatches(6).schedule == "zb-h1" and zb.with_microbatches(6).num_microbatches == 6


def test_gpipe_plays_as_torch_runs_it():
    """Equal stages without sends: (m + S - 1)(f + b), what 1F1B takes (its fill is most of it where m < S), each
    stage ending its backwards one backward after the next one. With sends, each receive is posted only after
    the compute before it (``ScheduleGPipe``): a message to stage k + 1 waits for both, so every forward past
    the first stage pays its send (two stages, m = 2, f = 1, b = 2, e = 0.5 by hand)."""
    from hetrain.cost.pipeline import gpipe_pipeline_s, one_f_one_b_play_s

    for S, m in ((8, 3), (4, 4), (4, 9), (1, 2)):
        _, total, ends = gpipe_pipeline_s([3.0] * S, [2.0] * S, [0.0] * (S - 1), m)
        assert total == (m + S - 1) * 3.0 and ends == [total - 2.0 * k for k in range(S)]
        if m >= S:
            assert one_f_one_b_play_s([3.0] * S, [2.0] * S, [0.0] * (S - 1), m) == total
    # stage 0: F0 0-1, F1 1-2; act 0 arrives 1.5, stage 1: F0 1.5-2.5, F1: act 1 sent at 2, posted at 2.5: 3.0-4.0;
    # stage 1 B0 4-6, B1 6-8; grad 0 at 6.5 (stage 0 posted at 3, its act-1 send through), stage 0 B0 6.5-8.5;
    # grad 1 8.5-9.0, B1 9.0-11.0
    _, total, ends = gpipe_pipeline_s([3.0, 3.0], [2.0, 2.0], [0.5], 2)
    assert total == 11.0 and ends == [11.0, 9.0]


def test_gpipe_last_stage_holds_every_micro_batchs_logits_and_saved_loss():
    """torch keeps each micro-batch's stage output in its forward cache until the backward, and the loss's graph
    its fp32 softmax: under GPipe the last stage holds them for all m, where 1F1B's holds one."""
    plan, cost = _one_pipeline(8, 4, False)
    gpipe = plan.model_copy(update={"pipelines": [plan.pipelines[0].with_microbatches(3)],
                                    "global_batch_size": 3})
    assert gpipe.pipelines[0].schedule == "gpipe"
    est = cost.estimate(gpipe)
    u = cost.unit_costs("A100-80G", 300, 1, 1, None)
    seq, vocab = plan.model.seq_length, plan.model.vocab_size
    assert u.head_saved_bytes == seq * vocab * 4 and u.head_out_bytes > 0
    one, three = (u.stage_memory_bytes(2, False, True, n) for n in (1, 3))
    assert three - one == pytest.approx(2 * (2 * u.block_act_bytes + u.boundary_bytes + u.head_out_bytes
                                             + u.head_saved_bytes))
    assert est.peak_memory_gb["a/3"] * 1e9 == pytest.approx(three, rel=1e-6)


def test_zero_bubble_order_defers_stage_ks_weight_gradients_by_k():
    """Stage 1 of 3 (2 in flight, W one backward late): every micro-batch's F, B, W once, W after its B,
    and no more than 3 micro-batches between their F and their W."""
    order = zero_bubble_order(5, 2, 1)
    assert order[:6] == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("W", 0)]
    for kind in "FBW":
        assert [i for k, i in order if k == kind] == list(range(5))
    held = peak = 0
    for kind, i in order:
        held += {"F": 1, "B": 0, "W": -1}[kind]
        peak = max(peak, held)
        if kind == "W":
            assert order.index(("B", i)) < order.index(("W", i))
    assert peak == 3


# --------------------------------------------------------------------------- the planner's choice

def test_the_planner_runs_zb_h1_where_it_is_faster_and_fits():
    """Two pipelines of different depth (4 A100 stages; 2 V100 stages) without recompute: ZB-H1 on both
    (their drains filled with weight gradients), the plan predicted faster than with 1F1B, every stage
    within its memory. On GPUs too small to hold the micro-batches ZB-H1 keeps waiting for their weight
    gradient, the pipeline keeps its schedule."""
    from hetrain.cost.costmodel import CostModel
    from hetrain.spec.specs import ClusterSpec
    from solver.search.assemble import choose_schedules

    model, cluster, settings = _a100_v100(24)
    stages = _stages
    plan = Plan(model=model, cluster="c", global_batch_size=24, micro_batch_size=1, tp=1, training=settings,
                pipelines=[PipelinePlan(num_microbatches=16, stages=stages("a", "A100-80G", [0, 2, 4, 6, 8])),
                           PipelinePlan(num_microbatches=8, stages=stages("b", "V100-32G", [0, 4, 8]))])
    cost = CostModel(cluster, model, settings)
    before = cost.estimate(plan)
    chosen, est = choose_schedules(plan, cost, before)
    assert [p.schedule_name for p in chosen.pipelines] == ["zb-h1", "zb-h1"]
    assert est.iteration_time_s < before.iteration_time_s and not est.over_capacity()
    assert est.iteration_time_s == pytest.approx(cost.estimate(chosen).iteration_time_s)

    # the V100 pipeline's last stage on a GPU holding just what it needs under 1F1B: ZB-H1 would keep
    # one more micro-batch there, waiting for its weight gradient
    def with_last_stage_gb(memory_gb: float) -> tuple[ClusterSpec, Plan]:
        data = cluster.model_dump()
        data["gpu_types"] = {"tight": {**data.get("gpu_types", {}).get("V100-32G", {}), "tflops": 125,
                                       "memory_gb": memory_gb, "memory_bandwidth_gbps": 900, "fp32_tflops": 15.7}}
        data["nodes"].append({"name": "d", "gpu": "tight", "count": 1, "intra_node_bandwidth_gbps": 150})
        last = StagePlan(devices=["d/0"], gpu="tight", layers=(4, 8))
        pipes = [plan.pipelines[0].model_copy(update={"num_microbatches": 20}),  # the slower pipeline
                 PipelinePlan(num_microbatches=4, stages=[plan.pipelines[1].stages[0], last])]
        # every stage already shards its optimizer state: choose_schedules would otherwise shard it first
        # (shard_if_faster), which frees the memory this case is about
        pipes = [p.model_copy(update={"stages": [st.model_copy(update={"optimizer_state": "sharded"})
                                                 for st in p.stages]}) for p in pipes]
        return ClusterSpec.model_validate(data), plan.model_copy(update={"pipelines": pipes})

    roomy, moved = with_last_stage_gb(32)
    need_gb = CostModel(roomy, model, settings).estimate(moved).peak_memory_gb["d/0"]
    tight, moved = with_last_stage_gb(need_gb + 0.01)
    chosen, est = choose_schedules(moved, CostModel(tight, model, settings))
    assert chosen.pipelines[0].schedule_name == "zb-h1" and chosen.pipelines[1].schedule_name != "zb-h1"
    assert not est.over_capacity()


def test_a_schedule_that_speeds_up_some_pipelines_takes_more_of_the_batch():
    """Two pipelines the batch was split between for 1F1B (4 A100 stages; 2 V100 stages); ZB-H1 on the A100
    one alone leaves the plan's time where it was, the V100 pipeline ending last. Split again for their
    new times (``rebalance_microbatches``), the A100 pipeline takes micro-batches from the V100 one: the
    same batch, the plan faster, each pipeline still a micro-batch per stage, and the estimate the
    cost model's own."""
    from hetrain.cost.costmodel import CostModel
    from solver.search.assemble import allocate_microbatches, rebalance_microbatches

    model, cluster, settings = _a100_v100(46)
    cost = CostModel(cluster, model, settings)
    stages = _stages
    pipes = [PipelinePlan(num_microbatches=23, stages=stages("a", "A100-80G", [0, 2, 4, 6, 8])),
             PipelinePlan(num_microbatches=23, stages=stages("b", "V100-32G", [0, 4, 8]))]
    plan = Plan(model=model, cluster="c", global_batch_size=46, micro_batch_size=1, tp=1, training=settings,
                pipelines=pipes)
    played = cost.estimate(plan).pipelines  # 1F1B: T(m) = m tau + fill, split as the planners split it
    counts = allocate_microbatches([p.bottleneck_s for p in played],
                                   [p.time_s - 23 * p.bottleneck_s for p in played], 46, [4, 2])
    split = plan.model_copy(update={"pipelines": [p.model_copy(update={"num_microbatches": c})
                                                  for p, c in zip(pipes, counts)]})
    zb = split.model_copy(update={"pipelines": [split.pipelines[0].model_copy(update={"schedule": "zb-h1"}),
                                                split.pipelines[1]]})
    before, zb_est = cost.estimate(split), cost.estimate(zb)
    assert zb_est.iteration_time_s == pytest.approx(before.iteration_time_s, rel=1e-3)  # the V100 one binds
    again, est = rebalance_microbatches(zb, cost, zb_est)
    got = [p.num_microbatches for p in again.pipelines]
    assert counts == [37, 9] and sum(got) == 46 and got[0] > counts[0] and got[1] >= 2, (counts, got)
    assert est.iteration_time_s < zb_est.iteration_time_s * 0.98 and not est.over_capacity()
    assert est.iteration_time_s == pytest.approx(cost.estimate(again).iteration_time_s)
    assert rebalance_microbatches(again, cost, est)[0] is again  # split for its times already: unchanged


def test_the_planners_terms_per_stage_price_a_template_as_the_estimate_plays_it():
    """``UnitCosts.stage_terms_s`` + ``schedule_terms``: what a planner prices per template without a Plan,
    against the estimate of the plan built from it (equal stages, sends inside a node: the closed form
    is within its bounds of the play)."""
    from hetrain.cost.costmodel import CostModel
    from hetrain.cost.pipeline import schedule_terms
    from hetrain.spec.specs import ClusterSpec, TrainingSettings

    model = ModelSpec(name="m", num_layers=8, hidden_size=1024, num_heads=16, seq_length=512, vocab_size=8000)
    cluster = ClusterSpec.model_validate({"name": "c", "inter_node_bandwidth_gbps": 25, "nodes": [
        {"name": "a", "gpu": "A100-80G", "count": 4, "intra_node_bandwidth_gbps": 300}]})
    settings = TrainingSettings(global_batch_size=16, activation_recompute=False)
    cost = CostModel(cluster, model, settings)
    u = cost.unit_costs("A100-80G", 300, 1, 1)
    for schedule in ("1f1b", "zb-h1"):
        terms = [u.stage_terms_s(2, k == 0, k == 3, schedule) for k in range(4)]
        e = cost.send_s(300, 1)
        tau, fill = schedule_terms(schedule, *zip(*terms), [e] * 3)
        stages = [StagePlan(devices=[f"a/{k}"], gpu="A100-80G", layers=(2 * k, 2 * k + 2)) for k in range(4)]
        est = cost.estimate(Plan(model=model, cluster="c", global_batch_size=16, micro_batch_size=1, tp=1,
                                 pipelines=[PipelinePlan(num_microbatches=16, stages=stages, schedule=schedule)]))
        assert est.pipelines[0].stage_s == pytest.approx([c for c, _, _ in terms])
        assert 16 * tau + fill == pytest.approx(est.pipeline_s, rel=0.16)


def _interleaved(chunks: list[tuple[str, tuple[int, int]]], v: int | None = 2, microbatches: int = 4,
                 schedule: str | None = "interleaved-1f1b") -> Plan:
    model = ModelSpec(name="m", num_layers=6, hidden_size=64, num_heads=4, seq_length=32, vocab_size=256)
    stages = [StagePlan(devices=[d], gpu="T4", layers=layers) for d, layers in chunks]
    return Plan(model=model, cluster="c", global_batch_size=microbatches + 2, micro_batch_size=1, tp=1,
                pipelines=[PipelinePlan(num_microbatches=microbatches, stages=stages, schedule=schedule,
                                        virtual_stages=v),
                           PipelinePlan(num_microbatches=2, stages=[StagePlan(devices=["m/0"], gpu="T4",
                                                                              layers=(0, 6))])])


CHUNKS = [("n/0", (0, 1)), ("n/1", (1, 3)), ("n/0", (3, 4)), ("n/1", (4, 6))]


def test_interleaved_plans_are_checked_in_one_line():
    plan = _interleaved(CHUNKS)
    validate_plan_structure(plan)
    assert plan.devices() == ["n/0", "n/1", "m/0"]
    pipe = plan.pipelines[0]
    assert pipe.depth == 2 and pipe.chunks_of(0) == [0, 2] and pipe.chunks_of(1) == [1, 3]
    assert "virtual_stages" not in _plan(None).to_json()  # other plans keep their bytes
    assert Plan.model_validate_json(plan.to_json()) == plan
    swapped = [CHUNKS[0], CHUNKS[1], ("n/1", (3, 4)), ("n/0", (4, 6))]
    for p, message in (
            (_interleaved(CHUNKS, v=None), r"pipelines\[0\]: schedule interleaved-1f1b needs virtual_stages of at "
                                           r"least 2, got None"),
            (_interleaved(CHUNKS, v=2, schedule=None), r"pipelines\[0\]: virtual_stages is for schedule "
                                                       r"interleaved-1f1b, not 1f1b"),
            (_interleaved(CHUNKS[:3], v=2), r"pipelines\[0\]: 3 stages do not make virtual_stages 2 chunks"),
            (_interleaved(CHUNKS, v=4), r"pipelines\[0\]: 4 stages do not make virtual_stages 4 chunks"),
            (_interleaved(swapped), r"pipelines\[0\]\.stages\[2\]: devices \['n/1'\] differs from stages\[0\]'s "
                                    r"\['n/0'\]"),
            (_interleaved(CHUNKS, microbatches=5), r"num_microbatches 5 is not a multiple of interleaved 1F1B's 2 "
                                                   r"rounds")):
        with pytest.raises(HetrainError, match=message) as err:
            validate_plan_structure(p)
        assert "\n" not in str(err.value)
    # cutting a pipeline into chunks: every stage's blocks divide by v (the chunks would leave blocks out)
    odd = PipelinePlan(num_microbatches=4, stages=[StagePlan(devices=["n/0"], gpu="T4", layers=(0, 2)),
                                                   StagePlan(devices=["n/1"], gpu="T4", layers=(2, 5))])
    with pytest.raises(HetrainError, match=r"^stages\[1\]: 3 blocks do not divide into 2 chunks for interleaved 1F1B$"):
        odd.interleave(2)


def test_an_interleaved_device_holds_its_chunks_in_one_role_and_its_buckets_follow_each_chunk():
    from hetrain.plan.layout import build_layout

    layout = build_layout(_interleaved(CHUNKS))
    assert layout.world_size == 3 and layout.tp_groups == [(0,), (1,), (2,)] and layout.pp_groups == [(0, 1), (2,)]
    first = layout.roles[0]
    assert first.chunk_layers == [(0, 1), (3, 4)] and first.is_first and not first.is_last
    assert [c for c, _ in layout.roles[1].chunks] == [1, 3] and layout.roles[1].is_last
    assert [(b.ranks, b.layers, b.embedding, b.head) for b in layout.buckets] == [
        ((0, 2), (0, 1), True, False), ((1, 2), (1, 3), False, False), ((0, 2), (3, 4), False, False),
        ((1, 2), (4, 6), False, True)]


def test_interleaved_order_is_torchs():
    """``interleaved_order`` is torch's ``ScheduleInterleaved1F1B`` order, idle slots left out, for depths,
    chunk counts and micro-batches torch takes (the cost model plays it; the runtime runs torch's)."""
    import types

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    from hetrain.plan.eager import interleaved_order, interleaved_rounds

    checked = 0
    for p in range(2, 6):
        for v in range(2, 5):
            for m in range(1, 17):
                rounds, per_round = interleaved_rounds(p, m)
                if m % rounds:
                    continue
                state = types.SimpleNamespace(n_local_stages=v, microbatches_per_round=per_round, pp_group_size=p,
                                              _n_microbatches=m)
                for rank in range(p):
                    want = [("F" if a.computation_type == _ComputationType.FORWARD else "B", a.stage_index // p,
                             a.microbatch_index)
                            for a in ScheduleInterleaved1F1B._calculate_single_rank_operations(state, rank) if a]
                    assert interleaved_order(p, v, m, rank) == want, (p, v, m, rank)
                    checked += 1
    assert checked > 300


def test_interleaved_held_counts_the_chunks_at_the_peak():
    """Rank 0 of 2, two chunks, 4 micro-batches: warm-up of 2 + 2 forwards, the fifth forward before the first
    backward: 3 of chunk 0 and 2 of chunk 1 in flight (torch's order), 5 in all against 1F1B's 2."""
    from hetrain.plan.eager import interleaved_held, interleaved_order

    order = interleaved_order(2, 2, 4, 0)
    assert order[:6] == [("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1), ("F", 0, 2), ("B", 1, 0)]
    assert interleaved_held(order, [1.0, 1.0]) == [3, 2]
    assert _interleaved(CHUNKS).pipelines[0].in_flight(0) == 3


def _one_pipeline(num_layers: int, microbatches: int, recompute):
    from hetrain.cost.costmodel import CostModel
    from hetrain.spec.specs import ClusterSpec, TrainingSettings

    model = ModelSpec(name="m", num_layers=num_layers, hidden_size=2048, num_heads=16, seq_length=1024,
                      vocab_size=32000)
    cluster = ClusterSpec.model_validate({
        "name": "c", "inter_node_bandwidth_gbps": 200,
        "nodes": [{"name": "a", "gpu": "A100-80G", "count": 4, "intra_node_bandwidth_gbps": 300}]})
    settings = TrainingSettings(global_batch_size=microbatches, activation_recompute=recompute)
    per = num_layers // 4
    stages = [StagePlan(devices=[f"a/{k}"], gpu="A100-80G", layers=(k * per, (k + 1) * per)) for k in range(4)]
    plan = Plan(model=model, cluster="c", global_batch_size=microbatches, micro_batch_size=1, tp=1, training=settings,
                pipelines=[PipelinePlan(num_microbatches=microbatches, stages=stages)])
    return plan, CostModel(cluster, model, settings)


def test_interleaved_play_divides_the_fill_by_v_and_the_estimate_counts_each_devices_chunks():
    """On equal stages without sends the played pipeline is m w + (p - 1) w / v (Narayanan et al.); in the
    estimate, a device's memory is its chunks' states and the activations torch's order keeps at its peak
    (more than 1F1B's S - k), and the capacity shares still add up to 1."""
    from hetrain.cost.pipeline import interleaved_pipeline_s, one_f_one_b_play_s
    from hetrain.cost.report import plan_rows, where_time_goes

    p, m, w = 4, 8, 24.0
    assert one_f_one_b_play_s([w] * p, [w * 2 / 3] * p, [0.0] * (p - 1), m) == m * w + (p - 1) * w
    for v in (2, 4):
        _, total, ends = interleaved_pipeline_s([w / v] * (p * v), [w * 2 / 3 / v] * (p * v), [0.0] * (p * v - 1), p, m)
        assert total == pytest.approx(m * w + (p - 1) * w / v) and max(ends) == total

    plan, cost = _one_pipeline(8, 4, False)
    inter = plan.model_copy(update={"pipelines": [plan.pipelines[0].interleave(2)]})
    validate_plan_structure(inter)
    before, after = cost.estimate(plan), cost.estimate(inter)
    assert after.pipelines[0].time_s < before.pipelines[0].time_s
    pipe = inter.pipelines[0]
    u = cost.unit_costs("A100-80G", 300, 1, 1, None)
    held = pipe.chunk_held(0)
    assert sum(held) > plan.pipelines[0].in_flight(0)
    assert after.peak_memory_gb["a/0"] * 1e9 == pytest.approx(u.chunks_memory_bytes(
        [(1, True, False, held[0]), (1, False, False, held[1])]), rel=1e-6)
    assert after.peak_memory_gb["a/0"] > before.peak_memory_gb["a/0"]
    assert sum(where_time_goes(cost, inter, after).values()) == pytest.approx(1.0)
    assert {r["virtual stages"] for r in plan_rows(inter, after)} == {2}


def test_the_planner_interleaves_a_pipeline_where_that_is_faster_and_fits():
    """Four A100 stages of four blocks and four micro-batches, all recomputing fully (ZB-H1 cannot split
    there): the fill is most of the step, interleaved 1F1B cuts it and fits; with as many micro-batches
    as 1F1B's fill is small against, and sends that v-fold crossings make dear, it may not."""
    from solver.search.assemble import choose_schedules

    plan, cost = _one_pipeline(16, 4, "full")
    before = cost.estimate(plan)
    chosen, est = choose_schedules(plan, cost, before)
    pipe = chosen.pipelines[0]
    assert pipe.schedule_name == "interleaved-1f1b" and pipe.virtual_stages in (2, 4)
    validate_plan_structure(chosen)
    assert est.iteration_time_s < before.iteration_time_s and not est.over_capacity()
    assert est.iteration_time_s == pytest.approx(cost.estimate(chosen).iteration_time_s)
    # the chosen v is the fastest of those that fit
    others = [cost.estimate(plan.model_copy(update={"pipelines": [plan.pipelines[0].interleave(v)]}))
              for v in (2, 4)]
    assert est.iteration_time_s == pytest.approx(min(e.iteration_time_s for e in others if not e.over_capacity()))


def test_deepspeed_engine_plays_its_lockstep_schedule():
    """DeepSpeed's engine (``deepspeed-1f1b``, priced to compare with runs made by it): equal stages without sends
    take 1F1B's (m + S - 1)(f + b), each stage ending one backward after the next; with sends every message is
    its own blocking send and receive, so an end stage pays 2 e per micro-batch and a middle one 4 e (torch's
    1F1B fuses each send with the receive going the other way: e_(k-1) + e_k)."""
    from hetrain.cost.pipeline import deepspeed_pipeline_s, one_f_one_b_play_s, pipeline_terms

    for S, m in ((1, 1), (1, 3), (2, 1), (3, 7), (4, 4), (5, 11)):
        _, total, ends = deepspeed_pipeline_s([3.0] * S, [2.0] * S, [0.0] * (S - 1), m)
        assert total == (m + S - 1) * 3.0 and ends == [total - 2.0 * k for k in range(S)]
    # one micro-batch by hand: F0 0-1, act 1-1.5, F 1.5-2.5, B 2.5-4.5, grad 4.5-5.0, B 5.0-7.0
    assert deepspeed_pipeline_s([3.0, 3.0], [2.0, 2.0], [0.5], 1)[1:] == (7.0, [7.0, 5.0])
    m = 40
    two = deepspeed_pipeline_s([3.0] * 2, [2.0] * 2, [0.5], m)
    assert two[1] == m * (3.0 + 2 * 0.5) + 3.0  # the steady state: c + 2 e on both stages
    three = deepspeed_pipeline_s([3.0] * 3, [2.0] * 3, [0.5] * 2, m)
    assert three[0] == pytest.approx(3.0 + 4 * 0.5, rel=0.01)
    assert pipeline_terms([3.0] * 3, [0.5] * 2)[0] == 3.0 + 2 * 0.5
    assert one_f_one_b_play_s([3.0] * 3, [2.0] * 3, [0.5] * 2, m) < three[1]


def test_a_deepspeed_plan_is_estimated_not_trained(tmp_path):
    """``hetrain estimate`` prices a plan of DeepSpeed's engine under its schedule; ``hetrain train`` refuses it in
    one line (exit 2) before anything starts."""
    from hetrain.cost.costmodel import CostModel
    from tests.helpers import run_cli

    model, cluster, settings = _a100_v100(8)
    stages = _stages("a", "A100-80G", [0, 2, 4, 6, 8])
    plan = Plan(model=model, cluster="c", global_batch_size=8, micro_batch_size=1, tp=1, training=settings,
                pipelines=[PipelinePlan(num_microbatches=8, stages=stages, schedule="deepspeed-1f1b")])
    cm = CostModel(cluster, model, settings)
    est = cm.estimate(plan)
    torch_est = cm.estimate(plan.model_copy(update={"pipelines": [plan.pipelines[0].model_copy(
        update={"schedule": "1f1b"})]}))
    assert est.pipeline_s > torch_est.pipeline_s  # its sends one at a time
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    r = run_cli("train", "--plan", str(path), "--steps", "1", "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "deepspeed-1f1b" in r.stderr and "does not train with" in r.stderr
    assert not (tmp_path / "run").exists()


def test_a_deepspeed_plan_may_have_fewer_micro_batches_than_stages():
    """DeepSpeed's engine idles the steps without a micro-batch (torch's 1F1B refuses such a pipeline)."""
    from hetrain.cost.costmodel import CostModel

    model, cluster, settings = _a100_v100(2)
    stages = _stages("a", "A100-80G", [0, 2, 4, 6, 8])
    for schedule in ("deepspeed-1f1b", "1f1b"):
        plan = Plan(model=model, cluster="c", global_batch_size=2, micro_batch_size=1, tp=1, training=settings,
                    pipelines=[PipelinePlan(num_microbatches=2, stages=stages, schedule=schedule)])
        if schedule == "1f1b":
            with pytest.raises(HetrainError, match="2 micro-batches for 4 stages"):
                validate_plan_structure(plan)
            continue
        validate_plan_structure(plan)
        assert CostModel(cluster, model, settings).estimate(plan).pipeline_s > 0
