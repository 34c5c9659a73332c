"""The gradient sync's chunks (``GRAD_SYNC_CHUNK_NUMEL``): whole tensors packed up to the limit. The collectives
in chunks, on two gloo processes, are in tests/integration/test_sync_chunks.py."""

from __future__ import annotations

from hetrain.spec.arithmetic import sync_chunks


def test_sync_chunks_pack_whole_tensors_up_to_the_limit():
    assert sync_chunks([65, 7, 120, 4, 99], 70) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert sync_chunks([5, 7, 120, 4, 2], 12) == [(0, 2), (2, 3), (3, 5)]
    assert sync_chunks([5, 7], 1000) == [(0, 2)]
    assert sync_chunks([], 10) == []
