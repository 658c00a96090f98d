"""Quantization algorithms: pure functions over tensors."""
