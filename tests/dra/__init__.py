"""The DRA driver (`mpsagent.dra`): the API client and its conversions, the slice publisher, CDI specs, the
checkpoint, the kubelet's gRPC services, and the agent with `--dra on`."""
