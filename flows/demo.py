"""The whole loop: ``make demo`` (``python -m flows.demo``).

Where this machine can make network namespaces (root, ``ip netns``) it runs on the test bed
(``flows.bed``): a control node, a bucket node and three training nodes, each a namespace
with its own worker, disk and shaped links; the train deployment runs per node, the spot
node's watcher gets a notice, the ranks checkpoint and stop, the event's automation recovers
on the two survivors (each restoring from its own disk first) and the run trains to the end;
it prints what each node did. Elsewhere (or with ``--one-machine``):

Starts a local Prefect server (SQLite under ``.demo/prefect``), an S3-compatible endpoint
(moto) and a stand-in for the cloud's metadata endpoint; deploys ``deployments/prefect.yaml``
to a process work pool and starts a worker; runs the training deployment on the CPU-emulated
mixed cluster (two fast devices, two spot devices); partway, the spot node ``slow`` gets a
preemption notice. Its watcher asks the ranks for an emergency checkpoint and emits
``hetrain.node.preempted``; the node disappears at the deadline; the recovery deployment,
started by the event's automation, re-plans for the survivors, reassembles the checkpoint
(peers first, the bucket for the rest) and trains to the end. Prints what happened, the
recovery breakdown and where the UI is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

from flows import ROOT
from hetrain.rundir import RunDir
from hetrain.runtime.launch import free_port

console = Console()


def wait_http(url: str, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"demo: {what} did not come up at {url} within {timeout_s:.0f} s")


class Services:
    """Child processes of the demo; all stopped on exit, whatever happens."""

    def __init__(self, home: Path, env: dict[str, str]) -> None:
        self.home, self.env, self.procs = home, env, []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.home / f"{name}.log", "w")
        proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append((name, proc, log))
        return proc

    def run(self, argv: list[str]) -> str:
        r = subprocess.run(argv, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise SystemExit(f"demo: {' '.join(argv[2:5])} failed:\n{r.stdout}{r.stderr}")
        return r.stdout

    def start_prefect_server(self, port: int) -> str:
        """``prefect server start`` on loopback at ``port`` (log: prefect-server.log); its API URL once it answers."""
        api = f"http://127.0.0.1:{port}/api"
        self.start("prefect-server", [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                      "--port", str(port)])
        wait_http(f"{api}/health", 120, "the Prefect server")
        return api

    def deploy_with_worker(self) -> None:
        """The ``hetrain`` work pool, every deployment of deployments/prefect.yaml, and a worker on the pool."""
        py = sys.executable
        self.run([py, "-m", "prefect", "work-pool", "create", "hetrain", "--type", "process"])
        self.run([py, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml"])
        self.start("worker", [py, "-m", "prefect", "worker", "start", "--pool", "hetrain"])

    def stop(self) -> None:
        for _, proc, log in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
            log.close()


def recovery_runs() -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name("hetrain-recover/recover")
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])))
    return [r.id for r in runs]


def wait_final(flow_run_ids, deadline: float):
    """The state of the first of ``flow_run_ids()`` to reach a final state."""
    from prefect.client.orchestration import get_client

    while time.monotonic() < deadline:
        with get_client(sync_client=True) as client:
            for run_id in flow_run_ids():
                state = client.read_flow_run(run_id).state
                if state is not None and state.is_final():
                    return state
        time.sleep(1)
    raise SystemExit("demo: timed out waiting for a flow run")


def report(run_dir: Path, steps: int, notice_step: int, wall_s: float, ui: str, home: Path) -> None:
    records = [json.loads(line) for line in RunDir(run_dir).metrics.read_text().splitlines()]
    (rec_path,) = sorted(run_dir.glob("recovery-from-step-*.json"))[-1:]
    rec = json.loads(rec_path.read_text())
    resumed_at = next(i for i, r in enumerate(records) if "resume_load_s" in r)
    first, after = records[:resumed_at], records[resumed_at:]
    console.print(f"[bold]5/5[/] done in {wall_s:.0f} s")
    table = Table(title="what happened", title_justify="left")
    table.add_column("")
    table.add_column("")
    redone = (f"; steps {rec['checkpoint_step'] + 1}-{first[-1]['step']} ran after the last commit and were redone"
              if first[-1]["step"] > rec["checkpoint_step"] else "")
    table.add_row("training", f"steps 0-{first[-1]['step']} on {', '.join(rec['old_devices'])}{redone}")
    table.add_row("preemption notice", f"node slow at step {notice_step}; emergency checkpoint committed at step "
                  f"{rec['checkpoint_step']}")
    table.add_row("recovered plan", ", ".join(rec["plan_devices"]))
    table.add_row("resumed", f"step {after[0]['step']} (= checkpoint + 1), trained to step {after[-1]['step']} of "
                  f"{steps - 1}; loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}")
    table.add_row("checkpoint fetched", f"{rec['bytes_from_peers'] / 1e6:.2f} MB from surviving peers, "
                  f"{rec['bytes_from_remote'] / 1e6:.2f} MB from the bucket")
    console.print(table)
    phases = Table(title="recovery time", title_justify="left")
    phases.add_column("phase")
    phases.add_column("seconds", justify="right")
    for k, v in rec["timings_s"].items():
        phases.add_row(k.removesuffix("_s").replace("_", " "), f"{v:.3f}")
    console.print(phases)
    console.print(f"Flow runs, logs and artifacts (plans, pipelines, progress, recovery) are in the Prefect database "
                  f"under {home / 'prefect'}; to browse them: PREFECT_HOME={home / 'prefect'} prefect server start "
                  f"(this run's UI was {ui}).", highlight=False)


# One emulated device per node: with this machine's two cores shared by every namespace, the
# planner (rightly) leaves slower devices out, and the spot node must be in the plan for its
# loss to matter. The one-machine demo and `hetrain plan --compare` show mixed types.
BED_NODES = [
    {"name": "a", "gpu": "cpu-fast", "count": 1, "intra_node_bandwidth_gbps": 2.0, "emulate": {"slowdown": 2.0}},
    {"name": "b", "gpu": "cpu-fast", "count": 1, "intra_node_bandwidth_gbps": 2.0, "emulate": {"slowdown": 2.0}},
    {"name": "spot", "gpu": "cpu-fast", "count": 1, "intra_node_bandwidth_gbps": 2.0, "spot": True,
     "emulate": {"slowdown": 2.0}},
]
BED_LINK_MBIT, BED_BUCKET_MBIT = 400, 200
# Sequences per step on the bed's three equal nodes: 24 split evenly into micro-batches of 4 (2 each).
# gpt-tiny's fixed costs per micro-batch make micro-batches of 4 the planner's choice, and with the
# train flow's default of 16 that is 4 micro-batches: a third pipeline would get 1 while the others
# keep 2, and its extra all-reduce member would only cost, so the planner rightly left the spot
# node out and there was nothing to recover.
BED_GLOBAL_BATCH = 24


def _devices_by_node(plan: dict) -> dict[str, list[str]]:
    """Each node's devices in a plan, with the pipeline and stage each serves."""
    found: dict[str, list[str]] = {}
    for p, pipeline in enumerate(plan["pipelines"]):
        for s, stage in enumerate(pipeline["stages"]):
            for device in stage["devices"]:
                found.setdefault(device.split("/")[0], []).append(f"{device} (pipeline {p}, stage {s})")
    return found


