"""Bad input to every command, as a new user (or a typo) gives it: exit code 2, one line naming the file,
option or value, no traceback, nothing half-written, nothing outside the test's directory touched.

Commands run in-process through ``hetrain.cli.main`` (the console script itself, typer's usage
errors included), so a hundred cases cost seconds. Cases that need a running server or a
trained checkpoint live beside their subject in tests/integration (test_recovery, test_preemption,
test_lifecycle: a kill -9 of a training run, too).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from hetrain.cli import main
from tests.helpers import EXAMPLES

CLUSTER = str(EXAMPLES / "clusters" / "cpu-emulated.yaml")
MODEL = str(EXAMPLES / "models" / "gpt-tiny.yaml")


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and mtime: what a command must leave alone."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size if p.is_file() else -1, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("inputs")
    binary = d / "binary.yaml"
    binary.write_bytes(bytes(range(256)) * 8)
    bjson = d / "binary.json"
    bjson.write_bytes(b"\xff\xfe\x00\x80not json")
    a_file = d / "a-file"
    a_file.write_text("x\n")
    a_dir = d / "a-dir"
    a_dir.mkdir()
    cluster = Path(CLUSTER).read_text()
    (d / "billion.yaml").write_text(cluster.replace("count: 2", "count: 1000000000", 1))
    nodes = "".join(f"  - {{name: n{i}, gpu: A100-80G, count: 1024, intra_node_bandwidth_gbps: 300}}\n"
                    for i in range(70))
    (d / "huge-cluster.yaml").write_text(f"name: huge\nnodes:\n{nodes}")
    model = Path(MODEL).read_text()
    (d / "deep.yaml").write_text(model.replace("num_layers: 6", "num_layers: 1000000"))
    (d / "list.yaml").write_text("- 1\n- 2\n")
    (d / "huge.json").write_bytes(b" " * (65 << 20))
    os.mkfifo(d / "a-fifo")  # stands for a device node: `--out /dev/null` as root would replace the real one
    (d / "corpus.bin").write_bytes(b"text that is the input\n" * 10)
    (d / "model.yaml").write_text(model)
    laughs = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))
    (d / "laughs.yaml").write_text(laughs)  # about 500 bytes; 9**9 strings once expanded
    (d / "twice.yaml").write_text(model + "num_layers: 12\n")
    (d / "digits.yaml").write_text(model.replace("num_layers: 6", "num_layers: " + "9" * 5000))
    (d / "bool-layers.yaml").write_text(model.replace("num_layers: 6", "num_layers: true"))
    (d / "deep.json").write_text('{"schema": "hetrain.plan/v1", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    custom = "gpu_types: {{fast: {{tflops: {}, memory_gb: 80, memory_bandwidth_gbps: 2000}}}}\n"
    nodes1 = "nodes:\n  - {name: a, gpu: fast, count: 2, intra_node_bandwidth_gbps: 100}\n"
    (d / "inf-tflops.yaml").write_text("name: inf\n" + custom.format(".inf") + nodes1)
    (d / "absurd-tflops.yaml").write_text("name: absurd\n" + custom.format("1e300") + nodes1)
    (d / "nan-link.yaml").write_text("name: nan\ninter_node_bandwidth_gbps: .nan\n" + nodes1.replace("fast", "A100-80G"))
    assert main_ok(["plan", "--cluster", CLUSTER, "--model", MODEL, "--global-batch-size", "16",
                    "--out", str(d / "plan.json")])
    return {"binary": binary, "bjson": bjson, "file": a_file, "dir": a_dir, "plan": d / "plan.json", "root": d,
            "fifo": d / "a-fifo", "corpus": d / "corpus.bin", "model": d / "model.yaml"}


def main_ok(argv: list[str]) -> bool:
    old = sys.argv
    sys.argv = ["hetrain", *argv]
    try:
        return main() == 0
    finally:
        sys.argv = old


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    old = sys.argv
    sys.argv = ["hetrain", *argv]
    try:
        try:
            rc = main()
        except SystemExit as e:  # never expected: main returns its code
            rc = f"SystemExit({e.code})"
    finally:
        sys.argv = old
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


# (case, argv with {name} for the files above, what the one line must say)
CASES = [
    # files that are not what they claim
    ("binary cluster", ["plan", "--cluster", "{binary}", "--model", MODEL, "--global-batch-size", "16"],
     "binary.yaml: not a UTF-8 text file"),
    ("binary model", ["plan", "--cluster", CLUSTER, "--model", "{binary}", "--global-batch-size", "16"],
     "binary.yaml: not a UTF-8 text file"),
    ("binary profile", ["plan", "--cluster", CLUSTER, "--model", MODEL, "--global-batch-size", "16",
                        "--profile", "{bjson}"], "binary.json: not a UTF-8 text file"),
    ("binary plan (estimate)", ["estimate", "--plan", "{bjson}", "--cluster", CLUSTER], "binary.json: not a UTF-8"),
    ("binary plan (train)", ["train", "--plan", "{bjson}"], "binary.json: not a UTF-8 text file"),
    ("a 65 MB plan", ["train", "--plan", "{root}/huge.json"], "is not a hetrain spec, plan or profile"),
    ("a directory as cluster", ["plan", "--cluster", "{dir}", "--model", MODEL, "--global-batch-size", "16"],
     "a-dir: is a directory, expected a file"),
    ("a YAML list as model", ["plan", "--cluster", CLUSTER, "--model", "{root}/list.yaml", "--global-batch-size", "16"],
     "list.yaml: expected a mapping of fields at the top level, got list"),
    # sizes no one means (each would hang or exhaust memory)
    ("a billion GPUs", ["plan", "--cluster", "{root}/billion.yaml", "--model", MODEL, "--global-batch-size", "16"],
     "billion.yaml: nodes[0].count: expected at most 1024, got 1000000000"),
    ("71,680 GPUs", ["plan", "--cluster", "{root}/huge-cluster.yaml", "--model", MODEL, "--global-batch-size", "16"],
     "huge-cluster.yaml: nodes: expected at most 65536 GPUs in all, got 71680"),
    ("a million layers", ["plan", "--cluster", CLUSTER, "--model", "{root}/deep.yaml", "--global-batch-size", "16"],
     "deep.yaml: num_layers: expected at most 1024, got 1000000"),
    ("global batch 10^12", ["plan", "--cluster", CLUSTER, "--model", MODEL, "--global-batch-size", "1000000000000"],
     "--global-batch-size: expected at most 1048576, got 1000000000000"),
    ("micro-batch 10^6", ["plan", "--cluster", CLUSTER, "--model", MODEL, "--global-batch-size", "16",
                          "--micro-batch-size", "1000000"], "--micro-batch-size: expected at most 4096"),
    ("profile micro-batch 10^8", ["profile", "--model", MODEL, "--out", "{root}/p.json", "--micro-batch-sizes",
                                  "100000000"], "--micro-batch-sizes: expected integers from 1 to 4096"),
    ("train 10^13 steps", ["train", "--plan", "{plan}", "--steps", "10000000000000"], "'--steps'"),
    # option values outside their range
    ("time limit -1", ["plan", "--cluster", CLUSTER, "--model", MODEL, "--global-batch-size", "16", "--time-limit",
                       "-1"], "'--time-limit'"),
    ("port 70000", ["serve", "--root", "{dir}", "--port", "70000"], "'--port'"),
    ("port -1", ["serve", "--root", "{dir}", "--port", "-1"], "'--port'"),
    ("recover timeout -1", ["recover", "--run", "{dir}", "--lost-nodes", "a", "--timeout-s", "-1"], "'--timeout-s'"),
    ("watch poll 0", ["watch", "--node", "a", "--cloud", "aws", "--poll-s", "0"], "'--poll-s'"),
    ("train keep 0", ["train", "--plan", "{plan}", "--keep", "0"], "'--keep'"),
    ("not a number", ["train", "--plan", "{plan}", "--steps", "ten"], "'--steps'"),
    ("unknown planner", ["plan", "--cluster", CLUSTER, "--model", MODEL, "--global-batch-size", "16", "--planner",
                         "best"], "--planner: expected one of"),
    ("unknown cloud", ["watch", "--node", "a", "--cloud", "ibm"], "--cloud: expected one of aws, gcp, azure"),
    ("watch a run and a root", ["watch", "--node", "a", "--cloud", "aws", "--run", "{dir}", "--runs-root", "{dir}"],
     "--run and --runs-root: give one"),
    ("restore without a run", ["restore", "--run", "{dir}", "--node", "a", "--lost-nodes", "c"],
     "no config.json (not a run directory of this node)"),
    ("restore nothing lost", ["restore", "--run", "{dir}", "--node", "a", "--lost-nodes", ","],
     "--lost-nodes: expected at least one node name"),
    ("export without a run", ["export", "--run", "{dir}", "--out", "{root}/exported"],
     "no config.json (not a run directory)"),
    ("export int8", ["export", "--run", "{dir}", "--out", "{root}/exported", "--dtype", "int8"],
     "--dtype: expected one of fp32, bf16, fp16, got 'int8'"),
    ("missing option", ["plan", "--model", MODEL], "Missing option '--global-batch-size'"),
    ("neither cluster nor offers", ["plan", "--model", MODEL, "--global-batch-size", "16"],
     "give --cluster (your machines) or --offers"),
    ("unknown command", ["trian"], "No such command 'trian'"),
    ("bad run id", ["train", "--plan", "{plan}", "--run-id", "../x"], "--run-id '../x': expected letters"),
    # outputs that cannot be written: refused before the work, nothing created
    ("plan --out a directory", ["plan", "--cluster", CLUSTER, "--model", MODEL, "--global-batch-size", "16", "--out",
                                "{dir}"], "--out {dir}: is a directory, expected a file path"),
    ("plan --out under a file", ["plan", "--cluster", CLUSTER, "--model", MODEL, "--global-batch-size", "16",
                                 "--out", "{file}/plan.json"], "--out {file}/plan.json: {file} is a file"),
    ("profile --out a directory", ["profile", "--model", MODEL, "--out", "{dir}", "--micro-batch-sizes", "1",
                                   "--tp", "1"], "--out {dir}: is a directory"),
    ("data --out a directory", ["data", "prepare", "--text", "{file}", "--out", "{dir}"], "--out {dir}"),
    ("train --run-dir a file", ["train", "--plan", "{plan}", "--run-dir", "{file}"],
     "--run-dir {file}: is a file, expected a directory"),
    ("train --metrics a directory", ["train", "--plan", "{plan}", "--run-dir", "{root}/r1", "--metrics", "{dir}"],
     "--metrics {dir}: is a directory"),
    ("train --checkpoint-dir under a file", ["train", "--plan", "{plan}", "--run-dir", "{root}/r2",
                                             "--checkpoint-dir", "{file}/ckpt/{{node}}"], "--checkpoint-dir {file}/ckpt/"),
    ("YAML aliases", ["plan", "--cluster", CLUSTER, "--model", "{root}/laughs.yaml", "--global-batch-size", "16"],
     "laughs.yaml: invalid YAML (more than 1,000,000 values once its aliases are expanded)"),
    ("a key twice", ["plan", "--cluster", CLUSTER, "--model", "{root}/twice.yaml", "--global-batch-size", "16"],
     "twice.yaml: invalid YAML (line 8: the key 'num_layers' is given twice)"),
    ("5000 digits", ["plan", "--cluster", CLUSTER, "--model", "{root}/digits.yaml", "--global-batch-size", "16"],
     "digits.yaml: invalid YAML (line 3: an integer of 5000 digits (at most 40))"),
    ("true layers", ["plan", "--cluster", CLUSTER, "--model", "{root}/bool-layers.yaml", "--global-batch-size", "16"],
     "bool-layers.yaml: num_layers: expected a number, got True"),
    ("JSON 100k deep", ["estimate", "--plan", "{root}/deep.json", "--cluster", CLUSTER],
     "deep.json: invalid JSON (nested more than 64 deep)"),
    ("infinite TFLOPS", ["plan", "--cluster", "{root}/inf-tflops.yaml", "--model", MODEL, "--global-batch-size", "16"],
     "inf-tflops.yaml: gpu_types.fast.tflops: "),
    ("absurd TFLOPS", ["plan", "--cluster", "{root}/absurd-tflops.yaml", "--model", MODEL, "--global-batch-size",
                       "16"], "absurd-tflops.yaml: gpu_types.fast.tflops: expected at most 100000"),
    ("NaN bandwidth", ["plan", "--cluster", "{root}/nan-link.yaml", "--model", MODEL, "--global-batch-size", "16"],
     "nan-link.yaml: inter_node_bandwidth_gbps: "),
    ("train --lr inf", ["train", "--plan", "{plan}", "--run-dir", "{root}/r4", "--lr", "inf"], "--lr: input should be a finite number"),
    ("train --seed 1e23", ["train", "--plan", "{plan}", "--run-dir", "{root}/r5", "--seed", "100000000000000000000000"],
     "--seed"),
    ("data --out on a read-only filesystem", ["data", "prepare", "--text", "{corpus}", "--out", "/proc/hetrain.bin"],
     "--out /proc/hetrain.bin: cannot write in /proc"),
    ("plan --out a fifo", ["plan", "--cluster", CLUSTER, "--model", MODEL, "--global-batch-size", "16", "--out",
                           "{fifo}"], "--out {fifo}: is not a regular file"),
    ("plan --out the model", ["plan", "--cluster", CLUSTER, "--model", "{model}", "--global-batch-size", "16",
                              "--out", "{model}"], "--out {model}: is the --model this command reads"),
    ("data --out the text", ["data", "prepare", "--text", "{corpus}", "--out", "{corpus}"],
     "--out {corpus}: is the --input {corpus} this command reads"),
    ("train --peer without =", ["train", "--plan", "{plan}", "--run-dir", "{root}/r3", "--peer", "nodeurl"],
     "--peer: expected NODE=URL, got 'nodeurl'"),
]


@pytest.mark.parametrize("argv,expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(files, capsys, argv, expect):
    fill = {k: str(v) for k, v in files.items()}
    argv = [a.format(**fill) for a in argv]
    before = tree(files["root"])
    rc, out, err = run_main(argv, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, (rc, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert expect.format(**fill) in lines[0], lines[0]
    assert "Traceback" not in err + out
    assert tree(files["root"]) == before  # nothing written, created or removed


def test_a_profile_that_cannot_fit_is_refused_before_it_allocates():
    from hetrain.errors import HetrainError
    from hetrain.profiling.profiler import available_bytes, profile_model, profiling_bytes
    from hetrain.spec.specs import load_model

    spec = load_model(EXAMPLES / "models" / "gpt-13b.yaml")
    import torch

    free = available_bytes(torch.device("cpu"))
    b = next(b for b in (64, 256, 1024, 4096) if profiling_bytes(spec, b) > free)
    with pytest.raises(HetrainError, match=rf"micro-batch size {b}: profiling gpt-13b at it needs at least"):
        profile_model(spec, gpus={"cpu": 1.0}, micro_batch_sizes=[b], tp_degrees=[1])


def test_help_still_works(capsys):
    rc, out, _ = run_main([], capsys)
    assert rc == 0 and "plan" in out and "train" in out


def test_a_worker_crash_reaches_the_user_as_its_first_exception(tmp_path: Path):
    """Not "see launch.log": the rank's own error line, else the first exception of the output (the cause)."""
    from hetrain.runtime.launch import _worker_error

    log = tmp_path / "launch.log"
    log.write_text(
        "[rank1]: Traceback (most recent call last):\n"
        '[rank1]:   File "hetrain/checkpoint/save.py", line 103, in save\n'
        "[rank1]: OSError: [Errno 28] No space left on device: '/ckpt/b/step-000049/__1_0.distcp'\n"
        "[rank0]: Traceback (most recent call last):\n"
        "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer\n"
        "KeyboardInterrupt: \n")
    assert _worker_error(log) == ("OSError: [Errno 28] No space left on device: '/ckpt/b/step-000049/__1_0.distcp' "
                                  f"(full output in {log})")
    log.write_text("noise\nhetrain: error: rank 2: --data x.bin: holds ids up to 70000, the model's vocabulary "
                   "is 50257\nRuntimeError: later\n")
    assert _worker_error(log) == "rank 2: --data x.bin: holds ids up to 70000, the model's vocabulary is 50257"


