"""fp8 matmuls through torchao's float8 training, on CPU by its emulation (the same casts and scales)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetrain.cost.formats import fp8_weight_copy_bytes
from hetrain.errors import HetrainError
from hetrain.runtime.fp8 import apply_fp8
from hetrain.runtime.model import GPT, lm_loss
from hetrain.runtime.precision import apply_mixed_precision
from hetrain.spec.specs import load_model
from tests.helpers import EXAMPLES

pytest.importorskip("torchao", reason="the fp8 extra (the test extra installs it)")
SPEC = load_model(EXAMPLES / "models" / "llama-tiny.yaml")


def _loss_and_grads(fp8: bool) -> tuple[float, dict[str, torch.Tensor]]:
    model = GPT(SPEC)
    model.init_weights(0)
    apply_mixed_precision(model, "bf16", "cpu", is_last=True)
    if fp8:
        assert apply_fp8(model, "bf16", torch.device("cpu"), tp=1) == 7 * SPEC.num_layers  # q k v o, w1 w3 w2
    tokens = torch.randint(0, SPEC.vocab_size, (4, SPEC.seq_length + 1), generator=torch.Generator().manual_seed(0))
    loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_fp8_blocks_train_close_to_bf16_and_keep_fp32_weights():
    loss_bf16, grads_bf16 = _loss_and_grads(fp8=False)
    loss_fp8, grads_fp8 = _loss_and_grads(fp8=True)
    assert loss_fp8 == pytest.approx(loss_bf16, rel=0.02)  # e4m3 forward, e5m2 gradients, scaled per tensor
    assert grads_fp8.keys() == grads_bf16.keys()
    for name, g in grads_fp8.items():
        assert g.dtype == torch.float32 and torch.isfinite(g).all(), name
        cos = nn.functional.cosine_similarity(g.flatten(), grads_bf16[name].flatten(), dim=0)
        assert cos > 0.95, (name, float(cos))


@pytest.mark.parametrize("precision, tp, expected", [
    ("fp16", 1, "--fp8: expected the stage in bf16 around its fp8 matmuls, got precision fp16"),
    ("bf16", 2, "--fp8: tensor parallelism (tp 2) with fp8 is not supported yet; plan with tp 1"),
])
def test_fp8_refuses_what_it_cannot_run_in_one_line(precision, tp, expected):
    with pytest.raises(HetrainError, match="^" + expected.replace("(", r"\(").replace(")", r"\)") + "$"):
        apply_fp8(GPT(SPEC), precision, torch.device("cpu"), tp=tp)


def _saved_bytes(fp8: bool) -> int:
    """Bytes autograd keeps for backward of one forward of two sequences, parameters aside (distinct storages)."""
    model = GPT(SPEC)
    model.init_weights(0)
    apply_mixed_precision(model, "bf16", "cpu", is_last=True)
    if fp8:
        apply_fp8(model, "bf16", torch.device("cpu"), tp=1)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.randint(0, SPEC.vocab_size, (2, SPEC.seq_length + 1), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    return sum(kept.values())


def test_fp8_saves_the_parameters_where_autocast_saves_16_bit_copies_as_the_cost_model_counts():
    """What ``hetrain.cost.formats`` prices an fp8 stage's memory at: a ``Float8Linear`` keeps its bf16 input, as
    autocast's linear does, and the fp32 parameter itself instead of a bf16 copy of the weight."""
    assert _saved_bytes(fp8=False) - _saved_bytes(fp8=True) == SPEC.num_layers * fp8_weight_copy_bytes(SPEC, 1)
