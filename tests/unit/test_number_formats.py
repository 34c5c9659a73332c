"""Each GPU in its own number format: the catalog says which formats a type has, the plan writes each stage's."""

from __future__ import annotations

import pytest

from hetrain.config import RunConfig, describe_precision
from hetrain.cost.costmodel import CostModel
from hetrain.cost.formats import block_forward_s, fp8_weight_copy_bytes
from hetrain.errors import HetrainError
from hetrain.plan.schema import Plan, validate_plan, validate_plan_structure
from hetrain.profiling.profile import Profile, ProfileEntry
from hetrain.spec.arithmetic import head_forward_flops
from hetrain.spec.catalog import CATALOG
from hetrain.spec.specs import GB, ClusterSpec, TrainingSettings, load_cluster, load_model
from solver.planners.registry import make_plan
from tests.helpers import EXAMPLES, run_cli

MODEL = load_model(EXAMPLES / "models" / "gpt-6.7b.yaml")


def _formats(plan) -> dict[str, set[str | None]]:
    seen: dict[str, set[str | None]] = {}
    for pipe in plan.pipelines:
        for stage in pipe.stages:
            seen.setdefault(stage.gpu, set()).add(stage.precision)
    return seen


def test_volta_and_turing_have_no_bf16_and_compute_in_fp16_at_their_tensor_rate():
    for name in ("V100-16G", "V100-32G", "T4"):
        gpu = CATALOG[name]
        assert gpu.format_for("bf16") == "fp16" and gpu.achievable_flops("bf16") == gpu.achievable_flops("fp16")
        forced = gpu.without_tensor_cores_for("bf16")  # bf16 forced onto it: the CUDA cores' rate
        assert forced.achievable_flops("bf16") == pytest.approx(gpu.achievable_flops("fp32"))
    assert CATALOG["A100-80G"].format_for("bf16") == "bf16"


def test_paper_mix_plans_v100_stages_in_fp16_and_the_rest_in_the_plans_bf16():
    cluster = load_cluster(EXAMPLES / "clusters" / "paper-3types.yaml")
    plan = make_plan("hetrain", cluster, MODEL, TrainingSettings(global_batch_size=128)).plan
    formats = _formats(plan)
    assert formats.pop("V100-32G") == {"fp16"}
    assert formats and all(f == {None} for f in formats.values())  # the plan's bf16, unwritten as before


