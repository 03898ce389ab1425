"""The GPU adapters (`mpsagent.gpu`): NVML (the real nvidia-ml-py over the fake library), health, and the driver's
per-container memory limits."""
