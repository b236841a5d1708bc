"""The FP8 folder: output formats (dialects), manifest, safetensors writer, shard layout,
read-back."""
