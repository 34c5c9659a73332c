"""The watcher against a hostile metadata endpoint (issue 33): it outlives any answer (nested,
huge, endless, not HTTP), no poll outlasts its deadline however the answer trickles in, and a
SIGTERM or SIGINT ends `hetrain watch` at once even while a poll hangs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hetrain.recovery.preemption import (MAX_ANSWER_BYTES, POLL_DEADLINE_S, SHORTEST_NOTICE_S, AwsSpot,
                                         AzureScheduledEvents, PreemptionWatcher)
from tests.helpers import ROOT

TOKEN = "hostile-token"
NESTED = b"[" * 100_000 + b"]" * 100_000


def aws_notice(seconds_ahead: float = 120) -> bytes:
    when = datetime.now(UTC) + timedelta(seconds=seconds_ahead)
    return json.dumps({"action": "terminate", "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}).encode()


class HostileImds:
    """An AWS IMDSv2 endpoint on 127.0.0.1 with scripted answers: ``answers`` maps the number of a
    spot/instance-action request (0 first) to bytes, or to "trickle-body" / "trickle-head" (one byte a
    second, forever), "endless" (64 kB chunks at full speed, up to 50 MB) or "not-http" (no status
    line); requests not in it get
    ``then`` (bytes; None: 404, no notice). ``tokens`` does the same for the token requests (default:
    the token)."""

    def __init__(self, answers: dict, then: bytes | None = None, tokens: dict | None = None) -> None:
        self.answers, self.then, self.tokens = answers, then, tokens or {}
        self.gets = self.puts = 0
        self.closing = threading.Event()
        self.first_request = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _trickle(self, head: bool) -> None:
                try:
                    if head:  # the status line and an endless header, a byte a second
                        data = b"HTTP/1.0 200 OK\r\nX-Slow: " + b"a" * 10_000_000
                    else:
                        self.send_response(200)
                        self.end_headers()  # no length: the body runs to the end of the connection
                        data = b" " * 10_000_000  # JSON whitespace
                    for i in range(len(data)):
                        self.wfile.write(data[i:i + 1])
                        self.wfile.flush()
                        if fake.closing.wait(1.0):
                            return
                except OSError:  # the watcher gave up on it
                    pass

            def _endless(self) -> None:
                self.send_response(200)
                self.end_headers()
                try:
                    for _ in range(800):  # 50 MB at most, so that a reader without a bound ends too
                        self.wfile.write(b"a" * 65536)
                except OSError:
                    pass

            def _answer(self, answer) -> None:
                if answer in ("trickle-body", "trickle-head"):
                    return self._trickle(answer == "trickle-head")
                if answer == "endless":
                    return self._endless()
                if answer == "not-http":
                    self.wfile.write(b"\x00\x01 garbage, not a status line\r\n\r\n")
                    return None
                return self._send(404, b"") if answer is None else self._send(200, answer)

            def _answer_or_then(self, answers: dict, n: int, then) -> None:
                self._answer(answers[n] if n in answers else then)

            def do_PUT(self) -> None:
                fake.first_request.set()
                if not self.path.endswith("/latest/api/token"):
                    return self._send(400, b"")
                n, fake.puts = fake.puts, fake.puts + 1
                self._answer_or_then(fake.tokens, n, TOKEN.encode())

            def do_GET(self) -> None:
                fake.first_request.set()
                if not self.path.endswith("/latest/meta-data/spot/instance-action"):
                    return self._send(404, b"")
                if self.headers.get("X-aws-ec2-metadata-token") != TOKEN:
                    return self._send(401, b"")
                n, fake.gets = fake.gets, fake.gets + 1
                self._answer_or_then(fake.answers, n, fake.then)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def imds():
    made = []

    def make(*args, **kwargs) -> HostileImds:
        made.append(HostileImds(*args, **kwargs))
        return made[-1]

    yield make
    for server in made:
        server.close()


def watch_in_thread(url: str, poll_s: float = 0.1):
    calls = []
    watcher = PreemptionWatcher(AwsSpot(url), "spot-1", on_notice=lambda n, c: calls.append(n), poll_s=poll_s,
                                log=lambda m: None)
    thread = threading.Thread(target=watcher.run, daemon=True)
    thread.start()
    return watcher, thread, calls


def test_a_deeply_nested_answer_is_an_unreadable_notice_and_the_watcher_lives(imds):
    """200 kB of brackets (RecursionError killed the watcher, the hook never ran): an answer it cannot
    read, so the shortest notice (what any unreadable answer is), and the hook runs."""
    server = imds({0: NESTED}, then=aws_notice())
    watcher, thread, calls = watch_in_thread(server.url)
    thread.join(10)
    assert not thread.is_alive(), "the watcher never acted on the answer"
    watcher.stop()
    (notice,) = calls
    assert notice is watcher.notice and notice.action == "unreadable" and notice.cloud == "aws"
    assert SHORTEST_NOTICE_S - 5 < notice.seconds_left() <= SHORTEST_NOTICE_S
    assert "more than" in notice.detail["error"] and notice.detail["answer"] == "[" * 500


@pytest.mark.parametrize("answer,why", [
    (b"[" * 5000 + b"]" * 5000, "nested more than 64"),  # within the size bound: the nesting bound
    (b'{"action": "terminate", "time": "2030-01-01T00:00:00Z", "x": ' + b"[" * 900 + b"]" * 900 + b"}",
     "nested more than 64"),  # a notice carrying a nest Python can parse but not copy (to_dict)
    ("endless", f"more than {MAX_ANSWER_BYTES} bytes"),  # 50 MB were read into memory
    (b'{"action": "terminate", "time": 5}', "expected 'action' and 'time'"),
    (b'{"action": "terminate", "time": "2030-01-01T00:00:00Z", "n": 1' + b"0" * 5000 + b"}", "digits"),
    (b"\xff\xfe garbage", ""),
], ids=["brackets", "nest-in-a-notice", "endless", "time-a-number", "huge-int", "not-utf8"])
def test_any_answer_is_a_notice_or_unreadable_and_the_source_polls_on(imds, answer, why):
    """The same source reads the real notice on the next poll: nothing of the bad answer stays."""
    server = imds({0: None, 1: answer}, then=aws_notice())
    source = AwsSpot(server.url)
    assert source.poll() is None  # request 0: no notice (404)
    started = time.monotonic()
    notice = source.poll()
    assert time.monotonic() - started < 2
    assert notice.action == "unreadable" and why in notice.detail["error"], notice.detail["error"]
    json.dumps(notice.to_dict())  # what the hook gets
    assert source.poll().action == "terminate"


def test_a_notice_with_a_nest_inside_reaches_the_hook(imds, tmp_path: Path):
    """A notice whose extra field nests 900 deep parsed, then crashed the watcher while it asked for the
    checkpoint (the request file holds the notice): the hook never ran."""
    nested = b'{"action": "terminate", "time": "2030-01-01T00:00:00Z", "x": ' + b"[" * 900 + b"]" * 900 + b"}"
    server = imds({0: nested})
    calls = []
    watcher = PreemptionWatcher(AwsSpot(server.url), "spot-1", request_file=tmp_path / "checkpoint.request",
                                on_notice=lambda n, c: calls.append((n, c)), poll_s=0.1, log=lambda m: None)
    thread = threading.Thread(target=watcher.run, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and len(calls) == 1
    assert calls[0][0].action == "unreadable" and calls[0][1] is True
    assert json.loads((tmp_path / "checkpoint.request").read_text())["action"] == "unreadable"


def test_an_azure_answer_of_the_wrong_types_is_unreadable():
    from hetrain.testing.fakecloud import FakeCloudMetadata

    fake = FakeCloudMetadata().start()
    try:
        for answer in ('{"Events": [{"EventType": "Preempt", "NotBefore": 5}]}',
                       '{"Events": [{"EventType": "Preempt", "NotBefore": "Mon, 99 Zzz 99999 99:99:99 GMT"}]}',
                       '{"Events": [' * 3000 + "]}" * 3000):
            fake.answer("n1", "azure", answer)
            notice = AzureScheduledEvents(fake.url("n1")).poll()
            assert notice.action == "unreadable", answer
    finally:
        fake.stop()


@pytest.mark.parametrize("where", ["token", "notice-head", "notice-body"])
def test_a_trickling_answer_does_not_hide_the_notice(imds, where):
    """The first poll's answer trickles in a byte a second, forever (a socket timeout restarts with each
    byte: that poll never ended); the poll gives up at its deadline and the next one sees the notice."""
    trickle = {0: "trickle-head" if where == "notice-head" else "trickle-body"}
    server = imds({} if where == "token" else trickle, then=aws_notice(), tokens=trickle if where == "token" else None)
    started = time.monotonic()
    watcher, thread, calls = watch_in_thread(server.url)
    thread.join(10)
    seen = time.monotonic() - started
    watcher.stop()
    assert not thread.is_alive(), "no notice within 10 s: the trickling poll held the watcher"
    assert [n.action for n in calls] == ["terminate"]
    assert POLL_DEADLINE_S - 0.5 < seen < 10  # the first poll hung until its deadline, the next saw the notice


def test_an_answer_that_is_not_http_is_retried(imds):
    """Not a status line (http.client's BadStatusLine, no OSError, ended the watcher): a transport
    failure like a 5xx, logged; the next poll sees the notice."""
    server = imds({0: "not-http"}, then=aws_notice())
    logged = []
    watcher = PreemptionWatcher(AwsSpot(server.url), "spot-1", poll_s=0.1, log=logged.append)
    thread = threading.Thread(target=watcher.run, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and watcher.notice is not None and watcher.notice.action == "terminate"
    assert "not an HTTP answer" in logged[0] and "still watching" in logged[0]


def test_a_poll_gives_up_at_its_deadline(imds):
    server = imds({}, tokens={0: "trickle-body"})
    raised = []

    def poll() -> None:
        try:
            AwsSpot(server.url).poll()
        except Exception as e:  # noqa: BLE001
            raised.append(e)

    thread = threading.Thread(target=poll, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(POLL_DEADLINE_S + 5)
    assert not thread.is_alive(), "the poll still reads its trickling answer"
    assert time.monotonic() - started < POLL_DEADLINE_S + 1
    assert isinstance(raised[0], TimeoutError) and "no complete answer" in str(raised[0])


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_hetrain_watch_stops_at_once_while_a_poll_hangs(imds, tmp_path: Path, sig, code):
    """Every answer trickles; SIGTERM (a notice: the hook runs, exit 0) and SIGINT (a stop: no hook,
    exit 130) end `hetrain watch` within seconds (SIGTERM waited for the hung poll: forever)."""
    server = imds({}, tokens={n: "trickle-body" for n in range(100)})
    hook_out = tmp_path / "hook.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetrain", "watch", "--node", "spot-1", "--cloud", "aws", "--metadata-url", server.url,
         "--poll-s", "0.5", "--hook-command", f'echo "$HETRAIN_NOTICE" > {hook_out}'],
        cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        assert "watching aws" in proc.stderr.readline()
        assert server.first_request.wait(20)
        time.sleep(1.0)  # the poll hangs on its trickling answer
        sent = time.monotonic()
        proc.send_signal(sig)
        try:
            rest = proc.communicate(timeout=10)[1]
        except subprocess.TimeoutExpired:
            pytest.fail(f"hetrain watch still running 10 s after {sig.name}")
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, rest
    assert took < 3, f"{took:.1f} s after {sig.name}"
    if sig == signal.SIGTERM:
        assert json.loads(hook_out.read_text())["cloud"] == "signal"
    else:
        assert not hook_out.exists()


def test_a_metadata_url_that_is_not_plain_http_is_one_line():
    """The metadata services answer plain HTTP: anything else was polled (and failed) forever."""
    done = subprocess.run([sys.executable, "-m", "hetrain", "watch", "--node", "n", "--cloud", "aws",
                           "--metadata-url", "ftp://127.0.0.1/x"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "expected http://HOST" in done.stderr and "Traceback" not in done.stderr
