"""Switchyard control plane: the public gRPC API, routing and worker supervision."""
