"""The events plane: protobuf events on subjects (NATS | memory | none), and publish pacing."""
