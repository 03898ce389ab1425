"""The kubelet adapter: the device-plugin gRPC server, registration, and (later) the pod-resources client."""
