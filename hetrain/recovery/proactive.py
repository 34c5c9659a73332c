"""Recovery inside a preemption notice: the new plan starts before the node goes, training pauses only to switch.

A restart after the node is gone pays, in order: re-planning, fetching the checkpoint, and
starting the new plan's processes (interpreter, torch, rendezvous, model build: seconds on
CPU, tens of seconds with CUDA contexts and NCCL communicators). A notice (AWS: 2 minutes,
GCP and Azure: about 30 s) leaves time to do all but the fetch of the last step while the old
plan still trains. ``recover_in_notice_window``:

1. re-plans for the nodes that stay;
2. starts the new plan's processes as a *warm start* (``RunConfig.standby_file``): they build
   their stages, run a collective on each of their groups and wait, idle;
3. once they are ready, asks the old plan for an emergency checkpoint at its next step and
   to stop there (the checkpoint request with ``stop``; every rank agrees on the step through
   the step's all-reduce);
4. fetches that step to the run's restore directory from the nodes that stay, then from the
   leaving nodes themselves (still up: their shards need not wait for the bucket), the bucket
   last, everything verified against the manifest;
5. writes the switch: the warm ranks load (DCP reshards) and train from the step after it.

Live (``live=True``, ``hetrain.checkpoint.live``): at step 3 the old ranks save the state
into their memory and serve it instead of waiting for the disk commit; steps 4 and 5 become one:
the warm ranks fetch exactly the slices their new stages need from the old ranks, verify them
against the offer and load them (DCP reshards), within ``live_timeout_s``. The emergency
checkpoint is committed to disk and the bucket once the new ranks have answered (a commit
beside the transfer would compete with it). A live transfer that fails on any rank (a slice
that differs from its digest, the deadline, an old rank gone) is answered as failed; the old
ranks' commit is then waited for and the switch takes the disk path (steps 4 and 5) with the
same warm ranks. An old rank that died took the emergency step with it (it was only in its
memory): the fetch finds the step incomplete and the run restarts from the newest committed one.

Deadline guard: if the warm start is not ready with ``switch_reserve_s`` left before the
deadline, or dies, or the emergency step cannot be fetched whole (a leaving node gone before
the bucket had its shards), the checkpoint is still asked for, the warm start is cancelled and
the run restarts the usual way (``recover``, once the old ranks have ended and uploaded): the
last committed step is never lost, and nothing partly fetched is loaded. The
downtime (the wall time between the old plan's last step and the new plan's first) is read
from the run's metrics.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# Imported now, not on the switch's critical path: verifying the fetched .metadata needs DCP's
# metadata classes, a first import of several seconds on a loaded machine.
import hetrain.checkpoint.safe_metadata  # noqa: F401
from hetrain.checkpoint.reassemble import FetchReport, FileFetch, Source, reassemble_newest
from hetrain.checkpoint.store import CheckpointStore
from hetrain.errors import HetrainError
from hetrain.files import write_text_atomic
from hetrain.plan.schema import load_plan, validate_plan
from hetrain.cost.notice import DEFAULT_SWITCH_RESERVE_S
from hetrain.recovery.preemption import wait_for_checkpoint
from hetrain.recovery.recover import Planner, RecoveryResult, recover, surviving_cluster, write_report
from hetrain.run.runs import load_run, sources_for
from hetrain.rundir import (RunDir, done_files, done_step, live_offer_file, live_release_file, live_result_file,
                            ready_file)
from hetrain.spec.specs import load_cluster

# At least this long for the old plan's ranks to finish the last checkpoint's bucket upload
# after the switch (else until the deadline) before they are stopped.
OLD_EXIT_S = 5.0
# How long the warm ranks get to fetch, verify and load the offered state before the switch takes
# the disk path: a small model loads in well under a second on loopback, a multi-GB stage over a
# 10 Gb/s link in a few seconds; past this the disk path (about 10 s on CPU) is no slower.
DEFAULT_LIVE_TIMEOUT_S = 30.0
# Past the live deadline, how long the warm ranks get to agree on their answer and write it.
LIVE_ANSWER_GRACE_S = 10.0
POLL_S = 0.02  # the switch's polls of its message files: a fraction of a step


@dataclass
class NoticeRecovery(RecoveryResult):
    switched: bool = False  # False: the deadline guard fell back to a restart
    why_not: str | None = None  # why it fell back
    leaving_nodes: list[str] = field(default_factory=list)
    live: dict = field(default_factory=dict)  # a live attempt's answer: ok, why, load_s, bytes (empty: none tried)

    def bytes_from(self) -> dict[str, int]:
        """Bytes fetched from the nodes that stay, from the leaving nodes and from the bucket."""
        out = {"staying": 0, "leaving": 0, "remote": 0}
        for f in self.fetch.files:
            kind = "remote" if f.source == "remote" else "leaving" if f.source in self.leaving_nodes else "staying"
            out[kind] += f.size
        return out


def standby_config_name(run_dir: Path) -> str:
    """A config name no running launch of the run uses: a switched run trains under its warm start's
    config, and the next notice's warm start must not take its name."""
    from hetrain.runtime.launch import worker_pids

    k = 1
    while worker_pids(run_dir, name := RunDir(run_dir).standby_config(k).name):
        k += 1
    return name


