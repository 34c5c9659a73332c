"""Stage 4, checkpoints: ``manifest`` the committed-step contract (which files, their hashes, which
nodes hold them); ``store`` one checkpoint root (a URL and its options: its steps, manifests,
pruning); ``save`` each rank's DCP shard and the collective commit; ``backup`` the background
upload; ``peer`` the read-only server; ``reassemble`` fetches the newest step from peers then
the bucket, verified; ``safe_metadata`` reads DCP's pickled index without running code.
Only ``save`` runs inside training (torch.distributed); the rest is control plane.
"""

# Here, not in ``reassemble`` which reads them, so the CLI's options can name them without importing fsspec.
PEER_TOKEN_ENV = "HETRAIN_PEER_TOKEN"
# Seconds without a byte before a peer counts as gone and its files are taken from another source: a live
# peer answers within milliseconds on any link, and a timeout on silence, not on the whole transfer, lets a
# multi-GB shard over a slow link finish.
PEER_SILENCE_S = 10.0
