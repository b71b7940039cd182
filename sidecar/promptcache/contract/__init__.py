"""The wire contracts shared by the sidecar and its clients: chunk keys, the chunk layout, proto conversions,
gRPC data frames, shared-memory files, the bulk channel's framing, quantization and Kubernetes quantities."""
