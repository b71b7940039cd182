"""The node-local cache server: memory (device) tier, gRPC service, metrics, configuration."""
