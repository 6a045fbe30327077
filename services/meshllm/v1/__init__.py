"""Generated protobuf and gRPC code of the meshllm.v1 contracts — do not edit."""
