"""Who does what: a plan turned into ranks, process groups and gradient buckets.

Pure bookkeeping, no torch.distributed: the launcher uses it to count processes per node,
every worker uses it to find its role and to create the same groups in the same order.

Ranks are numbered node by node (nodes in order of first appearance in the plan, devices by
index within a node), which is how ``accelerate launch`` / ``torchrun`` number the processes
of multi-node jobs: node ``k`` runs ranks ``[offset_k, offset_k + count_k)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetrain.plan.schema import Plan


@dataclass(frozen=True)
class Role:
    """One rank's place in the plan."""

    rank: int
    device: str
    node: str
    pipeline: int
    stage: int
    tp_rank: int
    layers: tuple[int, int]  # its first chunk's blocks (its only one unless interleaved)
    num_stages: int  # the pipeline's depth: its stages of devices
    num_microbatches: int
    # interleaved 1F1B: (global stage index, blocks) of each chunk the rank runs, in model order; () otherwise
    chunks: tuple[tuple[int, tuple[int, int]], ...] = ()

    @property
    def chunk_layers(self) -> list[tuple[int, int]]:
        """The block ranges this rank holds, in model order."""
        return [layers for _, layers in self.chunks] or [self.layers]

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


@dataclass(frozen=True)
class SyncBucket:
    """Parameters one rank all-reduces with exactly the other ranks that hold them.

    ``layers`` is a half-open block range; ``embedding``/``head`` add the first/last stage's
    extra parameters. ``ranks`` holds one rank per pipeline, all with the same TP rank; except
    ``tied``: a tied model's one weight, held by every first and every last stage (Megatron's
    embedding group, across the pipelines too), whose gradients sum over all of them: the
    embedding's part from the first stages, the head's from the last, both on one-stage pipelines.
    """

    ranks: tuple[int, ...]
    layers: tuple[int, int]
    embedding: bool = False
    head: bool = False
    tied: bool = False


@dataclass
class Layout:
    plan: Plan
    roles: list[Role]
    nodes: dict[str, list[int]]  # node -> its ranks, in rank order
    tp_groups: list[tuple[int, ...]] = field(default_factory=list)  # one per stage
    pp_groups: list[tuple[int, ...]] = field(default_factory=list)  # one per (pipeline, tp rank)
    buckets: list[SyncBucket] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.roles)

    def buckets_of(self, rank: int) -> list[SyncBucket]:
        return [b for b in self.buckets if rank in b.ranks]

    def sync_groups(self) -> list[tuple[int, ...]]:
        """Distinct rank sets that all-reduce gradients, in a fixed order."""
        return list(dict.fromkeys(b.ranks for b in self.buckets))

    def tp_group_of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.tp_groups if rank in g)

    def pp_group_of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.pp_groups if rank in g)


def build_layout(plan: Plan) -> Layout:
    node_of = {d: d.split("/", 1)[0] for d in plan.devices()}
    nodes: dict[str, list[str]] = {}
    for dev in plan.devices():
        nodes.setdefault(node_of[dev], []).append(dev)
    order = [d for node in nodes.values() for d in sorted(node, key=lambda d: int(d.rsplit("/", 1)[1]))]
    rank_of = {d: r for r, d in enumerate(order)}

    roles: dict[int, Role] = {}
    tp_groups: list[tuple[int, ...]] = []
    stage_ranks: list[list[tuple[int, ...]]] = []  # [pipeline][stage] -> ranks by tp rank
    for p, pipe in enumerate(plan.pipelines):
        stage_ranks.append([])
        for s, stage in enumerate(pipe.stages):
            # TP rank = the order of the stage's ranks, whatever order the plan lists its devices in:
            # DTensor shards by the rank in the group (dist.new_group sorts its ranks), and pipeline
            # sends and gradient buckets pair ranks by TP rank
            ranks = tuple(sorted(rank_of[d] for d in stage.devices))
            stage_ranks[p].append(ranks)  # an interleaved pipeline's later chunks: their devices' ranks again
            if s >= pipe.depth:
                continue
            tp_groups.append(ranks)
            chunks = tuple((c, tuple(pipe.stages[c].layers)) for c in pipe.chunks_of(s)) if pipe.interleaved else ()
            for j, r in enumerate(ranks):
                dev = order[r]
                roles[r] = Role(
                    rank=r, device=dev, node=node_of[dev], pipeline=p, stage=s, tp_rank=j,
                    layers=tuple(stage.layers), num_stages=pipe.depth,
                    num_microbatches=pipe.num_microbatches, chunks=chunks,
                )
    pp_groups = [
        tuple(stages[s][j] for s in range(plan.pipelines[p].depth)) for p, stages in enumerate(stage_ranks)
        for j in range(plan.tp)
    ]
    return Layout(
        plan=plan,
        roles=[roles[r] for r in range(len(order))],
        nodes={n: [rank_of[d] for d in order if node_of[d] == n] for n in nodes},
        tp_groups=tp_groups,
        pp_groups=pp_groups,
        buckets=_buckets(plan, stage_ranks) if len(plan.pipelines) > 1 else _tied_buckets(plan, stage_ranks),
    )


def _tied_buckets(plan: Plan, stage_ranks: list[list[tuple[int, ...]]]) -> list[SyncBucket]:
    """Per TP rank, the bucket of a tied model's weight: the ranks of every first and last stage (none for an
    untied model, or one where each pipeline is one stage and the only one: the weight is one Parameter)."""
    if not plan.model.tied:
        return []
    out = []
    for j in range(plan.tp):
        holders = tuple(sorted({r for stages in stage_ranks for r in (stages[0][j], stages[-1][j])}))
        if len(holders) > 1:
            out.append(SyncBucket(holders, (0, 0), tied=True))
    return out


def _buckets(plan: Plan, stage_ranks: list[list[tuple[int, ...]]]) -> list[SyncBucket]:
    """Cut the blocks at every pipeline's stage boundary; merge neighbours with the same holders."""
    cuts = sorted({0, plan.model.num_layers} | {s.layers[0] for p in plan.pipelines for s in p.stages})

    def holders(layer: int, j: int) -> tuple[int, ...]:
        out = []
        for p, pipe in enumerate(plan.pipelines):
            s = next(i for i, st in enumerate(pipe.stages) if st.layers[0] <= layer < st.layers[1])
            out.append(stage_ranks[p][s][j])
        return tuple(out)

    buckets: list[SyncBucket] = []
    for j in range(plan.tp):
        first = tuple(stages[0][j] for stages in stage_ranks)
        last = tuple(stages[-1][j] for stages in stage_ranks)
        tied = [b for b in _tied_buckets(plan, stage_ranks) if first[0] in b.ranks]
        items = tied + [SyncBucket(first, (0, 0), embedding=True)]
        items += [SyncBucket(holders(lo, j), (lo, hi)) for lo, hi in zip(cuts, cuts[1:])]
        items.append(SyncBucket(last, (plan.model.num_layers,) * 2, head=True))
        merged: list[SyncBucket] = []
        for b in items:
            if merged and merged[-1].ranks == b.ranks:
                m = merged.pop()
                b = SyncBucket(b.ranks, (min(m.layers[0], b.layers[0]), max(m.layers[1], b.layers[1])),
                               m.embedding or b.embedding, m.head or b.head, m.tied or b.tied)
            merged.append(b)
        buckets += merged
    return buckets
