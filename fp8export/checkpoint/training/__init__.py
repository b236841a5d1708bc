"""Readers of FP8 training state (amax histories): Transformer Engine, Keras float8, torchao."""
