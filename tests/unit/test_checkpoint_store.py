"""hetrain.checkpoint.store: one checkpoint root (a URL and its options) on a local disk, in S3 (moto) and behind a
peer server: committed steps, pruning, manifests written and read back, and what comes from a bucket or a peer
checked before it is believed. No training: the steps are hand-made files under a manifest."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hetrain.checkpoint import PEER_TOKEN_ENV
from hetrain.checkpoint.manifest import MANIFEST, METADATA, Manifest, build_manifest, sha256_bytes, step_name
from hetrain.checkpoint.peer import PeerServer
from hetrain.checkpoint.reassemble import Source
from hetrain.checkpoint.store import CheckpointStore
from hetrain.config import CheckpointConfig
from hetrain.errors import HetrainError
from tests.helpers.training import moto_bucket, plan

PLAN = plan(1, [(8, [("a/0", [0, 6])])])
BUCKET = "hetrain-store-unit"  # moto's state is one per process: a bucket name of this module's own


def commit(store: CheckpointStore, step: int, run_id: str = "run") -> Manifest:
    """A step as a save leaves it: a shard and .metadata, then the manifest naming their sizes and hashes."""
    shard, metadata = f"shard of step {step}".encode(), b"metadata"
    store.write_file(step, "__0_0.distcp", shard)
    store.write_file(step, METADATA, metadata)
    manifest = build_manifest(run_id, step, PLAN, "adamw", [("a", [("__0_0.distcp", len(shard), sha256_bytes(shard))])],
                              (len(metadata), sha256_bytes(metadata)))
    store.write_manifest(step, manifest)
    return manifest


def unfinished(store: CheckpointStore, step: int) -> None:
    """A save that never committed: a shard, no manifest."""
    store.write_file(step, "__0_0.distcp", b"half")


@pytest.fixture(scope="module")
def s3():
    with moto_bucket(BUCKET) as found:
        yield found


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path: Path) -> CheckpointStore:
    """An empty root on this machine's disk or in the moto bucket (each test its own prefix)."""
    if request.param == "local":
        return CheckpointStore(str(tmp_path / "root"))
    endpoint, _ = request.getfixturevalue("s3")
    return CheckpointStore(f"s3://{BUCKET}/{tmp_path.name}", {"endpoint_url": endpoint})


def test_committed_steps_are_those_with_a_manifest_oldest_first(store: CheckpointStore):
    assert store.committed_steps() == []  # no root yet: nothing committed, no error
    for step in (12, 3):
        commit(store, step)
    unfinished(store, 20)
    store.fs.pipe_file(f"{store.root}/notes.txt", b"not a step")
    assert store.committed_steps() == [3, 12]


def test_a_manifest_written_is_read_back_whole(store: CheckpointStore):
    manifest = commit(store, 7)
    assert store.read_manifest(7) == manifest
    assert sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(store.step_path(7), detail=False)) == \
        sorted([MANIFEST, METADATA, "__0_0.distcp"])  # no temporary file left beside it


def test_prune_keeps_the_newest_and_never_another_runs_or_a_protected_step(store: CheckpointStore):
    for step in (10, 20, 30, 40):
        commit(store, step)
    commit(store, 5, run_id="other")
    unfinished(store, 15)
    unfinished(store, 45)
    assert sorted(store.prune(keep=2, protect={20}, run_id="run")) == [10, 15]  # an unfinished save older too
    assert store.committed_steps() == [5, 20, 30, 40]  # the other run's step 5 is neither counted nor removed
    assert store.prune(keep=2, run_id="run") == [20]
    assert sorted(store.prune(keep=1)) == [5, 30]  # without a run id every committed step counts
    assert store.committed_steps() == [40]
    assert store.fs.exists(store.step_path(45, "__0_0.distcp"))  # a save newer than the kept step may be under way


