"""The discovery plane: instances and model cards (etcd | memory | static)."""
