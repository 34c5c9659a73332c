"""Stage 4, checkpoints: ``manifest`` the committed-step contract (which files, their hashes, which
nodes hold them); ``save`` each rank's DCP shard and the collective commit; ``backup`` the
background upload; ``peer`` the read-only server; ``reassemble`` fetches the newest step from
peers then the bucket, verified; ``safe_metadata`` reads DCP's pickled index without running code.
Only ``save`` runs inside training (torch.distributed); the rest is control plane.
"""
