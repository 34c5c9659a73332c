"""How long a run takes to start its ranks: hetrain's agent (workers forked preloaded) beside plain torchrun.

Why: every rank of a plain ``torchrun`` (or ``accelerate launch``) is a fresh interpreter that imports
torch, ``torch.distributed.pipelining`` and hetrain before its first step; ``hetrain.runtime.agent``
forks them from a server that imported them once. This trains the same plan (the emulated CPU
cluster's, 4 ranks, gpt-tiny, 2 steps, no checkpoints) through ``hetrain.runtime.launch.launch``
under both launchers, alternating, and reports the time to the first step's record, the whole
launch, and the CPU seconds of every process it started (launcher, server, workers).

    python bench/launch_start.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, print_table, write_results


def _plan(tmp: Path) -> Path:
    out = tmp / "plan.json"
    cluster = ROOT / "examples/clusters/cpu-emulated.yaml"
    subprocess.run([sys.executable, "-m", "hetrain", "plan", "--cluster", str(cluster),
                    "--model", str(ROOT / "examples/models/gpt-tiny.yaml"), "--global-batch-size", "8",
                    "--no-compare", "--out", str(out)], check=True, capture_output=True, cwd=ROOT)
    return out


def _torchrun(world_size: int):
    """Plain torchrun starting ``python -m hetrain.runtime.worker`` per rank, the way before the agent."""
    from hetrain.runtime.launch import MONITOR_S, NodeCommand, free_port

    def commands(config_path: Path) -> list[NodeCommand]:
        return [NodeCommand("*", {}, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                                      "--nproc-per-node", str(world_size), "--rdzv-backend", "c10d",
                                      "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", MONITOR_S,
                                      "-m", "hetrain.runtime.worker", str(config_path)])]
    return commands


def _one(plan_path: Path, run_dir: Path, launcher: str) -> dict:
    from hetrain.config import TrainOptions, build_run_config
    from hetrain.plan.layout import build_layout
    from hetrain.plan.schema import load_plan
    from hetrain.runtime.launch import launch

    layout = build_layout(load_plan(plan_path))
    config = build_run_config(run_dir, plan_path, TrainOptions(steps=2, checkpoints=False))
    first: list[float] = []
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    launch(config, layout, run_dir, on_record=lambda r: first.append(time.perf_counter()) if not first else None,
           commands=None if launcher == "agent" else _torchrun(layout.world_size))
    wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"first_step_s": first[0] - started, "wall_s": wall, "cpu_s": cpu, "ranks": layout.world_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"torchrun": [], "agent": []}
    with tempfile.TemporaryDirectory(prefix="hetrain-launch-") as tmp_str:
        tmp = Path(tmp_str)
        plan_path = _plan(tmp)
        for i in range(args.repeats):  # alternating: the machine is shared
            for launcher in runs:
                runs[launcher].append(_one(plan_path, tmp / f"{launcher}-{i}", launcher))
    rows = []
    for launcher, got in runs.items():
        rows.append({"launcher": launcher, "ranks": got[0]["ranks"],
                     **{k: statistics.median(r[k] for r in got) for k in ("first_step_s", "wall_s", "cpu_s")},
                     "runs": len(got)})
    base = rows[0]
    for r in rows:
        r["first_step_ratio"] = base["first_step_s"] / r["first_step_s"]
        r["cpu_ratio"] = base["cpu_s"] / r["cpu_s"]
    print_table("Starting a run's ranks (emulated CPU cluster, gpt-tiny, 2 steps; medians, launchers alternating)",
                rows, [("launcher", "launcher"), ("ranks", "ranks"), ("first step s", "{first_step_s:.2f}"),
                       ("whole launch s", "{wall_s:.2f}"), ("CPU s", "{cpu_s:.1f}"),
                       ("torchrun / this, first step", "{first_step_ratio:.2f}x"),
                       ("torchrun / this, CPU", "{cpu_ratio:.2f}x"), ("runs", "runs")])
    print(f"\nresults: {write_results('launch_start', rows)}")


if __name__ == "__main__":
    main()
