"""Recovery against real parts: a moto S3 server on loopback, HTTP peers on 127.0.0.x, gloo ranks.

One training run (module fixture) leaves a committed checkpoint on three nodes' directories
and in the bucket; each test copies what it needs and breaks it its own way.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from moto.server import ThreadedMotoServer

from hetrain.checkpoint.manifest import MANIFEST, step_name
from hetrain.checkpoint.store import CheckpointStore
from hetrain.checkpoint.peer import PeerServer
from hetrain.checkpoint.reassemble import Source, find_latest, reassemble
from hetrain.config import CheckpointConfig, RunConfig
from hetrain.errors import HetrainError
from hetrain.recovery.recover import recover
from hetrain.runtime.launch import free_port, write_config
from solver.planners.registry import make_plan
from tests.helpers.training import CLUSTER_YAML, TINY, moto_bucket, plan, run

BUCKET = "hetrain-test"
SAVE = plan(1, [(5, [("a/0", [0, 2]), ("b/0", [2, 6])]), (3, [("a/1", [0, 4]), ("c/0", [4, 6])])])
@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on loopback with this module's bucket: (endpoint, filesystem)."""
    with moto_bucket(BUCKET) as found:
        yield found


@pytest.fixture(scope="module")
def trained(tmp_path_factory, s3):
    """Steps 0-3 on nodes a, b, c; checkpoints at steps 1 and 3, both backed up."""
    endpoint, fs = s3
    base = tmp_path_factory.mktemp("trained")
    cfg = CheckpointConfig(local_dir=str(base / "nodes" / "{node}"), every_steps=2, keep=2,
                           remote_url=f"s3://{BUCKET}/base", remote_options={"endpoint_url": endpoint})
    run(SAVE, base / "train", steps=4, checkpoint=cfg)
    return base, cfg


def copy_run(trained, s3, dest: Path, name: str) -> CheckpointConfig:
    """This test's own copy of the node directories and of the bucket prefix."""
    base, cfg = trained
    endpoint, fs = s3
    shutil.copytree(base / "nodes", dest / "nodes")
    fs.copy(f"{BUCKET}/base", f"{BUCKET}/{name}", recursive=True)
    fs.invalidate_cache()
    return cfg.model_copy(update={"local_dir": str(dest / "nodes" / "{node}"), "remote_url": f"s3://{BUCKET}/{name}"})


def remote_source(cfg: CheckpointConfig) -> Source:
    return Source("remote", CheckpointStore.for_remote(cfg), remote=True)


def test_training_backs_checkpoints_up_to_the_bucket(trained, s3):
    base, cfg = trained
    assert CheckpointStore.for_remote(cfg).committed_steps() == [1, 3]
    remote = CheckpointStore.for_remote(cfg).read_manifest(3)
    assert remote == CheckpointStore.for_node(cfg, "a").read_manifest(3)
    fs = s3[1]
    for f in remote.files:
        assert fs.size(f"{BUCKET}/base/{step_name(3)}/{f.path}") == f.size


def test_lost_node_recovers_from_peers_and_bucket_and_resumes(trained, s3, tmp_path: Path):
    """Node c is gone with its disk: a and b serve over HTTP, c's shard comes from the bucket."""
    cfg = copy_run(trained, s3, tmp_path, "lost-c")
    shutil.rmtree(cfg.node_root("c"))
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER_YAML)
    with PeerServer(cfg.node_root("a"), host="127.0.0.2") as peer_a, \
            PeerServer(cfg.node_root("b"), host="127.0.0.3") as peer_b:
        cfg = cfg.model_copy(update={"peers": {"a": peer_a.url, "b": peer_b.url, "c": "http://127.0.0.4:9"}})
        run_dir = tmp_path / "run"
        # the run as hetrain train left it: its config names the plan, the cluster and the checkpoints
        SAVE.write(tmp_path / "plan.json")
        write_config(RunConfig(plan=str(tmp_path / "plan.json"), cluster=str(cluster), steps=6, lr=1e-2,
                               checkpoint=cfg), run_dir)
        result = recover(run_dir, ["c"], lambda cl, m, s: make_plan("hetrain", cl, m, s).plan, timeout_s=2)
    assert result.step == 3
    sources = {f.path: f.source for f in result.fetch.files}
    assert sources["__3_0.distcp"] == "remote"  # rank 3 lived on c
    assert {sources[p] for p in ("__0_0.distcp", "__1_0.distcp")} == {"a"}
    assert sources["__2_0.distcp"] == "b"
    assert "c" not in {d.split("/")[0] for d in result.plan.devices()}
    assert [r["step"] for r in result.records] == [4, 5]
    assert set(result.timings_s) >= {"replan_s", "fetch_s", "load_s", "first_step_s"}
    resumed = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [4, 5] and "resume_load_s" in resumed[0]
    # the resumed run keeps checkpointing into the survivors' directories
    assert CheckpointStore.for_node(cfg, "a").committed_steps()[-1] == 5


