# %% [markdown]
# # hetrain from Python
#
# Plan a tiny GPT for a mixed cluster, train it a few steps on this machine's CPU (the
# cluster's `emulate` settings make four CPU processes behave like two fast and two slow
# devices), export it, and load the export back: the public API only (`import hetrain`).
# Runs as a script (`python examples/python_api.py [WORK_DIR]`) or cell by cell in a notebook.

# %%
import sys
import tempfile
from pathlib import Path

import hetrain

EXAMPLES = Path(__file__).resolve().parent
work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="hetrain-api-"))

# %% [markdown]
# ## Plan
# The cluster and model files are the ones `hetrain plan --cluster ... --model ...` reads.

# %%
cluster = hetrain.load_cluster(EXAMPLES / "clusters" / "cpu-emulated.yaml")
model = hetrain.load_model(EXAMPLES / "models" / "gpt-tiny.yaml")
result = hetrain.plan(cluster, model, global_batch_size=8, precision="fp32", time_limit_s=5)
for p, pipeline in enumerate(result.plan.pipelines):
    stages = ", ".join(f"{'+'.join(s.devices)} blocks {s.layers[0]}-{s.layers[1] - 1}" for s in pipeline.stages)
    print(f"pipeline {p}: {pipeline.num_microbatches} micro-batches on {stages}")
print(f"predicted: {result.estimate.iteration_time_s:.3f} s a step, {result.estimate.tokens_per_s:,.0f} tokens/s")

# %% [markdown]
# ## Data
# One text file, byte-level tokens (gpt-tiny's vocabulary is the 256 bytes); give a
# `tokenizer=` (a tokenizer.json) and JSON lines, Parquet or a saved `datasets` dataset for more.

# %%
data = hetrain.prepare_data(EXAMPLES / "data" / "tiny.txt", work / "tiny.bin")
print(f"{data['num_tokens']:,} tokens, {data['dtype']}")

# %% [markdown]
# ## Train
# `hetrain.train` takes `hetrain train`'s options as keywords; each step's record is what
# `RUN_DIR/metrics.jsonl` gets (TensorBoard: `tensorboard --logdir RUN_DIR`).

# %%
records = hetrain.train(result.plan, work / "run", cluster=EXAMPLES / "clusters" / "cpu-emulated.yaml",
                        steps=4, data=str(work / "tiny.bin"), lr=3e-3,
                        on_record=lambda r: print(f"step {r['step']}: loss {r['loss']:.3f}"))
print(f"trained {len(records)} steps, loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}")

# %% [markdown]
# ## Export and use
# One `model.safetensors`, whatever plan trained it; `load_export` and `build_model` give a
# plain `torch.nn.Module` on the CPU.

# %%
exported = hetrain.export(work / "run", work / "export")
spec, weights = hetrain.load_export(work / "export")
net = hetrain.build_model(spec, weights)
import torch  # noqa: E402  (only here: the API itself needs no torch import from the user)

tokens = torch.tensor([list(b"hetrain ")])
print(f"exported step {exported.step}: {exported.num_params:,} parameters; "
      f"next byte after 'hetrain ': {chr(int(net(tokens)[0, -1].argmax()))!r}")
