"""What a checkpoint costs the training loop: synchronous vs background, with and without buddy copies.

The ~230 MB GPT of bench/recovery.py on four one-device nodes checkpoints every ``--every``
steps (long enough for a background commit to finish before the next checkpoint, as with
checkpoints minutes apart on GPUs).
Runs alternate between the modes, ``--repeats`` times each:

- synchronous: every rank writes, fsyncs and hashes its shard, the buddy copies are made and
  the manifest committed before the next step (hetrain before background checkpoints);
- background: the rank's state is copied into host-memory buffers (pinned on a GPU) and
  training goes on; a thread writes, hashes, copies and commits over a process group of its own.

The stall is the median ``checkpoint_s`` of the checkpoints after the first (the time a rank
spends in ``save``; the first allocates the snapshot buffers);
"commit s" is how long a background checkpoint took to be committed, "step s" the training
step itself and "s per step" the run's wall time per step, stalls included: on this 2-core
machine, where four ranks already share the cores, the background thread competes with
training for them (on a GPU node it runs on otherwise idle host cores). Ratios, not absolute times, are
what this shared machine can tell.

    python bench/checkpoint_cost.py [--every 3] [--checkpoints 3] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _common import print_table, write_results

from hetrain.checkpoint.store import CheckpointStore
from hetrain.config import CheckpointConfig, RunConfig
from hetrain.plan.layout import build_layout
from hetrain.runtime.launch import launch
from hetrain.spec.specs import ModelSpec, TrainingSettings, load_cluster
from recovery import CLUSTER
from solver.planners.registry import make_plan


MODES = {  # name: (background, replicate)
    "synchronous": (False, False),
    "background": (True, False),
    "synchronous, buddy copy": (False, True),
    "background, buddy copy": (True, True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=3, help="steps between checkpoints")
    ap.add_argument("--checkpoints", type=int, default=3, help="checkpoints per run after the first")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    steps = args.every * (args.checkpoints + 1)
    model = ModelSpec(name="gpt-bench-ckpt", num_layers=6, hidden_size=512, num_heads=8, seq_length=64, vocab_size=256)
    settings = TrainingSettings(global_batch_size=8, precision="fp32", micro_batch_sizes=[1, 2], tp_degrees=[1])
    stall: dict[str, list[float]] = {mode: [] for mode in MODES}
    commit_s: dict[str, list[float]] = {mode: [] for mode in MODES}
    step_s: dict[str, list[float]] = {mode: [] for mode in MODES}
    wall_s: dict[str, list[float]] = {mode: [] for mode in MODES}
    copied_mb: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="hetrain-ckptcost-") as tmp_str:
        tmp = Path(tmp_str)
        (tmp / "cluster.yaml").write_text(CLUSTER)
        plan = make_plan("hetrain", load_cluster(tmp / "cluster.yaml"), model, settings).plan
        plan.write(tmp / "plan.json")
        for rep in range(args.repeats):
            for mode, (background, replicate) in MODES.items():
                root = tmp / f"{mode.replace(' ', '-').replace(',', '')}-{rep}"
                ckpt = CheckpointConfig(local_dir=str(root / "nodes" / "{node}"), every_steps=args.every, keep=1,
                                        replicate=replicate, background=background)
                config = RunConfig(plan=str(tmp / "plan.json"), steps=steps, checkpoint=ckpt)
                records = launch(config, build_layout(plan), root / "run")[args.every:]  # after the first save
                stall[mode] += [r["checkpoint_s"] for r in records if "checkpoint_s" in r]
                step_s[mode] += [r["step_time_s"] for r in records]
                wall_s[mode].append(sum(r["step_time_s"] + r.get("checkpoint_s", 0.0) for r in records) / len(records))
                commit_s[mode] += [c["commit_s"] for r in records for c in r.get("checkpoints_committed", [])]
                manifest = CheckpointStore.for_node(ckpt, "n0").read_manifest(steps - 1)
                copied_mb[mode] = sum(f.size * (len(f.nodes) - 1) for f in manifest.files
                                      if f.path.endswith(".distcp")) / 1e6
                total_mb = manifest.total_bytes / 1e6
                print(f"repeat {rep} {mode}: stall {statistics.median(stall[mode]):.3f} s", flush=True)
    rows = []
    for mode, (background, replicate) in MODES.items():
        sync_mode = "synchronous, buddy copy" if replicate else "synchronous"
        median = statistics.median(stall[mode])
        rows.append({"mode": mode, "stall_s": median,
                     "commit": f"{statistics.median(commit_s[mode]):.2f}" if commit_s[mode] else "-", "step_s": statistics.median(step_s[mode]),
                     "wall_s": statistics.median(wall_s[mode]),
                     "copied_mb": copied_mb[mode], "stall_vs_sync": median / statistics.median(stall[sync_mode]),
                     "stalls": stall[mode], "commits": commit_s[mode]})
    print_table(f"Checkpoint stall, {total_mb:.0f} MB checkpoint on 4 nodes, medians over {args.repeats} runs x "
                f"{args.checkpoints} checkpoints, one every {args.every} steps (seconds)", rows,
                [("mode", "mode"), ("training stall s", "{stall_s:.3f}"),
                 ("background commit s", "commit"),
                 ("training step s", "{step_s:.2f}"), ("s per step, stalls included", "{wall_s:.2f}"),
                 ("MB copied to buddies", "{copied_mb:.0f}"),
                 ("stall vs synchronous", "{stall_vs_sync:.3f}x")])
    print(f"\nresults: {write_results('checkpoint_cost', rows)}")


if __name__ == "__main__":
    main()
