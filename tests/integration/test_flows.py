"""Flows against a real ``prefect server start`` with a real process worker.

The deployments come from deployments/prefect.yaml through `prefect deploy`; the preemption
event goes through Prefect's events API, the automation creates the recovery flow run, and
the worker runs it like on a cluster node. The server's scheduler creates the nightly runs of
the train deployment, and a schedule a few seconds ahead runs to completion
(test_the_server_schedules_the_nightly_runs_and_a_scheduled_run_finishes). The module's one
server, deployments and worker serve every test.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="hetrain-prefect-home-")
for _k, _v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
    os.environ.setdefault(_k, _v)  # for the moto bucket, in this process and the worker's flow runs

import pytest  # noqa: E402
from prefect.client.orchestration import get_client  # noqa: E402
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId  # noqa: E402
from prefect.deployments import run_deployment  # noqa: E402
from prefect.settings import PREFECT_API_URL, temporary_settings  # noqa: E402

from flows.demo import Services  # noqa: E402
from flows.events import emit_preempted  # noqa: E402
from flows.train import train  # noqa: E402
from hetrain.checkpoint.store import CheckpointStore  # noqa: E402
from hetrain.config import TrainOptions  # noqa: E402
from hetrain.rundir import RunDir  # noqa: E402
from tests.helpers import ROOT  # noqa: E402


HOME = Path(os.environ["PREFECT_HOME"])  # the server's database and log, the worker's log
SCHEDULER_LOOP_S = 2  # the server's default is 60 s
NIGHTLY_CRON = "0 3 * * *"


@pytest.fixture(scope="module")
def server():
    """``prefect server start`` as a user starts it (SQLite in this module's PREFECT_HOME, its log in
    ``prefect-server.log`` there), but for the scheduler's loop: every 2 s, not 60, so the nightly test
    does not wait a minute for it. This process's flows, clients and ``run_deployment`` talk to it, as
    ``prefect_test_harness`` makes them talk to its server."""
    from prefect.context import _temporary_global_settings_context, get_settings_context

    from hetrain.runtime.launch import free_port

    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": str(SCHEDULER_LOOP_S),
           "COLUMNS": "200"}
    services = Services(HOME, env)  # the demo's owner of child processes: stopped at the end, whatever happened
    try:
        services.start_prefect_server(port)
        # as prefect_test_harness: the settings of this context and of contexts copied before it
        with temporary_settings({PREFECT_API_URL: api}), _temporary_global_settings_context(get_settings_context()):
            yield api
    finally:
        services.stop()


def prefect_cli(api: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_API_URL": api, "COLUMNS": "200"}
    r = subprocess.run([sys.executable, "-m", "prefect", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=180)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.fixture(scope="module")
def bucket():
    """An S3 API on loopback (moto) with a bucket for the runs' backups."""
    import s3fs
    from moto.server import ThreadedMotoServer

    from hetrain.runtime.launch import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    s3fs.S3FileSystem(endpoint_url=endpoint).mkdir("flows")
    yield endpoint
    server.stop()


@pytest.fixture(scope="module")
def deployed(server):
    prefect_cli(server, "work-pool", "create", "hetrain", "--type", "process")
    r = prefect_cli(server, "--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml")
    return server, r.stdout


@pytest.fixture(scope="module")
def worker(deployed):
    api = deployed[0]
    log = open(HOME / "worker.log", "w")
    # it looks for runs every 2 s (Prefect's default 10, as flows/bed.py's workers): each recovery waits for one
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", "hetrain"], cwd=ROOT,
                            env={**os.environ, "PREFECT_API_URL": api, "PREFECT_WORKER_QUERY_SECONDS": "2"},
                            stdout=log, stderr=subprocess.STDOUT)
    yield proc
    proc.terminate()
    try:
        proc.wait(5)  # idle by now; a worker that lingers on SIGTERM only costs the suite time
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


async def _deployment(name: str):
    async with get_client() as client:
        return await client.read_deployment_by_name(name)


async def _runs_of(deployment_id) -> list:
    async with get_client() as client:
        return await client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))


