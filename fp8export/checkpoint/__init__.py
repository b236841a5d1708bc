"""Read a checkpoint (HF folder, safetensors, torch, Keras, Transformer Engine, torchao) into a
``Checkpoint``: tensor infos, lazy loads, the model config and the FP8 training state."""
