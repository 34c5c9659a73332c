"""Spot preemption notices: poll the cloud's metadata endpoint or catch SIGTERM, then act.

On a notice the watcher (one per node) asks the node's training ranks for an emergency
checkpoint, if the deadline leaves time for one, by creating the run's request file (the
ranks agree on it through their per-step all-reduce and checkpoint at the next step), and
calls a hook (``hetrain watch --hook-command``, or the Prefect event the orchestration
layer plugs in). It fires once.

With ``defer_checkpoint_s``, a notice that leaves more time than that goes to the hook at once
and the checkpoint is left to the recovery it starts: a switch inside the notice window
(``hetrain.recovery.proactive``) asks for the checkpoint itself once its new ranks are ready,
and a checkpoint taken before would only spend the window. If nobody has asked by
``min_checkpoint_s`` before the deadline, the watcher asks then: nothing is lost when the
recovery never comes.

Documented endpoints (the base URL is configurable so tests point it at a local fake):

* AWS (IMDSv2): ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds``, then
  ``GET /latest/meta-data/spot/instance-action`` with ``X-aws-ec2-metadata-token``: 404 while
  there is none, else ``{"action": "terminate"|"stop"|"hibernate", "time": "2026-11-22T08:22:00Z"}``
  (about two minutes ahead).
* GCP: ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google``:
  ``TRUE`` once preempted; spot VMs get 30 s.
* Azure: ``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true``:
  ``{"Events": [{"EventType": "Preempt", "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT", ...}]}``.

The watcher outlives whatever the endpoint does: a poll reads at most ``MAX_ANSWER_BYTES`` and
gives up ``POLL_DEADLINE_S`` after it began however slowly the answer trickles in (a socket
timeout alone restarts with every byte), an answer it cannot read is the shortest notice (see
``_MetadataSource``), and a poll runs on its own thread so that a stop (SIGTERM, SIGINT,
``stop``) is acted on at once, not when the poll ends.
"""

from __future__ import annotations

import contextlib
import email.utils
import http.client
import io
import json
import os
import signal
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from hetrain.cost.notice import MIN_CHECKPOINT_S
from hetrain.errors import HetrainError
from hetrain.files import parse_json
from hetrain.rundir import ACTIVE_MARKER, RunDir, done_files, done_step

DEFAULT_BASE = {"aws": "http://169.254.169.254", "gcp": "http://metadata.google.internal",
                "azure": "http://169.254.169.254"}
GCP_SPOT_NOTICE_S = 30.0
SIGTERM_GRACE_S = 30.0
MIN_POLL_S = 0.5  # the metadata endpoint is shared by everything on the VM and rate-limited (AWS: ~10 req/s)
STOP_CHECK_S = 0.1  # how often a watcher waiting for a poll looks whether it was stopped (a SIGTERM's notice)


@dataclass
class Notice:
    cloud: str  # aws, gcp, azure or signal
    action: str  # terminate, stop, hibernate, preempt
    deadline: datetime | None  # UTC; when the machine goes away
    detail: dict = field(default_factory=dict)

    def seconds_left(self, now: datetime | None = None) -> float | None:
        if self.deadline is None:
            return None
        return (self.deadline - (now or datetime.now(UTC))).total_seconds()

    def to_dict(self) -> dict:
        data = asdict(self)
        data["deadline"] = self.deadline.isoformat() if self.deadline else None
        return data


# One poll (AWS: the token and the notice) gives up this long after it began, however the answer
# trickles in: the metadata service answers in milliseconds, and a poll stuck longer only delays the
# next one, which may see the notice (GCP and Azure give 30 s in all). A socket timeout alone does not
# bound it: every byte restarts it.
POLL_DEADLINE_S = 3.0
# The most of an answer that is read: a notice is ~100 bytes (AWS, GCP), Azure's scheduled events a
# few kB; anything longer is no answer of theirs and counts as unreadable.
MAX_ANSWER_BYTES = 64 << 10


class _DeadlineReader(io.RawIOBase):
    """The socket's bytes, each read waiting only until ``deadline`` (``time.monotonic``)."""

    def __init__(self, owner: _DeadlineSocket) -> None:
        super().__init__()
        self.owner = owner

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self.owner.sock.settimeout(_time_left(self.owner.deadline))
        try:
            return self.owner.sock.recv_into(buffer)
        except TimeoutError:  # waited until the deadline
            raise TimeoutError(_TOO_LATE) from None

    def close(self) -> None:
        if not self.closed:
            self.owner.release()
        super().close()


