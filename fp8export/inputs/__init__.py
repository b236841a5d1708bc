"""Input data shared by calibration and verification: sample files (text, jsonl with media, token
arrays) tokenised by the checkpoint's guarded tokenizer copy into padded batches."""
