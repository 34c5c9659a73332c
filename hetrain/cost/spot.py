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
stall), ``bench/recovery.py`` (a restart peers first after a node lost without notice) and
``bench/recovery.py --notice`` (the notice-window switch's downtime and its emergency checkpoint)
write ``bench/results/*.json``; those are read when present, else the figures of the same
benchmarks' tables in docs/benchmarks/recovery.md. Like ``hetrain simulate``'s, they are taken as
measured: the benchmarks' model and machine (a 232 MB checkpoint, CPU ranks on a busy 2-core
machine); run them with your model's size on your nodes to price your run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from hetrain.spec.specs import ClusterSpec

BENCH_RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
# With no preemption a notice cannot warn of, the run still checkpoints (crashes, the end of a rental):
# at most once an hour, the interval Young/Daly gives a stall of seconds against an MTBF of days.
MAX_CHECKPOINT_INTERVAL_S = 3600.0
SECONDS_PER_HOUR = 3600.0

# ---- The figures of docs/benchmarks/recovery.md, used when bench/results has no JSON (2-core machine, CPU ranks).
# "Checkpoint stall" table (2026-11-24, bench/checkpoint_cost.py), row "background": training stall 0.172 s.
BENCH_STALL_S = 0.172
# "Recovery: peers first vs bucket only" table (2026-11-23, bench/recovery.py), row "peers first": total 11.94 s.
BENCH_RESTART_S = 11.94
# "Downtime after a preemption notice" table (2026-11-24, bench/recovery.py --notice), row "notice-window switch":
# downtime 9.47 s, of which the emergency checkpoint 1.71 s.
BENCH_SWITCH_S, BENCH_EMERGENCY_CHECKPOINT_S = 9.47, 1.71
BENCH_TABLES = "docs/benchmarks/recovery.md (Checkpoint stall; Recovery; Downtime after a preemption notice)"


@dataclass(frozen=True)
class RecoveryCosts:
    """Measured costs of checkpoints and recovery, and where they were measured."""

    checkpoint_stall_s: float  # training's stall per background checkpoint
    restart_downtime_s: float  # a node lost without notice: re-plan, fetch peers first, start, load, first step
    switch_downtime_s: float  # a notice-window switch
    emergency_checkpoint_s: float  # what the notice must cover for the switch to lose no work
    source: str


def _rows(path: Path) -> dict[str, dict]:
    return {r["mode"]: r for r in json.loads(path.read_text())}


def load_recovery_costs(results: Path = BENCH_RESULTS) -> RecoveryCosts:
    """The measured costs: bench/results JSON where the benchmarks were run here, else their published tables."""
    figures = {"checkpoint_stall_s": BENCH_STALL_S, "restart_downtime_s": BENCH_RESTART_S,
               "switch_downtime_s": BENCH_SWITCH_S, "emergency_checkpoint_s": BENCH_EMERGENCY_CHECKPOINT_S}
    reads = {"checkpoint_cost.json": lambda rows: {"checkpoint_stall_s": rows["background"]["stall_s"]},
             "recovery.json": lambda rows: {"restart_downtime_s": rows["peers first"]["total_s"]},
             "recovery_notice.json": lambda rows: {
                 "switch_downtime_s": rows["notice-window switch"]["downtime_s"],
                 "emergency_checkpoint_s": rows["notice-window switch"]["emergency_checkpoint_s"]}}
    sources = []
    for name, read in reads.items():
        try:
            figures |= {k: float(v) for k, v in read(_rows(results / name)).items()}
            sources.append(str(results / name))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not run here (or an older bench's rows): the published figure stands
    source = (" and ".join(sources) + ("" if len(sources) == len(reads) else f", the rest from {BENCH_TABLES}")
              if sources else BENCH_TABLES)
    return RecoveryCosts(**figures, source=source)


@dataclass(frozen=True)
class PreemptionLoss:
    """The expected cost of preemptions to a run: its checkpoint interval and the fraction of wall time lost."""

    checkpoint_interval_s: float
    lost_fraction: float  # of wall time: stalls, downtime and work redone
    unwarned_per_hour: float  # interruptions whose notice is too short for an emergency checkpoint
    warned_per_hour: float
    costs: RecoveryCosts

    def goodput(self, tokens_per_s: float) -> float:
        return tokens_per_s * (1.0 - self.lost_fraction)


def young_daly_interval_s(stall_s: float, interruptions_per_hour: float) -> float:
    """sqrt(2 x stall x MTBF), at most ``MAX_CHECKPOINT_INTERVAL_S``."""
    if interruptions_per_hour <= 0:
        return MAX_CHECKPOINT_INTERVAL_S
    mtbf_s = SECONDS_PER_HOUR / interruptions_per_hour
    return min(MAX_CHECKPOINT_INTERVAL_S, math.sqrt(2.0 * stall_s * mtbf_s))


def preemption_loss(rates_per_hour: list[tuple[float, float]], costs: RecoveryCosts) -> PreemptionLoss:
    """The loss for nodes preempted at ``(rate per hour, notice s)`` each.

    A notice at least as long as the emergency checkpoint lets the run switch in the notice window
    (nothing redone, the switch's downtime); a shorter one is a restart from the last checkpoint.
    """
    warn_s = costs.emergency_checkpoint_s
    in_time = [notice_s > 0 and notice_s >= warn_s for _, notice_s in rates_per_hour]
    warned = sum(rate for (rate, _), ok in zip(rates_per_hour, in_time) if ok)
    unwarned = sum(rate for (rate, _), ok in zip(rates_per_hour, in_time) if not ok)
    tau = young_daly_interval_s(costs.checkpoint_stall_s, unwarned)
    per_s = 1.0 / SECONDS_PER_HOUR
    lost = (costs.checkpoint_stall_s / tau + unwarned * per_s * (costs.restart_downtime_s + tau / 2)
            + warned * per_s * costs.switch_downtime_s)
    return PreemptionLoss(tau, min(1.0, lost), unwarned, warned, costs)


def cluster_preemption_loss(cluster: ClusterSpec, costs: RecoveryCosts) -> PreemptionLoss:
    """The loss of a run on ``cluster``: its spot nodes' ``preemptions_per_hour`` and ``notice_s``."""
    return preemption_loss([(n.preemptions_per_hour or 0.0, n.notice_s or 0.0) for n in cluster.nodes if n.spot],
                           costs)


def price_per_hour(cluster: ClusterSpec) -> float:
    """Dollars per hour of the cluster's GPUs (a node without a price costs nothing)."""
    return sum(n.count * (n.price_per_gpu_hour or 0.0) for n in cluster.nodes)
