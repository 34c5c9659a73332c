"""Stage 2, predict: the one cost model (iteration time, per-device memory) that the planners,
the benchmarks and the reports call. Torch-free; may import ``spec``, ``profiling.profile`` and ``plan``.
"""
