"""A spot market to replay: when each spot node is preempted (and with what notice) and when it comes back.

Two sources, one form (a list of ``MarketEvent`` sorted by time):

* ``read_market_csv``: a CSV file with the header ``time_s,node,event,notice_s``, one row per
  event: ``time_s`` seconds from the start of the replay, ``node`` a node of the cluster file,
  ``event`` ``preempt`` (the node is gone at ``time_s``; the cloud warned ``notice_s`` seconds
  before, blank: the node's ``notice_s`` from the cluster file, else 0) or ``available`` (the
  node can be rented again from ``time_s``; ``notice_s`` blank). Every node is up at time 0.
  A bad row is one ``HetrainError`` naming the file, the line and the field.
* ``generate_market``: a seeded draw from each spot node's ``preemptions_per_hour``: exponential
  times between preemptions while the node is up (a Poisson process, the memoryless model the
  clouds' published interruption frequencies fit), the node back ``return_after_s`` later.
  Each node draws from its own stream, keyed by the seed, the replay and its name, so two
  clusters that share a node see the same events for it (paired comparisons).

Torch-free, Prefect-free: the simulator (``hetrain.recovery.simulate``) and the CLI read it.
"""

from __future__ import annotations

import csv
import io
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from hetrain.cost.recovery_costs import SECONDS_PER_HOUR
from hetrain.errors import HetrainError
from hetrain.files import read_text, write_text_atomic
from hetrain.spec.specs import ClusterSpec

CSV_COLUMNS = ("time_s", "node", "event", "notice_s")
EVENTS = ("preempt", "available")


@dataclass(frozen=True)
class MarketEvent:
    """``node`` preempted at ``time_s`` (warned ``notice_s`` before) or available again from ``time_s``."""

    time_s: float
    node: str
    kind: Literal["preempt", "available"]
    notice_s: float = 0.0

    @property
    def notice_at_s(self) -> float:
        """When the warning came (never before the replay's start)."""
        return max(0.0, self.time_s - self.notice_s)


def _number(text: str, where: str, field: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise HetrainError(f"{where}: {field}: expected a number of seconds >= 0, got '{text}'") from None
    if not math.isfinite(value) or value < 0:
        raise HetrainError(f"{where}: {field}: expected a number of seconds >= 0, got '{text}'")
    return value


def _row_event(row: dict[str, str], where: str, cluster_nodes: dict[str, float]) -> MarketEvent:
    """One CSV row as an event; HetrainError naming the field when a value is wrong."""
    time_s = _number((row["time_s"] or "").strip(), where, "time_s")
    node = (row["node"] or "").strip()
    if node not in cluster_nodes:
        known = ", ".join(sorted(cluster_nodes))
        raise HetrainError(f"{where}: node: expected a node of the cluster ({known}), got '{node}'")
    kind = (row["event"] or "").strip()
    if kind not in EVENTS:
        raise HetrainError(f"{where}: event: expected one of {', '.join(EVENTS)}, got '{kind}'")
    notice_text = (row["notice_s"] or "").strip()
    if kind == "available" and notice_text:
        raise HetrainError(f"{where}: notice_s: expected it blank for an 'available' event, got '{notice_text}'")
    notice_s = _number(notice_text, where, "notice_s") if notice_text else cluster_nodes[node]
    return MarketEvent(time_s, node, kind, notice_s if kind == "preempt" else 0.0)


def read_market_csv(path: str | Path, cluster: ClusterSpec | list[ClusterSpec]) -> list[MarketEvent]:
    """The events of a market CSV (see the module's docstring), by time; nodes of any of ``cluster``.

    Checks that each node's events alternate (a node is preempted while up, available while gone).
    """
    clusters = cluster if isinstance(cluster, list) else [cluster]
    notice_of = {n.name: n.notice_s or 0.0 for c in clusters for n in c.nodes}
    lines = read_text(path).splitlines()
    reader = csv.DictReader(lines)
    header = [h.strip() for h in reader.fieldnames or []]
    if header != list(CSV_COLUMNS):
        raise HetrainError(f"{path}: line 1: expected the header {','.join(CSV_COLUMNS)}, got '{','.join(header)}'")
    reader.fieldnames = header
    events: list[tuple[MarketEvent, int]] = []
    for row in reader:
        where = f"{path}: line {reader.line_num}"
        if None in row or any(v is None for v in row.values()):
            raise HetrainError(f"{where}: expected {len(CSV_COLUMNS)} fields ({','.join(CSV_COLUMNS)})")
        events.append((_row_event(row, where, notice_of), reader.line_num))
    events.sort(key=lambda e: e[0].time_s)
    _check_alternation(events, path)
    return [e for e, _ in events]


def _check_alternation(events: list[tuple[MarketEvent, int]], path: str | Path) -> None:
    up: dict[str, bool] = {}
    for event, line in events:
        was_up = up.get(event.node, True)
        if (event.kind == "preempt") != was_up:
            state = "up" if was_up else "already gone"
            raise HetrainError(f"{path}: line {line}: event: node '{event.node}' is {state} at {event.time_s:g} s; "
                               f"expected {'preempt' if was_up else 'available'}, got '{event.kind}'")
        up[event.node] = event.kind == "available"


def node_rng(seed: int, replay: int, node: str) -> np.random.Generator:
    """The random stream of one node in one replay: the same for the same seed, replay and node name."""
    return np.random.default_rng([seed, replay, zlib.crc32(node.encode())])


def generate_market(cluster: ClusterSpec, horizon_s: float, seed: int, return_after_s: float,
                    replay: int = 0) -> list[MarketEvent]:
    """Preemptions of each spot node drawn from its ``preemptions_per_hour`` up to ``horizon_s`` (see the module)."""
    events: list[MarketEvent] = []
    for node in cluster.nodes:
        rate_per_s = (node.preemptions_per_hour or 0.0) / SECONDS_PER_HOUR
        if not node.spot or rate_per_s <= 0:
            continue
        rng, t = node_rng(seed, replay, node.name), 0.0
        while True:
            t += rng.exponential(1.0 / rate_per_s)
            if t >= horizon_s:
                break
            events.append(MarketEvent(t, node.name, "preempt", node.notice_s or 0.0))
            t += return_after_s
            if t >= horizon_s:
                break
            events.append(MarketEvent(t, node.name, "available"))
    events.sort(key=lambda e: (e.time_s, e.node))
    return events


def write_market_csv(events: list[MarketEvent], path: str | Path) -> Path:
    """The events as a market CSV that ``read_market_csv`` reads back (a generated market, to replay again)."""
    text = io.StringIO()
    w = csv.writer(text, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for e in events:
        w.writerow([repr(e.time_s), e.node, e.kind, repr(e.notice_s) if e.kind == "preempt" else ""])
    write_text_atomic(path, text.getvalue(), "market CSV")
    return Path(path)
