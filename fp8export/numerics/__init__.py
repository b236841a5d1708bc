"""FP8 numerics (E4M3 encode/decode, amax→scale) and accuracy metrics. Imports torch."""
