"""A cluster of machines on one machine: the Prefect control plane, a bucket and training nodes on the test bed.

Each part is a network namespace of ``hetrain.testing.netbed`` (veth pairs on a bridge, links
shaped with ``tc tbf``, addresses in 198.18.0.0/24 that exist only inside the bed):

* ``control``: the Prefect server and the worker on the pool's ``default`` queue (the parent
  train and recover flows);
* ``bucket``: an S3 API (moto) behind a slower link;
* one namespace per training node running ``hetrain node start`` (its work queue's worker,
  its peer server, and on spot nodes the preemption watcher), each with its own runs root
  (its disk).

A cloud's metadata endpoint cannot exist here: a fake on the host answers each spot node on
the node's own loopback (as 169.254.169.254 answers each VM). This process reaches the
server and the bucket through relays (``NetBed.forward``); the nodes reach them, and each
other, over the bed's network only. The demo and the tests build their clusters with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from flows import ROOT
from hetrain.testing import netbed
from hetrain.testing.fakecloud import FakeCloudMetadata

API_PORT = 4200
S3_PORT = 5000
BUCKET = "bed"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
START_S = 120  # the server, moto and four workers start at once on two busy cores
WORKER_QUERY_S = "2"  # workers look for runs every 2 s (Prefect's default 10): each fan-out waits for one


def _wait_for(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise netbed.NetBedError(f"{url} did not answer in {timeout_s:.0f} s")


class BedCluster:
    """``with BedCluster(home, nodes) as c:`` the whole cluster up; torn down on exit, whatever happened.

    ``nodes``: the cluster file's nodes (name, gpu, count, ... as in ``examples/clusters``);
    each gets its bed address. ``cluster_fields``: the file's other fields (name, gpu_types...). ``rate_mbit``: each training node's link (the bucket's is
    ``bucket_mbit``). Spot nodes (``spot: true``) watch the fake metadata endpoint ``cloud``.
    """

    def __init__(self, home: Path, nodes: list[dict], *, cluster_fields: dict | None = None, rate_mbit: float = 400,
                 bucket_mbit: float = 200, peer_token: str = "bed-peer-token") -> None:
        self.home = Path(home)
        self.node_specs = [dict(n) for n in nodes]
        self.names = [n["name"] for n in nodes]
        self.cluster_fields = {"name": "bed", **(cluster_fields or {})}  # name, gpu_types, bandwidths...
        self.token = peer_token
        self.bed = netbed.NetBed(["control", "bucket", *self.names],
                                 rate_mbit={"control": None, "bucket": bucket_mbit, **{n: rate_mbit for n in self.names}})
        self.cloud = FakeCloudMetadata()
        self.roots = {n: self.home / n / "runs" for n in self.names}  # each node's disk
        self._logs: list = []

    # -- up and down
    def __enter__(self) -> BedCluster:
        self.home.mkdir(parents=True, exist_ok=True)
        self.bed.up()
        self.cloud.start()
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.bed.down()
        self.cloud.stop()
        for log in self._logs:
            log.close()
        self._logs.clear()

    def _start(self) -> None:
        bed, home = self.bed, self.home
        base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        base |= {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false", "PYTHONPATH": str(ROOT),
                 "HETRAIN_PEER_TOKEN": self.token, **CREDENTIALS, "PREFECT_WORKER_QUERY_SECONDS": WORKER_QUERY_S}
        self._start_in("control", [sys.executable, "-m", "prefect", "server", "start", "--host", "0.0.0.0", "--port",
                                   str(API_PORT)], {**base, "PREFECT_HOME": str(home / "control-home")})
        self._start_in("bucket", [sys.executable, "-m", "moto.server", "-H", "0.0.0.0", "-p", str(S3_PORT)], base)
        self.api = f"http://127.0.0.1:{bed.forward('control', API_PORT, str(home))}/api"  # this process's way in
        self.s3_host = f"http://127.0.0.1:{bed.forward('bucket', S3_PORT, str(home))}"
        self.s3_inside = f"http://{bed.address('bucket')}:{S3_PORT}"  # the nodes' way to the bucket
        _wait_for(self.api + "/health", START_S)
        cli_env = {**base, "PREFECT_API_URL": self.api, "PREFECT_HOME": str(home / "cli-home")}
        for args in (["work-pool", "create", "hetrain", "--type", "process"],
                     ["--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml"]):
            r = subprocess.run([sys.executable, "-m", "prefect", *args], cwd=ROOT, env=cli_env, capture_output=True,
                               text=True, timeout=300)
            if r.returncode != 0:
                raise netbed.NetBedError(f"prefect {args[0]}: {(r.stdout + r.stderr).strip()[-2000:]}")
        inside = f"http://{bed.address('control')}:{API_PORT}/api"  # how the nodes reach the server
        self._start_in("control", [sys.executable, "-m", "prefect", "worker", "start", "--pool", "hetrain",
                                   "--work-queue", "default", "--name", "control"],
                       {**base, "PREFECT_API_URL": inside, "PREFECT_HOME": str(home / "w-control")})
        for spec in self.node_specs:
            node = spec["name"]
            watch = []
            if spec.get("spot"):  # the node's metadata endpoint, on its own loopback
                port = bed.reach_host(node, self.cloud.port, str(home))
                watch = ["--cloud", "aws", "--metadata-url", f"http://127.0.0.1:{port}/{node}", "--watch-poll-s", "0.5"]
            self._start_in(node, [sys.executable, "-m", "hetrain", "node", "start", "--name", node, "--runs-root",
                                  str(self.roots[node]), *watch],
                           {**base, "PREFECT_API_URL": inside, "PREFECT_HOME": str(home / f"w-{node}")})
        self._wait_for_workers()
        _wait_for(self.s3_host, START_S)
        import s3fs

        s3fs.S3FileSystem(endpoint_url=self.s3_host, key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                          secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"]).mkdir(BUCKET)
        cluster = {**self.cluster_fields,
                   "nodes": [{**n, "address": bed.address(n["name"])} for n in self.node_specs]}
        self.cluster_file = home / "cluster.yaml"
        self.cluster_file.write_text(yaml.safe_dump(cluster, sort_keys=False))

    def _start_in(self, node: str, argv: list[str], env: dict[str, str]) -> None:
        log = open(self.home / f"{node}-{Path(argv[2]).name}-{len(self._logs)}.log", "w")
        self._logs.append(log)
        subprocess.Popen(self.bed.exec_argv(node, argv), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                         env={**env, **self.bed.env(node)})  # they die with their namespace

    def _wait_for_workers(self) -> None:
        from prefect.settings import PREFECT_API_URL, temporary_settings

        from flows.fanout import queue_ready

        with temporary_settings({PREFECT_API_URL: self.api}):  # a node's worker is up once it polls its queue
            deadline = time.monotonic() + START_S
            while not all(queue_ready(n) for n in self.names):
                if time.monotonic() > deadline:
                    idle = [n for n in self.names if not queue_ready(n)]
                    raise netbed.NetBedError(f"the workers of {', '.join(idle)} did not poll their queues "
                                             f"(logs in {self.home})")
                time.sleep(1)

    # -- using
    def lose(self, node: str) -> None:
        """``node`` is gone: every process in its namespace killed, its disk deleted."""
        import shutil

        netbed.kill_namespace_processes(self.bed.nodes[node].namespace)
        shutil.rmtree(self.roots[node], ignore_errors=True)

    def training_processes(self) -> list[str]:
        """Command lines of training processes (launchers, ranks) still alive in any node of the bed."""
        left = []
        for node in self.bed.nodes.values():
            out = subprocess.run(["ip", "netns", "pids", node.namespace], capture_output=True, text=True).stdout
            for pid in out.split():
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                if "hetrain.runtime.worker" in cmd or "torch.distributed.run" in cmd:
                    left.append(f"{node.name}: {cmd}")
        return left
