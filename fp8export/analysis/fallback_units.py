"""Which layers ``--accuracy-budget`` keeps in high precision, and in which order.

The score pass (``fallback.py``) gives, per scored token ``t`` and candidate layer ``l``, the
first-order effect of that layer's FP8 error on the next-token loss, ``p[t, l] = g_l · d_l``
(the loss gradient at the layer's output times the FP8 layer's output error on the reference's
own input). The logit change of any set ``F`` of FP8 layers is, to first order, the sum of the
layers' changes, so the KL it adds is estimated by the empirical Fisher quadratic form

    KL(F) ≈ 0.5 · mean_t (Σ_{l ∈ F} p[t, l])² = f^T C f,   C = 0.5 · P^T P / tokens,

with ``f`` the indicator of ``F``. Unlike a sum of per-layer scores (the diagonal of ``C``)
it sees layers whose errors add up or cancel on the same tokens.

**Units** are what can be kept: a fused group (q/k/v, gate/up: vLLM refuses a partly
quantized fused layer) or a single linear, and the structures above them — a decoder layer's
attention or MLP, a whole decoder layer (the first and the last among them). The keep order
is greedy on the quadratic form: at each step the unit whose keeping lowers the estimated KL
most per parameter it adds joins; a structure competes with its own parts, so it is chosen
only where keeping it together is worth more than its best part (errors that compound inside
it). Each step adds one or more base units.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

_INDEX = re.compile(r"\.(\d+)\.")


@dataclass
class Unit:
    """A set of base units (indices into the base list) that can be kept together."""

    name: str
    members: tuple[int, ...]


@dataclass
class Base:
    """A fused group or a single linear: kept or quantized as a whole."""

    modules: list[str]
    columns: list[int]  # the modules' columns in the score matrix
    params: int


def base_units(layers, column: dict[str, int]) -> list[Base]:
    """One base unit per fused group (its members) or per layer, in the layers' order."""
    by_key: dict[str, Base] = {}
    for layer in layers:
        b = by_key.setdefault(layer.group or layer.module, Base([], [], 0))
        b.modules.append(layer.module)
        b.columns.append(column[layer.module])
        b.params += int(layer.weight.numel())
    return list(by_key.values())


def structures(bases: list[Base]) -> list[Unit]:
    """Every base unit on its own, and the decoder-layer structures above them: ``<prefix>.N``
    (a whole layer) and ``<prefix>.N.<part>`` (its attention, its MLP), where they hold more
    than one base unit."""
    units = [Unit(b.modules[0] if len(b.modules) == 1 else _group_name(b.modules), (i,))
             for i, b in enumerate(bases)]
    parents: dict[str, list[int]] = {}
    for i, b in enumerate(bases):
        name = b.modules[0]
        m = _INDEX.search(name)
        if m is None:
            continue
        layer = name[:m.end() - 1]  # "model.layers.3"
        part = name[:name.find(".", m.end()) if "." in name[m.end():] else len(name)]
        parents.setdefault(layer, []).append(i)
        if part != name:
            parents.setdefault(part, []).append(i)
    for name, members in parents.items():
        if len(members) > 1:
            units.append(Unit(name, tuple(members)))
    return units


def _group_name(modules: list[str]) -> str:
    parent = modules[0].rpartition(".")[0]
    return f"{parent}.{{{','.join(m.rpartition('.')[2] for m in modules)}}}"


def greedy_path(cov: np.ndarray, bases: list[Base], units: list[Unit]
                ) -> list[tuple[str, list[int]]]:
    """The keep order: ``(unit name, base units it adds)`` per step, until every base unit
    is kept. ``cov`` is ``C`` over the score matrix's columns."""
    n = len(bases)
    cols = [np.asarray(b.columns) for b in bases]
    fp8 = np.ones(cov.shape[0])  # indicator of the layers still in FP8
    kept = np.zeros(n, dtype=bool)
    path = []
    while not kept.all():
        cf = cov @ fp8
        best, best_gain, best_add = None, -np.inf, None
        for u in units:
            add = [i for i in u.members if not kept[i]]
            if not add:
                continue
            idx = np.concatenate([cols[i] for i in add])
            params = sum(bases[i].params for i in add)
            # KL(F) - KL(F \ U) = 2 u^T C f - u^T C u
            drop = 2.0 * cf[idx].sum() - cov[np.ix_(idx, idx)].sum()
            gain = drop / max(params, 1)
            if gain > best_gain:
                best, best_gain, best_add = u, gain, add
        for i in best_add:
            kept[i] = True
            fp8[cols[i]] = 0.0
        path.append((best.name, best_add))
    return path


def predicted(cov: np.ndarray, bases: list[Base], path) -> np.ndarray:
    """The estimated KL after each number of steps of ``path`` (0 = everything in FP8)."""
    fp8 = np.ones(cov.shape[0])
    out = [float(fp8 @ cov @ fp8)]
    for _, add in path:
        for i in add:
            fp8[np.asarray(bases[i].columns)] = 0.0
        out.append(float(fp8 @ cov @ fp8))
    return np.maximum(np.asarray(out), 0.0)
