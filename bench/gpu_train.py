"""``hetrain train`` of a one-device plan in several modes, alternating, side by side: what checkpoints and fp8 cost.

Why: the promises a GPU user relies on are about whole runs, not parts: checkpoints every 50 steps
cost at most 2 % of the steps' time against the same run without checkpoints, and no checkpoint
(the first included) stalls training over half a second (issue 49); fp8 trains at least 1.2x the
tokens/s of bf16, both compiled, with the loss within 2 % after 50 steps (issue 50). Each mode is
the real CLI in its own process, so its start, allocator and compile are its own; modes alternate
``--repeats`` times and the medians count.

    python bench/gpu_train.py --check checkpoint   # bench/gpu/plan-llama-1.5b.json, 120 steps, every 50 vs none
    python bench/gpu_train.py --check fp8          # bench/gpu/plan-llama-3b.json, 50 steps, fp8 vs bf16, compiled

Without a GPU the same runs go on CPU with a tiny Llama (``--cpu``: the code path, not the figures; written as
``gpu_train_<check>_cpu.json``). tests/integration/test_gpu_checks.py runs both checks that way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, print_table, write_results

CHECKS = {
    # name: plan, steps, warm-up steps left out of the medians, {mode: CLI flags}
    "checkpoint": ("bench/gpu/plan-llama-1.5b.json", 120, 5,
                   {"no checkpoints": ["--no-checkpoints"],
                    "checkpoint every 50": ["--checkpoint-every", "50", "--keep", "1"]}),
    "fp8": ("bench/gpu/plan-llama-3b.json", 50, 8,
            {"bf16, compiled": ["--compile", "--no-checkpoints"],
             "fp8, compiled": ["--compile", "--fp8", "--no-checkpoints"]}),
}


# ``--cpu``: the same modes on one CPU device with a tiny Llama, to check the code path (flags, metrics, this script)
# before a lent GPU's minutes are spent on it; its figures mean nothing
CPU_CLUSTER = """name: one-cpu
inter_node_bandwidth_gbps: 1.0
gpu_types:
  cpu-dev: {tflops: 0.05, fp32_tflops: 0.05, memory_gb: 8, memory_bandwidth_gbps: 10, efficiency: 1.0}
nodes:
  - {name: n0, gpu: cpu-dev, count: 1, intra_node_bandwidth_gbps: 2.0}
"""
CPU_MODEL = """name: llama-tiny
arch: llama
num_layers: 2
hidden_size: 64
num_heads: 4
num_kv_heads: 2
ffn_hidden_size: 128
seq_length: 32
vocab_size: 256
"""


def _cpu_plan(tmp: Path) -> str:
    """The tiny Llama's plan on one CPU device, bf16 as the GPU plans (``--cpu``)."""
    (tmp / "cluster.yaml").write_text(CPU_CLUSTER)
    (tmp / "model.yaml").write_text(CPU_MODEL)
    out = tmp / "plan.json"
    done = subprocess.run([sys.executable, "-m", "hetrain", "plan", "--cluster", str(tmp / "cluster.yaml"), "--model",
                    str(tmp / "model.yaml"), "--global-batch-size", "4", "--micro-batch-size", "2", "--tp", "1",
                    "--precision", "bf16", "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"hetrain plan of the tiny Llama failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return str(out)


def _run(plan: str, steps: int, flags: list[str], run_dir: Path, timeout_s: float,
         cpu: bool = False) -> tuple[list[dict], float]:
    cmd = [sys.executable, "-m", "hetrain", "train", "--plan", plan, "--steps", str(steps), "--run-dir", str(run_dir),
           *flags]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, **({"ACCELERATE_USE_CPU": "1"} if cpu else {}),  # CPU on a GPU host too
                               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                        os.environ.get("PYTHONPATH")]))})
    wall_s = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], wall_s


