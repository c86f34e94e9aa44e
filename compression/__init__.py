"""Compression library: tensors in, bytes out. Knows nothing of gRPC or peers."""
