"""The FP8 folder: its dialects, shards, config and manifest as written and read back, and the one
reader of every FP8 folder (ours and other tools') as the engines its config names read it."""
