"""Every process of a run ends with the process that launched it, however that one ends (``kill -9`` included).

``launch`` starts each node's launcher (``accelerate launch`` or ``torchrun``) in a session of its
own, so that stopping it can signal its whole group; the launcher's agent starts every worker in a
session of its own too (torch's ``SubprocessHandler``). So no signal to ``hetrain train``'s process
group reaches them, and a ``SIGKILL`` of ``hetrain train`` or of the launcher leaves no handler to
pass a stop on: before this module, the orphans trained on and committed steps into the run
directory while a second ``hetrain train`` resumed it (issue 48). Three links, each the kernel's or
a thread's, none needing the dying process to do anything:

* the launcher is exec'd through ``tied_argv``, which asks the kernel for ``SIGKILL`` when its parent
  (the process calling ``launch``, i.e. ``hetrain train`` or a flow run) dies: ``PR_SET_PDEATHSIG``,
  kept across ``exec``; it checks afterwards that the parent is still the one that started it (a
  parent gone before the request would never send it);
* every worker asks the same of its parent, the launcher's agent, first thing at import
  (``tie_to_parent``), before torch is imported;
* every worker also watches the process that called ``launch`` (``HETRAIN_TRAIN_PID``, its pid and
  start time, so a reused pid does not count) from a daemon thread, twice a second: the link that
  holds where a wrapper between them forks instead of exec'ing, and where there is no ``prctl``.

The run directory's lock (``RunDir.lock``) then refuses a second run while any worker of the run
is alive, so even a worker that escaped all three could never overlap a resumed run.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from hetrain.processes import alive

PR_SET_PDEATHSIG = 1  # linux/prctl.h
TRAIN_PID_ENV = "HETRAIN_TRAIN_PID"  # "PID:START" of the process that called launch()
WATCH_S = 0.5

# Run by the launcher's interpreter before it execs the launcher: python -I -S -c TIE PARENT_PID ARGV...
_TIE = ("import ctypes,os,sys\n"
        "try:\n ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)\n"
        "except (OSError, AttributeError):\n pass\n"
        "if os.getppid() != int(sys.argv[1]):\n os._exit(137)\n"
        "os.execvp(sys.argv[2], sys.argv[2:])\n")


def tied_argv(argv: list[str]) -> list[str]:
    """``argv`` run so that it is killed when this process (the one that starts it) dies."""
    return [sys.executable, "-I", "-S", "-c", _TIE, str(os.getpid()), *argv]


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux); whether it could."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _end_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def watch(token: str, interval_s: float = WATCH_S, on_gone=_end_self) -> threading.Thread:
    """A daemon thread calling ``on_gone`` (default: SIGKILL this process) once ``token``'s process is gone."""
    def run() -> None:
        while alive(token):
            threading.Event().wait(interval_s)
        on_gone()

    thread = threading.Thread(target=run, name="hetrain-lifeline", daemon=True)
    thread.start()
    return thread


def tie_to_parent() -> None:
    """For a worker: die with the launcher's agent (the kernel's signal) and with whoever called ``launch``."""
    parent = os.getppid()
    set_parent_death_signal()
    if os.getppid() != parent:  # the agent died before the request could count
        _end_self()
    token = os.environ.get(TRAIN_PID_ENV)
    if token:
        if not alive(token):
            _end_self()
        watch(token)
