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
