"""Background upload of committed checkpoints to a remote fsspec store (S3, R2, MinIO, GCS...).

One ``Uploader`` thread per node (its first rank). After each commit it uploads the files
that node is first to hold, with retries and exponential backoff. The coordinator's uploader
(the node of rank 0) then waits until every file of the manifest is in the store with the
right size, uploads ``.metadata`` and finally the manifest: a remote step without a
manifest is incomplete and never used. Training only ever enqueues; a slow or failing store
delays the backup, never a step. When training ends, ``close`` waits (bounded) for the queue.

Credentials come from the environment or the standard AWS configuration (s3fs/botocore);
only URLs are logged.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import TypeVar

from hetrain.checkpoint.manifest import MANIFEST, METADATA, join, parse_manifest
from hetrain.checkpoint.store import TRANSFER_THREADS, CheckpointStore
from hetrain.config import CheckpointConfig
from hetrain.errors import HetrainError

log = logging.getLogger("hetrain.checkpoint.backup")
T = TypeVar("T")


# What a retry meets again: no such bucket or directory (s3fs maps NoSuchBucket to FileNotFoundError),
# access denied, no credentials. Retrying them only hides the problem for minutes.
PERMANENT_ERRORS = (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError)
PERMANENT_ERROR_NAMES = {"NoCredentialsError", "PartialCredentialsError", "InvalidAccessKeyId", "SignatureDoesNotMatch"}
PROBE_NAME = ".hetrain-probe"  # written and removed under the remote root before the first step


def is_permanent(e: BaseException) -> bool:
    """True for a store error that retrying cannot fix (see ``PERMANENT_ERRORS``)."""
    return isinstance(e, PERMANENT_ERRORS) or type(e).__name__ in PERMANENT_ERROR_NAMES


def probe_remote(config: CheckpointConfig) -> str | None:
    """Before the first step: the remote store exists, takes a write and a delete with these credentials.

    What a retry would meet again (no such bucket or directory, access denied, no credentials, a
    bad URL) raises HetrainError, one line naming the URL; a bucket is never created here. A
    store that does not answer (down, unreachable) is no reason to lose the training time:
    the run starts and its uploads retry, and the returned line says so (None when all is well).
    """
    store = CheckpointStore.for_remote(config)
    if store is None:
        return None
    url = store.url

    def write_and_delete() -> None:
        probe = join(store.root, f"{PROBE_NAME}-{uuid.uuid4().hex[:12]}")
        store.fs.pipe_file(probe, b"hetrain")
        store.fs.rm_file(probe)

    try:
        write_and_delete()  # s3fs already retries a store that does not answer (about 10 s)
    except Exception as e:  # the store's errors are many (botocore, aiohttp, OSError, ValueError for a bad URL)
        why = "no such bucket or directory" if isinstance(e, FileNotFoundError) else f"{type(e).__name__}: {e}"
        if is_permanent(e) or isinstance(e, ValueError):
            raise HetrainError(f"--remote {url}: cannot write there ({why}); expected an existing bucket or "
                               f"directory this machine's credentials can write to") from None
        return (f"--remote {url} does not answer ({why}); training starts and each checkpoint's upload retries "
                f"({config.upload_retries} times)")
    return None


def with_retries(what: str, fn: Callable[[], T], retries: int, first_delay_s: float = 0.5,
                 max_delay_s: float = 8.0) -> T:
    """Call ``fn``; on an error wait 0.5, 1, 2, ... s (capped) and try again, ``retries`` more times.

    Errors that a retry meets again (``is_permanent``) are raised at once.
    """
    delay = first_delay_s
    for attempt in range(retries + 1):
        try:
            return fn()
        except Exception as e:  # the store's errors are many (botocore, aiohttp, OSError)
            if attempt == retries or is_permanent(e):
                raise
            log.warning("%s failed (%s: %s); retry %d/%d in %.1f s", what, type(e).__name__, e, attempt + 1,
                        retries, delay)
            time.sleep(delay)
            delay = min(delay * 2, max_delay_s)
    raise AssertionError("unreachable")


class Uploader:
    def __init__(self, config: CheckpointConfig, node: str, coordinator: bool, run_id: str | None = None) -> None:
        assert config.remote_url
        self.config, self.node, self.coordinator, self.run_id = config, node, coordinator, run_id
        self.local = CheckpointStore.for_node(config, node)
        self.remote = CheckpointStore.for_remote(config)
        self.uploaded: list[int] = []  # steps this node finished (coordinator: with the manifest)
        self.failed: list[tuple[int, str]] = []  # (step, why)
        self._reported = 0  # failures already handed out by new_failures()
        self.pending: set[int] = set()  # queued or uploading: local pruning must leave them
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"hetrain-upload-{node}", daemon=True)
        self._thread.start()

    def submit(self, step: int, manifest_bytes: bytes) -> None:
        self.pending.add(step)
        self._queue.put((step, manifest_bytes))

    def new_failures(self) -> list[str]:
        """Failures since the last call, as "step N: why" (for the metrics record of the step that sees them)."""
        news = self.failed[self._reported:]
        self._reported += len(news)
        return [f"step {step}: {why}" for step, why in news]

    def status(self) -> dict:
        """What reached the store: the ``backup.json`` a run leaves when it ends."""
        return {"remote": self.config.remote_url, "uploaded_steps": sorted(self.uploaded),
                "failed": [{"step": step, "error": why} for step, why in self.failed],
                "unfinished_steps": sorted(self.pending)}

    def close(self, timeout_s: float | None = None) -> bool:
        """Wait for queued uploads (at most ``timeout_s``); True when they all finished."""
        self._queue.put(None)
        self._thread.join(self.config.upload_timeout_s if timeout_s is None else timeout_s)
        if self._thread.is_alive():
            log.warning("backup of node %s to %s did not finish (steps %s still pending)", self.node,
                        self.config.remote_url, sorted(self.pending))
            return False
        return True

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            step, manifest_bytes = item
            try:
                self.upload(step, manifest_bytes)
                self.uploaded.append(step)
            except Exception as e:
                self.failed.append((step, f"{type(e).__name__}: {e}"))
                log.error("backup of step %d from node %s to %s failed: %s: %s", step, self.node,
                          self.config.remote_url, type(e).__name__, e)
            finally:
                self.pending.discard(step)
                try:  # steps kept past `keep` only because they were still uploading can go now
                    self.local.prune(self.config.keep, protect=set(self.pending), run_id=self.run_id)
                except Exception as e:
                    log.warning("pruning %s failed: %s", self.local.url, e)

    def upload(self, step: int, manifest_bytes: bytes) -> None:
        cfg = self.config
        manifest = parse_manifest(manifest_bytes, "manifest")
        store, local_dir, remote_dir = self.remote.fs, self.local.step_path(step), self.remote.step_path(step)
        started = time.perf_counter()
        mine = sorted((f for f in manifest.files if f.path != METADATA and f.nodes[0] == self.node),
                      key=lambda f: -f.size)

        def put(f) -> None:
            with_retries(f"upload {f.path} of step {step}",
                         lambda: store.put_file(join(local_dir, f.path), join(remote_dir, f.path)), cfg.upload_retries)

        # the files side by side, the largest first (``TRANSFER_THREADS``: one stream is a fraction of the link);
        # the first to fail (in time) fails the upload, and the files not yet started are not sent for nothing
        pool = ThreadPoolExecutor(max_workers=max(1, min(TRANSFER_THREADS, len(mine))))
        try:
            for done in as_completed([pool.submit(put, f) for f in mine]):
                done.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        if not self.coordinator:
            return
        others = {f.path: f.size for f in manifest.files if f.path != METADATA and f.nodes[0] != self.node}
        deadline = time.monotonic() + cfg.upload_timeout_s
        while others:
            for path, size in list(others.items()):
                try:
                    if store.size(join(remote_dir, path)) == size:
                        del others[path]
                except (FileNotFoundError, OSError):
                    pass
            if others:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"other nodes did not upload {', '.join(sorted(others))} "
                                       f"within {cfg.upload_timeout_s:g} s")
                time.sleep(0.2)
                store.invalidate_cache()
        with_retries(f"upload {METADATA} of step {step}",
                     lambda: store.put_file(join(local_dir, METADATA), join(remote_dir, METADATA)),
                     cfg.upload_retries)
        with_retries(f"upload {MANIFEST} of step {step}",
                     lambda: self.remote.write_manifest(step, manifest_bytes), cfg.upload_retries)
        store.invalidate_cache()
        self.remote.prune(cfg.keep, run_id=manifest.run_id)
        log.info("step %d backed up to %s (%.1f MB, %.1f s)", step, cfg.remote_url, manifest.total_bytes / 1e6,
                 time.perf_counter() - started)
