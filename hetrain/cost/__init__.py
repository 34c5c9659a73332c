"""Stage 2, predict: the one cost model (iteration time, per-device memory) that the planners,
the benchmarks and the reports call. Torch-free; may import ``spec``, ``profiling.profile`` and ``plan``.

``collectives`` (all-reduce, all-gather and send times), ``pipeline`` (a pipeline's time: 1F1B in
closed form, eager 1F1B and torch's 1F1B played out), ``stage`` (per-stage unit costs: compute, TP
communication, memory), ``costmodel`` (``CostModel``: the estimate of a whole plan), ``report``
(plan rows, where the time goes). The model's own arithmetic is ``hetrain.spec.arithmetic``.
"""