def wait_for_runs(deployment_id, count: int, timeout_s: float = 240) -> list:
    """Flow runs of a deployment once ``count`` of them reached a final state."""
    import anyio

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runs = anyio.run(_runs_of, deployment_id)
        done = [r for r in runs if r.state and r.state.is_final()]
        if len(done) >= count:
            return done
        time.sleep(1)
    raise AssertionError(f"{count} flow runs of deployment {deployment_id} did not finish in {timeout_s} s")


def check_pictures(run_dir: Path) -> None:
    """The run's pictures are image artifacts, read back through Prefect's client: the PNG files that
    ``hetrain.pictures`` drew into the run directory, byte for byte, as ``data:`` URLs (loss and ranks, the
    loss also part way: more than one version), and the plan's predicted and measured timelines as PNGs."""
    import base64

    import anyio
    from prefect.client.schemas.filters import (ArtifactCollectionFilter, ArtifactCollectionFilterKey, ArtifactFilter,
                                                ArtifactFilterKey)

    keys = ["e2e-loss", "e2e-ranks", "e2e-training-timeline", "e2e-timeline-measured"]

    async def read():
        async with get_client() as client:
            latest = await client.read_latest_artifacts(
                artifact_filter=ArtifactCollectionFilter(key=ArtifactCollectionFilterKey(any_=keys)))
            versions = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))
            return {a.key: a for a in latest}, [a.key for a in versions]

    latest, versions = anyio.run(read)
    assert set(latest) == set(keys)
    png = {}
    for key, artifact in latest.items():
        assert artifact.type == "image" and artifact.data.startswith("data:image/png;base64,"), key
        png[key] = base64.b64decode(artifact.data.split(",", 1)[1])
        assert png[key].startswith(b"\x89PNG\r\n\x1a\n") and len(png[key]) > 5_000, key  # a drawing, not a dot
    assert png["e2e-loss"] == (run_dir / "loss.png").read_bytes()
    assert png["e2e-ranks"] == (run_dir / "ranks.png").read_bytes()
    assert versions.count("e2e-loss") > 1  # published as the run went, not only at its end


def test_train_flow_end_to_end(server, tmp_path: Path):
    result = train(run_id="e2e", runs_root=str(tmp_path), options=TrainOptions(steps=8, checkpoint_every=4))
    assert result["status"] == "completed" and result["first_step"] == 0 and result["last_step"] == 7
    assert CheckpointStore(str(tmp_path / "e2e" / "checkpoints" / "fast")).committed_steps() == [3, 7]
    import anyio

    async def artifacts():
        async with get_client() as client:
            return {a.key: a for a in await client.read_artifacts()}

    arts = anyio.run(artifacts)
    assert {"e2e-training-plan", "e2e-training-pipelines", "e2e-progress", "e2e-iteration-time"} <= set(arts)
    assert "pipeline 0:" in arts["e2e-training-pipelines"].data
    check_pictures(tmp_path / "e2e")
    # run again, as the schedule does, on fresh data: the run resumes after its newest checkpoint, 4 more steps
    again = train(run_id="e2e", runs_root=str(tmp_path),
                  options=TrainOptions(more_steps=4, checkpoint_every=4, data="examples/data/tiny.txt"))
    assert again["resumed_from"] == 7 and again["first_step"] == 8 and again["last_step"] == 11