def test_the_lock_is_refused_while_a_worker_of_the_run_lives_and_taken_once_it_is_gone(tmp_path: Path):
    """A killed run's worker that still lives holds the run: one forked as the agent forks them (the run only in
    its environment, named in its pid file with its start time and config), or one whose command line names the
    config (an older hetrain's bare pid file). A pid file naming a live process that is not the run's (here this
    test's own, with its true start time) counts for nothing: ``launch`` kills what counts."""
    import subprocess

    from hetrain.errors import HetrainError
    from hetrain.processes import owner_token
    from hetrain.rundir import RUN_DIR_ENV, RunDir

    run = RunDir.of(tmp_path / "run")
    run.pids.mkdir(parents=True)
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    worker = subprocess.Popen(sleep, env={**os.environ, RUN_DIR_ENV: str(run.path)})
    old = subprocess.Popen([*sleep, str(run.config)])
    try:
        for p in (worker, old):  # exec'd: before that a child shows this process's command line and environment
            while "time.sleep" not in Path(f"/proc/{p.pid}/cmdline").read_text():
                pass
        (run.pids / f"{worker.pid}.pid").write_text(f"{owner_token(worker.pid)}\n{run.config}\n")  # as a worker does
        (run.pids / f"{old.pid}.pid").write_text(str(old.pid))  # as an older hetrain's did
        (run.pids / f"{os.getpid()}.pid").write_text(f"{owner_token()}\n{run.config}\n")  # planted
        assert sorted(run.live_workers()) == sorted([worker.pid, old.pid])
        with pytest.raises(HetrainError, match=rf"2 training process\(es\) of this run are still alive \(pid "
                                               rf"({worker.pid}, {old.pid}|{old.pid}, {worker.pid})\)"):
            with run.lock(workers_grace_s=0.3):
                pass
        old.kill()
        old.wait()
        with pytest.raises(HetrainError, match=rf"1 training process\(es\) of this run are still alive \(pid "
                                               rf"{worker.pid}\)"):
            with run.lock(workers_grace_s=0.3):
                pass
    finally:
        for p in (worker, old):
            p.kill()
            p.wait()
    with run.lock(workers_grace_s=0.3):  # gone: the run is free (its stale pid files name no live worker of it)
        assert (run.path / ".lock").read_text() == str(os.getpid())