def test_a_t4_only_cluster_plans_fp16_and_the_table_says_what_bf16_everywhere_would_cost(tmp_path):
    cluster = ClusterSpec.model_validate({"name": "t4s", "inter_node_bandwidth_gbps": 25,
                                          "nodes": [{"name": "t", "gpu": "T4", "count": 4,
                                                     "intra_node_bandwidth_gbps": 16}]})
    model = load_model(EXAMPLES / "models" / "gpt-small.yaml")
    plan = make_plan("hetrain", cluster, model, TrainingSettings(global_batch_size=16)).plan
    assert _formats(plan) == {"T4": {"fp16"}}
    (tmp_path / "t4.yaml").write_text(cluster.model_dump_json())
    r = run_cli("plan", "--cluster", str(tmp_path / "t4.yaml"), "--model", str(EXAMPLES / "models" / "gpt-small.yaml"),
                "--global-batch-size", "16", "--no-compare")
    assert r.returncode == 0, r.stderr
    assert "T4 in fp16 (no bf16 tensor cores)" in " ".join(r.stdout.split())
    with pytest.raises(HetrainError, match="^`precision` bf16: the plan.s T4 stage computes in fp16"):
        RunConfig(plan="p.json", precision="bf16").resolved_precision(plan, "cuda", plan.pipelines[0].stages[0])
    plan.write(tmp_path / "plan.json")  # forced from the command line: one line, exit 2, before any process
    r = run_cli("train", "--plan", str(tmp_path / "plan.json"), "--precision", "bf16", "--steps", "1",
                "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2 and "the plan's T4 stage computes in fp16" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


# -- fp8 under the `fastest` policy -------------------------------------------------------------------------------
H100_A100 = ClusterSpec.model_validate({"name": "h100-a100", "inter_node_bandwidth_gbps": 25, "nodes": [
    {"name": "h100", "gpu": "H100-SXM", "count": 4, "intra_node_bandwidth_gbps": 450},
    {"name": "a100", "gpu": "A100-80G", "count": 4, "intra_node_bandwidth_gbps": 300}]})


def _without_formats(plan):
    """The plan's layout with every stage in the plan's precision (what the bf16 policy prices it at)."""
    return plan.model_copy(update={"pipelines": [
        pipe.model_copy(update={"stages": [s.model_copy(update={"precision": None}) for s in pipe.stages]})
        for pipe in plan.pipelines]})


@pytest.mark.parametrize("recompute", ["auto", "full"])  # auto: none here, memory allowing
def test_fastest_puts_fp8_on_exactly_the_h100s_each_priced_faster_in_its_own_memory(recompute):
    fastest = TrainingSettings(global_batch_size=32, formats="fastest", activation_recompute=recompute)
    result = make_plan("hetrain", H100_A100, MODEL, fastest)
    plan = result.plan
    assert plan.tp == 1 and _formats(plan) == {"H100-SXM": {"fp8"}, "A100-80G": {None}}
    assert plan.training.formats == "fastest"
    bf16 = TrainingSettings(global_batch_size=32, activation_recompute=recompute)
    in_bf16 = CostModel(H100_A100, MODEL, bf16).estimate(_without_formats(plan))
    assert result.estimate.iteration_time_s < in_bf16.iteration_time_s
    for pipe, got, was in zip(plan.pipelines, result.estimate.pipelines, in_bf16.pipelines):
        for k, (stage, fp8_s, bf16_s) in enumerate(zip(pipe.stages, got.stage_s, was.stage_s)):
            d = stage.devices[0]
            mem_fp8, mem_bf16 = result.estimate.peak_memory_gb[d], in_bf16.peak_memory_gb[d]
            if stage.gpu == "A100-80G":
                assert (fp8_s, mem_fp8) == (bf16_s, mem_bf16)
                continue
            assert fp8_s < bf16_s / 1.1  # the blocks' linear layers at the fp8 rate
            # torchao saves the fp32 parameter where autocast saves a 16-bit copy per micro-batch (kept without
            # recompute, rebuilt with it), more than the largest linear's fp8 casts take for a moment
            blocks = stage.layers[1] - stage.layers[0]
            copies_gb = fp8_weight_copy_bytes(MODEL, 1) / GB
            held = pipe.in_flight(k) + pipe.weight_pending(k)  # ZB-H1 also holds those waiting for their W
            assert mem_bf16 - blocks * held * copies_gb <= mem_fp8 < mem_bf16


def test_the_bf16_policy_plans_as_before_given_or_not():
    base = make_plan("hetrain", H100_A100, MODEL, TrainingSettings(global_batch_size=32)).plan
    given = make_plan("hetrain", H100_A100, MODEL, TrainingSettings(global_batch_size=32, formats="bf16")).plan
    assert _formats(base) == {"H100-SXM": {None}, "A100-80G": {None}}

    def unsolved(p):
        return p.model_copy(update={"solver": None}).to_json()

    assert unsolved(given) == unsolved(base) and '"formats"' not in base.to_json()


def test_fastest_leaves_volta_and_turing_in_fp16_and_ampere_in_bf16():
    cluster = load_cluster(EXAMPLES / "clusters" / "paper-3types.yaml")
    plan = make_plan("hetrain", cluster, MODEL, TrainingSettings(global_batch_size=128, formats="fastest")).plan
    formats = _formats(plan)
    assert formats.pop("V100-32G") == {"fp16"} and all(f == {None} for f in formats.values())


def test_a_custom_type_declaring_fp8_in_the_cluster_file_gets_fp8_stages(tmp_path):
    (tmp_path / "ada.yaml").write_text(
        "name: ada\ninter_node_bandwidth_gbps: 25\n"
        "gpu_types:\n  MyAda: {tflops: 200, fp8_tflops: 400, memory_gb: 48, memory_bandwidth_gbps: 900}\n"
        "nodes:\n  - {name: n, gpu: MyAda, count: 4, intra_node_bandwidth_gbps: 64}\n")
    cluster = load_cluster(tmp_path / "ada.yaml")
    assert cluster.gpu_type("MyAda").format_for("bf16", "fastest") == "fp8"
    assert cluster.gpu_type("MyAda").format_for("bf16", "fastest", tp=2) == "bf16"  # fp8 runs without TP
    model = load_model(EXAMPLES / "models" / "gpt-small.yaml")
    plan = make_plan("hetrain", cluster, model, TrainingSettings(global_batch_size=16, formats="fastest",
                                                                  tp_degrees=[1])).plan
    assert _formats(plan) == {"MyAda": {"fp8"}}


def test_the_fp8_rate_reproduces_torchtitans_float8_speedup_on_llama_3_1_8b():
    """torchtitan, Llama 3.1 8B on H100, compiled, local batch 2 x 8192: 8,532 / 6,667 tokens/s in fp8 / bf16
    (``FP8_LINEAR_EFFICIENCY`` is fitted to it): the cost model's blocks and head reproduce it within 2 %."""
    model = load_model(EXAMPLES / "models" / "llama-3-8b.yaml")  # Llama 3.1 8B's shape, 8192 tokens
    g = CATALOG["H100-SXM"]

    def step_s(fmt: str) -> float:
        return (model.num_layers * block_forward_s(model, g, "bf16", fmt, 1, 2)
                + head_forward_flops(model, 2) / g.achievable_flops("bf16"))

    assert step_s("bf16") / step_s("fp8") == pytest.approx(8532 / 6667, rel=0.02)
    assert g.achievable_flops("fp8") == pytest.approx(2 * g.achievable_flops("bf16"), rel=1e-3)  # 1,979 vs 989 dense


def test_fp8_stages_are_refused_under_tp_and_on_gpus_without_fp8_in_one_line():
    plan = make_plan("hetrain", H100_A100, MODEL, TrainingSettings(global_batch_size=32, formats="fastest")).plan
    data = plan.model_dump(mode="json", by_alias=True)
    a100 = next((p, k) for p, pipe in enumerate(plan.pipelines) for k, s in enumerate(pipe.stages)
                if s.gpu == "A100-80G")
    data["pipelines"][a100[0]]["stages"][a100[1]]["precision"] = "fp8"
    with pytest.raises(HetrainError, match=rf"^pipelines\[{a100[0]}\].stages\[{a100[1]}\]: precision fp8 on a "
                                           r"A100-80G, which has no fp8 tensor cores"):
        validate_plan(Plan.model_validate(data), H100_A100)
    with pytest.raises(HetrainError, match=r"precision fp8 runs without tensor parallelism \(tp 1: .*the plan has "
                                           r"tp 2$"):
        validate_plan_structure(Plan.model_validate({**data, "tp": 2, "pipelines": [
            {"num_microbatches": 32, "stages": [{"devices": ["h100/0", "h100/1"], "gpu": "H100-SXM",
                                                  "layers": [0, MODEL.num_layers], "precision": "fp8"}]}]}))


def test_an_fp8_stage_autocasts_in_bf16_with_fp8_linears_unless_a_precision_is_forced():
    plan = make_plan("hetrain", H100_A100, MODEL, TrainingSettings(global_batch_size=32, formats="fastest")).plan
    stages = [s for p in plan.pipelines for s in p.stages]
    h100 = next(s for s in stages if s.gpu == "H100-SXM")
    a100 = next(s for s in stages if s.gpu == "A100-80G")
    config = RunConfig(plan="p.json")
    assert config.resolved_precision(plan, "cuda", h100) == "bf16"
    assert config.stage_fp8(h100) and not config.stage_fp8(a100)
    forced = RunConfig(plan="p.json", precision="bf16")
    assert forced.resolved_precision(plan, "cuda", h100) == "bf16" and not forced.stage_fp8(h100)
    assert RunConfig(plan="p.json", fp8=True).stage_fp8(a100)  # --fp8: every stage, as before
    assert "fp8 on the H100-SXM stages" in describe_precision(config, plan)


def test_plan_formats_fastest_shows_the_fp8_stages_and_says_when_there_is_none(tmp_path):
    (tmp_path / "mixed.yaml").write_text(H100_A100.model_dump_json())
    gpt = str(EXAMPLES / "models" / "gpt-small.yaml")
    r = run_cli("plan", "--cluster", str(tmp_path / "mixed.yaml"), "--model", gpt, "--global-batch-size", "16",
                "--formats", "fastest", "--tp", "1")
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert "H100-SXM fp8" in out and "H100-SXM in fp8 (fp8 tensor cores" in out
    assert "this plan in bf16 everywhere would take" in out
    t4s = ClusterSpec.model_validate({"name": "t4s", "inter_node_bandwidth_gbps": 25, "nodes": [
        {"name": "t", "gpu": "T4", "count": 2, "intra_node_bandwidth_gbps": 16}]})
    (tmp_path / "t4.yaml").write_text(t4s.model_dump_json())
    r = run_cli("plan", "--cluster", str(tmp_path / "t4.yaml"), "--model", gpt, "--global-batch-size", "16",
                "--formats", "fastest")
    assert r.returncode == 0, r.stderr
    assert "note: --formats fastest: no GPU type of cluster 't4s' has fp8 tensor cores" in r.stderr


def test_a_profiles_bf16_times_price_an_fp8_stage_at_the_analytic_fp8_ratio():
    """The profiler measures bf16: an fp8 stage takes its GPU's measured block times x the cost model's fp8 / bf16
    ratio of a block, the head and embedding as measured."""
    entry = ProfileEntry(tp=1, micro_batch_size=1, block_forward_s=0.01, block_backward_s=0.02,
                         head_forward_s=0.003, head_backward_s=0.006, block_activation_bytes=10**8)
    profile = Profile(model=MODEL, devices={"H100-SXM": [entry]}, activation_recompute=False)
    costs = {formats: CostModel(H100_A100, MODEL, TrainingSettings(global_batch_size=32, formats=formats,
                                                                    activation_recompute="none"), profile)
             .unit_costs("H100-SXM", 450, 1, 1) for formats in ("bf16", "fastest")}
    g = CATALOG["H100-SXM"]
    ratio = block_forward_s(MODEL, g, "bf16", "fp8", 1, 1) / block_forward_s(MODEL, g, "bf16", "bf16", 1, 1)
    assert costs["bf16"].block_s == pytest.approx(0.03)
    assert costs["fastest"].block_s == pytest.approx(0.03 * ratio) and ratio < 0.8
    assert costs["fastest"].head_s == costs["bf16"].head_s
    assert costs["bf16"].block_act_bytes - costs["fastest"].block_act_bytes == fp8_weight_copy_bytes(MODEL, 1)
