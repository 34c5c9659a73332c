"""The train flow across machines: a Prefect worker per node, each node a network namespace.

The bed has a control node (the Prefect server and the worker that runs the parent flows), a
bucket node (an S3 API, moto, behind a 200 Mbit/s link) and three training nodes on 400 Mbit/s
links: ``a`` and ``b`` with one fast device each and the spot node ``spot`` with two slow ones.
Each training node runs ``hetrain node start`` (a worker on the work queue named after it, a
peer server) with its own runs root (its disk). The test drives the server and the bucket
through relays (``NetBed.forward``); the nodes reach them, and each other, over the bed's
network only. Skipped where network namespaces cannot be made.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from conftest import EXAMPLES, ROOT
from hetrain.testing import netbed

OK, WHY = netbed.available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not OK, reason=f"no network namespaces here: {WHY}")]

NODES = ["a", "b", "spot"]
API_PORT = 4200
S3_PORT = 5000
BUCKET = "bed"
TOKEN = "bed-peer-token"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
SERVER_START_S = 120


def _wait_for(url: str, timeout_s: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} did not answer in {timeout_s} s")


class Bed(NamedTuple):
    bed: netbed.NetBed
    api: str  # the Prefect API, from the host
    cluster_file: Path  # the nodes with their bed addresses
    roots: dict[str, Path]  # each node's runs root (its disk)
    s3_host: str  # the bucket's endpoint, from the host
    s3_inside: str  # the bucket's endpoint, from the nodes


@pytest.fixture(scope="module")
def bed_cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bedflows")
    bed = netbed.NetBed(["control", "bucket", *NODES],
                        rate_mbit={"control": None, "bucket": 200, **{n: 400 for n in NODES}}).up()
    logs = []
    try:
        base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        base |= {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false",
                 "PYTHONPATH": str(ROOT), "HETRAIN_PEER_TOKEN": TOKEN, **CREDENTIALS,
                 "PREFECT_WORKER_QUERY_SECONDS": "2"}  # workers look for runs every 2 s (default 10): each fan-out waits for it

        def start(node: str, argv: list[str], **env: str) -> None:
            log = open(tmp / f"{node}-{argv[2]}-{len(logs)}.log", "w")
            logs.append(log)
            subprocess.Popen(bed.exec_argv(node, argv), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                             env={**base, **bed.env(node), **env})

        start("control", [sys.executable, "-m", "prefect", "server", "start", "--host", "0.0.0.0", "--port",
                          str(API_PORT)], PREFECT_HOME=str(tmp / "control-home"))
        start("bucket", [sys.executable, "-m", "moto.server", "-H", "0.0.0.0", "-p", str(S3_PORT)])
        api = f"http://127.0.0.1:{bed.forward('control', API_PORT, str(tmp))}/api"
        s3_host = f"http://127.0.0.1:{bed.forward('bucket', S3_PORT, str(tmp))}"  # the test's way in
        _wait_for(api + "/health", SERVER_START_S)
        cli_env = {**base, "PREFECT_API_URL": api, "PREFECT_HOME": str(tmp / "cli-home")}
        for args in (["work-pool", "create", "hetrain", "--type", "process"],
                     ["--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml"]):
            r = subprocess.run([sys.executable, "-m", "prefect", *args], cwd=ROOT, env=cli_env, capture_output=True,
                               text=True, timeout=180)
            assert r.returncode == 0, r.stdout + r.stderr
        inside = f"http://{bed.address('control')}:{API_PORT}/api"  # how the nodes reach the server
        start("control", [sys.executable, "-m", "prefect", "worker", "start", "--pool", "hetrain", "--work-queue",
                          "default", "--name", "control"], PREFECT_API_URL=inside, PREFECT_HOME=str(tmp / "w-control"))
        roots = {}
        for node in NODES:
            roots[node] = tmp / node / "runs"
            start(node, [sys.executable, "-m", "hetrain", "node", "start", "--name", node, "--runs-root",
                         str(roots[node])], PREFECT_API_URL=inside, PREFECT_HOME=str(tmp / f"w-{node}"))
        from flows.fanout import queue_ready
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: api}):  # the nodes' workers are up once they poll their queues
            deadline = time.monotonic() + SERVER_START_S
            while not all(queue_ready(n) for n in NODES):
                assert time.monotonic() < deadline, "the nodes' workers did not poll their queues"
                time.sleep(1)
        _wait_for(s3_host, SERVER_START_S)
        import s3fs

        s3fs.S3FileSystem(endpoint_url=s3_host, key="testing", secret="testing").mkdir(BUCKET)
        cluster = yaml.safe_load((EXAMPLES / "clusters" / "cpu-emulated.yaml").read_text())
        fast, slow = cluster["nodes"]
        cluster["nodes"] = [{**fast, "name": "a", "count": 1}, {**fast, "name": "b", "count": 1}, {**slow, "name": "spot"}]
        for n in cluster["nodes"]:
            n["address"] = bed.address(n["name"])
        cluster_file = tmp / "cluster.yaml"
        cluster_file.write_text(yaml.safe_dump(cluster))
        yield Bed(bed, api, cluster_file, roots, s3_host, f"http://{bed.address('bucket')}:{S3_PORT}")
    finally:
        bed.down()
        for log in logs:
            log.close()


def _run(api: str, parameters: dict, timeout_s: float = 400):
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api}):
        return run_deployment("hetrain-train/train", parameters=parameters, timeout=timeout_s, poll_interval=1)


def _table(api: str, flow_run_id, key_part: str) -> list[dict]:
    """Rows of the table artifact (of a flow run, or any) whose key ends with ``key_part``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])) if flow_run_id else None)
    found = [a for a in artifacts if a.type == "table" and (a.key or "").endswith(key_part)]
    assert found, [a.key for a in artifacts]
    return json.loads(found[0].data) if isinstance(found[0].data, str) else found[0].data