@pytest.mark.parametrize("kind", ["directory", "symbolic link"])
def test_a_lock_that_is_a_directory_or_a_link_is_refused_in_one_line(files, capsys, tmp_path: Path, kind):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("a file the lock must never truncate\n")
    if kind == "directory":
        (run_dir / ".lock").mkdir()
    else:
        (run_dir / ".lock").symlink_to(victim)
    rc, out, err = run_main(["train", "--plan", str(files["plan"]), "--run-dir", str(run_dir)], capsys)
    assert rc == 2 and err.splitlines() == [f"error: --run-dir {run_dir}: .lock is a {kind}, expected the run's "
                                            f"lock file (a regular file hetrain makes); remove it"], err
    assert victim.read_text() == "a file the lock must never truncate\n"
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]


# -- issue 48: hostile corpora for `data prepare` -------------------------------------------------------------------
HOSTILE_LINES = {
    "100k nested brackets": ('{"text": "ok", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
                             "line 2: JSON nested too deep to read"),
    "a 5,001-digit integer": ('{"text": "ok", "n": ' + "9" * 5001 + "}\n", "line 2: an integer of 5001 digits"),
    "a lone surrogate": ('{"text": "ab\\ud800cd"}\n', "line 2: field 'text' holds a lone surrogate '\\ud800'"),
}


