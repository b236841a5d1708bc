"""Observers on real modules: padding excluded, Conv1D, fused-group sharing, missing layers."""

from __future__ import annotations

import pytest
import torch

from fp8export.calibration.calibrators import get_calibrator
from fp8export.calibration.observe import observe
from fp8export.calibration.observers import ActivationObserver
from fp8export.errors import Fp8ExportError
from fp8export.inputs.samples import as_samples


class Toy(torch.nn.Module):
    """Per-token model (no mixing across positions): batch composition cannot change values."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(16, 8)
        with torch.no_grad():
            self.emb.weight[0] = 1000.0  # the pad token: huge if padding leaked into statistics
        self.q = torch.nn.Linear(8, 8)
        self.k = torch.nn.Linear(8, 8)
        self.fc = torch.nn.Linear(8, 4)
        self.never = torch.nn.Linear(4, 4)  # not on the forward path

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        return self.fc(torch.relu(self.q(h) + self.k(h)))


def _forward(model):
    def call(batch, device):
        with torch.inference_mode():
            return model(batch.input_ids.to(device))
    return call


def _amax(model, token_lists, modules, batch_size, method="max"):
    ob = observe(model, as_samples(token_lists, pad_id=0), modules, method=method,
                 batch_size=batch_size, forward=_forward(model), show_progress=False)
    return ob, {m: get_calibrator(method).amax_from(s).amax for m, s in ob.stats.items()}


def test_padding_positions_are_excluded():
    model = Toy()
    short, long_ = [3, 4], [5, 6, 7, 8, 9]
    _, alone = _amax(model, [short], ["q", "fc"], 1)
    _, alone2 = _amax(model, [long_], ["q", "fc"], 1)
    ob, padded = _amax(model, [short, long_], ["q", "fc"], 2, method="percentile")
    assert ob.tokens == 7  # short was padded with id 0 to length 5
    for m in ("q", "fc"):
        assert ob.stats[m].amax == max(alone[m], alone2[m])
    assert padded["q"] < 100  # the 1000-valued pad embedding never reached the statistics
    # histogram counts exclude padding too: 7 tokens x 8 features into q
    assert int(ob.stats["q"].counts.sum()) == 7 * 8


def test_max_is_batch_order_and_batch_size_independent():
    model = Toy()
    data = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11], [12, 13]]
    _, a = _amax(model, data, ["q", "k", "fc"], 2)
    _, b = _amax(model, list(reversed(data)), ["q", "k", "fc"], 3)
    assert a == b


def test_layers_without_input_are_reported_and_absent():
    ob, amax = _amax(Toy(), [[1, 2]], ["q", "never"], 1)
    assert ob.missing == ["never"] and "never" not in amax


def test_unknown_or_non_linear_modules_are_rejected():
    model = Toy()
    with pytest.raises(Fp8ExportError, match="not in the model"):
        ActivationObserver(model, ["nope"], lambda: get_calibrator("max"))
    with pytest.raises(Fp8ExportError, match="not linear"):
        ActivationObserver(model, ["emb"], lambda: get_calibrator("max"))


def test_fused_members_share_one_observation_with_identical_statistics():
    model = Toy()
    data = [[1, 2, 3], [4, 5]]
    samples = as_samples(data)
    shared = observe(model, samples, ["q", "k"], method="percentile", groups={"qk": ["q", "k"]},
                     forward=_forward(model), show_progress=False, batch_size=2)
    alone = observe(model, samples, ["q", "k"], method="percentile", forward=_forward(model),
                    show_progress=False, batch_size=2)
    for m in ("q", "k"):
        assert shared.stats[m].amax == alone.stats[m].amax
        assert (shared.stats[m].counts == alone.stats[m].counts).all()


def test_gpt2_conv1d_and_real_llama_padding(tiny_llama):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=1,
                                      n_head=2)).eval()
    mods = ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
            "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"]
    ob = observe(gpt2, as_samples([[1, 2, 3, 4], [5, 6]]), mods, batch_size=2,
                 show_progress=False)
    assert sorted(ob.stats) == sorted(mods) and not ob.missing
    assert type(dict(gpt2.named_modules())[mods[0]]).__name__ == "Conv1D"

    # Causal Llama with right padding: valid positions do not see the padding, and padded
    # positions are dropped, so the padded batch gives the unpadded samples' amax.
    from fp8export.models import load_model

    model, _ = load_model(tiny_llama, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        model.model.embed_tokens.weight[0] = 500.0  # pad id 0: would dominate if it leaked
    mods = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    a = [observe(model, as_samples([s]), mods, batch_size=1, show_progress=False).stats
         for s in ([2, 5, 6], [2, 7, 8, 9, 10, 11])]
    b = observe(model, as_samples([[2, 5, 6], [2, 7, 8, 9, 10, 11]]), mods, batch_size=2,
                show_progress=False).stats
    for m in mods:
        assert b[m].amax == pytest.approx(max(a[0][m].amax, a[1][m].amax), rel=1e-5)
        assert b[m].amax < 50
