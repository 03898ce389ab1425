"""Benchmarks of the agent as a real process against a minimal grpclib server (the floor): `python bench/run.py`."""
