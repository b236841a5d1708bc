"""Per-layer attribution on MoE models: each expert projection measured on the reference's own
routing (transformers runs the experts fused, so the probe computes them per expert)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "families"))

from model_families import FAMILIES, MOE_FAMILIES, save_family  # noqa: E402


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_fp8(request, tmp_path_factory):
    from fp8export import api
    from fp8export.convert.config import ConvertConfig

    root = tmp_path_factory.mktemp(request.param)
    src = save_family(request.param, root / "src")
    api.convert(ConvertConfig(checkpoint=src, output=root / "fp8"))
    return request.param, src, root / "fp8"


def test_per_layer_on_its_own_moe_folder(moe_fp8):
    from fp8export import api
    from fp8export.verify.config import VerifyConfig

    family, src, fp8 = moe_fp8
    from fp8export.errors import VerificationFailed

    try:
        res = api.verify(VerifyConfig(reference=src, candidate=fp8, samples=8, seq_len=32,
                                      per_layer=True, write_reports=False, noise_floor=False,
                                      device="cpu"))
    except VerificationFailed as failed:  # random tiny MoE logits are flat: top-1 may miss
        res = failed.result
    rows = {r["module"]: r for r in res.per_layer}
    experts = {m: r for m, r in rows.items() if ".experts." in m}
    values = FAMILIES[family][2]
    n_experts = values.get("num_local_experts") or values.get("num_experts")
    assert len(experts) == 2 * n_experts * 3  # every projection of every expert of 2 layers
    measured = [r for r in experts.values() if r["tokens"]]
    assert measured and all(20 < r["sqnr_db"] < 40 for r in measured)
    assert all(r["sqnr_e2e_db"] is None for r in experts.values())  # routing differs per side
    tokens = res.metrics["tokens"]  # every real (unpadded) position
    top_k = values["num_experts_per_tok"]
    for layer in range(2):  # each routed token counted once per expert it went to
        gates = [r["tokens"] for m, r in experts.items()
                 if f"layers.{layer}." in m and m.rsplit(".", 1)[-1] in ("w1", "gate_proj")]
        assert sum(gates) == tokens * top_k
    dense = [r for m, r in rows.items() if ".experts." not in m]
    assert dense and all(r["sqnr_e2e_db"] is not None for r in dense)
