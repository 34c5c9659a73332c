"""The network-namespace test bed: nodes joined by a tc-shaped link, training across them, nothing left behind.

Skipped where network namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import sys
import time

import pytest

from hetrain.config import RunConfig
from hetrain.errors import HetrainError
from hetrain.plan.layout import build_layout
from hetrain.plan.schema import Plan
from hetrain.runtime.launch import NodeCommand, launch
from hetrain.spec.specs import load_model
from hetrain.testing import netbed
from tests.helpers import EXAMPLES

OK, WHY = netbed.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"no network namespaces here: {WHY}")

SPEC = load_model(EXAMPLES / "models" / "gpt-tiny.yaml")
CLUSTER_FILE = EXAMPLES / "clusters" / "cpu-emulated.yaml"


def _ours() -> set[str]:
    return {ns for ns in netbed._namespaces() if ns.startswith(netbed.PREFIX)}


def two_node_run(tmp_path) -> tuple[RunConfig, object]:
    """A 3-step run of one pipeline whose two stages sit on the two nodes: every micro-batch crosses the link."""
    plan = Plan.model_validate({
        "schema": "hetrain.plan/v1", "model": SPEC.model_dump(), "cluster": "cpu-emulated",
        "global_batch_size": 4, "micro_batch_size": 1, "tp": 1,
        "pipelines": [{"num_microbatches": 4, "stages": [
            {"devices": ["fast/0"], "gpu": "cpu-fast", "layers": [0, 4]},
            {"devices": ["slow/0"], "gpu": "cpu-slow", "layers": [4, 6]}]}],
    })
    path = tmp_path / "plan.json"
    plan.write(path)
    return RunConfig(plan=str(path), cluster=str(CLUSTER_FILE), steps=3), build_layout(plan)


def test_link_runs_at_its_rate_and_the_bed_is_removed():
    before = _ours()
    with netbed.NetBed(["a", "b"], rate_mbit=200) as bed:
        assert {n.namespace for n in bed.nodes.values()} <= _ours()
        mb_s = netbed.measure_link_mb_s(bed, "a", "b", 8 << 20)
    assert 0.6 * 25 < mb_s < 1.1 * 25  # 200 Mbit/s = 25 MB/s, less TCP's slow start
    assert _ours() == before


def test_fixture_builds_a_bed(make_netbed):
    bed = make_netbed(["x", "y", "z"], rate_mbit=400)
    assert len({n.address for n in bed.nodes.values()}) == 3
    assert bed.bridge_ns in _ours()


def test_unshaped_link_is_much_faster_than_a_shaped_one(make_netbed):
    bed = make_netbed(["a", "b"])
    assert netbed.measure_link_mb_s(bed, "a", "b", 32 << 20) > 2 * 25


def test_plan_trains_across_namespaced_nodes(tmp_path):
    config, layout = two_node_run(tmp_path)
    with netbed.NetBed(["fast", "slow"], rate_mbit=400) as bed:
        records = launch(config, layout, tmp_path / "run", commands=bed.launch_commands(layout, "bedtest"))
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["loss"] > 0 for r in records)
    assert {r["device"] for r in records[-1]["ranks"]} == {"fast/0", "slow/0"}
    assert (tmp_path / "run" / "launch-fast.log").exists() and (tmp_path / "run" / "launch-slow.log").exists()


def test_a_failing_node_stops_the_others(tmp_path):
    """The slow node's launcher dies at once: the fast node's, waiting at the rendezvous, is stopped too."""
    config, layout = two_node_run(tmp_path)
    with netbed.NetBed(["fast", "slow"]) as bed:
        real = bed.launch_commands(layout, "failtest")

        def commands(config_path):
            cmds = real(config_path)
            return [c if c.node == "fast" else NodeCommand(c.node, c.env, bed.exec_argv(c.node, [
                sys.executable, "-c", "import sys; print('ValueError: node lost its disk'); sys.exit(3)"]))
                for c in cmds]

        started = time.monotonic()
        with pytest.raises(HetrainError, match="node lost its disk"):
            launch(config, layout, tmp_path / "run", commands=commands)
        assert time.monotonic() - started < 60
        for node in bed.nodes.values():  # nothing of the run is left in any node
            assert netbed._ip("netns", "pids", node.namespace, check=False).stdout.split() == []
