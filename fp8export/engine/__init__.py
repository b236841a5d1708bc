"""``build-engine``: a TensorRT FP8 engine from the Q/DQ graph (the tensorrt package or trtexec,
imported lazily) and the per-layer precision report of what it built."""
