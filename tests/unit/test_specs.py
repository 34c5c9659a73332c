"""Specs load from YAML, and every bad input gives one clear line and exit code 2."""

from pathlib import Path

import pytest

from hetrain.errors import HetrainError
from hetrain.spec.catalog import CATALOG
from hetrain.spec.specs import load_cluster, load_model
from tests.helpers import EXAMPLES

REQUIRED_GPUS = ["A100-40G", "A100-80G", "V100-16G", "V100-32G", "RTX3090", "A10G", "L4", "T4", "H100-SXM",
                 "H100-PCIe", "H200-SXM", "L40S", "A6000"]


def test_catalog_has_the_required_types():
    for name in REQUIRED_GPUS:
        assert CATALOG[name].tflops > 0 and CATALOG[name].memory_gb > 0


@pytest.mark.parametrize("path", sorted((EXAMPLES / "clusters").glob("*.yaml")), ids=lambda p: p.stem)
def test_example_clusters_load(path):
    cl = load_cluster(path)
    assert cl.num_devices == len(cl.devices) >= 2
    assert len({d.name for d in cl.devices}) == cl.num_devices


@pytest.mark.parametrize("path", sorted((EXAMPLES / "models").glob("*.yaml")), ids=lambda p: p.stem)
def test_example_models_load(path):
    assert load_model(path).num_layers > 0


def test_device_names_and_links():
    cl = load_cluster(EXAMPLES / "clusters/paper-32gpu.yaml")
    assert cl.devices[0].name == "a100-0/0"
    assert cl.bandwidth_gbps("rtx-0", "rtx-1") == 3.125
    assert cl.bandwidth_gbps("rtx-0", "a100-0") == 12.5
    assert cl.bandwidth_gbps("v100-0", "v100-0") == 150
    assert cl.min_bandwidth_gbps({"rtx-0", "rtx-1", "a100-0"}) == 3.125
    assert cl.min_bandwidth_gbps({"a100-0", "v100-1"}) == 12.5


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


GOOD_NODE = "{name: a, gpu: A100-80G, count: 2, intra_node_bandwidth_gbps: 300}"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("name: x\nnodes: [{name: a, gpu: B200-Z, count: 2, intra_node_bandwidth_gbps: 300}]\n",
         "nodes[0].gpu: unknown GPU type 'B200-Z'"),
        ("name: x\nnodes: [{name: a, gpu: A100-80G, count: -2, intra_node_bandwidth_gbps: 300}]\n",
         "nodes[0].count: expected"),
        ("name: x\nnodes: [" + GOOD_NODE + ", " + GOOD_NODE + "]\n", "nodes[1].name: expected a unique node name"),
        ("name: x\nnodes: [" + GOOD_NODE + "]\nlinks: [{nodes: [a, zz], bandwidth_gbps: 1}]\n",
         "links[0].nodes: expected names of nodes in this file, got 'zz'"),
        ("name: x\nnodes: [" + GOOD_NODE + "]\nbogus: 1\n", "bogus: is not a known field"),
        ("name: x\nnodes: [{name: a, gpu: T4, count: 1, intra_node_bandwidth_gbps: 1, address: 'h; rm'}]\n",
         "nodes[0].address: expected"),
        ("nodes: [" + GOOD_NODE + "]\n", "name: is required"),
        ("name: x\nnodes: [{name: a, gpu: A100-80G, count: 2\n", "invalid YAML"),
    ],
)
def test_bad_cluster_files_name_file_and_field(tmp_path, text, expected):
    path = _write(tmp_path, text)
    with pytest.raises(HetrainError) as e:
        load_cluster(path)
    msg = str(e.value)
    assert msg.startswith(str(path) + ": ") and expected in msg and "\n" not in msg


def test_custom_gpu_type(tmp_path):
    path = _write(tmp_path, "name: x\ngpu_types: {MI250: {tflops: 181, memory_gb: 64, memory_bandwidth_gbps: 1600}}\n"
                            "nodes: [{name: a, gpu: MI250, count: 4, intra_node_bandwidth_gbps: 100}]\n")
    cl = load_cluster(path)
    assert cl.gpu_type("MI250").memory_gb == 64


