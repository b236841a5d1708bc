"""``verify``: reference and candidate run on the same tokens, their outputs compared (KL, top-1,
perplexity, per-layer SQNR) and judged against thresholds into a ``VerifyResult``."""