class _BedDemo:
    """One demo on the test bed, phase by phase: each waits on the flows under one deadline and says what it saw."""

    def __init__(self, bc, client, args, home: Path) -> None:
        self.bc, self.client, self.args, self.home = bc, client, args, home
        self.deadline = time.monotonic() + args.timeout_s
        self.run_id = "demo"

    def _wait(self, done, failed: str, give_up=lambda: False, poll_s: float = 1.0):
        """``done()``'s first true value, polled till the deadline or ``give_up()`` (then the demo ends: ``failed``)."""
        while not (value := done()):
            if time.monotonic() > self.deadline or give_up():
                raise SystemExit(f"demo: {failed}")
            time.sleep(poll_s)
        return value

    def show_nodes(self) -> None:
        import yaml

        cluster = yaml.safe_load(self.bc.cluster_file.read_text())
        nodes = Table(title="nodes", title_justify="left")
        for col in ("node", "address", "devices", "link", "spot"):
            nodes.add_column(col)
        for n in cluster["nodes"]:
            nodes.add_row(n["name"], n["address"], f"{n['count']} x {n['gpu']}", f"{BED_LINK_MBIT} Mbit/s",
                          "yes (watched)" if n.get("spot") else "")
        console.print(nodes)
        console.print(f"    Prefect API (relayed to this machine): {self.bc.api}")

    def start_training(self) -> dict:
        """The per-node training run started through its deployment; its plan once the nodes have it."""
        from prefect.deployments import run_deployment

        from flows.bed import BUCKET

        console.print(f"[bold]2/5[/] training run '{self.run_id}' per node (launch=per-node): each GPU type profiled "
                      f"on its own node, planned, one node run per node through its work queue, torchrun's c10d "
                      f"rendezvous on the first node; {self.args.steps} steps, checkpoints every 25 steps to each "
                      f"node's disk and s3://{BUCKET}/{self.run_id}")
        self.train_run = run_deployment("hetrain-train/train", timeout=0, parameters={
            "cluster": str(self.bc.cluster_file), "run_id": self.run_id, "global_batch_size": BED_GLOBAL_BATCH,
            "launch": "per-node", "planner": "hetrain",
            "options": {"steps": self.args.steps, "checkpoint_every": 25, "remote": f"s3://{BUCKET}/{self.run_id}",
                        "remote_endpoint": self.bc.s3_inside}})
        plan_file = RunDir(self.bc.roots["a"] / self.run_id).plan
        self._wait(plan_file.exists, f"the training run did not start on the nodes; logs in {self.home}",
                   give_up=self._training_ended, poll_s=0.5)
        plan = json.loads(plan_file.read_text())
        if "spot" not in _devices_by_node(plan):
            raise SystemExit("demo: the plan leaves the spot node out (its devices measured too slow to help): "
                             "nothing to recover")
        self.metrics = RunDir(self.bc.roots[_first_node(plan)] / self.run_id).metrics
        return plan

    def _training_ended(self) -> bool:
        return self.client.read_flow_run(self.train_run.id).state.is_final()

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.metrics.read_text().splitlines()] if self.metrics.exists() else []

    def preempt_spot(self) -> tuple[list[dict], datetime]:
        """The notice once training passes ``--preempt-at-step``; the records up to the emergency checkpoint's step,
        where the ranks stopped, and when the node goes."""
        step = self.args.preempt_at_step
        self._wait(lambda: (r := self.records()) and r[-1]["step"] >= step,
                   f"training did not reach step {step}; logs in {self.home}", give_up=self._training_ended,
                   poll_s=0.3)
        notice_step = self.records()[-1]["step"]
        gone_at = self.bc.cloud.preempt("spot", self.args.notice_s)
        console.print(f"[bold]3/5[/] step {notice_step}: the cloud announces that spot node 'spot' goes away at "
                      f"{gone_at:%H:%M:%S} ({self.args.notice_s:g} s notice)")
        state = self._wait(lambda: (st := self.client.read_flow_run(self.train_run.id).state).is_final() and st,
                           "the training run did not stop after the notice")
        before = self.records()
        stopped = before[-1]
        if not stopped.get("stopped"):
            raise SystemExit(f"demo: the run ended {state.name} at step {stopped['step']} without stopping for the "
                             f"notice (raise --steps); logs in {self.home}")
        console.print(f"    spot's watcher had the ranks take an emergency checkpoint at step {stopped['step']} and "
                      f"stop there, and emitted hetrain.node.preempted; training flow run {state.name}")
        return before, gone_at

    def recover(self, gone_at: datetime) -> dict[str, dict]:
        """The node lost at its deadline; the recovery the event started, to its end; each node's restored bytes."""
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowFilter, FlowFilterName

        from flows.report import artifact_key

        time.sleep(max(0.0, (gone_at - datetime.now(UTC)).total_seconds()))
        self.bc.lose("spot")
        console.print("[bold]4/5[/] the deadline: node 'spot' is gone (its processes killed, its disk deleted); the "
                      "event's automation started hetrain-recover/recover: restore on every survivor at once, "
                      "re-plan, resume per node")
        named = FlowFilter(name=FlowFilterName(any_=["hetrain-recover"]))
        recs = self._wait(lambda: self.client.read_flow_runs(flow_filter=named),
                          "the preemption event started no recovery")
        rec = self._wait(lambda: (r := self.client.read_flow_run(recs[0].id)).state.is_final() and r,
                         "timed out waiting for the recovery")
        if not rec.state.is_completed():
            raise SystemExit(f"demo: recovery ended {rec.state.name}: {rec.state.message}; logs in {self.home}")
        found = self.client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[artifact_key(self.run_id, "recovery-bytes")])))
        if not found:
            raise SystemExit("demo: the recovery published no table of restored bytes")
        data = found[0].data
        return {r["node"]: r for r in (json.loads(data) if isinstance(data, str) else data)}

    def resumed(self, step: int) -> tuple[dict, list[dict]]:
        """The plan recovery made from ``step``'s checkpoint, and the records since the resume."""
        new_plan = json.loads(RunDir(self.bc.roots["a"] / self.run_id).plan_from_step(step).read_text())
        records = RunDir(self.bc.roots[_first_node(new_plan)] / self.run_id).metrics.read_text().splitlines()
        after_all = [json.loads(line) for line in records]
        return new_plan, after_all[max(i for i, r in enumerate(after_all) if "resume_load_s" in r):]


