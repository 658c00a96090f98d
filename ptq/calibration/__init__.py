"""Calibration: token batches and the block-by-block runner that collects statistics."""