def test_corrupt_peer_file_is_refetched_from_the_bucket(trained, s3, tmp_path: Path):
    cfg = copy_run(trained, s3, tmp_path, "corrupt")
    shard = Path(cfg.node_root("a")) / step_name(3) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    peers = [Source(n, cfg.node_root(n)) for n in "abc"]
    manifest, _ = find_latest(peers)
    report = reassemble(manifest, peers, remote_source(cfg), str(tmp_path / "restore"))
    fetched = {f.path: f for f in report.files}
    assert fetched["__0_0.distcp"].source == "remote"
    assert "checksum mismatch" in fetched["__0_0.distcp"].skipped[0]
    assert all(f.source != "remote" for p, f in fetched.items() if p != "__0_0.distcp")
    want = Path(trained[1].node_root("a")) / step_name(3) / "__0_0.distcp"
    assert (tmp_path / "restore" / "__0_0.distcp").read_bytes() == want.read_bytes()


def test_silent_peer_times_out_and_the_bucket_serves(trained, s3, tmp_path: Path):
    cfg = copy_run(trained, s3, tmp_path, "silent")
    silent = socket.socket()
    silent.bind(("127.0.0.5", 0))
    silent.listen(16)  # accepts connections, never answers
    try:
        peers = [Source("a", f"http://127.0.0.5:{silent.getsockname()[1]}"), Source("b", cfg.node_root("b")),
                 Source("c", cfg.node_root("c"))]
        manifest, _ = find_latest(peers[1:])
        t0 = time.perf_counter()
        report = reassemble(manifest, peers, remote_source(cfg), str(tmp_path / "restore"), timeout_s=1.0)
        assert time.perf_counter() - t0 < 20
    finally:
        silent.close()
    fetched = {f.path: f for f in report.files}
    for path in ("__0_0.distcp", "__1_0.distcp"):  # a's shards
        assert fetched[path].source == "remote" and "Timeout" in fetched[path].skipped[0]


def test_missing_everywhere_is_a_clear_error_and_loads_nothing(trained, s3, tmp_path: Path):
    cfg = copy_run(trained, s3, tmp_path, "missing")
    shutil.rmtree(cfg.node_root("c"))
    s3[1].rm(f"{BUCKET}/missing/{step_name(3)}/__3_0.distcp")
    peers = [Source(n, cfg.node_root(n)) for n in "ab"]
    manifest, _ = find_latest(peers + [remote_source(cfg)])
    with pytest.raises(HetrainError, match=r"file __3_0\.distcp could not be fetched from any source \(remote: not found\)"):
        reassemble(manifest, peers, remote_source(cfg), str(tmp_path / "restore"))
    assert not (tmp_path / "restore").exists() and not (tmp_path / "restore.partial").exists()


def test_manifest_of_another_model_is_refused(trained):
    base, cfg = trained
    other = TINY.model_copy(update={"hidden_size": 128})
    with pytest.raises(HetrainError, match="checkpoint is of model 'gpt-tiny'.*not the run's"):
        find_latest([Source("a", cfg.node_root("a"))], model=other)


