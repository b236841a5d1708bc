"""Checkpoint readers, tensor selection, FP8 writers and the convert pipeline."""
