"""What a preemption notice of ``n`` seconds lets hetrain do: one rule for the watchers that act on
notices (``hetrain.recovery.preemption``), the replay of a market (``hetrain.recovery.simulate``)
and the spot objectives that price a rental (``hetrain.cost.spot``), so the plan is priced as the
run will recover.

* **switch**: long enough for the notice-window switch (``switch_notice_s``): the new plan's ranks
  warm-start beside the old plan, which trains on; nothing is lost, the switch's downtime is paid;
* **restart-notice**: long enough for an emergency checkpoint (``MIN_CHECKPOINT_S``): nothing is
  lost, the restart after it is paid;
* **restart**: shorter: the work since the last periodic checkpoint is lost, then the restart.
"""

from __future__ import annotations

from typing import Literal

from hetrain.cost.recovery_costs import RecoveryCosts

# A notice at least this long leaves time for a switch inside it (the recovery flow's start, a
# warm start of the new plan, the switch's reserve): AWS's two minutes do, GCP's and Azure's 30 s not.
SWITCH_NOTICE_S = 60.0
# A notice at least this long leaves time for an emergency checkpoint (a step, a snapshot, a
# commit: a few seconds) before the node goes; a shorter one loses the work since the last one.
MIN_CHECKPOINT_S = 10.0
# Kept free before the deadline for what follows a switch's warm start (``hetrain.recovery.proactive``):
# the emergency checkpoint (a step, a snapshot and a commit) and the fetch of the leaving nodes' shards.
DEFAULT_SWITCH_RESERVE_S = 20.0

NoticeAction = Literal["switch", "restart-notice", "restart"]


def switch_notice_s(costs: RecoveryCosts) -> float:
    """The shortest notice a switch fits in: ``SWITCH_NOTICE_S``, and no less than the measured warm start
    plus the reserve after it."""
    return max(SWITCH_NOTICE_S, costs.switch_warm_start_s + DEFAULT_SWITCH_RESERVE_S)


def notice_action(notice_s: float, costs: RecoveryCosts, *, switch: bool = True) -> NoticeAction:
    """What a notice of ``notice_s`` seconds allows (the module's list); ``switch``: the strategy switches."""
    if switch and notice_s >= switch_notice_s(costs):
        return "switch"
    return "restart-notice" if notice_s >= MIN_CHECKPOINT_S else "restart"
