"""The Llama architecture (RMSNorm, SwiGLU, rotary positions, grouped-query attention) through spec,
cost model, planner and profiler; its runtime equivalence is in test_runtime.py, the export of a trained
Llama in test_init_from.py."""

from __future__ import annotations

import pytest
import torch

from hetrain.errors import HetrainError
from hetrain.runtime.model import GPT
from hetrain.spec.arithmetic import block_activation_bytes, block_params, total_params
from hetrain.spec.specs import TrainingSettings, load_cluster, load_model
from tests.helpers import EXAMPLES

LLAMA_TINY = EXAMPLES / "models" / "llama-tiny.yaml"
BASE = "name: m\nnum_layers: 2\nhidden_size: 64\nnum_heads: 4\nseq_length: 8\nvocab_size: 10\n"


@pytest.mark.parametrize("extra,expected", [
    ("num_kv_heads: 2\n", "num_kv_heads: only for arch: llama"),
    ("arch: llama\nnum_kv_heads: 3\n", "num_kv_heads: expected a divisor of num_heads 4, got 3"),
    ("arch: llama\nsliding_window: 4\n", "sliding_window: expected at least seq_length 8"),
    ("arch: mamba\n", "arch"),
])
def test_bad_llama_fields_name_the_field(tmp_path, extra, expected):
    p = tmp_path / "m.yaml"
    p.write_text(BASE + extra)
    with pytest.raises(HetrainError, match=expected) as e:
        load_model(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_odd_head_size_is_refused_for_rotary_positions(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text(BASE.replace("num_heads: 4", "num_heads: 64").replace("hidden_size: 64", "hidden_size: 192")
                 + "arch: llama\n")
    with pytest.raises(HetrainError, match="rotary positions need an even head size"):
        load_model(p)


def test_parameter_counts_match_the_module_and_llama_3_8b():
    spec = load_model(LLAMA_TINY)
    model = GPT(spec)
    assert total_params(spec) == sum(p.numel() for p in model.parameters())
    assert block_params(spec) == sum(p.numel() for p in model.layers["0"].parameters())
    assert model.pos_embedding is None  # rotary positions: nothing learned
    # Meta's Llama 3 8B: 8,030,261,248 parameters
    assert total_params(load_model(EXAMPLES / "models" / "llama-3-8b.yaml")) == 8_030_261_248


def test_tp_must_divide_the_key_value_heads():
    spec = load_model(LLAMA_TINY)  # 4 query heads over 2 key/value heads
    assert spec.tp_divides(2) and not spec.tp_divides(4)
    assert spec.split_sizes() == "hidden_size 64, num_heads 4 and num_kv_heads 2"


def test_stages_of_a_llama_compose_to_the_whole_model():
    """Rotary positions are computed inside each block: any cut gives the whole model's logits."""
    spec = load_model(LLAMA_TINY)
    whole, first, second = GPT(spec), GPT(spec, (0, 2)), GPT(spec, (2, 6))
    for m in (whole, first, second):
        m.init_weights(3)
    ids = torch.randint(0, spec.vocab_size, (2, spec.seq_length))
    assert torch.allclose(second(first(ids)), whole(ids), atol=1e-6)


def test_llama_3_8b_plans_on_the_paper_cluster():
    from solver.planners.registry import make_plan

    spec = load_model(EXAMPLES / "models" / "llama-3-8b.yaml")
    cluster = load_cluster(EXAMPLES / "clusters" / "paper-3types.yaml")
    result = make_plan("hetrain", cluster, spec, TrainingSettings(global_batch_size=256))
    assert result.plan.model == spec and result.estimate.iteration_time_s > 0
    assert result.plan.tp in (1, 2, 4, 8) and spec.tp_divides(result.plan.tp)


def test_swiglu_keeps_more_activations_than_gelu():
    """Same widths, the SwiGLU block saves two more ffn-wide tensors per token than the GELU one."""
    gpt = load_model(EXAMPLES / "models" / "gpt-tiny.yaml")
    llama = gpt.model_copy(update={"arch": "llama"})
    settings = TrainingSettings(global_batch_size=8, precision="fp32")
    extra = block_activation_bytes(llama, settings, 1, 1) - block_activation_bytes(gpt, settings, 1, 1)
    rms_norm_copies = gpt.seq_length * 2 * gpt.hidden_size * 4  # RMSNorm keeps its normalized input (fp32)
    assert extra == pytest.approx(gpt.seq_length * 2 * llama.ffn_size * settings.activation_bytes + rms_norm_copies)


def test_a_llama_is_preempted_and_recovers_on_the_survivors(tmp_path):
    """Spot node c gets a notice at the start: every rank checkpoints step 0 and stops (buddy copies
    keep c's shards on a); c goes with its disk; the survivors re-plan and resume at step 1."""
    import json
    import shutil

    from hetrain.config import CheckpointConfig, RunConfig
    from hetrain.plan.schema import Plan
    from hetrain.recovery.recover import recover
    from hetrain.runtime.launch import write_config
    from solver.planners.registry import make_plan
    from tests.helpers.training import CLUSTER_YAML, plan, run

    spec = load_model(LLAMA_TINY)
    base = plan(1, [(5, [("a/0", [0, 2]), ("b/0", [2, 6])]), (3, [("a/1", [0, 4]), ("c/0", [4, 6])])])
    p = Plan.model_validate({**json.loads(base.to_json()), "model": spec.model_dump(mode="json", exclude_none=True)})
    request = tmp_path / "checkpoint.request"
    request.write_text(json.dumps({"cloud": "aws", "action": "terminate", "stop": True}))
    cfg = CheckpointConfig(local_dir=str(tmp_path / "nodes" / "{node}"), every_steps=1000, replicate=True)
    records = run(p, tmp_path / "train", steps=6, checkpoint=cfg, request_file=str(request))
    assert [r["step"] for r in records] == [0] and records[0]["stopped"] == "preemption notice"
    shutil.rmtree(cfg.node_root("c"))  # gone, its disk with it
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER_YAML)
    p.write(tmp_path / "plan.json")
    run_dir = tmp_path / "run"
    write_config(RunConfig(plan=str(tmp_path / "plan.json"), cluster=str(cluster), steps=3, lr=1e-2,
                           checkpoint=cfg), run_dir)
    result = recover(run_dir, ["c"], lambda cl, m, s: make_plan("hetrain", cl, m, s).plan, timeout_s=2)
    assert result.step == 0 and result.plan.model == spec
    assert "c" not in {d.split("/")[0] for d in result.plan.devices()}
    assert [r["step"] for r in result.records] == [1, 2]
    assert all(r["loss"] > 0 for r in result.records)


def test_a_llama_export_loads_in_transformers_with_the_same_logits(tmp_path):
    """Where Hugging Face transformers is installed (an optional extra: `pip install transformers`):
    LlamaForCausalLM built from the exported config.json and model.safetensors computes the logits
    hetrain's model computes with the same weights."""
    transformers = pytest.importorskip("transformers")
    from hetrain.export import HF_CONFIG, WEIGHTS, exported_name, hf_config

    from safetensors.torch import save_file

    spec = load_model(LLAMA_TINY)
    model = GPT(spec)
    model.init_weights(7)
    tmp_path.joinpath(HF_CONFIG).write_text(__import__("json").dumps(hf_config(spec, "fp32")))
    save_file({exported_name(spec, n): t.contiguous() for n, t in model.state_dict().items()},
              str(tmp_path / WEIGHTS))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32)
    hf.eval()
    ids = torch.randint(0, spec.vocab_size, (2, spec.seq_length))
    with torch.no_grad():
        want = model(ids)
        got = hf(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()


def test_the_profiler_times_a_llama_block_and_its_memory_matches_the_cost_model():
    """One rank's TP shard of a Llama block (q by query heads, k and v by key/value heads, SwiGLU's
    three projections), measured under each recompute mode: what it keeps is what the cost model counts."""
    from hetrain.spec.arithmetic import selective_activation_bytes
    from hetrain.profiling.profiler import profile_entry, shard_block

    spec = load_model(LLAMA_TINY)
    block = shard_block(spec, 2)
    assert block.attn.wq.out_features == 32 and block.attn.wk.out_features == 16  # 2 of 4 heads, 1 of 2 kv heads
    assert block.mlp.w3.out_features == block.mlp.w1.out_features == 64
    cpu = torch.device("cpu")
    settings = TrainingSettings(global_batch_size=8, precision="fp32")
    entry = profile_entry(spec, 1, 2, activation_recompute=False, device=cpu, slowdown=1.0, warmup=0, repeats=1)
    assert entry.block_forward_s > 0 and entry.block_backward_s > 0
    kept = {mode: r.block_activation_bytes for mode, r in entry.recompute.items()}
    assert kept["full"] < kept["selective"] < kept["none"]
    assert kept["none"] == pytest.approx(block_activation_bytes(spec, settings, 1, 2), rel=0.05)
    assert kept["selective"] == pytest.approx(selective_activation_bytes(spec, settings, 1, 2), rel=0.05)
