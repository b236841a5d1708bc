"""Which linear weights become FP8 (families, fused groups, selection) and their scales: weight
amax and round trip, activation ranges, the training-history policy."""
