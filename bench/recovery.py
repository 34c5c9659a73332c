"""Recovery time: peers first (AutoHet's idea) vs everything from the bucket (the spot baseline).

A GPT of about 19 M parameters trains two steps on four one-device nodes and commits a
checkpoint of about 230 MB (weights + AdamW moments, four DCP shards) to each node's
directory and, in the background, to a bucket on a local S3 server (moto, its own process).
Node n3 is then lost with its disk. Each repeat restores that same checkpoint twice,
alternating:

* peers first: n0-n2 serve their directories over HTTP (``hetrain serve`` processes on
  127.0.0.2-4); only n3's shard comes from the bucket;
* bucket only: every file from the bucket (``hetrain recover --no-peers``);

On loopback a bucket is as fast as a peer, which no cloud bucket is: recovery reads the bucket
through a proxy capped at ``--bucket-mb-s`` (default 100 MB/s, about what one node sustains
from S3-class storage; bench/_netem.py). Peers stay on loopback, slower than a real 10-100 Gb/s
cluster network through Python's HTTP stacks. ``--bucket-mb-s 0`` measures without the cap.

each time through ``hetrain.recovery.recover``: re-plan for the three survivors, fetch,
start three processes, load with DCP resharding, one training step. Prints the breakdown
and the ratios, writes bench/results/recovery.json.

    python bench/recovery.py [--repeats 2] [--layers 6] [--hidden 512] [--bucket-mb-s 100]

``--bed`` runs it across machines instead: each node a network namespace of the test bed
(``hetrain.testing.netbed``: veth pairs on a bridge, links shaped with ``tc tbf``), the
bucket (moto) in its own namespace behind a slower link (``--bucket-mbit``, default 200
Mbit/s, against ``--node-mbit`` 1000 for the nodes). The ranks train inside their nodes'
namespaces, each node writing to its own disk (directory) and serving it (``hetrain serve``,
token required); after n3 is lost, the three survivors restore at once, each inside its
namespace (``hetrain restore``): peers first (own disk, then the other survivors, then the
bucket) against bucket only. Reports bytes per node and source and each node's fetch time;
the recovery's fetch phase is as long as its slowest node. Needs root and ``ip netns``.

    python bench/recovery.py --bed [--repeats 2] [--bucket-mbit 200] [--node-mbit 1000]

``--notice`` measures *downtime* (the wall time between the old plan's last step and the new
plan's first) for one running run whose node n3 gets a preemption notice, three ways, each
from a fresh run of the same model on the same four nodes (every node serving its checkpoint
directory over HTTP, the bucket behind the ``--bucket-mb-s`` cap):

* bucket-only restart (AutoHet's baseline): the old plan takes an emergency checkpoint and
  stops; once it is backed up n3 is gone, and a restart reads everything from the bucket;
* peers-first restart (hetrain before the notice-window switch): the same, but the survivors
  serve their shards and only n3's comes from the bucket;
* notice-window switch (``hetrain.recovery.proactive``): while the old plan trains, the new
  plan's ranks start and wait; then the emergency checkpoint, n3's shard fetched from n3
  itself, the switch;
* live switch (``live=True``, ``hetrain.checkpoint.live``): the same warm start, but the old
  ranks serve the emergency state from memory and each new rank fetches, verifies and loads
  the slices its stage needs; the checkpoint reaches disk and the bucket behind it.

Each repeat runs the modes in turn (alternating, so load from elsewhere on the machine falls on
all of them); each mode's downtime ratio to the same repeat's bucket-only restart is printed
with its spread (min and max over the repeats). The downtime's parts: the old plan's emergency
checkpoint (for the live switch, its in-memory save and offer), the fetch, starting processes,
the load (for the live switch, the transfer, verification and DCP's load together) and the rest
(the controller's polls and messages, the new plan's first step's start).

    python bench/recovery.py --notice [--repeats 3] [--bucket-mb-s 100]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import print_table, write_results

import s3fs

from hetrain.checkpoint.store import CheckpointStore
from hetrain.config import CheckpointConfig, RunConfig
from hetrain.plan.layout import build_layout
from hetrain.recovery.recover import recover
from hetrain.runtime.launch import free_port, launch, write_config
from hetrain.spec.specs import ModelSpec, TrainingSettings, load_cluster
from solver.planners.registry import make_plan

BUCKET = "hetrain-bench"
LOST = "n3"
CLUSTER = """
name: bench-4x1
inter_node_bandwidth_gbps: 1.0
gpu_types:
  cpu: {tflops: 0.02, fp32_tflops: 0.01, memory_gb: 8, memory_bandwidth_gbps: 10, efficiency: 1.0}
