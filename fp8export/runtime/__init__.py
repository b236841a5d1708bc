"""The FP8 inference runtime: E4M3 linears (``Fp8Linear``, fused projections), their GEMMs and
quantize kernels (per tensor, channel, token and block), the FP8 KV-cache emulation, and the
loader of an FP8 folder into a torch model. Runners (``fp8export.runners``) run it."""
