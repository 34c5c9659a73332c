"""Convert the Sailor artifact's measured runs on the MIT cluster into hetrain's files (a test fixture).

Why: the cost model must rank plans as real mixed clusters do, and the public artifact of the Sailor planner
(Strati et al., SOSP'25; github.com/eth-easl/sailor) holds OPT-350M runs on nodes of 8 RTX 3090, 8 RTX 2080
(Ti: 11 GB) and 8 Titan RTX, each plan with its measured iteration time, next to the per-layer profiles and
the network measurements its own simulator used. This script reads them from a clone (or a bare git
directory) and writes, under ``--out``:

    cluster.json   the nodes the plans use and the links Sailor measured between them
    model.json     OPT-350M as Sailor's training config gives it (24 blocks, hidden 1024, seq 2048)
    profile.json   hetrain.profile/v1 from Sailor's per-layer times (fp32, micro-batch 2, TP 1-8)
    plans/*.json   hetrain.plan/v1, one per Sailor plan_config_*.json
    measured.json  each plan's measured iteration time, gradient-reduction time and peak memory
    SOURCE.md      where each number came from (repository, commit, paths)

Only ``sailor/Planner/simulations/validation/mit`` is converted: the artifact's other validation folders are a
check kept apart from this work. Nothing here imports hetrain: the files are checked by loading them.

    python bench/sailor_convert.py --sailor /path/to/sailor [--out tests/fixtures/sailor_mit]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLANS_DIR = "sailor/Planner/simulations/validation/mit"
PROFILES = "sailor/Planner/simulations/profiles_tmp.json"  # per model, GPU, mbs, tp, layer: [fwd, bwd, update] s
LLM_INFO = "sailor/Planner/llm_info.json"  # per model, tp, layer: parameter and activation floats (mbs 1)
TRAINING = "sailor/Planner/simulations/configs/training_config_opt_350.json"
CLUSTER = "sailor/Planner/simulations/configs/basic_cluster_config.json"
INTRA = "sailor/providers/intra_node_bandwidths.json"  # per GPU type, GPUs: [poly coeffs, max bytes/s]
INTER = "sailor/providers/multizone_bandwidths_het.json"  # zone, type, count, zone, type, count: [coeffs, max]
MODEL = "OPT-350"
ZONE = "us-central1-a"
GPUS_PER_NODE = 8  # basic_cluster_config.json: every MIT node has 8 GPUs of one type
# The runs trained under Megatron-DeepSpeed, whose pipelines run DeepSpeed's engine (TrainSchedule, blocking sends);
# the plans say so, and hetrain prices them under it (``hetrain.cost.pipeline.deepspeed_pipeline_s``)
SCHEDULE = "deepspeed-1f1b"
FP32_BYTES = 4
# Sailor's names -> hetrain's (RTX3090 is in hetrain's catalog; the Turing cards are defined in the cluster file)
TYPES = {"RTX-3090": "RTX3090", "RTX-2080": "RTX2080Ti", "Titan-RTX": "TitanRTX"}
NODE_PREFIX = {"RTX-3090": "rtx3090", "RTX-2080": "rtx2080", "Titan-RTX": "titan"}
# Turing data sheets (NVIDIA Turing GPU architecture whitepaper, appendix A, Founders Edition boards): RTX 2080
# Ti 13.4 FP32 TFLOPS, 53.8 FP16 tensor TFLOPS with FP32 accumulate, 11 GB GDDR6 at 616 GB/s (Sailor's cluster
# config gives the "RTX-2080" nodes 11 GiB: the Ti); Titan RTX 16.3 FP32, 130.5 tensor with FP32 accumulate,
# 24 GB at 672 GB/s. Only the analytic path reads them: the fixture's profile gives measured times.
TURING = {
    "RTX2080Ti": {"tflops": 53.8, "fp32_tflops": 13.4, "memory_gb": 11.0, "memory_bandwidth_gbps": 616},
    "TitanRTX": {"tflops": 130.5, "fp32_tflops": 16.3, "memory_gb": 24.0, "memory_bandwidth_gbps": 672},
}


def git_show(sailor: Path, path: str) -> str:
    """A file of the artifact at HEAD, from a work tree or a bare git directory."""
    return subprocess.run(["git", f"--git-dir={_git_dir(sailor)}", "show", f"HEAD:{path}"],
                          check=True, capture_output=True, text=True).stdout


def _git_dir(sailor: Path) -> Path:
    return sailor / ".git" if (sailor / ".git").exists() else sailor


def head_commit(sailor: Path) -> str:
    return subprocess.run(["git", f"--git-dir={_git_dir(sailor)}", "rev-parse", "HEAD"],
                          check=True, capture_output=True, text=True).stdout.strip()


def plan_paths(sailor: Path) -> list[str]:
    out = subprocess.run(["git", f"--git-dir={_git_dir(sailor)}", "ls-tree", "-r", "--name-only", "HEAD", PLANS_DIR],
                         check=True, capture_output=True, text=True).stdout.split()
    return sorted(p for p in out if p.endswith(".json"))


def model_spec(training: dict) -> dict:
    """OPT-350M in hetrain's terms: Sailor trains it as a Megatron GPT (``type: gpt2``) of these sizes."""
    return {"name": "opt-350m", "num_layers": training["num_layers"], "hidden_size": training["hidden_size"],
            "num_heads": training["heads"], "seq_length": training["sequence_length"],
            "vocab_size": training["vocab_size"]}


