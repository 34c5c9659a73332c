"""``hetrain data prepare``: text, JSON lines, Parquet or a saved dataset into a flat token file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from hetrain.cli.common import err, out, user_errors


@user_errors
def data_prepare(
    inputs: Annotated[list[Path], typer.Option(
        "--input", "--text", "-i", help="a text file (one document), JSON lines (.jsonl: a document a line), "
        "Parquet (.parquet: a document a row) or a datasets dataset saved to disk (a directory); repeat for more")],
    out_file: Annotated[Path, typer.Option("--out", help="token file to write (.bin; a .bin.json describes it)")],
    tokenizer: Annotated[Path | None, typer.Option(
        help="tokenizer.json, or a transformers model directory (default: byte-level, one token per byte)")] = None,
    field: Annotated[str, typer.Option(help="the text field of JSON lines, Parquet and datasets")] = "text",
    split: Annotated[str, typer.Option(help="the split of a saved DatasetDict")] = "train",
    eos: Annotated[str | None, typer.Option(
        help="end-of-document token put between documents (default: the tokenizer's own; 'none': no token)")] = None,
):
    """Tokenize documents into a flat token file for `hetrain train --data`, on every core."""
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    from hetrain.runtime.data import prepare_tokens

    with Progress(TextColumn("[bold]tokenize"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TextColumn("{task.fields[tokens]:,} tokens"), TimeRemainingColumn(),
                  console=err, transient=True) as bar:
        task = bar.add_task("tokenize", total=None, tokens=0)
        meta = prepare_tokens(inputs, out_file, tokenizer, field=field, eos=eos, split=split,
                              progress=lambda done, total, tokens: bar.update(task, completed=done, total=total,
                                                                              tokens=tokens))
    table = Table(title=f"{out_file}", title_justify="left")
    for col in ("tokens", "documents", "dtype", "vocabulary", "end of document", "tokenizer"):
        table.add_column(col, justify="left" if col == "tokenizer" else "right", overflow="fold")
    table.add_row(f"{meta['num_tokens']:,}", f"{meta['documents']:,}", meta["dtype"], f"{meta['vocab_size']:,}",
                  "none" if meta["eos_id"] is None else str(meta["eos_id"]), meta["tokenizer"])
    out.print(table)
