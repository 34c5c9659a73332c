"""Offers: the GPUs one could rent, and a rental (a choice among them) as an ordinary cluster file.

An offers file lists, per offer, a node shape (GPU type, GPUs per node, intra-node link), where
it is (a zone), how many such nodes can be had, and its prices on demand and on the spot market,
with the spot market's preemption rate and notice. Zones say how fast nodes inside them talk
(``inter_node_bandwidth_gbps``); ``zone_links`` how fast two zones do. ``hetrain plan --offers``
chooses a rental from it; :func:`cluster_from_rental` turns that rental into a ``ClusterSpec``
whose nodes carry ``spot``, ``price_per_gpu_hour``, ``preemptions_per_hour`` and ``notice_s``,
which ``hetrain train`` and ``hetrain simulate`` read like any cluster file. Loading errors are
one line naming the file and field, as for cluster files (``hetrain.spec.specs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt, model_validator

from hetrain.errors import HetrainError
from hetrain.spec.catalog import CATALOG, GPUType
from hetrain.spec.specs import (MAX_CLUSTER_GPUS, MAX_GPUS_PER_NODE, MAX_LATENCY_US, MAX_LINK_GBPS, MAX_NOTICE_S,
                                MAX_PREEMPTIONS_PER_HOUR, MAX_PRICE_PER_GPU_HOUR, NAME_PATTERN, ClusterSpec,
                                _FieldError, _Spec, load_yaml, parse_spec)

# Inside a cloud region zones are joined by links of tens of Gb/s shared by every tenant; a few GB/s per
# node pair is what a training job can count on. Used between zones that no zone_links entry joins.
DEFAULT_INTER_ZONE_GBPS = 1.25  # 10 Gb/s
# Exact per-pair links are written for a rental over several zones up to this many node pairs; past it the
# cluster takes the slowest link between any two of its nodes for every pair (pessimistic, but a cluster
# file of a million link lines would be larger than the planner's work on it).
MAX_EXACT_LINK_PAIRS = 4096
# An offers file lists what clouds rent: a cloud has some 15 GPU types, a region tens of zones. The planner
# probes every GPU type (64 take seconds, 256 minutes), and a 60 MB file of 200,000 types took YAML alone
# minutes to read: both refused at once, in one line (issue 48).
MAX_OFFERS_BYTES = 4 << 20
MAX_OFFER_GPU_TYPES = 64
MAX_OFFERS = 4096
Market = Literal["spot", "on_demand"]


class ZoneSpec(_Spec):
    """A zone (an availability zone, a data centre): nodes inside it talk at ``inter_node_bandwidth_gbps``."""

    name: str = Field(pattern=NAME_PATTERN)
    inter_node_bandwidth_gbps: PositiveFloat = Field(le=MAX_LINK_GBPS,
                                                     description="GB/s between GPUs of two nodes in this zone")


class ZoneLinkSpec(_Spec):
    """The bandwidth between nodes of two zones (GB/s)."""

    zones: tuple[str, str]
    bandwidth_gbps: PositiveFloat = Field(le=MAX_LINK_GBPS)


class OfferSpec(_Spec):
    """Up to ``nodes_available`` nodes of ``gpus_per_node`` GPUs of type ``gpu`` in ``zone``, on demand or spot.

    Prices are dollars per GPU-hour; a market without a price is not offered. ``preemptions_per_hour``
    is how often one spot node of this offer is taken back (a cloud preempts whole instances), and
    ``notice_s`` how long before it the cloud warns.
    """

    name: str = Field(pattern=NAME_PATTERN)
    gpu: str
    zone: str
    nodes_available: PositiveInt = Field(le=MAX_CLUSTER_GPUS)
    gpus_per_node: PositiveInt = Field(le=MAX_GPUS_PER_NODE)
    intra_node_bandwidth_gbps: PositiveFloat = Field(le=MAX_LINK_GBPS, description="GB/s between two GPUs of a node")
    nics: Literal["one", "per_gpu"] = Field(default="one", description="as in the cluster file")
    on_demand_price_per_gpu_hour: NonNegativeFloat | None = Field(default=None, le=MAX_PRICE_PER_GPU_HOUR)
    spot_price_per_gpu_hour: NonNegativeFloat | None = Field(default=None, le=MAX_PRICE_PER_GPU_HOUR)
    preemptions_per_hour: NonNegativeFloat | None = Field(
        default=None, le=MAX_PREEMPTIONS_PER_HOUR, description="expected preemptions of one spot node per hour")
    notice_s: NonNegativeFloat = Field(default=0.0, le=MAX_NOTICE_S,
                                       description="warning before a spot preemption, seconds (AWS 120, GCP 30)")

    @model_validator(mode="after")
    def _markets(self) -> OfferSpec:
        if self.on_demand_price_per_gpu_hour is None and self.spot_price_per_gpu_hour is None:
            raise _FieldError("on_demand_price_per_gpu_hour",
                              "expected a price on demand or on the spot market (spot_price_per_gpu_hour), got neither")
        if self.spot_price_per_gpu_hour is not None and self.preemptions_per_hour is None:
            raise _FieldError("preemptions_per_hour", "is required with spot_price_per_gpu_hour (a spot market "
                                                      "without a preemption rate cannot be priced)")
        return self

    @property
    def markets(self) -> tuple[Market, ...]:
        return tuple(m for m, price in (("on_demand", self.on_demand_price_per_gpu_hour),
                                        ("spot", self.spot_price_per_gpu_hour)) if price is not None)

    def price_per_gpu_hour(self, market: Market) -> float:
        price = self.spot_price_per_gpu_hour if market == "spot" else self.on_demand_price_per_gpu_hour
        if price is None:
            raise HetrainError(f"offer '{self.name}' has no {market.replace('_', '-')} price")
        return price


class OffersSpec(_Spec):
    name: str
    zones: list[ZoneSpec] = Field(min_length=1)
    offers: list[OfferSpec] = Field(min_length=1, max_length=MAX_OFFERS)
    zone_links: list[ZoneLinkSpec] = Field(default_factory=list)
    inter_zone_bandwidth_gbps: PositiveFloat = Field(
        default=DEFAULT_INTER_ZONE_GBPS, le=MAX_LINK_GBPS,
        description="GB/s between nodes of two zones that no zone_links entry joins")
    collective_latency_us: NonNegativeFloat = Field(default=0.0, le=MAX_LATENCY_US, description="as in the cluster file")
    gpu_types: dict[str, GPUType] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_references(self) -> OffersSpec:
        zones = _unique(self.zones, "zones")
        _unique(self.offers, "offers")
        for i, offer in enumerate(self.offers):
            if offer.gpu not in self.gpu_types and offer.gpu not in CATALOG:
                known = ", ".join(sorted(set(CATALOG) | set(self.gpu_types)))
                raise _FieldError(f"offers[{i}].gpu", f"unknown GPU type '{offer.gpu}'; expected one of {known} "
                                                      "or a type defined under gpu_types")
            if offer.zone not in zones:
                raise _FieldError(f"offers[{i}].zone", f"expected one of the zones {', '.join(zones)}, "
                                                       f"got '{offer.zone}'")
        for i, link in enumerate(self.zone_links):
            for end in link.zones:
                if end not in zones:
                    raise _FieldError(f"zone_links[{i}].zones", f"expected names of zones in this file, got '{end}'")
            if link.zones[0] == link.zones[1]:
                raise _FieldError(f"zone_links[{i}].zones",
                                  "expected two different zones (a zone's own is inter_node_bandwidth_gbps)")
        return self

    def offer(self, name: str) -> OfferSpec:
        for o in self.offers:
            if o.name == name:
                return o
        raise HetrainError(f"no offer named '{name}' in offers '{self.name}'")

    def zone_bandwidth_gbps(self, zone_a: str, zone_b: str) -> float:
        """GB/s between a node in ``zone_a`` and one in ``zone_b``."""
        if zone_a == zone_b:
            return next(z.inter_node_bandwidth_gbps for z in self.zones if z.name == zone_a)
        for link in self.zone_links:
            if set(link.zones) == {zone_a, zone_b}:
                return link.bandwidth_gbps
        return self.inter_zone_bandwidth_gbps


def _unique(items: list, field: str) -> list[str]:
    names: list[str] = []
    for i, item in enumerate(items):
        if item.name in names:
            raise _FieldError(f"{field}[{i}].name", f"expected a unique name, got duplicate '{item.name}'")
        names.append(item.name)
    return names


def load_offers(path: str | Path) -> OffersSpec:
    """The offers file at ``path``; one line when it is past the limits above (the size before it is read)."""
    p = Path(path)
    size = p.stat().st_size if p.is_file() else 0
    if size > MAX_OFFERS_BYTES:
        raise HetrainError(f"{p}: {size / 1e6:.1f} MB is past the limit of an offers file ({MAX_OFFERS_BYTES >> 20} MB: "
                           f"at most {MAX_OFFERS} offers of {MAX_OFFER_GPU_TYPES} GPU types); wrong file?")
    spec = parse_spec(OffersSpec, load_yaml(p), str(p))
    types = {o.gpu for o in spec.offers} | set(spec.gpu_types)
    if len(types) > MAX_OFFER_GPU_TYPES:
        raise HetrainError(f"{p}: gpu_types: {len(types)} GPU types offered or defined, at most "
                           f"{MAX_OFFER_GPU_TYPES} (the planner probes each one)")
    return spec


@dataclass(frozen=True)
class Rental:
    """``nodes`` nodes of one offer on one market."""

    offer: str
    market: Market
    nodes: int


def node_names(rental: Rental) -> list[str]:
    tag = "spot" if rental.market == "spot" else "od"
    return [f"{rental.offer}-{tag}-{i}" for i in range(rental.nodes)]


def cluster_from_rental(offers: OffersSpec, rentals: list[Rental] | tuple[Rental, ...],
                        name: str | None = None) -> ClusterSpec:
    """The cluster file of a rental: a node per rented node, carrying its market, price, preemption rate and notice.

    Nodes in one zone talk at the zone's bandwidth; across zones at the zones' link. The cluster's
    default inter-node bandwidth is the slowest of these; faster pairs are written as links while
    there are at most ``MAX_EXACT_LINK_PAIRS`` of them.
    """
    _check_rental(offers, rentals)
    nodes, zone_of = [], {}
    for r in rentals:
        if r.nodes <= 0:
            continue
        offer = offers.offer(r.offer)
        spot = r.market == "spot"
        for node in node_names(r):
            zone_of[node] = offer.zone
            nodes.append({"name": node, "gpu": offer.gpu, "count": offer.gpus_per_node,
                          "intra_node_bandwidth_gbps": offer.intra_node_bandwidth_gbps, "nics": offer.nics,
                          "spot": spot, "price_per_gpu_hour": offer.price_per_gpu_hour(r.market),
                          **({"preemptions_per_hour": offer.preemptions_per_hour, "notice_s": offer.notice_s}
                             if spot else {})})
    if not nodes:
        raise HetrainError("a rental of no nodes is no cluster")
    zones = sorted(set(zone_of.values()))
    speeds = {(a, b): offers.zone_bandwidth_gbps(a, b) for a in zones for b in zones if a <= b}
    slowest = min(speeds.values())
    links = []
    fast_pairs = [(a, b) for (a, b), bw in speeds.items() if bw > slowest]
    by_zone = {z: [n for n, zn in zone_of.items() if zn == z] for z in zones}
    pair_count = sum(len(by_zone[a]) * (len(by_zone[b]) - (a == b)) // (2 if a == b else 1) for a, b in fast_pairs)
    if pair_count <= MAX_EXACT_LINK_PAIRS:
        for a, b in fast_pairs:
            ends = [(x, y) for i, x in enumerate(by_zone[a]) for y in (by_zone[b][i + 1:] if a == b else by_zone[b])]
            links += [{"nodes": [x, y], "bandwidth_gbps": speeds[(a, b)]} for x, y in ends]
    gpu_types = {g: t for g, t in offers.gpu_types.items() if any(n["gpu"] == g for n in nodes)}
    return ClusterSpec.model_validate({
        "name": name or f"{offers.name}-rental", "nodes": nodes, "inter_node_bandwidth_gbps": slowest,
        "links": links, "collective_latency_us": offers.collective_latency_us, "gpu_types": gpu_types})


def _check_rental(offers: OffersSpec, rentals) -> None:
    """HetrainError unless every rental names an offer, a market it has, and no more nodes than it has in all."""
    taken: dict[str, int] = {}
    for r in rentals:
        offer = offers.offer(r.offer)
        offer.price_per_gpu_hour(r.market)
        taken[r.offer] = taken.get(r.offer, 0) + r.nodes
        if taken[r.offer] > offer.nodes_available:
            raise HetrainError(f"offer '{r.offer}': {taken[r.offer]} nodes rented, "
                               f"{offer.nodes_available} available")


def rental_of_cluster(cluster: ClusterSpec) -> list[Rental]:
    """The rental a cluster of ``cluster_from_rental`` came from (its node names say it)."""
    counts: dict[tuple[str, Market], int] = {}
    for node in cluster.nodes:
        offer, tag, _ = node.name.rsplit("-", 2)
        market: Market = "spot" if tag == "spot" else "on_demand"
        counts[(offer, market)] = counts.get((offer, market), 0) + 1
    return [Rental(o, m, n) for (o, m), n in counts.items()]


def cluster_yaml(cluster: ClusterSpec, header: str) -> str:
    """A cluster as the text of a cluster file, ``header`` as a comment on its first line."""
    body = yaml.safe_dump(cluster.model_dump(mode="json", exclude_defaults=True, exclude_none=True), sort_keys=False)
    return f"# {header}\n{body}"
