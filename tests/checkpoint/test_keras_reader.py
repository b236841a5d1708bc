"""The Keras reader against real Keras 3 files: names, layouts, float8 detection, orientation."""

from __future__ import annotations

import numpy as np
import pytest
from test_keras_fixtures import (
    build_tiny,
    copy_pair,
    edit_config,
    keras_or_skip,
    layer_entry,
    saved_tiny,
)

from fp8export.checkpoint.keras_reader import KerasCheckpoint, einsum_kernel_2d, is_float8_policy
from fp8export.checkpoint.source import open_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # Keras: "no quantize method"

FLOAT8 = {"mha.query", "mha.key", "mha.value", "mha.attention_output", "proj", "back",
          "hidden", "head"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return saved_tiny(tmp_path_factory)


@pytest.mark.parametrize("kind", ["keras", "h5"])
def test_tensors_names_and_layouts(tiny, kind):
    with open_checkpoint(tiny[kind]) as ckpt:
        assert isinstance(ckpt, KerasCheckpoint) and ckpt.kind == "keras"
        infos = {t.name: t for t in ckpt.tensors()}
        assert set(ckpt.float8_modules()) == FLOAT8
        # Dense: [in, out] as stored; EinsumDense: 2-D views; bias-less head has no bias.
        assert infos["hidden.weight"].shape == (8, 8) and infos["hidden.weight"].transposed
        assert infos["head.weight"].shape == (8, 1) and "head.bias" not in infos
        assert infos["mha.query.weight"].shape == (8, 8) and infos["mha.query.weight"].transposed
        assert infos["mha.query.bias"].shape == (8,)
        assert infos["mha.attention_output.weight"].shape == (8, 8)
        assert infos["proj.weight"].shape == (8, 12) and infos["proj.weight"].transposed
        assert infos["back.weight"].shape == (8, 12) and not infos["back.weight"].transposed
        assert infos["embed.embeddings"].shape == (40, 8)
        assert {"norm.gamma", "norm.beta"} <= set(infos)
        # float8 variables are training state, never tensors; nor are optimizer slots
        assert not [n for n in infos if "amax" in n or "scale" in n or "optimizer" in n]
        assert all(t.dtype == "F32" for t in infos.values())


@pytest.mark.parametrize("kind", ["keras", "h5"])
def test_loaded_values_are_the_keras_variables(tiny, kind):
    values = tiny["values"]
    with open_checkpoint(tiny[kind]) as ckpt:
        for name, path in [("hidden.weight", "hidden/kernel"), ("hidden.bias", "hidden/bias"),
                           ("head.weight", "head/kernel"), ("embed.embeddings", "embed/embeddings"),
                           ("mha.query.weight", "mha/query/kernel"),
                           ("back.weight", "back/kernel")]:
            got = ckpt.load(name).numpy()
            want = values[path]
            assert got.shape == ckpt.info(name).shape
            np.testing.assert_array_equal(got, want.reshape(got.shape))


def test_two_d_views_compute_what_the_layers_compute(tmp_path):
    """x @ W (transposed=True) or x @ W.T (False) plus bias must equal each layer's output."""
    keras = keras_or_skip()
    keras.utils.set_random_seed(3)
    model = build_tiny(keras, float8=False)
    model.save(tmp_path / "plain.keras")
    x = np.random.default_rng(0).standard_normal((2, 6, 8)).astype("float32")
    h = np.random.default_rng(1).standard_normal((2, 6, 12)).astype("float32")
    mha = model.get_layer("mha")
    cases = {"mha.query": (mha._query_dense, x), "mha.value": (mha._value_dense, x),
             "mha.attention_output": (mha._output_dense, x.reshape(2, 6, 2, 4)),
             "proj": (model.get_layer("proj"), x), "back": (model.get_layer("back"), h)}
    with open_checkpoint(tmp_path / "plain.keras") as ckpt:
        for module, (layer, inp) in cases.items():
            w = ckpt.load(f"{module}.weight").numpy()
            w = w if ckpt.info(f"{module}.weight").transposed else w.T
            flat = inp.reshape(2, 6, w.shape[0])
            ours = flat @ w
            if f"{module}.bias" in {t.name for t in ckpt.tensors()}:
                ours = ours + ckpt.load(f"{module}.bias").numpy()
            theirs = np.asarray(layer(inp).detach().cpu()).reshape(ours.shape)
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5, err_msg=module)
        assert ckpt.float8_modules() == [] and ckpt.training_state() is None