def downtime(records_before: list[dict], records_after: list[dict]) -> float | None:
    """Seconds between the end of the old plan's last step and the start of the new plan's first.

    A record is written after its step's checkpoint: the old plan's emergency checkpoint is
    part of the downtime, the new plan's first step is not.
    """
    if not records_before or not records_after:
        return None
    last, first = records_before[-1], records_after[0]
    if "time" not in last or "time" not in first:
        return None
    return first["time"] - first["step_time_s"] - (last["time"] - last.get("checkpoint_s", 0.0))


def recover_in_notice_window(run_dir: Path, leaving_nodes: list[str], planner: Planner, deadline: float, *,
                             cluster_file: Path | None = None, steps: int | None = None, timeout_s: float = 10.0,
                             switch_reserve_s: float = DEFAULT_SWITCH_RESERVE_S, steps_after: int | None = None,
                             on_progress: Callable[[str], None] | None = None,
                             on_record: Callable[[dict], None] | None = None, live: bool = False,
                             live_timeout_s: float = DEFAULT_LIVE_TIMEOUT_S) -> NoticeRecovery:
    """Switch the running run in ``run_dir`` to a plan without ``leaving_nodes`` before ``deadline`` (epoch s).

    The running plan (the run's, or an earlier switch's) ends at the emergency checkpoint; a
    run that is not training is restarted the usual way. Returns the switch's (or the fallback restart's) result, with the
    new plan's metric records and the timings: ``replan_s``, ``warm_start_s`` (until the new
    ranks were ready), ``checkpoint_s`` (request to commit), ``fetch_s``, ``downtime_s``.
    ``steps``: where the new plan ends (default the run's); ``steps_after``: instead, this many
    steps after the switch (benchmarks and tests, which cannot know the switch step ahead).
    ``live``: move the state from the old ranks' memory to the new ranks' (see the module's note);
    the result's ``live`` says how that went, ``switched`` with an empty ``why_not`` and
    ``fetch.dest`` the offer's index URL when it did.
    """
    switch = _NoticeSwitch(run_dir.resolve(), leaving_nodes, deadline, cluster_file, timeout_s, switch_reserve_s,
                           on_progress or (lambda _: None), on_record)
    switch.replan(planner, steps)
    why_not = switch.warm_start()
    # The emergency checkpoint, whether or not the switch goes ahead: never lose the last step.
    step, offer = switch.emergency_checkpoint(live=live and why_not is None)
    if offer is not None:
        result = switch.switch_live(offer, steps_after, live_timeout_s)
        if result is not None:
            return result
        step = switch.committed_after_live(offer["step"])
        if not switch.thread.is_alive():  # nothing waits for the disk path's switch: restart
            why_not = f"the warm start failed: {switch.outcome.get('error')}"
    if step is None and why_not is None:
        why_not = "the old plan committed no checkpoint before the deadline"
    report = None
    if why_not is None:
        switch.say(f"old plan checkpointed step {step} and stopped")
        report, why_not = switch.fetch(step)
    if why_not is not None:  # the restart reads what the staying nodes and the bucket hold once the old ranks end
        if step is not None and steps_after:
            steps = step + 1 + steps_after
        return switch.fall_back(why_not, planner, steps)
    return switch.hand_over(report, step, steps_after)


