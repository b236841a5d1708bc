"""``export-onnx``: an FP8 folder traced to a standard ONNX Q/DQ graph, checked against TensorRT's
FP8 rules and onnx.checker, and run at every onnxruntime optimization level before it is kept."""