def test_simulate_flow_plans_replays_and_publishes_a_table_and_a_picture(server, tmp_path: Path):
    """The simulate flow plans the cluster itself, replays a drawn market and publishes both artifacts."""
    import base64

    import anyio
    import yaml

    from flows.simulate import simulate
    from hetrain.recovery.simulate import SimulateOptions

    cluster = {"name": "sim", "inter_node_bandwidth_gbps": 1.0,
               "gpu_types": {"cpu": {"tflops": 0.02, "fp32_tflops": 0.01, "memory_gb": 8,
                                     "memory_bandwidth_gbps": 10, "efficiency": 1.0}},
               "nodes": [{"name": "od", "gpu": "cpu", "count": 1, "intra_node_bandwidth_gbps": 2.0,
                          "price_per_gpu_hour": 2.0},
                         {"name": "sp", "gpu": "cpu", "count": 1, "intra_node_bandwidth_gbps": 2.0, "spot": True,
                          "price_per_gpu_hour": 1.0, "preemptions_per_hour": 1.0, "notice_s": 30}]}
    (tmp_path / "sim.yaml").write_text(yaml.safe_dump(cluster))
    rows = simulate(name="sim", clusters=[str(tmp_path / "sim.yaml")], model="examples/models/gpt-tiny.yaml",
                    global_batch_size=8, options=SimulateOptions(replays=5, hours=6), runs_root=str(tmp_path))
    assert [r["strategy"] for r in rows] == ["hetrain", "bucket restarts", "on-demand"]
    assert (tmp_path / "simulations" / "sim" / "simulation.json").is_file()

    async def artifacts():
        async with get_client() as client:
            return {a.key: a for a in await client.read_artifacts()}

    arts = anyio.run(artifacts)
    assert arts["sim-simulation"].type == "table" and "bucket restarts" in arts["sim-simulation"].data
    picture = arts["sim-replay"]
    assert picture.type == "image" and picture.data.startswith("data:image/png;base64,")
    png = (tmp_path / "simulations" / "sim" / "replay.png").read_bytes()
    assert base64.b64decode(picture.data.split(",", 1)[1]) == png


def test_prefect_yaml_deploys_a_schedule_and_a_trigger(deployed):
    import anyio

    api, _ = deployed
    dep_train = anyio.run(_deployment, "hetrain-train/train")
    assert dep_train.schedules and dep_train.schedules[0].schedule.cron == "0 3 * * *"
    dep_recover = anyio.run(_deployment, "hetrain-recover/recover")
    assert dep_recover.work_pool_name == "hetrain"
    dep_simulate = anyio.run(_deployment, "hetrain-simulate/simulate")  # its options a form: SimulateOptions' schema
    assert "SimulateOptions" in json.dumps(dep_simulate.parameter_openapi_schema)
    r = prefect_cli(api, "automation", "ls")
    assert "recover" in r.stdout


def test_a_recovery_stops_only_its_runs_node_runs(deployed):
    """``stop_run`` (what a recovery does first) cancels the node runs tagged with its run, and no other."""
    from flows.fanout import run_tag, stop_run

    from datetime import UTC, datetime, timedelta

    def node_run(run_id: str, node: str):  # due in an hour: no worker takes them, they stay Scheduled
        return run_deployment("hetrain-node/node", timeout=0, tags=[run_tag(run_id)],
                              scheduled_time=datetime.now(UTC) + timedelta(hours=1),
                              parameters={"run_id": run_id, "node": node, "plan": {}, "cluster": {},
                                          "rendezvous": "a:29500", "steps": 1})

    mine = [node_run("stopme", n) for n in ("a", "b")]
    other = node_run("keepme", "a")
    said = []
    assert sorted(stop_run("stopme", "node b is lost", said.append)) == ["a", "b"]
    with get_client(sync_client=True) as client:
        states = [client.read_flow_run(r.id).state for r in mine]
        assert all(s.is_cancelled() and s.message == "node b is lost" for s in states), states
        assert client.read_flow_run(other.id).state.is_scheduled()
    assert said == ["stopping run stopme on a, b: node b is lost"]
    assert stop_run("stopme", "again", said.append) == []  # nothing left going


