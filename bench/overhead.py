"""Runtime overhead: hetrain vs plain PyTorch DDP on a homogeneous 2-process plan (CPU, gloo).

On a homogeneous plan (2 pipelines, one single-device stage each) hetrain does what DDP does,
through heavier machinery: a 1F1B schedule object, the stage meter's hooks, one flat gradient
all-reduce after backward, an all-reduce for the grad norm and loss, and a metrics gather per
step. This measures what that machinery costs. Both sides train the same GPT (same recompute
setting) on the same data, with the same micro-batch size, micro-batches per rank (gradient
accumulation), AdamW, clipping to 1.0 and one thread per rank; they run alternately because
the machine is noisy. Target: hetrain at most 5 % slower. Prints a table, writes
bench/results/overhead.json.

Two times per step, each the median over the steps after the warm-up:
* step: what each side times itself, data loading through the optimizer step, slowest rank;
* wall: the interval between consecutive step ends on rank 0, so it includes whatever a side
  does between steps (hetrain: gathering every rank's metrics and writing the JSONL line).
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
from contextlib import nullcontext
from pathlib import Path

from _common import print_table, write_results

import torch

from hetrain.config import RunConfig
from hetrain.plan.layout import build_layout
from hetrain.plan.schema import Plan
from hetrain.runtime.data import PipelineSampler, TokenSource
from hetrain.runtime.launch import free_port, launch
from hetrain.runtime.model import GPT, lm_loss
from hetrain.spec.specs import ModelSpec

TARGET = 1.05
PROCESSES = 2


def homogeneous_plan(spec: ModelSpec, global_batch: int, micro_batch: int) -> Plan:
    """Two pipelines, each one stage of one device holding every block, equal micro-batch counts."""
    per_pipeline = global_batch // (PROCESSES * micro_batch)
    return Plan.model_validate({
        "schema": "hetrain.plan/v1", "model": spec.model_dump(), "cluster": "bench",
        "global_batch_size": global_batch, "micro_batch_size": micro_batch, "tp": 1,
        "pipelines": [{"num_microbatches": per_pipeline,
                       "stages": [{"devices": [f"n/{i}"], "gpu": "cpu", "layers": [0, spec.num_layers]}]}
                      for i in range(PROCESSES)],
    })


# --------------------------------------------------------------------------- the DDP side


def ddp_worker(config_path: str) -> None:
    """One rank of the baseline (started by ``accelerate launch``): writes ``rank{R}.jsonl``."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    cfg = json.loads(Path(config_path).read_text())
    dist.init_process_group("gloo")
    try:
        torch.set_num_threads(cfg["threads_per_rank"])
        rank, world = dist.get_rank(), dist.get_world_size()
        spec = ModelSpec.model_validate(cfg["model"])
        global_batch, micro_batch = cfg["global_batch_size"], cfg["micro_batch_size"]
        per_rank = global_batch // world
        num_micro = per_rank // micro_batch
        model = GPT(spec, recompute=cfg["activation_recompute"])
        model.init_weights(cfg["seed"])
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
        source = TokenSource(spec.seq_length, spec.vocab_size, seed=cfg["seed"])
        sampler = PipelineSampler(source, global_batch, rank * per_rank, per_rank)
        # DDP averages gradients over ranks, so scale by world: the gradient of the global-batch mean, as hetrain's.
        scale = micro_batch / global_batch * world
        with open(Path(cfg["out_dir"]) / f"rank{rank}.jsonl", "w") as out:
            for step in range(cfg["steps"]):
                started = time.perf_counter()
                inputs, targets = sampler.batch(step)
                loss_sum = 0.0
                for i in range(num_micro):
                    mb = slice(i * micro_batch, (i + 1) * micro_batch)
                    with ddp.no_sync() if i < num_micro - 1 else nullcontext():
                        loss = lm_loss(ddp(inputs[mb]), targets[mb], scale=scale)
                        loss.backward()
                    loss_sum += float(loss.detach())
                computed = time.perf_counter()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_grad_norm"])
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                ended = time.perf_counter()
                out.write(json.dumps({"step": step, "step_time_s": ended - started,
                                      "compute_s": computed - started, "loss": loss_sum / world,
                                      "time": time.time()}) + "\n")
                out.flush()
    finally:
        dist.destroy_process_group()


