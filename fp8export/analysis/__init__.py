"""Measurements of FP8 layers, below both convert and verify: per-layer attribution, the
accuracy-budget search (which layers stay in high precision), bootstrap confidence of metrics."""
