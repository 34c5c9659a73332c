"""Take the docs' screenshots of the Prefect UI with headless Chromium: ``python docs/_gen/screenshots.py``.

Starts what a user starts on one machine (docs/how-to/prefect-one-machine.md): ``prefect server start`` with
SQLite in a temp PREFECT_HOME, the ``hetrain`` process pool, the deployments of ``deployments/prefect.yaml``
and a worker; runs the train deployment once on the emulated CPU cluster (gpt-tiny, a few steps); then
photographs the flow run, its plan artifacts (the plan's table, its picture of the pipelines and its predicted
timeline), the run's pictures (the loss curve, each rank's time, the measured timeline) and the train deployment
with its nightly schedule into ``docs/images/``. Everything it started is stopped at the end
(``flows.demo.Services``). Needs a Chromium: ``chromium-headless-shell`` or ``chromium`` on PATH (Debian's
``apt-get install chromium-headless-shell``), or ``--chromium PATH``. Not part of the build: the images are
committed, and this script is how to take them again.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from flows.demo import Services  # noqa: E402
from hetrain.runtime.launch import free_port  # noqa: E402

IMAGES = ROOT / "docs" / "images"
WINDOW = "1400,1000"  # CSS pixels: the UI's side bar and a run's graph both fit
# Virtual time Chromium gives the UI's scripts to fetch and draw before the shot (with 20 s some shots were blank).
RENDER_BUDGET_MS = 60_000
RUN_TIMEOUT_S = 900  # the train flow profiles, plans and trains; a shared 2-core machine is slow
STEPS = 12  # enough steps for a loss curve in the logs, few enough to finish in a couple of minutes
GLOBAL_BATCH = 24  # sequences per step: enough that the plan uses the slow (spot) devices too, not only the fast ones
ARTIFACT_SHOTS = {  # artifact key of the "docs" run -> its page's screenshot
    "docs-training-plan": "prefect-plan-table.png",
    "docs-training-pipelines": "prefect-plan-pipelines.png",
    "docs-training-timeline": "prefect-plan-timeline.png",
    "docs-loss": "prefect-loss.png",
    "docs-ranks": "prefect-ranks.png",
    "docs-timeline-measured": "prefect-timeline-measured.png",
}


def chromium(explicit: str | None) -> str:
    for name in ([explicit] if explicit else ["chromium-headless-shell", "chromium", "chromium-browser"]):
        path = shutil.which(name) if name else None
        if path:
            return path
    raise SystemExit("screenshots: no Chromium found (apt-get install chromium-headless-shell, or --chromium PATH)")


def shoot(browser: str, url: str, out: Path) -> None:
    # --run-all-compositor-stages-before-draw: without it the shot was taken before the UI drew, one time in two
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--run-all-compositor-stages-before-draw", f"--window-size={WINDOW}",
                    f"--virtual-time-budget={RENDER_BUDGET_MS}",
                    f"--screenshot={out}", url], check=True, capture_output=True, timeout=120)
    print(f"{out.relative_to(ROOT)} <- {url}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chromium", help="path of a Chromium (default: found on PATH)")
    args = ap.parse_args()
    browser = chromium(args.chromium)
    home = Path(tempfile.mkdtemp(prefix="hetrain-screenshots-"))
    port = free_port()
    ui, api = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_WORKER_QUERY_SECONDS": "2", "COLUMNS": "200"}
    os.environ.update(PREFECT_API_URL=api, PREFECT_HOME=str(home))
    services = Services(home, env)
    try:
        services.start_prefect_server(port)
        services.deploy_with_worker()

        from prefect.client.orchestration import get_client
        from prefect.deployments import run_deployment

        run = run_deployment("hetrain-train/train", timeout=0, parameters={
            "run_id": "docs", "runs_root": str(home / "runs"), "global_batch_size": GLOBAL_BATCH,
            "options": {"steps": STEPS}})
        deadline = time.monotonic() + RUN_TIMEOUT_S
        with get_client(sync_client=True) as client:
            while not (state := client.read_flow_run(run.id).state) or not state.is_final():
                if time.monotonic() > deadline:
                    raise SystemExit(f"screenshots: the train flow run did not finish in {RUN_TIMEOUT_S} s")
                time.sleep(2)
            if not state.is_completed():
                raise SystemExit(f"screenshots: the train flow run ended {state.name}; see {home}/worker.log")
            deployment = client.read_deployment_by_name("hetrain-train/train")
            from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

            artifacts = {a.key: a for a in client.read_latest_artifacts(artifact_filter=ArtifactCollectionFilter(
                key=ArtifactCollectionFilterKey(any_=list(ARTIFACT_SHOTS))))}
        IMAGES.mkdir(exist_ok=True)
        shoot(browser, f"{ui}/runs/flow-run/{run.id}", IMAGES / "prefect-train-run.png")
        for key, name in ARTIFACT_SHOTS.items():
            if key not in artifacts:
                raise SystemExit(f"screenshots: the flow run published no artifact {key}")
            shoot(browser, f"{ui}/artifacts/artifact/{artifacts[key].latest_id}", IMAGES / name)
        shoot(browser, f"{ui}/deployments/deployment/{deployment.id}", IMAGES / "prefect-schedule.png")
    finally:
        services.stop()
    shutil.rmtree(home, ignore_errors=True)  # kept when something failed: its prefect-server.log and worker.log say why


if __name__ == "__main__":
    main()
