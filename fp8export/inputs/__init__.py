"""Input data shared by calibration and verification (heavy imports stay inside functions).

- :mod:`.samples`: sample files (.txt / .jsonl / .npz / .safetensors) -> tokens -> padded
  batches.
- :mod:`.tokenizer`: the checkpoint's tokenizer, loaded from a private copy made through the
  guarded reader.
"""
