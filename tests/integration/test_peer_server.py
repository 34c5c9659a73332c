"""The peer server under hostile or broken clients (issue 33): no training, a fake checkpoint root.

Half-sent requests are dropped within the header deadline and never crowd out a peer with the
token; a download is cut for inactivity, never for its length; only checkpoint files are served;
``hetrain serve`` checks its root before it says anything.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from hetrain.checkpoint.manifest import MANIFEST, METADATA, step_name
from hetrain.checkpoint.peer import HEADER_TIMEOUT_S, MAX_CONNECTIONS, PeerServer
from tests.helpers import ROOT, run_cli

TOKEN = "s3cret"
SLOW_CLIENTS = 200  # the red team's count: 150 exhausted the server's descriptors


@pytest.fixture
def ckpt_root(tmp_path: Path) -> Path:
    """A node's checkpoint root with one committed step, beside what a run directory also holds."""
    root = tmp_path / "root"
    step = root / step_name(1)
    step.mkdir(parents=True)
    (step / MANIFEST).write_text(json.dumps({"step": 1, "files": []}))
    (step / "__0_0.distcp").write_bytes(b"shard" * 100)
    (step / METADATA).write_bytes(b"index")
    (step / "notes.txt").write_text("not a checkpoint file")
    (step / f"{MANIFEST}.1a2b3c4d.tmp").write_text("{}")  # a manifest being written
    (root / "config.json").write_text('{"secret": "the run config"}')
    (root / "metrics.jsonl").write_text('{"step": 1}\n')
    (root / "__0_0.distcp").write_bytes(b"a shard outside any step directory")
    (root / "notastep").mkdir()
    (root / "notastep" / MANIFEST).write_text("{}")
    # a node serving its whole runs root: RUN/checkpoints/NODE/step-N below it
    node = root / "run" / "checkpoints" / "a" / step_name(2)
    node.mkdir(parents=True)
    (node / MANIFEST).write_text("{}")
    (node / "__1_0.distcp").write_bytes(b"shard of node a")
    (root / "run" / "config.json").write_text("{}")
    (root / "run" / "launch.log").write_text("log")
    return root


