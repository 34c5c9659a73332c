"""What spot preemptions cost a run in expectation: the checkpoint interval and the fraction of time lost.

A run of synchronous data parallelism stops whenever any of its nodes goes away. With nodes
preempted at rates lambda_i per hour, the run is interrupted at Lambda = sum_i lambda_i. Per
interruption it loses the recovery downtime D and, unless the notice was long enough to take an
emergency checkpoint, the work since the last periodic checkpoint (tau / 2 on average); each
periodic checkpoint stalls training C seconds. The expected lost fraction of wall time is

    C / tau + Lambda_unwarned * (D_restart + tau / 2) + Lambda_warned * D_switch

minimised by Young/Daly's tau = sqrt(2 C / Lambda_unwarned) = sqrt(2 x stall x MTBF); the
replaced node (or the re-planned run on the others) is assumed back within D. Expected goodput
is throughput x (1 - lost fraction).

C and D are measured, not guessed: ``bench/checkpoint_cost.py`` (the background checkpoint's
stall) and ``bench/recovery.py --notice`` (downtime of a peers-first restart and of the
notice-window switch) write ``bench/results/*.json``; those are read when present, else the
figures of the same benchmarks' tables in docs/benchmarks/recovery.md. They were measured on a
checkpoint of ``measured_checkpoint_mb`` over ``measured_ranks`` one-GPU ranks; the parts that move
bytes (the stall, the emergency checkpoint, the fetch and the load) are scaled to the run's
checkpoint bytes per GPU (each rank saves and loads its own shard, all at once), the rest (starting
processes, the rendezvous) are taken as they are. The benchmarks ran on CPU ranks of a busy 2-core
machine: run them on your nodes and their JSON replaces these figures.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from hetrain.spec.arithmetic import total_params
from hetrain.spec.specs import ClusterSpec, ModelSpec

BENCH_RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
# fp32 master weights + two fp32 AdamW moments: what a DCP checkpoint of a bf16 run holds per parameter
# (bench/recovery.py's 19 M-parameter GPT checkpoints 232 MB: 12.2 bytes per parameter).
CHECKPOINT_BYTES_PER_PARAM = 12
# With no preemption a notice cannot warn of, the run still checkpoints (crashes, the end of a rental):
# at most once an hour, the interval Young/Daly gives a stall of seconds against an MTBF of days.
MAX_CHECKPOINT_INTERVAL_S = 3600.0
SECONDS_PER_HOUR = 3600.0

# ---- The figures of docs/benchmarks/recovery.md, used when bench/results has no JSON (2-core machine, CPU ranks).
# "Checkpoint stall" table (2026-11-24, bench/checkpoint_cost.py), row "background": training stall 0.172 s.
BENCH_STALL_S = 0.172
# "Downtime after a preemption notice" table (2026-11-24, bench/recovery.py --notice), row "peers-first restart":
# downtime 37.04 s, of which emergency checkpoint 1.87, fetch 4.19, load 1.53.
BENCH_RESTART = {"downtime_s": 37.04, "emergency_checkpoint_s": 1.87, "fetch_s": 4.19, "load_s": 1.53}
# Same table, row "notice-window switch": downtime 9.47 s, emergency checkpoint 1.71, fetch 4.40, load 3.31.
BENCH_SWITCH = {"downtime_s": 9.47, "emergency_checkpoint_s": 1.71, "fetch_s": 4.40, "load_s": 3.31}
BENCH_CHECKPOINT_MB = 232.0  # the checkpoint both benchmarks move (tables' captions)
BENCH_RANKS = 4  # one GPU (CPU rank) on each of four nodes
BENCH_TABLES = "docs/benchmarks/recovery.md (Checkpoint stall; Downtime after a preemption notice)"


@dataclass(frozen=True)
class RecoveryCosts:
    """Measured costs of checkpoints and recovery, and where they were measured."""

    checkpoint_stall_s: float
    restart: dict  # downtime_s and its byte-moving parts: emergency_checkpoint_s, fetch_s, load_s
    switch: dict
    measured_checkpoint_mb: float
    measured_ranks: int
    source: str

    def scaled(self, checkpoint_mb_per_gpu: float) -> RecoveryCosts:
        """These costs for a run whose checkpoint holds ``checkpoint_mb_per_gpu`` MB per GPU."""
        k = checkpoint_mb_per_gpu / (self.measured_checkpoint_mb / self.measured_ranks)

        def one(parts: dict) -> dict:
            moving = parts["emergency_checkpoint_s"] + parts["fetch_s"] + parts["load_s"]
            fixed = max(0.0, parts["downtime_s"] - moving)
            return {**{p: parts[p] * k for p in ("emergency_checkpoint_s", "fetch_s", "load_s")},
                    "downtime_s": fixed + moving * k}

        return replace(self, checkpoint_stall_s=self.checkpoint_stall_s * k, restart=one(self.restart),
                       switch=one(self.switch), measured_checkpoint_mb=checkpoint_mb_per_gpu * self.measured_ranks)


def load_recovery_costs(results: Path = BENCH_RESULTS) -> RecoveryCosts:
    """The measured costs: bench/results JSON where the benchmarks were run here, else their published tables."""
    stall, restart, switch, sources = BENCH_STALL_S, BENCH_RESTART, BENCH_SWITCH, []
    try:
        rows = {r["mode"]: r for r in json.loads((results / "checkpoint_cost.json").read_text())}
        stall = float(rows["background"]["stall_s"])
        sources.append(str(results / "checkpoint_cost.json"))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        rows = {r["mode"]: r for r in json.loads((results / "recovery_notice.json").read_text())}
        keys = ("downtime_s", "emergency_checkpoint_s", "fetch_s", "load_s")
        picked = [{k: float(rows[mode][k]) for k in keys} for mode in ("peers-first restart", "notice-window switch")]
        restart, switch = picked
        sources.append(str(results / "recovery_notice.json"))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    source = (" and ".join(sources) + ("" if len(sources) == 2 else f", the rest from {BENCH_TABLES}")
              if sources else BENCH_TABLES)
    return RecoveryCosts(stall, dict(restart), dict(switch), BENCH_CHECKPOINT_MB, BENCH_RANKS, source)


def checkpoint_mb_per_gpu(model: ModelSpec, gpus: int) -> float:
    """The run's checkpoint spread over its GPUs (DCP: each rank saves its shard)."""
    return total_params(model) * CHECKPOINT_BYTES_PER_PARAM / 1e6 / max(1, gpus)