def test_model_heads_must_divide_hidden(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("name: m\nnum_layers: 2\nhidden_size: 100\nnum_heads: 3\nseq_length: 8\nvocab_size: 10\n")
    with pytest.raises(HetrainError, match="num_heads: expected a divisor of hidden_size 100, got 3"):
        load_model(p)


BAD_INPUTS = [
    (["--cluster", "nope.yaml"], "nope.yaml: file not found"),
    (["--cluster", "{tmp}/syntax.yaml"], "invalid YAML"),
    (["--cluster", "{tmp}/unknown.yaml"], "unknown GPU type 'Z9'"),
    (["--cluster", "{tmp}/negative.yaml"], "nodes[0].count: expected"),
    (["--model", "examples/models/gpt-30b.yaml", "--cluster", "{tmp}/tiny.yaml"],
     "gpt-30b needs at least"),
    (["--global-batch-size", "10", "--micro-batch-size", "4"],
     "global batch size 10 is not divisible by micro-batch size 4"),
]


@pytest.mark.parametrize("args, expected", BAD_INPUTS, ids=["missing", "yaml", "gpu", "count", "fits", "batch"])
def test_cli_bad_input_one_line_exit_2(cli, tmp_path, args, expected):
    (tmp_path / "syntax.yaml").write_text("name: x\nnodes: [\n")
    (tmp_path / "unknown.yaml").write_text("name: x\nnodes: [{name: a, gpu: Z9, count: 1, intra_node_bandwidth_gbps: 1}]\n")
    (tmp_path / "negative.yaml").write_text("name: x\nnodes: [{name: a, gpu: T4, count: -1, intra_node_bandwidth_gbps: 1}]\n")
    (tmp_path / "tiny.yaml").write_text("name: tiny\nnodes: [{name: a, gpu: T4, count: 2, intra_node_bandwidth_gbps: 16}]\n")
    base = {"--cluster": "examples/clusters/paper-12gpu.yaml", "--model": "examples/models/gpt-6.7b.yaml",
            "--global-batch-size": "64"}
    given = dict(zip(args[::2], args[1::2]))
    merged = {**base, **{k: v.replace("{tmp}", str(tmp_path)) for k, v in given.items()}}
    flat = [x for kv in merged.items() for x in kv]
    out = cli("plan", *flat)
    assert out.returncode == 2, out.stderr
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and expected in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_node_start_refuses_a_bad_name_or_runs_root(cli, tmp_path):
    (tmp_path / "file").write_text("x")
    for args, expected in ((["--name", "a b"], "--name 'a b': expected a node name"),
                           (["--name", "default"], "--name default: that is the pool's queue"),
                           (["--name", "a", "--runs-root", str(tmp_path / "file")], "is a file, expected a directory"),
                           (["--name", "a", "--cloud", "ibm"], "--cloud: expected one of aws, gcp, azure"),
                           (["--name", "a", "--runs-root", str(tmp_path / "runs")], "PREFECT_API_URL is not set")):
        r = cli("node", "start", *args)
        assert r.returncode == 2 and expected in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_check_that_names_the_bad_value_is_not_told_it_twice():
    from pydantic import ValidationError

    from hetrain.spec.specs import TrainingSettings, describe_validation_error

    with pytest.raises(ValidationError) as e:
        TrainingSettings(global_batch_size=8, tp_degrees=[1, 3])
    line = describe_validation_error("--tp", e.value)
    assert line == "--tp: tp_degrees: expected powers of two, got 3", line


def test_a_cluster_file_may_use_anchors_and_aliases(tmp_path):
    """Repeated node specs by anchor and merge key (and what yaml.safe_dump writes for shared values) load."""
    from hetrain.spec.specs import load_cluster

    (tmp_path / "c.yaml").write_text(
        "name: anchors\n"
        "nodes:\n"
        "  - &v100 {name: v1, gpu: V100-32G, count: 4, intra_node_bandwidth_gbps: 150}\n"
        "  - {<<: *v100, name: v2}\n")
    cluster = load_cluster(tmp_path / "c.yaml")
    assert [n.name for n in cluster.nodes] == ["v1", "v2"] and cluster.nodes[1].count == 4
