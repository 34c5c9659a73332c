"""Where a checkpoint's stall goes: the state dict, the copy into the prepared buffers, a bare copy of the same bytes.

Why: the stall a background checkpoint costs training is ``training_state`` (torch's
``get_state_dict``) plus ``Snapshot.take`` (the device-to-host copy into buffers made before);
the bare copy of the same bytes into one pinned buffer is the floor. One model built the way
``hetrain train`` builds it (the 1.5B Llama of bench/gpu/ on a GPU; a small GPT on CPU), one
fused AdamW step so the optimizer state exists, then each part timed ``--repeats`` times.

    python bench/snapshot_copy.py [--model bench/gpu/llama-1.5b.yaml] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import ROOT, print_table, write_results

from hetrain.checkpoint.save import training_state
from hetrain.checkpoint.snapshot import Snapshot, _leaves, state_bytes
from hetrain.runtime.model import GPT
from hetrain.spec.specs import load_model


def _timed(fn, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    spec = load_model(ROOT / (args.model or ("bench/gpu/llama-1.5b.yaml" if cuda else "examples/models/gpt-small.yaml")))
    device = torch.device("cuda" if cuda else "cpu")
    model = GPT(spec).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if cuda else {}))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    state = training_state(model, opt)
    nbytes = state_bytes(state)
    snap = Snapshot()
    prepare_s = _timed(lambda: (snap.prepare(state), snap._thread.join()), False)
    pinned = snap.pinned
    tensors = [t for t in _leaves(state) if t.numel() > 0]
    # the floor: every tensor's bytes into one pinned buffer of the same size, back to back
    bare = torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8, pin_memory=cuda)
    views, at = [], 0
    for t in tensors:
        views.append(bare[at:at + t.numel() * t.element_size()])
        at += t.numel() * t.element_size()

    def bare_copy() -> None:
        for view, t in zip(views, tensors):
            view.copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)

    rows = {"get_state_dict": [], "Snapshot.take": [], "bare copy (one pinned buffer)": []}
    for _ in range(args.repeats):
        rows["get_state_dict"].append(_timed(lambda: training_state(model, opt), cuda))
        rows["Snapshot.take"].append(_timed(lambda: snap.take(state), cuda))
        rows["bare copy (one pinned buffer)"].append(_timed(bare_copy, cuda))
    out = [{"part": k, "median_s": statistics.median(v), "runs": v, "gb_per_s": nbytes / 1e9 / statistics.median(v)}
           for k, v in rows.items()]
    print_table(f"{spec.name}: {nbytes / 1e9:.1f} GB of state; buffers prepared in {prepare_s:.1f} s "
                f"(pinned: {pinned})", out,
                [("part", "part"), ("median s", "{median_s:.3f}"), ("GB/s", "{gb_per_s:.1f}")])
    print(f"\nresults: {write_results('snapshot_copy', out)}")


if __name__ == "__main__":
    main()