@pytest.mark.parametrize("case", list(HOSTILE_LINES))
def test_a_hostile_json_line_is_one_line_and_nothing_written(tmp_path: Path, capsys, case):
    line, expect = HOSTILE_LINES[case]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a fine first document"}\n' + line)
    rc, out, err = run_main(["data", "prepare", "--input", str(corpus), "--out", str(tmp_path / "out.bin")], capsys)
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"error: {corpus}: {expect}"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]


@pytest.mark.parametrize("content", ["", '{"text": ""}\n\n{"text": ""}\n'], ids=["empty file", "empty documents"])
def test_an_empty_corpus_is_refused_before_a_token_file_of_nothing(tmp_path: Path, capsys, content):
    corpus = tmp_path / ("corpus.jsonl" if content else "corpus.txt")
    corpus.write_text(content)
    rc, out, err = run_main(["data", "prepare", "--input", str(corpus), "--out", str(tmp_path / "out.bin")], capsys)
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and f"--input {corpus}: no tokens" in lines[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == [corpus.name]


def test_prepare_never_writes_through_a_planted_temp_link_nor_over_an_input_of_that_name(tmp_path: Path, capsys):
    """The old temporaries were fixed names: `.out.bin.tmp` as the input was destroyed, as a link written through."""
    victim = tmp_path / "victim.txt"
    victim.write_text("another file\n")
    (tmp_path / ".out.bin.json.tmp").symlink_to(victim)
    corpus = tmp_path / ".out.bin.tmp"  # the input, named like the old temporary of the output
    corpus.write_text("the corpus itself\n")
    rc, out, err = run_main(["data", "prepare", "--input", str(corpus), "--out", str(tmp_path / "out.bin")], capsys)
    assert rc == 0, err
    assert corpus.read_text() == "the corpus itself\n" and victim.read_text() == "another file\n"
    assert (tmp_path / "out.bin").read_bytes() == b"the corpus itself\n"  # byte-level: one token a byte
    assert (tmp_path / ".out.bin.json.tmp").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.bin.json.tmp", ".out.bin.tmp", "out.bin",
                                                          "out.bin.json", "victim.txt"]
    umask = os.umask(0)
    os.umask(umask)
    assert oct((tmp_path / "out.bin").stat().st_mode & 0o777) == oct(0o666 & ~umask)  # as open() makes files


