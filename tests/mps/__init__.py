"""The MPS adapter (`mpsagent.mps`): the real `nvidia-cuda-mps-control` under the agent's supervision, its control
log, its record, its root, and who holds its socket."""
