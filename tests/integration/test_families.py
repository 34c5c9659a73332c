"""The families trained from transformers' save: each under two asymmetric pipelines at TP 2, its first loss
transformers'; a tied export that transformers loads and whose ``generate()`` stops at the data's EOS."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hetrain.plan.schema import Plan
from hetrain.runtime.data import TokenSource
from hetrain.runtime.model import GPT, lm_loss
from hetrain.spec.hf import pretrained_spec
from tests.helpers import run_cli
from tests.helpers.models import SEQ, transformers_model
from tests.helpers.training import run

transformers = pytest.importorskip("transformers")


def asymmetric_tp2_plan(spec) -> Plan:
    """Pipeline 0: two stages (blocks 0-1, 1-4); pipeline 1: one stage; TP 2 throughout."""
    def stage(node: str, first: int, layers: list[int]) -> dict:
        return {"devices": [f"{node}/{first}", f"{node}/{first + 1}"], "gpu": "cpu", "layers": layers}

    return Plan.model_validate({
        "schema": "hetrain.plan/v1", "model": spec.model_dump(), "cluster": "test", "global_batch_size": 4,
        "micro_batch_size": 1, "tp": 2,
        "pipelines": [{"num_microbatches": 3, "stages": [stage("a", 0, [0, 1]), stage("a", 2, [1, 4])]},
                      {"num_microbatches": 1, "stages": [stage("b", 0, [0, 4])]}]})


@pytest.mark.parametrize("family", ["llama-3.1", "llama-3.2", "qwen-2.5", "qwen-3", "mistral"])
def test_a_family_trains_from_transformers_loss_under_two_asymmetric_pipelines_at_tp2(tmp_path: Path, family: str):
    """The first loss of a run started with --init-from on transformers' save is transformers' on the same
    batch, for each family issue 46 names: Llama 3.1's rotary scaling, tied weights split by vocabulary on both ends
    (Llama 3.2, Qwen 2.5), Qwen 2.5's q/k/v biases, Qwen 3's head norms summed over the TP group, Mistral."""
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


def test_a_trained_tied_export_loads_in_transformers_and_generate_stops_at_the_datas_eos(tmp_path: Path):
    """Qwen 2.5's shape (q/k/v bias, tied), data made with a bare tokenizer.json whose EOS is id 0, trained two
    steps with the embedding and the head on different ranks, exported: transformers loads the model (the
    hetrain logits) and the tokenizer (EOS, BOS and pad named), and greedy ``generate()`` stops at the EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

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