def _training_processes(bed) -> list[str]:
    """Command lines of training processes (launchers, ranks) still alive in any node of the bed."""
    left = []
    for node in bed.nodes.values():
        out = subprocess.run(["ip", "netns", "pids", node.namespace], capture_output=True, text=True).stdout
        for pid in out.split():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "hetrain.runtime.worker" in cmd or "torch.distributed.run" in cmd:
                left.append(f"{node.name}: {cmd}")
    return left


def test_a_node_failing_mid_run_fails_the_parent_and_leaves_no_process(bed_cluster):
    bed, api, cluster_file, roots = bed_cluster[:4]
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api}):
        run = run_deployment("hetrain-train/train", timeout=0, parameters={
            "cluster": str(cluster_file), "run_id": "bedfail", "steps": 200, "use_profile": False,
            "checkpoint_every": 100, "launch": "per-node", "planner": "whale"})
    metrics = [roots[n] / "bedfail" / "metrics.jsonl" for n in NODES]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not any(m.exists() and m.read_text().count("\n") >= 2 for m in metrics):
        time.sleep(0.5)
    assert any(m.exists() and m.read_text().count("\n") >= 2 for m in metrics), "training did not start"
    killed = 0
    namespace = bed.nodes["spot"].namespace
    for pid in subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split():
        try:
            if b"hetrain.runtime.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(int(pid), 9)  # one of the slow node's ranks dies mid-run (as under the OOM killer)
                killed += 1
                break
        except OSError:
            continue
    assert killed == 1
    with temporary_settings({PREFECT_API_URL: api}):
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and not (state := client.read_flow_run(run.id).state).is_final():
                time.sleep(1)
    assert state.is_failed(), state
    assert "node spot" in state.message
    assert _training_processes(bed) == []


