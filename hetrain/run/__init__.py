"""A run's start, owned once: check -> config -> prepare -> write the plan -> launch (``start_run``).

``hetrain train``, the Python API (``hetrain.train``), the Prefect flows and recovery each build a
``RunRequest`` and call ``start_run``; nothing else spells the sequence out.
"""