def test_peer_server_is_confined_to_its_root_and_checks_the_token(trained, tmp_path: Path, monkeypatch):
    base, cfg = trained
    (Path(cfg.node_root("a")).parent / "secret.txt").write_text("not for peers")
    with PeerServer(cfg.node_root("a"), host="127.0.0.6", token="s3cret") as peer:
        def get(path: str, token: str | None = "s3cret") -> int:
            req = urllib.request.Request(peer.url + path, headers={"Authorization": f"Bearer {token}"} if token else {})
            try:
                with urllib.request.urlopen(req, timeout=5) as resp:
                    return resp.status
            except urllib.error.HTTPError as e:
                return e.code

        assert get(f"/{step_name(3)}/{MANIFEST}") == 200
        assert get("/_steps") == 200
        assert get(f"/{step_name(3)}/{MANIFEST}", token=None) == 401
        assert get(f"/{step_name(3)}/{MANIFEST}", token="wrong") == 401
        for escape in ("/../secret.txt", "/%2e%2e/secret.txt", f"/{step_name(3)}/../../secret.txt"):
            assert get(escape) == 404, escape
        # through fsspec: without the token the peer is skipped, with it the peer serves
        src = Source("a", peer.url)
        with pytest.raises(Exception, match="401"):
            src.steps(2.0)
        monkeypatch.setenv("HETRAIN_PEER_TOKEN", "s3cret")
        assert src.steps(2.0) == [1, 3]
    # a node serving its whole runs root: each checkpoint root below it answers /_steps, nothing above it
    with PeerServer(Path(cfg.node_root("a")).parent, host="127.0.0.6", token="s3cret") as peer:
        assert Source("a", f"{peer.url}/a").steps(2.0) == [1, 3]
        assert Source("a", f"{peer.url}/nothing-here").steps(2.0) == []
        for escape in ("/../_steps", "/%2e%2e/_steps", "/a/../../_steps"):
            assert get(escape) == 404, escape


def test_bucket_down_during_upload_is_retried_and_training_goes_on(s3, tmp_path: Path, botocore_tries_once):
    """The store is down when training starts; it comes back only after an upload has failed and is retrying."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    late = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    log = tmp_path / "train" / "run" / "launch.log"
    came_back: list[float] = []

    def start_after_a_retry() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if log.exists() and "retry" in log.read_text():
                late.start()
                came_back.append(time.time())
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=start_after_a_retry, daemon=True)
    watcher.start()
    try:
        cfg = CheckpointConfig(local_dir=str(tmp_path / "nodes" / "{node}"), every_steps=1, keep=2,
                               remote_url=f"s3://{BUCKET}/late", remote_options={"endpoint_url": endpoint},
                               upload_retries=10)
        records = run(SAVE, tmp_path / "train", steps=3, checkpoint=cfg)
        watcher.join(5)
        assert came_back, "no upload was retried"
        assert [r["step"] for r in records] == [0, 1, 2]
        # checkpoints were committed locally whatever the store did (the newest 2 kept); once the
        # store was back they reached it too, and the remote keeps the newest 2 as well
        for node in "abc":
            assert CheckpointStore.for_node(cfg, node).committed_steps() == [1, 2]
        assert CheckpointStore.for_remote(cfg).committed_steps() == [1, 2]
        assert "testing" not in log.read_text()  # credentials never logged
    finally:
        if came_back:
            late.stop()


def test_recover_command_rejects_unknown_runs_and_nodes(tmp_path: Path, trained):
    from tests.helpers import run_cli

    r = run_cli("recover", "--run", str(tmp_path / "nowhere"), "--lost-nodes", "c")
    assert r.returncode == 2 and "no config.json there" in r.stderr
    (tmp_path / "cluster.yaml").write_text(CLUSTER_YAML)
    SAVE.write(tmp_path / "plan.json")
    write_config(RunConfig(plan=str(tmp_path / "plan.json"), cluster=str(tmp_path / "cluster.yaml"),
                           checkpoint=trained[1]), tmp_path / "run")
    r = run_cli("recover", "--run", str(tmp_path / "run"), "--lost-nodes", "v100-9")
    assert r.returncode == 2
    assert "lost node 'v100-9' is not a node of cluster" in r.stderr and "(nodes: a, b, c)" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------- untrusted sources


def _rewrite_manifest(root: Path, step: int, edit) -> None:
    path = root / step_name(step) / MANIFEST
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_manifest_path_outside_the_step_directory_is_refused(trained, s3, tmp_path: Path):
    """A peer lists '../../../../evil' (with a matching sha256): it is not fetched anywhere; another holder's manifest is used."""
    import hashlib

    cfg = copy_run(trained, s3, tmp_path, "traversal")
    root_a = Path(cfg.node_root("a"))
    payload = b"written by an attacker"
    target = tmp_path / "evil"
    planted = root_a / step_name(3) / "../../../../evil"
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_bytes(payload)
    _rewrite_manifest(root_a, 3, lambda m: m["files"].append(
        {"path": "../../../../evil", "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
         "nodes": ["a"]}))
    with pytest.raises(HetrainError, match=r"files\.\d+\.path: .*'\.\./\.\./\.\./\.\./evil' is not a checkpoint file"):
        CheckpointStore(str(root_a)).read_manifest(3)
    peers = [Source(n, cfg.node_root(n)) for n in "abc"]
    manifest, source = find_latest(peers)
    assert all(f.path != "../../../../evil" for f in manifest.files)  # b's manifest: a's was refused
    restore = tmp_path / "restore" / "x"
    reassemble(manifest, peers, None, str(restore))
    assert not target.exists() and not (restore.parent / "evil").exists()
    assert sorted(p.name for p in restore.iterdir()) == sorted([f.path for f in manifest.files] + [MANIFEST])


