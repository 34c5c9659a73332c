"""The options of a simulation (``hetrain simulate``, the simulate flow): one declaration for both.

Apart from the simulator so that the command line imports only pydantic for them (the simulator
loads numpy and the recovery modules when the command runs).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt

from hetrain.cost.recovery_costs import SECONDS_PER_HOUR  # the one owner of the hour

# Spot capacity that went away comes back after about this long unless --return-after-s says
# otherwise: an assumption (the clouds publish how often they interrupt, not how soon capacity
# returns); a market CSV gives the real times.
DEFAULT_RETURN_AFTER_S = 3600.0
# On-demand over spot price when the cluster file gives only the spot price: an assumption of the
# order of the clouds' spot discounts (AWS advertises up to 90 % off; on GPU instances 60-70 % is
# common), so on demand costs about 3x. --on-demand-price-factor overrides it; an offers file with
# both prices will replace it.
DEFAULT_ON_DEMAND_PRICE_FACTOR = 3.0
MAX_REPLAYS = 10_000  # each replay is milliseconds; ten thousand is already a tight distribution
MAX_HOURS = 24 * 365.0  # a year of market


class SimulateOptions(BaseModel):
    """What ``hetrain simulate`` and the simulate flow take besides the clusters and plans."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    market: str | None = Field(default=None, description="market CSV (time_s,node,event,notice_s); default: draw "
                               "one from each spot node's preemptions_per_hour")
    seed: int = Field(default=0, ge=0, description="seed of the drawn markets (replay i uses seed and i)")
    hours: PositiveFloat = Field(default=24.0, le=MAX_HOURS, description="length of the replayed market, hours")
    replays: PositiveInt = Field(default=1, le=MAX_REPLAYS, description="seeded markets to replay (drawn only)")
    tokens: float | None = Field(default=None, gt=0, description="stop a run once it has trained this many tokens")
    deadline_hours: float | None = Field(
        default=None, gt=0, le=MAX_HOURS, description="report the share of replays that train --tokens by then")
    checkpoint_every_s: float | None = Field(
        default=None, gt=0, description="seconds between checkpoints (default: the interval hetrain plan --offers "
        "chooses: Young/Daly from the measured stall and the preemptions a notice cannot cover)")
    return_after_s: float = Field(default=DEFAULT_RETURN_AFTER_S, ge=0.0, le=MAX_HOURS * SECONDS_PER_HOUR,
                                  description="drawn markets: seconds until a preempted node can be rented again")
    on_demand_price_factor: float = Field(
        default=DEFAULT_ON_DEMAND_PRICE_FACTOR, ge=1.0, le=100.0,
        description="the on-demand baseline pays a spot node's price times this")
    live_switch: bool = Field(default=False, description="hetrain switches live (hetrain switch --live)")
    bench_results: str | None = Field(
        default=None, description="directory of the recovery benches' JSON results (default: bench/measured)")
