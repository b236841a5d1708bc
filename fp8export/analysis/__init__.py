"""Measurements of FP8 layers, below both convert and verify: per-layer attribution, the
accuracy-budget search of which layers to keep in high precision, and the bootstrap confidence
of the metrics."""
