"""hetrain: train large models on mixed, preemptible GPUs.

Data flows one way: specs -> profile -> plan (``hetrain.plan/v1``) -> runtime ->
checkpoints -> recovery -> new plan. This package never imports Prefect.
"""

__version__ = "0.1.0"
