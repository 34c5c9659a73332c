"""Specs: the cluster, the model and the training settings, as pydantic models loaded from YAML.

Every loading error becomes one ``HetrainError`` line naming the file, the field and what
was expected, e.g. ``clusters/x.yaml: nodes[1].count: expected an integer >= 1, got -2``.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from hetrain.errors import HetrainError
from hetrain.files import parse_yaml, read_text
from hetrain.spec.catalog import CATALOG, MAX_GPU_MEMORY_GB, GPUType

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
GB = 1e9  # every *_gb in hetrain is decimal gigabytes, as GPU datasheets count them

# Sizes no one can mean. Beyond them a typo (an extra zero, a count of bytes for GPUs) would not
# fail but hang: the planner would enumerate billions of devices, a run would allocate a
# batch no machine holds. Each limit is far above anything trained today.
MAX_GPUS_PER_NODE = 1024  # the largest single NVLink domains have 256 GPUs (GH200 NVL256)
MAX_CLUSTER_GPUS = 65536  # the largest training clusters are ~100k GPUs split over jobs
MAX_LAYERS = 1024  # the deepest LLMs have ~130 blocks
MAX_HIDDEN_SIZE = 1 << 17  # 131072; the widest LLMs use ~25k
MAX_HEADS = 1024
MAX_SEQ_LENGTH = 1 << 22  # 4M tokens; the longest-context models train at 1M
MAX_VOCAB_SIZE = 1 << 22  # 4M ids; the largest vocabularies have ~256k
MAX_GLOBAL_BATCH = 1 << 20  # sequences per step; Llama 3 405B used ~2k sequences of 8k tokens
MAX_MICRO_BATCH = 4096  # sequences per micro-batch
MAX_TP_DEGREE = 64


MAX_LINK_GBPS = 1e6  # GB/s of one link: NVLink 5 is 1.8 TB/s per GPU; a million is a typo
MAX_LATENCY_US = 1e7  # ten seconds for one message: a link that slow is down
MAX_SLOWDOWN = 1e4  # an emulated device ten thousand times slower than the CPU would never finish a step
MAX_PRICE_PER_GPU_HOUR = 1e4  # dollars; the dearest cloud GPUs rent for about 10
MAX_PREEMPTIONS_PER_HOUR = 3600.0  # one a second: a spot GPU gone faster than that never trains a step
MAX_NOTICE_S = 86400.0  # clouds warn 30 s (GCP) to 2 min (AWS); a day ahead is a maintenance window
MAX_BYTES_PER_PARAM = 64.0  # fp32 weights, gradients and three fp32 optimizer moments are 20
MAX_ROPE_THETA = 1e12  # Llama 3 uses 5e5; long-context models a few million


def _numbers_only(annotation) -> bool:
    """Whether a field takes numbers and no bool (``num_layers: true`` must not read as one layer)."""
    if annotation is bool:
        return False
    if annotation in (int, float):
        return True
    args = get_args(annotation)
    if get_origin(annotation) is Annotated:
        return _numbers_only(args[0])
    if get_origin(annotation) in (Union, UnionType):
        return any(_numbers_only(a) for a in args if a is not type(None)) and bool not in args
    if get_origin(annotation) is list and args:
        return _numbers_only(args[0])
    return False


class _Spec(BaseModel):
    # No infinity or NaN anywhere in a spec: the cost model divides by these numbers.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML's ``true`` is no count: pydantic would take it as 1."""
        field = cls.model_fields.get(info.field_name)
        items = value if isinstance(value, list) else [value]
        if field is not None and any(isinstance(v, bool) for v in items) and _numbers_only(field.annotation):
            raise ValueError(f"expected a number, got {value!r}")
        return value


# --------------------------------------------------------------------------- cluster


class EmulateSpec(_Spec):
    """Make a CPU node act like a slower, smaller GPU (tests and benchmarks on one machine).

    The runtime stretches the node's stage compute by ``slowdown`` and stops with an
    out-of-memory error naming the device when it needs more than ``memory_gb``. Ignored on GPUs.
    """

    slowdown: float = Field(default=1.0, ge=1.0, le=MAX_SLOWDOWN, description="compute takes this many times longer")
    memory_gb: PositiveFloat | None = Field(default=None, le=MAX_GPU_MEMORY_GB, description="memory budget per device, GB")


