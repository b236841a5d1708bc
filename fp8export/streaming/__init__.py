"""Layer streaming: a model run one decoder layer at a time, read from its shards, the hidden
states kept on the device, in host memory or in a spill file; the plan that decides it."""
