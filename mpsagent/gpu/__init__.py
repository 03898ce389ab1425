"""The GPU adapters: NVML, node snapshot files, the port they both satisfy, and the health monitor."""
