"""Comparison of reference and candidate outputs and its judgement against thresholds."""