class _NoticeSwitch:
    """The steps of ``recover_in_notice_window``, in order, sharing the run and what each step learnt."""

    def __init__(self, run_dir: Path, leaving_nodes: list[str], deadline: float, cluster_file: Path | None,
                 timeout_s: float, switch_reserve_s: float, say: Callable[[str], None],
                 on_record: Callable[[dict], None] | None) -> None:
        from hetrain.runtime.launch import worker_pids

        self.run, self.leaving_nodes, self.deadline = RunDir(run_dir), list(leaving_nodes), deadline
        self.cluster_file, self.timeout_s, self.switch_reserve_s = cluster_file, timeout_s, switch_reserve_s
        self.say, self.on_record = say, on_record
        self.config = load_run(run_dir)
        self.old_pids = worker_pids(run_dir, None)  # the running plan's ranks (the run's, or an earlier switch's)
        if self.config.checkpoint is None:
            raise HetrainError(f"--run {run_dir}: the run keeps no checkpoints; nothing to switch from")
        if self.config.request_file is None:
            raise HetrainError(f"--run {run_dir}: the run takes no checkpoint requests")
        self.cluster_path = cluster_file or (Path(self.config.cluster) if self.config.cluster else None)
        if self.cluster_path is None:
            raise HetrainError(f"--run {run_dir}: the run has no cluster file; pass --cluster")
        self.old_plan = load_plan(self.config.plan)
        self.metrics = Path(self.config.metrics) if self.config.metrics else self.run.metrics
        self.request = Path(self.config.request_file)
        self.timings: dict[str, float] = {}
        self.outcome: dict = {}
        self.thread: threading.Thread | None = None
        self.live: dict = {}  # a live attempt's answer (``switch_live``)

    def replan(self, planner: Planner, steps: int | None) -> None:
        """The new plan without the leaving nodes, and the warm start's config (its standby file cleared)."""
        new_cluster = surviving_cluster(load_cluster(self.cluster_path), self.leaving_nodes, str(self.cluster_path))
        started = time.perf_counter()
        self.plan = planner(new_cluster, self.old_plan.model, self.old_plan.settings())
        validate_plan(self.plan, new_cluster)
        self.timings["replan_s"] = time.perf_counter() - started
        self.plan.write(self.run.plan_standby)
        self.say(f"re-planned for {len(self.plan.devices())} devices without {', '.join(self.leaving_nodes)}")
        for stale in (self.run.standby, ready_file(self.run.standby)):
            stale.unlink(missing_ok=True)
        for done in done_files(self.request):
            done.unlink()
        self.standby_config = self.config.model_copy(update={
            "plan": str(self.run.plan_standby), "cluster": str(Path(self.cluster_path).resolve()),
            "steps": steps or self.config.steps, "start_step": 0, "resume_from": None, "resume_options": {},
            "standby_file": str(self.run.standby)})

    def warm_start(self) -> str | None:
        """Start the new plan's ranks beside the old ones and wait until they are ready; why not, if they are not."""
        from hetrain.plan.layout import build_layout
        from hetrain.runtime.launch import launch

        standby_name = standby_config_name(self.run.path)

        def run_standby() -> None:
            try:
                self.outcome["records"] = launch(self.standby_config, build_layout(self.plan), self.run.path,
                                                 config_name=standby_name, on_record=self.on_record)
            except BaseException as e:  # noqa: BLE001 - reported to the caller's thread
                self.outcome["error"] = e

        self.thread = threading.Thread(target=run_standby, name="hetrain-standby", daemon=True)
        started = time.perf_counter()
        why_not = None
        left_s = self.deadline - time.time()
        if not self.old_pids:  # nothing trains: nothing to checkpoint or to switch from
            why_not = "the run is not training"
        elif left_s <= self.switch_reserve_s:  # no time to start anything: checkpoint now, restart after
            why_not = f"{max(0.0, left_s):.0f} s left, the switch needs more than {self.switch_reserve_s:g} s"
        else:
            self.thread.start()
        ready = ready_file(self.run.standby)
        while why_not is None and not ready.exists():
            if not self.thread.is_alive():
                why_not = f"the warm start failed: {self.outcome.get('error')}"
                break
            if time.time() > self.deadline - self.switch_reserve_s:
                why_not = f"the warm start was not ready {self.switch_reserve_s:g} s before the deadline"
                break
            time.sleep(0.05)
        self.timings["warm_start_s"] = time.perf_counter() - started
        if why_not is None:
            self.say(f"new plan's ranks ready in {self.timings['warm_start_s']:.1f} s")
        return why_not

    def emergency_checkpoint(self, live: bool = False) -> tuple[int | None, dict | None]:
        """Ask the old plan's ranks to checkpoint and stop: (committed step, None), or with ``live``
        (offered step, offer) once they serve it; (None, None): nothing before the deadline."""
        if not self.old_pids:
            return None, None
        started = time.perf_counter()
        for stale in (live_offer_file(self.request), live_release_file(self.request),
                      live_result_file(self.run.standby)):
            stale.unlink(missing_ok=True)
        request = {"stop": True, "reason": "notice-window switch", **({"live": True} if live else {})}
        write_text_atomic(self.request, json.dumps(request) + "\n", "checkpoint request")
        offer = self._wait_for_offer() if live else None
        if offer is not None:  # answered by the offer: taken back, else the new plan's ranks would read it
            self.request.unlink(missing_ok=True)
        step = offer["step"] if offer else wait_for_checkpoint(self.request, max(0.0, self.deadline - time.time()),
                                                                poll_s=POLL_S)
        self.timings["checkpoint_s"] = time.perf_counter() - started
        return step, offer

    def _wait_for_offer(self) -> dict | None:
        """The old plan's live offer; None when it answered without one, ended, or the deadline came."""
        from hetrain.runtime.launch import worker_pids

        path = live_offer_file(self.request)
        while time.time() < self.deadline and not done_files(self.request):
            try:
                return json.loads(path.read_text())
            except (FileNotFoundError, ValueError):
                pass
            if not set(self.old_pids) & set(worker_pids(self.run.path, None)):
                return None
            time.sleep(POLL_S)
        return None

    def switch_live(self, offer: dict, steps_after: int | None, live_timeout_s: float) -> NoticeRecovery | None:
        """The warm ranks load the offered state; the switch's result, or None (``self.live`` says why)."""
        step = offer["step"]
        self.say(f"old plan offers step {step} live")
        end = step + 1 + steps_after if steps_after else self.standby_config.steps
        live_deadline = min(self.deadline, time.time() + live_timeout_s)
        started = time.perf_counter()
        write_text_atomic(self.run.standby, json.dumps({"live": offer, "live_deadline": live_deadline,
                                                        "start_step": step + 1, "steps": end}) + "\n",
                          "standby switch")
        answer = live_result_file(self.run.standby)
        self.live = {"ok": False, "why": "the new ranks did not answer"}
        while self.thread.is_alive() and time.time() < live_deadline + LIVE_ANSWER_GRACE_S:
            try:
                self.live = json.loads(answer.read_text())
                break
            except (FileNotFoundError, ValueError):
                time.sleep(POLL_S)
        self.timings["live_s"] = time.perf_counter() - started
        write_text_atomic(live_release_file(self.request), "{}\n", "live release")  # the old ranks may go
        if not self.live.get("ok"):
            self.say(f"live switch failed, taking the disk path: {self.live.get('why')}")
            return None
        files = [FileFetch(name, entry["size"], entry["node"], self.timings["live_s"], [])
                 for name, entry in offer["files"].items()]
        report = FetchReport(step, offer["metadata"]["url"], files, self.timings["live_s"])
        return self.hand_over(report, step, steps_after, live=True)

    def committed_after_live(self, step: int) -> int | None:
        """After a failed live switch: ``step`` once the old ranks committed it; None if they ended first."""
        from hetrain.runtime.launch import worker_pids

        started = time.perf_counter()
        committed = None
        while time.time() < self.deadline:
            if done := done_files(self.request):
                committed = max(map(done_step, done))
                break
            if not set(self.old_pids) & set(worker_pids(self.run.path, None)):
                break
            time.sleep(POLL_S)
        self.timings["commit_wait_s"] = time.perf_counter() - started
        # ended without answering (one died after the commit): the fetch finds whether the step is whole
        return committed if committed is not None else step

    def fetch(self, step: int):
        """The checkpoint of ``step`` into the run's restore slot, leaving nodes included; (report, why not)."""
        started = time.perf_counter()
        peers, remote = sources_for(self.config, self.old_plan, self.leaving_nodes)
        leaving = [Source(n, CheckpointStore.for_peer(self.config.checkpoint, n)) for n in self.leaving_nodes]
        report, why_not = None, None
        try:
            report = reassemble_newest(peers + leaving, remote, lambda s: str(self.run.restore(s)),
                                       model=self.old_plan.model, timeout_s=self.timeout_s)
            if report.step != step:  # the bucket may have it once the old ranks finish their upload
                why_not = f"step {step} could not be fetched whole ({'; '.join(report.passed_over)})"
        except HetrainError as e:  # e.g. a leaving node gone mid-fetch before the bucket had its shards
            why_not = f"the fetch failed ({e})"
        self.timings["fetch_s"] = time.perf_counter() - started
        return report, why_not

    def fall_back(self, why_not: str, planner: Planner, steps: int | None) -> NoticeRecovery:
        """No switch: once the old ranks end, cancel the warm start and restart the usual way."""
        from hetrain.runtime.launch import wait_for_workers_to_exit

        wait_for_workers_to_exit(self.run.path, timeout_s=max(5.0, self.deadline - time.time()), pids=self.old_pids)
        old_records = _records(self.metrics)
        if self.thread is not None and self.thread.is_alive():
            write_text_atomic(self.run.standby, json.dumps({"cancel": True}) + "\n", "standby switch")
            self.thread.join(60)
        self.say(f"falling back to a restart: {why_not}")
        result = recover(self.run.path, self.leaving_nodes, planner, cluster_file=self.cluster_file, steps=steps,
                         timeout_s=self.timeout_s, on_record=self.on_record)
        out = NoticeRecovery(**vars(result), switched=False, why_not=why_not, leaving_nodes=list(self.leaving_nodes),
                             live=self.live)
        out.timings_s.update(self.timings)
        out.timings_s["downtime_s"] = downtime(old_records, result.records)
        return out

    def hand_over(self, report, step: int, steps_after: int | None, live: bool = False) -> NoticeRecovery:
        """The switch: the warm start loads the fetched checkpoint and trains on; the run is the new plan's.

        ``live``: the warm start already loaded the state from the old ranks; the run's config then
        names no checkpoint (the emergency step reaches the node roots and the bucket behind it).
        """
        from hetrain.runtime.launch import wait_for_workers_to_exit, write_config

        # The old ranks freed their GPU memory before answering (Trainer.release_device_memory) and
        # now only finish the checkpoint's bucket upload: the switch does not wait for them.
        final_plan = self.run.plan_from_step(report.step)
        self.plan.write(final_plan)
        end = report.step + 1 + steps_after if steps_after else self.standby_config.steps
        if not live:
            write_text_atomic(self.run.standby, json.dumps({"resume_from": report.dest,
                                                            "start_step": report.step + 1, "steps": end}) + "\n",
                              "standby switch")
        # From now on the run is the new plan's: later recoveries and resumes (another notice while it
        # trains) read the run's config, and find its ranks under the warm start's config name.
        write_config(self.standby_config.model_copy(update={
            "plan": str(final_plan), "start_step": report.step + 1, "steps": end,
            "resume_from": None if live else report.dest,
            "standby_file": None}), self.run.path)
        self.say(f"switched: the new plan trains from step {report.step + 1}")
        wait_for_workers_to_exit(self.run.path, timeout_s=max(OLD_EXIT_S, self.deadline - time.time()),
                                 pids=self.old_pids)
        self.thread.join()
        if "error" in self.outcome:
            raise self.outcome["error"]
        records = self.outcome["records"]
        old_records = [r for r in _records(self.metrics) if r["step"] <= step]
        self.timings["downtime_s"] = downtime(old_records, records)
        result = NoticeRecovery(self.run.path, list(self.leaving_nodes), report.step, self.plan, final_plan, report,
                                self.timings, records, switched=True, leaving_nodes=list(self.leaving_nodes),
                                live=self.live)
        write_report(result, self.old_plan)
        return result


def _records(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    out = []
    for line in metrics.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
