"""The checkpoint's host snapshot and writer, without training: buffers made ahead, files hashed as written."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hetrain.checkpoint.snapshot import Snapshot, _leaves, state_bytes
from hetrain.checkpoint.writer import HashingWriter


def _state() -> dict:
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(300, 70), "b": torch.randn(70, dtype=torch.float64),
                      "empty": torch.zeros(0, 5)},
            "optim": {"state.w.step": torch.tensor(3.0), "state.w.exp_avg": torch.randn(300, 70),
                      "param_groups.w.lr": 0.1}, "rng": torch.get_rng_state()}


def test_prepared_buffers_take_exact_copies_each_in_a_storage_of_its_own():
    state = _state()
    snap = Snapshot()
    snap.prepare(state)
    # a host state's buffers are made before prepare returns (a background thread would take its steps' cores)
    assert snap.prepare_s is not None and snap._thread is None
    first = snap.take(state)
    assert snap.waited_s < 0.05
    pointers = [t.data_ptr() for t in _leaves(first) if t.numel()]
    for a, b in zip(_leaves(first), _leaves(state)):
        assert torch.equal(a, b) and a.dtype == b.dtype
        # DCP's writer clones a tensor whose storage is larger than itself (a second copy per commit)
        assert a.untyped_storage().size() == a.nbytes
    state["model"]["w"].add_(1.0)
    second = snap.take(state)
    assert [t.data_ptr() for t in _leaves(second) if t.numel()] == pointers  # the same buffers, reused
    assert torch.equal(second["model"]["w"], state["model"]["w"])
    assert second["optim"]["param_groups.w.lr"] == 0.1


def test_a_state_over_the_budget_does_not_fit():
    state = _state()
    assert not Snapshot(budget_bytes=state_bytes(state) - 1).fits(state)
    assert Snapshot(budget_bytes=state_bytes(state)).fits(state)


def test_the_writer_hashes_what_reaches_the_disk(tmp_path: Path):
    state = {f"t{i}": torch.randn(200, 50 + i) for i in range(9)}
    writer = HashingWriter(str(tmp_path / "ckpt"), thread_count=4)
    dcp.save(state, storage_writer=writer)
    shards = {name: entry for name, entry in writer.written.items() if name.endswith(".distcp")}
    assert len(shards) == 4  # one file per writer thread
    for name, (size, digest) in shards.items():
        data = (tmp_path / "ckpt" / name).read_bytes()
        assert (size, digest) == (len(data), hashlib.sha256(data).hexdigest())
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ckpt"))
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_the_console_and_prefect_hear_of_skipped_checkpoints_and_long_waits_only():
    from hetrain.runtime.metrics import LONG_CHECKPOINT_WAIT_S, checkpoint_notes

    assert checkpoint_notes({"step": 9, "checkpoint_s": 0.2, "checkpoint_waited_s": LONG_CHECKPOINT_WAIT_S / 2}) == []
    waited, = checkpoint_notes({"step": 9, "checkpoint_waited_s": 12.06})
    assert waited.startswith("checkpoint of step 9 waited 12.1 s for the previous one's commit")
    buffers, = checkpoint_notes({"step": 1, "checkpoint_buffers_waited_s": 3.04})
    assert buffers.startswith("checkpoint of step 1 waited 3.0 s for its host buffers")
    skipped, = checkpoint_notes({"step": 99, "checkpoint_skipped": {"in_flight_step": 49, "skipped_so_far": 1}})
    assert skipped.startswith("checkpoint of step 99 skipped: step 49's is still being committed")


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_state_made_before_the_first_step_trains_exactly_as_one_made_by_it(optimizer):
    """``Checkpointer.prepare`` makes the optimizer's state before the first step (so the snapshot's buffers can be
    made while the first steps run): three steps from it match three steps of an optimizer left to make its own,
    bit for bit, step counts included; a state that exists (a loaded one) is left alone."""
    from hetrain.checkpoint.save import prepare_optimizer_state
    from hetrain.runtime.trainer import optimizer_impl

    def trained(early: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
        opt = cls(model.parameters(), lr=1e-2, weight_decay=0.1, **optimizer_impl(optimizer))
        if early:
            prepare_optimizer_state(model, opt, fresh=True)
            assert bool(opt.state) == (optimizer == "adamw")
            assert all(torch.count_nonzero(t) == 0 for s in opt.state.values() for t in s.values())
        for _ in range(3):
            model(torch.randn(8, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    (lazy, lazy_opt), (early, early_opt) = trained(False), trained(True)
    for a, b in zip(lazy.parameters(), early.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(lazy_opt.state.values(), early_opt.state.values()):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if optimizer == "adamw":
        assert all(float(s["step"]) == 3 for s in early_opt.state.values())
        before = {k: v.clone() for k, v in early_opt.state[next(early.parameters())].items()}
        prepare_optimizer_state(early, early_opt, fresh=True)
        after = early_opt.state[next(early.parameters())]
        assert all(torch.equal(before[k], after[k]) for k in before)
