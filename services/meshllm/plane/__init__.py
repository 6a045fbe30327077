"""The planes: request (gRPC transport), discovery (etcd | memory | static), events (NATS | memory)."""
