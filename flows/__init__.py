"""Prefect flows over the hetrain library (orchestration issue): profile -> plan -> train, recovery."""
