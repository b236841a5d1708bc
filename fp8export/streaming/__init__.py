"""Layer streaming: a model run one decoder layer (or block of layers) at a time, its weights
read from the checkpoint's shards as each layer runs, the hidden states of every sample kept on
the device, in host memory or in a spill file between layers (docs/architecture.md; README
"Models larger than one GPU")."""
