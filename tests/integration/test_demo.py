"""The README's main job, end to end: `python -m flows.demo` (what `make demo` runs after setup).

On one machine here; the test-bed variant's parts (per-node training, the spot watcher, the
event-triggered per-node recovery) are tested in test_netbed_flows.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT


def test_demo_trains_preempts_recovers_and_finishes(tmp_path: Path):
    env = {**os.environ, "COLUMNS": "160", "NO_COLOR": "1"}
    # the demo's own defaults are 50 steps, the notice at step 18; fewer here to keep the suite short
    r = subprocess.run([sys.executable, "-m", "flows.demo", "--one-machine", "--home", str(tmp_path / "demo"),
                        "--steps", "20", "--preempt-at-step", "8"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "5/5 done in" in out and "Prefect UI: http://127.0.0.1:" in out
    assert "(= checkpoint + 1), trained to step 19 of 19" in out
    assert "recovered plan" in out and "slow/" not in out.split("recovered plan")[1].splitlines()[0]
    for phase in ("replan", "fetch", "load", "first step"):
        assert phase in out


def test_the_bed_demo_plans_a_pipeline_on_the_spot_node():
    """`make demo` on the test bed preempts the spot node, so the plan it trains under must use it: with
    gpt-tiny's measured fixed costs the planner takes micro-batches of 4, and the batch must split over
    all three equal nodes (16 sequences did not: the planner rightly left the spot node out)."""
    import torch
    import yaml

    from flows.demo import BED_GLOBAL_BATCH, BED_NODES
    from hetrain.profiling.profiler import gpus_from_cluster, profile_model
    from hetrain.spec.specs import ClusterSpec, TrainingSettings, load_model
    from solver.planners.registry import make_plan

    torch.set_num_threads(1)  # as the training ranks
    types = yaml.safe_load((ROOT / "examples" / "clusters" / "cpu-emulated.yaml").read_text())
    cluster = ClusterSpec.model_validate({"name": "bed", "nodes": BED_NODES,
                                          **{k: v for k, v in types.items() if k not in ("name", "nodes")}})
    model = load_model(ROOT / "examples" / "models" / "gpt-tiny.yaml")
    settings = TrainingSettings(global_batch_size=BED_GLOBAL_BATCH, precision="fp32")
    profile = profile_model(model, gpus=gpus_from_cluster(cluster), micro_batch_sizes=settings.micro_batch_sizes,
                            tp_degrees=[1], activation_recompute=False)
    plan = make_plan("hetrain", cluster, model, settings, profile).plan
    nodes = {d.split("/")[0] for p in plan.pipelines for st in p.stages for d in st.devices}
    assert "spot" in nodes, plan.pipelines
