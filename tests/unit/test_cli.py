"""The `hetrain plan` and `hetrain estimate` commands, end to end in a subprocess."""

import json
from tests.helpers import EXAMPLES


def test_plan_compare_prints_table_and_writes_plan(cli, tmp_path):
    out_file = tmp_path / "plan.json"
    r = cli("plan", "--cluster", str(EXAMPLES / "clusters/paper-12gpu.yaml"), "--model",
            str(EXAMPLES / "models/gpt-6.7b.yaml"), "--global-batch-size", "128", "--compare", "--out", str(out_file))
    assert r.returncode == 0, r.stderr
    for word in ("hetrain", "megatron", "whale", "tokens/s", "vs megatron", "useful work"):
        assert word in r.stdout
    assert "these times are analytic estimates" in r.stderr and "not measured" in r.stderr  # no --profile
    plan = json.loads(out_file.read_text())
    assert plan["schema"] == "hetrain.plan/v1"
    for key in ("model", "cluster", "global_batch_size", "micro_batch_size", "tp", "pipelines", "predicted", "solver"):
        assert key in plan
    assert plan["predicted"]["measured"] is False  # no --profile: the plan says so, and `hetrain train` too
    launch = cli("train", "--plan", str(out_file), "--print-launch", "--run-dir", str(tmp_path / "run"))
    assert launch.returncode == 0, launch.stderr
    assert "note: the plan's predicted times: these times are analytic estimates" in launch.stderr
    assert set(plan["solver"]) >= {"planner", "status", "gap", "wall_s"}
    stage = plan["pipelines"][0]["stages"][0]
    assert set(stage) <= {"devices", "gpu", "layers", "recompute", "optimizer_state", "in_flight"} and "recompute" in stage

    est = cli("estimate", "--plan", str(out_file), "--cluster", str(EXAMPLES / "clusters/paper-12gpu.yaml"), "--json")
    assert est.returncode == 0, est.stderr
    pred = json.loads(est.stdout)
    assert abs(pred["iteration_time_s"] - plan["predicted"]["iteration_time_s"]) < 1e-4
    assert pred["fits"] is True
    shown = cli("estimate", "--plan", str(out_file), "--cluster", str(EXAMPLES / "clusters/paper-12gpu.yaml"))
    assert shown.returncode == 0, shown.stderr
    assert "of the cluster's compute capacity" in " ".join(shown.stdout.split())


