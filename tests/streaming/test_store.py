"""Where hidden states wait between layers (fp8export/streaming/store.py)."""

from __future__ import annotations

import pytest
import torch

from fp8export.errors import Fp8ExportError
from fp8export.streaming.store import HiddenStore


@pytest.mark.parametrize("tier", ["device", "host", "spill"])
def test_a_batch_reads_back_what_its_layer_wrote(tier, tmp_path):
    shapes = [(2, 5, 8), (1, 3, 8)]
    with HiddenStore(tier, torch.device("cpu"), tmp_path) as store:
        store.reserve(shapes, torch.bfloat16)
        for b, s in enumerate(shapes):
            store.put(b, torch.full(s, float(b + 1), dtype=torch.bfloat16))
        x = torch.randn(shapes[0]).to(torch.bfloat16)
        store.put(0, x)
        assert torch.equal(store.get(0), x) and torch.equal(store.get(1), torch.full(
            shapes[1], 2.0, dtype=torch.bfloat16))
        with pytest.raises(Fp8ExportError, match="internal"):
            store.put(1, torch.zeros(shapes[0], dtype=torch.bfloat16))
        # the spill file is unlinked as soon as it is mapped: nothing to leave behind
        assert not list(tmp_path.iterdir())


def test_the_spill_file_must_fit_the_free_space(tmp_path, monkeypatch):
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    store = HiddenStore("spill", torch.device("cpu"), tmp_path)
    with pytest.raises(Fp8ExportError, match="GiB of spill file but .* free there"):
        store.reserve([(4, 64, 64)], torch.bfloat16)
    assert not list(tmp_path.iterdir())
