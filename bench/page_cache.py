"""A write into page-cache pages this machine freed a moment ago against one into pages it freed a while ago.

Why: on this project's VM the commit's floor in bench/checkpoint_large.py depended on which pages a write lands
in. A VM whose guest reports freed memory back to its host (virtio-balloon's free page reporting) gets those
pages back slowly the next time it touches them; a bare host does not pay that. A checkpoint keeps the previous
one until it commits, so its writes rarely land in pages just freed, where back-to-back plain writes (each
deleting its files before the next) always do. This writes ``--gb`` GB with one fsync, deletes it, waits each of
``PAUSES_S`` and writes again, twice over (medians), and prints the seconds per pause: the pause after which a
write runs at the fresh pages' speed is the one bench/checkpoint_large.py waits before its fresh-page floor.

    python bench/page_cache.py [--gb 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from _common import print_table, write_results

PAUSES_S = (0, 5, 15, 30)
CHUNK_BYTES = 64 << 20


def _write_s(path: Path, block: memoryview, nbytes: int) -> float:
    """``nbytes`` written to ``path`` from ``block`` over and over, fsynced once; the file is deleted after."""
    started = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - started
    path.unlink()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    args = ap.parse_args()
    nbytes = int(args.gb * (1 << 30)) // CHUNK_BYTES * CHUNK_BYTES
    block = memoryview(bytearray(os.urandom(1 << 20)) * (CHUNK_BYTES >> 20))
    times: dict[int, list[float]] = {pause: [] for pause in PAUSES_S}
    with tempfile.TemporaryDirectory(prefix="hetrain-pagecache-", dir=os.environ.get("HETRAIN_BENCH_TMP")) as tmp:
        path = Path(tmp) / "written"
        for _ in range(2):
            _write_s(path, block, nbytes)  # frees its pages for the next one
            for pause in PAUSES_S:
                time.sleep(pause)
                times[pause].append(_write_s(path, block, nbytes))
    medians = {pause: statistics.median(values) for pause, values in times.items()}
    rows = [{"pause_s": pause, "write_s": s, "gb_per_s": nbytes / 1e9 / s} for pause, s in medians.items()]
    for row in rows:
        row["vs_just_freed"] = row["write_s"] / rows[0]["write_s"]
    print_table(f"{nbytes / (1 << 30):.1f} GiB written with one fsync, after the previous write's pages were freed "
                f"(median of 2)", rows,
                [("pause after the last write's file went, s", "pause_s"), ("write s", "{write_s:.2f}"),
                 ("GB/s", "{gb_per_s:.2f}"), ("vs no pause", "{vs_just_freed:.2f}x")])
    print(f"\nresults: {write_results('page_cache', rows)}")


if __name__ == "__main__":
    main()