class NodeSpec(_Spec):
    """One machine: ``count`` GPUs of one type joined by a link of ``intra_node_bandwidth_gbps`` GB/s."""

    name: str = Field(pattern=NAME_PATTERN)
    gpu: str
    count: PositiveInt = Field(le=MAX_GPUS_PER_NODE)
    intra_node_bandwidth_gbps: PositiveFloat = Field(le=MAX_LINK_GBPS, description="GB/s between two GPUs of this node")
    spot: bool = False
    price_per_gpu_hour: NonNegativeFloat | None = Field(default=None, le=MAX_PRICE_PER_GPU_HOUR)
    preemptions_per_hour: NonNegativeFloat | None = Field(
        default=None, le=MAX_PREEMPTIONS_PER_HOUR,
        description="a spot node's expected preemptions per hour (its offer's rate); absent: unknown, taken as 0")
    notice_s: NonNegativeFloat | None = Field(
        default=None, le=MAX_NOTICE_S, description="how long before a preemption the cloud warns (seconds)")
    emulate: EmulateSpec | None = None
    nics: Literal["one", "per_gpu"] = Field(
        default="one",
        description="one: the node's GPUs share one network link to other nodes (what they send to other "
        "nodes at once splits inter_node_bandwidth_gbps); per_gpu: each GPU has a NIC of that bandwidth "
        "(DGX-class nodes)")

    address: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=r"^[A-Za-z0-9][A-Za-z0-9.:_-]*$",
        description="host name or IP address the other nodes reach this node at (the rendezvous on the first "
        "node of a plan, peer servers); default: the node's name")

    @property
    def host(self) -> str:
        """Where other nodes reach this node."""
        return self.address or self.name

    @property
    def shares_nic(self) -> bool:
        return self.nics == "one" and self.count > 1


class LinkSpec(_Spec):
    """Bandwidth override for one pair of nodes (GB/s), e.g. two nodes in different racks."""

    nodes: tuple[str, str]
    bandwidth_gbps: PositiveFloat = Field(le=MAX_LINK_GBPS)


@dataclass(frozen=True)
class Device:
    """One GPU of the cluster, named ``<node>/<index>``."""

    name: str
    node: str
    index: int
    gpu: str


