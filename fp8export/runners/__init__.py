"""Runners: one interface (activate / infer / deactivate) over torch, onnxruntime, TensorRT."""