def test_preemption_event_starts_recovery_through_the_trigger(deployed, worker, bucket, tmp_path: Path):
    import anyio

    dep = anyio.run(_deployment, "hetrain-recover/recover")
    runs_root = tmp_path / "runs"
    # FLOP-based plan (no profile): all four devices, so the spot node's shards must come from the bucket
    first = train(run_id="spot", runs_root=str(runs_root), use_profile=False,
                  options=TrainOptions(steps=6, checkpoint_every=3, remote="s3://flows/spot", remote_endpoint=bucket))
    plan_before = json.loads((runs_root / "spot" / "plan.json").read_text())
    assert any(d.startswith("slow/") for p in plan_before["pipelines"] for s in p["stages"] for d in s["devices"])
    assert first["status"] == "completed"
    nodes = runs_root / "spot" / "checkpoints"
    assert CheckpointStore(str(nodes / "fast")).committed_steps() == [2, 5]
    # the run goes on to step 12 after recovery: raise the target as a longer run would have had
    config_path = runs_root / "spot" / "config.json"
    config = json.loads(config_path.read_text())
    config["steps"] = 10
    config_path.write_text(json.dumps(config))

    emit_preempted("spot", "slow", {"cloud": "aws", "action": "terminate", "deadline": None}, 5, str(runs_root))
    (run,) = wait_for_runs(dep.id, 1)
    assert run.state.is_completed(), run.state.message
    # every payload field rendered into a parameter; the port as a number (the json kind in prefect.yaml)
    assert run.parameters == {"run_id": "spot", "lost_node": "slow", "runs_root": str(runs_root), "launch": "local",
                              "cluster": "", "lost_until": "", "rendezvous_port": 29500}
    metrics = [json.loads(line) for line in (runs_root / "spot" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics][-4:] == [6, 7, 8, 9]  # resumed right after the last commit
    report = json.loads((runs_root / "spot" / "recovery-from-step-5.json").read_text())
    assert report["bytes_from_peers"] > 0 and report["bytes_from_remote"] > 0
    # the report drawn (each phase, the fetch by source) and shown in the UI
    from prefect.artifacts import Artifact

    from flows.report import artifact_key

    assert (runs_root / "spot" / "recovery-from-step-5.png").stat().st_size > 5_000
    picture = Artifact.get(artifact_key("spot", "recovery-timeline"))
    assert picture is not None and picture.type == "image" and picture.data.startswith("data:image/png;base64,")
    assert CheckpointStore(str(nodes / "fast")).committed_steps()[-1] == 9
    plan = json.loads((runs_root / "spot" / "plan-from-step-5.json").read_text())
    assert all(not d.startswith("slow/") for p in plan["pipelines"] for s in p["stages"] for d in s["devices"])


def test_two_notices_at_once_make_one_switch_inside_the_notice_window(deployed, worker, bucket, tmp_path: Path):
    """Spot nodes b and c get notices at once while the run trains: two events, two recovery flow runs.

    The first to take the run's recovery slot takes both nodes (the other ends as merged) and
    switches the run to a plan on node a inside the notice window: warm ranks, emergency
    checkpoint, switch; every step trained once.
    """
    import threading
    from datetime import UTC, datetime, timedelta

    import anyio
    from prefect.artifacts import Artifact

    from flows.recover import _merge_key
    from hetrain.config import CheckpointConfig
    from hetrain.plan.schema import Plan
    from hetrain.runtime.launch import worker_pids
    from tests.helpers.training import CLUSTER_YAML, plan, run

    dep = anyio.run(_deployment, "hetrain-recover/recover")
    (tmp_path / "cluster.yaml").write_text(CLUSTER_YAML)
    run_dir = tmp_path / "run"  # the run "run" under runs root tmp_path
    old = plan(1, [(5, [("a/0", [0, 2]), ("b/0", [2, 6])]), (3, [("a/1", [0, 4]), ("c/0", [4, 6])])])
    cfg = CheckpointConfig(local_dir=str(tmp_path / "nodes" / "{node}"), every_steps=1000, keep=2,
                           remote_url="s3://flows/twice", remote_options={"endpoint_url": bucket})
    trained = threading.Thread(target=run, args=(old, tmp_path, 100_000), daemon=True,
                               kwargs={"checkpoint": cfg, "cluster": str(tmp_path / "cluster.yaml"),
                                       "request_file": str(run_dir / "checkpoint.request")})
    trained.start()
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert time.monotonic() < deadline and trained.is_alive(), "the run did not start training"
        time.sleep(0.2)
    until = (datetime.now(UTC) + timedelta(seconds=150)).isoformat()
    for node in ("b", "c"):
        emit_preempted("run", node, {"cloud": "aws", "action": "terminate", "deadline": until}, None, str(tmp_path))
    # the new plan trains once the run's config names it; a few steps after, the operator stops it
    deadline = time.monotonic() + 240
    while "plan-from-step" not in json.loads((run_dir / "config.json").read_text())["plan"]:
        assert time.monotonic() < deadline, "no switch"
        time.sleep(0.5)
    switch_step = json.loads((run_dir / "config.json").read_text())["start_step"] - 1
    while json.loads(metrics.read_text().splitlines()[-1])["step"] < switch_step + 3:
        assert time.monotonic() < deadline, "the new plan does not train"
        time.sleep(0.5)
    (run_dir / "checkpoint.request").write_text(json.dumps({"stop": True}))
    trained.join(60)

    deadline = time.monotonic() + 120
    while True:
        ours = [r for r in anyio.run(_runs_of, dep.id) if r.parameters.get("runs_root") == str(tmp_path)]
        if len(ours) == 2 and all(r.state and r.state.is_final() for r in ours):
            break
        assert time.monotonic() < deadline, [(r.name, r.state) for r in ours]
        time.sleep(1)
    assert all(r.state.is_completed() for r in ours), [r.state.message for r in ours]
    merged = [r for r in ours if Artifact.get(_merge_key("run", str(r.id))) is not None]
    assert len(merged) == 1  # one notice's recovery took the other's node
    (report,) = [json.loads(p.read_text()) for p in run_dir.glob("recovery-from-step-*.json")]
    assert sorted(report["lost_nodes"]) == ["b", "c"] and report["checkpoint_step"] == switch_step
    assert {d.split("/")[0] for d in report["plan_devices"]} == {"a"}
    assert report["bytes_from_remote"] == 0  # b's and c's shards came from b and c, inside their notice
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(len(steps))) and steps[-1] > switch_step  # every step once, across the switch
    assert not worker_pids(run_dir, None)
    # the old plan ended at its emergency checkpoint; the same plan change as a cold restart from
    # that checkpoint trains the same losses as the warm ranks did
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[switch_step].get("stopped")
    new_plan = Plan.model_validate_json(Path(report["plan"]).read_text())
    cold = run(new_plan, tmp_path / "cold", steps=switch_step + 4, start_step=switch_step + 1,
               resume_from=str(RunDir(run_dir).restored(switch_step)))
    assert [r["loss"] for r in cold] == [r["loss"] for r in records[switch_step + 1:switch_step + 4]]


