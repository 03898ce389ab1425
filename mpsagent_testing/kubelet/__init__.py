"""grpcio stand-ins for the kubelet (an independent gRPC implementation, as the real kubelet's grpc-go is)."""
