"""Tied embeddings (Llama 3.2 1B/3B, the small Qwens): the LM head is the token embedding's weight.

One stage holding both ends holds one Parameter; where the ends sit on different ranks each keeps a
copy and the tied bucket (``SyncBucket.tied``: every first and last stage, per TP rank, Megatron's
embedding group across pipelines) sums their gradients. The trainings of asymmetric plans against one
process are in tests/integration/test_tied.py.
"""

from __future__ import annotations

import torch

from hetrain.plan.layout import build_layout
from hetrain.plan.schema import Plan
from hetrain.runtime.model import GPT
from hetrain.runtime.parallelize import bucket_params, norm_counted
from hetrain.spec.arithmetic import total_params
from tests.helpers.models import TIED, tied_plan


def test_one_stage_holds_one_weight_and_counts_it_once():
    whole = GPT(TIED)
    assert whole.head.weight is whole.tok_embedding.weight
    assert total_params(TIED) == sum(p.numel() for p in whole.parameters())
    first, last = GPT(TIED, (0, 2)), GPT(TIED, (2, 6))
    first.init_weights(3), last.init_weights(3), whole.init_weights(3)
    assert torch.equal(first.tok_embedding.weight, last.head.weight)  # the copies start alike
    assert torch.equal(last.head.weight, whole.head.weight)
    assert all(p is not last.head.weight for p in norm_counted(last, list(last.parameters())))  # counted on the first
    assert len(norm_counted(whole, list(whole.parameters()))) == len(list(whole.parameters()))


def test_the_cost_model_holds_the_tied_weight_once_on_a_stage_with_both_ends():
    from hetrain.cost.costmodel import CostModel
    from hetrain.spec.specs import ClusterSpec, TrainingSettings

    cluster = ClusterSpec.model_validate({"name": "c", "nodes": [{"name": "a", "gpu": "A100-80G", "count": 1,
                                                                  "intra_node_bandwidth_gbps": 100}]})
    cost = CostModel(cluster, TIED, TrainingSettings(global_batch_size=8))
    assert cost.stage_params(TIED.num_layers, True, True, 1) == total_params(TIED)
    untied = CostModel(cluster, TIED.model_copy(update={"tie_embeddings": None}), TrainingSettings(global_batch_size=8))
    both_ends = cost.stage_params(0, True, False, 1) + cost.stage_params(0, False, True, 1)
    assert both_ends == untied.stage_params(0, True, True, 1)  # on different stages: a copy each


def test_the_tied_bucket_holds_every_end_of_every_pipeline():
    layout = build_layout(tied_plan(2))
    tied = [b for b in layout.buckets if b.tied]
    # per TP rank: pipeline 0's first stage (ranks 0, 1), its last (2, 3), pipeline 1's one stage (4, 5)
    assert sorted(b.ranks for b in tied) == [(0, 2, 4), (1, 3, 5)]
    first, last, both = GPT(TIED, (0, 2)), GPT(TIED, (2, 6)), GPT(TIED)
    for rank, stage, want in ((0, first, first.tok_embedding.weight), (2, last, last.head.weight),
                              (4, both, both.head.weight)):
        params = [p for b in layout.buckets_of(rank) for p in bucket_params(stage, b)]
        assert sum(p is want for p in params) == 1  # in the tied bucket alone, once
    one_pipeline = Plan.model_validate(tied_plan(1).model_dump() | {"pipelines": [tied_plan(1).pipelines[0]],
                                                                     "global_batch_size": 6})
    assert [(b.ranks, b.tied) for b in build_layout(one_pipeline).buckets] == [((0, 1), True)]


def test_a_checkpoint_holds_the_tied_weight_once_and_loads_onto_either_layout(tmp_path):
    """Saved by one stage holding both ends, or by a last stage holding the head's copy alone: the weight and its
    AdamW state only under the embedding's name; a last stage's copy loads from either (the weight and its state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from hetrain.checkpoint.save import load_training_state, prepare_optimizer_state, training_state

    def stage(layers: tuple[int, int], seed: int) -> tuple[GPT, torch.optim.Optimizer]:
        model = GPT(TIED, layers)
        model.init_weights(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        prepare_optimizer_state(model, opt)
        opt.state[model.head.weight]["exp_avg"].fill_(seed)
        return model, opt

    for saved in ((0, 6), (2, 6)):
        model, opt = stage(saved, 1)
        dcp.save(training_state(model, opt), storage_writer=FsspecWriter(str(tmp_path / str(saved))))
        keys = dcp.FileSystemReader(str(tmp_path / str(saved))).read_metadata().state_dict_metadata
        assert "model.tok_embedding.weight" in keys and "optim.state.tok_embedding.weight.exp_avg" in keys
        assert not any("head.weight" in k for k in keys), sorted(k for k in keys if "head" in k)
        last, last_opt = stage((2, 6), 2)
        load_training_state(str(tmp_path / str(saved)), last, last_opt)
        assert torch.equal(last.head.weight, model.head.weight)
        assert torch.equal(last_opt.state[last.head.weight]["exp_avg"], opt.state[model.head.weight]["exp_avg"])
