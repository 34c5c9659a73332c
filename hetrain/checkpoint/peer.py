"""Serve a node's checkpoint root read-only over HTTP, so peers can reassemble from it.

A Starlette app on uvicorn: ``StaticFiles`` confined to the root (it refuses paths that
resolve outside it, ``../`` included), plus ``GET /_steps`` listing the committed steps
(``StaticFiles`` serves no directory listings). With a token every request must carry
``Authorization: Bearer <token>``; clients read it from ``HETRAIN_PEER_TOKEN``.

    hetrain serve --root /local/ckpt --host 0.0.0.0 --port 8470 [--token-env HETRAIN_PEER_TOKEN]
"""

from __future__ import annotations

import hmac
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

from hetrain.checkpoint.manifest import committed_steps
from hetrain.errors import HetrainError


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


def make_app(root: str | Path, token: str | None = None) -> ASGIApp:
    root = Path(root).resolve()
    if not root.is_dir():
        raise HetrainError(f"--root {root}: not a directory")

    async def steps(request: Request) -> JSONResponse | PlainTextResponse:
        """Committed steps of the root, or of a checkpoint root below it (a node serving its runs root)."""
        sub = (root / request.path_params.get("sub", "")).resolve()
        if not sub.is_relative_to(root):
            return PlainTextResponse("outside the served root", status_code=404)
        return JSONResponse(committed_steps(str(sub)) if sub.is_dir() else [])

    app: ASGIApp = Starlette(routes=[Route("/_steps", steps), Route("/{sub:path}/_steps", steps),
                                     Mount("/", StaticFiles(directory=root))])
    return _BearerToken(app, token) if token else app


class PeerServer:
    """A peer server on a background thread (tests, the demo, and the trainer's node)."""

    def __init__(self, root: str | Path, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> None:
        config = uvicorn.Config(make_app(root, token), host=host, port=port, log_level="warning", access_log=False,
                                lifespan="off")
        self.server = uvicorn.Server(config)
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
