"""The live switch: training state from the old plan's memory straight into the new plan's ranks.

A notice-window switch through disk pays for an emergency checkpoint committed to disk, a fetch
of its files and DCP's load from them (about 10 s on a loaded CPU machine). The live switch
keeps DCP and drops the disk from the critical path:

* Each old rank saves its emergency state with ``dcp.save`` into its own memory (fsspec's
  ``memory://`` through DCP's own ``FsspecWriter``), hashes every stored item (SHA-256 of each
  tensor's or value's bytes) and serves those bytes read-only over HTTP with range requests.
  The plan's rank 0 writes an *offer*: the step, each shard file's URL, node and item table
  (offset, length, SHA-256), and the ``.metadata`` index's URL, size and digest.
* Each new rank loads with ``dcp.load`` through ``LiveReader``: DCP's planner maps the old plan's
  stored chunks onto this rank's new DTensor shards (other TP degree, other pipeline cuts), so
  the reader is asked for exactly the stored items this rank's stage overlaps, and fetches only
  those byte ranges, from the old ranks that hold them, in parallel, with a deadline. Every
  item is checked against the offer's length and digest *before* anything is deserialized
  or copied into the model; the index is unpickled by ``safe_metadata.load_metadata``.
* The emergency checkpoint still goes to disk and the bucket: the old ranks commit the same
  snapshot (``Checkpointer``'s usual path) once the switch releases them, so that the commit's
  disk writes, hashing and upload do not compete with the transfer training waits for. A
  failed transfer waits for that commit and takes the disk path; an old rank that dies before
  committing takes its emergency step with it, and the run restarts from the newest committed
  step (nothing committed is lost).

Why DCP over an in-memory layer rather than our own sends over a process group: the plan-to-plan
mapping (which slice of which stored tensor lands where in the new layout) already exists once,
in DCP's planner, and is what the disk path and every test of resharding exercise; a second
mapping over ``hetrain.plan.layout`` would have to agree with it tensor by tensor (flattened
optimizer state, replicated norms, vocabulary shards). HTTP rather than a gloo group spanning
both plans: the two plans are separate launches (separate worlds), and a group across them
would need a rendezvous both join, while a peer that dies or stalls mid-transfer must end in a
clean error within the deadline on every new rank; with HTTP each rank's reads fail on their
own, DCP gathers the failure to every rank, and no collective is left hanging. Bytes on the
wire are DCP's own serialization, the same bytes the disk checkpoint holds.

What is read from an old rank is untrusted until verified: the offer comes from the old
plan's rank 0 through the controller, and every byte range is checked against it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import http.client
import io
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from hetrain.checkpoint.manifest import CHECKPOINT_FILE
from hetrain.checkpoint.reassemble import PEER_TOKEN_ENV
from hetrain.checkpoint.safe_metadata import load_metadata
from hetrain.errors import HetrainError
from hetrain.files import write_text_atomic

MEMORY_ROOT = "memory://hetrain-live"  # this process's own fsspec memory filesystem
# Fault injection for the tests, on the serving (old) side: "corrupt:RANK" flips a byte of every
# slice that rank serves; "stall:RANK" sends half a slice and goes silent; "kill:RANK" sends half a
# slice and SIGKILLs the rank (its state was only in memory: the emergency step is lost with it).
FAULT_LIVE = "HETRAIN_FAULT_LIVE"
# The address the old ranks serve on, where nodes reach each other by another name than loopback
# (default: the host of the node's peer URL when it is HTTP, else 127.0.0.1).
LIVE_HOST_ENV = "HETRAIN_LIVE_HOST"
# Old ranks serve until the controller releases them, at most this long: a cloud notice is at most
# two minutes, after which the node is gone anyway.
SERVE_MAX_S = 120.0
# One read from a socket: small enough that a stalled peer is noticed within the deadline's slack.
CHUNK_BYTES = 1 << 20
# Parallel range requests of one new rank: one per old rank it reads from on a small plan; more
# would only contend for the same sockets and cores.
MAX_FETCH_THREADS = 8


class LiveTransferError(HetrainError):
    """A live transfer failed (peer gone, bad bytes, deadline): the switch falls back to the disk path."""


# --------------------------------------------------------------------------- old side: save, hash, serve

class _MemoryWriter(FsspecWriter):
    """DCP's fsspec writer into this process's memory, remembering where each item was written."""

    def __init__(self, path: str) -> None:
        super().__init__(path, sync_files=False, overwrite=True)  # memory files have no descriptor to fsync
        self.items: list = []

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        self.items = [r.storage_data for r in future.wait()]
        return future


def _fault(rank: int) -> str | None:
    kind, _, who = os.environ.get(FAULT_LIVE, "").partition(":")
    return kind if who == str(rank) and kind in ("corrupt", "stall", "kill") else None


class LiveServer:
    """One old rank's serialized state, served read-only over HTTP (``GET /<file>`` with ``Range``)."""

    def __init__(self, files: dict[str, bytes], host: str, rank: int) -> None:
        self.files, self.fault = files, _fault(rank)
        token = os.environ.get(PEER_TOKEN_ENV)
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if token and not hmac.compare_digest(self.headers.get("Authorization", ""), f"Bearer {token}"):
                    self.send_error(401)
                    return
                owner._answer(self)

            def log_message(self, *args: Any) -> None:  # quiet: the ranks' logs are for errors
                pass

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="hetrain-live-server", daemon=True)
        self.thread.start()

    def _answer(self, handler: BaseHTTPRequestHandler) -> None:
        name = handler.path.lstrip("/")
        data = self.files.get(name)
        if data is None:
            handler.send_error(404)
            return
        lo, hi = _byte_range(handler.headers.get("Range"), len(data))
        if lo is None:
            handler.send_error(416)
            return
        body = memoryview(data)[lo:hi]
        handler.send_response(206 if handler.headers.get("Range") else 200)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if name == ".metadata" or self.fault is None:
            handler.wfile.write(body)
            return
        self._serve_faulty(handler, body)

    def _serve_faulty(self, handler: BaseHTTPRequestHandler, body: memoryview) -> None:
        if self.fault == "corrupt":
            bad = bytearray(body)
            bad[len(bad) // 2] ^= 0xFF
            handler.wfile.write(bad)
            return
        handler.wfile.write(body[: len(body) // 2])
        handler.wfile.flush()
        if self.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(SERVE_MAX_S)  # stall: the rest never comes

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.files = {}


def _byte_range(header: str | None, size: int) -> tuple[int | None, int]:
    """``bytes=a-b`` (inclusive) as a half-open range within ``size``; (None, 0) if unsatisfiable."""
    if not header:
        return 0, size
    try:
        unit, _, spec = header.partition("=")
        a, _, b = spec.partition("-")
        lo, hi = int(a), int(b) + 1
    except ValueError:
        return None, 0
    if unit.strip() != "bytes" or not 0 <= lo < hi <= size:
        return None, 0
    return lo, hi


def serve_host(peer_url: str | None) -> str:
    """Where this rank serves: ``HETRAIN_LIVE_HOST``, else its node's HTTP peer host, else loopback."""
    if os.environ.get(LIVE_HOST_ENV):
        return os.environ[LIVE_HOST_ENV]
    parts = urlsplit(peer_url or "")
    return parts.hostname if parts.scheme in ("http", "https") and parts.hostname else "127.0.0.1"


def offer_state(step: int, state: dict, group, *, node: str, host: str, offer_file: str | None) -> LiveServer:
    """Collective over ``group``: save ``state`` into memory, serve it, and (plan rank 0) write the offer.

    Returns this rank's server; the caller closes it once the new ranks are done (or the deadline).
    """
    rank = dist.get_rank()
    path = f"{MEMORY_ROOT}/{os.getpid()}/step-{step}"
    writer = _MemoryWriter(path)
    dcp.save(state, storage_writer=writer, process_group=group)
    fs = writer.fs.fs
    names = {info.relative_path for info in writer.items}
    files = {name: bytes(fs.cat_file(f"{path}/{name}")) for name in names}
    if fs.exists(f"{path}/.metadata"):  # the coordinator's index
        files[".metadata"] = bytes(fs.cat_file(f"{path}/.metadata"))
    fs.rm(path, recursive=True)
    items: dict[str, list] = {name: [] for name in names}
    for info in writer.items:
        chunk = memoryview(files[info.relative_path])[info.offset: info.offset + info.length]
        items[info.relative_path].append([info.offset, info.length, hashlib.sha256(chunk).hexdigest()])
    server = LiveServer(files, host, rank)
    metadata = files.get(".metadata")
    mine = {"node": node, "url": server.url, "items": items,
            "metadata": None if metadata is None else [len(metadata), hashlib.sha256(metadata).hexdigest()]}
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    if offer_file is not None:
        write_text_atomic(offer_file, json.dumps(build_offer(step, gathered)) + "\n", "live offer")
    return server


def build_offer(step: int, gathered: list[dict]) -> dict:
    """The offer the new ranks read: every shard file's URL, node and item table, and the index."""
    files, metadata = {}, None
    for part in gathered:
        for name, items in part["items"].items():
            files[name] = {"url": f"{part['url']}/{name}", "node": part["node"], "items": sorted(items),
                           "size": sum(length for _, length, _ in items)}
        if part["metadata"] is not None:
            size, digest = part["metadata"]
            metadata = {"url": f"{part['url']}/.metadata", "node": part["node"], "size": size, "sha256": digest}
    if metadata is None:
        raise HetrainError(f"live offer of step {step}: no rank wrote DCP's index")
    return {"step": step, "metadata": metadata, "files": files}


# --------------------------------------------------------------------------- new side: fetch, verify, load

class LiveReader(FileSystemReader):
    """DCP's filesystem reader whose bytes come from the old ranks' servers, verified, within a deadline."""

    def __init__(self, offer: dict, deadline: float) -> None:
        super().__init__("/")  # no path is opened: ``read_data`` swaps in what it fetched
        self.offer, self.deadline = offer, deadline
        self.bytes_read = 0
        self._fetched: dict[tuple[str, int], memoryview] = {}
        self._metadata: bytes | None = None
        self._lock = threading.Lock()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        meta = self.offer["metadata"]
        if self._metadata is None:  # asked for once to find the keys, again by DCP's load
            data = self._get(meta["url"], 0, meta["size"])
            if hashlib.sha256(data).hexdigest() != meta["sha256"]:
                raise LiveTransferError(f"{meta['url']}: the index's SHA-256 differs from the offer's")
            self._metadata = bytes(data)
        metadata = load_metadata(self._metadata, meta["url"])
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        wanted = {(self.storage_data[r.storage_index].relative_path, self.storage_data[r.storage_index].offset,
                   self.storage_data[r.storage_index].length) for r in plan.items}
        by_file: dict[str, list[tuple[int, int, str]]] = {}
        for name, offset, length in sorted(wanted):
            by_file.setdefault(name, []).append((offset, length, self._digest(name, offset, length)))
        with ThreadPoolExecutor(min(MAX_FETCH_THREADS, max(1, len(by_file)))) as pool:
            for _ in pool.map(lambda kv: self._fetch_file(*kv), by_file.items()):
                pass  # raises the first failure
        self.fs = _Fetched()
        return super().read_data(plan, planner)

    def _slice_file(self, file, sinfo) -> io.BytesIO:
        return io.BytesIO(self._fetched[(sinfo.relative_path, sinfo.offset)])

    def _digest(self, name: str, offset: int, length: int) -> str:
        entry = self.offer["files"].get(name)
        if entry is None or not CHECKPOINT_FILE.fullmatch(name):
            raise LiveTransferError(f"the index names {name!r}, which the offer does not hold")
        for lo, size, digest in entry["items"]:
            if lo == offset and size == length:
                return digest
        raise LiveTransferError(f"{name}: the index's item at {offset} ({length} bytes) is not in the offer")

    def _fetch_file(self, name: str, items: list[tuple[int, int, str]]) -> None:
        """Contiguous items in one range request each; every item verified before it is kept."""
        url = self.offer["files"][name]["url"]
        for run in _contiguous(items):
            lo = run[0][0]
            data = self._get(url, lo, run[-1][0] + run[-1][1] - lo)
            for offset, length, digest in run:
                chunk = data[offset - lo: offset - lo + length]
                if hashlib.sha256(chunk).hexdigest() != digest:
                    raise LiveTransferError(f"{url}: bytes {offset}+{length} differ from the offer's SHA-256")
                with self._lock:
                    self._fetched[(name, offset)] = chunk  # a view of the response's buffer: no copy

    def _get(self, url: str, offset: int, length: int) -> memoryview:
        """``length`` bytes at ``offset`` of ``url``, or LiveTransferError (short, refused, past the deadline)."""
        parts = urlsplit(url)
        left_s = self.deadline - time.time()
        if left_s <= 0:
            raise LiveTransferError(f"{url}: the transfer's deadline passed")
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=left_s)
        headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
        if os.environ.get(PEER_TOKEN_ENV):
            headers["Authorization"] = f"Bearer {os.environ[PEER_TOKEN_ENV]}"
        out, got = bytearray(length), 0
        try:
            conn.request("GET", parts.path, headers=headers)
            sock = conn.sock  # the response reads from it; the connection may drop its reference
            response = conn.getresponse()
            if response.status != 206:
                raise LiveTransferError(f"{url}: answered {response.status} {response.reason}")
            while got < length:
                if time.time() > self.deadline:
                    raise LiveTransferError(f"{url}: the transfer's deadline passed after {got} of {length} bytes")
                sock.settimeout(max(0.01, self.deadline - time.time()))
                chunk = response.read1(min(CHUNK_BYTES, length - got))  # what has come, not a full chunk
                if not chunk:
                    break
                out[got: got + len(chunk)] = chunk
                got += len(chunk)
        except TimeoutError:
            raise LiveTransferError(f"{url}: the transfer's deadline passed after {got} of {length} bytes") from None
        except (OSError, http.client.HTTPException) as e:
            raise LiveTransferError(f"{url}: {type(e).__name__}: {e} after {got} of {length} bytes") from None
        finally:
            conn.close()
        if got != length:
            raise LiveTransferError(f"{url}: the connection closed after {got} of {length} bytes")
        with self._lock:
            self.bytes_read += length
        return memoryview(out)


def _contiguous(items: list[tuple[int, int, str]]) -> Iterator[list[tuple[int, int, str]]]:
    run: list = []
    for item in items:
        if run and run[-1][0] + run[-1][1] != item[0]:
            yield run
            run = []
        run.append(item)
    if run:
        yield run


class _Fetched:
    """Stands in for DCP's filesystem once the bytes are here: ``LiveReader._slice_file`` serves them."""

    def concat_path(self, path, suffix):
        return suffix

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        yield None


def load_live(trainer, switch: dict, standby_file: str, device) -> bool:
    """Collective over the new plan's world: load the offered state into ``trainer``; True when every rank did.

    Every rank's failure (DCP gathers a read's failure to all ranks; anything else is gathered
    here) makes the answer no on all of them, and rank 0 writes it next to ``standby_file``.
    Nothing read is copied into the model unless it matched the offer; a failed switch's model is
    loaded again, whole, by the disk path that follows.
    """
    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    from hetrain.rundir import live_result_file

    started = time.perf_counter()
    reader = LiveReader(switch["live"], float(switch["live_deadline"]))
    why = None
    try:
        trainer.load(switch["live"]["metadata"]["url"], switch["start_step"], switch.get("steps"), reader=reader)
    except CheckpointException as e:  # DCP's is a BaseException, carrying each rank's failure
        why = "; ".join(_cause(f) for f in e.failures.values())
    except Exception as e:
        why = _cause(e)
    whys: list = [None] * dist.get_world_size()
    dist.all_gather_object(whys, why)
    total = torch.tensor([float(reader.bytes_read)], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    failed = [f"rank {r}: {w}" for r, w in enumerate(whys) if w]
    if dist.get_rank() == 0:
        result = {"ok": not failed, "why": "; ".join(failed) or None, "load_s": time.perf_counter() - started,
                  "bytes": int(total.item()), "start_step": switch["start_step"], "time": time.time()}
        write_text_atomic(live_result_file(standby_file), json.dumps(result) + "\n", "live switch result")
    return not failed


def _cause(error: BaseException) -> str:
    """One line for a failure DCP may have wrapped (a tuple of the exception and its stack)."""
    if isinstance(error, tuple):  # DCP's wrapped failure: (exception, its stack)
        error = error[0]
    return f"{type(error).__name__}: {error}"
