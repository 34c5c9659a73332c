"""A checkpoint root as one value: a URL and its fsspec options, and the few things done under it.

Every module that lists, reads, writes or prunes the steps under a root goes through a
``CheckpointStore``, so that how a URL becomes a filesystem (and its credentials, timeouts and
peer token) is decided once, here. A root is a node's own disk (a path, ``file://``), a shared
filesystem (``sftp://``), the run's remote backup (``s3://``, R2, MinIO, GCS) or a peer's
``hetrain serve`` (``http(s)://``): read-only, and, since an HTTP server shows no directories,
it lists its committed steps itself at ``<url>/_steps``.

What a manifest is and how an untrusted one is checked stays in ``manifest`` (one owner); the
store knows where the files are and how to reach them. It imports no torch: the control plane
(recovery, the CLI, the flows, ``hetrain serve``) uses it. ``hetrain.config`` sits below this
package (import-linter's layers), so the stores of a run's ``CheckpointConfig`` are made here
(``for_node``, ``for_peer``, ``for_remote``), not by the config.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import PurePosixPath
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from hetrain.checkpoint import PEER_TOKEN_ENV
from hetrain.checkpoint.manifest import MANIFEST, Manifest, join, parse_manifest, step_name, step_of_dir, write_atomic
from hetrain.config import CheckpointConfig
from hetrain.errors import HetrainError

STEPS_LISTING = "_steps"  # what a peer server answers with its committed steps (hetrain.checkpoint.peer)
# Object stores: a single PUT is atomic and a rename is a copy and a delete, so a file is written in one piece
# there; everywhere else under a temporary name and renamed (``manifest.write_atomic``).
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "memory"})
MAX_LISTED_STEPS = 100_000  # a peer's /_steps listing longer than this is not a checkpoint root's
# Files moved at once between a node's disk and the bucket or its peers (``hetrain.checkpoint.reassemble``'s fetch,
# ``hetrain.checkpoint.backup``'s upload): one object-store stream carries a fraction of a node's link (s3fs
# uploads one file's parts one after another), and a node's checkpoint is a few files per rank of up to GBs.
TRANSFER_THREADS = 8


def url_filesystem(url: str, options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """``(filesystem, path)`` of ``url``: fsspec's, except that a local one makes the directories it writes into.

    The one place a checkpoint URL becomes a filesystem (a root here, or a step directory a
    reassembly writes into); a local root written through ``auto_mkdir`` needs no makedirs first.
    """
    from fsspec.implementations.local import LocalFileSystem

    fs, path = url_to_fs(url, **(options or {}))
    if isinstance(fs, LocalFileSystem) and not fs.auto_mkdir:
        fs = LocalFileSystem(auto_mkdir=True)
    return fs, path


@dataclass(frozen=True)
class CheckpointStore:
    """A checkpoint root: its URL and the fsspec options that reach it (which may hold credentials)."""

    url: str
    options: dict[str, Any] = field(default_factory=dict, hash=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", copy.deepcopy(dict(self.options)))  # the caller's dict may change later

    # ------------------------------------------------------------------ the stores of a run's config

    @classmethod
    def for_node(cls, config: CheckpointConfig, node: str) -> CheckpointStore:
        """``node``'s own root: where its ranks write, what it prunes, what it reads directly when it recovers."""
        return cls(config.node_root(node))

    @classmethod
    def for_peer(cls, config: CheckpointConfig, node: str) -> CheckpointStore:
        """Where other nodes read ``node``'s checkpoints: its peer server if it has one, else its root."""
        return cls(config.peer_url(node))

    @classmethod
    def for_remote(cls, config: CheckpointConfig) -> CheckpointStore | None:
        """The run's remote backup (None without one)."""
        return cls(config.remote_url, config.remote_options) if config.remote_url else None

    # ------------------------------------------------------------------ reaching it

    @property
    def is_peer_server(self) -> bool:
        """A peer's ``hetrain serve``: another machine's answer, read-only, listing at ``/_steps``."""
        return self.url.startswith(("http://", "https://"))

    @cached_property
    def _fs_and_root(self) -> tuple[fsspec.AbstractFileSystem, str]:
        return url_filesystem(self.url, self.options)

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The filesystem, made on first use and kept (fsspec shares one instance among equal options)."""
        return self._fs_and_root[0]

    @property
    def root(self) -> str:
        """The root's path inside ``fs`` (the URL without its protocol)."""
        return self._fs_and_root[1]

    def with_timeout(self, timeout_s: float) -> CheckpointStore:
        """This store with every request bounded by ``timeout_s`` (and the peer token for a peer server).

        For a peer, silence, not total time, makes it gone: a multi-GB shard takes minutes on a
        slow link. The token is read from ``$HETRAIN_PEER_TOKEN`` now, not when the store was made.
        """
        options = copy.deepcopy(self.options)
        if self.is_peer_server:
            import aiohttp

            timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
            options.setdefault("client_kwargs", {}).setdefault("timeout", timeout)
            token = os.environ.get(PEER_TOKEN_ENV)
            if token:
                options.setdefault("headers", {})["Authorization"] = f"Bearer {token}"
        elif self.url.startswith("s3://"):
            options.setdefault("config_kwargs", {}).update(
                {"connect_timeout": timeout_s, "read_timeout": timeout_s, "retries": {"max_attempts": 2}})
        else:
            return self
        return CheckpointStore(self.url, options)

    # ------------------------------------------------------------------ paths

    def step_path(self, step: int, name: str | None = None) -> str:
        """Path inside ``fs`` of step ``step``'s directory, or of the file ``name`` in it."""
        return join(self.root, step_name(step), *([name] if name else []))

    def step_url(self, step: int, name: str | None = None) -> str:
        """The same as a URL, for messages (never the options: they may hold credentials)."""
        return join(self.url, step_name(step), *([name] if name else []))

    # ------------------------------------------------------------------ steps and manifests

    def committed_steps(self) -> list[int]:
        """Steps that have a manifest, oldest first (a peer server's own listing for a peer)."""
        if self.is_peer_server:
            return self._listed_steps()
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        steps = []
        for entry in entries:
            name = PurePosixPath(entry.rstrip("/")).name
            step = step_of_dir(name)
            if step is not None and self.fs.exists(join(self.root, name, MANIFEST)):
                steps.append(step)
        return sorted(steps)

    def _listed_steps(self) -> list[int]:
        """A peer's ``/_steps``: untrusted, so a list of step numbers or an error naming the URL."""
        where = join(self.url, STEPS_LISTING)
        answer = self.fs.cat_file(join(self.root, STEPS_LISTING))  # its errors say why (a refused token: HTTP 401)
        try:
            listed = json.loads(answer)
        except ValueError as e:
            raise HetrainError(f"{where}: not JSON ({e})") from None
        if (not isinstance(listed, list) or len(listed) > MAX_LISTED_STEPS
                or not all(type(s) is int and s >= 0 for s in listed)):
            raise HetrainError(f"{where}: expected a list of at most {MAX_LISTED_STEPS} step numbers")
        return sorted(set(listed))

    def read_manifest(self, step: int) -> Manifest:
        """Step ``step``'s manifest, checked as untrusted (``manifest.parse_manifest``: errors name the file)."""
        return parse_manifest(self.fs.cat_file(self.step_path(step, MANIFEST)), self.step_url(step, MANIFEST))

    def write_file(self, step: int, name: str, data: bytes) -> None:
        """Write ``name`` into step ``step`` whole: readers see no file or all of it (see OBJECT_STORE_PROTOCOLS)."""
        protocols = {self.fs.protocol} if isinstance(self.fs.protocol, str) else set(self.fs.protocol)
        if protocols & OBJECT_STORE_PROTOCOLS:
            self.fs.pipe_file(self.step_path(step, name), data)
        else:
            write_atomic(self.fs, self.step_path(step, name), data)

    def write_manifest(self, step: int, manifest: Manifest | bytes) -> None:
        """Commit step ``step``: its manifest, written last and whole (the bytes given, or the model's JSON)."""
        data = manifest.to_json().encode() if isinstance(manifest, Manifest) else manifest
        self.write_file(step, MANIFEST, data)

    def step_owners(self) -> dict[int, str | None]:
        """Committed step -> the run id its manifest names (None for a manifest that cannot be read)."""
        owners: dict[int, str | None] = {}
        for step in self.committed_steps():
            try:
                owners[step] = self.read_manifest(step).run_id
            except Exception:  # damaged: says nothing about whose it is
                owners[step] = None
        return owners

    def prune(self, keep: int, protect: set[int] | frozenset = frozenset(), run_id: str | None = None) -> list[int]:
        """Remove committed steps beyond the newest ``keep`` (manifest first), and unfinished saves older than them.

        Steps in ``protect`` (e.g. still being uploaded) stay. Paths another node removed first are fine.
        With ``run_id``, committed steps whose manifest names another run are neither counted nor
        removed: a run never deletes what another run committed. Returns the steps removed.
        """
        others: set[int] = set()
        if run_id is None:
            steps = self.committed_steps()
        else:  # a damaged manifest counts as this run's, so it ages out
            owners = self.step_owners()
            others = {step for step, owner in owners.items() if owner not in (None, run_id)}
            steps = sorted(set(owners) - others)
        if len(steps) <= keep:
            return []
        oldest_kept = steps[-keep]
        fs, removed = self.fs, []
        for entry in fs.ls(self.root, detail=False):
            name = PurePosixPath(entry.rstrip("/")).name
            step = step_of_dir(name)
            if step is None or step >= oldest_kept or step in protect or step in others:
                continue
            manifest = join(self.root, name, MANIFEST)  # the name as found: step-120 is step 120 too
            try:
                if fs.exists(manifest):
                    fs.rm_file(manifest)  # uncommit first: a half-deleted step is never mistaken for a checkpoint
                fs.rm(join(self.root, name), recursive=True)
            except FileNotFoundError:
                pass
            removed.append(step)
        return removed