def link_gbps(inter: dict, a: str, b: str, count: int) -> float:
    """Sailor's measured peak GB/s from a node of type ``a`` to one of ``b`` (``count`` GPUs each), both ways' least."""
    zone = inter[ZONE]
    ways = [zone[x][str(count)][ZONE][y][str(count)][1] for x, y in ((a, b), (b, a))
            if str(count) in zone[x] and y in zone[x][str(count)][ZONE]]
    return round(min(ways) / 1e9, 4)


def cluster_spec(inter: dict, intra: dict, nodes: dict[str, int]) -> dict:
    """The MIT nodes the plans use (``nodes``: Sailor type -> how many), with Sailor's measured links:
    inside a node the peak of its 8-GPU all-reduce test, between nodes the peak of its send test with 8 GPUs a
    side (the count a TP-8 stage sends with). Pairs slower than the default get a ``links`` entry each."""
    names = {t: [f"{NODE_PREFIX[t]}-{i}" for i in range(n)] for t, n in nodes.items()}
    spec_nodes = [{"name": name, "gpu": TYPES[t], "count": GPUS_PER_NODE,
                   "intra_node_bandwidth_gbps": round(intra[t][str(GPUS_PER_NODE)][1] / 1e9, 3)}
                  for t, ns in names.items() for name in ns]
    pairs = {(a, b): link_gbps(inter, a, b, GPUS_PER_NODE) for a in nodes for b in nodes}
    fastest = max(pairs.values())
    links = []
    flat = [(t, n) for t, ns in names.items() for n in ns]
    for i, (ta, na) in enumerate(flat):
        for tb, nb in flat[i + 1:]:
            if pairs[(ta, tb)] < fastest:
                links.append({"nodes": [na, nb], "bandwidth_gbps": pairs[(ta, tb)]})
    return {"name": "sailor-mit", "inter_node_bandwidth_gbps": fastest, "nodes": spec_nodes, "links": links,
            "gpu_types": TURING}


def profile_json(profiles: dict, llm_info: dict, model: dict, micro_batch: int) -> dict:
    """hetrain.profile/v1 from Sailor's per-layer [forward, backward, update] seconds (layer 0 the embedding,
    1..24 the blocks, 25 the final norm, head and loss), fp32 without recompute (backward ~2.7 x forward at TP 1).

    Sailor timed each TP degree on a real TP group of one node: its times include the TP all-reduces
    (``includes_tp_comm``). The blocks' times are the mean over the 24 blocks; activation bytes are Sailor's
    per-block measurement at micro-batch 1, times the micro-batch (as Sailor's simulator scales them)."""
    devices = {}
    last = model["num_layers"] + 1
    for sailor_type, ours in TYPES.items():
        entries = []
        for tp, layers in sorted(profiles[MODEL][sailor_type][str(micro_batch)].items(), key=lambda kv: int(kv[0])):
            blocks = [layers[str(i)] for i in range(1, last)]
            act = llm_info[MODEL][tp]["2"]["act_mem_floats"] * FP32_BYTES * micro_batch if tp in llm_info[MODEL] else None
            entry = {"tp": int(tp), "micro_batch_size": micro_batch,
                     "block_forward_s": round(statistics.fmean(b[0] for b in blocks), 6),
                     "block_backward_s": round(statistics.fmean(b[1] for b in blocks), 6),
                     "embed_forward_s": layers["0"][0], "embed_backward_s": layers["0"][1],
                     "head_forward_s": layers[str(last)][0], "head_backward_s": layers[str(last)][1]}
            if act is not None:
                entry["block_activation_bytes"] = int(act)
            entries.append(entry)
        devices[ours] = entries
    return {"schema": "hetrain.profile/v1", "model": model, "precision": "fp32", "activation_recompute": False,
            "head_split": True, "includes_tp_comm": True, "devices": devices}


