"""Readers of FP8 training state: the amax histories and stored scales that Transformer Engine,
Keras float8 and torchao leave in a checkpoint."""
