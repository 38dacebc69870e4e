"""Calibration: codebooks fitted to a model's keys and values, per-layer bit allocation, key-split
search, and the codebooks file format."""