def _first_node(plan: dict) -> str:
    """The node of the first pipeline's first stage: its rank 0 writes the run's metrics."""
    return plan["pipelines"][0]["stages"][0]["devices"][0].split("/")[0]


def bed_main(args, home: Path, started: float) -> None:
    """The demo across machines: every node a network namespace with its own worker, disk and links."""
    import yaml
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.bed import BedCluster

    types = yaml.safe_load((ROOT / "examples" / "clusters" / "cpu-emulated.yaml").read_text())
    console.print(f"[bold]1/5[/] building the test bed in {home}: namespaces control (Prefect server, parent flows' "
                  f"worker), bucket (S3 API, {BED_BUCKET_MBIT} Mbit/s) and nodes "
                  f"{', '.join(n['name'] for n in BED_NODES)} ({BED_LINK_MBIT} Mbit/s links, each with its own "
                  f"worker, disk and peer server; spot also watches its metadata endpoint)")
    fields = {"name": "demo-bed", **{k: v for k, v in types.items() if k not in ("name", "nodes")}}
    with BedCluster(home, BED_NODES, cluster_fields=fields, rate_mbit=BED_LINK_MBIT,
                    bucket_mbit=BED_BUCKET_MBIT) as bc, \
            temporary_settings({PREFECT_API_URL: bc.api}), get_client(sync_client=True) as client:
        demo = _BedDemo(bc, client, args, home)
        demo.show_nodes()
        plan = demo.start_training()
        before, gone_at = demo.preempt_spot()
        rows = demo.recover(gone_at)
        new_plan, after = demo.resumed(before[-1]["step"])
    _bed_report(plan, new_plan, rows, before, after, time.monotonic() - started, home)


