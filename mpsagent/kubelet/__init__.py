"""The kubelet adapter: the device-plugin servicer and its endpoint (serve, register, follow the kubelet's
restarts), the pod-resources client that reconciles the ledgers, and the node guard (one agent per resource and GPU
of a node)."""