def test_plan_json_and_planner_choice(cli):
    r = cli("plan", "--cluster", str(EXAMPLES / "clusters/paper-12gpu.yaml"), "--model",
            str(EXAMPLES / "models/gpt-6.7b.yaml"), "--global-batch-size", "64", "--planner", "megatron", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["solver"]["planner"] == "megatron"


def test_plan_with_bf16_gradients_records_them_and_syncs_in_half_the_time(cli):
    """--grad-reduce bf16: the plan says so (training then reduces in bf16) and its sync is priced at half the bytes."""
    args = ("plan", "--cluster", str(EXAMPLES / "clusters/paper-12gpu.yaml"), "--model",
            str(EXAMPLES / "models/gpt-6.7b.yaml"), "--global-batch-size", "64", "--planner", "megatron", "--json")
    fp32, bf16 = (json.loads(cli(*args, *extra).stdout) for extra in ((), ("--grad-reduce", "bf16")))
    assert fp32["training"]["grad_reduce"] == "fp32" and bf16["training"]["grad_reduce"] == "bf16"
    assert bf16["predicted"]["sync_and_optimizer_s"] < fp32["predicted"]["sync_and_optimizer_s"]
    bad = cli(*args, "--grad-reduce", "fp16")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --grad-reduce: expected input should be 'fp32' or 'bf16', got 'fp16'"]


def test_estimate_rejects_bad_hand_written_plans(cli, tmp_path):
    cluster = str(EXAMPLES / "clusters/paper-12gpu.yaml")
    model = {"name": "m", "num_layers": 4, "hidden_size": 1024, "num_heads": 8, "seq_length": 512,
             "vocab_size": 1000}
    base = {"schema": "hetrain.plan/v1", "model": model, "cluster": "paper-12gpu", "global_batch_size": 8,
            "micro_batch_size": 1, "tp": 1}
    cases = [
        ([{"num_microbatches": 8, "stages": [{"devices": ["a100/0"], "gpu": "A100-80G", "layers": [0, 3]}]}],
         "stages cover blocks [0, 3) but m has 4"),
        ([{"num_microbatches": 8, "stages": [{"devices": ["a100/9"], "gpu": "A100-80G", "layers": [0, 4]}]}],
         "device 'a100/9' is not in cluster"),
        ([{"num_microbatches": 8, "stages": [{"devices": ["v100/0"], "gpu": "A100-80G", "layers": [0, 4]}]}],
         "is a V100-32G, but the stage says A100-80G"),
        ([{"num_microbatches": 5, "stages": [{"devices": ["a100/0"], "gpu": "A100-80G", "layers": [0, 4]}]}],
         "pipelines process 5 micro-batches"),
        ([{"num_microbatches": 4, "stages": [{"devices": ["a100/0"], "gpu": "A100-80G", "layers": [0, 4]}]},
          {"num_microbatches": 4, "stages": [{"devices": ["a100/0"], "gpu": "A100-80G", "layers": [0, 4]}]}],
         "used more than once"),
    ]
    for pipelines, expected in cases:
        p = tmp_path / "p.json"
        p.write_text(json.dumps({**base, "pipelines": pipelines}))
        r = cli("estimate", "--plan", str(p), "--cluster", cluster)
        assert r.returncode == 2, (expected, r.stdout, r.stderr)
        assert expected in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_estimate_reports_memory_overflow(cli, tmp_path):
    plan = {"schema": "hetrain.plan/v1",
            "model": {"name": "gpt-13b", "num_layers": 40, "hidden_size": 5120, "num_heads": 40, "seq_length": 2048,
                      "vocab_size": 50257},
            "cluster": "paper-12gpu", "global_batch_size": 8, "micro_batch_size": 1, "tp": 1,
            "pipelines": [{"num_microbatches": 8, "stages": [{"devices": ["rtx/0"], "gpu": "RTX3090", "layers": [0, 40]}]}]}
    p = tmp_path / "p.json"
    p.write_text(json.dumps(plan))
    r = cli("estimate", "--plan", str(p), "--cluster", str(EXAMPLES / "clusters/paper-12gpu.yaml"))
    assert r.returncode == 1
    assert "device rtx/0 needs" in r.stderr and "has 24.0 GB" in r.stderr


def test_an_error_that_looks_like_markup_prints_as_it_is(cli, tmp_path):
    """Paths and gloo's errors ("[/.../pair.cc:553]") are not rich markup: one line, exit 2, no MarkupError."""
    odd = tmp_path / "x[/gloo]" / "plan.json"
    r = cli("estimate", "--plan", str(odd), "--cluster", str(EXAMPLES / "clusters/paper-12gpu.yaml"))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"error: {odd}: file not found"], r.stderr


def test_help_and_the_plan_table_fit_80_columns_whole(tmp_path):
    """At 80 columns no line is longer, no option's name and no number is cut ('…')."""
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT

    def run(*args):
        env = {**os.environ, "COLUMNS": "80", "NO_COLOR": "1"}
        r = subprocess.run([sys.executable, "-m", "hetrain", *args], capture_output=True, text=True, cwd=ROOT,
                           env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        assert all(len(line) <= 80 for line in r.stdout.splitlines()), r.stdout
        assert "…" not in r.stdout, r.stdout
        return r.stdout

    helped = run("plan", "--help")
    for option in ("--global-batch-size", "--micro-batch-size", "--no-recompute", "--time-limit", "--compare"):
        assert option in helped
    table = run("plan", "--cluster", str(EXAMPLES / "clusters/paper-3types.yaml"), "--model",
                str(EXAMPLES / "models/gpt-6.7b.yaml"), "--global-batch-size", "64", "--compare", "--time-limit", "5")
    for cell in ("RTX3090", "rtx/{0,1}", "26.3/80", "131.6", "sharded", "vs", "megatron", "pipelines=2"):
        assert cell in table
