"""The planners, one module each, and the registry that runs them by name (``solver.planners.registry.make_plan``).

``hetrain`` is the product; ``milp`` (its search alone), ``megatron``, ``whale`` (``baselines``), ``exhaustive``
(the referee) and the per-type pipelines (``typed``, a seed of ``hetrain``) do not import each other.
"""
