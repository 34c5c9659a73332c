"""The train flow across machines: a Prefect worker per node, each node a network namespace.

The bed has a control node (the Prefect server and the worker that runs the train flow) and
two training nodes joined by a 400 Mbit/s link, each with its own worker on the work queue
named after it and its own runs root (its disk). The test drives the server through a relay
(``NetBed.forward``); the nodes reach it, and each other, over the bed's network only.
Skipped where network namespaces cannot be made.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import EXAMPLES, ROOT
from hetrain.testing import netbed

OK, WHY = netbed.available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not OK, reason=f"no network namespaces here: {WHY}")]

NODES = ["fast", "slow"]  # the emulated cluster's nodes
API_PORT = 4200
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


@pytest.fixture(scope="module")
def bed_cluster(tmp_path_factory):
    """(bed, host API URL, cluster file with the nodes' bed addresses, per-node runs roots)."""
    tmp = tmp_path_factory.mktemp("bedflows")
    bed = netbed.NetBed(["control", *NODES], rate_mbit={"control": None, "fast": 400, "slow": 400}).up()
    logs = []
    try:
        base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        base |= {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false",
                 "PYTHONPATH": str(ROOT)}

        def start(node: str, argv: list[str], **env: str) -> None:
            log = open(tmp / f"{node}-{argv[2]}-{len(logs)}.log", "w")
            logs.append(log)
            subprocess.Popen(bed.exec_argv(node, argv), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                             env={**base, **bed.env(node), **env})

        start("control", [sys.executable, "-m", "prefect", "server", "start", "--host", "0.0.0.0", "--port",
                          str(API_PORT)], PREFECT_HOME=str(tmp / "control-home"))
        api = f"http://127.0.0.1:{bed.forward('control', API_PORT, str(tmp))}/api"
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
        cluster = yaml.safe_load((EXAMPLES / "clusters" / "cpu-emulated.yaml").read_text())
        for n in cluster["nodes"]:
            n["address"] = bed.address(n["name"])
        cluster_file = tmp / "cluster.yaml"
        cluster_file.write_text(yaml.safe_dump(cluster))
        yield bed, api, cluster_file, roots
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


def test_train_flow_runs_one_node_flow_per_node(bed_cluster):
    bed, api, cluster_file, roots = bed_cluster
    # whale's plans use every GPU (hetrain's, with these profiles, may leave the slow node out)
    run = _run(api, {"cluster": str(cluster_file), "run_id": "bed", "steps": 4, "checkpoint_every": 2,
                     "launch": "per-node", "planner": "whale"})
    assert run.state.is_completed(), run.state.message
    # each GPU type was profiled on its own node, and the emulated slow type measured slower
    profiles = {}
    for gpu, node in (("cpu-fast", "fast"), ("cpu-slow", "slow")):
        (row,) = [r for r in _table(api, None, f"profile-{gpu}-{node}") if r["tp"] == 1 and r["micro-batch"] == 1]
        profiles[gpu] = row["block fwd ms"] + row["block bwd ms"]
    assert profiles["cpu-slow"] > 1.3 * profiles["cpu-fast"], profiles
    rows = {r["node"]: r for r in _table(api, run.id, "nodes")}  # the parent's per-node table
    assert set(rows) == set(NODES)
    lead = rows["fast"] if rows["fast"]["steps"] else rows["slow"]
    assert lead["last_step"] == 3 and lead["final_loss"] > 0 and lead["steps"] == 4
    for node in NODES:  # each node wrote its own shards on its own disk, nothing of the other's
        ckpt = roots[node] / "bed" / "checkpoints"
        assert [p.name for p in ckpt.iterdir()] == [node]
        assert rows[node]["checkpoints_on_disk"] == "1, 3"  # after every 2 steps and at the end
    first = next(iter(json.loads((roots["fast"] / "bed" / "plan.json").read_text())["pipelines"]))
    assert first["stages"]
    assert (roots["fast"] / "bed" / "metrics.jsonl").exists() != (roots["slow"] / "bed" / "metrics.jsonl").exists()
    assert _training_processes(bed) == []


def test_a_node_failing_mid_run_fails_the_parent_and_leaves_no_process(bed_cluster):
    bed, api, cluster_file, roots = bed_cluster
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
    assert any(m.exists() for m in metrics), "training did not start"
    killed = 0
    namespace = bed.nodes["slow"].namespace
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
    print("PARENT:", state.message)
    assert "node slow" in state.message
    assert _training_processes(bed) == []
