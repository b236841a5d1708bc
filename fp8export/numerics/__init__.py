"""FP8 numerics with one scale convention (scale = amax / 448): E4M3 encode and decode, per
tensor, channel and block scales, GPTQ on the E4M3 grid, SQNR and the accuracy metrics."""