def test_crafted_metadata_never_runs_and_recovery_takes_an_older_step(trained, s3, tmp_path: Path):
    """Node a serves a DCP .metadata that would run code when unpickled, with a manifest vouching for it."""
    import hashlib
    import os
    import pickle

    from hetrain.checkpoint.reassemble import reassemble_newest

    marker = tmp_path / "code-ran"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    cfg = copy_run(trained, s3, tmp_path, "pickle")
    root_a = Path(cfg.node_root("a"))
    evil = pickle.dumps(Exploit())
    (root_a / step_name(3) / ".metadata").write_bytes(evil)

    def vouch(m):
        for f in m["files"]:
            if f["path"] == ".metadata":
                f["size"], f["sha256"] = len(evil), hashlib.sha256(evil).hexdigest()

    _rewrite_manifest(root_a, 3, vouch)
    peers = [Source(n, cfg.node_root(n)) for n in "abc"]
    manifest, source = find_latest(peers)
    assert source.name == "a"
    with pytest.raises(HetrainError, match=r"a: .*asks for posix\.system, which is not a DCP metadata type"):
        reassemble(manifest, peers, None, str(tmp_path / "direct"))
    report = reassemble_newest(peers, None, lambda s: str(tmp_path / "restore" / step_name(s)))
    assert report.step == 1 and not marker.exists()
    # the step-1 copy loads (through the same restricted reader the ranks use)
    from hetrain.checkpoint.safe_metadata import load_metadata

    load_metadata((tmp_path / "restore" / step_name(1) / ".metadata").read_bytes(), "restored")
    assert not marker.exists()


def test_bytes_entries_are_loaded_without_running_code(tmp_path: Path):
    """DCP keeps non-tensor values as torch.save bytes; a crafted one must not run code, nor replace a tensor."""
    import io
    import os
    from types import SimpleNamespace

    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    from hetrain.checkpoint.safe_metadata import SafeLoadPlanner, UnsafeMetadata

    marker = tmp_path / "code-ran"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    planner = SafeLoadPlanner()
    planner.set_up_planner({"w": torch.zeros(2), "lr": 0.1},
                           Metadata(state_dict_metadata={"w": BytesStorageMetadata(), "lr": BytesStorageMetadata()}),
                           is_coordinator=True)
    with pytest.raises(UnsafeMetadata, match="entry w is stored as bytes, but it is a tensor"):
        planner.create_local_plan()
    payload = io.BytesIO()
    torch.save(Exploit(), payload)
    payload.seek(0)
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="lr"))
    with pytest.raises(UnsafeMetadata, match="entry lr: not a plain value"):
        planner.load_bytes(item, payload)
    assert not marker.exists()
    plain = io.BytesIO()
    torch.save(0.25, plain)
    plain.seek(0)
    planner.load_bytes(item, plain)
    assert planner.original_state_dict["lr"] == 0.25