BAD_RECOVERIES = [
    ({"run_id": "nope", "lost_node": "slow"}, "unknown run 'nope'"),
    ({"run_id": "spot", "lost_node": "zz"}, "lost node 'zz' is not a node of cluster"),
    ({"run_id": "spot", "lost_node": "slow", "cluster": "no/such-cluster.yaml"}, "no/such-cluster.yaml: file not found"),
]


@pytest.fixture(scope="module")
def bad_recoveries(server, tmp_path_factory) -> dict[str, object]:
    """The bad recovery requests, each a flow run of ``hetrain-recover`` on the server: flow run ids by reason.

    They run in this process: through the worker, three engines starting at once took a minute of the
    suite (CI) to reach the same flow code. The worker's way to the flow, its parameters from the
    deployment, is test_preemption_event_starts_recovery_through_the_trigger's.
    """
    from flows.recover import recover

    runs_root = tmp_path_factory.mktemp("bad") / "runs"
    (runs_root / "spot").mkdir(parents=True)
    (runs_root / "spot" / "config.json").write_text(json.dumps({
        "plan": str(ROOT / "missing-plan.json"), "cluster": str(ROOT / "examples" / "clusters" / "cpu-emulated.yaml")}))
    return {expected: recover(**parameters, runs_root=str(runs_root), return_state=True).state_details.flow_run_id
            for parameters, expected in BAD_RECOVERIES}


@pytest.mark.parametrize("parameters,expected", BAD_RECOVERIES)
def test_bad_recovery_requests_fail_with_a_reason(bad_recoveries, parameters, expected):
    """The server's record of the flow run (what the UI shows): failed, the reason in its message."""
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(bad_recoveries[expected])
    assert run.state.is_failed(), run.state
    assert expected in run.state.message, run.state.message