def _bed_report(plan: dict, new_plan: dict, rows: dict[str, dict], before: list[dict], after: list[dict],
                wall_s: float, home: Path) -> None:
    """Each node's part before and after the preemption, and the loss across it."""
    step = before[-1]["step"]
    old_devices, new_devices = _devices_by_node(plan), _devices_by_node(new_plan)
    console.print(f"[bold]5/5[/] done in {wall_s:.0f} s")
    table = Table(title="what each node did", title_justify="left")
    for col in ("node", f"steps 0-{step}", "restored (own disk / peers / bucket)", "restore s",
                f"steps {after[0]['step']}-{after[-1]['step']}"):
        table.add_column(col, justify="left" if col in ("node",) else "right")
    for n in BED_NODES:
        name = n["name"]
        row = rows.get(name)
        restored_mb = (f"{row['local_bytes'] / 1e6:.1f} / {row['peer_bytes'] / 1e6:.1f} / "
                       f"{row['bucket_bytes'] / 1e6:.1f} MB" if row else "gone at the deadline")
        table.add_row(name, ", ".join(old_devices.get(name, [])) or "-", restored_mb,
                      f"{row['seconds']:.1f}" if row else "", ", ".join(new_devices.get(name, [])) or "-")
    console.print(table)
    console.print(f"training: loss {before[0]['loss']:.3f} at step 0 -> {before[-1]['loss']:.3f} at step {step} "
                  f"(the emergency checkpoint) -> {after[-1]['loss']:.3f} at step {after[-1]['step']}; resumed at "
                  f"step {after[0]['step']} (= checkpoint + 1), no committed step lost", highlight=False)
    console.print(f"Logs of every process are in {home}; the bed is torn down.", highlight=False)


