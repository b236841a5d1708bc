"""Keras models rebuilt as torch modules from their saved config and weights, without Keras.

``config`` turns a Keras ``config.json`` into a checked graph of supported layers (nothing in it
is imported or run), ``layers`` holds the torch modules that compute what those Keras and
keras_hub layers compute, ``weights`` reads their tensors from a ``.keras`` / ``.weights.h5``
file or an FP8 folder, and ``build`` puts the three together into one ``torch.nn.Module``.
"""
