"""The repository's tools: the bench (bench/) and the hardware check (scripts/hardware_check.py)."""