def _one_machine_env(home: Path, api_port: int) -> dict[str, str]:
    """The demo's processes' environment: its own Prefect home and server, the bucket's credentials."""
    from flows.bed import WORKER_QUERY_S

    return {**os.environ, "PREFECT_HOME": str(home / "prefect"), "PREFECT_API_URL": f"http://127.0.0.1:{api_port}/api",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_URL": f"http://127.0.0.1:{api_port}",
            "PREFECT_WORKER_QUERY_SECONDS": WORKER_QUERY_S,  # the recovery starts within 2 s of the event
            "AWS_ACCESS_KEY_ID": os.environ.get("AWS_ACCESS_KEY_ID", "demo"),
            "AWS_SECRET_ACCESS_KEY": os.environ.get("AWS_SECRET_ACCESS_KEY", "demo"),
            "AWS_DEFAULT_REGION": "us-east-1", "PWD": str(ROOT)}


def _start_services(services: Services, home: Path, api_port: int, s3_port: int) -> None:
    """The Prefect server, the S3 endpoint with the demo's bucket, the deployments and a worker."""
    console.print(f"[bold]1/5[/] starting Prefect server (SQLite in {home / 'prefect'}), S3 endpoint, work pool")
    services.start("s3", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(s3_port)])
    services.start_prefect_server(api_port)
    wait_http(f"http://127.0.0.1:{s3_port}/moto-api/", 60, "the S3 endpoint")
    import s3fs

    s3fs.S3FileSystem(endpoint_url=f"http://127.0.0.1:{s3_port}").mkdir("hetrain-demo")
    console.print(f"    Prefect UI: [link]http://127.0.0.1:{api_port}[/] (open it to watch the flows)")
    services.deploy_with_worker()
    console.print("    deployed hetrain-train/train (nightly cron) and hetrain-recover/recover "
                  "(trigger: hetrain.node.preempted); worker started")


