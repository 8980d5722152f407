"""tether.server: engine, sessions, batched verifier, streaming, gRPC service, training and the `tether-server` CLI."""
