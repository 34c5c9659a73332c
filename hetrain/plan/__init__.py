"""The plan, the contract between planning and training: ``schema`` is the ``hetrain.plan/v1`` file
(pipelines, stages, devices, micro-batches) and its validation; ``layout`` turns a plan into ranks,
groups and gradient buckets. Torch-free; may import ``spec``. The planners live in ``solver/``.
"""
