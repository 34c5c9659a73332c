"""Imported first by an agent's fork server (``hetrain.runtime.agent`` preloads it): the server dies with its agent.

Python's fork server exits once every holder of its "alive" pipe has closed it, and the workers it
forks hold it too; an agent killed by ``SIGKILL`` would leave the server and its workers (each tied
to the server, ``hetrain.runtime.worker.entry``) waiting on one another. The kernel's parent-death
signal ties the server to the agent instead, so a ``kill -9`` of the agent takes the server, and with
it every worker, at once. Imported anywhere else (``AGENT_PID_ENV`` unset, or not this process's
parent) it does nothing.
"""

from __future__ import annotations

import os

from hetrain.runtime.lifeline import set_parent_death_signal

AGENT_PID_ENV = "HETRAIN_AGENT_PID"  # set by the agent before it starts its fork server

_agent = os.environ.get(AGENT_PID_ENV, "")
if _agent.isdigit() and int(_agent) == os.getppid():
    set_parent_death_signal()
    if os.getppid() != int(_agent):  # the agent died before the request could count
        os._exit(137)
