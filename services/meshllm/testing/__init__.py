"""Test support: real etcd / nats-server processes, the engine conformance kit, fakes."""
