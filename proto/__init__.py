"""Wire protocol: generated protobuf/gRPC stubs for proto/gossip.proto (data only)."""
