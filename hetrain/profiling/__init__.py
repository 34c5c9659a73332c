"""Stage 1, profile: per-layer times and activation memory measured on each GPU type.

``profile`` is the file contract (``hetrain.profile/v1``, torch-free); ``profiler`` measures
(torch), ``timing`` is how (the clocks, autocast, the kept bytes). May import ``spec`` (model
arithmetic: ``spec.arithmetic``), never ``cost``: the cost model reads profiles, never the profiler.
"""