def _one_machine_run(args, home: Path, api_port: int, s3_port: int, started: float) -> None:
    """Train through the deployment, preempt the spot node partway, wait for the recovery the event starts, report."""
    from prefect.deployments import run_deployment

    from hetrain.testing.fakecloud import FakeCloudMetadata

    metadata = FakeCloudMetadata().start()
    run_id, runs_root = "demo", home / "runs"
    console.print(f"[bold]2/5[/] training run '{run_id}': gpt-small on the emulated cluster (fast x2 at 2x, spot "
                  f"slow x2 at 4x), {args.steps} steps, checkpoints every 10 steps to each node and to "
                  f"s3://hetrain-demo")
    train_run = run_deployment("hetrain-train/train", timeout=0, parameters={
        "run_id": run_id, "runs_root": str(runs_root), "model": "examples/models/gpt-small.yaml",
        "global_batch_size": 48, "spot_metadata_url": metadata.url("").rstrip("/"), "cloud": "aws",
        "options": {"steps": args.steps, "checkpoint_every": 10, "remote": f"s3://hetrain-demo/{run_id}",
                    "remote_endpoint": f"http://127.0.0.1:{s3_port}"}})
    metrics = RunDir(runs_root / run_id).metrics
    deadline = time.monotonic() + args.timeout_s

    def last_step() -> int:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        return json.loads(lines[-1])["step"] if lines else -1

    while last_step() < args.preempt_at_step:
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: training did not reach step {args.preempt_at_step}; see {home}/worker.log")
        time.sleep(0.3)
    notice_step = last_step()
    when = metadata.preempt("slow", args.notice_s)
    console.print(f"[bold]3/5[/] step {notice_step}: the cloud announces that spot node 'slow' goes away at "
                  f"{when:%H:%M:%S} ({args.notice_s:g} s notice)")
    train_state = wait_final(lambda: [train_run.id], deadline)
    if last_step() >= args.steps - 1 and not recovery_runs():
        raise SystemExit("demo: training finished before the node went away; use a larger --steps")
    console.print(f"    training flow run ended {train_state.name}; the node's watcher emitted hetrain.node.preempted")
    console.print("[bold]4/5[/] the event's automation started hetrain-recover/recover; waiting for it")
    recover_state = wait_final(lambda: recovery_runs(), deadline)
    if not recover_state.is_completed():
        raise SystemExit(f"demo: recovery ended {recover_state.name}: {recover_state.message}; see {home}/worker.log")
    report(runs_root / run_id, args.steps, notice_step, time.monotonic() - started, f"http://127.0.0.1:{api_port}",
           home)
    metadata.stop()


def one_machine_main(args, home: Path, started: float) -> None:
    """The demo on this machine: the services as child processes, stopped whatever happens."""
    api_port, s3_port = free_port(), free_port()
    env = _one_machine_env(home, api_port)
    os.environ.update(env)  # this process talks to the same server and bucket
    services = Services(home, env)
    try:
        _start_services(services, home, api_port, s3_port)
        _one_machine_run(args, home, api_port, s3_port, started)
    finally:
        services.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description="hetrain end to end: train, preempt a spot node, recover, finish")
    ap.add_argument("--home", default=str(ROOT / ".demo"), help="state of the demo (Prefect DB, runs, logs)")
    ap.add_argument("--steps", type=int, default=None, help="default: 50 on one machine, 150 on the test bed")
    ap.add_argument("--preempt-at-step", type=int, default=18)
    ap.add_argument("--notice-s", type=float, default=None,
                    help="seconds between the notice and the node's end (default: 5 on one machine, 60 on the bed)")
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--one-machine", action="store_true", help="one machine even where a test bed can be built")
    args = ap.parse_args()

    started = time.monotonic()
    home = Path(args.home).resolve()
    if home.exists():
        shutil.rmtree(home)
    home.mkdir(parents=True)
    from hetrain.testing import netbed

    ok, why = (False, "--one-machine") if args.one_machine else netbed.available()
    if ok:
        console.print("[bold]running on a network-namespace test bed[/]: several machines on this one (root and "
                      "`ip netns` are here; --one-machine to skip)")
        args.steps = args.steps or 150
        args.notice_s = args.notice_s if args.notice_s is not None else 60.0
        bed_main(args, home, started)
        return
    console.print(f"[bold]running on one machine[/] (no test bed: {why})", highlight=False)
    args.steps = args.steps or 50
    args.notice_s = args.notice_s if args.notice_s is not None else 5.0
    one_machine_main(args, home, started)


if __name__ == "__main__":
    main()
