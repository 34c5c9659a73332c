"""CPU AdamW throughput: what an offloaded stage's host step costs per parameter (``hetrain.cost.stage``).

torch's AdamW on one fp32 tensor of PARAMS parameters, in its three CPU implementations (for-loop,
foreach, fused), on one thread (what a rank gets under torchrun's OMP_NUM_THREADS=1) and on every
thread of this machine. Bytes/s counts ADAMW_BYTES_PER_PARAM per parameter (the cost model's unit,
``CPU_ADAMW_BYTES_PER_S``). Median of REPEATS steps after one warm-up. Prints a table, writes
bench/results/cpu_adamw.json.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from _common import print_table, write_results

from hetrain.cost.stage import ADAMW_BYTES_PER_PARAM, CPU_ADAMW_BYTES_PER_S

PARAMS = 20_000_000  # 80 MB of fp32: well past the caches, small enough for a shared 2-core machine
REPEATS = 3
IMPLEMENTATIONS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def step_s(options: dict) -> float:
    """Median seconds of one AdamW step over PARAMS parameters."""
    p = torch.nn.Parameter(torch.randn(PARAMS))
    p.grad = torch.randn(PARAMS)
    opt = torch.optim.AdamW([p], lr=1e-3, **options)
    opt.step()
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    rows = []
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        for name, options in IMPLEMENTATIONS.items():
            s = step_s(options)
            rows.append({"threads": threads, "implementation": name, "step_s": s, "mparams_per_s": PARAMS / s / 1e6,
                         "gb_per_s": PARAMS * ADAMW_BYTES_PER_PARAM / s / 1e9,
                         "vs_model": PARAMS * ADAMW_BYTES_PER_PARAM / s / CPU_ADAMW_BYTES_PER_S,
                         "load": os.getloadavg()[0]})
    print_table(f"torch {torch.__version__} AdamW on the CPU, {PARAMS:,} fp32 parameters "
                f"(the cost model: {CPU_ADAMW_BYTES_PER_S / 1e9:g} GB/s)", rows,
                [("threads", "threads"), ("AdamW", "implementation"), ("step s", "{step_s:.3f}"),
                 ("M params/s", "{mparams_per_s:,.0f}"), ("GB/s", "{gb_per_s:.2f}"), ("/ model", "{vs_model:.2f}x"),
                 ("load", "{load:.1f}")])
    print(f"\nwrote {write_results('cpu_adamw', rows)}")


if __name__ == "__main__":
    main()
