"""Comparison of reference and candidate outputs, thresholds, and reports."""