# --------------------------------------------------------------------------- failures that must surface


def test_an_unreadable_newest_manifest_falls_back_to_the_step_before_and_says_why(trained, s3, tmp_path: Path):
    from hetrain.checkpoint.reassemble import reassemble_newest

    cfg = copy_run(trained, s3, tmp_path, "torn")
    for node in "abc":  # step 3's manifest damaged on every peer, and the bucket's too
        (Path(cfg.node_root(node)) / step_name(3) / MANIFEST).write_text('{"run_id": "run", "st')
    endpoint, fs = s3
    fs.pipe(f"{BUCKET}/torn/{step_name(3)}/{MANIFEST}", b"\x00\x01")
    peers = [Source(n, cfg.node_root(n)) for n in "abc"]
    report = reassemble_newest(peers, remote_source(cfg), lambda s: str(tmp_path / "restore" / step_name(s)))
    assert report.step == 1
    assert len(report.passed_over) == 1 and report.passed_over[0].startswith("step 3: manifest of step 3 unreadable")
    assert any(w.startswith("passed over step 3") for w in report.warnings())


def test_a_wrong_peer_token_is_named_as_the_reason(trained, monkeypatch):
    from hetrain.checkpoint.reassemble import committed_by_source

    base, cfg = trained
    with PeerServer(cfg.node_root("a"), token="s3cret") as peer:
        monkeypatch.setenv("HETRAIN_PEER_TOKEN", "wrong")
        holders, errors = committed_by_source([Source("a", peer.url)], 2.0)
    assert not holders
    assert errors == ["a: refused our peer token (HTTP 401): give this node the $HETRAIN_PEER_TOKEN that "
                      "`hetrain serve` there was started with"]


def test_a_store_that_fails_every_upload_is_exit_3_with_one_line(tmp_path: Path, s3, botocore_tries_once):
    from tests.helpers import run_cli

    one = plan(1, [(8, [("a/0", [0, 6])])])
    one.write(tmp_path / "plan.json")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    r = run_cli("train", "--plan", str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "run"), "--steps", "2",
                "--remote", f"s3://{BUCKET}/dead", "--remote-endpoint", dead, "--upload-retries", "0")
    assert r.returncode == 3, r.stderr
    assert "done: 2 steps" in r.stdout
    lines = [line for line in r.stderr.splitlines() if line.startswith("backup:")]
    assert len(lines) == 1 and f"step 1 did not reach s3://{BUCKET}/dead" in lines[0]
    assert "committed on the nodes' disks" in lines[0]
    status = json.loads((tmp_path / "run" / "backup.json").read_text())
    assert status["newest_local_step"] == 1 and status["uploaded_steps"] == [] and status["failed"][0]["step"] == 1
    assert CheckpointStore(str(tmp_path / "run" / "checkpoints" / "a")).committed_steps() == [1]


def test_a_checkpoint_root_of_another_run_is_refused_and_never_pruned(trained, s3, tmp_path: Path):
    from tests.helpers import run_cli

    cfg = copy_run(trained, s3, tmp_path, "foreign")  # steps 1 and 3 of run 'run'
    SAVE.write(tmp_path / "plan.json")
    r = run_cli("train", "--plan", str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "mine"), "--steps", "2",
                "--checkpoint-dir", cfg.local_dir)
    assert r.returncode == 2
    assert f"--checkpoint-dir {cfg.node_root('a')}: holds committed checkpoints of run 'run' (newest: step 3)" in r.stderr
    assert not (tmp_path / "mine").exists() or not any((tmp_path / "mine").iterdir())
    assert CheckpointStore.for_node(cfg, "a").prune(keep=1, run_id="mine") == []
    assert CheckpointStore.for_node(cfg, "a").committed_steps() == [1, 3]
    assert CheckpointStore.for_node(cfg, "a").prune(keep=1, run_id="run") == [1]


