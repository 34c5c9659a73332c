"""What recovering from a preemption costs, as measured by ``bench/recovery.py`` and ``bench/checkpoint_cost.py``.

The one owner of these figures: the simulator (``hetrain.recovery.simulate``) prices every
switch, restart and checkpoint with them, the planner's spot objectives (``hetrain.cost.spot``)
the expected loss of a rental, and both name the files they came from; none of them is a
constant in code. Young/Daly's checkpoint interval from them is here too, for both. A
directory holds the three result files the benches write (``bench/results/`` after a run; the
repository commits one measured set in ``bench/measured/``):

* ``recovery_notice.json`` (``bench/recovery.py --notice``): downtime from the old plan's last
  step to the new plan's first after a notice: ``notice-window switch`` (and ``live switch``),
  with how long the new plan's ranks took to start (``warm_start_s``), ``peers-first restart``
  (hetrain's emergency checkpoint and restart) and ``bucket-only restart`` (AutoHet's baseline);
* ``recovery.json`` (``bench/recovery.py``): a restart after a node is lost without notice,
  ``peers first`` and ``bucket only``: re-plan, fetch, start, load, first step (``total_s``);
* ``checkpoint_cost.json`` (``bench/checkpoint_cost.py``): the training stall per checkpoint
  (``background``: hetrain's default).

They are the bench's model and machine (a 232 MB checkpoint on CPU processes by default): run
the benches with your model's size on your machines (``--layers``, ``--hidden``) and point the
simulator at their results to price your run.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from hetrain.errors import HetrainError
from hetrain.files import parse_json, read_text

NOTICE_FILE = "recovery_notice.json"
RESTART_FILE = "recovery.json"
CHECKPOINT_FILE = "checkpoint_cost.json"
# The measured set committed with the repository (a checkout or an editable install has it)
COMMITTED_DIR = Path(__file__).resolve().parents[2] / "bench" / "measured"
# With rare preemptions the run still checkpoints (crashes, the end of a rental): at most an hour apart,
# where Young/Daly gives a stall of seconds against an MTBF of days.
MAX_CHECKPOINT_INTERVAL_S = 3600.0
SECONDS_PER_HOUR = 3600.0


# What a checkpoint holds per parameter: fp32 weights and AdamW's two fp32 moments (16-bit training keeps
# fp32 masters): 18 GB for the 1.5 B-parameter Llama measured on an H200.
CHECKPOINT_BYTES_PER_PARAM = 12


@dataclass(frozen=True)
class StateLinks:
    """The bandwidths a checkpoint's size is priced at, with where they were measured."""

    # a GPU's copy into the prepared pinned snapshot buffers: 55.1 GB/s for 18 GB on an H200
    # (bench/snapshot_copy.py's bare copy, 2026-11-28)
    host_copy_gbps: float = 55.0
    # a node's local disk: the H200 machine's, dd of 8 GB with direct I/O and fsync, 1.1 GB/s (2026-11-28);
    # the background commit of 18 GB ran at 1.17 GB/s there
    disk_write_gbps: float = 1.1
    source: str = "host copy 55 GB/s, disk 1.1 GB/s: measured on an H200 node, 2026-11-28"


@dataclass(frozen=True)
class RecoveryCosts:
    """Seconds each way of recovering takes (medians of the bench's repeats), and where they were read."""

    switch_downtime_s: float  # notice-window switch, the state through the disk
    live_switch_downtime_s: float | None  # the same with the live switch (None: not measured)
    switch_warm_start_s: float  # the new plan's ranks started and ready before the switch
    restart_notice_peers_s: float  # emergency checkpoint, restart, peers first (hetrain without a switch)
    restart_notice_bucket_s: float  # emergency checkpoint, restart from the bucket (AutoHet's baseline)
    restart_peers_s: float  # no notice: re-plan, fetch peers first, start, load, first step
    restart_bucket_s: float  # no notice, everything from the bucket
    checkpoint_stall_s: float  # training's stall per background checkpoint
    emergency_checkpoint_s: float  # the switch's emergency checkpoint: what a notice must cover to lose no work
    source: str  # the directory the numbers were read from
    checkpoint_commit_s: float = 0.0  # a background commit (write, hash, sync); ``for_state`` prices it
    state_gb_per_gpu: float | None = None  # the checkpoint these costs were scaled to (``for_state``), if any
    state_links: str | None = None  # the bandwidths they were scaled at, and where those were measured

    def for_state(self, rank_bytes: float, node_bytes: float, node_link_gbps: float,
                  links: StateLinks | None = None) -> RecoveryCosts:
        """These costs for a run whose ranks each checkpoint ``rank_bytes`` (a node ``node_bytes``).

        The benches measured a small state (232 MB on four CPU processes): what they measured is kept
        as each phase's fixed part, and the part that grows with the state is added at the measured
        bandwidths of ``links``: the stall copies a rank's state into host memory, the commit and an
        emergency checkpoint write a node's to its disk, a restart or switch fetches a node's over
        its link (``node_link_gbps``, GB/s) and writes it before loading.
        """
        links = links or StateLinks()
        copy_s = rank_bytes / (links.host_copy_gbps * 1e9)
        write_s = node_bytes / (links.disk_write_gbps * 1e9)
        fetch_s = node_bytes / (max(node_link_gbps, 1e-9) * 1e9) + write_s
        return replace(self, checkpoint_stall_s=self.checkpoint_stall_s + copy_s, checkpoint_commit_s=write_s,
                       emergency_checkpoint_s=self.emergency_checkpoint_s + write_s,
                       restart_notice_peers_s=self.restart_notice_peers_s + write_s + fetch_s,
                       restart_notice_bucket_s=self.restart_notice_bucket_s + write_s + fetch_s,
                       restart_peers_s=self.restart_peers_s + fetch_s, restart_bucket_s=self.restart_bucket_s + fetch_s,
                       switch_downtime_s=self.switch_downtime_s + write_s + fetch_s,
                       state_gb_per_gpu=rank_bytes / 1e9, state_links=links.source)

    def as_dict(self) -> dict:
        return asdict(self)


