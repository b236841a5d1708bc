"""Keras models rebuilt as torch modules without Keras: a checked graph of supported layers from
the saved config, their torch equivalents, weights from .keras / .weights.h5 or an FP8 folder."""