def test_a_tampered_manifest_is_refused_naming_the_file(store: CheckpointStore):
    commit(store, 5)
    path = store.step_path(5, MANIFEST)
    good = json.loads(store.fs.cat_file(path))
    tampered = ((r"files\.0\.path: ", {"path": "../../../etc/passwd"}), (r"files\.0\.sha256: ", {"sha256": "x"}),
                (r"manifest: .*files: 1e\+06 GB in all", {"size": 10**15}))  # a peer streaming zeros to fill the disk
    for where, tamper in tampered:
        bad = {**good, "files": [{**good["files"][0], **tamper}, *good["files"][1:]]}
        store.fs.pipe_file(path, json.dumps(bad).encode())
        with pytest.raises(HetrainError, match=f"^{re.escape(store.step_url(5, MANIFEST))}: {where}"):
            store.read_manifest(5)
    store.fs.pipe_file(path, b"{not json")
    with pytest.raises(HetrainError, match=f"^{re.escape(store.step_url(5, MANIFEST))}: "):
        store.read_manifest(5)
    assert store.step_owners() == {5: None}  # damaged: whose it is is unknown, and pruning may age it out


def test_a_run_configs_stores(tmp_path: Path):
    cfg = CheckpointConfig(local_dir=str(tmp_path / "{node}") + "/", remote_url="s3://b/run",
                           remote_options={"endpoint_url": "http://127.0.0.1:9"}, peers={"a": "http://10.0.0.1:8470/"})
    assert CheckpointStore.for_node(cfg, "a").url == str(tmp_path / "a")
    assert CheckpointStore.for_peer(cfg, "a").url == "http://10.0.0.1:8470"
    assert CheckpointStore.for_peer(cfg, "b").url == str(tmp_path / "b")  # no server: its root
    remote = CheckpointStore.for_remote(cfg)
    assert remote == CheckpointStore("s3://b/run", {"endpoint_url": "http://127.0.0.1:9"})
    assert "127.0.0.1:9" not in repr(remote)  # options may hold credentials: never in a log line
    assert CheckpointStore.for_remote(cfg.model_copy(update={"remote_url": None})) is None


def test_with_timeout_bounds_every_request_and_sends_the_peer_token(monkeypatch):
    monkeypatch.setenv(PEER_TOKEN_ENV, "s3cret")
    peer = CheckpointStore("http://10.0.0.1:8470").with_timeout(2.5)
    assert peer.options["headers"] == {"Authorization": "Bearer s3cret"}
    timeout = peer.options["client_kwargs"]["timeout"]
    assert (timeout.total, timeout.sock_connect, timeout.sock_read) == (None, 2.5, 2.5)  # silence, not a download
    options = {"endpoint_url": "http://127.0.0.1:9"}
    bucket = CheckpointStore("s3://b/run", options).with_timeout(4.0)
    assert bucket.options["config_kwargs"]["read_timeout"] == 4.0
    assert bucket.options["endpoint_url"] == options["endpoint_url"]
    assert options == {"endpoint_url": "http://127.0.0.1:9"}  # the caller's options are left as they were
    disk = CheckpointStore("/tmp/x")
    assert disk.with_timeout(1.0) is disk


def test_a_peer_server_lists_its_steps_and_a_hostile_listing_is_refused(tmp_path: Path):
    local = CheckpointStore(str(tmp_path / "a"))
    for step in (1, 3):
        commit(local, step)
    unfinished(local, 4)
    with PeerServer(local.url) as server:
        peer = CheckpointStore(server.url).with_timeout(2.0)
        assert peer.is_peer_server and peer.committed_steps() == [1, 3]
        assert peer.read_manifest(3) == local.read_manifest(3)
        assert not Source("a", server.url).is_ours() and Source("a", local).is_ours()
    for answer in (b'["1", 2]', b'{"steps": [1]}', b"[-1]", b"<html>"):
        with _answering(answer) as url:
            with pytest.raises(HetrainError, match=f"^{url}/_steps: "):
                CheckpointStore(url).with_timeout(2.0).committed_steps()


class _answering:
    """An HTTP server on loopback that answers every GET with ``body`` (a peer gone wrong)."""

    def __init__(self, body: bytes) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)

    def __enter__(self) -> str:
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_source_is_a_named_store():
    store = CheckpointStore("s3://b/run", {"key": "secret"})
    remote = Source("remote", store, remote=True)
    assert remote.store is store and remote.url == "s3://b/run" and remote.is_ours()
    assert Source("a", "/disk/a") == Source("a", CheckpointStore("/disk/a"))  # a URL is a store without options
    on_disk = CheckpointStore("file:///disk/a")
    assert on_disk.step_path(3, MANIFEST) == f"/disk/a/{step_name(3)}/{MANIFEST}"  # inside its filesystem
    assert on_disk.step_url(3, MANIFEST) == f"file:///disk/a/{step_name(3)}/{MANIFEST}"  # in messages
