"""The nightly retraining really runs: a real ``prefect server start`` schedules the train deployment's runs.

What a user relies on, end to end, from a fresh install: deploy ``deployments/prefect.yaml`` as the
README says, and the server's scheduler creates the train deployment's upcoming runs (it did not with
SQLAlchemy 2.1, issue 32: the scheduler failed every minute and "Upcoming" stayed empty); a schedule
a few seconds ahead creates a run that a worker picks up and finishes, with committed checkpoints.

The only change from a user's server is the scheduler's loop (2 s here, 60 s by default), so the
test does not wait a minute for it.
"""

from __future__ import annotations

import datetime as dt
import os
import tempfile
import time
from pathlib import Path

import pytest

from flows.demo import Services
from hetrain.checkpoint.store import CheckpointStore
from hetrain.runtime.launch import free_port

SCHEDULER_LOOP_S = 2  # the server's default is 60 s
NIGHTLY_CRON = "0 3 * * *"


@pytest.fixture(scope="module")
def server():
    """``prefect server start`` (SQLite in a temp PREFECT_HOME), the work pool, the deployments, a worker."""
    home = Path(tempfile.mkdtemp(prefix="hetrain-schedule-"))
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": str(SCHEDULER_LOOP_S),
           "PREFECT_WORKER_QUERY_SECONDS": "2", "COLUMNS": "200"}
    services = Services(home, env)  # the demo's owner of child processes: logs in home, all stopped at the end
    try:
        services.start_prefect_server(port)
        services.deploy_with_worker()
        yield api, home
    finally:
        services.stop()


def _client_call(api: str, fn):
    """Run ``await fn(client)`` against the server at ``api``."""
    import anyio
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def go():
        with temporary_settings({PREFECT_API_URL: api}):
            async with get_client() as client:
                return await fn(client)

    return anyio.run(go)


def _runs_of_train(api: str) -> list:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    async def fn(client):
        dep = await client.read_deployment_by_name("hetrain-train/train")
        return dep, await client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])))

    return _client_call(api, fn)


def test_the_server_schedules_the_nightly_runs_and_a_scheduled_run_finishes(server, tmp_path: Path):
    api, home = server
    # 1. the nightly cron from prefect.yaml: the scheduler creates the upcoming runs, each at 03:00 UTC
    deadline = time.monotonic() + 60
    while True:
        dep, runs = _runs_of_train(api)
        nightly = [r for r in runs if r.state_type.value == "SCHEDULED"]
        if nightly or time.monotonic() > deadline:
            break
        time.sleep(1)
    server_log = (home / "prefect-server.log").read_text()
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
                  f"worker log:\n{(home / 'worker.log').read_text()[-4000:]}")
    assert done[0].auto_scheduled and abs((done[0].expected_start_time - anchor).total_seconds()) < 1
    assert CheckpointStore(str(tmp_path / "scheduled" / "checkpoints" / "fast")).committed_steps() == [1, 3]
