"""Serve a node's checkpoint root read-only over HTTP, so peers can reassemble from it.

A Starlette app on uvicorn: ``StaticFiles`` confined to the root (it refuses paths that
resolve outside it, ``../`` included), plus ``GET /_steps`` listing the committed steps
(``StaticFiles`` serves no directory listings). With a token every request must carry
``Authorization: Bearer <token>``; clients read it from ``HETRAIN_PEER_TOKEN``.

Only checkpoint files are served: a manifest, ``.metadata`` or a shard (``__<rank>_<n>.distcp``)
directly inside a step directory (``step-<N>``) at any depth below the root, and ``<dir>/_steps``.
Anything else under the root (a run's config.json, metrics, logs) is 404, token or not.

uvicorn never times out a request whose headers do not arrive, and holds every connection it
accepts: 150 half-sent requests used up the server's file descriptors (issue 33). Its HTTP
protocol here is guarded by the limits below: a deadline for each request's line and headers, a
deadline on inactivity while a response waits for the client to read (never on a download's total
time), and a cap on open connections that drops the oldest connection still waiting for its
request, so a flood of slow clients cannot crowd out a peer that asks at once. The event loop
holds idle connections without a thread each; files are read on anyio's bounded thread pool.

    hetrain serve --root /local/ckpt --host 0.0.0.0 --port 8470 [--token-env HETRAIN_PEER_TOKEN]
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import socket
import struct
import threading
import time
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from hetrain.checkpoint.manifest import CHECKPOINT_FILE, MANIFEST, STEP_DIR
from hetrain.checkpoint.store import STEPS_LISTING, CheckpointStore
from hetrain.errors import HetrainError

try:
    import fcntl
    import termios
except ImportError:  # not POSIX: inactivity is a pause of IDLE_TIMEOUT_S (see _pending_bytes)
    pass

# A real client sends its request line and headers in one small write, and a kept-alive peer asks
# again within moments; a connection that has not sent a whole request this long after it opened
# (or after its previous response) is a slow or stalled client and is dropped.
HEADER_TIMEOUT_S = 5.0
# A response is only ever cut for inactivity: the client has taken nothing for this long while the
# socket's buffers are full. A peer reading a shard pauses for its disk and its hash (well under a
# second); a download that moves, however slowly and however long, never hits it.
IDLE_TIMEOUT_S = 30.0
# Every connection holds a socket, and while it downloads an open file: two descriptors, so 64 need
# about 130 (150 half-open connections once exhausted a server's), and they cover eight recovering
# nodes fetching with eight workers each from this one peer at once.
# Past the cap a new connection evicts the oldest one still waiting for its request (a slow client, or
# an idle kept-alive one), or is closed at once when every connection is busy with a response.
MAX_DOWNLOADS = 64
# Connections open at once, waiting for their request or served: past MAX_DOWNLOADS a request is answered 503
# with Retry-After (a burst of 200 peers' downloads is answered, never reset; issue 48). Past this cap a new
# connection evicts the oldest one still waiting for its request (a slow client, or an idle kept-alive one),
# or is closed at once when every connection has a request in progress. 256 sockets and 64 open files stay
# well inside DESCRIPTORS_WANTED.
MAX_CONNECTIONS = 256
RETRY_AFTER_S = 1
# Request line plus headers: a peer's GET is a few hundred bytes and a handful of headers. h11 bounds only a
# request still arriving (a whole 40 KB one in one read passed), so every request is measured again.
MAX_HEADER_BYTES = 16 * 1024
MAX_HEADERS = 100
# On stop, responses still in flight get this long before they are cut.
SHUTDOWN_GRACE_S = 3.0
# Connections the kernel queues for us, which is also the most asyncio accepts in one turn of the event
# loop, before the cap above can act on them. uvicorn's 2048 let a burst take every descriptor, and
# asyncio then logs the failed accept (and re-arms it) once per slot: thousands of tracebacks at once.
LISTEN_BACKLOG = 128
# Descriptors `hetrain serve` wants: two per connection under the cap, a few turns' accepts before the
# cap acts on them, the process's own, and a margin. A lower soft limit (macOS gives a process 256) is
# raised toward the hard limit at start.
DESCRIPTORS_WANTED = 1024


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with the limits it lacks (the values are class attributes, see ``server_config``)."""

    header_timeout_s = HEADER_TIMEOUT_S
    idle_timeout_s = IDLE_TIMEOUT_S
    max_connections = MAX_CONNECTIONS

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._waiting_since: float | None = None  # set while no request is in progress: evictable
        self._header_deadline: asyncio.TimerHandle | None = None
        self._stalled: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_request()
        if len(self.connections) > self.max_connections:
            waiting = [c for c in self.connections
                       if c is not self and getattr(c, "_waiting_since", None) is not None]
            victim = min(waiting, key=lambda c: c._waiting_since, default=self)
            victim._drop()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle and self._waiting_since is not None:  # a whole request line and headers came
            self._waiting_since = None
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request
        if self.transport.is_closing():  # a graceful close waits for the client to take the rest: watch it do so
            if self._stalled is None:
                self._watch_progress(self._pending_bytes())
        elif self.cycle is not None and self.cycle.response_complete:
            self._await_request()

    def pause_writing(self) -> None:  # the socket's buffers and ours are full: wait on the client
        super().pause_writing()
        if self._stalled is None:
            self._watch_progress(self._pending_bytes())

    def _watch_progress(self, pending: int | None) -> None:
        self._stalled = self.loop.call_later(self.idle_timeout_s, self._check_progress, pending)

    def _check_progress(self, before: int | None) -> None:
        """Still paused ``idle_timeout_s`` on: go on if the client took any bytes meanwhile, else drop it."""
        now = self._pending_bytes()
        if now is not None and before is not None and now < before:
            self._watch_progress(now)
        else:
            self._drop()

    def _pending_bytes(self) -> int | None:
        """What the client has yet to take: our buffer plus the kernel's send queue (Linux's SIOCOUTQ).

        The kernel lets us write again only once a third of its buffer (up to megabytes) is free, so
        a slow reader can keep us paused for a while although it reads all along; its queue shrinks.
        None where the kernel cannot say: then a pause of ``idle_timeout_s`` is the inactivity.
        """
        try:
            queued = struct.unpack("i", fcntl.ioctl(self.transport.get_extra_info("socket").fileno(),
                                                    termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        except (AttributeError, OSError, ValueError, NameError):
            return None
        return queued + self.transport.get_write_buffer_size()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stalled is not None and not self.transport.is_closing():
            self._stalled.cancel()
            self._stalled = None

    def timeout_keep_alive_handler(self) -> None:
        self._drop()  # uvicorn's own closes gracefully, which waits on a client that does not read

    def _await_request(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        self._waiting_since = self.loop.time()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._drop)

    def _cancel_timers(self) -> None:
        for timer in (self._header_deadline, self._stalled):
            if timer is not None:
                timer.cancel()
        self._header_deadline = self._stalled = None

    def _drop(self) -> None:
        """Close now, discarding what the client has not read (a graceful close would wait for it)."""
        self._cancel_timers()
        self._waiting_since = None
        self.connections.discard(self)  # at once: the cap counts what is still open
        self.transport.abort()  # also when closing already, but waiting to flush to a client that does not read


def servable(path: str) -> bool:
    """Whether a (percent-decoded) request path names something a peer may read.

    ``/_steps`` and ``<dir>/_steps``, or a checkpoint file directly inside a step directory at any
    depth. No empty, ``.`` or ``..`` component anywhere (the root's confinement checks again).
    """
    parts = path.split("/")
    if len(parts) < 2 or parts[0] != "" or any(p in ("", ".", "..") for p in parts[1:]):
        return False
    name = parts[-1]
    if name == STEPS_LISTING:
        return True
    return (len(parts) >= 3 and STEP_DIR.fullmatch(parts[-2]) is not None
            and (name == MANIFEST or CHECKPOINT_FILE.fullmatch(name) is not None))


class _CheckpointFilesOnly:
    """404 for every path ``servable`` refuses, before anything looks at the disk."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not servable(scope["path"]):
            await PlainTextResponse("not a checkpoint file", status_code=404)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _Limits:
    """Requests past the header limits get 431, requests past ``max_downloads`` in progress 503 with Retry-After.

    Both answered and closed (``Connection: close``) after the request was read whole, so the client reads the
    answer instead of a reset. Outermost: nothing else looks at a request refused here.
    """

    def __init__(self, app: ASGIApp, max_downloads: int = MAX_DOWNLOADS) -> None:
        self.app, self.max_downloads, self.in_progress = app, max_downloads, 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + sum(
            len(k) + len(v) + 4 for k, v in headers)
        if len(headers) > MAX_HEADERS or size > MAX_HEADER_BYTES:
            await PlainTextResponse(f"request headers too large (at most {MAX_HEADERS} headers, "
                                    f"{MAX_HEADER_BYTES} bytes)", status_code=431,
                                    headers={"connection": "close"})(scope, receive, send)
            return
        if self.in_progress >= self.max_downloads:
            await PlainTextResponse("busy: too many downloads at once; retry", status_code=503,
                                    headers={"retry-after": str(RETRY_AFTER_S), "connection": "close"})(
                scope, receive, send)
            return
        self.in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_progress -= 1


class _BearerToken:
    """Reject requests without the right ``Authorization: Bearer`` header (constant-time compare)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.expected = app, f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                await PlainTextResponse("missing or wrong bearer token", status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def check_token(token: str | None, where: str = "the bearer token") -> None:
    """One line unless ``token`` (when given) can be a bearer token: not blank, no spaces or control characters."""
    if token is None:
        return
    if not token.strip():
        raise HetrainError(f"{where}: is blank; expected a secret (e.g. openssl rand -hex 32)")
    if any(c.isspace() or not c.isprintable() or not c.isascii() for c in token):
        raise HetrainError(f"{where}: holds a space, a control or a non-ASCII character; expected the characters of a "
                           f"bearer token (letters, digits, -._~+/=)")


def make_app(root: str | Path, token: str | None = None, max_downloads: int = MAX_DOWNLOADS) -> ASGIApp:
    check_token(token)
    root = Path(root).resolve()
    if not root.is_dir():
        raise HetrainError(f"--root {root}: not a directory")

    def steps(request: Request) -> JSONResponse | PlainTextResponse:
        """Committed steps of the root, or of a checkpoint root below it (a node serving its runs root).

        Not async: Starlette lists on its bounded thread pool, so a slow disk never holds the event loop."""
        sub = (root / request.path_params.get("sub", "")).resolve()
        if not sub.is_relative_to(root):
            return PlainTextResponse("outside the served root", status_code=404)
        return JSONResponse(CheckpointStore(str(sub)).committed_steps() if sub.is_dir() else [])

    app: ASGIApp = _CheckpointFilesOnly(Starlette(routes=[Route(f"/{STEPS_LISTING}", steps),
                                                          Route(f"/{{sub:path}}/{STEPS_LISTING}", steps),
                                                          Mount("/", StaticFiles(directory=root))]))
    return _Limits(_BearerToken(app, token) if token else app, max_downloads)


def server_config(root: str | Path, token: str | None = None, host: str = "127.0.0.1", port: int = 0, *,
                  header_timeout_s: float = HEADER_TIMEOUT_S, idle_timeout_s: float = IDLE_TIMEOUT_S,
                  max_connections: int = MAX_CONNECTIONS, max_downloads: int = MAX_DOWNLOADS) -> uvicorn.Config:
    """uvicorn's configuration for a peer server (checks the root first); the limits are for tests."""
    app = make_app(root, token, max_downloads)
    protocol = type("PeerHTTP", (_GuardedH11,), {"header_timeout_s": header_timeout_s,
                                                  "idle_timeout_s": idle_timeout_s,
                                                  "max_connections": max_connections})
    return uvicorn.Config(app, host=host, port=port, http=protocol, ws="none", lifespan="off", log_level="warning",
                          access_log=False, timeout_keep_alive=max(1, int(header_timeout_s)),
                          h11_max_incomplete_event_size=MAX_HEADER_BYTES, timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
                          backlog=LISTEN_BACKLOG)


def bind(host: str, port: int, what: str = "--port") -> socket.socket:
    """The listening socket of a peer server, bound now: a port in use is one line, not uvicorn's two and exit 3."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise HetrainError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as e:
        sock.close()
        why = "is in use (another hetrain serve?)" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
        raise HetrainError(f"{what} {port}: {host}:{port} {why}; choose another port") from None
    sock.set_inheritable(True)
    return sock


def raise_descriptor_limit(wanted: int = DESCRIPTORS_WANTED) -> int | None:
    """Raise this process's soft limit on open files to ``wanted`` (at most the hard limit), never lower it.

    For ``hetrain serve``, which owns its process. The limit now in force; None where there is none to set.
    """
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError):
            pass
    return soft


class PeerServer:
    """A peer server on a background thread (tests, the demo, and the trainer's node)."""

    def __init__(self, root: str | Path, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 **limits: float) -> None:
        self.server = uvicorn.Server(server_config(root, token, host, port, **limits))
        self.host = host
        self._thread = threading.Thread(target=self.server.run, name=f"hetrain-peer-{host}", daemon=True)

    @property
    def url(self) -> str:
        sockets = self.server.servers[0].sockets
        return f"http://{self.host}:{sockets[0].getsockname()[1]}"

    def start(self, timeout_s: float = 10.0) -> PeerServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise HetrainError(f"peer server on {self.host} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(5)

    def __enter__(self) -> PeerServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
