"""One device: ``hetrain train`` of a one-device plan vs a plain PyTorch loop of the same model.

Why: the runtime must train at the speed of a well-written PyTorch loop (target: ratio >= 0.97,
>= 40 % MFU on the 1.4B GPT on an H100, bf16 with recompute), and the plan's predictions must
be what the user sees (step time within 10 % when fed a profile taken on that device, memory
within 10 %); and hetrain's model must be no slower than transformers' of the same shape
(``hetrain_vs_transformers`` >= 1.0: transformers' ``GPT2LMHeadModel`` or, ``--arch llama``,
``LlamaForCausalLM``, SDPA attention, gradient checkpointing where hetrain recomputes, run by
the same plain loop). Both sides use the same ``hetrain.runtime.model.GPT``, precision, micro-batching,
recompute, AdamW (fused on GPUs, foreach on CPU), clipping and LR schedule; the plain loop is
bench code (30 lines below), not library code. Each side runs in its own process (a fresh
allocator, so peak memory is its own), alternating ``--repeats`` times; the median step after
warm-up counts.

On a GPU: the 1.4B GPT (24 blocks, hidden 2048, 16 heads, sequence 2048, vocabulary 50304),
global batch 16, micro-batch 4. Without a GPU: the same comparison on CPU with a small model
in fp32 (one thread), so the bench runs everywhere; memory there is counted by
``hetrain.runtime.instrument.AllocationTracker`` on both sides.

    python bench/gpu_step.py [--steps 12] [--repeats 2] [--precision bf16]
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

GPU_MODEL = {"name": "gpt-1.4b", "num_layers": 24, "hidden_size": 2048, "num_heads": 16, "seq_length": 2048,
             "vocab_size": 50304}
CPU_MODEL = {"name": "gpt-cpu-bench", "num_layers": 4, "hidden_size": 256, "num_heads": 4, "seq_length": 128,
             "vocab_size": 256}
# --arch llama: a 1.5B Llama 3 shape (grouped-query attention, SwiGLU) on a GPU, a small one on CPU
GPU_LLAMA = {"name": "llama-1.5b", "arch": "llama", "num_layers": 24, "hidden_size": 2048, "num_heads": 16,
             "num_kv_heads": 8, "ffn_hidden_size": 5632, "seq_length": 2048, "vocab_size": 32000,
             "rope_theta": 500000.0}
CPU_LLAMA = {"name": "llama-cpu-bench", "arch": "llama", "num_layers": 4, "hidden_size": 256, "num_heads": 4,
             "num_kv_heads": 2, "ffn_hidden_size": 512, "seq_length": 128, "vocab_size": 256}
WARMUP_STEPS = 3  # compile/allocator warm-up; their times are left out


def _gpu_type(name: str) -> str:
    """The catalog type of this device, from its CUDA name."""
    for key, typ in (("H100", "H100-SXM"), ("H200", "H100-SXM"), ("A100", "A100-80G"), ("L40S", "L40S"),
                     ("A10", "A10G"), ("L4", "L4"), ("V100", "V100-32G"), ("3090", "RTX3090"), ("T4", "T4")):
        if key in name:
            return typ
    return "H100-SXM"


def transformers_model(spec, recompute: bool):
    """transformers' model of ``spec``'s shape, and its forward as ``ids -> logits``: ``LlamaForCausalLM`` from
    the export's own config for a Llama, ``GPT2LMHeadModel`` (exact GELU, untied head) for a GPT; SDPA
    attention, gradient checkpointing where hetrain recomputes."""
    import transformers

    from hetrain.spec.hf import hf_config

    if spec.arch == "llama":
        config = transformers.AutoConfig.for_model(**hf_config(spec, "fp32"))
    else:
        config = transformers.GPT2Config(n_layer=spec.num_layers, n_embd=spec.hidden_size, n_head=spec.num_heads,
                                         n_positions=spec.seq_length, vocab_size=spec.vocab_size,
                                         n_inner=spec.ffn_size, activation_function="gelu",
                                         tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, lambda ids: model(input_ids=ids, use_cache=False).logits


def plain_loop(spec_json: str, steps: int, global_batch: int, micro_batch: int, precision: str, recompute: bool,
               out: str, trace_memory: bool, kind: str = "hetrain") -> None:
    """The reference: what a careful engineer writes by hand for one device, around hetrain's model
    (``kind`` hetrain) or transformers' of the same shape (``kind`` transformers)."""
    import torch

    from hetrain.runtime.data import TokenSource
    from hetrain.runtime.model import GPT, lm_loss
    from hetrain.spec.schedule import LRSchedule
    from hetrain.spec.specs import ModelSpec

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)
    spec = ModelSpec.model_validate_json(spec_json)
    if kind == "transformers":
        model, forward = transformers_model(spec, recompute)
        model.train()
    else:
        model = forward = GPT(spec, recompute=recompute)
        model.init_weights(0)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, **({"fused": True} if cuda else {"foreach": True}))
    schedule = LRSchedule.for_run(steps)
    source = TokenSource(spec.seq_length, spec.vocab_size, seed=0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    tracker = None
    if trace_memory:
        from hetrain.runtime.instrument import AllocationTracker

        tracker = AllocationTracker(list(model.parameters()))
    times = []
    for step in range(steps):
        seq = source.sequences(step * global_batch, global_batch).to(device)
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        with tracker or _null():
            for mb in seq.split(micro_batch):
                with torch.autocast(device.type, dtype=dtype, cache_enabled=False) if dtype else _null():
                    logits = forward(mb[:, :-1])
                (lm_loss(logits, mb[:, 1:]) * (micro_batch / global_batch)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for group in opt.param_groups:
                group["lr"] = schedule.lr_at(step)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    peak = tracker.peak_bytes if tracker else torch.cuda.max_memory_allocated() if cuda else None
    Path(out).write_text(json.dumps({"step_s": times, "peak_gb": peak / 1e9 if peak is not None else None}))


def _null():
    import contextlib

    return contextlib.nullcontext()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--precision", default=None, help="bf16 on GPU, fp32 on CPU by default")
    ap.add_argument("--no-recompute", action="store_true")
    ap.add_argument("--global-batch-size", type=int, default=None)
    ap.add_argument("--micro-batch-size", type=int, default=None)
    ap.add_argument("--arch", choices=("gpt", "llama"), default="gpt",
                    help="the model: GPT 1.4B (default) or a 1.5B Llama on a GPU, small ones on CPU")
    ap.add_argument("--plain", nargs=9, help=argparse.SUPPRESS)  # child mode: the plain loop
    args = ap.parse_args()
    if args.plain:
        spec_json, steps, gb, mb, precision, recompute, out, trace, kind = args.plain
        plain_loop(spec_json, int(steps), int(gb), int(mb), precision, recompute == "1", out, trace == "1", kind)
        return

    import torch

    from hetrain.cost.costmodel import CostModel
    from hetrain.spec.arithmetic import train_flops_per_sequence
    from hetrain.plan.schema import Plan
    from hetrain.profiling.profiler import profile_model
    from hetrain.spec.specs import ClusterSpec, ModelSpec, TrainingSettings

    cuda = torch.cuda.is_available()
    models = {"gpt": (GPU_MODEL, CPU_MODEL), "llama": (GPU_LLAMA, CPU_LLAMA)}[args.arch]
    spec = ModelSpec.model_validate(models[0] if cuda else models[1])
    precision = args.precision or ("bf16" if cuda else "fp32")
    recompute = not args.no_recompute
    gb = args.global_batch_size or (16 if cuda else 8)
    mb = args.micro_batch_size or (4 if cuda else 2)
    gpu = _gpu_type(torch.cuda.get_device_name()) if cuda else "cpu-bench"
    cluster = ClusterSpec.model_validate({
        "name": "one-device", "nodes": [{"name": "local", "gpu": gpu, "count": 1, "intra_node_bandwidth_gbps": 100,
                                         # a CPU node (no slowdown): the cost model charges foreach AdamW's temporaries
                                         **({} if cuda else {"emulate": {"slowdown": 1.0}})}],
        **({} if cuda else {"gpu_types": {"cpu-bench": {"tflops": 0.1, "fp32_tflops": 0.05, "memory_gb": 16,
                                                        "memory_bandwidth_gbps": 10, "efficiency": 1.0}}})})
    settings = TrainingSettings(global_batch_size=gb, micro_batch_sizes=[mb], tp_degrees=[1], precision=precision,
                                activation_recompute=recompute)
    plan = Plan.model_validate({
        "schema": "hetrain.plan/v1", "model": spec.model_dump(), "cluster": cluster.name, "global_batch_size": gb,
        "micro_batch_size": mb, "tp": 1, "training": settings.model_dump(),
        "pipelines": [{"num_microbatches": gb // mb,
                       "stages": [{"devices": ["local/0"], "gpu": gpu, "layers": [0, spec.num_layers]}]}]})

    work = Path(tempfile.mkdtemp(prefix="gpu_step-"))
    plan.write(work / "plan.json")

    def hetrain_run(name: str, steps: int, trace: bool) -> list[dict]:
        run_dir = work / name
        cmd = [sys.executable, "-m", "hetrain", "train", "--plan", str(work / "plan.json"), "--steps", str(steps),
               "--run-dir", str(run_dir), "--lr", "3e-4"] + (["--trace-memory"] if trace else [])
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]

    def plain_run(name: str, steps: int, trace: bool, kind: str = "hetrain") -> dict:
        out = work / f"{name}.json"
        subprocess.run([sys.executable, __file__, "--plain", spec.model_dump_json(), str(steps), str(gb), str(mb),
                        precision, "1" if recompute else "0", str(out), "1" if trace else "0", kind],
                       check=True, cwd=ROOT)
        return json.loads(out.read_text())

    hetrain_s, plain_s, hf_s, hetrain_gb, plain_gb, hf_gb = [], [], [], [], [], []
    for repeat in range(args.repeats):
        records = hetrain_run(f"run{repeat}", args.steps, trace=False)
        hetrain_s.append(statistics.median(r["step_time_s"] for r in records[WARMUP_STEPS:]))
        plain = plain_run(f"plain{repeat}", args.steps, trace=False)
        plain_s.append(statistics.median(plain["step_s"][WARMUP_STEPS:]))
        theirs = plain_run(f"transformers{repeat}", args.steps, trace=False, kind="transformers")
        hf_s.append(statistics.median(theirs["step_s"][WARMUP_STEPS:]))
        if cuda:
            hetrain_gb.append(max(r["ranks"][0]["peak_memory_gb"] for r in records))
            plain_gb.append(plain["peak_gb"])
            hf_gb.append(theirs["peak_gb"])
        print(f"repeat {repeat}: hetrain {hetrain_s[-1]:.3f} s/step, plain loop {plain_s[-1]:.3f} s/step, "
              f"transformers' model in the loop {hf_s[-1]:.3f} s/step", flush=True)
    if not cuda:  # a CPU has no allocator to ask: one short run each with every allocation counted
        hetrain_gb.append(max(r["ranks"][0]["peak_memory_gb"] for r in hetrain_run("memory", 2, trace=True)))
        plain_gb.append(plain_run("plain-memory", 2, trace=True)["peak_gb"])
        hf_gb.append(plain_run("transformers-memory", 2, trace=True, kind="transformers")["peak_gb"])

    if not cuda:
        torch.set_num_threads(1)
    prof = profile_model(spec, gpus={gpu: 1.0}, micro_batch_sizes=[mb], tp_degrees=[1],
                         activation_recompute=recompute, precision=precision)
    analytic = CostModel(cluster, spec, settings).estimate(plan)
    profiled = CostModel(cluster, spec, settings, prof).estimate(plan)
    tokens = gb * spec.seq_length
    peak_flops = cluster.gpu_type(gpu).tflops * 1e12 if cuda else None
    model_flops = train_flops_per_sequence(spec, activation_recompute=False) * gb  # MFU counts no recompute
    h, p = statistics.median(hetrain_s), statistics.median(plain_s)
    reserve = settings.framework_reserve_gb
    rows = []
    t = statistics.median(hf_s)
    for name, step_s, mem in (("hetrain train", h, max(hetrain_gb)), ("plain PyTorch loop", p, max(plain_gb)),
                              ("transformers' model, same loop", t, max(hf_gb))):
        rows.append({"run": name, "step_s": step_s, "tokens_per_s": tokens / step_s,
                     "mfu": f"{model_flops / step_s / peak_flops:.1%}" if peak_flops else "-",
                     "peak_gb": mem, "vs_plain": p / step_s})
    for name, est in (("predicted, analytic", analytic), ("predicted, profile-fed", profiled)):
        rows.append({"run": name, "step_s": est.iteration_time_s, "tokens_per_s": est.tokens_per_s, "mfu": "-",
                     "peak_gb": est.peak_memory_gb["local/0"] - reserve, "vs_plain": p / est.iteration_time_s})
    device = torch.cuda.get_device_name() if cuda else f"CPU, 1 thread ({os.cpu_count()} cores on the machine)"
    title = (f"{spec.name} on {device}: {precision}, recompute {'on' if recompute else 'off'}, global batch {gb}, "
             f"micro-batch {mb}, median of {args.repeats} alternating runs of {args.steps} steps")
    print_table(title, rows, [("run", "run"), ("s / step", "{step_s:.3f}"), ("tokens/s", "{tokens_per_s:,.0f}"),
                              ("MFU", "mfu"), ("peak GB", "{peak_gb:.3f}"), ("plain loop time / this", "{vs_plain:.3f}")])
    summary = {"hetrain_vs_plain": p / h, "hetrain_vs_transformers": t / h,
               "predicted_step_error_profile": profiled.iteration_time_s / h - 1,
               "predicted_step_error_analytic": analytic.iteration_time_s / h - 1,
               "predicted_memory_error": (profiled.peak_memory_gb["local/0"] - reserve) / max(hetrain_gb) - 1}
    print("\n" + "  ".join(f"{k} {v:+.3f}" if "error" in k else f"{k} {v:.3f}" for k, v in summary.items()))
    path = write_results("gpu_step", {"device": device, "model": spec.model_dump(), "precision": precision,
                                      "recompute": recompute, "rows": rows, "summary": summary,
                                      "hetrain_step_s": hetrain_s, "plain_step_s": plain_s,
                                      "transformers_step_s": hf_s})
    print(f"results in {path}")


if __name__ == "__main__":
    main()