def test_each_surviving_node_restores_from_its_own_disk_first(trained, s3, tmp_path: Path):
    """Node c is gone: a and b each restore the step on their own, reading their own shards from
    their disks, the other survivor's over its peer server and c's from the bucket."""
    from hetrain.recovery.recover import restore_on_node

    cfg = copy_run(trained, s3, tmp_path, "per-node")
    shutil.move(cfg.node_root("c"), tmp_path / "c-leaving")
    manifest = CheckpointStore.for_node(cfg, "a").read_manifest(3)
    size = {f.path: f.size for f in manifest.files}
    held = {node: {f.path for f in manifest.files if node in f.nodes} for node in "ab"}
    with PeerServer(cfg.node_root("a"), host="127.0.0.2") as peer_a, \
            PeerServer(cfg.node_root("b"), host="127.0.0.3") as peer_b:
        cfg = cfg.model_copy(update={"peers": {"a": peer_a.url, "b": peer_b.url, "c": "http://127.0.0.4:9"}})
        config = RunConfig(plan="plan.json", steps=6, checkpoint=cfg)
        for node, other in (("a", "b"), ("b", "a")):
            report = restore_on_node(config, SAVE, node, ["c"], lambda s, n=node: str(tmp_path / n / f"step-{s}"),
                                     timeout_s=2)
            assert report.step == 3
            sources = {f.path: f.source for f in report.files}
            assert {p for p, src in sources.items() if src == node} == held[node]  # none of its bytes moved
            kinds = report.by_kind(node)
            assert kinds["local"] == sum(size[p] for p in held[node])
            assert kinds["peers"] == sum(size[p] for p, src in sources.items() if src == other) > 0
            assert sources["__3_0.distcp"] == "remote" and kinds["remote"] >= size["__3_0.distcp"]
            assert (tmp_path / node / "step-3" / MANIFEST).exists()  # whole and verified, committed last
        # c inside its notice window: its server still answers (its disk kept aside here), so its shard
        # comes from it rather than the bucket; gone (a dead address), the bucket as before
        with PeerServer(str(tmp_path / "c-leaving"), host="127.0.0.4") as peer_c:
            leaving = config.model_copy(update={"checkpoint": cfg.model_copy(update={
                "peers": {**cfg.peers, "c": peer_c.url}})})
            report = restore_on_node(leaving, SAVE, "a", ["c"], lambda s: str(tmp_path / "a-window" / f"step-{s}"),
                                     timeout_s=2, still_up=["c"])
        assert {f.path: f.source for f in report.files}["__3_0.distcp"] == "c"
        report = restore_on_node(config, SAVE, "a", ["c"], lambda s: str(tmp_path / "a-gone" / f"step-{s}"),
                                 timeout_s=2, still_up=["c"])
        assert {f.path: f.source for f in report.files}["__3_0.distcp"] == "remote"
        everything = restore_on_node(config, SAVE, "a", ["c"], lambda s: str(tmp_path / "a-bucket" / f"step-{s}"),
                                     timeout_s=2, use_peers=False)  # the restart-from-the-bucket baseline
        assert everything.by_kind("a") == {"local": 0, "peers": 0, "remote": sum(size.values())}
    with pytest.raises(HetrainError, match="among the lost nodes"):
        restore_on_node(config, SAVE, "c", ["c"], lambda s: str(tmp_path / "c"))