def _rows(directory: Path, name: str) -> dict[str, dict]:
    path = directory / name
    if not path.is_file():
        raise HetrainError(f"--bench-results: {directory} has no {name} (run the bench that writes it; see "
                           f"docs/how-to/simulate.md)")
    rows = parse_json(read_text(path), str(path))
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "mode" in r for r in rows):
        raise HetrainError(f"{path}: expected the bench's list of rows with a 'mode' each")
    return {r["mode"]: r for r in rows}


def _seconds(rows: dict[str, dict], mode: str, key: str, path: Path) -> float:
    row = rows.get(mode)
    if row is None:
        raise HetrainError(f"{path}: no row for mode '{mode}' (expected one of the bench's modes; was it skipped?)")
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise HetrainError(f"{path}: mode '{mode}': {key}: expected seconds >= 0, got {value!r}")
    return float(value)


def _warm_start_s(rows: dict[str, dict], path: Path) -> float:
    """The median of the switch's repeats' ``warm_start_s`` (the row keeps each repeat under ``runs``)."""
    runs = rows.get("notice-window switch", {}).get("runs") or []
    values = [r.get("warm_start_s") for r in runs if isinstance(r, dict)]
    if not values or not all(isinstance(v, int | float) and v >= 0 for v in values):
        raise HetrainError(f"{path}: mode 'notice-window switch': runs[].warm_start_s: expected seconds >= 0")
    return float(statistics.median(values))


def load_recovery_costs(directory: str | Path | None = None) -> RecoveryCosts:
    """The measured costs in ``directory`` (default: the committed ``bench/measured``); HetrainError if one lacks."""
    d = Path(directory) if directory is not None else COMMITTED_DIR
    if not d.is_dir():
        raise HetrainError(f"--bench-results: expected a directory holding {NOTICE_FILE}, {RESTART_FILE} and "
                           f"{CHECKPOINT_FILE}, got '{d}'")
    notice, restart, ckpt = _rows(d, NOTICE_FILE), _rows(d, RESTART_FILE), _rows(d, CHECKPOINT_FILE)
    np_, rp, cp = d / NOTICE_FILE, d / RESTART_FILE, d / CHECKPOINT_FILE
    return RecoveryCosts(
        switch_downtime_s=_seconds(notice, "notice-window switch", "downtime_s", np_),
        live_switch_downtime_s=(_seconds(notice, "live switch", "downtime_s", np_) if "live switch" in notice
                                else None),
        switch_warm_start_s=_warm_start_s(notice, np_),
        restart_notice_peers_s=_seconds(notice, "peers-first restart", "downtime_s", np_),
        restart_notice_bucket_s=_seconds(notice, "bucket-only restart", "downtime_s", np_),
        restart_peers_s=_seconds(restart, "peers first", "total_s", rp),
        restart_bucket_s=_seconds(restart, "bucket only", "total_s", rp),
        checkpoint_stall_s=_seconds(ckpt, "background", "stall_s", cp),
        emergency_checkpoint_s=_seconds(notice, "notice-window switch", "emergency_checkpoint_s", np_),
        source=str(d),
    )


def young_daly_interval_s(stall_s: float, interruptions_per_hour: float) -> float | None:
    """Young/Daly's checkpoint interval ``sqrt(2 x stall x MTBF)``, at most ``MAX_CHECKPOINT_INTERVAL_S``;
    None when nothing is ever interrupted (the caller's default interval then)."""
    if interruptions_per_hour <= 0:
        return None
    mtbf_s = SECONDS_PER_HOUR / interruptions_per_hour
    return min(MAX_CHECKPOINT_INTERVAL_S, math.sqrt(2.0 * stall_s * mtbf_s))