_TOO_LATE = f"no complete answer within {POLL_DEADLINE_S:g} s"


def _time_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(_TOO_LATE)
    return left


class _DeadlineSocket:
    """What ``http.client`` uses of a socket, every operation bounded by one deadline.

    Like a socket's ``makefile``, a reader keeps the socket open until it is closed too
    (``http.client`` closes the connection and reads the answer on)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline
        self._users = 1

    def sendall(self, data: bytes) -> None:
        self.sock.settimeout(_time_left(self.deadline))
        try:
            self.sock.sendall(data)
        except TimeoutError:
            raise TimeoutError(_TOO_LATE) from None

    def makefile(self, mode: str = "rb") -> io.BufferedReader:
        self._users += 1
        return io.BufferedReader(_DeadlineReader(self))

    def release(self) -> None:
        self._users -= 1
        if self._users == 0:
            self.sock.close()

    def close(self) -> None:
        if self._users > 0:
            self.release()


class _DeadlineConnection(http.client.HTTPConnection):
    def __init__(self, host: str, port: int | None, timeout_s: float, deadline: float) -> None:
        super().__init__(host, port, timeout=timeout_s)
        self.deadline = deadline

    def connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), timeout=min(self.timeout, _time_left(self.deadline)))
        self.sock = _DeadlineSocket(sock, self.deadline)


def _request(url: str, headers: dict[str, str], method: str = "GET", timeout_s: float = 2.0,
             deadline: float | None = None) -> tuple[int, bytes]:
    """The status and at most ``MAX_ANSWER_BYTES + 1`` bytes of the answer (more means too long).

    Everything (connecting, sending, the status line, headers and body) is done by ``deadline``
    (``time.monotonic``; default ``POLL_DEADLINE_S`` from now), else TimeoutError; ``timeout_s`` bounds
    each step as well. An answer that breaks HTTP raises HetrainError: the watcher retries.
    """
    deadline = time.monotonic() + POLL_DEADLINE_S if deadline is None else deadline
    parts = urllib.parse.urlsplit(url)
    conn = _DeadlineConnection(parts.hostname or "", parts.port, timeout_s, deadline)
    resp = None
    try:
        conn.request(method, urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, "")), headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read(MAX_ANSWER_BYTES + 1)
    except http.client.HTTPException as e:  # a status line, header or chunk that is not HTTP
        raise HetrainError(f"{parts.hostname}: not an HTTP answer ({type(e).__name__}: {str(e)[:200]})") from None
    finally:
        if resp is not None:
            resp.close()
        conn.close()


SHORTEST_NOTICE_S = 30.0  # GCP and Azure give 30 s: an answer we cannot read gets no more than that


class UnreadableNotice(ValueError):
    """The endpoint answered something other than "no notice" that we cannot read."""


def parse_utc(text: str) -> datetime:
    """An ISO 8601 time; one without a zone is UTC (what the metadata services mean)."""
    when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def _parse_json(body: bytes):
    """The answer as JSON, read as every reader of ours reads it (``hetrain.files.parse_json``: nesting
    at most 64 deep, no duplicate keys, no giant integers); UnreadableNotice otherwise."""
    try:
        return parse_json(body.decode("utf-8"), "the answer")
    except HetrainError as e:
        raise UnreadableNotice(str(e).removeprefix("the answer: ")) from None


class _MetadataSource:
    """A cloud's metadata endpoint; ``poll`` returns a Notice or None.

    Transport failures (no answer, a 5xx, no complete answer within ``POLL_DEADLINE_S``, an
    answer that is not HTTP) raise: the watcher retries. An answer that is neither "no notice"
    nor a notice we can read (whatever it holds: longer than ``MAX_ANSWER_BYTES``, nested too
    deep, of the wrong types) counts as a notice with the shortest deadline any cloud gives
    (``SHORTEST_NOTICE_S``): the node may be about to go, and a checkpoint that turns out
    unneeded costs seconds where a missed notice costs the work since the last one.
    """

    cloud = ""

    def __init__(self, base_url: str | None = None, timeout_s: float = 2.0,
                 deadline_s: float = POLL_DEADLINE_S) -> None:
        self.base = (base_url or DEFAULT_BASE[self.cloud]).rstrip("/")
        parts = urllib.parse.urlsplit(self.base)
        if parts.scheme != "http" or not parts.hostname:
            raise HetrainError(f"metadata URL '{self.base}': expected http://HOST[:PORT][/PATH] (the metadata "
                               f"services answer plain HTTP on a link-local address)")
        self.timeout_s, self.deadline_s = timeout_s, deadline_s

    def poll(self) -> Notice | None:
        body = self.fetch(time.monotonic() + self.deadline_s)
        if body is None:
            return None
        try:
            if len(body) > MAX_ANSWER_BYTES:
                raise UnreadableNotice(f"an answer of more than {MAX_ANSWER_BYTES} bytes")
            return self.parse(body)
        except Exception as e:  # noqa: BLE001 - whatever the answer holds, it is one we cannot read
            return Notice(self.cloud, "unreadable", datetime.now(UTC) + timedelta(seconds=SHORTEST_NOTICE_S),
                          {"answer": body[:500].decode(errors="replace"), "error": f"{type(e).__name__}: {e}"})

    def fetch(self, deadline: float) -> bytes | None:
        """The endpoint's answer (at most ``MAX_ANSWER_BYTES + 1`` bytes), or None for its "no notice"
        answer; by ``deadline`` (``time.monotonic``)."""
        raise NotImplementedError

    def parse(self, body: bytes) -> Notice | None:
        raise NotImplementedError


class AwsSpot(_MetadataSource):
    cloud = "aws"

    def fetch(self, deadline: float) -> bytes | None:
        status, token = _request(f"{self.base}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "300"},
                                 method="PUT", timeout_s=self.timeout_s, deadline=deadline)
        if status != 200:
            raise HetrainError(f"AWS metadata token request to {self.base} answered {status}")
        if len(token) > MAX_ANSWER_BYTES:
            raise HetrainError(f"AWS metadata token from {self.base}: more than {MAX_ANSWER_BYTES} bytes")
        status, body = _request(f"{self.base}/latest/meta-data/spot/instance-action",
                                {"X-aws-ec2-metadata-token": token.decode(errors="replace")}, timeout_s=self.timeout_s,
                                deadline=deadline)
        if status == 404:
            return None
        if status != 200:
            raise HetrainError(f"AWS spot/instance-action at {self.base} answered {status}")
        return body

    def parse(self, body: bytes) -> Notice | None:
        data = _parse_json(body)
        if not isinstance(data, dict):
            raise UnreadableNotice(f"expected a JSON object, got {type(data).__name__}")
        action = data.get("action")
        deadline = parse_utc(data["time"]) if isinstance(data.get("time"), str) else None
        if deadline is None or not isinstance(action, str):
            raise UnreadableNotice("expected 'action' and 'time'")
        return Notice("aws", action, deadline, data)


class GcpPreempted(_MetadataSource):
    cloud = "gcp"

    def fetch(self, deadline: float) -> bytes | None:
        status, body = _request(f"{self.base}/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"},
                                timeout_s=self.timeout_s, deadline=deadline)
        if status != 200:
            raise HetrainError(f"GCP instance/preempted at {self.base} answered {status}")
        return None if body.strip().upper() == b"FALSE" else body

    def parse(self, body: bytes) -> Notice | None:
        if body.strip().upper() != b"TRUE":
            raise UnreadableNotice("expected TRUE or FALSE")
        return Notice("gcp", "preempt", datetime.now(UTC) + timedelta(seconds=GCP_SPOT_NOTICE_S), {})


class AzureScheduledEvents(_MetadataSource):
    cloud = "azure"

    def fetch(self, deadline: float) -> bytes | None:
        status, body = _request(f"{self.base}/metadata/scheduledevents?api-version=2020-07-01", {"Metadata": "true"},
                                timeout_s=self.timeout_s, deadline=deadline)
        if status != 200:
            raise HetrainError(f"Azure scheduledevents at {self.base} answered {status}")
        return body

    def parse(self, body: bytes) -> Notice | None:
        data = _parse_json(body)
        events = data.get("Events") if isinstance(data, dict) else None
        if not isinstance(events, list):
            raise UnreadableNotice("expected an object with an 'Events' list")
        for event in events:
            if not isinstance(event, dict):
                raise UnreadableNotice("expected each event to be an object")
            if event.get("EventType") == "Preempt":
                not_before = event.get("NotBefore")
                deadline = email.utils.parsedate_to_datetime(not_before) if not_before else None
                if deadline is not None and deadline.tzinfo is None:
                    deadline = deadline.replace(tzinfo=UTC)
                return Notice("azure", "preempt", deadline or datetime.now(UTC) + timedelta(seconds=SHORTEST_NOTICE_S),
                              event)
        return None


SOURCES = {"aws": AwsSpot, "gcp": GcpPreempted, "azure": AzureScheduledEvents}


class PreemptionWatcher:
    """Poll ``source`` every ``poll_s`` (and catch SIGTERM); on the first notice, act once."""

    def __init__(self, source, node: str, *, request_file: Path | Callable[[], list[Path]] | None = None,
                 min_checkpoint_s: float = MIN_CHECKPOINT_S, on_notice: Callable[[Notice, bool], None] | None = None,
                 poll_s: float = 5.0, log: Callable[[str], None] = print, stop_after_checkpoint: bool = False,
                 defer_checkpoint_s: float | None = None) -> None:
        """``request_file``: the run's checkpoint request file, or a function giving those of the runs
        active at the notice (a node's watcher: see ``active_runs``). ``stop_after_checkpoint``: the
        runs end at the emergency checkpoint (a recovery resumes them from it elsewhere) rather than
        train on until the node goes. ``defer_checkpoint_s``: see the module's docstring."""
        self.stop_after_checkpoint = stop_after_checkpoint
        self.defer_checkpoint_s = defer_checkpoint_s
        self.deferred: threading.Timer | None = None  # the fallback request of a deferred checkpoint
        self.source, self.node = source, node
        self.request_file, self.min_checkpoint_s = request_file, min_checkpoint_s
        self.on_notice, self.poll_s, self.log = on_notice, poll_s, log
        self.notice: Notice | None = None
        self.requested: list[Path] = []  # the request files written for the notice
        self._fired = threading.Lock()
        self.stopped = threading.Event()  # no more polling
        self.handled = threading.Event()  # the notice was acted on (checkpoint requested, hook returned)

    def handle(self, notice: Notice) -> bool:
        """Request the emergency checkpoint if there is time, call the hook; False if already handled."""
        if not self._fired.acquire(blocking=False):
            return False
        self.notice = notice
        self.stopped.set()
        left = notice.seconds_left()
        files = self._request_files()
        why_not = "no time for a checkpoint" if files else "no run to checkpoint"
        problems = []
        defer = (bool(files) and left is not None and self.defer_checkpoint_s is not None
                 and left > self.defer_checkpoint_s)
        if defer:  # the recovery asks; the watcher only if nobody has, min_checkpoint_s before the deadline
            for request in files:  # answers to earlier notices must not count as a request for this one
                for old in done_files(request):
                    old.unlink(missing_ok=True)
            # a deadline years ahead (garbage) must not overflow the timer
            self.deferred = threading.Timer(min(left - self.min_checkpoint_s, threading.TIMEOUT_MAX),
                                            self._request_if_nobody_did, args=(files,))
            self.deferred.daemon = True
            self.deferred.start()
        elif files and (left is None or left >= self.min_checkpoint_s):
            problems = [p for p in map(self._request, files) if p]
        checkpoint = bool(self.requested)
        when = f"{left:.0f} s left" if left is not None else "no deadline given"
        unreadable = f" (unreadable answer: {notice.detail.get('error')})" if notice.action == "unreadable" else ""
        if defer:
            said = [f"the emergency checkpoint is left to the recovery (asked for here {self.min_checkpoint_s:g} s "
                    f"before the deadline if it has not been)"]
        else:
            asked = ("emergency checkpoint requested"
                     + (f" in {len(self.requested)} runs" if len(self.requested) > 1 else "")
                     + (", then the run stops" if self.stop_after_checkpoint else ""))
            said = ([asked] if checkpoint else []) + (problems or ([] if checkpoint else [why_not]))
        self.log(f"node {self.node}: {notice.cloud} {notice.action} notice ({when}){unreadable}; " + "; ".join(said))
        try:
            if self.on_notice is not None:
                self.on_notice(notice, checkpoint)
        finally:
            self.handled.set()
        return True

    def _request(self, request: Path) -> str | None:
        """Ask the run of ``request`` for the emergency checkpoint; the problem, if it could not be asked."""
        try:
            request.parent.mkdir(parents=True, exist_ok=True)
            for old in done_files(request):
                old.unlink(missing_ok=True)  # answers to earlier notices must not answer this one
            request.write_text(json.dumps({**self.notice.to_dict(), "stop": self.stop_after_checkpoint}))
            self.requested.append(request)
            return None
        except OSError as e:  # the notice still goes to the hook: it matters more than the checkpoint
            return f"cannot request a checkpoint ({request}: {e.strerror or e})"

    def _request_if_nobody_did(self, files: list[Path]) -> None:
        """A deferred checkpoint's fallback: request it for each run no recovery has asked yet."""
        for request in files:
            if request.exists() or any(done_files(request)):
                continue  # asked (a switch's request, pending or answered)
            problem = self._request(request)
            self.log(f"node {self.node}: " + (problem or f"no recovery asked for the emergency checkpoint of "
                                              f"{request.parent.name}; requested it {self.min_checkpoint_s:g} s "
                                              f"before the deadline"))

    def _request_files(self) -> list[Path]:
        if self.request_file is None:
            return []
        return [self.request_file] if isinstance(self.request_file, Path) else list(self.request_file())

    def install_sigterm(self, grace_s: float = SIGTERM_GRACE_S) -> None:
        """SIGTERM (what spot VMs and Kubernetes send first) counts as a notice with ``grace_s`` left."""
        def on_sigterm(_signum, _frame) -> None:
            threading.Thread(target=self.handle, args=(Notice("signal", "terminate",
                                                              datetime.now(UTC) + timedelta(seconds=grace_s)),),
                             daemon=True).start()

        signal.signal(signal.SIGTERM, on_sigterm)

    def run(self) -> Notice | None:
        """Poll until a notice arrives (then act on it) or ``stop`` is called; returns the notice.

        Each poll runs on a thread of its own while this one waits for it or for a stop: a SIGTERM
        (a notice), a SIGINT or ``stop`` ends the watch within ``STOP_CHECK_S`` even while a poll
        hangs (it gives up by ``POLL_DEADLINE_S``; one is left behind at most)."""
        errors = 0
        while not self.stopped.is_set():
            outcome = self._poll_once()
            if outcome is None:  # stopped while the poll was under way
                break
            notice, error = outcome
            if error is None:
                errors = 0
            else:  # the source's transport failure, or anything else it raised: still watching
                errors += 1
                if errors in (1, 10) or errors % 100 == 0:
                    self.log(f"node {self.node}: polling {self.source.cloud} failed ({error}); still watching")
            if notice is not None:
                self.handle(notice)
                break
            self.stopped.wait(self.poll_s)
        if self.notice is not None:  # a SIGTERM may be handled on another thread: let it finish
            self.handled.wait()
        return self.notice

    def _poll_once(self) -> tuple[Notice | None, BaseException | None] | None:
        """(notice, None) or (None, what the poll raised); None when stopped before the poll ended."""
        done = threading.Event()
        outcome: list = []

        def poll() -> None:
            try:
                outcome.append((self.source.poll(), None))
            except Exception as e:  # noqa: BLE001 - a watcher outlives any answer: logged, polled again
                outcome.append((None, e))
            finally:
                done.set()

        threading.Thread(target=poll, daemon=True, name=f"hetrain-poll-{self.node}").start()
        while not done.wait(STOP_CHECK_S):
            if self.stopped.is_set():
                return None
        return outcome[0]

    def stop(self) -> None:
        self.stopped.set()
        if self.deferred is not None:
            self.deferred.cancel()


def wait_for_checkpoint(request_file: Path, timeout_s: float, poll_s: float = 0.2) -> int | None:
    """The step of the emergency checkpoint once the ranks answered the request (``.done-<step>``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = done_files(request_file)
        if done:
            return max(map(done_step, done))
        time.sleep(poll_s)
    return None




@contextlib.contextmanager
def mark_active(run_dir: Path, info: dict) -> Iterator[None]:
    """While the block runs, ``run_dir`` is one of this node's active runs (``active_runs``).

    ``info`` is what a preemption of this node needs to start the run's recovery (for the
    orchestration layer: how the run was launched, its cluster file); the file also holds the
    pid that runs it, so a run whose process died without cleaning up is not taken as active.
    """
    path = RunDir.of(run_dir).active_marker
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), **info}))
    os.replace(tmp, path)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def active_runs(runs_root: Path) -> list[tuple[Path, dict]]:
    """The runs of ``runs_root`` whose ranks run on this node now, with their ``mark_active`` info."""
    found = []
    for marker in sorted(Path(runs_root).glob(f"*/{ACTIVE_MARKER}")):
        try:
            info = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue  # being written or removed
        if isinstance(info, dict) and _alive(info.get("pid")):
            found.append((marker.parent, info))
    return found