class ClusterSpec(_Spec):
    name: str
    nodes: list[NodeSpec] = Field(min_length=1)
    inter_node_bandwidth_gbps: PositiveFloat = Field(
        default=12.5, le=MAX_LINK_GBPS, description="GB/s between GPUs of two different nodes (12.5 GB/s = 100 Gb/s)"
    )
    links: list[LinkSpec] = Field(default_factory=list)
    collective_latency_us: NonNegativeFloat = Field(
        default=0.0, le=MAX_LATENCY_US,
        description="fixed cost in microseconds of a send, or of a collective between two GPUs, on top of "
        "bytes / bandwidth; a collective among p GPUs pays it ceil(log2 p) times (tens of us for NCCL, "
        "milliseconds for gloo on a busy CPU; 0 ignores it, fine for large models)",
    )
    gpu_types: dict[str, GPUType] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_references(self) -> ClusterSpec:
        total = sum(n.count for n in self.nodes)
        if total > MAX_CLUSTER_GPUS:
            raise _FieldError("nodes", f"expected at most {MAX_CLUSTER_GPUS} GPUs in all, got {total}")
        seen: set[str] = set()
        for i, node in enumerate(self.nodes):
            if node.name in seen:
                raise _FieldError(f"nodes[{i}].name", f"expected a unique node name, got duplicate '{node.name}'")
            seen.add(node.name)
            if node.gpu not in self.gpu_types and node.gpu not in CATALOG:
                known = ", ".join(sorted(set(CATALOG) | set(self.gpu_types)))
                raise _FieldError(
                    f"nodes[{i}].gpu",
                    f"unknown GPU type '{node.gpu}'; expected one of {known} or a type defined under gpu_types",
                )
        for i, link in enumerate(self.links):
            for end in link.nodes:
                if end not in seen:
                    raise _FieldError(f"links[{i}].nodes", f"expected names of nodes in this file, got '{end}'")
            if link.nodes[0] == link.nodes[1]:
                raise _FieldError(f"links[{i}].nodes", "expected two different nodes (use intra_node_bandwidth_gbps)")
        return self

    # ---- derived views (not part of the file format)

    @property
    def default_precision(self) -> Literal["bf16", "fp32"]:
        """The number format a run plans and trains in when the user names none: the one rule, for ``hetrain
        plan``, the Python API and the flows. fp32 where every node is an emulated (CPU) device: a CPU has no
        bf16 matrix units, so bf16 there is slower and no closer to a GPU's numerics; bf16 on GPUs (a type
        without bf16 tensor cores computes in fp16, per stage: ``GPUType.format_for``)."""
        return "fp32" if all(n.emulate is not None for n in self.nodes) else "bf16"

    def gpu_type(self, name: str) -> GPUType:
        return self.gpu_types.get(name) or CATALOG[name]

    @cached_property
    def node_by_name(self) -> dict[str, NodeSpec]:
        return {n.name: n for n in self.nodes}

    @cached_property
    def _link_overrides(self) -> dict[frozenset[str], float]:
        return {frozenset(link.nodes): link.bandwidth_gbps for link in self.links}

    def bandwidth_gbps(self, node_a: str, node_b: str) -> float:
        """GB/s between a GPU on ``node_a`` and one on ``node_b`` (intra-node when they are the same)."""
        if node_a == node_b:
            return self.node_by_name[node_a].intra_node_bandwidth_gbps
        return self._link_overrides.get(frozenset((node_a, node_b)), self.inter_node_bandwidth_gbps)

    def min_bandwidth_gbps(self, nodes: set[str] | frozenset[str]) -> float:
        """Slowest link among a set of nodes: what a ring collective over GPUs on them runs at."""
        nodes = frozenset(nodes)
        if len(nodes) == 1:
            (only,) = nodes
            return self.bandwidth_gbps(only, only)
        inside = [bw for pair, bw in self._link_overrides.items() if pair <= nodes]
        pairs = len(nodes) * (len(nodes) - 1) // 2
        if len(inside) < pairs:  # some pair uses the default inter-node link
            inside.append(self.inter_node_bandwidth_gbps)
        return min(inside)

    def has_link_override(self, node: str) -> bool:
        return any(node in pair for pair in self._link_overrides)

    @cached_property
    def devices(self) -> list[Device]:
        return [Device(f"{n.name}/{i}", n.name, i, n.gpu) for n in self.nodes for i in range(n.count)]

    @cached_property
    def device_by_name(self) -> dict[str, Device]:
        return {d.name: d for d in self.devices}

    @cached_property
    def node_of(self) -> dict[str, str]:
        """Device name -> its node's name (the cost model looks it up for every stage it prices)."""
        return {d.name: d.node for d in self.devices}

    @property
    def num_devices(self) -> int:
        return sum(n.count for n in self.nodes)

    def total_memory_gb(self) -> float:
        return sum(n.count * self.gpu_type(n.gpu).memory_gb for n in self.nodes)


# --------------------------------------------------------------------------- model


LLAMA_ONLY = ("num_kv_heads", "rope_theta", "norm_eps", "tie_embeddings", "head_size", "qkv_bias", "qk_norm",
              "rope_scaling", "sliding_window", "family")
