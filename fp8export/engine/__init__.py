"""TensorRT engine build and inspection (imports tensorrt lazily)."""
