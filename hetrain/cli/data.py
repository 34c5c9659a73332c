"""``hetrain data prepare``: a text file into a flat token file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from hetrain.cli.common import err, out, user_errors


@user_errors
def data_prepare(
    text: Annotated[Path, typer.Option(help="text file (UTF-8)")],
    out_file: Annotated[Path, typer.Option("--out", help="token file to write (.bin; a .bin.json describes it)")],
    tokenizer: Annotated[Path | None, typer.Option(help="Hugging Face tokenizer.json (default: byte-level, "
                                                        "one token per byte)")] = None,
):
    """Tokenize a text file into a flat token file for `hetrain train --data`."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from hetrain.runtime.data import prepare_tokens

    with Progress(TextColumn("[bold]tokenize"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=err, transient=True) as bar:
        task = bar.add_task("tokenize", total=None)
        meta = prepare_tokens(text, out_file, tokenizer,
                              progress=lambda done, total: bar.update(task, completed=done, total=total))
    table = Table(title=f"{out_file}", title_justify="left")
    for col in ("tokens", "dtype", "vocabulary", "largest id", "tokenizer"):
        table.add_column(col, justify="left" if col == "tokenizer" else "right")
    table.add_row(f"{meta['num_tokens']:,}", meta["dtype"], f"{meta['vocab_size']:,}", str(meta["max_id"]),
                  meta["tokenizer"])
    out.print(table)
