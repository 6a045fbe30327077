"""Pure data, no I/O: internal types, converters, KV block hashing, names."""