def run_ddp(args: argparse.Namespace, spec: ModelSpec, run_dir: Path) -> list[dict]:
    """Launch the baseline like hetrain launches its workers; per-step records like hetrain's."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = {"model": spec.model_dump(), "global_batch_size": args.global_batch, "micro_batch_size": args.micro_batch,
           "steps": args.steps, "seed": 0, "lr": 1e-3, "weight_decay": 0.0, "max_grad_norm": 1.0,
           "activation_recompute": args.recompute, "threads_per_rank": 1, "out_dir": str(run_dir)}
    config_path = run_dir / "ddp.json"
    config_path.write_text(json.dumps(cfg))
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1",
            "--num_processes", str(PROCESSES), "--main_process_port", str(free_port()), "--monitor_interval", "0.2",
            str(Path(__file__).resolve()), "--ddp-worker", str(config_path)]
    log = run_dir / "launch.log"
    with log.open("w") as log_f:
        proc = subprocess.run(argv, stdout=log_f, stderr=subprocess.STDOUT, env={**os.environ})
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"DDP baseline failed (exit {proc.returncode}):\n{tail}")
    ranks = [[json.loads(line) for line in (run_dir / f"rank{r}.jsonl").read_text().splitlines()]
             for r in range(PROCESSES)]
    return [{"step": rows[0]["step"], "step_time_s": max(r["step_time_s"] for r in rows),
             "loss": sum(r["loss"] for r in rows), "time": rows[0]["time"]} for rows in zip(*ranks)]


# --------------------------------------------------------------------------- the hetrain side


def run_hetrain(args: argparse.Namespace, spec: ModelSpec, run_dir: Path) -> list[dict]:
    plan = homogeneous_plan(spec, args.global_batch, args.micro_batch)
    plan.write(run_dir / "plan.json")
    config = RunConfig(plan=str(run_dir / "plan.json"), steps=args.steps, seed=0, optimizer="adamw", lr=1e-3,
                       weight_decay=0.0, max_grad_norm=1.0, activation_recompute=args.recompute,
                       threads_per_rank=1)
    return launch(config, build_layout(plan), run_dir / "run")


# --------------------------------------------------------------------------- measuring


def steady(records: list[dict], warmup: int) -> tuple[list[float], list[float]]:
    """Step times and wall intervals of the steps after the warm-up."""
    records = sorted(records, key=lambda r: r["step"])
    step_s = [r["step_time_s"] for r in records[warmup:]]
    times = [r["time"] for r in records]
    wall_s = [b - a for a, b in zip(times[warmup:], times[warmup + 1:])]
    return step_s, wall_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="first steps of each run left out of the medians")
    parser.add_argument("--repeats", type=int, default=2, help="runs per side, alternating hetrain and DDP")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--no-recompute", dest="recompute", action="store_false",
                        help="keep activations (default: recompute, as the plan's training settings say)")
    parser.add_argument("--ddp-worker", metavar="CONFIG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ddp_worker:
        ddp_worker(args.ddp_worker)
        return
    if args.global_batch % (PROCESSES * args.micro_batch):
        parser.error(f"--global-batch must be a multiple of {PROCESSES} x --micro-batch")
    if args.steps < args.warmup + 3:
        parser.error("--steps must exceed --warmup by at least 3")

    os.environ["ACCELERATE_USE_CPU"] = "true"  # both sides on CPU with gloo, even where a GPU is present
    spec = ModelSpec(name="gpt-bench", num_layers=args.layers, hidden_size=args.hidden, num_heads=8,
                     seq_length=args.seq, vocab_size=256)
    tokens_per_step = args.global_batch * spec.seq_length
    sides = {"hetrain": run_hetrain, "ddp": run_ddp}
    samples: dict[str, dict[str, list]] = {s: {"step": [], "wall": [], "runs": [], "loss": []} for s in sides}
    with tempfile.TemporaryDirectory(prefix="hetrain-overhead-") as tmp:
        for repeat in range(args.repeats):
            for side, fn in sides.items():
                t0 = time.perf_counter()
                records = fn(args, spec, Path(tmp) / f"{side}-{repeat}")
                elapsed = time.perf_counter() - t0
                if len(records) != args.steps:
                    raise RuntimeError(f"{side}: {len(records)} step records, expected {args.steps}")
                step_s, wall_s = steady(records, args.warmup)
                s = samples[side]
                s["step"] += step_s
                s["wall"] += wall_s
                s["loss"].append(records[-1]["loss"])
                run = {"repeat": repeat, "step_ms": 1e3 * statistics.median(step_s),
                       "wall_ms": 1e3 * statistics.median(wall_s), "run_s": elapsed}
                s["runs"].append(run)
                print(f"{side} run {repeat}: step {run['step_ms']:.1f} ms, wall {run['wall_ms']:.1f} ms/step, "
                      f"final loss {records[-1]['loss']:.4f}, {elapsed:.1f} s in all", flush=True)

    rows = []
    for side, s in samples.items():
        step, wall = statistics.median(s["step"]), statistics.median(s["wall"])
        rows.append({"side": side, "runs": len(s["runs"]), "steps": len(s["step"]), "step_ms": 1e3 * step,
                     "wall_ms": 1e3 * wall, "tokens_per_s": tokens_per_step / step,
                     "wall_tokens_per_s": tokens_per_step / wall, "final_loss": statistics.mean(s["loss"]),
                     "per_run": s["runs"]})
    ddp = rows[1]
    for r in rows:
        r["step_ratio"] = r["step_ms"] / ddp["step_ms"]
        r["wall_ratio"] = r["wall_ms"] / ddp["wall_ms"]
        r["within_target"] = r["step_ratio"] <= TARGET and r["wall_ratio"] <= TARGET
        r["target_text"] = "" if r is ddp else ("yes" if r["within_target"] else "no")
    recompute = "recompute" if args.recompute else "no recompute"
    print_table(
        f"Runtime overhead vs DDP ({spec.num_layers} x {spec.hidden_size} GPT, seq {spec.seq_length}, "
        f"global batch {args.global_batch}, micro-batch {args.micro_batch}, {PROCESSES} ranks x 1 thread, gloo, "
        f"{recompute}; medians of steps {args.warmup}..{args.steps - 1} over {args.repeats} runs per side)",
        rows,
        [("side", "side"), ("step ms", "{step_ms:.1f}"), ("tokens/s", "{tokens_per_s:,.0f}"),
         ("wall ms/step", "{wall_ms:.1f}"), ("wall tokens/s", "{wall_tokens_per_s:,.0f}"),
         ("step / ddp", "{step_ratio:.3f}"), ("wall / ddp", "{wall_ratio:.3f}"),
         (f"<= {TARGET:.2f}", "target_text"), ("final loss", "{final_loss:.4f}")],
    )
    print(f"\nwrote {write_results('overhead', rows)}")


if __name__ == "__main__":
    main()