def summarize(records: list[dict], warmup: int, tokens_per_step: int) -> dict:
    """Medians after warm-up; the checkpoints' stalls (all of them, the first included) and commits."""
    kept = records[warmup:]
    step_s = [r["step_time_s"] for r in kept]
    stalls = [r["checkpoint_s"] for r in records if "checkpoint_s" in r]
    commits = [c["commit_s"] for r in records for c in r.get("checkpoints_committed", [])]
    busy_s = sum(r["step_time_s"] + r.get("checkpoint_s", 0.0) for r in kept)  # the last one's wait included
    return {"step_s": statistics.median(step_s), "tokens_per_s": tokens_per_step / statistics.median(step_s),
            "loop_s": busy_s, "stalls": [round(s, 3) for s in stalls], "max_stall_s": max(stalls, default=0.0),
            "commits": [round(c, 2) for c in commits], "skipped": sum("checkpoint_skipped" in r for r in records),
            "waited_s": sum(r.get("checkpoint_waited_s", 0.0) for r in records),
            "final_loss": records[-1]["loss"], "peak_gb": max(x["peak_memory_gb"] for r in kept for x in r["ranks"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", choices=sorted(CHECKS), required=True)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--steps", type=int, default=None, help="default: the check's")
    ap.add_argument("--plan", default=None, help="default: the check's (bench/gpu/)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    ap.add_argument("--cpu", action="store_true", help="a tiny Llama on one CPU device: the code path, not the figures")
    args = ap.parse_args()
    plan_path, steps, warmup, modes = CHECKS[args.check]
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="hetrain-gputrain-", dir=os.environ.get("HETRAIN_BENCH_TMP")) as tmp:
        plan_path = _cpu_plan(Path(tmp)) if args.cpu else plan_path
        plan_path, steps = args.plan or plan_path, args.steps or steps
        plan = json.loads((ROOT / plan_path).read_text())
        tokens_per_step = plan["global_batch_size"] * plan["model"]["seq_length"]
        for rep in range(args.repeats):
            for mode, flags in modes.items():
                run_dir = Path(tmp) / f"{args.check}-{rep}-{len(results[mode])}-{mode.split(',')[0].replace(' ', '-')}"
                records, wall_s = _run(plan_path, steps, flags, run_dir, args.timeout_s, args.cpu)
                row = {**summarize(records, min(warmup, steps // 2), tokens_per_step), "wall_s": wall_s}
                results[mode].append(row)
                print(f"repeat {rep} {mode}: {json.dumps(row)}", flush=True)
    base = next(iter(modes))
    base_loop = statistics.median(r["loop_s"] for r in results[base])
    base_tps = statistics.median(r["tokens_per_s"] for r in results[base])
    base_loss = statistics.median(r["final_loss"] for r in results[base])
    rows = []
    for mode, runs in results.items():
        loop_s = statistics.median(r["loop_s"] for r in runs)
        tps = statistics.median(r["tokens_per_s"] for r in runs)
        loss = statistics.median(r["final_loss"] for r in runs)
        rows.append({"mode": mode, "step_s": statistics.median(r["step_s"] for r in runs), "tokens_per_s": tps,
                     "vs_base_tokens": tps / base_tps, "loop_s": loop_s, "loop_vs_base": loop_s / base_loop - 1.0,
                     "max_stall_s": max(r["max_stall_s"] for r in runs), "stalls": [r["stalls"] for r in runs],
                     "commits": [r["commits"] for r in runs], "skipped": sum(r["skipped"] for r in runs),
                     "waited_s": sum(r["waited_s"] for r in runs), "final_loss": loss,
                     "loss_vs_base": loss / base_loss - 1.0, "peak_gb": max(r["peak_gb"] for r in runs),
                     "runs": runs})
    print_table(f"{args.check}: hetrain train, {plan['model']['name']}, {steps} steps, global batch "
                f"{plan['global_batch_size']} x {plan['model']['seq_length']} tokens, medians over {args.repeats} "
                f"run(s) per mode after {warmup} warm-up steps", rows,
                [("mode", "mode"), ("step s", "{step_s:.3f}"), ("tokens/s", "{tokens_per_s:,.0f}"),
                 (f"vs {base}", "{vs_base_tokens:.3f}x"), ("steps' time s (stalls incl.)", "{loop_s:.1f}"),
                 ("cost vs base", "{loop_vs_base:+.1%}"), ("max stall s", "{max_stall_s:.3f}"),
                 ("skipped", "{skipped}"), ("final loss", "{final_loss:.4f}"), ("loss vs base", "{loss_vs_base:+.2%}"),
                 ("peak GB", "{peak_gb:.1f}")])
    # a CPU run's figures never take the place of a GPU's
    print(f"\nresults: {write_results(f'gpu_train_{args.check}' + ('_cpu' if args.cpu else ''), rows)}")


if __name__ == "__main__":
    main()
