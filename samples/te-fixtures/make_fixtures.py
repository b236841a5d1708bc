"""Reproduce Transformer Engine checkpoints (state dicts with ``_extra_state``) without TE.

Transformer Engine needs a CUDA build, so these files are *reproduced*: the state dicts have
TE's parameter names, and each ``_extra_state`` is serialised exactly as TE's
``get_extra_state`` does it (``transformer_engine/pytorch/module/base.py``; layouts and keys in
``reference/training_amax_formats.md`` §1.2–§1.5):

* 2.x  — ``torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)`` with
  ``state = {recipe, scale_fwd, amax_history_fwd, scale_bwd, amax_history_bwd,
  extra_fp8_variables}``; ``recipe`` is a ``transformer_engine.common.recipe.DelayedScaling``
  instance (pickled through a stand-in module of that name registered only while pickling);
* 1.x  — ``io.BytesIO`` holding ``torch.save(state)`` with ``scale_inv_*`` and no recipe;
* 0.6–0.11 — uint8 tensor of ``pickle.dumps(state)`` without a recipe;
* empty states: ``torch.empty(0, uint8)`` (2.4+), the pickle of None (2.0–2.3),
  ``torch.save(None)`` in a BytesIO (1.x), and a stateless ``Float8CurrentScaling`` state (≤2.17).

Histories come from a simulation of TE's delayed-scaling update (row 0 accumulates the step's
amax; at the update ``amax = max(history)`` or ``history[0]``, the history rolls by −1, row 0
is zeroed and ``scale = 448 / amax / 2**margin``), so rows and scales relate as in a real run.

Usage: ``python samples/te-fixtures/make_fixtures.py OUT_DIR [--marker PATH]``. ``--marker`` is
the file the malicious fixtures would create if anything executed them (default
``OUT_DIR/PWNED``); a safe reader leaves it absent. Tests import :func:`write_fixtures`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import io
import pickle
import sys
import types
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

E4M3_MAX = 448.0
H, FFN, EXPERTS = 32, 64, 4  # hidden size, MLP size, GroupedLinear experts


# ------------------------------------------------------------- stand-ins for TE's recipe module

class _FormatHelper(NamedTuple):
    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)


@dataclasses.dataclass()
class DelayedScaling:
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Any = "max"
    scaling_factor_compute_algo: Any = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclasses.dataclass()
class Float8CurrentScaling:
    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False


RECIPE_MODULE = "transformer_engine.common.recipe"


@contextlib.contextmanager
def te_recipe_module():
    """Make the stand-ins pickle as ``transformer_engine.common.recipe.<name>``, then undo it."""
    module = types.ModuleType(RECIPE_MODULE)
    classes = (_FormatHelper, Format, DelayedScaling, Float8CurrentScaling)
    saved = {c: (c.__module__, c.__qualname__) for c in classes}
    for c in classes:
        c.__module__ = RECIPE_MODULE
        setattr(module, c.__name__, c)
    parents = ("transformer_engine", "transformer_engine.common")
    added = [name for name in (*parents, RECIPE_MODULE) if name not in sys.modules]
    for name in parents:
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules[RECIPE_MODULE] = module
    try:
        yield
    finally:
        for c, (mod, qual) in saved.items():
            c.__module__, c.__qualname__ = mod, qual
        for name in added:
            sys.modules.pop(name, None)


def my_amax_algo(history):  # a user's custom amax_compute_algo (pickled by reference)
    return history.max(dim=0).values


# ----------------------------------------------------------------- TE delayed-scaling simulation

@dataclasses.dataclass
class Simulated:
    scale: np.ndarray  # [n] multiplier (q = x * scale)
    history: np.ndarray  # [L, n] TE layout
    amaxes: np.ndarray  # [steps, n] the amax each step recorded (ground truth)


def simulate(amaxes: np.ndarray, length: int, algo: str = "max", margin: int = 0,
             fp8_max: float = E4M3_MAX, partial: np.ndarray | None = None) -> Simulated:
    """Run TE's delayed-scaling update over ``amaxes[step, slot]`` (float32 like TE).

    ``partial`` is an amax recorded into row 0 after the last update (a mid-step save).
    """
    steps, n = amaxes.shape
    hist = np.zeros((length, n), np.float32)
    scale = np.ones(n, np.float32)
    for t in range(steps):
        hist[0] = np.maximum(hist[0], amaxes[t])  # the forward pass records into row 0
        amax = hist.max(axis=0) if algo == "max" else hist[0].copy()
        hist = np.roll(hist, -1, axis=0)
        hist[0] = 0
        ok = np.isfinite(amax) & (amax > 0)
        new = (fp8_max / np.where(ok, amax, 1)) / 2.0 ** margin
        scale = np.where(ok, new, scale).astype(np.float32)
    if partial is not None:
        hist[0] = partial
    return Simulated(scale, hist, amaxes.astype(np.float32))


def _fwd_bwd(num_gemms: int, length: int, steps: int, rng: np.random.Generator, *,
             algo: str = "max", margin: int = 0, partial: bool = False) -> tuple[dict, Simulated]:
    n = 3 * num_gemms
    amaxes = rng.uniform(0.5, 8.0, size=(steps, n)) * rng.uniform(0.5, 2.0, size=n)
    amaxes = amaxes.astype(np.float32)
    amaxes[:, 2::3] = 0  # GEMM output slots are unused without fp8_mha
    part = amaxes[-1] * 1.5 if partial else None
    fwd = simulate(amaxes, length, algo, margin, partial=part)
    bwd_amax = rng.uniform(1e-4, 1e-2, size=(steps, 2 * num_gemms)).astype(np.float32)
    bwd = simulate(bwd_amax, length, algo, margin, fp8_max=57344.0)
    tensors = {"scale_fwd": torch.from_numpy(fwd.scale.copy()),
               "amax_history_fwd": torch.from_numpy(fwd.history.copy()),
               "scale_bwd": torch.from_numpy(bwd.scale.copy()),
               "amax_history_bwd": torch.from_numpy(bwd.history.copy())}
    return tensors, fwd


def _extra_vars(num_gemms: int) -> dict:
    return {"fp8_checkpoint": True, "num_gemms": num_gemms, "fp8_max_fwd": 448.0,
            "fp8_max_bwd": 57344.0}


# --------------------------------------------------------------------------- serialisations

def serialize_2x(tensors: dict, num_gemms: int, recipe: Any) -> torch.Tensor:
    """TE 2.x: uint8 tensor of pickle.dumps({recipe, scale/amax fwd+bwd, extra_fp8_variables})."""
    state = {"recipe": recipe, **tensors, "extra_fp8_variables": _extra_vars(num_gemms)}
    with te_recipe_module():
        data = pickle.dumps(state)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def serialize_1x(tensors: dict | None, num_gemms: int = 1) -> io.BytesIO:
    """TE 0.12–1.13: io.BytesIO of torch.save(state) (scale_inv kept, no recipe)."""
    state = None
    if tensors is not None:
        state = {"scale_fwd": tensors["scale_fwd"], "scale_inv_fwd": 1.0 / tensors["scale_fwd"],
                 "amax_history_fwd": tensors["amax_history_fwd"],
                 "scale_bwd": tensors["scale_bwd"], "scale_inv_bwd": 1.0 / tensors["scale_bwd"],
                 "amax_history_bwd": tensors["amax_history_bwd"],
                 "extra_fp8_variables": _extra_vars(num_gemms)}
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf


def serialize_06(tensors: dict, num_gemms: int) -> torch.Tensor:
    """TE 0.6–0.11: uint8 tensor of pickle.dumps(state) with scale_inv and no recipe."""
    state = {"scale_fwd": tensors["scale_fwd"], "scale_inv_fwd": 1.0 / tensors["scale_fwd"],
             "amax_history_fwd": tensors["amax_history_fwd"], "scale_bwd": tensors["scale_bwd"],
             "scale_inv_bwd": 1.0 / tensors["scale_bwd"],
             "amax_history_bwd": tensors["amax_history_bwd"],
             "extra_fp8_variables": _extra_vars(num_gemms)}
    return torch.tensor(np.frombuffer(pickle.dumps(state), dtype=np.uint8))


# ---------------------------------------------------------------------------- model layouts

def _w(rng: np.random.Generator, *shape: int) -> torch.Tensor:
    values = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    return torch.from_numpy(values).to(torch.bfloat16)


@dataclasses.dataclass
class Fixture:
    state_dict: dict[str, Any]
    truth: dict[str, Simulated]  # TE prefix → its forward simulation
    history_len: int


def te_layer_state_dict(layout: str, *, length: int = 16, steps: int = 40, seed: int = 0,
                        algo: str = "max", margin: int = 0, partial: bool = False,
                        prefix: str = "layers.0") -> Fixture:
    """One TE transformer layer: LayerNormLinear qkv, attention, Linear proj, LayerNormMLP,
    GroupedLinear experts — in the ``layout`` "2.x", "1.x" or "0.6"."""
    rng = np.random.default_rng(seed)
    sd: dict[str, Any] = {}
    truth: dict[str, Simulated] = {}
    recipe = DelayedScaling(amax_history_len=length, amax_compute_algo=algo, margin=margin)

    def extra_state(name: str, num_gemms: int):
        tensors, sim = _fwd_bwd(num_gemms, length, steps, rng, algo=algo, margin=margin,
                                partial=partial)
        truth[name] = sim
        if layout == "2.x":
            return serialize_2x(tensors, num_gemms, recipe)
        if layout == "1.x":
            return serialize_1x(tensors, num_gemms)
        if layout == "0.6":
            return serialize_06(tensors, num_gemms)
        raise ValueError(layout)

    qkv = f"{prefix}.self_attention.layernorm_qkv"
    sd[f"{qkv}.layer_norm_weight"] = torch.ones(H, dtype=torch.bfloat16)
    sd[f"{qkv}.layer_norm_bias"] = torch.zeros(H, dtype=torch.bfloat16)
    sd[f"{qkv}.weight"] = _w(rng, 3 * H, H)
    sd[f"{qkv}.bias"] = torch.zeros(3 * H, dtype=torch.bfloat16)
    sd[f"{qkv}._extra_state"] = extra_state(qkv, 1)
    if layout == "2.x":  # FP8 DPA state (TE >= 1.8 key)
        att = f"{prefix}.self_attention.core_attention"
        sd[f"{att}._extra_state"] = extra_state(att, 3)
    proj = f"{prefix}.self_attention.proj"
    sd[f"{proj}.weight"] = _w(rng, H, H)
    sd[f"{proj}.bias"] = torch.zeros(H, dtype=torch.bfloat16)
    sd[f"{proj}._extra_state"] = extra_state(proj, 1)
    mlp = f"{prefix}.layernorm_mlp"
    sd[f"{mlp}.layer_norm_weight"] = torch.ones(H, dtype=torch.bfloat16)
    sd[f"{mlp}.layer_norm_bias"] = torch.zeros(H, dtype=torch.bfloat16)
    sd[f"{mlp}.fc1_weight"] = _w(rng, FFN, H)
    sd[f"{mlp}.fc1_bias"] = torch.zeros(FFN, dtype=torch.bfloat16)
    sd[f"{mlp}.fc2_weight"] = _w(rng, H, FFN)
    sd[f"{mlp}.fc2_bias"] = torch.zeros(H, dtype=torch.bfloat16)
    sd[f"{mlp}._extra_state"] = extra_state(mlp, 2)
    moe = f"{prefix}.experts"
    for i in range(EXPERTS):
        sd[f"{moe}.weight{i}"] = _w(rng, H, H)
    sd[f"{moe}._extra_state"] = extra_state(moe, EXPERTS)
    return Fixture(sd, truth, length)


def megatron_history1(seed: int = 1) -> Fixture:
    """Megatron default: amax_history_len=1, most_recent — the history is all zeros."""
    rng = np.random.default_rng(seed)
    tensors, sim = _fwd_bwd(1, 1, 10, rng, algo="most_recent")
    recipe = DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent")
    sd = {"decoder.linear_fc1.weight": _w(rng, FFN, H),
          "decoder.linear_fc1._extra_state": serialize_2x(tensors, 1, recipe)}
    return Fixture(sd, {"decoder.linear_fc1": sim}, 1)


def calibration_state(seed: int = 2) -> Fixture:
    """TE calibration mode: scale stays 1.0, the batch amax is copied into row 0."""
    rng = np.random.default_rng(seed)
    hist = np.zeros((8, 3), np.float32)
    hist[0] = [3.25, 0.125, 0.0]
    tensors = {"scale_fwd": torch.ones(3), "amax_history_fwd": torch.from_numpy(hist),
               "scale_bwd": torch.ones(2), "amax_history_bwd": torch.zeros(8, 2)}
    sim = Simulated(np.ones(3, np.float32), hist, hist[:1].copy())
    sd = {"fc.weight": _w(rng, H, H),
          "fc._extra_state": serialize_2x(tensors, 1, DelayedScaling(amax_history_len=8))}
    return Fixture(sd, {"fc": sim}, 8)


def empty_states(seed: int = 3) -> dict[str, Any]:
    """Modules whose last forward ran outside FP8, in every TE layout, and a stateless recipe."""
    rng = np.random.default_rng(seed)
    sd: dict[str, Any] = {}
    for name, value in (
            ("empty_2_4", torch.empty(0, dtype=torch.uint8)),  # TE 2.4+ (and 2.18 stateless)
            ("none_2_0", torch.frombuffer(bytearray(pickle.dumps(None)), dtype=torch.uint8)),
            ("none_1_x", serialize_1x(None)),
            ("current_scaling", _stateless())):
        sd[f"{name}.weight"] = _w(rng, H, H)
        sd[f"{name}._extra_state"] = value
    return sd


def _stateless() -> torch.Tensor:
    state = {"recipe": Float8CurrentScaling(), "extra_fp8_variables": _extra_vars(1)}
    with te_recipe_module():
        data = pickle.dumps(state)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def custom_algo_state(seed: int = 4) -> dict[str, Any]:
    """DelayedScaling with a user's amax_compute_algo callable (a global reference)."""
    rng = np.random.default_rng(seed)
    tensors, _ = _fwd_bwd(1, 16, 20, rng)
    recipe = DelayedScaling(amax_history_len=16, amax_compute_algo=my_amax_algo)
    return {"fc.weight": _w(rng, H, H), "fc._extra_state": serialize_2x(tensors, 1, recipe)}


