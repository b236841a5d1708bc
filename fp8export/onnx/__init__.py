"""ONNX export, Q/DQ rewrite and the TensorRT-rule structural checker."""