DEFAULT_ROPE_THETA = 10_000.0  # Llama 2's; Llama 3 files say 500000
DEFAULT_NORM_EPS = 1e-5
LLAMA_FFN_MULTIPLE = 256  # Llama rounds its default SwiGLU width (8/3 of hidden) up to a multiple of this
# The transformers families the Llama block runs (``hetrain.spec.hf`` maps each to its switches)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class RopeScaling(_Spec):
    """Llama 3.1's rotary scaling (transformers' ``rope_type: llama3``): wavelengths longer than the
    original context over ``low_freq_factor`` are stretched ``factor`` times, those shorter than it over
    ``high_freq_factor`` kept, the ones between blended; how Llama 3.1 reads 128k tokens after 8k training."""

    type: Literal["llama3"] = Field(default="llama3", description="transformers' rope_type")
    factor: PositiveFloat = Field(le=1e4, description="how many times the long wavelengths are stretched")
    low_freq_factor: PositiveFloat = Field(default=1.0, le=1e4, description="wavelengths longer than the original "
                                                                             "context over this are stretched")
    high_freq_factor: PositiveFloat = Field(default=4.0, le=1e4, description="wavelengths shorter than the original "
                                                                              "context over this are kept")
    original_max_position_embeddings: PositiveInt = Field(le=MAX_SEQ_LENGTH, description="the context the model "
                                                                                          "was first trained at")

    @model_validator(mode="after")
    def _ordered(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:  # the blend divides by their difference
            raise _FieldError("high_freq_factor", f"expected more than low_freq_factor {self.low_freq_factor}, "
                                                  f"got {self.high_freq_factor}")
        return self


class ModelSpec(_Spec):
    """A decoder-only transformer: ``num_layers`` blocks between a token embedding and an LM head.

    ``arch: gpt`` (the default, so files without it keep their meaning): LayerNorm, a GELU MLP
    ``4 x hidden`` wide, learned positions, multi-head attention. ``arch: llama`` (Llama 2/3,
    Mistral, Qwen 2/2.5/3): RMSNorm, a SwiGLU MLP, rotary positions (``rope_theta``), grouped-query
    attention with ``num_kv_heads`` key/value heads (default ``num_heads``: plain multi-head). The
    families differ by switches of that one block: ``qkv_bias`` (Qwen 2), ``qk_norm`` (Qwen 3),
    ``head_size`` (Qwen 3, Mistral Nemo), ``rope_scaling`` (Llama 3.1/3.2), ``tie_embeddings``
    (Llama 3.2 1B/3B, small Qwens). ``family`` names the transformers class an export is written as.
    """

    name: str
    arch: Literal["gpt", "llama"] = "gpt"
    family: Literal["llama", "mistral", "qwen2", "qwen3"] | None = Field(
        default=None, description="the transformers family an export is written as (default: the one the "
                                  "switches make: qwen3 with qk_norm, qwen2 with qkv_bias, else llama)")
    num_layers: PositiveInt = Field(le=MAX_LAYERS)
    hidden_size: PositiveInt = Field(le=MAX_HIDDEN_SIZE)
    num_heads: PositiveInt = Field(le=MAX_HEADS)
    seq_length: PositiveInt = Field(le=MAX_SEQ_LENGTH)
    vocab_size: PositiveInt = Field(le=MAX_VOCAB_SIZE)
    ffn_hidden_size: PositiveInt | None = Field(default=None, le=4 * MAX_HIDDEN_SIZE)
    num_kv_heads: PositiveInt | None = Field(default=None, le=MAX_HEADS)
    head_size: PositiveInt | None = Field(default=None, le=MAX_HIDDEN_SIZE,
                                          description="width of one attention head (default hidden_size / num_heads)")
    rope_theta: PositiveFloat | None = Field(default=None, le=MAX_ROPE_THETA)
    rope_scaling: RopeScaling | None = Field(default=None, description="Llama 3.1's rotary scaling (none: plain)")
    norm_eps: PositiveFloat | None = Field(default=None, lt=1.0)
    qkv_bias: bool | None = Field(default=None, description="a bias on the query, key and value projections")
    qk_norm: bool | None = Field(default=None, description="RMSNorm over each query and key head, before rotary")
    sliding_window: PositiveInt | None = Field(default=None, le=MAX_SEQ_LENGTH,
                                               description="the model's attention window (at least seq_length)")
    tie_embeddings: bool | None = Field(default=None, description="the LM head is the token embedding's weight")

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> ModelSpec:
        if self.head_size is None and self.hidden_size % self.num_heads:
            raise _FieldError(
                "num_heads", f"expected a divisor of hidden_size {self.hidden_size}, got {self.num_heads}"
            )
        if self.arch == "gpt":
            given = [f for f in LLAMA_ONLY if getattr(self, f) is not None]
            if given:
                raise _FieldError(given[0], "only for arch: llama (this model is arch: gpt)")
            return self
        if self.num_heads % self.kv_heads:
            raise _FieldError("num_kv_heads", f"expected a divisor of num_heads {self.num_heads}, "
                                              f"got {self.num_kv_heads}")
        if self.head_dim % 2:
            where = "head_size" if self.head_size else "num_heads"
            raise _FieldError(where, f"rotary positions need an even head size: hidden_size {self.hidden_size}, "
                                     f"num_heads {self.num_heads}, head size {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < self.seq_length:
            raise _FieldError("sliding_window", f"expected at least seq_length {self.seq_length} (sliding-window "
                                                f"attention is not supported), got {self.sliding_window}")
        return self

    def tp_divides(self, tp: int) -> bool:
        """Whether ``tp`` ranks can split this model's heads (query and key/value) and hidden size evenly."""
        return tp >= 1 and self.hidden_size % tp == 0 and self.num_heads % tp == 0 and self.kv_heads % tp == 0

    def split_sizes(self) -> str:
        """What a TP degree must divide, for messages: ``hidden_size 4096, num_heads 32 and num_kv_heads 8``."""
        kv = f" and num_kv_heads {self.kv_heads}" if self.kv_heads != self.num_heads else ""
        return f"hidden_size {self.hidden_size}{',' if kv else ' and'} num_heads {self.num_heads}{kv}"

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.arch == "llama":
            return -(-int(8 * self.hidden_size / 3) // LLAMA_FFN_MULTIPLE) * LLAMA_FFN_MULTIPLE
        return 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        """One attention head's width: ``head_size`` where the model sets it, else ``hidden_size / num_heads``."""
        return self.head_size or self.hidden_size // self.num_heads

    @property
    def q_size(self) -> int:
        """Width of the query projection (and of the attention output ``wo`` reads)."""
        return self.num_heads * self.head_dim

    @property
    def tied(self) -> bool:
        """Whether the LM head is the token embedding's weight (one tensor, ``hetrain.runtime.tied``)."""
        return bool(self.tie_embeddings)

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``num_kv_heads`` (grouped-query attention), else one per query head."""
        return self.num_kv_heads or self.num_heads

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection."""
        return self.kv_heads * self.head_dim

    @property
    def rope_base(self) -> float:
        return self.rope_theta or DEFAULT_ROPE_THETA

    @property
    def eps(self) -> float:
        return self.norm_eps or DEFAULT_NORM_EPS


# --------------------------------------------------------------------------- training settings


RecomputeMode = Literal["none", "selective", "full"]
RecomputeSetting = Literal["auto", "none", "selective", "full"]
# Least recompute (fastest, most memory) first: the order in which the planner tries them.
RECOMPUTE_MODES: tuple[RecomputeMode, ...] = ("none", "selective", "full")
# Where a stage keeps its layers' AdamW state: every replica the whole of it (replicated), 1/D of it
# across the D replicas of each layer (sharded: ZeRO-1, the gradient all-reduce becomes a
# reduce-scatter and a parameter all-gather), or its share in host memory, the step on the CPU (offloaded).
OptimizerStateMode = Literal["replicated", "sharded", "offloaded"]
OPTIMIZER_STATE_MODES: tuple[OptimizerStateMode, ...] = ("replicated", "sharded", "offloaded")


class TrainingSettings(_Spec):
    """What the planner may vary and what it must respect, besides the hardware."""

    global_batch_size: PositiveInt = Field(le=MAX_GLOBAL_BATCH, description="sequences per optimizer step")
    micro_batch_sizes: list[Annotated[int, Field(ge=1, le=MAX_MICRO_BATCH)]] = Field(default=[1, 2, 4], min_length=1,
                                                                                       max_length=64)
    tp_degrees: list[Annotated[int, Field(ge=1, le=MAX_TP_DEGREE)]] = Field(default=[1, 2, 4, 8], min_length=1,
                                                                              max_length=64)
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    # Absent (None) is bf16's policy, so the plans of everyone who never asks keep their bytes.
    formats: Literal["bf16", "fastest"] | None = Field(
        default=None, description="number-format policy: bf16 (absent): every stage in `precision` where its GPU "
        "has it (fp16 where a type has no bf16 tensor cores); fastest: besides, fp8 on the stages whose GPU type has "
        "fp8 tensor cores (its catalog fp8_tflops) and that run without tensor parallelism, bf16 around the blocks' "
        "fp8 linear layers")
    bytes_per_param: PositiveFloat = Field(
        default=16.0, le=MAX_BYTES_PER_PARAM,
        description="weights + gradients + optimizer state per parameter; mixed-precision Adam: "
        "2 (16-bit weights) + 2 (16-bit grads) + 4 (fp32 master) + 4 + 4 (Adam moments) = 16",
    )
    activation_recompute: RecomputeSetting = Field(
        default="auto",
        description="which activations blocks recompute in backward: 'auto' lets the planner pick per stage "
        "(none where memory allows, else selective, else full); one mode applies it to every stage. "
        "true/false, from files written before per-stage recompute, read as 'auto'/'none'")
    grad_reduce: Literal["fp32", "bf16"] = Field(
        default="fp32", description="dtype of the data-parallel gradient all-reduce (gradients are held in fp32)")
    framework_reserve_gb: NonNegativeFloat = Field(
        default=2.0, le=MAX_GPU_MEMORY_GB, description="per-GPU memory held by CUDA context, allocator and communication buffers"
    )

    @field_validator("activation_recompute", mode="before")
    @classmethod
    def _recompute_from_bool(cls, v):
        if isinstance(v, bool):
            return "auto" if v else "none"
        return v

    @field_validator("formats")
    @classmethod
    def _bf16_policy_unwritten(cls, v: str | None) -> str | None:
        """bf16's policy, given or not, is absent: a plan made with it keeps the bytes it had before policies."""
        return None if v == "bf16" else v

    @property
    def format_policy(self) -> Literal["bf16", "fastest"]:
        return self.formats or "bf16"

    @property
    def recompute_modes(self) -> tuple[RecomputeMode, ...]:
        """The modes a planner may choose from, least recompute first."""
        return RECOMPUTE_MODES if self.activation_recompute == "auto" else (self.activation_recompute,)

    def stage_recompute(self, recorded: RecomputeMode | None) -> RecomputeMode:
        """The mode a stage runs: the plan's record, else one for every stage.

        A plan written before per-stage recompute records none: with recompute allowed those plans
        recomputed every block fully, so 'auto' reads as 'full' there.
        """
        if recorded is not None:
            return recorded
        return "full" if self.activation_recompute == "auto" else self.activation_recompute

    @field_validator("tp_degrees")
    @classmethod
    def _powers_of_two(cls, v: list[int]) -> list[int]:
        bad = [t for t in v if t & (t - 1)]
        if bad:
            raise ValueError(f"expected powers of two, got {bad[0]}")
        return sorted(set(v))

    @field_validator("micro_batch_sizes")
    @classmethod
    def _sorted(cls, v: list[int]) -> list[int]:
        return sorted(set(v))

    @property
    def activation_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    def check_batch(self, micro_batch_size: int) -> None:
        if self.global_batch_size % micro_batch_size:
            raise HetrainError(
                f"global batch size {self.global_batch_size} is not divisible by micro-batch size {micro_batch_size}"
            )

    @classmethod
    def for_search(cls, where: str, global_batch_size: int, *, micro_batch_size: int | None = None,
                   tp: list[int] | tuple[int, ...] | None = None, **fields) -> TrainingSettings:
        """The settings a plan is searched under, from a user's choices (``hetrain plan``'s flags, ``hetrain.plan``'s
        arguments): a fixed ``micro_batch_size`` and ``tp`` degrees narrow the search, ``fields`` are the other
        settings; a bad value is one line naming ``where`` and the field, a micro-batch that does not divide the
        batch one line too."""
        from pydantic import ValidationError

        if micro_batch_size is not None:
            fields["micro_batch_sizes"] = [micro_batch_size]
        if tp is not None:
            fields["tp_degrees"] = list(tp)
        try:
            settings = cls(global_batch_size=global_batch_size, **fields)
        except ValidationError as e:
            raise HetrainError(describe_validation_error(where, e)) from None
        if micro_batch_size is not None:
            settings.check_batch(micro_batch_size)
        return settings


# --------------------------------------------------------------------------- loading

S = TypeVar("S", bound=BaseModel)


class _FieldError(ValueError):
    """Raised inside validators so the message can name the exact field path."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


def _loc_to_str(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:  # a key from the file as it is when plain, quoted when it holds anything odd (a newline, a dot)
            key = str(part)
            out += ("." if out else "") + (key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else repr(key))
    return out or "(top level)"


_PYDANTIC_HINTS = {
    "missing": "is required",
    "extra_forbidden": "is not a known field",
}
_PYDANTIC_BOUNDS = {  # error type -> (words, ctx key)
    "less_than_equal": ("at most", "le"), "less_than": ("less than", "lt"),
    "greater_than_equal": ("at least", "ge"), "greater_than": ("more than", "gt"),
}


def describe_validation_error(source: str, err: ValidationError) -> str:
    """First error of a pydantic ValidationError as one line naming source and field.

    An unknown key comes first, with the required field it may be a typo of: a misspelt
    ``num_layer:`` is also a missing ``num_layers``, and naming only the missing one hides the typo.
    """
    errors = err.errors()
    unknown = [e for e in errors if e["type"] == "extra_forbidden"]
    first = unknown[0] if unknown else errors[0]
    ctx_err = (first.get("ctx") or {}).get("error")
    if isinstance(ctx_err, _FieldError):
        where, what = ctx_err.field, ctx_err.message
        prefix = _loc_to_str(first["loc"])
        if prefix != "(top level)":
            where = f"{prefix}.{where}"
    else:
        where = _loc_to_str(first["loc"])
        kind = first["type"]
        ctx = first.get("ctx") or {}
        if kind in _PYDANTIC_HINTS:
            what = _PYDANTIC_HINTS[kind]
        elif kind in _PYDANTIC_BOUNDS:
            words, key = _PYDANTIC_BOUNDS[kind]
            what = f"expected {words} {ctx[key]}, got {first.get('input')!r}"
        else:
            msg = re.sub(r"^Value error, ", "", first["msg"])
            what = f"expected {msg[0].lower() + msg[1:]}" if not msg.lower().startswith("expected") else msg
            if "input" in first and kind not in ("missing",) and ", got " not in what:  # unless the check said it
                what += f", got {first['input']!r}"
    if unknown:
        missing = [str(e["loc"][-1]) for e in errors if e["type"] == "missing" and e["loc"][:-1] == first["loc"][:-1]]
        close = difflib.get_close_matches(str(first["loc"][-1]), missing, n=1)
        if close:
            what += f" (did you mean {close[0]}?)"
    more = len(errors) - 1
    tail = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    return f"{source}: {where}: {what}{tail}"


def load_yaml(path: str | Path) -> Any:
    return parse_yaml(read_text(path), str(path))


def parse_spec(cls: type[S], data: Any, source: str) -> S:
    if not isinstance(data, dict):
        raise HetrainError(f"{source}: expected a mapping of fields at the top level, got {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise HetrainError(describe_validation_error(source, e)) from None


def load_cluster(path: str | Path) -> ClusterSpec:
    return parse_spec(ClusterSpec, load_yaml(path), str(path))


def load_model(path: str | Path) -> ModelSpec:
    return parse_spec(ModelSpec, load_yaml(path), str(path))