# -- issue 48: hostile --init-from weights --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory) -> dict[str, Path]:
    """A good transformers Llama directory and its hostile variants, each beside a directory it must not reach."""
    import shutil
    import struct

    from hetrain.runtime.model import GPT
    from hetrain.spec.hf import safetensors_names
    from hetrain.spec.specs import load_model
    from tests.helpers.models import write_transformers_dir
    from tests.helpers.training import LLAMA_TINY

    root = tmp_path_factory.mktemp("weights")
    model = GPT(load_model(LLAMA_TINY))
    model.init_weights(0)
    good = write_transformers_dir(root / "good", model)
    dirs = {"good": good}

    def variant(name: str) -> Path:
        dirs[name] = root / name
        shutil.copytree(good, dirs[name])
        return dirs[name]

    for name, header in (("number", b"42"), ("nested", b"[" * 200_000 + b"]" * 200_000),
                         ("outside", b'{"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1000000]}}')):
        (variant(name) / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    (variant("loop") / "model.safetensors").unlink()
    (dirs["loop"] / "model.safetensors").symlink_to("model.safetensors")
    (root / "dirloop").symlink_to("dirloop")
    dirs["dirloop"] = root / "dirloop"
    (root / "other").mkdir()
    (variant("escape") / "model.safetensors").rename(root / "other" / "model.safetensors")
    (dirs["escape"] / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        n: "../other/model.safetensors" for n in safetensors_names(root / "other" / "model.safetensors")}}))
    dirs["plan"] = root / "plan.json"
    assert main_ok(["plan", "--cluster", CLUSTER, "--model", str(good), "--global-batch-size", "16",
                    "--out", str(dirs["plan"])])
    return dirs


