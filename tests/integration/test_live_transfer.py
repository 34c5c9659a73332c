"""The live switch's transfer in one process: served, fetched, verified; a corrupted, stalled or forged slice refused.

The end-to-end switch between two plans (real old and new ranks, the disk path after a failed
transfer) is in test_live_switch.py; these check the transfer's own promises in a second each:
what arrives equals what was offered, and nothing that differs from the offer is loaded.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hetrain.checkpoint.live import FAULT_LIVE, LiveReader, LiveTransferError, offer_state


@pytest.fixture
def world(tmp_path: Path):
    """A gloo world of one process (``offer_state`` gathers the ranks' tables over it)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def state() -> dict:
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(64, 32), "b": torch.randn(32)}, "step": 7}


def offer(tmp_path: Path, group, fault: str | None, monkeypatch) -> tuple[dict, object]:
    if fault:
        monkeypatch.setenv(FAULT_LIVE, f"{fault}:0")  # read when the rank's server starts
    server = offer_state(7, state(), group, node="a", host="127.0.0.1", offer_file=str(tmp_path / "offer"))
    return json.loads((tmp_path / "offer").read_text()), server


def load(offered: dict, deadline_s: float = 10.0) -> tuple[dict, LiveReader]:
    target = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}, "step": 0}
    reader = LiveReader(offered, time.time() + deadline_s)
    dcp.load(target, storage_reader=reader)
    return target, reader


def failure(error: BaseException) -> str:
    """DCP gathers a read's failure into a CheckpointException: the reader's own message."""
    if isinstance(error, CheckpointException):
        return "; ".join(str(f[0] if isinstance(f, tuple) else f) for f in error.failures.values())
    return str(error)


def test_the_offered_state_arrives_whole_and_equal(tmp_path: Path, world, monkeypatch):
    offered, server = offer(tmp_path, world, None, monkeypatch)
    try:
        loaded, reader = load(offered)
    finally:
        server.close()
    want = state()
    assert torch.equal(loaded["model"]["w"], want["model"]["w"]) and torch.equal(loaded["model"]["b"], want["model"]["b"])
    assert loaded["step"] == 7 and offered["step"] == 7
    assert reader.bytes_read >= (64 * 32 + 32) * 4  # the tensors' bytes came over HTTP


@pytest.mark.parametrize("fault,why", [("corrupt", "SHA-256"), ("stall", "deadline")])
def test_a_corrupted_or_stalled_slice_is_refused(tmp_path: Path, world, monkeypatch, fault, why):
    offered, server = offer(tmp_path, world, fault, monkeypatch)
    started = time.monotonic()
    try:
        with pytest.raises((LiveTransferError, CheckpointException)) as caught:
            load(offered, deadline_s=1.0)
    finally:
        server.close()
    assert why in failure(caught.value)
    assert time.monotonic() - started < 10  # a stall ends at the deadline, not at the server's patience


def test_an_offer_that_lies_about_its_bytes_loads_nothing(tmp_path: Path, world, monkeypatch):
    """The offer comes through the controller from an old rank: a forged digest is a refusal, not a load."""
    offered, server = offer(tmp_path, world, None, monkeypatch)
    forged = copy.deepcopy(offered)
    name = next(iter(forged["files"]))
    forged["files"][name]["items"][0][2] = "0" * 64
    index = copy.deepcopy(offered)
    index["metadata"]["sha256"] = "0" * 64
    try:
        for bad, why in ((forged, "SHA-256"), (index, "index's SHA-256")):
            with pytest.raises((LiveTransferError, CheckpointException)) as caught:
                load(bad)
            assert why in failure(caught.value)
    finally:
        server.close()
