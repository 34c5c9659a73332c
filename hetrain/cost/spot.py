"""What spot preemptions cost a run in expectation: the checkpoint interval and the fraction of time lost.

A run of synchronous data parallelism stops whenever any of its nodes goes away. With nodes
preempted at rates lambda_i per hour, the run is interrupted at Lambda = sum_i lambda_i. Per
interruption it loses the recovery downtime D and, unless the notice was long enough to take an
emergency checkpoint, the work since the last periodic checkpoint (tau / 2 on average); each
periodic checkpoint stalls training C seconds. What a notice allows is ``hetrain.cost.notice``'s
rule, the one the watchers act on and ``hetrain simulate`` replays. The expected lost fraction of
wall time is

    C / tau + Lambda_unwarned * (D_restart + tau / 2) + Lambda_checkpointed * D_restart_after_checkpoint
      + Lambda_switched * D_switch

minimised by Young/Daly's tau = sqrt(2 C / Lambda_unwarned) = sqrt(2 x stall x MTBF); the
replaced node (or the re-planned run on the others) is assumed back within D. Expected goodput
is throughput x (1 - lost fraction).

C and D are measured, not guessed: ``hetrain.cost.recovery_costs`` reads them from the benches'
results (the committed ``bench/measured/`` by default), the same figures ``hetrain simulate``
replays: the background checkpoint's stall, a restart peers first after a node lost without
notice, and the notice-window switch's downtime and emergency checkpoint. They are the
benchmarks' model and machine (a 232 MB checkpoint, CPU ranks on a busy 2-core machine); run
them with your model's size on your nodes to price your run.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetrain.cost.notice import notice_action
from hetrain.cost.recovery_costs import (MAX_CHECKPOINT_INTERVAL_S, SECONDS_PER_HOUR, RecoveryCosts,
                                         young_daly_interval_s)
from hetrain.spec.specs import ClusterSpec

MIN_CHECKPOINT_INTERVAL_S = 1.0  # checkpoints no closer than this however cheap: a step takes about that long


@dataclass(frozen=True)
class PreemptionLoss:
    """The expected cost of preemptions to a run: its checkpoint interval and the fraction of wall time lost."""

    checkpoint_interval_s: float
    lost_fraction: float  # of wall time: stalls, downtime and work redone
    unwarned_per_hour: float  # interruptions whose notice is too short for an emergency checkpoint
    warned_per_hour: float  # the others: a switch or an emergency checkpoint and a restart
    costs: RecoveryCosts

    def goodput(self, tokens_per_s: float) -> float:
        return tokens_per_s * (1.0 - self.lost_fraction)


def preemption_loss(rates_per_hour: list[tuple[float, float]], costs: RecoveryCosts) -> PreemptionLoss:
    """The loss for nodes preempted at ``(rate per hour, notice s)`` each, each notice priced by what it lets
    hetrain do (``hetrain.cost.notice.notice_action``, as ``hetrain simulate`` replays it): a switch (its
    downtime), an emergency checkpoint and a restart (nothing redone, the restart's downtime), or a restart
    from the last periodic checkpoint (half an interval redone); periodic checkpoints only against the last.
    """
    by_action = {"switch": 0.0, "restart-notice": 0.0, "restart": 0.0}
    for rate, notice_s in rates_per_hour:
        by_action[notice_action(notice_s, costs)] += rate
    unwarned = by_action["restart"]
    tau = young_daly_interval_s(costs.checkpoint_stall_s, unwarned)
    if tau is None:  # nothing a notice cannot cover: checkpoints only against the rest (an hour apart)
        tau = MAX_CHECKPOINT_INTERVAL_S
    per_s = 1.0 / SECONDS_PER_HOUR
    # a stall measured as zero makes checkpoints free: as often as one a second (not "never", which `or` made it)
    # and no closer than a commit takes: a checkpoint due while the previous one commits is skipped (or waits)
    tau = max(tau, MIN_CHECKPOINT_INTERVAL_S, costs.checkpoint_commit_s)
    lost = (costs.checkpoint_stall_s / tau + unwarned * per_s * (costs.restart_peers_s + tau / 2)
            + by_action["restart-notice"] * per_s * costs.restart_notice_peers_s
            + by_action["switch"] * per_s * costs.switch_downtime_s)
    return PreemptionLoss(tau, min(1.0, lost), unwarned, by_action["switch"] + by_action["restart-notice"], costs)


def cluster_preemption_loss(cluster: ClusterSpec, costs: RecoveryCosts) -> PreemptionLoss:
    """The loss of a run on ``cluster``: its spot nodes' ``preemptions_per_hour`` and ``notice_s``."""
    return preemption_loss([(n.preemptions_per_hour or 0.0, n.notice_s or 0.0) for n in cluster.nodes if n.spot],
                           costs)
