"""The request plane: Generate streams between processes (gRPC calls, sessions on gRPC or TCP, in process) and its servers."""
