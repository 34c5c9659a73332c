"""Each GPU in its own number format: the catalog says which formats a type has, the plan writes each stage's."""

from __future__ import annotations

import pytest

from hetrain.config import RunConfig
from hetrain.errors import HetrainError
from hetrain.spec.catalog import CATALOG
from hetrain.spec.specs import ClusterSpec, TrainingSettings, load_cluster, load_model
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