INIT_FROM_CASES = {
    "number": "model.safetensors: not a safetensors file (its header is int, expected an object of tensors)",
    "nested": "model.safetensors: header: invalid JSON (nested more than 64 deep)",
    "outside": "model.safetensors: not a safetensors file (tensor 'x': expected dtype, shape and data offsets inside",
    "loop": "model.safetensors: a symbolic link that loops, expected a file",
    "dirloop": "dirloop: a symbolic link that loops",
    "escape": "model.safetensors.index.json: weight_map names '../other/model.safetensors', outside the directory",
}


@pytest.mark.parametrize("case", list(INIT_FROM_CASES))
def test_hostile_init_from_weights_are_one_line_before_any_process_starts(llama_dirs, tmp_path: Path, capsys, case):
    rc, out, err = run_main(["train", "--plan", str(llama_dirs["plan"]), "--init-from", str(llama_dirs[case]), "--steps", "1",
                             "--run-dir", str(tmp_path / "run")], capsys)
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and INIT_FROM_CASES[case] in lines[0], err
    assert not (tmp_path / "run").exists()


def test_non_finite_weights_are_refused_at_load(llama_dirs, tmp_path: Path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from hetrain.errors import HetrainError
    from hetrain.runtime.model import GPT
    from hetrain.runtime.pretrained import load_pretrained
    from hetrain.spec.hf import check_pretrained, pretrained_spec

    d = tmp_path / "nan"
    shutil.copytree(llama_dirs["good"], d)
    tensors = load_file(str(d / "model.safetensors"))
    key = "model.layers.3.mlp.down_proj.weight"
    tensors[key] = tensors[key].clone()
    tensors[key][1, 2] = float("nan")
    tensors[key][0, 0] = float("inf")
    save_file(tensors, str(d / "model.safetensors"))
    spec = pretrained_spec(d)
    check_pretrained(d, spec)  # the header is fine: only the values are not
    load_pretrained(GPT(spec, [0, 2]), spec, d)  # a stage without that tensor loads
    with pytest.raises(HetrainError, match=rf"'{key}' holds 2 non-finite values \(NaN or infinity\) of "):
        load_pretrained(GPT(spec, [2, 6]), spec, d)
    assert torch.isfinite(load_file(str(llama_dirs["good"] / "model.safetensors"))[key]).all()


# -- issue 48: --print-launch writes nothing into an existing run ---------------------------------------------------
def test_print_launch_writes_nothing_into_an_existing_run(files, tmp_path: Path, capsys):
    run_dir = tmp_path / "run"
    rc, out, err = run_main(["train", "--plan", str(files["plan"]), "--print-launch", "--run-dir", str(run_dir)], capsys)
    assert rc == 0 and "hetrain.runtime.agent" in out and (run_dir / "config.json").is_file(), err  # a new run: its config
    before = tree(tmp_path)
    rc, out, err = run_main(["train", "--plan", str(files["plan"]), "--print-launch", "--run-dir", str(run_dir),
                             "--checkpoint-dir", str(tmp_path / "elsewhere"), "--steps", "7"], capsys)
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and lines == [f"error: --run-dir {run_dir}: holds a run already (config.json); --print-launch "
                                 f"writes a new run's config.json and never touches an existing run's; give a new "
                                 f"--run-dir"], err
    assert tree(tmp_path) == before


# -- issue 48: disk full, then room again ---------------------------------------------------------------------------
@pytest.fixture
def disk_of_256mb(tmp_path: Path):
    """A real filesystem of 256 MB (tmpfs; root only) with 56 MB taken: 200 MB free, as in the report."""
    import subprocess

    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        (mnt / "taken").write_bytes(b"\0" * (56 << 20))
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_resume_with_room_for_its_checkpoint_is_not_refused_for_a_flat_gigabyte(disk_of_256mb: Path):
    """200 MB free: a 5.6 MB step is fetched (it was refused, "keeping 1 GB"); a 150 MB one is not (no room for the
    next checkpoint), in one line with the numbers; large steps keep a gigabyte beyond themselves, as before."""
    import shutil
    from types import SimpleNamespace

    from fsspec.implementations.local import LocalFileSystem

    from hetrain.checkpoint.reassemble import _check_room, free_space_needed
    from hetrain.errors import HetrainError

    free = shutil.disk_usage(disk_of_256mb).free
    assert 190e6 < free < 210e6
    dest = str(disk_of_256mb / "run" / "restore" / "step-1")
    _check_room(LocalFileSystem(), dest, SimpleNamespace(step=1, total_bytes=5_600_000))
    with pytest.raises(HetrainError, match=r"checkpoint step 1: 150.0 MB to fetch, 2\d\d.\d MB free at .*disk \(a "
                                           r"resume needs 300.0 MB: the step and room for the next checkpoint\)"):
        _check_room(LocalFileSystem(), dest, SimpleNamespace(step=1, total_bytes=150_000_000))
    assert free_space_needed(5_600_000) == 5_600_000 + (64 << 20)
    assert free_space_needed(10 << 30) == (11 << 30)


# -- issue 48: the peer server ------------------------------------------------------------------------------------
@pytest.fixture
def served_step(tmp_path: Path) -> tuple[Path, str, bytes]:
    """A checkpoint root with one committed step holding a 2 MB shard: the root, the shard's path, its bytes."""
    from hetrain.checkpoint.manifest import MANIFEST, step_name

    step = tmp_path / "root" / step_name(1)
    step.mkdir(parents=True)
    (step / MANIFEST).write_text(json.dumps({"step": 1, "files": []}))
    shard = os.urandom(2 << 20)
    (step / "__0_0.distcp").write_bytes(shard)
    return tmp_path / "root", f"/{step_name(1)}/__0_0.distcp", shard


def _raw_get(host: str, port: int, path: str, extra_headers: str = "", pause_s: float = 0.0):
    """(status, headers, body) of one GET over a socket of its own; ``pause_s`` before reading the body."""
    import socket
    import time

    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra_headers}\r\n".encode())
        f = sock.makefile("rb")
        status = int(f.readline().split()[1])
        headers = {}
        while (line := f.readline().strip()):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        time.sleep(pause_s)
        return status, headers, f.read(int(headers.get("content-length", 0)))


