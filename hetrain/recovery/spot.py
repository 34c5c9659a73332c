"""The spot nodes of a run whose ranks all run on this machine (``launch=local``): watched, and gone at the deadline.

A run on one machine (one node, or the emulated cluster) has no node watchers of its own:
``LocalSpotRun`` watches each spot node's metadata endpoint (the cloud's, or the emulated
cluster's fake one) with the real watcher, asks for the emergency checkpoint, and at the
deadline sets ``stop_event``, which stops the run's processes as the node's loss would. The
train flow uses it for ``launch=local``; per node, ``hetrain node start`` runs the watcher.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from hetrain.cost.notice import MIN_CHECKPOINT_S
from hetrain.recovery.preemption import Notice, PreemptionWatcher, wait_for_checkpoint


class LocalSpotRun:
    """Watchers for the spot nodes of a run on this machine (the emulated cluster, or one node).

    On a node's notice: ask the ranks for an emergency checkpoint (when the deadline allows),
    wait for it, call ``on_preempted(node, notice, checkpoint_step)``, and at the deadline set
    ``stop_event``: the node is gone then, and with it the run's collectives.
    """

    def __init__(self, sources: dict[str, object], request_file: Path,
                 on_preempted: Callable[[str, Notice, int | None], None] | None = None, *, poll_s: float = 1.0,
                 min_checkpoint_s: float = MIN_CHECKPOINT_S, log: Callable[[str], None] = print,
                 defer_checkpoint_s: float | None = None) -> None:
        self.stop_event = threading.Event()
        self.preempted: list[tuple[str, Notice, int | None]] = []
        self._timers: list[threading.Timer] = []

        def handler(node: str) -> Callable[[Notice, bool], None]:
            def on_notice(notice: Notice, checkpoint: bool) -> None:
                left = notice.seconds_left() or 0.0
                step = wait_for_checkpoint(request_file, max(left, 0.0)) if checkpoint else None
                self.preempted.append((node, notice, step))
                try:
                    if on_preempted is not None:
                        on_preempted(node, notice, step)
                finally:  # the node goes away at its deadline whatever the hook did
                    # a garbage deadline years ahead would overflow the timer: capped as the watcher's own
                    left_s = min(max(0.0, notice.seconds_left() or 0.0), threading.TIMEOUT_MAX)
                    timer = threading.Timer(left_s, self.stop_event.set)
                    timer.daemon = True
                    timer.start()
                    self._timers.append(timer)
            return on_notice

        self.watchers = [PreemptionWatcher(src, node, request_file=request_file, min_checkpoint_s=min_checkpoint_s,
                                           on_notice=handler(node), poll_s=poll_s, log=log,
                                           defer_checkpoint_s=defer_checkpoint_s)
                         for node, src in sources.items()]
        self._threads = [threading.Thread(target=w.run, daemon=True, name=f"hetrain-watch-{w.node}")
                         for w in self.watchers]

    def __enter__(self) -> LocalSpotRun:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        for w in self.watchers:
            w.stop()
        for t in self._timers:
            t.cancel()
