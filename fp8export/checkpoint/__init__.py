"""Checkpoint readers: the source registry and the safetensors, torch, Keras and training-state
readers, and the model config."""
