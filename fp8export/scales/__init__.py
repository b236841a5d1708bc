"""Which linear weights become FP8 (families, fused groups, target selection) and their scales:
weight amax and E4M3 round trip, activation ranges, the training-history policy."""
