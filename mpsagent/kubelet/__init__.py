"""The floor both kubelet plugins stand on: the gRPC wire (`wire`: requests received within bounds, the one mapping
of a refusal or failure to a gRPC status), one served socket (`served_socket`), what the kubelet answered a
plugin's registration (`registration_record`), the pod-resources client that reconciles the ledgers
(`podresources`), and the node guard (one agent per resource and GPU of a node). The two plugins are its siblings:
`deviceplugin/` and `dra/`."""
