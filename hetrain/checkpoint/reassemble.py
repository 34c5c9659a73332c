"""Reassemble the newest committed checkpoint: surviving peers first, the remote store for the rest.

Sources are checkpoint roots (``store.CheckpointStore``: a URL and its options): a peer's
HTTP server (``hetrain serve``), any other filesystem a peer's root is reachable by
(``file://`` on a shared disk, ``sftp://``), and the remote backup (``s3://``). The newest
step whose manifest any source has is chosen; for every file of it the candidates are the
surviving peers the manifest says hold it, in order, then the remote store. A candidate that
is unreachable within ``timeout_s``, lacks the file, or serves bytes whose size or SHA-256
differ from the manifest is skipped (and reported). Files are streamed in parallel, hashed on
the way, into ``<dest>.partial`` and the directory is renamed to ``dest`` only when every
file arrived intact, with the manifest written last: an error leaves nothing that could be
loaded.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import fsspec

from hetrain.checkpoint import PEER_SILENCE_S, PEER_TOKEN_ENV
from hetrain.checkpoint.manifest import MANIFEST, METADATA, FileEntry, Manifest, join
from hetrain.checkpoint.store import TRANSFER_THREADS, CheckpointStore, url_filesystem
from hetrain.errors import HetrainError
from hetrain.spec.specs import ModelSpec

CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class Source:
    """A checkpoint store to read from and who it is: a surviving peer (``name`` = node) or the remote store.

    ``store`` may be given as a URL (a root reached with no options: a path, ``file://``, a peer server).
    """

    name: str
    store: CheckpointStore
    remote: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.store, str):
            object.__setattr__(self, "store", CheckpointStore(self.store))

    @property
    def url(self) -> str:
        return self.store.url

    def is_ours(self, local: str | None = None) -> bool:
        """Our own configuration (this node's disk, a root on this machine, the run's remote store), not another
        machine's answer: a checkpoint of another model here is our mistake, from a peer it is passed over."""
        return self.remote or self.name == local or not self.store.is_peer_server

    def steps(self, timeout_s: float) -> list[int]:
        """Committed steps this source holds (a peer server answers ``/_steps``)."""
        return self.store.with_timeout(timeout_s).committed_steps()

    def manifest(self, step: int, timeout_s: float) -> Manifest:
        return self.store.with_timeout(timeout_s).read_manifest(step)


@dataclass
class FileFetch:
    path: str
    size: int
    source: str  # the source name it came from
    seconds: float
    skipped: list[str]  # "source: why" for every candidate that failed first


@dataclass
class FetchReport:
    step: int
    dest: str
    files: list[FileFetch]
    seconds: float
    passed_over: list[str] = field(default_factory=list)  # "step N: why" for each newer step not used
    unreachable: list[str] = field(default_factory=list)  # "source: why" for sources that could not be asked

    def warnings(self) -> list[str]:
        """What a user should hear: sources that failed, newer steps passed over, files a peer served badly."""
        out = [f"source {u}" for u in self.unreachable]
        out += [f"passed over {p}" for p in self.passed_over]
        for f in self.files:
            out += [f"{f.path}: skipped {s}" for s in f.skipped]
        return out

    def by_kind(self, local: str | None = None) -> dict[str, int]:
        """Bytes from this node's own disk (``local``: its source name), from peers and from the remote store."""
        out = {"local": 0, "peers": 0, "remote": 0}
        for f in self.files:
            out["local" if f.source == local else "remote" if f.source == "remote" else "peers"] += f.size
        return out

    def by_source(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.files:
            out[f.source] = out.get(f.source, 0) + f.size
        return out


class WrongModel(HetrainError):
    """A source holds a checkpoint of another model: a configuration error, never a reason to fall back."""


class NoCheckpoint(HetrainError):
    """No source holds a committed checkpoint; ``errors`` says which sources could not be asked."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("no committed checkpoint on any surviving peer or in the remote store"
                         + (f" ({'; '.join(errors)})" if errors else ""))
        self.errors = errors


def committed_by_source(sources: list[Source], timeout_s: float) -> tuple[dict[int, list[Source]], list[str]]:
    """Which sources hold each committed step, and the sources that could not be asked (with why)."""
    holders: dict[int, list[Source]] = {}
    errors: list[str] = []
    for source in sources:
        try:
            for step in source.steps(timeout_s):
                holders.setdefault(step, []).append(source)
        except Exception as e:
            errors.append(f"{source.name}: {_why(e)}")
    return holders, errors


def _manifest(step: int, holders: list[Source], model: ModelSpec | None, timeout_s: float, local: str | None = None,
              passed_over: list[str] | None = None) -> Manifest:
    """Step ``step``'s manifest from the first holder whose answer is whole and of ``model``.

    A manifest of another model on one of our own sources (``Source.is_ours``) is a configuration
    error and raises ``WrongModel``; from a peer it is passed over like an unreadable one (one
    hostile or misconfigured peer must not stop a recovery), and said in ``passed_over``.
    """
    last: Exception | None = None
    for source in holders:
        try:
            manifest = source.manifest(step, timeout_s)
        except Exception as e:
            last = e
            continue
        if model is not None and manifest.model != model:
            wrong = WrongModel(f"{source.store.step_url(step, MANIFEST)}: checkpoint is of model "
                               f"'{manifest.model.name}' {manifest.model.model_dump(exclude_none=True)}, "
                               f"not the run's '{model.name}'")
            if source.is_ours(local):
                raise wrong
            last = wrong
            if passed_over is not None:
                passed_over.append(f"peer {source.name}: {wrong}")
            continue
        return manifest
    raise HetrainError(f"manifest of step {step} unreadable on {', '.join(s.name for s in holders)} ({_why(last)})")


def find_latest(sources: list[Source], model: ModelSpec | None = None, timeout_s: float = PEER_SILENCE_S) -> tuple[Manifest,
                                                                                                     Source]:
    """The newest committed manifest any source has; a manifest for another model is an error."""
    holders, errors = committed_by_source(sources, timeout_s)
    if not holders:
        raise NoCheckpoint(errors)
    step = max(holders)
    return _manifest(step, holders[step], model, timeout_s), holders[step][0]


def reassemble_newest(peers: list[Source], remote: Source | None, dest_of: Callable[[int], str], *,
                      model: ModelSpec | None = None, timeout_s: float = PEER_SILENCE_S,
                      progress: Callable[[int, int], None] | None = None, local: str | None = None) -> FetchReport:
    """Reassemble the newest committed step that can be fetched whole, falling back to older ones.

    An emergency checkpoint may be committed on the nodes before the lost node's shards reached
    the bucket: then the step before it, complete in the bucket, is the one to resume from.
    ``local``: the name of the peer that is this node's own disk (see ``reassemble``).
    """
    sources = peers + ([remote] if remote else [])
    holders, errors = committed_by_source(sources, timeout_s)
    if not holders:
        raise NoCheckpoint(errors)
    failures = []
    for step in sorted(holders, reverse=True):
        try:
            manifest = _manifest(step, holders[step], model, timeout_s, local, failures)
            report = reassemble(manifest, peers, remote, dest_of(step), timeout_s=timeout_s, progress=progress,
                                local=local)
        except WrongModel:
            raise
        except HetrainError as e:  # a damaged or incomplete step: the one before it may be whole
            failures.append(f"step {step}: {e}")
            continue
        report.passed_over, report.unreachable = failures, errors
        return report
    raise HetrainError("no committed checkpoint could be fetched whole: " + " | ".join(failures))


def _why(e: BaseException) -> str:
    """A short reason; fsspec's HTTP layer reports a timeout as FileNotFoundError from the real cause."""
    status = getattr(e, "status", None) or getattr(e.__cause__, "status", None)
    if status in (401, 403):
        return (f"refused our peer token (HTTP {status}): give this node the ${PEER_TOKEN_ENV} that "
                f"`hetrain serve` there was started with")
    cause = e.__cause__
    if isinstance(e, FileNotFoundError) and cause is not None and not isinstance(cause, FileNotFoundError):
        if "404" not in str(cause):
            return f"{type(cause).__name__}: {cause}".rstrip(": ")
    if isinstance(e, FileNotFoundError):
        return "not found"
    return f"{type(e).__name__}: {e}".rstrip(": ")


def copy_verified(src: Source, entry: FileEntry, step: int, dest_fs: fsspec.AbstractFileSystem, dest_path: str,
                   timeout_s: float) -> None:
    store = src.store.with_timeout(timeout_s)
    digest, size = hashlib.sha256(), 0
    tmp = dest_path + ".tmp"
    try:
        with store.fs.open(store.step_path(step, entry.path), "rb", block_size=CHUNK_BYTES) as fin, \
                dest_fs.open(tmp, "wb") as fout:
            while chunk := fin.read(CHUNK_BYTES):
                digest.update(chunk)
                size += len(chunk)
                if size > entry.size:
                    break
                fout.write(chunk)
    except BaseException:
        if dest_fs.exists(tmp):
            dest_fs.rm_file(tmp)  # never leave half a file behind
        raise
    if size != entry.size or digest.hexdigest() != entry.sha256:
        dest_fs.rm_file(tmp)
        raise ValueError(f"checksum mismatch (got {size} bytes, sha256 {digest.hexdigest()[:12]}..., "
                         f"manifest says {entry.size} bytes, {entry.sha256[:12]}...)")
    if entry.path == METADATA:  # the manifest vouching for it came from the same source: check what it is
        from hetrain.checkpoint.safe_metadata import load_metadata

        try:
            load_metadata(dest_fs.cat_file(tmp), f"{src.name}: {entry.path} of step {step}")
        except BaseException:
            dest_fs.rm_file(tmp)
            raise
    dest_fs.mv(tmp, dest_path)


# Room a fetch leaves beyond the step itself: the resumed run writes its next checkpoint (about the step's size)
# and its logs and metrics. As much as the step, at least 64 MB, at most a gigabyte: a flat gigabyte refused a
# 5.6 MB checkpoint on a disk with 200 MB free, the one place its run could resume (issue 48).
FREE_SPACE_MARGIN_BYTES = 1 << 30
MIN_FREE_SPACE_MARGIN_BYTES = 64 << 20


def free_space_needed(total_bytes: int) -> int:
    """Bytes that must be free where a step of ``total_bytes`` is fetched for a resume (see the margins above)."""
    return total_bytes + min(FREE_SPACE_MARGIN_BYTES, max(MIN_FREE_SPACE_MARGIN_BYTES, total_bytes))


def _check_room(dest_fs: fsspec.AbstractFileSystem, dest: str, manifest: Manifest) -> None:
    """Refuse before fetching when a local destination has no room for the whole step (a full disk helps nobody)."""
    from fsspec.implementations.local import LocalFileSystem

    if not isinstance(dest_fs, LocalFileSystem):
        return
    base = Path(dest)
    while not base.exists() and base != base.parent:
        base = base.parent
    free = shutil.disk_usage(base).free
    need = free_space_needed(manifest.total_bytes)
    if need > free:
        raise HetrainError(f"checkpoint step {manifest.step}: {manifest.total_bytes / 1e6:,.1f} MB to fetch, "
                           f"{free / 1e6:,.1f} MB free at {base} (a resume needs {need / 1e6:,.1f} MB: the step and "
                           f"room for the next checkpoint); free some space and run it again")


def reassemble(manifest: Manifest, peers: list[Source], remote: Source | None, dest_url: str, *,
               timeout_s: float = PEER_SILENCE_S, workers: int = TRANSFER_THREADS,
               progress: Callable[[int, int], None] | None = None, local: str | None = None) -> FetchReport:
    """Fetch every file of ``manifest`` into ``dest_url``, verified; peers first, the remote for the rest.

    ``local`` names the peer whose root is this node's own disk: every file it holds is read
    from there first (verified like any other), so a node that recovers moves over the network
    only what it lacks.
    """
    started = time.perf_counter()
    by_name = {p.name: p for p in peers}
    dest_fs, dest = url_filesystem(dest_url)
    _check_room(dest_fs, dest, manifest)
    partial = dest.rstrip("/") + ".partial"
    if dest_fs.exists(partial):
        dest_fs.rm(partial, recursive=True)
    dest_fs.makedirs(partial, exist_ok=True)
    total, done = manifest.total_bytes, 0

    def fetch(entry: FileEntry) -> FileFetch:
        holders = sorted((n for n in entry.nodes if n in by_name), key=lambda n: n != local)  # own disk first
        candidates = [by_name[n] for n in holders] + ([remote] if remote else [])
        skipped = []
        for src in candidates:
            t0 = time.perf_counter()
            try:
                copy_verified(src, entry, manifest.step, dest_fs, join(partial, entry.path), timeout_s)
                return FileFetch(entry.path, entry.size, src.name, time.perf_counter() - t0, skipped)
            except Exception as e:
                skipped.append(f"{src.name}: {_why(e)}")
        tried = "; ".join(skipped) if skipped else "no surviving peer holds it and no remote store is configured"
        raise HetrainError(f"checkpoint step {manifest.step}: file {entry.path} could not be fetched from any "
                           f"source ({tried})")

    fetched: list[FileFetch] = []
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for result in pool.map(fetch, sorted(manifest.files, key=lambda f: -f.size)):
                fetched.append(result)
                done += result.size
                if progress:
                    progress(done, total)
        dest_fs.pipe_file(join(partial, MANIFEST), manifest.to_json().encode())
        if dest_fs.exists(dest):
            dest_fs.rm(dest, recursive=True)
        dest_fs.mv(partial, dest, recursive=True)
    except BaseException:
        if dest_fs.exists(partial):
            dest_fs.rm(partial, recursive=True)
        raise
    return FetchReport(manifest.step, dest_url, fetched, time.perf_counter() - started)

