"""Optimization-profile shapes for ``build-engine``: parse ``--shapes`` and derive defaults.

``--shapes`` takes one value per dynamic input, ``NAME:MIN,OPT,MAX`` with each shape written as
``AxBx...`` (``input_ids:1x1,1x128,8x512``). Inputs not named get defaults derived from the
graph: the first dynamic axis is taken as batch, the second as sequence. Reading the graph
uses ``onnx.load(..., load_external_data=False)`` so weights are not loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fp8export.errors import Fp8ExportError, UsageError

DEFAULT_BATCH = (1, 1, 8)  # min, opt, max
DEFAULT_SEQ = (1, 128, 512)


@dataclass(frozen=True)
class ShapeRange:
    """min/opt/max shapes of one input for a TensorRT optimization profile."""

    name: str
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def __post_init__(self):
        if not (len(self.min) == len(self.opt) == len(self.max)):
            raise UsageError(f"--shapes {self.name}: min/opt/max must have the same rank.")
        for lo, mid, hi in zip(self.min, self.opt, self.max):
            if not (1 <= lo <= mid <= hi):
                raise UsageError(
                    f"--shapes {self.name}: need 1 <= min <= opt <= max on every axis, got "
                    f"{self.min}, {self.opt}, {self.max}."
                )

    def to_dict(self) -> dict:
        return {"name": self.name, "min": list(self.min), "opt": list(self.opt),
                "max": list(self.max)}


def _parse_dims(text: str, spec: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise UsageError(
            f"--shapes {spec!r}: {text!r} is not a shape; write dims joined by 'x', e.g. 1x128."
        ) from None
    return dims


def parse_shape_spec(spec: str) -> ShapeRange:
    """Parse ``NAME:MIN,OPT,MAX`` (e.g. ``input_ids:1x1,1x128,8x512``)."""
    name, sep, rest = spec.rpartition(":")
    parts = rest.split(",")
    if not sep or not name or len(parts) != 3:
        raise UsageError(
            f"--shapes {spec!r}: expected NAME:MIN,OPT,MAX such as input_ids:1x1,1x128,8x512."
        )
    lo, mid, hi = (_parse_dims(p, spec) for p in parts)
    return ShapeRange(name, lo, mid, hi)


@dataclass(frozen=True)
class GraphInput:
    name: str
    dims: tuple[int | str | None, ...]  # int = static, str = symbolic (dynamic), None = unknown


def graph_inputs(onnx_path: Path) -> list[GraphInput]:
    """Inputs of the graph (initializers excluded), without loading external weights."""
    return read_graph(onnx_path)[0]


def read_graph(onnx_path: Path) -> tuple[list[GraphInput], int | None]:
    """The graph's inputs and the longest sequence its model allows (recorded by export-onnx
    in the metadata; None for graphs from elsewhere), without loading external weights."""
    from fp8export.onnx.export import MAX_POSITIONS_KEY
    from fp8export.onnx.load import load_onnx

    model = load_onnx(onnx_path)
    longest = next((p.value for p in model.metadata_props if p.key == MAX_POSITIONS_KEY), None)
    longest = int(longest) if longest is not None and longest.isdigit() and int(longest) else None
    inits = {i.name for i in model.graph.initializer}
    out = []
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        dims: list[int | str | None] = []
        for d in inp.type.tensor_type.shape.dim:
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            elif d.HasField("dim_param"):
                dims.append(d.dim_param)
            else:
                dims.append(None)
        out.append(GraphInput(inp.name, tuple(dims)))
    return out, longest


def _sequence_range(max_positions: int | None) -> tuple[int, int, int]:
    """(1, 128, 512), capped at the model's maximum positions."""
    lo, mid, hi = DEFAULT_SEQ
    if max_positions:
        hi = min(hi, max_positions)
        mid = min(mid, hi)
    return lo, mid, hi


def default_profile(inputs: list[GraphInput], given: list[ShapeRange] = (),
                    max_positions: int | None = None) -> list[ShapeRange]:
    """Complete ``given`` with defaults for every dynamic input of the graph.

    First dynamic axis = batch (1, 1, 8), second = sequence (1, 128, 512), the sequence capped
    at ``max_positions`` (the model's longest input); static axes fixed. An input named in
    ``given`` that the graph lacks is an error (a typo would silently be ignored by TensorRT
    otherwise), and so is a given sequence longer than ``max_positions``.
    """
    names = {i.name for i in inputs}
    unknown = [g.name for g in given if g.name not in names]
    if unknown:
        raise Fp8ExportError(
            f"--shapes names {unknown}, but the graph's inputs are {sorted(names)}."
        )
    by_name = {g.name: g for g in given}
    profile = []
    for inp in inputs:
        if inp.name in by_name:
            g = by_name[inp.name]
            if len(g.min) != len(inp.dims):
                raise Fp8ExportError(
                    f"--shapes {inp.name}: rank {len(g.min)} but the graph input has rank "
                    f"{len(inp.dims)} ({inp.dims})."
                )
            if max_positions and len(g.max) >= 2 and g.max[1] > max_positions:
                raise Fp8ExportError(
                    f"--shapes {g.name}: a sequence of {g.max[1]} tokens, but the model's "
                    f"positions end at {max_positions}. Give a max of at most {max_positions}.")
            profile.append(g)
            continue
        dynamic_seen = 0
        lo, mid, hi = [], [], []
        for d in inp.dims:
            if isinstance(d, int) and d > 0:
                lo.append(d), mid.append(d), hi.append(d)
                continue
            rng = DEFAULT_BATCH if dynamic_seen == 0 else _sequence_range(max_positions)
            dynamic_seen += 1
            lo.append(rng[0]), mid.append(rng[1]), hi.append(rng[2])
        if dynamic_seen:
            profile.append(ShapeRange(inp.name, tuple(lo), tuple(mid), tuple(hi)))
    return profile
