"""Planners: the hetrain MILP (Pyomo + HiGHS), the megatron and whale baselines, and the exhaustive referee.

Depends on ``hetrain`` specs and cost model, never the reverse.
"""
