"""The FP8 torch runtime: an FP8 folder loaded as E4M3 linears with their GEMMs and quantize
kernels (tensor, channel, token, block), the FP8 KV cache and FP8 attention."""
