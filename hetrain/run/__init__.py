"""A run's start, owned once: check -> config -> prepare -> write the plan -> launch (``start_run``).

``hetrain train``, the Python API (``hetrain.train``) and the Prefect flows each build a
``RunRequest`` and call ``start_run``; nothing else spells the sequence out (a recovery continues a
run rather than starting one, and launches from the reassembled step).
"""