def test_a_peer_with_a_newer_step_of_another_model_is_passed_over(trained, s3, tmp_path: Path, monkeypatch):
    """One hostile (or misconfigured) peer advertises step 5 of another model: the recovery takes step 3 from the
    node's own disk and the others, and says which peer it passed over and why (issue 33)."""
    import json

    from hetrain.checkpoint.reassemble import reassemble_newest

    cfg = copy_run(trained, s3, tmp_path, "hostile")
    hostile_root = Path(cfg.node_root("b"))
    shutil.copytree(hostile_root / step_name(3), hostile_root / step_name(5))
    manifest = json.loads((hostile_root / step_name(5) / MANIFEST).read_text())
    manifest["step"] = 5
    manifest["model"]["hidden_size"] = 128
    (hostile_root / step_name(5) / MANIFEST).write_text(json.dumps(manifest))
    monkeypatch.setenv("HETRAIN_PEER_TOKEN", "s3cret")
    with PeerServer(hostile_root, host="127.0.0.6", token="s3cret") as hostile:
        assert 5 in Source("b", hostile.url).steps(2.0)
        peers = [Source("a", cfg.node_root("a")), Source("b", hostile.url), Source("c", cfg.node_root("c"))]
        report = reassemble_newest(peers, remote_source(cfg), lambda s: str(tmp_path / "restore" / step_name(s)),
                                   model=TINY, local="a")
    assert report.step == 3
    said = " | ".join(report.warnings())
    assert "peer b:" in said and "checkpoint is of model 'gpt-tiny'" in said and "step 5" in said
    # the same manifest on our own disk is our configuration error: it stops, as before
    with pytest.raises(HetrainError, match="checkpoint is of model"):
        reassemble_newest([Source("b", str(hostile_root))], None, lambda s: str(tmp_path / "again" / step_name(s)),
                          model=TINY, local="b")


def test_a_manifest_that_lists_a_file_twice_or_claims_too_much_is_refused_before_any_fetch(trained, tmp_path: Path,
                                                                                              monkeypatch):
    """Sizes are bounded before fetching (issue 33): by the model's shape and by the destination's free space."""
    import json

    import hetrain.checkpoint.reassemble as reassemble_module
    from hetrain.checkpoint.manifest import max_checkpoint_bytes, parse_manifest

    base, cfg = trained
    good = CheckpointStore.for_node(cfg, "a").read_manifest(3)
    data = json.loads(good.to_json())
    twice = {**data, "files": data["files"] + data["files"][:1]}
    with pytest.raises(HetrainError, match="is listed twice"):
        parse_manifest(json.dumps(twice), "peer b")
    huge = {**data, "files": [{**data["files"][0], "size": 10**12}] + data["files"][1:]}
    with pytest.raises(HetrainError, match="more than a checkpoint of 'gpt-tiny' can hold"):
        parse_manifest(json.dumps(huge), "peer b")
    assert good.total_bytes <= max_checkpoint_bytes(good.model)
    # a destination without room: refused before a byte is fetched, nothing left behind
    monkeypatch.setattr(reassemble_module.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 1))
    with pytest.raises(HetrainError, match="MB free at .*a resume needs"):
        reassemble(good, [Source(n, cfg.node_root(n)) for n in "abc"], None, str(tmp_path / "dest"))
    assert not list(tmp_path.iterdir())


def test_an_index_with_absurd_sizes_is_one_line_in_export(trained, tmp_path: Path):
    """A .metadata made of genuine DCP classes but with sizes no model has: one HetrainError, no traceback."""
    import pickle

    from hetrain.checkpoint.safe_metadata import load_metadata
    from hetrain.export import consolidate

    base, cfg = trained
    step_dir = tmp_path / "step"
    reassemble(CheckpointStore.for_node(cfg, "a").read_manifest(3), [Source(n, cfg.node_root(n)) for n in "abc"],
               None, str(step_dir))
    metadata = load_metadata((step_dir / ".metadata").read_bytes(), "test")
    for entry in metadata.state_dict_metadata.values():
        if hasattr(entry, "size"):
            entry.size = torch.Size([10**12] * len(entry.size))
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(HetrainError, match=".metadata does not describe 'gpt-tiny'"):
        consolidate(str(step_dir), TINY)