@dataclass(frozen=True)
class PreemptionLoss:
    """The expected cost of preemptions to a run: its checkpoint interval and the fraction of wall time lost."""

    checkpoint_interval_s: float
    lost_fraction: float  # of wall time: stalls, downtime and work redone
    unwarned_per_hour: float  # interruptions whose notice is too short for an emergency checkpoint
    warned_per_hour: float
    costs: RecoveryCosts  # scaled to the run's checkpoint

    def goodput(self, tokens_per_s: float) -> float:
        return tokens_per_s * (1.0 - self.lost_fraction)


def young_daly_interval_s(stall_s: float, interruptions_per_hour: float) -> float:
    """sqrt(2 x stall x MTBF), at most ``MAX_CHECKPOINT_INTERVAL_S``."""
    if interruptions_per_hour <= 0:
        return MAX_CHECKPOINT_INTERVAL_S
    mtbf_s = SECONDS_PER_HOUR / interruptions_per_hour
    return min(MAX_CHECKPOINT_INTERVAL_S, math.sqrt(2.0 * stall_s * mtbf_s))


def preemption_loss(rates_per_hour: list[tuple[float, float]], costs: RecoveryCosts) -> PreemptionLoss:
    """The loss for nodes preempted at ``(rate per hour, notice s)`` each, with ``costs`` already scaled to the run.

    A notice at least as long as the emergency checkpoint lets the run switch in the notice window
    (nothing redone, the switch's downtime); a shorter one is a restart from the last checkpoint.
    """
    warn_s = costs.switch["emergency_checkpoint_s"]
    in_time = [notice_s > 0 and notice_s >= warn_s for _, notice_s in rates_per_hour]
    warned = sum(rate for (rate, _), ok in zip(rates_per_hour, in_time) if ok)
    unwarned = sum(rate for (rate, _), ok in zip(rates_per_hour, in_time) if not ok)
    tau = young_daly_interval_s(costs.checkpoint_stall_s, unwarned)
    per_s = 1.0 / SECONDS_PER_HOUR
    lost = (costs.checkpoint_stall_s / tau + unwarned * per_s * (costs.restart["downtime_s"] + tau / 2)
            + warned * per_s * costs.switch["downtime_s"])
    return PreemptionLoss(tau, min(1.0, lost), unwarned, warned, costs)


def cluster_preemption_loss(cluster: ClusterSpec, model: ModelSpec, costs: RecoveryCosts) -> PreemptionLoss:
    """The loss of a run of ``model`` on ``cluster``: its spot nodes' ``preemptions_per_hour`` and ``notice_s``."""
    scaled = costs.scaled(checkpoint_mb_per_gpu(model, cluster.num_devices))
    return preemption_loss([(n.preemptions_per_hour or 0.0, n.notice_s or 0.0) for n in cluster.nodes if n.spot],
                           scaled)


def price_per_hour(cluster: ClusterSpec) -> float:
    """Dollars per hour of the cluster's GPUs (a node without a price costs nothing)."""
    return sum(n.count * (n.price_per_gpu_hour or 0.0) for n in cluster.nodes)
