"""Offline, seeded IMDB-like sentiment data and the word-level tokenizer the sample uses.

The Keras tutorial downloads IMDB; this machine has no network, so the script writes its own
reviews. Each review mixes praise and criticism of a film; its label is the sign of the net
sentiment, where "not"/"never"/"hardly" before an adjective flips it and "very"/"truly" doubles
it. 5 % of labels are flipped, as noisy crowd labels are, so no model reaches 100 %. Getting
the negations right needs context (attention), averaging word polarities does not suffice.

The tokenizer is deliberately simple and saved as JSON (``vocab.json``) so any other tool can
feed the model: lowercase, split into words and punctuation, ``[PAD]`` = 0, ``[UNK]`` = 1, pad
or truncate to ``sequence_length``.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path

POSITIVE = ("good great excellent wonderful superb brilliant moving charming delightful "
            "gripping clever beautiful stunning funny touching memorable enjoyable fresh "
            "powerful engaging inspired lovely solid masterful witty").split()
NEGATIVE = ("bad awful terrible boring dull weak clumsy tedious predictable bland messy "
            "lifeless silly forgettable painful shallow confusing annoying stale flat "
            "pointless dreadful lazy mediocre").split()
NEGATORS = ("not", "never", "hardly")
INTENSIFIERS = ("very", "truly", "really")
NOUNS = ("plot story acting script soundtrack cast ending dialogue direction pacing "
         "cinematography editing score finale premise lead villain hero twist humor "
         "atmosphere setting costumes effects camera work").split()
NAMES = ("anna ben carla david elena frank grace henry ivy jack kate leo maria nick olga "
         "paul rosa sam tina victor").split()
FILLER = [
    "i saw this film last weekend with my family .",
    "the theater was almost empty on a rainy tuesday .",
    "it runs a little over two hours .",
    "my friend recommended it after the festival .",
    "the trailer gave away most of the first act .",
    "it is based on a novel i have not read .",
    "the studio released it in the summer .",
    "there is a short scene after the credits .",
    "i watched the subtitled version at home .",
    "the director also wrote the screenplay .",
]
TEMPLATES = [
    "the {noun} was {adj} .",
    "i thought the {noun} was {adj} .",
    "{name} gave a {adj} performance as the {noun} .",
    "overall the {noun} felt {adj} .",
    "honestly , the {noun} is {adj} .",
    "what a {adj} {noun} .",
    "the {noun} and the {noun2} were {adj} .",
    "{name} said the {noun} was {adj} , and i agree .",
]

PAD, UNK = "[PAD]", "[UNK]"
_TOKEN = re.compile(r"[a-z0-9']+|[^\sa-z0-9']")


def _phrase(rng: random.Random, polarity: int) -> tuple[str, int]:
    """An adjective phrase and its signed weight; ``polarity`` is the meaning it must carry."""
    negate = rng.random() < 0.3
    intense = rng.random() < 0.25
    # A negated word carries the opposite polarity of the word itself.
    word_pol = -polarity if negate else polarity
    adj = rng.choice(POSITIVE if word_pol > 0 else NEGATIVE)
    words = []
    if negate:
        words.append(rng.choice(NEGATORS))
    if intense:
        words.append(rng.choice(INTENSIFIERS))
    words.append(adj)
    return " ".join(words), polarity * (2 if intense else 1)


def make_review(rng: random.Random) -> tuple[str, int]:
    """One review and its (noise-free) label."""
    lean = 1 if rng.random() < 0.5 else -1
    sentences, score = [], 0
    for _ in range(rng.randint(3, 9)):
        if rng.random() < 0.3:
            sentences.append(rng.choice(FILLER))
            continue
        polarity = lean if rng.random() < 0.68 else -lean
        adj, weight = _phrase(rng, polarity)
        score += weight
        sentences.append(rng.choice(TEMPLATES).format(
            noun=rng.choice(NOUNS), noun2=rng.choice(NOUNS), name=rng.choice(NAMES), adj=adj))
    if score == 0:  # break ties with a closing verdict, as reviewers do
        adj, weight = _phrase(rng, lean)
        sentences.append(f"in the end it was {adj} .")
        score += weight
    return " ".join(sentences), int(score > 0)


def make_split(n: int, seed: int, label_noise: float = 0.05) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        text, label = make_review(rng)
        if rng.random() < label_noise:
            label = 1 - label
        rows.append({"text": text, "label": label})
    return rows


def tokenize_words(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


def build_vocab(texts: list[str], max_size: int) -> list[str]:
    """Most frequent words first (ties alphabetical, so the result is reproducible)."""
    counts = Counter(w for t in texts for w in tokenize_words(t))
    words = sorted(counts, key=lambda w: (-counts[w], w))
    return [PAD, UNK] + words[: max_size - 2]


def encode(texts: list[str], vocab: list[str], sequence_length: int):
    import numpy as np

    index = {w: i for i, w in enumerate(vocab)}
    out = np.zeros((len(texts), sequence_length), dtype="int32")  # [PAD] = 0
    for row, text in enumerate(texts):
        ids = [index.get(w, 1) for w in tokenize_words(text)][:sequence_length]
        out[row, : len(ids)] = ids
    return out


def save_tokenizer(path: Path, vocab: list[str], sequence_length: int) -> None:
    path.write_text(json.dumps({
        "type": "word-level",
        "lowercase": True,
        "pattern": _TOKEN.pattern,
        "pad_token": PAD, "pad_id": 0, "unk_token": UNK, "unk_id": 1,
        "sequence_length": sequence_length,
        "padding": "right, with pad_id, to sequence_length; longer inputs are truncated",
        "vocab": vocab,
    }, indent=1) + "\n")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_eval_npz(path: Path, rows: list[dict], vocab: list[str], sequence_length: int) -> None:
    """The eval split as the model sees it: ``input_ids`` padded to ``sequence_length`` with
    ``[PAD]`` = 0 (no ``attention_mask``: the model reads the padding, as in training) and
    ``labels``. This is the ``--data`` file for ``fp8export verify``."""
    import numpy as np

    ids = encode([r["text"] for r in rows], vocab, sequence_length)
    labels = np.array([r["label"] for r in rows], dtype="int64")
    np.savez_compressed(path, input_ids=ids, labels=labels)


if __name__ == "__main__":  # rebuild data/eval.npz from data/eval.jsonl and data/vocab.json
    here = Path(__file__).resolve().parent / "data"
    tok = json.loads((here / "vocab.json").read_text())
    rows = [json.loads(line) for line in (here / "eval.jsonl").read_text().splitlines()]
    write_eval_npz(here / "eval.npz", rows, tok["vocab"], tok["sequence_length"])