nodes:
""" + "".join(f"  - {{name: n{i}, gpu: cpu, count: 1, intra_node_bandwidth_gbps: 2.0, spot: true}}\n" for i in range(4))


def wait_for_port(host: str, port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {host}:{port}")


def starter(procs: list[subprocess.Popen]):
    """A function that starts a helper process (output piped) and keeps it in ``procs`` to kill at the end."""

    def start(argv: list[str]) -> subprocess.Popen:
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
        return procs[-1]

    return start


def start_bucket(start, cap_mb_s: float) -> tuple[str, str]:
    """moto on loopback with the bench's bucket; its endpoint and the one behind the ``cap_mb_s`` link emulator."""
    port = free_port()
    start([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)])
    endpoint = f"http://127.0.0.1:{port}"
    wait_for_port("127.0.0.1", port)
    s3fs.S3FileSystem(endpoint_url=endpoint).mkdir(BUCKET)
    if cap_mb_s <= 0:
        return endpoint, endpoint
    proxy = start([sys.executable, str(Path(__file__).with_name("_netem.py")), "127.0.0.1", str(port), str(cap_mb_s)])
    return endpoint, proxy.stdout.readline().strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--bucket-mb-s", type=float, default=100.0, help="bucket bandwidth cap in MB/s (0: none)")
    ap.add_argument("--bed", action="store_true", help="across network namespaces (root): per-node restores")
    ap.add_argument("--notice", action="store_true", help="downtime: restarts vs the notice-window and live switches")
    ap.add_argument("--skip-modes", type=lambda s: s.split(","), default=[],
                    help="--notice: comma-separated modes to leave out (the bucket-only restart always runs)")
    ap.add_argument("--bucket-mbit", type=float, default=200.0, help="--bed: the bucket's link (Mbit/s)")
    ap.add_argument("--node-mbit", type=float, default=1000.0, help="--bed: each node's link (Mbit/s)")
    args = ap.parse_args()
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(k, "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    if args.bed:
        bed_main(args)
        return
    if args.notice:
        notice_main(args)
        return

    procs: list[subprocess.Popen] = []
    start = starter(procs)
    endpoint, bucket_endpoint = start_bucket(start, args.bucket_mb_s)
    model = ModelSpec(name="gpt-bench-ckpt", num_layers=args.layers, hidden_size=args.hidden, num_heads=8,
                      seq_length=64, vocab_size=256)
    settings = TrainingSettings(global_batch_size=8, precision="fp32", micro_batch_sizes=[1, 2], tp_degrees=[1])

    def planner(cluster, m, s):
        return make_plan("hetrain", cluster, m, s).plan

    rows, samples = [], {"peers first": [], "bucket only": []}
    try:
        with tempfile.TemporaryDirectory(prefix="hetrain-recovery-") as tmp_str:
            tmp = Path(tmp_str)
            (tmp / "cluster.yaml").write_text(CLUSTER)
            plan = planner(load_cluster(tmp / "cluster.yaml"), model, settings)
            plan.write(tmp / "plan.json")
            ckpt = CheckpointConfig(local_dir=str(tmp / "nodes" / "{node}"), every_steps=1000,
                                    remote_url=f"s3://{BUCKET}/run", remote_options={"endpoint_url": endpoint})
            base = RunConfig(plan=str(tmp / "plan.json"), cluster=str(tmp / "cluster.yaml"), steps=2, checkpoint=ckpt)
            print(f"training {model.name} two steps on 4 nodes and checkpointing ...", flush=True)
            launch(base, build_layout(plan), tmp / "train")
            assert CheckpointStore.for_remote(ckpt).committed_steps() == [1], "backup did not finish"
            manifest = CheckpointStore.for_node(ckpt, "n0").read_manifest(1)
            shards = [f for f in manifest.files if f.path.endswith(".distcp")]
            print(f"checkpoint: {manifest.total_bytes / 1e6:.0f} MB in {len(shards)} shards "
                  f"({', '.join(f'{f.nodes[0]} {f.size / 1e6:.0f} MB' for f in shards)})", flush=True)
            shutil.rmtree(ckpt.node_root(LOST))  # the lost node's disk is gone with it

            peers = {}
            for i in range(3):
                host, peer_port = f"127.0.0.{i + 2}", free_port()
                start([sys.executable, "-m", "hetrain", "serve", "--root", ckpt.node_root(f"n{i}"), "--host", host,
                       "--port", str(peer_port)])
                wait_for_port(host, peer_port)
                peers[f"n{i}"] = f"http://{host}:{peer_port}"
            recover_ckpt = ckpt.model_copy(update={"peers": peers, "save_at_end": False,
                                                   "remote_options": {"endpoint_url": bucket_endpoint}})
            for rep in range(args.repeats):
                for mode in samples:
                    run_dir = tmp / f"{mode.replace(' ', '-')}-{rep}"
                    cfg = base.model_copy(update={"steps": 3, "checkpoint": recover_ckpt})
                    write_config(cfg, run_dir)
                    result = recover(run_dir, [LOST], planner, use_peers=mode == "peers first", timeout_s=5)
                    t = dict(result.timings_s)
                    t.pop("train_s", None)
                    t["total_s"] = sum(t.values())
                    kinds = result.bytes_by_kind()
                    samples[mode].append({**t, "peer_mb": kinds["peers"] / 1e6, "bucket_mb": kinds["remote"] / 1e6})
                    print(f"repeat {rep} {mode}: fetch {t['fetch_s']:.2f} s, total {t['total_s']:.2f} s "
                          f"({kinds['peers'] / 1e6:.0f} MB peers, {kinds['remote'] / 1e6:.0f} MB bucket)",
                          flush=True)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()

    keys = ["replan_s", "fetch_s", "startup_s", "load_s", "first_step_s", "total_s"]
    med = {mode: {k: statistics.median(x[k] for x in xs) for k in keys + ["peer_mb", "bucket_mb"]}
           for mode, xs in samples.items()}
    for mode, m in med.items():
        rows.append({"mode": mode, **m, "runs": samples[mode]})
    base_row = med["bucket only"]
    for r in rows:
        r["fetch_ratio"] = base_row["fetch_s"] / r["fetch_s"]
        r["total_ratio"] = base_row["total_s"] / r["total_s"]
    print_table(
        f"Recovery of one {manifest.total_bytes / 1e6:.0f} MB checkpoint ({len(shards)} shards) after losing {LOST}, "
        f"bucket capped at {args.bucket_mb_s:g} MB/s (0: loopback), medians of {args.repeats} alternating runs "
        f"each (seconds)",
        rows,
        [("mode", "mode"), ("MB from peers", "{peer_mb:.0f}"), ("MB from bucket", "{bucket_mb:.0f}"),
         ("re-plan", "{replan_s:.2f}"), ("fetch", "{fetch_s:.2f}"), ("start processes", "{startup_s:.2f}"),
         ("load", "{load_s:.2f}"), ("first step", "{first_step_s:.2f}"), ("total", "{total_s:.2f}"),
         ("fetch speed-up", "{fetch_ratio:.2f}x"), ("total speed-up", "{total_ratio:.2f}x")],
    )
    print(f"\nresults: {write_results('recovery', rows)}")


NOTICE_MODES = ("bucket-only restart", "peers-first restart", "notice-window switch", "live switch")
SWITCH_MODES = {"notice-window switch": False, "live switch": True}  # mode -> live
STEPS_AFTER = 2  # steps the new plan trains after recovering


NOTICE_COLUMNS = [  # the downtime's parts, then the ratios
    ("mode", "mode"), ("MB from staying nodes", "{staying_mb:.0f}"), ("MB from leaving node", "{leaving_mb:.0f}"),
    ("MB from bucket", "{bucket_mb:.0f}"), ("MB moved live", "{live_mb:.0f}"), ("new ranks started ahead s", "warm"),
    ("emergency checkpoint s", "{emergency_checkpoint_s:.2f}"), ("fetch s", "{fetch_s:.2f}"),
    ("start processes s", "{start_s:.2f}"), ("load s", "{load_s:.2f}"), ("other s", "{other_s:.2f}"),
    ("downtime s", "{downtime_s:.2f}"), ("downtime vs bucket-only", "{ratio:.2f}x shorter"),
    ("per-repeat ratio: median (min-max)", "ratio_spread")]


def notice_rows(samples: dict[str, list[dict]]) -> list[dict]:
    """A row per mode: its repeats' medians, its ratio to the bucket-only restart and that ratio's spread."""
    rows = []
    for mode, xs in samples.items():
        med = {k: statistics.median(x[k] for x in xs) for k in ("downtime_s", "staying_mb", "leaving_mb", "bucket_mb",
                                                                  "fetch_s", "emergency_checkpoint_s", "load_s",
                                                                  "start_s", "other_s", "live_mb")}
        rows.append({"mode": mode, **med, "runs": xs,
                     "warm": "-" if xs[0]["warm_start_s"] is None else
                     f"{statistics.median(x['warm_start_s'] for x in xs):.1f}"})
    base_row = rows[0]
    for r in rows:
        r["ratio"] = base_row["downtime_s"] / r["downtime_s"]
        # per repeat, against the same repeat's bucket-only restart: the spread of the ratio
        ratios = [b["downtime_s"] / x["downtime_s"] for b, x in zip(base_row["runs"], r["runs"])]
        r["ratios"] = ratios
        r["ratio_spread"] = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
    return rows


def notice_main(args) -> None:
    import threading

    from hetrain.recovery.preemption import wait_for_checkpoint
    from hetrain.recovery.proactive import downtime, recover_in_notice_window

    procs: list[subprocess.Popen] = []
    start = starter(procs)
    _, endpoint = start_bucket(start, args.bucket_mb_s)  # the runs upload through the cap too
    model = ModelSpec(name="gpt-bench-ckpt", num_layers=args.layers, hidden_size=args.hidden, num_heads=8,
                      seq_length=64, vocab_size=256)
    settings = TrainingSettings(global_batch_size=8, precision="fp32", micro_batch_sizes=[1, 2], tp_degrees=[1])

    def planner(cluster, m, s):
        return make_plan("hetrain", cluster, m, s).plan

    modes = [NOTICE_MODES[0]] + [m for m in NOTICE_MODES[1:] if m not in args.skip_modes]  # the ratios' base first
    samples: dict[str, list[dict]] = {mode: [] for mode in modes}
    try:
        with tempfile.TemporaryDirectory(prefix="hetrain-notice-") as tmp_str:
            tmp = Path(tmp_str)
            (tmp / "cluster.yaml").write_text(CLUSTER)
            plan = planner(load_cluster(tmp / "cluster.yaml"), model, settings)
            plan.write(tmp / "plan.json")
            for rep in range(args.repeats):
                for mode in modes:
                    name = f"{mode.split()[0]}-{rep}"
                    root, run_dir = tmp / name, tmp / name / "run"
                    servers = {}
                    for i in range(4):
                        node_root = root / "nodes" / f"n{i}"
                        node_root.mkdir(parents=True)
                        host, peer_port = f"127.0.0.{i + 2}", free_port()
                        servers[f"n{i}"] = start([sys.executable, "-m", "hetrain", "serve", "--root", str(node_root),
                                                  "--host", host, "--port", str(peer_port)])
                        wait_for_port(host, peer_port)
                    peers = {f"n{i}": f"http://127.0.0.{i + 2}:{servers[f'n{i}'].args[-1]}" for i in range(4)}
                    ckpt = CheckpointConfig(local_dir=str(root / "nodes" / "{node}"), every_steps=100_000,
                                            remote_url=f"s3://{BUCKET}/{name}", peers=peers,
                                            remote_options={"endpoint_url": endpoint})
                    base = RunConfig(plan=str(tmp / "plan.json"), cluster=str(tmp / "cluster.yaml"), steps=100_000,
                                     checkpoint=ckpt, request_file=str(run_dir / "checkpoint.request"))
                    old: dict = {}
                    thread = threading.Thread(target=lambda: old.update(records=launch(base, build_layout(plan),
                                                                                       run_dir)), daemon=True)
                    thread.start()
                    metrics = run_dir / "metrics.jsonl"
                    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
                        time.sleep(0.2)
                    notice_at = time.time()
                    if mode in SWITCH_MODES:
                        result = recover_in_notice_window(run_dir, [LOST], planner, deadline=notice_at + 120,
                                                          steps_after=STEPS_AFTER, timeout_s=5,
                                                          live=SWITCH_MODES[mode])
                        assert result.switched, result.why_not
                        assert not SWITCH_MODES[mode] or result.live.get("ok"), result.live
                        thread.join()
                        kinds = result.bytes_from()
                        sample = {"downtime_s": result.timings_s["downtime_s"], "step": result.step,
                                  "staying_mb": kinds["staying"] / 1e6, "leaving_mb": kinds["leaving"] / 1e6,
                                  "bucket_mb": kinds["remote"] / 1e6, "warm_start_s": result.timings_s["warm_start_s"],
                                  "checkpoint_s": result.timings_s["checkpoint_s"],
                                  "fetch_s": result.timings_s.get("fetch_s", 0.0),  # live: in the load
                                  "live_mb": result.live.get("bytes", 0) / 1e6}
                    else:
                        # today's notice: checkpoint, stop; the restart follows once the node is gone
                        (run_dir / "checkpoint.request").write_text('{"stop": true}\n')
                        step = wait_for_checkpoint(run_dir / "checkpoint.request", 120, poll_s=0.02)
                        thread.join()  # the old ranks exit once the step is in the bucket
                        servers[LOST].kill()
                        shutil.rmtree(ckpt.node_root(LOST))
                        started = time.perf_counter()
                        result = recover(run_dir, [LOST], planner, use_peers=mode == "peers-first restart",
                                         steps=step + 1 + STEPS_AFTER, timeout_s=5)
                        old_records = [r for r in old["records"] if r["step"] <= step]
                        kinds = result.bytes_by_kind()
                        sample = {"downtime_s": downtime(old_records, result.records), "step": step,
                                  "staying_mb": kinds["peers"] / 1e6, "leaving_mb": 0.0,
                                  "bucket_mb": kinds["remote"] / 1e6, "checkpoint_s": None,
                                  "fetch_s": result.timings_s["fetch_s"], "warm_start_s": None,
                                  "start_s": result.timings_s.get("startup_s"),
                                  "recover_call_s": time.perf_counter() - started, "live_mb": 0.0}
                    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
                    by_step = {r["step"]: r for r in map(json.loads, lines)}
                    sample["emergency_checkpoint_s"] = by_step[sample["step"]].get("checkpoint_s", 0.0)
                    sample["load_s"] = result.records[0].get("resume_load_s", 0.0)
                    sample["start_s"] = sample.get("start_s") or 0.0
                    sample["other_s"] = sample["downtime_s"] - sum(
                        sample[k] for k in ("emergency_checkpoint_s", "fetch_s", "start_s", "load_s"))
                    samples[mode].append(sample)
                    for proc in servers.values():
                        proc.kill()
                    print(f"repeat {rep} {mode}: downtime {sample['downtime_s']:.2f} s (step {sample['step']}, "
                          f"{sample['staying_mb']:.0f} MB staying nodes, {sample['leaving_mb']:.0f} MB leaving node, "
                          f"{sample['bucket_mb']:.0f} MB bucket)", flush=True)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    rows = notice_rows(samples)
    print_table(
        f"Downtime after a notice for node {LOST} ({args.layers} layers x {args.hidden}, 4 one-device nodes, bucket "
        f"capped at {args.bucket_mb_s:g} MB/s), medians of {args.repeats} alternating runs (seconds)", rows,
        NOTICE_COLUMNS)
    print(f"\nresults: {write_results('recovery_notice', rows)}")


def bed_main(args) -> None:
    """Per-node restores across the namespaces of a test bed (see the module's docstring)."""
    import json

    import yaml

    from hetrain.runtime.launch import write_config
    from hetrain.testing import netbed

    ok, why = netbed.available()
    if not ok:
        sys.exit(f"--bed: no network namespaces here ({why})")
    nodes = [f"n{i}" for i in range(4)]
    survivors = [n for n in nodes if n != LOST]
    s3_port, peer_port, token = 5000, 8470, os.urandom(16).hex()
    env = {**os.environ, "HETRAIN_PEER_TOKEN": token, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    model = ModelSpec(name="gpt-bench-ckpt", num_layers=args.layers, hidden_size=args.hidden, num_heads=8,
                      seq_length=64, vocab_size=256)
    settings = TrainingSettings(global_batch_size=8, precision="fp32", micro_batch_sizes=[1, 2], tp_degrees=[1])
    samples: dict[str, list[dict]] = {"peers first": [], "bucket only": []}
    bed = netbed.NetBed(["bucket", *nodes], rate_mbit={"bucket": args.bucket_mbit,
                                                       **{n: args.node_mbit for n in nodes}})
    with bed, tempfile.TemporaryDirectory(prefix="hetrain-recovery-bed-") as tmp_str:
        tmp = Path(tmp_str)
        logs = open(tmp / "servers.log", "w")

        def start(node: str, argv: list[str]) -> None:
            subprocess.Popen(bed.exec_argv(node, argv), stdout=logs, stderr=subprocess.STDOUT,
                             env={**env, **bed.env(node)})  # they die with their namespace

        start("bucket", [sys.executable, "-m", "moto.server", "-H", "0.0.0.0", "-p", str(s3_port)])
        s3_host = f"http://127.0.0.1:{bed.forward('bucket', s3_port, str(tmp))}"
        wait_for_port("127.0.0.1", int(s3_host.rsplit(":", 1)[1]))
        deadline = time.monotonic() + 60
        while True:
            try:
                s3fs.S3FileSystem(endpoint_url=s3_host).mkdir(BUCKET)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        cluster = yaml.safe_load(CLUSTER)
        for n in cluster["nodes"]:
            n["address"] = bed.address(n["name"])
        (tmp / "cluster.yaml").write_text(yaml.safe_dump(cluster))
        plan = make_plan("hetrain", load_cluster(tmp / "cluster.yaml"), model, settings).plan
        plan.write(tmp / "plan.json")
        ckpt = CheckpointConfig(
            local_dir=str(tmp / "nodes" / "{node}"), every_steps=1000, remote_url=f"s3://{BUCKET}/run",
            remote_options={"endpoint_url": f"http://{bed.address('bucket')}:{s3_port}"},
            peers={n: f"http://{bed.address(n)}:{peer_port}" for n in nodes})
        base = RunConfig(plan=str(tmp / "plan.json"), cluster=str(tmp / "cluster.yaml"), steps=2, checkpoint=ckpt)
        layout = build_layout(plan)
        print(f"training {model.name} two steps on 4 nodes of the bed and checkpointing ...", flush=True)
        launch(base, layout, tmp / "train", commands=bed.launch_commands(layout, "bench"))
        host_view = {"endpoint_url": s3_host}
        assert CheckpointStore(ckpt.remote_url, host_view).committed_steps() == [1], "backup did not finish"
        manifest = CheckpointStore.for_node(ckpt, "n0").read_manifest(1)
        shards = [f for f in manifest.files if f.path.endswith(".distcp")]
        print(f"checkpoint: {manifest.total_bytes / 1e6:.0f} MB in {len(shards)} shards "
              f"({', '.join(f'{f.nodes[0]} {f.size / 1e6:.0f} MB' for f in shards)})", flush=True)
        netbed._kill_namespace_processes(bed.nodes[LOST].namespace)
        shutil.rmtree(ckpt.node_root(LOST))  # the lost node's disk is gone with it
        for n in survivors:
            start(n, [sys.executable, "-m", "hetrain", "serve", "--root", ckpt.node_root(n), "--host", "0.0.0.0",
                      "--port", str(peer_port)])
        time.sleep(3)  # the servers import and bind
        for rep in range(args.repeats):
            for mode in samples:
                procs = {}
                for n in survivors:  # every survivor restores at once, inside its own namespace
                    run_dir = tmp / f"{mode.replace(' ', '-')}-{rep}" / n
                    write_config(base, run_dir)
                    argv = [sys.executable, "-m", "hetrain", "restore", "--run", str(run_dir), "--node", n,
                            "--lost-nodes", LOST, "--timeout-s", "5", "--json",
                            *(["--no-peers"] if mode == "bucket only" else [])]
                    procs[n] = subprocess.Popen(bed.exec_argv(n, argv), stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE, text=True, env={**env, **bed.env(n)})
                per_node = {}
                for n, proc in procs.items():
                    stdout, stderr = proc.communicate(timeout=600)
                    if proc.returncode != 0:
                        raise RuntimeError(f"restore on {n} ({mode}): {stderr.strip()}")
                    per_node[n] = json.loads(stdout)
                slowest = max(r["seconds"] for r in per_node.values())
                samples[mode].append({"nodes": per_node, "fetch_s": slowest})
                print(f"repeat {rep} {mode}: slowest node {slowest:.2f} s; " + "; ".join(
                    f"{n} {r['seconds']:.2f} s ({r['local_bytes'] / 1e6:.0f} MB own disk, "
                    f"{r['peer_bytes'] / 1e6:.0f} MB peers, {r['bucket_bytes'] / 1e6:.0f} MB bucket)"
                    for n, r in per_node.items()), flush=True)
        logs.close()

    rows = []
    base_s = statistics.median(x["fetch_s"] for x in samples["bucket only"])
    for mode, xs in samples.items():
        for n in survivors:
            first = xs[0]["nodes"][n]  # the bytes are the same every repeat
            rows.append({"mode": mode, "node": n, "own_mb": f"{first['local_bytes'] / 1e6:.0f}",
                         "peer_mb": f"{first['peer_bytes'] / 1e6:.0f}", "bucket_mb": f"{first['bucket_bytes'] / 1e6:.0f}",
                         "seconds": statistics.median(x["nodes"][n]["seconds"] for x in xs), "speedup": ""})
        fetch_s = statistics.median(x["fetch_s"] for x in xs)
        rows.append({"mode": mode, "node": "all (slowest node)", "own_mb": "", "peer_mb": "", "bucket_mb": "",
                     "seconds": fetch_s, "speedup": f"{base_s / fetch_s:.2f}x", "runs": xs})
    print_table(
        f"Per-node restore of one {manifest.total_bytes / 1e6:.0f} MB checkpoint ({len(shards)} shards) after losing "
        f"{LOST}, on the namespace bed: nodes {args.node_mbit:g} Mbit/s, bucket {args.bucket_mbit:g} Mbit/s; "
        f"medians of {args.repeats} alternating runs (seconds)",
        rows,
        [("mode", "mode"), ("node", "node"), ("MB own disk", "own_mb"), ("MB peers", "peer_mb"),
         ("MB bucket", "bucket_mb"), ("fetch s", "{seconds:.2f}"), ("speed-up vs bucket only", "speedup")],
    )
    print(f"\nresults: {write_results('recovery-bed', rows)}")


if __name__ == "__main__":
    main()