def training_settings(cfg: dict, tp: int) -> dict:
    """What the MIT runs trained with: fp32 weights, gradients and Adam (4 + 4 + 4 + 4 bytes per parameter),
    gradients reduced in fp32, no activation recompute (the profile's backward is ~2.7 x its forward)."""
    return {"global_batch_size": cfg["gbs"], "micro_batch_sizes": [cfg["mbs"]], "tp_degrees": [tp],
            "precision": "fp32", "bytes_per_param": 16.0, "activation_recompute": "none", "grad_reduce": "fp32"}


def _blocks(layers: list[int], num_layers: int) -> list[int]:
    """Sailor's layer indices (0 embedding, 1..num_layers blocks, num_layers + 1 head) -> hetrain's [start, end)."""
    inner = [i for i in layers if 1 <= i <= num_layers]
    return [inner[0] - 1, inner[-1]]


def convert_plan(cfg: dict, model: dict) -> tuple[dict, dict[str, int]]:
    """One Sailor plan as a hetrain plan, and how many nodes of each Sailor type it uses.

    Sailor's ``tmp_per_stage[i][j]`` is replica j of stage i (a node's GPU type, the GPUs it uses, the TP degree);
    replica j of every stage forms pipeline j. Each replica takes the next unused node of its type."""
    (pipe,) = cfg["pipeline_list"]
    dp = pipe["dp"][0]
    if any(d != dp for d in pipe["dp"]):
        raise ValueError(f"stages with different data parallelism {pipe['dp']}")
    used: dict[str, int] = {}
    replicas = []  # per stage, per replica: (node name, gpu type, tp)
    for stage in pipe["tmp_per_stage"]:
        row = []
        for (vms, tp) in stage:
            ((sailor_type, _gpus, _zone),) = vms
            index = used.get(sailor_type, 0)
            used[sailor_type] = index + 1
            row.append((f"{NODE_PREFIX[sailor_type]}-{index}", TYPES[sailor_type], tp))
        replicas.append(row)
    tps = {tp for row in replicas for _, _, tp in row}
    if len(tps) != 1:
        raise ValueError(f"stages with different TP degrees {sorted(tps)}")
    (tp,) = tps
    micro = cfg["gbs"] // cfg["mbs"] // dp
    pipelines = [{"num_microbatches": micro, "schedule": SCHEDULE,
                  "stages": [{"devices": [f"{replicas[i][j][0]}/{r}" for r in range(tp)], "gpu": replicas[i][j][1],
                              "layers": _blocks(layers, model["num_layers"])}
                             for i, layers in enumerate(pipe["layers_per_stage"])]}
                 for j in range(dp)]
    plan = {"schema": "hetrain.plan/v1", "model": model, "cluster": "sailor-mit", "global_batch_size": cfg["gbs"],
            "micro_batch_size": cfg["mbs"], "tp": tp, "pipelines": pipelines,
            "training": training_settings(cfg, tp)}
    return plan, used


def measured_row(name: str, path: str, cfg: dict) -> dict:
    return {"plan": name, "group": cfg["N"], "source": path, "iteration_s": cfg["real"],
            "grad_reduce_s": cfg["red_grads"], "peak_memory_gb": round(cfg["max_mem"] / 1e9, 3),
            "pipelines": cfg["pipeline_list"][0]["dp"][0], "stages": cfg["pipeline_list"][0]["num_stages"]}


