"""Planners, by role: the search machinery (``solver.search``), the planners (``solver.planners``) and renting
(``solver.rent``).

- ``solver.search``: what every planner shares: group classes, layer splits, pipeline templates and the search
  space, the MILP formulation and its LP bounds, assembly into a concrete plan, schedules, local improvement and
  the symmetry of large clusters.
- ``solver.planners``: one module per planner (``hetrain``, the product; ``milp``, its search alone; the
  ``megatron`` and ``whale`` baselines; the ``exhaustive`` referee; per-type pipelines, ``typed``) and the
  ``registry`` that runs them by name (``make_plan``).
- ``solver.rent``: which GPUs to rent from offers, and the plan over them.

Renting uses the planners, the planners use the search machinery, never the reverse (``.importlinter``).
Depends on ``hetrain`` specs and cost model, never the reverse.
"""
