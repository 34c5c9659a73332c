"""Stage 0, what the user describes: the cluster, the model and the training settings (YAML -> pydantic),
and ``arithmetic``: the model's parameters, FLOPs and activation bytes, whatever the cluster.

Imports nothing of hetrain but ``errors`` and ``files``; everything else builds on it.
"""
