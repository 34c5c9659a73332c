"""What a checkpoint costs the training loop, with and without buddy replication.

The ~230 MB GPT of bench/recovery.py on four one-device nodes checkpoints after every step.
Runs alternate between plain local checkpoints and ``replicate: true`` (each node also pulls
the previous node's new shards, verified, before the commit), ``--repeats`` times each. The
median ``checkpoint_s`` of the steps (the time the ranks spend in ``save``) is compared;
ratios, not absolute times, are what this shared 2-core machine can tell.

    python bench/checkpoint_cost.py [--steps 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _common import print_table, write_results

from hetrain.checkpoint.manifest import read_manifest
from hetrain.config import CheckpointConfig, RunConfig
from hetrain.plan.layout import build_layout
from hetrain.runtime.launch import launch
from hetrain.spec.specs import ModelSpec, TrainingSettings, load_cluster
from recovery import CLUSTER
from solver.planner import make_plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    model = ModelSpec(name="gpt-bench-ckpt", num_layers=6, hidden_size=512, num_heads=8, seq_length=64, vocab_size=256)
    settings = TrainingSettings(global_batch_size=8, precision="fp32", micro_batch_sizes=[1, 2], tp_degrees=[1])
    samples: dict[str, list[float]] = {"local only": [], "with buddy copy": []}
    step_s: dict[str, list[float]] = {k: [] for k in samples}
    copied_mb: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="hetrain-ckptcost-") as tmp_str:
        tmp = Path(tmp_str)
        (tmp / "cluster.yaml").write_text(CLUSTER)
        plan = make_plan("hetrain", load_cluster(tmp / "cluster.yaml"), model, settings).plan
        plan.write(tmp / "plan.json")
        for rep in range(args.repeats):
            for mode in samples:
                root = tmp / f"{mode.replace(' ', '-')}-{rep}"
                ckpt = CheckpointConfig(local_dir=str(root / "nodes" / "{node}"), every_steps=1, keep=1,
                                        replicate=mode != "local only")
                config = RunConfig(plan=str(tmp / "plan.json"), steps=args.steps, checkpoint=ckpt)
                records = launch(config, build_layout(plan), root / "run")
                samples[mode] += [r["checkpoint_s"] for r in records[1:]]  # the first save warms up
                step_s[mode] += [r["step_time_s"] for r in records[1:]]
                manifest = read_manifest(ckpt.node_root("n0"), args.steps - 1)
                copied_mb[mode] = sum(f.size * (len(f.nodes) - 1) for f in manifest.files
                                      if f.path.endswith(".distcp")) / 1e6
                total_mb = manifest.total_bytes / 1e6
                print(f"repeat {rep} {mode}: checkpoint {statistics.median(samples[mode]):.2f} s", flush=True)
    base = statistics.median(samples["local only"])
    rows = [{"mode": mode, "checkpoint_s": statistics.median(xs), "step_s": statistics.median(step_s[mode]),
             "copied_mb": copied_mb[mode], "ratio": statistics.median(xs) / base, "samples": xs}
            for mode, xs in samples.items()]
    print_table(f"Checkpoint cost, {total_mb:.0f} MB checkpoint on 4 nodes, medians over {args.repeats} runs x "
                f"{args.steps - 1} saves (seconds)", rows,
                [("mode", "mode"), ("checkpoint s", "{checkpoint_s:.2f}"), ("training step s", "{step_s:.2f}"),
                 ("MB copied to buddies", "{copied_mb:.0f}"), ("vs local only", "{ratio:.2f}x")])
    print(f"\nresults: {write_results('checkpoint_cost', rows)}")


if __name__ == "__main__":
    main()
