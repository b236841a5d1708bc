"""Runners: one interface (activate / infer / deactivate) over the torch reference, the FP8 torch
runtime, onnxruntime, TensorRT and Keras, giving logits for token ids."""