def test_200_concurrent_downloads_all_complete_or_get_503_with_retry_after(served_step):
    """None is reset: past the cap of downloads in progress the answer is 503, Retry-After, after the request."""
    from concurrent.futures import ThreadPoolExecutor

    from hetrain.checkpoint.peer import MAX_DOWNLOADS, PeerServer

    root, path, shard = served_step
    with PeerServer(root, host="127.0.0.21") as peer:
        host, port = peer.url.removeprefix("http://").rsplit(":", 1)
        with ThreadPoolExecutor(200) as pool:  # every client holds its download open a moment: they overlap
            results = list(pool.map(lambda _: _raw_get(host, int(port), path, pause_s=1.0), range(200)))
    served = [r for r in results if r[0] == 200]
    busy = [r for r in results if r[0] == 503]
    assert len(served) + len(busy) == 200, sorted({r[0] for r in results})
    assert all(body == shard for _, _, body in served)
    assert all(h.get("retry-after") == "1" and h.get("connection") == "close" for _, h, _ in busy)
    assert MAX_DOWNLOADS <= len(served) and busy, len(served)  # the cap was reached, and past it answered, not reset


@pytest.mark.parametrize("headers,status", [("X-Big: " + "a" * 40_000 + "\r\n", (400, 431)),
                                            ("".join(f"X-{i}: 1\r\n" for i in range(3000)), (400, 431)),
                                            ("".join(f"X-{i}: 1\r\n" for i in range(150)), (431,))],
                         ids=["one 40 KB header", "3,000 headers", "150 headers"])
