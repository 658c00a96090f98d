"""Checkpoint I/O in the compressed-tensors format."""
