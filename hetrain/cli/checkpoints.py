"""A run's checkpoints outside training: ``hetrain serve`` (to peers) and ``hetrain export`` (safetensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hetrain.checkpoint import PEER_SILENCE_S, PEER_TOKEN_ENV
from hetrain.cli.common import MAX_TIMEOUT_S, err, out, say_note, user_errors
from hetrain.errors import HetrainError
from hetrain.files import check_output_dir
from hetrain.rundir import CONFIG, RunDir


@user_errors
def serve(
    root: Annotated[Path, typer.Option(help="this node's checkpoint root")],
    host: Annotated[str, typer.Option(help="address to listen on (peers on other machines: 0.0.0.0 or this "
                                           "node's address)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port")] = 8470,
    token_env: Annotated[str, typer.Option(help="environment variable holding the bearer token (unset: no token)")]
    = PEER_TOKEN_ENV,
    insecure: Annotated[bool, typer.Option("--insecure", help="serve beyond loopback without a token")] = False,
):
    """Serve this node's checkpoints read-only over HTTP for peers' recovery."""
    import os

    import uvicorn

    from hetrain.checkpoint.peer import DESCRIPTORS_WANTED, bind, check_token, raise_descriptor_limit, server_config

    token = os.environ.get(token_env) or None
    check_token(token, f"${token_env}")  # ' ' is no secret: refused, not taken for a token
    loopback = host == "localhost" or host.startswith("127.") or host == "::1"
    if not token and not loopback and not insecure:
        raise HetrainError(f"--host {host}: checkpoints hold the model's weights; set a bearer token in ${token_env} "
                           f"to serve beyond loopback (or pass --insecure on a trusted network)")
    config = server_config(root, token, host, port)  # checks the root before anything is said
    sock = bind(host, port)  # a port in use: one line now, not uvicorn's two lines and exit 3
    descriptors = raise_descriptor_limit()
    err.print(f"serving {root} on http://{host}:{port} ({'bearer token required' if token else 'no token'})")
    if descriptors is not None and descriptors < DESCRIPTORS_WANTED:
        say_note(f"this process may open only {descriptors} files (its hard limit): a burst of connections can "
                 f"use them up for a moment; give it {DESCRIPTORS_WANTED} (ulimit -n)")
    uvicorn.Server(config).run(sockets=[sock])


@user_errors
def export(
    run: Annotated[Path, typer.Option(help="run directory (holds config.json)")],
    out_dir: Annotated[Path, typer.Option("--out", help="directory for model.safetensors (+ config.json)")],
    step: Annotated[int | None, typer.Option(min=0, help="a committed step (default: the newest)")] = None,
    dtype: Annotated[str, typer.Option(help="fp32 (as trained: exact), bf16 or fp16")] = "fp32",
    timeout_s: Annotated[float, typer.Option(min=0.1, max=MAX_TIMEOUT_S,
                                             help="seconds before a silent peer counts as gone")] = PEER_SILENCE_S,
):
    """Write a run's committed checkpoint as one model.safetensors (+ a transformers config.json for Llama)."""
    from hetrain.export import check_dtype, export_run

    check_dtype(dtype)
    if not RunDir.of(run).config.is_file():
        raise HetrainError(f"--run {run}: no {CONFIG} (not a run directory)")
    check_output_dir(out_dir, "--out")
    result = export_run(run, out_dir, step=step, dtype=dtype, timeout_s=timeout_s)
    out.print(f"exported step {result.step} of {run}: {result.num_params:,} parameters, "
              f"{result.num_bytes / 1e6:.1f} MB {dtype} -> {', '.join(str(out_dir / f) for f in result.files)}",
              highlight=False, soft_wrap=True)
