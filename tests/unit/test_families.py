"""The families people bring, as transformers 5 makes them (small configs, no hub): Llama 3.1 (rotary
scaling), Llama 3.2 (tied), Qwen 2.5 (q/k/v bias, tied), Qwen 3 (q/k norm, head size not hidden / heads),
Mistral. Each loads into hetrain's one block with transformers' logits, and hetrain's weights written as
the family's export load back into transformers with hetrain's logits. The slow test trains each from its
save under two asymmetric pipelines at TP 2 and compares the first loss with transformers'.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import run_cli
from hetrain.errors import HetrainError
from hetrain.plan.schema import Plan
from hetrain.runtime.data import TokenSource
from hetrain.runtime.model import GPT, lm_loss
from hetrain.runtime.pretrained import load_pretrained
from hetrain.spec.arithmetic import total_params
from hetrain.spec.hf import exported_name, hf_config, pretrained_spec

transformers = pytest.importorskip("transformers")

SEQ = 32
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=131072, rms_norm_eps=1e-6)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # shorter than SEQ: the scaling shows
FAMILIES = {
    "llama-3.1": ("LlamaConfig", {"rope_parameters": LLAMA3}),
    "llama-3.2": ("LlamaConfig", {"rope_parameters": LLAMA3 | {"factor": 32.0}, "tie_word_embeddings": True}),
    "qwen-2.5": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen-3": ("Qwen3Config", {"head_dim": 32}),  # 4 heads of 32 in a hidden size of 64
    "mistral": ("MistralConfig", {"sliding_window": None}),
}


def transformers_model(directory: Path, family: str):
    """``family``'s model as transformers makes and saves it, every weight moved off its init (zero biases, unit
    norms would hide a missing bias or norm)."""
    config_class, extra = FAMILIES[family]
    torch.manual_seed(3)
    config = getattr(transformers, config_class)(**(BASE | extra))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(directory))
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_transformers_made_gives_its_logits_in_hetrain(tmp_path: Path, family: str):
    theirs = transformers_model(tmp_path / "hf", family)
    spec = pretrained_spec(tmp_path / "hf", SEQ)
    ours = GPT(spec)
    load_pretrained(ours, spec, tmp_path / "hf")
    assert total_params(spec) == sum(p.numel() for p in theirs.parameters())  # tied: the one weight once
    tokens = TokenSource(SEQ, spec.vocab_size, seed=0).sequences(0, 2)
    with torch.no_grad():
        want, got = theirs(input_ids=tokens).logits, ours(tokens)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_hetrain_weights_written_as_the_family_load_in_transformers(tmp_path: Path, family: str):
    """The other way: hetrain's own weights, written as the export writes them (its config.json and names)."""
    transformers_model(tmp_path / "hf", family)
    spec = pretrained_spec(tmp_path / "hf", SEQ)
    ours = GPT(spec)
    ours.init_weights(11)
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config(spec, "fp32", {"bos_token_id": 0, "eos_token_id": 0})))
    save_file({exported_name(spec, n): t.contiguous() for n, t in ours.state_dict().items()},
              str(out / "model.safetensors"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(loaded).__name__ == json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"][0]
    assert loaded.config.eos_token_id == 0
    tokens = TokenSource(SEQ, spec.vocab_size, seed=1).sequences(0, 2)
    with torch.no_grad():
        want, got = ours(tokens), loaded(input_ids=tokens).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("change,expected", [
    ({"model_type": "gemma2"}, "model_type: 'gemma2' is not a family hetrain runs (llama, mistral, qwen2, qwen3)"),
    ({"sliding_window": 16}, "sliding_window: expected at least seq_length 32 (sliding-window attention is not "
                             "supported), got 16"),
    ({"attention_bias": True}, "attention_bias: true (a bias on q, k, v and o) is not in hetrain's block"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type: hetrain's Llama block has 'default' and "
                                                                "'llama3' rotary positions, the model 'yarn'"),
])
def test_what_the_block_lacks_is_one_line_naming_it(tmp_path: Path, change: dict, expected: str):
    transformers_model(tmp_path / "hf", "mistral")
    config = json.loads((tmp_path / "hf" / "config.json").read_text()) | change
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HetrainError, match=expected.replace("(", r"\(").replace(")", r"\)")) as e:
        pretrained_spec(tmp_path / "hf", SEQ)
    assert "\n" not in str(e.value)


def test_a_checkpoints_context_is_not_the_length_trained_at(tmp_path: Path):
    """Llama 3.2 reads 131072 tokens; planned without --seq-length it trains at 4096, with it at the asked."""
    transformers_model(tmp_path / "hf", "llama-3.2")
    assert pretrained_spec(tmp_path / "hf").seq_length == 4096
    assert pretrained_spec(tmp_path / "hf", 2048).seq_length == 2048


def asymmetric_tp2_plan(spec) -> Plan:
    """Pipeline 0: two stages (blocks 0-1, 1-4); pipeline 1: one stage; TP 2 throughout."""
    def stage(node: str, first: int, layers: list[int]) -> dict:
        return {"devices": [f"{node}/{first}", f"{node}/{first + 1}"], "gpu": "cpu", "layers": layers}

    return Plan.model_validate({
        "schema": "hetrain.plan/v1", "model": spec.model_dump(), "cluster": "test", "global_batch_size": 4,
        "micro_batch_size": 1, "tp": 2,
        "pipelines": [{"num_microbatches": 3, "stages": [stage("a", 0, [0, 1]), stage("a", 2, [1, 4])]},
                      {"num_microbatches": 1, "stages": [stage("b", 0, [0, 4])]}]})


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama-3.2", "qwen-3"])
def test_a_family_trains_from_transformers_loss_under_two_asymmetric_pipelines_at_tp2(tmp_path: Path, family: str):
    """The first loss of a run started with --init-from on transformers' save is transformers' on the same
    batch: tied weights split by vocabulary on both ends, Qwen 3's head norms summed over the TP group."""
    theirs = transformers_model(tmp_path / "hf", family)
    spec = pretrained_spec(tmp_path / "hf", SEQ)
    plan = asymmetric_tp2_plan(spec)
    plan.write(tmp_path / "plan.json")
    r = run_cli("train", "--plan", str(tmp_path / "plan.json"), "--steps", "1", "--init-from", str(tmp_path / "hf"),
                "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    seq = TokenSource(SEQ, spec.vocab_size, seed=0).sequences(0, plan.global_batch_size)
    with torch.no_grad():
        want = lm_loss(theirs(input_ids=seq[:, :-1]).logits, seq[:, 1:]).item()
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(record["loss"] - want) <= 1e-5 * want


def test_plan_trains_at_the_asked_length_and_refuses_a_family_it_lacks_in_one_line(tmp_path: Path):
    """``hetrain plan --seq-length`` (the model directory's context is 131072 tokens); a Gemma directory is
    refused with exit 2 in one line naming its family."""
    from conftest import EXAMPLES

    transformers_model(tmp_path / "hf", "llama-3.2")
    cluster = str(EXAMPLES / "clusters" / "cpu-emulated.yaml")
    r = run_cli("plan", "--model", str(tmp_path / "hf"), "--cluster", cluster, "--global-batch-size", "8",
                "--seq-length", "64", "--out", str(tmp_path / "plan.json"), "--time-limit", "1")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "plan.json").read_text())["model"]["seq_length"] == 64
    config = json.loads((tmp_path / "hf" / "config.json").read_text()) | {"model_type": "gemma"}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    r = run_cli("plan", "--model", str(tmp_path / "hf"), "--cluster", cluster, "--global-batch-size", "8")
    assert r.returncode == 2 and "'gemma' is not a family hetrain runs" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
