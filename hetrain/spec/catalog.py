"""Built-in GPU catalog: peak dense tensor throughput, memory and memory bandwidth.

All figures are the vendors' data-sheet numbers for dense math (the data sheets quote
"with sparsity" figures at twice these values; we halve those). ``tflops`` is FP16/BF16
tensor-core throughput with FP32 accumulate, ``fp32_tflops`` plain (non-tensor) FP32,
``fp8_tflops`` FP8 tensor-core throughput where a type has it (Ada and Hopper; absent elsewhere).
``memory_bandwidth_gbps`` is GB/s. Achievable throughput is ``tflops * efficiency``;
the default efficiency (0.5) is a typical model-FLOPs utilisation of well-tuned
Megatron-style training and can be overridden per type in the cluster file or
replaced entirely by a measured profile.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat


# Bounds far past any GPU there is (the H100 does 989 TFLOPS, the largest cards hold 192 GB at 8 TB/s): past
# them a value is a typo or an attack, and the cost model would divide by it or print "0 tokens/s".
MAX_TFLOPS = 1e5
MAX_GPU_MEMORY_GB = 1e4
MAX_MEMORY_BANDWIDTH_GBPS = 1e6
# fp8 runs where hetrain.runtime.fp8 runs it: the blocks' linear layers at tensor-parallel degree 1 (torchao's
# float8 under tensor parallelism needs its own parallel styles, not wired there yet), each only where
# torch._scaled_mm takes its matrices: both dimensions divisible by 16.
FP8_MAX_TP = 1
FP8_DIM_MULTIPLE = 16


class GPUType(BaseModel):
    """Performance and capacity of one GPU model."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    tflops: PositiveFloat = Field(le=MAX_TFLOPS, description="dense FP16/BF16 tensor TFLOPS")
    memory_gb: PositiveFloat = Field(le=MAX_GPU_MEMORY_GB, description="device memory in GB")
    memory_bandwidth_gbps: PositiveFloat = Field(le=MAX_MEMORY_BANDWIDTH_GBPS,
                                                 description="device memory bandwidth in GB/s")
    fp32_tflops: PositiveFloat | None = Field(default=None, le=MAX_TFLOPS,
                                              description="dense FP32 TFLOPS (for precision: fp32)")
    efficiency: float = Field(default=0.5, gt=0, le=1, description="achievable fraction of peak TFLOPS")
    bf16: bool = Field(default=True, description=(
        "bf16 on tensor cores (Ampere and later); false on Volta and Turing (V100, T4, RTX 20xx, Titan RTX), whose "
        "tensor cores run fp16 only: their stages compute in fp16 with loss scaling"))
    fp8_tflops: PositiveFloat | None = Field(default=None, le=MAX_TFLOPS, description=(
        "dense FP8 tensor TFLOPS (Ada and Hopper: L4, L40S, RTX 4090, H100, H200); absent where the type has no fp8 "
        "tensor cores. Under `--formats fastest` its stages' linear layers compute in fp8"))

    def format_for(self, precision: str, formats: str = "bf16", tp: int = 1) -> str:
        """The number format this GPU computes a stage in under the plan's precision and format policy: bf16
        where it has bf16 tensor cores, fp16 where it has only those (``tflops`` is then its fp16 figure), fp16
        and fp32 as asked; under the ``fastest`` policy fp8 (bf16 around its fp8 matmuls) where it has fp8
        tensor cores and the stage runs without tensor parallelism (``FP8_MAX_TP``): what the runtime can run."""
        if precision == "bf16" and not self.bf16:
            return "fp16"
        if precision == "bf16" and formats == "fastest" and self.fp8_tflops is not None and tp <= FP8_MAX_TP:
            return "fp8"
        return precision

    def achievable_flops(self, precision: str) -> float:
        """FLOP/s this GPU sustains on transformer math at the plan's precision (in ``format_for``'s format);
        ``fp8``: on its fp8 matmuls alone (what a stage in fp8 sustains: ``hetrain.cost.formats``)."""
        fmt = self.format_for(precision)
        if fmt == "fp8" and self.fp8_tflops is not None:
            peak = self.fp8_tflops
        else:
            peak = self.tflops if fmt != "fp32" else (self.fp32_tflops or self.tflops / 8)
        return peak * 1e12 * self.efficiency

    def without_tensor_cores_for(self, precision: str) -> GPUType:
        """This GPU if ``precision`` were forced on it where it has no tensor cores for it (bf16 on Volta and
        Turing runs on the CUDA cores, at about the fp32 rate): what a bf16-everywhere plan is priced at."""
        if self.format_for(precision) == precision:
            return self
        return self.model_copy(update={"tflops": self.fp32_tflops or self.tflops / 8, "bf16": True})