def flag_suspects(rows: list[dict]) -> None:
    """A run whose figures are another's to the last digit and that cannot have them: one pipeline (nothing to
    reduce across replicas; the other one-pipeline run reduced in 1.6 ms) but seconds of gradient reduction."""
    for row in rows:
        twins = [o["plan"] for o in rows if o is not row and
                 (o["iteration_s"], o["grad_reduce_s"], o["peak_memory_gb"]) ==
                 (row["iteration_s"], row["grad_reduce_s"], row["peak_memory_gb"])]
        if twins and row["pipelines"] == 1 and row["grad_reduce_s"] > 1.0:
            row["suspect"] = (f"same iteration, gradient-reduction and memory figures as {', '.join(twins)}, "
                              f"and {row['grad_reduce_s']} s of gradient reduction with one pipeline: a copy")


SOURCE_MD = """# Sailor's measured runs on the MIT cluster, in hetrain's files

Converted by `python bench/sailor_convert.py --sailor <clone of github.com/eth-easl/sailor>` from
github.com/eth-easl/sailor at commit {commit} (Strati et al., "Sailor: Automating Distributed Training over Dynamic,
Heterogeneous, and Geo-distributed Clusters", SOSP'25). Do not edit by hand: rerun the converter.

| file | from |
|---|---|
| `plans/*.json`, `measured.json` | `{plans}/N*/plan_config_*.json` (`real`: iteration s, `red_grads`: s, `max_mem`: bytes) |
| `profile.json` | `{profiles}` (OPT-350, mbs 2: per layer forward, backward s) and `{llm_info}` (activation floats) |
| `model.json` | `{training}` |
| `cluster.json` | `{cluster}` (GPUs per node), `{intra}` (8-GPU peak), `{inter}` (8 GPUs a side, peak) |

Runs: OPT-350M, fp32, micro-batch 2, Megatron-DeepSpeed on nodes of 8 RTX 3090, 8 RTX 2080 Ti and 8 Titan RTX.
`measured.json` keeps each plan's figures as the artifact gives them. `suspect` marks a run whose figures cannot be
its own (the tests and the table leave it out of the statistics and say so).
"""


def convert(sailor: Path, out: Path) -> list[dict]:
    """Write the fixture under ``out``; returns the measured rows."""
    training = json.loads(git_show(sailor, TRAINING))
    model = model_spec(training)
    rows, nodes = [], {}
    (out / "plans").mkdir(parents=True, exist_ok=True)
    for path in plan_paths(sailor):
        cfg = json.loads(git_show(sailor, path))
        name = Path(path).stem.removeprefix("plan_config_")
        plan, used = convert_plan(cfg, model)
        for t, n in used.items():
            nodes[t] = max(nodes.get(t, 0), n)
        (out / "plans" / f"{name}.json").write_text(json.dumps(plan, indent=2) + "\n")
        rows.append(measured_row(name, path, cfg))
    flag_suspects(rows)
    commit = head_commit(sailor)
    inter, intra = json.loads(git_show(sailor, INTER)), json.loads(git_show(sailor, INTRA))
    profile = profile_json(json.loads(git_show(sailor, PROFILES)), json.loads(git_show(sailor, LLM_INFO)), model, 2)
    cluster = cluster_spec(inter, intra, dict(sorted(nodes.items())))
    (out / "cluster.json").write_text(json.dumps(cluster, indent=2) + "\n")
    (out / "model.json").write_text(json.dumps(model, indent=2) + "\n")
    (out / "profile.json").write_text(json.dumps(profile, indent=2) + "\n")
    (out / "measured.json").write_text(json.dumps({"source": "github.com/eth-easl/sailor", "commit": commit,
                                                   "runs": rows}, indent=2) + "\n")
    (out / "SOURCE.md").write_text(SOURCE_MD.format(commit=commit, plans=PLANS_DIR, profiles=PROFILES,
                                                    llm_info=LLM_INFO, training=TRAINING, cluster=CLUSTER,
                                                    intra=INTRA, inter=INTER))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sailor", type=Path, required=True, help="a clone (or bare git directory) of eth-easl/sailor")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "sailor_mit")
    args = ap.parse_args()
    rows = convert(args.sailor, args.out)
    print(f"{len(rows)} runs written to {args.out}")


if __name__ == "__main__":
    main()
