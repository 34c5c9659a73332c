"""Shared bits of the benchmarks: the repo root on sys.path, result files, a rich table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"


def write_results(name: str, rows: list[dict]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(rows, indent=2))
    return path


def print_table(title: str, rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """Markdown table on stdout (pasteable into README and issue notes)."""
    print(f"\n{title}\n")
    print("| " + " | ".join(h for h, _ in columns) + " |")
    print("|" + "|".join("---" for _ in columns) + "|")
    for r in rows:
        print("| " + " | ".join(fmt.format(**r) if "{" in fmt else str(r.get(fmt, "")) for _, fmt in columns) + " |")


# GPU types of generated clusters, in the order ``generated_cluster`` takes them (node name prefix,
# catalog type, intra-node GB/s: NVLink for SXM parts, PCIe for the others)
MIX = [("a100", "A100-80G", 300), ("h100", "H100-SXM", 450), ("v100", "V100-32G", 150), ("rtx", "RTX3090", 16),
       ("a10g", "A10G", 16), ("l40s", "L40S", 32), ("a6000", "A6000", 56), ("a100s", "A100-40G", 300)]


def generated_cluster(num_gpus: int, types: int):
    """A cluster of the first ``types`` of MIX taking turns node by node (nodes of 8; of 4 up to 16 GPUs)."""
    from hetrain.spec.specs import ClusterSpec

    per_node = 4 if num_gpus <= 16 else 8
    nodes = []
    for i in range(num_gpus // per_node):
        prefix, gpu, bw = MIX[i % types]
        nodes.append({"name": f"{prefix}-{i}", "gpu": gpu, "count": per_node, "intra_node_bandwidth_gbps": bw})
    return ClusterSpec.model_validate({"name": f"gen-{num_gpus}x{types}", "nodes": nodes,
                                       "inter_node_bandwidth_gbps": 25})