def test_requests_past_the_header_limits_are_refused(served_step, headers, status):
    from hetrain.checkpoint.peer import PeerServer

    root, path, _ = served_step
    with PeerServer(root, host="127.0.0.22") as peer:
        host, port = peer.url.removeprefix("http://").rsplit(":", 1)
        assert _raw_get(host, int(port), path, headers)[0] in status
        assert _raw_get(host, int(port), path)[0] == 200  # the server is none the worse


@pytest.mark.parametrize("token", [" ", "\t\n", "two words"])
def test_a_blank_or_spaced_bearer_token_is_refused(files, capsys, monkeypatch, token):
    monkeypatch.setenv("HETRAIN_PEER_TOKEN", token)
    rc, out, err = run_main(["serve", "--root", str(files["dir"]), "--host", "0.0.0.0", "--port", "18479"], capsys)
    assert rc == 2 and err.startswith("error: $HETRAIN_PEER_TOKEN: ") and len(err.strip().splitlines()) == 1, err


def test_a_port_in_use_is_one_line(files, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.23", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, out, err = run_main(["serve", "--root", str(files["dir"]), "--host", "127.0.0.23", "--port", str(port)],
                                capsys)
    assert rc == 2 and err.strip().splitlines() == [f"error: --port {port}: 127.0.0.23:{port} is in use (another "
                                                    f"hetrain serve?); choose another port"], err


# -- issue 48: offers past any cloud's ------------------------------------------------------------------------------
def _offers_yaml(types: int) -> str:
    lines = ["name: many", "zones:", "  - {name: z, inter_node_bandwidth_gbps: 3}", "gpu_types:"]
    lines += [f"  g{i}: {{tflops: {100 + i % 50}, memory_gb: 80, memory_bandwidth_gbps: 2000}}" for i in range(types)]
    lines += ["offers:"] + [f"  - {{name: o{i}, gpu: g{i}, zone: z, nodes_available: 4, gpus_per_node: 8, "
                            f"intra_node_bandwidth_gbps: 300, on_demand_price_per_gpu_hour: {1 + i % 7}}}"
                            for i in range(types)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("types,expect", [
    (200_000, "MB is past the limit of an offers file (4 MB: at most 4096 offers of 64 GPU types); wrong file?"),
    (100, "gpu_types: 100 GPU types offered or defined, at most 64 (the planner probes each one)")],
    ids=["200,000 GPU types", "100 GPU types"])
def test_offers_of_more_gpu_types_than_any_cloud_are_one_line_at_once(tmp_path: Path, capsys, types, expect):
    import time

    offers = tmp_path / "offers.yaml"
    offers.write_text(_offers_yaml(types))
    started = time.monotonic()
    rc, out, err = run_main(["plan", "--offers", str(offers), "--model", MODEL, "--global-batch-size", "16",
                             "--out", str(tmp_path / "plan.json")], capsys)
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"error: {offers}: ") and expect in lines[0], err
    assert time.monotonic() - started < 10 and not (tmp_path / "plan.json").exists()