def test_a_trained_tied_export_loads_in_transformers_and_generate_stops_at_the_datas_eos(tmp_path: Path):
    """Qwen 2.5's shape (q/k/v bias, tied), data made with a bare tokenizer.json whose EOS is id 0, trained two
    steps with the embedding and the head on different ranks, exported: transformers loads the model (the
    hetrain logits) and the tokenizer (EOS, BOS and pad named), and greedy ``generate()`` stops at the EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from ckpt_helpers import run
    from hetrain.config import CheckpointConfig
    from hetrain.export import load_export

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    text = [f"the {w} of the model trains on document {i}" for i, w in enumerate(["plan", "stage", "rank"] * 20)]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=200, special_tokens=["<|endoftext|>", "<unk>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in text))
    r = run_cli("data", "prepare", "--input", str(tmp_path / "docs.jsonl"), "--tokenizer",
                str(tmp_path / "tokenizer.json"), "--out", str(tmp_path / "docs.bin"))
    assert r.returncode == 0, r.stderr
    transformers_model(tmp_path / "hf", "qwen-2.5")
    spec = pretrained_spec(tmp_path / "hf", 16)
    stage = lambda device, layers: {"devices": [device], "gpu": "cpu", "layers": layers}  # noqa: E731
    plan = Plan.model_validate({"schema": "hetrain.plan/v1", "model": spec.model_dump(), "cluster": "test",
                                "global_batch_size": 4, "micro_batch_size": 1, "tp": 1,
                                "pipelines": [{"num_microbatches": 4,
                                               "stages": [stage("a/0", [0, 2]), stage("a/1", [2, 4])]}]})
    run(plan, tmp_path / "train", steps=2, data=str(tmp_path / "docs.bin"), init_from=str(tmp_path / "hf"),
        checkpoint=CheckpointConfig(local_dir=str(tmp_path / "ckpt"), every_steps=1000))
    out = tmp_path / "export"
    r = run_cli("export", "--run", str(tmp_path / "train" / "run"), "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    _, weights = load_export(out)
    ours = GPT(spec)
    ours.load_state_dict(weights)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id) == (0, 0, 0)
    assert (theirs.config.eos_token_id, theirs.generation_config.eos_token_id) == (0, 0)
    prompt = torch.tensor([tokenizer.encode("the stage of the model")])
    with torch.no_grad():
        assert (theirs(input_ids=prompt).logits - ours(prompt)).abs().max() <= 1e-5
        theirs.model.norm.weight.zero_()  # every logit 0: greedy picks id 0, the data's EOS, first
        generated = theirs.generate(prompt, max_new_tokens=8, do_sample=False)
    assert generated[0, prompt.shape[1]:].tolist() == [0]  # one token, the EOS, and it stops
