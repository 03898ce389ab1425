"""The GPU adapters: NVML, node snapshot files, and the port they both satisfy."""