def test_parameters_that_fail_validation_are_refused_with_the_field(deployed):
    from prefect.exceptions import PrefectHTTPStatusError

    with pytest.raises(PrefectHTTPStatusError, match="timeout_s.*less than or equal to the minimum of 0"):
        run_deployment("hetrain-recover/recover", parameters={"run_id": "spot", "lost_node": "slow", "timeout_s": -1},
                       timeout=0)
    with pytest.raises(PrefectHTTPStatusError, match="run_id"):
        run_deployment("hetrain-recover/recover", parameters={"run_id": "../etc", "lost_node": "slow"}, timeout=0)


# -- the nightly schedule --------------------------------------------------------------------------------------------
def _client_call(api: str, fn):
    """Run ``await fn(client)`` against the server at ``api``."""
    import anyio

    async def go():
        with temporary_settings({PREFECT_API_URL: api}):
            async with get_client() as client:
                return await fn(client)

    return anyio.run(go)


def _runs_of_train(api: str) -> list:
    async def fn(client):
        dep = await client.read_deployment_by_name("hetrain-train/train")
        return dep, await client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])))

    return _client_call(api, fn)


def test_the_server_schedules_the_nightly_runs_and_a_scheduled_run_finishes(deployed, worker, tmp_path: Path):
    """The nightly retraining really runs. What a user relies on, end to end, from a fresh install: deploy
    ``deployments/prefect.yaml`` as the README says, and the server's scheduler creates the train deployment's
    upcoming runs (it did not with SQLAlchemy 2.1, issue 32: the scheduler failed every minute and "Upcoming"
    stayed empty); a schedule a few seconds ahead creates a run that a worker picks up and finishes, with
    committed checkpoints."""
    api, _ = deployed
    # 1. the nightly cron from prefect.yaml: the scheduler creates the upcoming runs, each at 03:00 UTC
    deadline = time.monotonic() + 60
    while True:
        dep, runs = _runs_of_train(api)
        nightly = [r for r in runs if r.state_type.value == "SCHEDULED"]
        if nightly or time.monotonic() > deadline:
            break
        time.sleep(1)
    server_log = (HOME / "prefect-server.log").read_text()
    assert "bulk DML" not in server_log, server_log[-3000:]
    assert dep.schedules[0].schedule.cron == NIGHTLY_CRON
    assert nightly, f"no scheduled run of hetrain-train/train after 60 s; server log:\n{server_log[-3000:]}"
    for r in nightly:
        start = r.expected_start_time.astimezone(dt.timezone.utc)
        assert (start.hour, start.minute) == (3, 0) and start > dt.datetime.now(dt.timezone.utc)

    # 2. a schedule a few seconds ahead (parameters of its own: a short run in tmp_path): the scheduler
    # creates the run, the worker starts it, the train flow trains and checkpoints
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import IntervalSchedule

    anchor = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=5)
    params = {"run_id": "scheduled", "options": {"steps": 4, "checkpoint_every": 2}, "runs_root": str(tmp_path)}

    async def add_schedule(client):
        return await client.create_deployment_schedules(dep.id, [DeploymentScheduleCreate(
            schedule=IntervalSchedule(interval=dt.timedelta(days=1), anchor_date=anchor), active=True,
            parameters=params)])

    _client_call(api, add_schedule)
    deadline = time.monotonic() + 300
    ours = []
    while time.monotonic() < deadline:
        _, runs = _runs_of_train(api)
        ours = [r for r in runs if r.parameters.get("run_id") == "scheduled"]
        if any(r.state_type.value in ("COMPLETED", "FAILED", "CRASHED") for r in ours):
            break
        time.sleep(2)
    done = [r for r in ours if r.state_type.value == "COMPLETED"]
    assert done, (f"the scheduled run did not finish: {[(r.name, r.state_type.value) for r in ours]}\n"
                  f"worker log:\n{(HOME / 'worker.log').read_text()[-4000:]}")
    assert done[0].auto_scheduled and abs((done[0].expected_start_time - anchor).total_seconds()) < 1
    assert CheckpointStore(str(tmp_path / "scheduled" / "checkpoints" / "fast")).committed_steps() == [1, 3]
