"""Tiny Keras 3 models saved the way users save them (helpers for the test_keras_* files).

Built with real Keras on the torch backend and trained a few steps after
``model.quantize("float8")`` so the float8 variables hold real histories. Cached per process.
"""

from __future__ import annotations

import json
import os
import shutil
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")


def keras_or_skip():
    if os.environ["KERAS_BACKEND"] != "torch":
        pytest.skip("these tests run Keras on the torch backend")
    return pytest.importorskip("keras")


def build_tiny(keras, float8: bool = True):
    """Embedding → MHA (EinsumDense projections) → EinsumDense → pool → Dense → Dense(no bias)."""
    inp = keras.Input((6,), dtype="int32", name="input_ids")
    x = keras.layers.Embedding(40, 8, name="embed")(inp)
    x = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, name="mha")(x, x)
    x = keras.layers.EinsumDense("abc,cd->abd", output_shape=(None, 12), bias_axes="d",
                                 name="proj")(x)
    x = keras.layers.EinsumDense("abc,dc->abd", output_shape=(None, 8), name="back")(x)
    x = keras.layers.LayerNormalization(name="norm")(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dense(8, activation="relu", name="hidden")(x)
    out = keras.layers.Dense(1, activation="sigmoid", use_bias=False, name="head")(x)
    model = keras.Model(inp, out)
    if float8:
        model.quantize("float8")
    return model


def train_steps(model, steps: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 40, (16 * steps, 6)).astype("int32")
    y = (x[:, 0] > 20).astype("float32")
    model.compile(optimizer="adam", loss="binary_crossentropy")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    return model


@lru_cache(maxsize=1)
def _saved(root: str) -> dict:
    keras = keras_or_skip()
    keras.utils.set_random_seed(1)
    model = train_steps(build_tiny(keras))
    out = Path(root)
    model.save(out / "tiny.keras")
    wdir = out / "weights"
    wdir.mkdir()
    model.save_weights(wdir / "tiny.weights.h5")
    (wdir / "config.json").write_text(model.to_json())
    values = {v.path: np.array(v.numpy()) for v in model.variables}
    return {"keras": out / "tiny.keras", "h5": wdir / "tiny.weights.h5", "values": values,
            "model": model}


def saved_tiny(tmp_path_factory) -> dict:
    """Paths to the tiny float8 model as .keras and as .weights.h5 + config.json (shared)."""
    root = tmp_path_factory.getbasetemp() / "keras-tiny"
    if not root.exists():
        root.mkdir()
    return _saved(str(root))


def copy_pair(saved: dict, dest: Path) -> Path:
    """A private copy of the .weights.h5 + config.json pair (tests that edit files use it)."""
    dest.mkdir(parents=True, exist_ok=True)
    h5 = shutil.copy(saved["h5"], dest / "tiny.weights.h5")
    shutil.copy(saved["h5"].parent / "config.json", dest / "config.json")
    return Path(h5)


def edit_config(path: Path, fn) -> None:
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg))


def layer_entry(cfg: dict, name: str) -> dict:
    for entry in cfg["config"]["layers"]:
        if entry["config"].get("name") == name:
            return entry
    raise KeyError(name)