CATALOG: dict[str, GPUType] = {
    # NVIDIA A100 Tensor Core GPU data sheet (2021): BF16 312 TF dense; 40GB HBM2 1,555 GB/s; 80GB HBM2e 2,039 GB/s (SXM).
    "A100-40G": GPUType(tflops=312, memory_gb=40, memory_bandwidth_gbps=1555, fp32_tflops=19.5),
    "A100-80G": GPUType(tflops=312, memory_gb=80, memory_bandwidth_gbps=2039, fp32_tflops=19.5),
    # NVIDIA Tesla V100 data sheet (SXM2): 125 tensor TFLOPS, 15.7 FP32, 900 GB/s HBM2, 16 or 32 GB. Volta's tensor
    # cores run FP16 only (NVIDIA Volta architecture whitepaper: "mixed-precision FP16/FP32"): no BF16.
    "V100-16G": GPUType(tflops=125, memory_gb=16, memory_bandwidth_gbps=900, fp32_tflops=15.7, bf16=False),
    "V100-32G": GPUType(tflops=125, memory_gb=32, memory_bandwidth_gbps=900, fp32_tflops=15.7, bf16=False),
    # NVIDIA Ampere GA102 whitepaper, appendix A (GeForce RTX 3090): FP16 tensor with FP32 accumulate 71 TF dense
    # (142 with sparsity); 35.6 FP32; 24 GB GDDR6X at 936 GB/s.
    "RTX3090": GPUType(tflops=71, memory_gb=24, memory_bandwidth_gbps=936, fp32_tflops=35.6),
    # NVIDIA A10 data sheet: BF16 tensor 125 TF dense (250 sparse), 31.2 FP32, 24 GB GDDR6 600 GB/s. AWS's A10G
    # (g5 instances) uses the same GA102 part, memory and bandwidth and publishes no separate sheet; its lower
    # clocks are what the default efficiency and a measured profile absorb.
    "A10G": GPUType(tflops=125, memory_gb=24, memory_bandwidth_gbps=600, fp32_tflops=31.2),
    # NVIDIA L4 data sheet: BF16 tensor 242 TF with sparsity -> 121 dense; FP8 tensor 485 TF with sparsity -> 242.5
    # dense; 30.3 FP32; 24 GB at 300 GB/s.
    "L4": GPUType(tflops=121, memory_gb=24, memory_bandwidth_gbps=300, fp32_tflops=30.3, fp8_tflops=242.5),
    # NVIDIA T4 data sheet: 65 TF mixed precision FP16/FP32 (no BF16 on Turing); 8.1 FP32; 16 GB at 320 GB/s.
    "T4": GPUType(tflops=65, memory_gb=16, memory_bandwidth_gbps=320, fp32_tflops=8.1, bf16=False),
    # NVIDIA H100 data sheet: SXM BF16 1,979 TF with sparsity -> 989 dense, FP8 3,958 sparse -> 1,979 dense, 67 FP32,
    # 80 GB 3.35 TB/s; PCIe BF16 1,513 sparse -> 756 dense, FP8 3,026 sparse -> 1,513 dense, 51 FP32, 80 GB 2.0 TB/s.
    "H100-SXM": GPUType(tflops=989, memory_gb=80, memory_bandwidth_gbps=3350, fp32_tflops=67, fp8_tflops=1979),
    "H100-PCIe": GPUType(tflops=756, memory_gb=80, memory_bandwidth_gbps=2000, fp32_tflops=51, fp8_tflops=1513),
    # NVIDIA H200 data sheet: SXM BF16 1,979 TF with sparsity -> 989 dense, FP8 3,958 sparse -> 1,979 dense, 67 FP32
    # (the H100 SXM's compute), 141 GB HBM3e at 4.8 TB/s.
    "H200-SXM": GPUType(tflops=989, memory_gb=141, memory_bandwidth_gbps=4800, fp32_tflops=67, fp8_tflops=1979),
    # NVIDIA L40S data sheet: BF16 tensor 733 TF with sparsity -> 366 dense; FP8 tensor 1,466 sparse -> 733 dense;
    # 91.6 FP32; 48 GB GDDR6 at 864 GB/s.
    "L40S": GPUType(tflops=366, memory_gb=48, memory_bandwidth_gbps=864, fp32_tflops=91.6, fp8_tflops=733),
    # NVIDIA RTX A6000 data sheet: tensor 309.7 TF with sparsity -> 154.8 dense; 38.7 FP32; 48 GB GDDR6 768 GB/s.
    "A6000": GPUType(tflops=154.8, memory_gb=48, memory_bandwidth_gbps=768, fp32_tflops=38.7),
}