def test_keras_33_policy_form_is_recognised(tiny, tmp_path):
    h5 = copy_pair(tiny, tmp_path)

    def to_33(cfg):
        entry = layer_entry(cfg, "hidden")
        entry["config"]["dtype"] = {"module": "keras.dtype_policies",
                                    "class_name": "QuantizedFloat8DTypePolicy",
                                    "config": {"name": "float8_from_float32",
                                               "amax_history_length": 1024}}
    edit_config(tmp_path / "config.json", to_33)
    with open_checkpoint(h5) as ckpt:
        assert "hidden" in ckpt.float8_modules()
        assert not any("variable layout" in n for n in
                       next(la for la in ckpt.layers if la.module == "hidden").notes)


def test_is_float8_policy_forms():
    assert is_float8_policy("float8_from_mixed_bfloat16")
    assert is_float8_policy({"class_name": "QuantizedFloat8DTypePolicy",
                             "config": {"mode": "float8", "source_name": "float32"}})
    assert is_float8_policy({"module": "keras", "class_name": "DTypePolicy",
                             "config": {"name": "float8_from_float32"}})
    assert not is_float8_policy({"class_name": "DTypePolicy", "config": {"name": "float32"}})
    assert not is_float8_policy({"class_name": "QuantizedDTypePolicy",
                                 "config": {"mode": "int8", "source_name": "float32"}})
    assert not is_float8_policy("mixed_bfloat16") and not is_float8_policy(None)


@pytest.mark.parametrize("equation,shape,expected", [
    ("abc,cde->abde", (32, 2, 16), ((32, 32), True)),     # MHA query/key/value
    ("abcd,cde->abe", (2, 16, 32), ((32, 32), True)),     # MHA attention output
    ("btd,dnh->btnh", (8, 2, 4), ((8, 8), True)),
    ("abc,cd->abd", (8, 12), ((8, 12), True)),
    ("ab,cb->ac", (5, 3), ((5, 3), False)),               # kernel [out, in]
    ("...b,bc->...c", (4, 6), ((4, 6), True)),
    ("abcd,dce->abe", (4, 2, 8), None),                   # contraction order differs from input
    ("abc,acd->abd", (2, 8, 4), None),                    # batched kernel: not a linear layer
    ("abc,cd->abd", (8, 12, 1), None),                    # rank mismatch
])
def test_einsum_kernel_2d(equation, shape, expected):
    assert einsum_kernel_2d(equation, shape) == expected


def test_names_follow_layer_paths_for_nested_layers(tmp_path):
    """Layers inside a custom layer: dotted layer-name paths, float8 found by layout."""
    keras = keras_or_skip()

    class Block(keras.layers.Layer):
        def build(self, shape):
            self.inner = keras.layers.Dense(4, name="inner")
            self.inner.build(shape)

        def call(self, x):
            return self.inner(x)

    inp = keras.Input((3,))
    model = keras.Model(inp, Block(name="block")(inp))
    model.quantize("float8")
    model.save_weights(tmp_path / "m.weights.h5")
    (tmp_path / "config.json").write_text(model.to_json())
    with open_checkpoint(tmp_path / "m.weights.h5") as ckpt:
        assert ckpt.float8_modules() == ["block.inner"]
        assert {t.name for t in ckpt.tensors()} == {"block.inner.weight", "block.inner.bias"}
        notes = ckpt.training_state().details["layer_notes"]["block.inner"]
        assert any("variable layout" in n for n in notes)


def test_files_without_name_attributes_map_through_config_order(tiny, tmp_path):
    """Keras < 3.6 wrote no ``name`` attribute: top-level groups map via config class order."""
    import h5py

    h5 = copy_pair(tiny, tmp_path)
    with h5py.File(h5, "r+") as f:
        def strip(name, obj):
            if isinstance(obj, h5py.Group) and "name" in obj.attrs:
                del obj.attrs["name"]
        f.visititems(strip)
    with open_checkpoint(h5) as ckpt:
        mods = set(ckpt.float8_modules())
        # top-level layers keep their config names; nested ones use attribute names
        assert {"hidden", "head", "proj", "back"} <= mods
        assert {"mha.query_dense", "mha.output_dense"} <= mods and len(mods) == 8
        # the same tensors as with names, only nested attribute names differ
        assert ckpt.info("mha.query_dense.weight").shape == (8, 8)
        assert ckpt.info("hidden.weight").shape == (8, 8)
