"""The gradient sync in chunks (``GRAD_SYNC_CHUNK_NUMEL``): the same sums, steps and gathers as one collective
per bucket, and a transient of one chunk, not the bucket.

Two gloo processes; each holds the same parameters with its own gradients. Every path runs twice, with a
chunk longer than the bucket (one collective, what the runtime did before chunking) and with a chunk shorter
than most tensors (slices of one tensor, several tensors packed, padded shares): the results must be equal
bit for bit (two ranks' sums do not depend on the order).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import spawn_ranks


SHAPES = [(13, 5), (7,), (40, 3), (2, 2), (9, 11)]  # 65, 7, 120, 4, 99 elements
SMALL, WHOLE = 17, 10_000


def _params(rank: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    grads = torch.Generator().manual_seed(1 + rank)
    for p in params:
        p.grad = torch.randn(p.shape, generator=grads)
    return params


def _worker(rank: int, port: int, out: str) -> None:
    from hetrain.runtime.parallelize import sync_gradients
    from hetrain.runtime.zero import ShardBucket

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    results = {}
    for name, limit in (("whole", WHOLE), ("small", SMALL)):
        params = _params(rank)
        sync_gradients([(group, params)], torch.float32, chunk_numel=limit)
        results[f"allreduce-{name}"] = [p.grad.tolist() for p in params]
        params = _params(rank)
        sync_gradients([(group, params)], torch.bfloat16, chunk_numel=limit)
        results[f"allreduce-bf16-{name}"] = [p.grad.tolist() for p in params]
        params = _params(rank)
        bucket = ShardBucket([(f"p{i}", p) for i, p in enumerate(params)], group, rank, [0, 1], None,
                             offload=False, fused=False, chunk_numel=limit)
        bucket.reduce_scatter(torch.float32)
        results[f"rows-{name}"] = [g.tolist() for g in bucket.grads]
        bucket.step(0.5, {"betas": (0.9, 0.95), "lr": 0.1, "weight_decay": 0.01, "eps": 1e-8})
        results[f"params-{name}"] = [p.detach().tolist() for p in params]
        results[f"chunks-{name}"] = len(bucket.param_chunks)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def synced(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("sync")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn_ranks(_worker, (port, str(out)), nprocs=2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_chunked_all_reduce_sums_like_one_collective(synced):
    for rank in synced:
        assert rank["allreduce-small"] == rank["allreduce-whole"]
        assert rank["allreduce-bf16-small"] == rank["allreduce-bf16-whole"]
    for i, got in enumerate(synced[0]["allreduce-whole"]):  # the sum over both ranks
        assert torch.allclose(torch.tensor(got), _params(0)[i].grad + _params(1)[i].grad)


def test_chunked_sharded_bucket_reduces_steps_and_gathers_like_one_collective(synced):
    assert synced[0]["chunks-whole"] == 1 and synced[0]["chunks-small"] == len(SHAPES)
    for rank in synced:
        assert rank["rows-small"] == rank["rows-whole"]
        assert rank["params-small"] == rank["params-whole"]
    assert synced[0]["params-small"] == synced[1]["params-small"]  # every replica whole again after the gather
    assert synced[0]["params-small"] != [p.detach().tolist() for p in _params(0)]  # the step moved them
