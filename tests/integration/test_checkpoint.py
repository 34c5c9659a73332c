"""Sharded checkpoints on real gloo processes: commit by manifest, pruning, exact resharding, faults."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from hetrain.checkpoint.manifest import MANIFEST, METADATA, sha256_file, step_name
from hetrain.checkpoint.store import CheckpointStore
from hetrain.checkpoint.reassemble import Source, find_latest, reassemble
from hetrain.config import CheckpointConfig
from hetrain.errors import HetrainError
from hetrain.spec.schedule import LRSchedule
from tests.helpers.training import dumped_state, plan, run

# Four processes on three nodes: pipeline 0 = a/0 (blocks 0-2) + b/0 (2-6), pipeline 1 = a/1 (0-4) + c/0 (4-6).
SAVE_PP = plan(1, [(5, [("a/0", [0, 2]), ("b/0", [2, 6])]), (3, [("a/1", [0, 4]), ("c/0", [4, 6])])])
# Node c lost: three processes, other cuts and micro-batch shares.
LOAD_PP = plan(1, [(2, [("a/0", [0, 6])]), (6, [("a/1", [0, 3]), ("b/0", [3, 6])])])
# Tensor parallel: one pipeline, two TP-2 stages on nodes a and b.
SAVE_TP = plan(2, [(8, [("a/0", [0, 2]), ("b/0", [2, 6])])])
# Node b lost: two single-device pipelines, no TP.
LOAD_TP = plan(1, [(4, [("a/0", [0, 6])]), (4, [("a/1", [0, 6])])])


def ckpt_config(tmp: Path, **kw) -> CheckpointConfig:
    return CheckpointConfig(local_dir=str(tmp / "nodes" / "{node}"), **kw)


def test_every_node_commits_its_shards_with_a_manifest(tmp_path: Path):
    cfg = ckpt_config(tmp_path, every_steps=2, keep=1)
    run(SAVE_PP, tmp_path / "save", steps=5, checkpoint=cfg)
    fs = LocalFileSystem()
    for node in ("a", "b", "c"):
        root = cfg.node_root(node)
        # steps 1, 3 (every 2) and 4 (the last) were saved; keep=1 leaves the newest
        assert CheckpointStore(root).committed_steps() == [4]
        assert not (Path(root) / step_name(1)).exists() and not (Path(root) / step_name(3)).exists()
        manifest = CheckpointStore(root).read_manifest(4)
        assert manifest.step == 4 and manifest.model == SAVE_PP.model and manifest.plan == SAVE_PP
        held = {f.path for f in manifest.files if node in f.nodes}
        on_disk = {p.name for p in (Path(root) / step_name(4)).iterdir()} - {MANIFEST}
        assert held == on_disk and METADATA in held
        for f in manifest.files:
            if node in f.nodes:
                assert sha256_file(fs, str(Path(root) / step_name(4) / f.path)) == (f.size, f.sha256)
    # each rank's shard lives on its own node only: ranks 0, 1 on a, 2 on b, 3 on c
    # (each rank writes up to write_threads files: __{rank}_{i}.distcp)
    owners: dict[int, set[str]] = {}
    for f in CheckpointStore.for_node(cfg, "a").read_manifest(4).files:
        if f.path != METADATA:
            owners.setdefault(int(f.path.split("_")[2]), set()).update(f.nodes)
    assert owners == {0: {"a"}, 1: {"a"}, 2: {"b"}, 3: {"c"}}


# the continuation check (a third training run, ~25 s here) once: the state loads exactly in both layouts
@pytest.mark.parametrize("save_plan,load_plan,continues", [(SAVE_PP, LOAD_PP, True), (SAVE_TP, LOAD_TP, False)],
                         ids=["pp-4-to-3", "tp2-to-tp1"])
def test_reshard_onto_a_new_plan_is_exact_and_continues(tmp_path: Path, save_plan, load_plan, continues):
    # One uninterrupted run of 5 steps commits at step 2 (every 3) and at its last step, 4: its state at
    # the end is what the step-4 checkpoint must load as, its losses what a run resumed at step 3 must see.
    cfg = ckpt_config(tmp_path, every_steps=3)
    straight = run(save_plan, tmp_path / "save", steps=5, checkpoint=cfg, dump=True)
    saved = dumped_state(save_plan, tmp_path / "save")
    assert any(name.startswith("optim/") and name.endswith("exp_avg_sq") for name in saved)
    schedule = LRSchedule(lr=1e-2, lr_min=1e-3, warmup_steps=1, decay_steps=8, total_steps=5)  # as training.run's
    assert [r["lr"] for r in straight] == pytest.approx([schedule.lr_at(i) for i in range(5)])

    # Every node's files are read where they are (losing their data is the fault tests' business):
    # this is about loading into another layout on fewer devices.
    sources = [Source(n, cfg.node_root(n)) for n in "abc"]
    manifest, _ = find_latest(sources, model=save_plan.model)
    assert manifest.step == 4
    reassemble(manifest, sources, None, str(tmp_path / "restore-4"))
    resumed = tmp_path / "load"
    run(load_plan, resumed, steps=5, start_step=5, resume_from=str(tmp_path / "restore-4"), dump=True)
    loaded = dumped_state(load_plan, resumed)
    assert loaded.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name

    # Training goes on at step 3 from the step-2 commit with the same data: the loss matches the
    # uninterrupted run's. Other schedule options (that would diverge) are given: the checkpoint's
    # schedule holds.
    if not continues:
        return
    source = str(tmp_path / "restore-2")
    reassemble(CheckpointStore.for_node(cfg, "a").read_manifest(2), sources, None, source)
    cont = run(load_plan, tmp_path / "cont", steps=5, start_step=3, resume_from=source,
               warmup_steps=0, decay_steps=100, lr=5.0)
    assert [r["lr"] for r in cont] == pytest.approx([schedule.lr_at(i) for i in (3, 4)])
    assert cont[0]["lr_schedule"] == schedule.model_dump()
    want = {r["step"]: r["loss"] for r in straight}
    got = {r["step"]: r["loss"] for r in cont}
    assert sorted(got) == [3, 4]
    assert got[3] == pytest.approx(want[3], rel=1e-5)
    assert got[4] == pytest.approx(want[4], rel=1e-3)


def test_rank_killed_during_save_leaves_previous_commit(tmp_path: Path, monkeypatch):
    cfg = ckpt_config(tmp_path, every_steps=2, keep=3)
    monkeypatch.setenv("HETRAIN_FAULT_KILL_IN_SAVE", "2:3")  # rank 2 SIGKILLs itself after writing its step-3 shard
    with pytest.raises(HetrainError):
        run(SAVE_PP, tmp_path / "save", steps=5, checkpoint=cfg)
    for node in ("a", "b", "c"):
        assert CheckpointStore.for_node(cfg, node).committed_steps() == [1]
    assert (Path(cfg.node_root("b")) / step_name(3) / "__2_0.distcp").exists()  # written, never committed
    # The previous commit loads and training continues from it.
    monkeypatch.delenv("HETRAIN_FAULT_KILL_IN_SAVE")
    peers = [Source(n, cfg.node_root(n)) for n in "abc"]
    manifest, _ = find_latest(peers)
    assert manifest.step == 1
    reassemble(manifest, peers, None, str(tmp_path / "restore"))
    records = run(SAVE_PP, tmp_path / "again", steps=3, start_step=2, resume_from=str(tmp_path / "restore"))
    assert [r["step"] for r in records] == [2]


def test_buddy_replication_recovers_a_lost_node_without_the_bucket(tmp_path: Path):
    cfg = ckpt_config(tmp_path, every_steps=2, replicate=True)
    records = run(SAVE_PP, tmp_path / "save", steps=2, checkpoint=cfg)
    assert records[-1]["checkpoint_s"] > 0
    # a CPU rank's snapshot buffers are made before its first step: its first checkpoint never waits for them
    assert records[-1]["checkpoint_buffers_made_s"] > 0 and "checkpoint_buffers_waited_s" not in records[-1]
    manifest = CheckpointStore.for_node(cfg, "b").read_manifest(1)
    # ring a -> b -> c -> a: each node keeps the previous node's shards
    holders = {f.path: f.nodes for f in manifest.files if f.path != METADATA}
    expected = {0: ["a", "b"], 1: ["a", "b"], 2: ["b", "c"], 3: ["c", "a"]}  # by rank (__{rank}_{i}.distcp)
    assert holders and all(nodes == expected[int(path.split("_")[2])] for path, nodes in holders.items())
    shutil.rmtree(cfg.node_root("c"))
    peers = [Source(n, cfg.node_root(n)) for n in "ab"]
    report = reassemble(find_latest(peers)[0], peers, None, str(tmp_path / "restore"))
    assert {f.path: f.source for f in report.files}["__3_0.distcp"] == "a"
