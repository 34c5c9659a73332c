"""The search machinery every planner shares: group classes, layer splits, pipeline templates and the search
space, the MILP formulation and its LP bounds, assembly into a concrete plan, schedules, local improvement and the
symmetry of large clusters. Imports no planner (``.importlinter``)."""