def get(url: str, token: str | None = TOKEN, timeout: float = 5.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def closed_by_server(sock: socket.socket, deadline: float) -> bool:
    """Whether the server closes ``sock`` (EOF or reset) before ``deadline`` (monotonic)."""
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(65536):
                return True
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_only_checkpoint_files_are_served(ckpt_root: Path):
    with PeerServer(ckpt_root, host="127.0.0.7", token=TOKEN) as peer:
        assert get(f"{peer.url}/_steps") == (200, b"[1]")
        assert get(f"{peer.url}/run/checkpoints/a/_steps") == (200, b"[2]")
        assert get(f"{peer.url}/nothing-here/_steps") == (200, b"[]")
        for path in (MANIFEST, "__0_0.distcp", METADATA):
            status, body = get(f"{peer.url}/{step_name(1)}/{path}")
            assert (status, body) == (200, (ckpt_root / step_name(1) / path).read_bytes()), path
        assert get(f"{peer.url}/run/checkpoints/a/{step_name(2)}/__1_0.distcp") == (200, b"shard of node a")
        for path in ("/config.json", "/metrics.jsonl", "/run/config.json", "/run/launch.log", "/__0_0.distcp",
                     f"/{step_name(1)}/notes.txt", f"/{step_name(1)}/{MANIFEST}.1a2b3c4d.tmp",
                     f"/notastep/{MANIFEST}", f"/{step_name(1)}", f"/{step_name(1)}/", "/",
                     f"/{step_name(1)}/./{MANIFEST}", f"//{step_name(1)}/{MANIFEST}",
                     f"/{step_name(1)}/{MANIFEST}/", f"/{step_name(1)}/../config.json",
                     f"/{step_name(1)}/%2e%2e/config.json", "/step-1x/__0_0.distcp"):
            assert get(peer.url + path)[0] == 404, path
        assert get(f"{peer.url}/config.json", token=None)[0] == 401  # the token is checked first
        assert get(f"{peer.url}/{step_name(1)}/{MANIFEST}", token="wrong")[0] == 401


def test_half_sent_requests_neither_starve_a_peer_nor_stay_open(ckpt_root: Path):
    """The red team's attack: 200 connections that send half a request line and stop."""
    with PeerServer(ckpt_root, host="127.0.0.8", token=TOKEN) as peer:
        slow = []
        try:
            opened = time.monotonic()
            for _ in range(SLOW_CLIENTS):
                sock = socket.create_connection(address(peer.url), timeout=5)
                sock.sendall(b"GET /_steps HT")
                slow.append(sock)
            start = time.monotonic()
            assert get(f"{peer.url}/_steps", timeout=5) == (200, b"[1]")
            assert time.monotonic() - start < 3.0
            assert len(peer.server.server_state.connections) <= MAX_CONNECTIONS
            deadline = opened + HEADER_TIMEOUT_S + 2.0
            still_open = sum(not closed_by_server(sock, deadline) for sock in slow)
            assert still_open == 0, f"{still_open} half-sent requests still open {HEADER_TIMEOUT_S + 2.0:.0f} s on"
            assert get(f"{peer.url}/_steps") == (200, b"[1]")
        finally:
            for sock in slow:
                sock.close()


def test_a_slow_trickle_and_a_silent_kept_alive_connection_meet_the_same_deadline(ckpt_root: Path):
    with PeerServer(ckpt_root, host="127.0.0.9", token=TOKEN, header_timeout_s=1.0) as peer:
        with socket.create_connection(address(peer.url), timeout=5) as trickle:
            start = time.monotonic()
            try:
                for byte in b"GET /_steps HTTP/1.1\r\nHost: x\r\n":  # a byte every 0.2 s: never idle, never done
                    trickle.sendall(bytes([byte]))
                    time.sleep(0.2)
            except (ConnectionResetError, BrokenPipeError):
                pass
            assert closed_by_server(trickle, start + 3.0)
            assert time.monotonic() - start < 2.5
        with socket.create_connection(address(peer.url), timeout=5) as kept:
            kept.sendall(f"GET /_steps HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
            answer = b""
            while not answer.endswith(b"[1]"):
                answer += kept.recv(4096)
            assert answer.startswith(b"HTTP/1.1 200")
            kept.sendall(b"GET /_st")  # half of a second request on the kept-alive connection
            start = time.monotonic()
            assert closed_by_server(kept, start + 3.0)
            assert time.monotonic() - start < 2.5


def _download(peer_url: str, path: str, pause_s: float, stall_s: float = 0.0) -> bytes:
    """GET ``path`` on a socket with a small receive buffer: nothing for ``stall_s``, then up to 64 KiB every
    ``pause_s``. The body as far as it came (the server may cut it)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # before connecting: the window stays small
    sock.settimeout(10)
    sock.connect(address(peer_url))
    with sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
        time.sleep(stall_s)
        head, body = b"", bytearray()
        try:
            while b"\r\n\r\n" not in head and (chunk := sock.recv(4096)):
                head += chunk
            head, first = head.split(b"\r\n\r\n", 1)
            assert head.startswith(b"HTTP/1.1 200"), head
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")))
            body += first
            while len(body) < length and (chunk := sock.recv(64 * 1024)):
                body += chunk
                time.sleep(pause_s)
        except ConnectionResetError:
            pass
        return bytes(body)


def test_a_download_is_cut_for_inactivity_never_for_its_length(ckpt_root: Path):
    shard = os.urandom(8 << 20)  # larger than the socket buffers (4 MiB at most here): the server waits on the reader
    (ckpt_root / step_name(1) / "__1_0.distcp").write_bytes(shard)
    path = f"/{step_name(1)}/__1_0.distcp"
    with PeerServer(ckpt_root, host="127.0.0.10", token=TOKEN, idle_timeout_s=1.0) as peer:
        start = time.monotonic()
        assert _download(peer.url, path, pause_s=0.02) == shard  # slow and steady (at most 3 MiB/s): whole
        assert time.monotonic() - start > 2.0  # twice the inactivity limit in all
        got = _download(peer.url, path, pause_s=0.0, stall_s=3.0)  # reads nothing for 3 s: cut
        assert len(got) < len(shard)


def test_serve_under_few_descriptors_outlasts_half_sent_requests(ckpt_root: Path, tmp_path: Path):
    """The red team's setting: `hetrain serve` started with a soft limit of 128 descriptors (macOS gives 256);
    200 half-sent requests used them all up and the peer with the token timed out."""
    host = "127.0.0.11"
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]

    def few_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    env = {**os.environ, "HETRAIN_PEER_TOKEN": TOKEN, "COLUMNS": "200", "NO_COLOR": "1"}
    server = subprocess.Popen([sys.executable, "-m", "hetrain", "serve", "--root", str(ckpt_root), "--host", host,
                               "--port", str(port)], cwd=ROOT, env=env, preexec_fn=few_descriptors,
                              stdout=subprocess.DEVNULL, stderr=open(tmp_path / "serve.log", "w"))
    slow = []
    try:
        url = f"http://{host}:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if get(f"{url}/_steps", timeout=1)[0] == 200:
                    break
            except urllib.error.URLError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        for _ in range(SLOW_CLIENTS):
            sock = socket.create_connection((host, port), timeout=5)
            sock.sendall(b"GET /_steps HT")
            slow.append(sock)
        start = time.monotonic()
        assert get(f"{url}/_steps", timeout=5) == (200, b"[1]")
        assert time.monotonic() - start < 3.0
        assert server.poll() is None
        assert "out of system resource" not in (tmp_path / "serve.log").read_text()  # asyncio's failed accept
    finally:
        for sock in slow:
            sock.close()
        server.terminate()
        server.wait(10)


def test_serve_checks_its_root_before_it_says_anything():
    r = run_cli("serve", "--root", "/nonexistent")
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "/nonexistent" in lines[0], r.stderr
