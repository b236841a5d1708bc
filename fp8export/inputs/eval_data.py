"""The inputs verify feeds to both runners: the user's data file, or a built-in sample set.

Data files are read exactly as calibration reads them (``fp8export.inputs.samples``). With
no ``--data`` a small built-in set is used, and the report says so: a handful of English
sentences tokenised with the reference's tokenizer, or, when the reference has no tokenizer,
fixed pseudo-random token ids (seed 0). Either proves the artifact runs and matches on
generic input; only your own data proves it on your task.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from fp8export.errors import Fp8ExportError

BUILTIN_TEXTS = (
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "In 1969, two astronauts walked on the Moon and returned safely to Earth days later.",
    "Photosynthesis converts light energy into chemical energy stored in glucose molecules.",
    "To install the package, create a virtual environment and run pip install with the name.",
    "She opened the old wooden box and found a stack of letters tied with a faded ribbon.",
    "The central bank raised interest rates by a quarter point to slow rising inflation.",
    "def add(a, b):\n    return a + b  # a function that returns the sum of two numbers",
    "Mount Everest, the highest mountain above sea level, lies on the border of Nepal and China.",
    "After the rain stopped, the children ran outside to jump in the puddles on the street.",
    "A transformer model processes tokens in parallel using attention over the whole sequence.",
    "The recipe calls for two cups of flour, one egg, a pinch of salt and a cup of warm milk.",
    "Water boils at one hundred degrees Celsius at sea level and at lower temperatures above.",
    "The museum's new exhibition brings together paintings from four centuries of history.",
    "Please send the quarterly report to the finance team before the end of the week.",
    "The train to the coast leaves at seven, so we should be at the station by half past six.",
    "Honey never spoils: archaeologists have found edible honey in ancient Egyptian tombs.",
)
RANDOM_SAMPLES = 8
RANDOM_LEN = 32


def tokenizer_folder(reference: Path) -> Path:
    """Where the reference's tokenizer lives (a weights file's folder)."""
    return reference if reference.is_dir() else reference.parent


def load_verify_samples(data: Path | None, reference: Path, config: dict[str, Any], *,
                        samples: int | None, seq_len: int | None, tokenizer=None):
    """``(Samples, data_info)`` for verify; ``data_info`` is JSON-serialisable for the report.

    ``tokenizer``: the reference's open tokenizer (:func:`~fp8export.inputs.tokenizer.
    open_tokenizer`), used for text and left open; None opens one when text needs it."""
    from fp8export.inputs.samples import as_samples, load_samples
    from fp8export.inputs.tokenizer import has_tokenizer
    from fp8export.models import task_of, vocab_size

    tok_dir = tokenizer_folder(reference)
    max_pos = config.get("max_position_embeddings") or config.get("n_positions")
    vocab = vocab_size(config)
    labels = None
    if task_of(config) == "seq-cls":  # other configs carry a default id2label of 2 classes
        labels = config.get("num_labels") or len(config.get("id2label") or {}) or None
    if data is not None:
        s = load_samples(data, tok_dir, max_samples=samples, seq_len=seq_len,
                         max_positions=max_pos, vocab_size=vocab, num_labels=labels,
                         tokenizer=tokenizer)
        if len(s) == 0:
            raise Fp8ExportError(f"{data}: no usable samples in the data file. Give at least "
                                 "one non-empty line / record.")
        found = {"source": str(data), "builtin": False, "samples": len(s),
                 "tokens": s.num_tokens, "truncated": s.truncated}
        if s.media is not None:  # images / audio through the model's processor
            found["media"] = s.media
            found["note"] = (f"Inputs: {s.media['images']} image, {s.media['audio']} audio and "
                             f"{s.media['text_only']} text-only sample(s), encoded by the "
                             f"model's {s.media['processor']}; one sample per batch.")
        return s, found
    if has_tokenizer(tok_dir):
        texts = BUILTIN_TEXTS[:samples] if samples else BUILTIN_TEXTS
        with tempfile.TemporaryDirectory() as tmp:
            f = Path(tmp) / "builtin.txt"
            f.write_text("\n".join(t.replace("\n", " ") for t in texts) + "\n", encoding="utf-8")
            s = load_samples(f, tok_dir, seq_len=seq_len, max_positions=max_pos,
                             vocab_size=vocab, tokenizer=tokenizer)
        note = (f"No --data given: used fp8export's built-in sample set ({len(s)} short English "
                "sentences, tokenised with the reference's tokenizer). Pass --data with your "
                "own evaluation data for a verdict about your task.")
        return s, {"source": "builtin:sentences", "builtin": True, "samples": len(s),
                   "tokens": s.num_tokens, "note": note}
    import numpy as np

    vocab = vocab or 0
    if vocab < 2:
        raise Fp8ExportError(f"{reference}: no --data, no tokenizer and no vocab_size in "
                             "config.json, so verify cannot make inputs. Pass --data with a "
                             ".npz/.safetensors file of input_ids.")
    n = samples or RANDOM_SAMPLES
    length = min(seq_len or RANDOM_LEN, RANDOM_LEN, int(max_pos or RANDOM_LEN))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, size=(n, length)).tolist()
    s = as_samples(ids, pad_id=0, source="builtin:random-tokens")
    note = (f"No --data given and the reference has no tokenizer: used {n} pseudo-random token "
            f"sequences of length {length} (seed 0). Random tokens are harsher than real text on "
            "some metrics; pass --data with your own evaluation data for a meaningful verdict.")
    return s, {"source": "builtin:random-tokens", "builtin": True, "samples": n,
               "tokens": n * length, "note": note}