# ------------------------------------------------------------------------------ malicious

class _WriteFile:
    """Unpickling this runs ``exec`` to create ``path``: what a hostile checkpoint does."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('pwned')",))


def malicious_2x(marker: Path) -> dict[str, Any]:
    """A 2.x-layout extra state whose pickle, if loaded with plain pickle, writes ``marker``."""
    rng = np.random.default_rng(5)
    tensors, _ = _fwd_bwd(1, 16, 20, rng)
    state = {"recipe": _WriteFile(marker), **tensors, "extra_fp8_variables": _extra_vars(1)}
    data = pickle.dumps(state)
    return {"fc.weight": _w(rng, H, H),
            "fc._extra_state": torch.frombuffer(bytearray(data), dtype=torch.uint8)}


def malicious_1x(marker: Path) -> dict[str, Any]:
    """A 1.x-layout extra state (BytesIO of torch.save) carrying the same payload."""
    rng = np.random.default_rng(6)
    buf = io.BytesIO()
    torch.save({"scale_fwd": torch.ones(3), "payload": _WriteFile(marker)}, buf)
    return {"fc.weight": _w(rng, H, H), "fc._extra_state": buf}


def malicious_outer(marker: Path) -> dict[str, Any]:
    """The payload in the outer state dict itself, next to a valid extra state."""
    rng = np.random.default_rng(7)
    return {"fc.weight": _w(rng, H, H), "fc._extra_state": torch.empty(0, dtype=torch.uint8),
            "fc.evil": _WriteFile(marker)}


def unknown_global_state() -> dict[str, Any]:
    """A 2.x extra state naming a global outside the allowlist as plain data (not a call)."""
    rng = np.random.default_rng(8)
    tensors, _ = _fwd_bwd(1, 16, 20, rng)
    state = {"recipe": DelayedScaling(amax_history_len=16), **tensors,
             "extra_fp8_variables": {**_extra_vars(1), "hook": np.ndarray}}
    with te_recipe_module():
        data = pickle.dumps(state)
    return {"fc.weight": _w(rng, H, H),
            "fc._extra_state": torch.frombuffer(bytearray(data), dtype=torch.uint8)}


# ----------------------------------------------------------------------------------- writing

def write_fixtures(out: Path, marker: Path | None = None) -> dict[str, Path]:
    """Write every fixture as ``<name>.pt`` into ``out``; returns name → path."""
    out.mkdir(parents=True, exist_ok=True)
    marker = marker if marker is not None else out / "PWNED"
    cases: dict[str, dict[str, Any]] = {
        "te2_layer": te_layer_state_dict("2.x").state_dict,
        "te1_layer": te_layer_state_dict("1.x").state_dict,
        "te06_layer": te_layer_state_dict("0.6").state_dict,
        "te2_history1": megatron_history1().state_dict,
        "te2_calibration": calibration_state().state_dict,
        "te_empty": empty_states(),
        "te2_custom_algo": custom_algo_state(),
        "te2_unknown_global": unknown_global_state(),
        "te2_malicious": malicious_2x(marker),
        "te1_malicious": malicious_1x(marker),
        "te_malicious_outer": malicious_outer(marker),
    }
    paths = {}
    for name, sd in cases.items():
        path = out / f"{name}.pt"
        torch.save(sd, path)
        paths[name] = path
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--marker", type=Path, default=None,
                        help="file the malicious fixtures would write (default OUT/PWNED)")
    args = parser.parse_args(argv)
    for name, path in write_fixtures(args.out, args.marker).items():
        print(f"{name:22s} {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
