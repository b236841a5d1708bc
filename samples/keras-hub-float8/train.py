"""The Keras tutorial "Float8 training and inference with a simple Transformer model", as written.

The model is the tutorial's ``build_model``: ``keras_hub.layers.TokenAndPositionEmbedding`` and
``keras_hub.layers.TransformerDecoder``, mean pooling and a small head. It is trained twice under
``mixed_bfloat16`` (Adam, batch 32, 3 epochs): (a) as is, (b) a fresh model after
``model.quantize("float8")``. Keras 3 runs on the torch backend on CPU; keras-hub installs
without TensorFlow (``pip install --no-deps keras-hub`` plus tokenizers, sentencepiece,
kagglehub, absl-py, regex, rich) because the model layers never touch it.

Two substitutions, both for this machine (no network, no TensorFlow):
- data: the seeded synthetic reviews of ``../keras-float8/data_gen.py`` instead of IMDB;
- tokenizer: a WordPiece vocabulary trained with the ``tokenizers`` library (lowercase,
  ``[PAD]`` = 0, ``[UNK]`` = 1, padded/truncated to 128) instead of keras_hub's
  ``compute_word_piece_vocabulary`` and ``WordPieceTokenizer``, which need tensorflow-text.

Writes:
  model/bf16_model.keras, model/float8_model.keras   the two trained models (config + weights)
  data/tokenizer.json                                the WordPiece tokenizer
  data/eval.jsonl                                    the eval split (text, label)
  data/eval.npz                                      the eval split tokenised (verify --data)
  results.json                                       Keras's accuracies, settings, versions

Run:  KERAS_BACKEND=torch .venv/bin/python samples/keras-hub-float8/train.py [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

if os.environ.setdefault("KERAS_BACKEND", "torch") != "torch":
    sys.exit("This sample runs Keras on the torch backend: set KERAS_BACKEND=torch.")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
SEED = 42
EPOCHS = 3
BATCH_SIZE = 32
VOCABULARY_SIZE = 20000  # the tutorial's cap; the synthetic corpus needs far fewer pieces
MAX_SEQUENCE_LENGTH = 128  # the tutorial pads IMDB to 200; these reviews are shorter
MODEL_KWARGS = dict(max_sequence_length=MAX_SEQUENCE_LENGTH, hidden_dim=32, num_heads=2,
                    intermediate_dim=32, dropout=0.1)
SPLITS = {"train": 20000, "val": 2000, "eval": 1000}  # as ../keras-float8 (same seeds)


def _data_gen():
    """The synthetic review generator shared with the look-alike sample."""
    spec = importlib.util.spec_from_file_location("kerasf8_data_gen",
                                                  HERE.parent / "keras-float8" / "data_gen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_model(vocabulary_size=20000, max_sequence_length=200, hidden_dim=32, num_heads=2,
                intermediate_dim=32, dropout=0.1):
    """The tutorial's ``build_model``, verbatim."""
    token_id_input = keras.layers.Input(shape=(None,), dtype="int32", name="input_ids")
    x = keras_hub.layers.TokenAndPositionEmbedding(
        vocabulary_size=vocabulary_size,
        sequence_length=max_sequence_length,
        embedding_dim=hidden_dim,
    )(token_id_input)
    x = keras.layers.Dropout(rate=dropout)(x)
    x = keras_hub.layers.TransformerDecoder(
        intermediate_dim=intermediate_dim,
        num_heads=num_heads,
        dropout=dropout,
    )(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dropout(dropout)(x)
    x = keras.layers.Dense(intermediate_dim, activation="relu")(x)
    x = keras.layers.Dropout(dropout)(x)
    outputs = keras.layers.Dense(1, activation="sigmoid")(x)
    return keras.Model(inputs=token_id_input, outputs=outputs)


def train_word_piece(texts, vocab_size, reserved_tokens):
    """WordPiece vocabulary and tokenizer (the tutorial's ``train_word_piece``, in tokenizers)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=reserved_tokens,
                                        show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.enable_padding(length=MAX_SEQUENCE_LENGTH, pad_id=0, pad_token="[PAD]")
    tokenizer.enable_truncation(MAX_SEQUENCE_LENGTH)
    return tokenizer


def encode(tokenizer, texts) -> np.ndarray:
    return np.array([e.ids for e in tokenizer.encode_batch(texts)], dtype="int32")


def fit_and_evaluate(name, model, data, epochs):
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    start = time.perf_counter()
    history = model.fit(data["train"][0], data["train"][1], batch_size=BATCH_SIZE,
                        epochs=epochs, validation_data=data["val"], verbose=2)
    train_s = time.perf_counter() - start
    loss, acc = model.evaluate(data["eval"][0], data["eval"][1], batch_size=BATCH_SIZE,
                               verbose=0)
    print(f"Accuracy ({name}): {acc:.2%}")
    return {"accuracy": float(acc), "loss": float(loss), "train_seconds": round(train_s, 1),
            "val_accuracy": [float(a) for a in history.history["val_accuracy"]],
            "steps": int(model.optimizer.iterations.numpy())}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 epoch on 2000 reviews (smoke test)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--out", type=Path, default=HERE, help="where data/, model/ and results go")
    args = ap.parse_args(argv)
    splits = dict(SPLITS, train=2000, val=500) if args.quick else SPLITS
    epochs = 1 if args.quick else EPOCHS
    torch.set_num_threads(args.threads)  # a tiny model: more threads only spin-wait

    data_gen = _data_gen()
    rows = {name: data_gen.make_split(n, seed=SEED + i)
            for i, (name, n) in enumerate(splits.items())}
    tokenizer = train_word_piece([r["text"] for r in rows["train"]], VOCABULARY_SIZE,
                                 ["[PAD]", "[UNK]"])
    data = {name: (encode(tokenizer, [r["text"] for r in rs]),
                   np.array([r["label"] for r in rs], dtype="float32"))
            for name, rs in rows.items()}
    vocabulary_size = tokenizer.get_vocab_size()
    (args.out / "data").mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out / "data" / "tokenizer.json"))
    data_gen.write_jsonl(args.out / "data" / "eval.jsonl", rows["eval"])
    np.savez_compressed(args.out / "data" / "eval.npz", input_ids=data["eval"][0],
                        labels=data["eval"][1].astype("int64"))
    print(f"WordPiece vocabulary: {vocabulary_size} pieces; splits: "
          + ", ".join(f"{k}={len(v)}" for k, v in rows.items()))

    results = {"keras": keras.__version__, "keras_hub": keras_hub.__version__,
               "backend": keras.backend.backend(), "epochs": epochs, "batch_size": BATCH_SIZE,
               "splits": splits, "vocabulary_size": vocabulary_size, "model": MODEL_KWARGS}
    model_dir = args.out / "model"
    model_dir.mkdir(exist_ok=True)
    for name, quantize in (("mixed_bfloat16", False), ("float8", True)):
        # a fresh session per model: plain layer names (dense, dense_1) in both files
        keras.backend.clear_session()
        keras.config.set_dtype_policy("mixed_bfloat16")
        keras.utils.set_random_seed(SEED)
        model = build_model(vocabulary_size=vocabulary_size, **MODEL_KWARGS)
        if quantize:
            model.quantize("float8")
            results["float8_layers"] = [layer.path for layer in model._flatten_layers()
                                        if "float8" in str(layer.dtype_policy.name)]
        results[name] = fit_and_evaluate(name, model, data, epochs)
        model.save(model_dir / ("float8_model.keras" if quantize else "bf16_model.keras"))

    print()
    print("| Precision      | Accuracy (eval split) |")
    print("|----------------|-----------------------|")
    for name in ("mixed_bfloat16", "float8"):
        print(f"| {name:<14} | {results[name]['accuracy']:.2%}                |")
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
