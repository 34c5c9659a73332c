"""hetrain: train large models on mixed, preemptible GPUs.

Data flows one way, one subpackage per stage: ``spec`` -> ``profiling`` -> plan (``solver``
writes ``hetrain.plan/v1``, ``plan``) -> ``runtime`` -> ``checkpoint`` -> ``recovery`` -> new
plan; ``cost`` predicts for all of them and ``config`` is the run's file. This package never
imports Prefect; only ``cli`` imports the planners (.importlinter checks both).
"""

__version__ = "0.1.0"