def test_train_per_node_lose_a_node_and_recover_per_node(bed_cluster):
    """The train flow profiles each GPU type on a node of that type and trains a plan over all three
    nodes, each writing its shards to its own disk. Node spot dies mid-run with its disk; a and b each
    restore the newest committed step, reading what they hold from their own disks, each other's shards
    from the other's peer server and spot's from the bucket, and resume on a new plan at checkpoint + 1."""
    import s3fs
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from hetrain.checkpoint.manifest import committed_steps, read_manifest

    bed, api, cluster_file, roots, s3_host, s3_inside = bed_cluster
    remote = f"s3://{BUCKET}/rec"
    with temporary_settings({PREFECT_API_URL: api}):
        # whale's plans use every GPU (hetrain's, with these profiles, may leave the slow node out)
        run = run_deployment("hetrain-train/train", timeout=0, parameters={
            "cluster": str(cluster_file), "run_id": "rec", "steps": 400, "checkpoint_every": 3,
            "launch": "per-node", "planner": "whale", "remote": remote, "remote_endpoint": s3_inside})
    options = {"endpoint_url": s3_host, "key": "testing", "secret": "testing"}
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # a checkpoint committed on every node and whole in the bucket
        s3fs.S3FileSystem(**options).invalidate_cache()
        if committed_steps(remote, options):
            break
        time.sleep(0.5)
    assert committed_steps(remote, options), "no checkpoint reached the bucket"
    # each GPU type was profiled on a node of its own, and the emulated slow type measured slower
    profiles = {}
    for gpu, node in (("cpu-fast", "a"), ("cpu-slow", "spot")):
        (row,) = [r for r in _table(api, None, f"profile-{gpu}-{node}") if r["tp"] == 1 and r["micro-batch"] == 1]
        profiles[gpu] = row["block fwd ms"] + row["block bwd ms"]
    assert profiles["cpu-slow"] > profiles["cpu-fast"], profiles  # 2x nominal; both nodes share 2 busy cores
    # every node writes its own shards to its own disk, and rank 0's node (the plan's first) the metrics
    plan = json.loads((roots["a"] / "rec" / "plan.json").read_text())
    first = plan["pipelines"][0]["stages"][0]["devices"][0].split("/")[0]
    assert {d.split("/")[0] for p in plan["pipelines"] for st in p["stages"] for d in st["devices"]} == set(NODES)
    for node in NODES:
        assert [p.name for p in (roots[node] / "rec" / "checkpoints").iterdir()] == [node]
        assert (roots[node] / "rec" / "metrics.jsonl").exists() == (node == first)
    netbed._kill_namespace_processes(bed.nodes["spot"].namespace)  # the spot node is gone, its disk with it
    shutil.rmtree(roots["spot"])
    with temporary_settings({PREFECT_API_URL: api}):
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:  # the survivors' ranks fail without their peer
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and not (state := client.read_flow_run(run.id).state).is_final():
                time.sleep(1)
        assert state.is_failed(), state
        newest = {n: committed_steps(str(roots[n] / "rec" / "checkpoints" / n))[-1] for n in ("a", "b")}
        assert len(set(newest.values())) == 1
        step = newest["a"]
        rec = run_deployment("hetrain-recover/recover", timeout=400, poll_interval=1, parameters={
            "run_id": "rec", "lost_node": "spot", "cluster": str(cluster_file), "launch": "per-node",
            "steps": step + 3})
    assert rec.state.is_completed(), rec.state.message
    rows = {r["node"]: r for r in _table(api, rec.id, "recovery-bytes")}
    manifest = read_manifest(str(roots["a"] / "rec" / "checkpoints" / "a"), step)
    size = {f.path: f.size for f in manifest.files}
    for node, other in (("a", "b"), ("b", "a")):
        row = rows[node]
        assert row["step"] == step  # the newest commit: no committed step lost
        held = [f.path for f in manifest.files if node in f.nodes]
        assert row["local_bytes"] == sum(size[p] for p in held)  # none of what it held came over the network
        assert row["peer_bytes"] > 0 and row["bucket_bytes"] > 0  # the other survivor's shards, then spot's
        assert row["local_bytes"] + row["peer_bytes"] + row["bucket_bytes"] == sum(size.values())
    metrics = [roots[n] / "rec" / "metrics.jsonl" for n in ("a", "b") if (roots[n] / "rec" / "metrics.jsonl").exists()]
    records = [json.loads(line) for m in metrics for line in m.read_text().splitlines()]
    resumed = [r["step"] for r in records if r["step"] > step]
    assert resumed == [step + 1, step + 2], resumed
    assert {r["device"].split("/")[0] for r in records[-1]["ranks"]} <= {"a", "b"}
    assert _training_processes(bed) == []
