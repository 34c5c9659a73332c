"""Stage 0, what the user describes: the cluster, the model and the training settings (YAML -> pydantic).

Imports nothing of hetrain but ``errors`` and ``files``; everything else builds on it.
"""
