"""The run directory: every file of a run, and every message file between the control plane and the ranks.

One owner (nothing else builds these paths): ``hetrain train``, the flows, the recovery, the
node's watcher and the training ranks all name a run's files through ``RunDir`` and the
message helpers below. Torch-free, so the control plane and the ranks share it.

    RUN/config.json                the run config every rank reads (``RunConfig``)
    RUN/config-standby[-K].json    a warm start's config (the K-th switch of the run)
    RUN/plan.json                  the plan the run started on; plan-from-step-N.json after a recovery,
                                   plan-standby.json while a warm start waits
    RUN/cluster.json               a node run's cluster; cluster-from-step-N.json after a recovery
    RUN/metrics.jsonl              rank 0's per-step records (a path of the user's choice instead)
    RUN/tensorboard/               rank 0's TensorBoard event files of the same records (`tensorboard --logdir RUN`)
    RUN/timeline/p{P}-s{K}.json    when each op of one step ran on stage K of pipeline P (the launch's third step)
    RUN/loss.png, RUN/ranks.png    the records drawn when the run ends (hetrain.pictures; with matplotlib),
    RUN/timeline-measured.png      and the measured step's ops, stage by stage
    RUN/backup.json                rank 0's account of what reached the remote store, when the run ends
    RUN/launch[-NODE].log          the launcher's output
    RUN/node-run.json              present while a node's ranks of the run run (its watcher finds them)
    RUN/.lock                      held (flock) by the one `hetrain train` or train flow run driving the run
    RUN/pids/PID.pid               one per live worker: the launcher makes sure none outlives it
    RUN/checkpoints/NODE/          each node's checkpoint root (unless --checkpoint-dir puts it elsewhere)
    RUN/restore/step-N/            a reassembled checkpoint of step N (one at a time)
    RUN/archive/TIME/              what --restart moved aside

Messages (each a file; a rename is the answer, so a reader never sees half of one):

    RUN/checkpoint.request         the watcher asks for an emergency checkpoint ({"stop": bool})
    RUN/checkpoint.request.done-N  the ranks answer: committed at step N
    RUN/standby.json               the switch a warm start waits for ({"resume_from", "start_step"} or cancel)
    RUN/standby.json.ready         the warm start says it is built and waiting
    RUN/checkpoint.request.live    a live switch's offer: the old ranks serve the step's state (``checkpoint.live``)
    RUN/checkpoint.request.live.release   the old ranks may stop serving
    RUN/standby.json.live          the warm start's answer to a live switch: loaded and verified, or why not
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hetrain.errors import HetrainError
from hetrain.processes import alive, owner_token


CONFIG = "config.json"
RUN_DIR_ENV = "HETRAIN_RUN_DIR"  # set by launch for every process of a run: a worker shows whose it is
STANDBY_CONFIG = "config-standby.json"  # a warm start's run config (its workers are found by it)
STANDBY = "standby.json"
BACKUP_STATUS = "backup.json"
CHECKPOINT_REQUEST = "checkpoint.request"
METRICS = "metrics.jsonl"
READY_SUFFIX = ".ready"
LIVE_SUFFIX = ".live"
DONE_INFIX = ".done-"
LOCK = ".lock"
CHECKPOINTS = "checkpoints"  # RUN/checkpoints/NODE: each node's default checkpoint root (and what peers serve)
ACTIVE_MARKER = "node-run.json"  # in a run directory while a node's ranks of the run are running
LOCK_WORKERS_GRACE_S = 10.0  # how long the lock waits for a killed run's workers to end (they die within a second)


@dataclass(frozen=True)
class RunDir:
    """The files of the run in ``path`` (a resolved directory)."""

    path: Path

    @classmethod
    def of(cls, path: str | Path) -> RunDir:
        return cls(Path(path).resolve())

    @property
    def config(self) -> Path:
        return self.path / CONFIG

    def standby_config(self, k: int = 1) -> Path:
        """The K-th warm start's config (K > 1: a run switched again while its last switch's workers run)."""
        return self.path / (STANDBY_CONFIG if k == 1 else f"config-standby-{k}.json")

    @property
    def plan(self) -> Path:
        return self.path / "plan.json"

    @property
    def plan_standby(self) -> Path:
        """The plan a warm start trains on until its switch renames the run's plan."""
        return self.path / "plan-standby.json"

    @property
    def active_marker(self) -> Path:
        """Present while a node's ranks of the run are running (the node's watcher finds runs by it)."""
        return self.path / ACTIVE_MARKER

    def plan_from_step(self, step: int) -> Path:
        return self.path / f"plan-from-step-{step}.json"

    @property
    def cluster(self) -> Path:
        return self.path / "cluster.json"

    def cluster_from_step(self, step: int) -> Path:
        return self.path / f"cluster-from-step-{step}.json"

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def timeline(self) -> Path:
        """One step's measured ops, a file per stage (``hetrain.pictures.measured_timeline``)."""
        return self.path / "timeline"

    @property
    def backup_status(self) -> Path:
        return self.path / BACKUP_STATUS

    @property
    def checkpoint_request(self) -> Path:
        return self.path / CHECKPOINT_REQUEST

    @property
    def standby(self) -> Path:
        return self.path / STANDBY

    @property
    def pids(self) -> Path:
        return self.path / "pids"

    def launch_log(self, config_name: str = CONFIG, node: str | None = None) -> Path:
        """The launcher's log: a warm start's beside the running plan's, one per node where nodes run apart."""
        stem = "launch" if config_name == CONFIG else f"launch-{Path(config_name).stem.removeprefix('config-')}"
        return self.path / (f"{stem}.log" if node is None else f"{stem}-{node}.log")

    @property
    def checkpoints(self) -> Path:
        """The default checkpoint roots' parent: ``checkpoints/{node}``."""
        return self.path / CHECKPOINTS

    @property
    def archive(self) -> Path:
        return self.path / "archive"

    def live_workers(self, config_name: str | None = CONFIG) -> list[int]:
        """PIDs of this run's workers that are still alive (``pids/*.pid``, each as ``worker_record`` wrote it).

        ``config_name``: those of one launch (the run's, or a warm start's); None: of every launch
        of the run (a switched run trains under its warm start's config until it is switched again).
        """
        alive_pids = []
        pids = self.path / "pids"
        for pid_file in pids.glob("*.pid") if pids.is_dir() and not pids.is_symlink() else ():
            try:
                pid, config = _read_worker_record(pid_file, self.path)
            except (OSError, ValueError):
                continue
            if config is not None and _is_config_of(config, self.path, config_name):
                alive_pids.append(pid)
        return alive_pids

    @contextlib.contextmanager
    def lock(self, what: str = "`run_dir`", workers_grace_s: float = LOCK_WORKERS_GRACE_S) -> Iterator[None]:
        """Hold the run while the block runs: a second ``hetrain train`` (or train flow run) on it is refused.

        An advisory ``flock`` on ``RUN/.lock``: the kernel drops it when the holder exits, however it
        exits, so a crashed run never leaves the directory locked. The lock is no proof that nothing
        trains, though: the holder's workers may outlive it for a moment (they end with it, see
        ``hetrain.runtime.lifeline``), so the lock waits ``workers_grace_s`` for any worker of the run
        still alive and is refused while one is. ``.lock`` is opened without following a link and must
        be a regular file (a planted link would have us truncate and write another file). A recovery acts
        on a running run on purpose (the notice-window switch) and does not take it.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        path = self.path / LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as e:
            kind = "a symbolic link" if path.is_symlink() else "a directory" if path.is_dir() else None
            raise HetrainError(f"{what} {self.path}: {LOCK} is {kind}, expected the run's lock file (a regular file "
                               f"hetrain makes); remove it" if kind else
                               f"{what} {self.path}: cannot open {LOCK} ({e.strerror or e})") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise HetrainError(f"{what} {self.path}: {LOCK} is not a regular file, expected the run's lock file; "
                                   f"remove it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
                raise HetrainError(f"{what} {self.path}: another hetrain train is running this run (pid {holder}); "
                                   f"wait for it, stop it, or choose another run directory") from None
            deadline = time.monotonic() + workers_grace_s
            while (workers := self.live_workers(None)) and time.monotonic() < deadline:
                time.sleep(0.1)
            if workers:
                raise HetrainError(f"{what} {self.path}: {len(workers)} training process(es) of this run are still "
                                   f"alive (pid {', '.join(map(str, sorted(workers)))}) with no hetrain train holding "
                                   f"it; stop them (kill {' '.join(map(str, sorted(workers)))}) before running it again")
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            yield
        finally:
            os.close(fd)

    def restore(self, step: int) -> Path:
        """``restore/step-N``, where a reassembled checkpoint lands; older restores are removed (one is enough)."""
        mine = self.restored(step)
        if mine.parent.is_dir():
            for old in mine.parent.iterdir():
                if old != mine:
                    shutil.rmtree(old, ignore_errors=True)
        return mine

    def restored(self, step: int) -> Path:
        """Where ``restore(step)`` put a checkpoint (nothing removed)."""
        return self.path / "restore" / f"step-{step}"


def _is_config_of(arg: str, run_dir: Path, config_name: str | None) -> bool:
    if config_name is not None:
        return str(run_dir / config_name) in arg
    path = Path(arg)
    return path.parent == run_dir and path.name.startswith("config") and path.suffix == ".json"


def worker_record(config_path: str) -> str:
    """What a worker writes into ``RUN/pids/PID.pid``: its name for as long as it lives (pid and start time)
    and the config it trains under, so that neither a reused pid nor another launch's worker counts as it
    (a worker forked by ``hetrain.runtime.agent`` has its fork server's command line, not its config)."""
    return f"{owner_token()}\n{Path(config_path).resolve()}\n"


def _read_worker_record(pid_file: Path, run_dir: Path) -> tuple[int, str | None]:
    """(pid, the config it trains under) where that process lives and shows itself to be this run's, else
    (pid, None). A pid file is only a claim (anyone who can write the run directory can write one, and
    ``launch`` kills what they name): the process must carry the run itself, the config in its command line
    (any launcher's worker, an older hetrain's bare pid files) or ``RUN_DIR_ENV`` naming this run in its
    environment (``launch``'s workers, forked ones too), and its start time must match the record's."""
    lines = pid_file.read_text()[:4096].splitlines()
    token = lines[0] if lines else ""
    pid = int(token.partition(":")[0])
    if ":" in token and not alive(token):
        return pid, None
    proc = Path(f"/proc/{pid}")
    argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
    named = next((arg for arg in argv if arg.endswith(".json") and _is_config_of(arg, run_dir, None)), None)
    if named is not None:
        return pid, named
    carries = f"{RUN_DIR_ENV}={run_dir}\0" in (proc / "environ").read_bytes().decode(errors="replace")
    return pid, (lines[1] if carries and len(lines) >= 2 else None)


def run_dir_of_config(config_path: str | Path) -> RunDir:
    """The run directory a config file (the run's or a warm start's) lies in."""
    return RunDir.of(Path(config_path).resolve().parent)


# -- messages, on the paths the run config carries (``request_file``, ``standby_file``)
def done_file(request: str | Path, step: int) -> Path:
    """The ranks' answer to a checkpoint request: committed at ``step``."""
    request = Path(request)
    return request.with_name(f"{request.name}{DONE_INFIX}{step}")


def answer_request(request: str | Path, step: int, taken: bool = False) -> None:
    """The ranks answer a checkpoint request: committed at ``step`` (a rename: the request becomes ``.done-<step>``).

    ``taken``: a live switch took the request back when the state was offered (the new plan's
    ranks read the same request file); the answer is then written afresh, by every node's leader.
    """
    if taken:
        from hetrain.files import write_text_atomic

        write_text_atomic(done_file(request, step), "{}\n", "checkpoint answer")
        return
    with contextlib.suppress(FileNotFoundError):  # another node's leader answered first
        os.replace(request, done_file(request, step))


def done_files(request: str | Path) -> list[Path]:
    """The answers to ``request`` present now."""
    request = Path(request)
    return list(request.parent.glob(f"{request.name}{DONE_INFIX}*"))


def done_step(done: Path) -> int:
    """The step a ``done_file`` names."""
    return int(done.name.rsplit(DONE_INFIX, 1)[1])


def ready_file(standby: str | Path) -> Path:
    """Where a warm start says it is built and waiting for the switch."""
    standby = Path(standby)
    return standby.with_name(standby.name + READY_SUFFIX)


def live_offer_file(request: str | Path) -> Path:
    """Where the old plan's rank 0 offers a live switch its emergency state (``hetrain.checkpoint.live``)."""
    request = Path(request)
    return request.with_name(request.name + LIVE_SUFFIX)


def live_release_file(request: str | Path) -> Path:
    """Present once the old ranks may stop serving their state."""
    offer = live_offer_file(request)
    return offer.with_name(offer.name + ".release")


def live_result_file(standby: str | Path) -> Path:
    """Where a warm start answers a live switch: loaded and verified, or why not."""
    standby = Path(standby)
    return standby.with_name(standby.name + LIVE_SUFFIX)
