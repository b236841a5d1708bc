"""Streaming activation statistics and the forward pre-hooks that feed them.

Statistics (:class:`ActivationStats`)
    - a running absmax (a 0-dim float32 tensor on the activation's device), and
    - optionally a fixed-size histogram of ``|x|`` with one bin per non-negative **bfloat16 bit
      pattern** (``2**15`` bins: 8 exponent bits + 7 mantissa bits), int64 counts.

Why not the linear 2048-bin histogram with range growth of TensorRT's pytorch-quantization
(``tools/pytorch-quantization/pytorch_quantization/calib/histogram.py``: ``torch.histc`` over
``[0, max]``, the bin count grows when a batch exceeds the range) and ModelOpt's
``HistogramCalibrator``? Four reasons specific to FP8 and to streaming:

1. *Exact.* The calibration model runs in bf16, so its linear inputs **are** bf16 values: a
   histogram over bf16 bit patterns loses nothing; every bin is one exact value, so MSE/KL
   over the histogram are the exact round-trip error of the observed data. (fp16/fp32
   inputs are rounded to bf16 for the histogram only; the absmax is kept exact.)
2. *No host syncs.* A linear histogram needs the batch max on the host to decide whether to
   grow (one ``.item()`` per layer per batch); a bit-pattern histogram has a fixed range, so
   it is updated entirely on the device.
3. *Order independent, deterministic.* No re-binning, so the result does not depend on
   which batch came first; integer counts add associatively, bit for bit.
4. *Log resolution.* E4M3 is a floating-point grid (constant relative step, subnormals down
   to ``scale * 2**-9``); a linear histogram puts everything below ``max/2048`` into bin 0,
   exactly where FP8 underflow happens. Here every binade has 128 bins.

Memory is fixed: 256 KiB per observed input, whatever the number of samples.

Cost control: the absmax sees every value, but when one call brings more than ``hist_rows``
token rows (default :data:`DEFAULT_HIST_ROWS`) the histogram takes every k-th row
(deterministic stride, ``k = ceil(rows / hist_rows)``). On a GPU the histogram's atomic adds,
not the absmax, are what costs time; a 512-sample x 2048-token corpus still puts ~10^8 values
per layer into the histogram, far more than a 99.99th percentile needs. ``hist_rows=None``
histograms everything.

Observers (:class:`ActivationObserver`) hook the modules ``convert`` will quantize
(``nn.Linear`` and GPT-2's ``Conv1D``), drop padding positions using the current batch's
attention mask, and let members of a fused group that receive the *same tensor object*
(q/k/v, gate/up) share one observation instead of three.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fp8export.errors import Fp8ExportError

if TYPE_CHECKING:
    from fp8export.calibration.calibrators import Calibrator

HIST_BINS = 1 << 15
"""One bin per non-negative bf16 bit pattern (sign cleared)."""
FINITE_BINS = 0x7F80
"""Patterns ``>= 0x7F80`` are +Inf (0x7F80) and NaN; bins below hold finite values."""
DEFAULT_HIST_ROWS = 2048
"""Token rows per call that go into the histogram before striding (see the module docstring)."""

_BIN_VALUES: np.ndarray | None = None


def bin_values() -> np.ndarray:
    """float64 value of every finite bin (``bin_values()[i]`` = the bf16 number with bits ``i``)."""
    global _BIN_VALUES
    if _BIN_VALUES is None:
        bits = torch.arange(FINITE_BINS, dtype=torch.int32).to(torch.int16)
        _BIN_VALUES = bits.view(torch.bfloat16).to(torch.float64).numpy().copy()
        _BIN_VALUES.setflags(write=False)
    return _BIN_VALUES


@dataclass(frozen=True)
class FinalStats:
    """Host-side snapshot of :class:`ActivationStats` (what calibrators compute from)."""

    amax: float  # exact running max |x| (NaN/Inf propagate)
    elements: int  # values observed
    counts: np.ndarray | None = None  # int64 [FINITE_BINS] histogram, None for max-only
    nonfinite: int = 0  # values that were Inf/NaN (from the histogram)

    def nonzero(self) -> tuple[np.ndarray, np.ndarray]:
        """``(values float64, counts float64)`` of the populated finite bins, ascending."""
        if self.counts is None:
            raise Fp8ExportError("internal: this calibrator needs a histogram but none was kept.")
        idx = np.flatnonzero(self.counts)
        return bin_values()[idx], self.counts[idx].astype(np.float64)


class ActivationStats:
    """Running absmax and (optionally) the bf16 bit-pattern histogram of one input stream.

    All state stays on the device of the first tensor it sees; :meth:`finalize` is the only
    host sync.
    """

    def __init__(self, histogram: bool, hist_rows: int | None = None):
        self.histogram = histogram
        self.hist_rows = hist_rows
        self.reset()

    def reset(self) -> None:
        self.amax: torch.Tensor | None = None
        self.hist: torch.Tensor | None = None
        self.elements = 0  # from shapes: no device sync
        self.hist_elements = 0
        self.calls = 0

    def update(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Add the values of ``x``.

        ``rows``: optional int64 indices (on x's device) of the token rows of
        ``x.reshape(-1, x.shape[-1])`` to keep (the non-padding positions); None keeps all.
        """
        x = x.detach()
        if rows is not None and x.device.type == "cpu":
            # CPU: copying the kept rows is cheaper than a per-row reduction (torch's CPU
            # row-wise min/max is ~10x slower than its full reduction), and the histogram
            # needs the kept values anyway.
            x = x.reshape(-1, x.shape[-1]).index_select(0, rows)
            rows = None
        if rows is not None:
            h = x.shape[-1]
            x = x.reshape(-1, h)
            # Device: per-row min/max, then the kept rows; no copy of the activation just to
            # drop padding. NaN propagates through aminmax and maximum.
            mn, mx = torch.aminmax(x, dim=-1)
            n = rows.numel() * h
            a = torch.maximum(mx, mn.neg()).index_select(0, rows).max() if rows.numel() else None
        else:
            n = x.numel()
            # One single-pass reduction (min and max together); |x|max = max(max, -min).
            # (linalg.vector_norm(ord=inf) is the same on a GPU but 13x slower on a CPU.)
            if n:
                mn, mx = torch.aminmax(x)
                a = torch.maximum(mx, mn.neg())
            else:
                a = None
        if a is None:
            return
        a = a.to(torch.float32)
        self.amax = a if self.amax is None else torch.maximum(self.amax, a)
        self.elements += n
        self.calls += 1
        if not self.histogram:
            return
        if rows is not None:
            x = x.index_select(0, rows)  # the histogram needs the kept values themselves
        if self.hist_rows and x.dim() >= 2:
            h = x.shape[-1]
            rows = n // h
            if rows > self.hist_rows:
                x = x.reshape(rows, h)[:: -(-rows // self.hist_rows)]
        self.hist_elements += x.numel()
        b = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        # Clearing the sign bit of the bf16 pattern gives |x|'s pattern: bin index in [0, 2**15).
        idx = b.reshape(-1).view(torch.int16) & 0x7FFF
        if self.hist is None:
            self.hist = torch.zeros(HIST_BINS, dtype=torch.int64, device=x.device)
        if idx.device.type == "cpu":
            self.hist += torch.bincount(idx, minlength=HIST_BINS)
        else:
            add_counts(self.hist, idx.to(torch.int32))

    def merge(self, other: ActivationStats) -> None:
        """Fold ``other`` into this one (same stream semantics as having seen both inputs)."""
        if other.amax is None:
            return
        if self.amax is None:
            self.amax = other.amax.clone()
        else:
            self.amax = torch.maximum(self.amax, other.amax.to(self.amax.device))
        self.elements += other.elements
        self.hist_elements += other.hist_elements
        self.calls += other.calls
        if self.histogram and other.hist is not None:
            h = other.hist.to(self.hist.device if self.hist is not None else other.hist.device)
            self.hist = h.clone() if self.hist is None else self.hist + h

    def finalize(self) -> FinalStats | None:
        """Copy to the host (one sync). None when nothing was observed."""
        if self.amax is None:
            return None
        amax = float(self.amax.cpu())
        if not self.histogram or self.hist is None:
            return FinalStats(amax=amax, elements=self.elements)
        h = self.hist.cpu().numpy()
        return FinalStats(amax=amax, elements=self.elements, counts=h[:FINITE_BINS].copy(),
                          nonfinite=int(h[FINITE_BINS:].sum()))


CUDA_HISTOGRAM_KERNEL = "index_add"
"""How device histograms are accumulated: ``index_add`` or ``histc`` (see :func:`add_counts`)."""
_HISTC_CHUNK = 1 << 24  # float32 counts are exact integers up to 2**24


def add_counts(hist: torch.Tensor, idx: torch.Tensor, kernel: str | None = None) -> None:
    """``hist[i] += (idx == i).sum()`` without a host sync (the accelerator path).

    ``torch.bincount`` on CUDA reads ``idx.max()`` back to the host to size its output; these
    two do not. ``index_add``: integer atomics straight into the int64 histogram. ``histc``:
    torch's histogram kernel with fixed bounds (per-block partial histograms, less atomic
    contention on hot bins), float32 counts, so it runs on chunks of at most 2**24 values to
    keep every count an exact integer. Both are exact and order-free: deterministic.
    """
    kernel = kernel or CUDA_HISTOGRAM_KERNEL
    if kernel == "histc":
        for chunk in idx.split(_HISTC_CHUNK):
            h = torch.histc(chunk.to(torch.float32), bins=HIST_BINS, min=0, max=HIST_BINS)
            hist += h.to(torch.int64)
        return
    ones = torch.ones(1, dtype=torch.int64, device=idx.device).expand(idx.numel())
    hist.index_add_(0, idx, ones)


# --------------------------------------------------------------------------------------------
# hooks


def is_linear_like(module: torch.nn.Module) -> bool:
    """``nn.Linear`` or transformers' GPT-2 ``Conv1D`` (a linear with an [in, out] weight)."""
    if isinstance(module, torch.nn.Linear):
        return True
    return type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None \
        and module.weight.dim() == 2


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    for key in ("input", "x", "hidden_states"):
        v = kwargs.get(key)
        if isinstance(v, torch.Tensor):
            return v
    for v in kwargs.values():
        if isinstance(v, torch.Tensor):
            return v
    return None


class ActivationObserver:
    """Forward pre-hooks on ``modules`` of ``model`` feeding one calibrator each.

    Use as a context manager around the forward passes; call :meth:`begin_batch` with the
    batch's attention mask before each forward so padding positions are excluded.

    Args:
        model: the torch model.
        modules: dotted names (``model.named_modules()``) of the linears to observe.
        make_calibrator: factory returning a fresh :class:`Calibrator` per module.
        groups: fused groups (lists of module names). Members that receive the identical input
            tensor in a forward share one observation (they would see the same values).
    """

    def __init__(self, model: torch.nn.Module, modules: Sequence[str],
                 make_calibrator: Callable[[], Calibrator],
                 groups: Sequence[Sequence[str]] = (),
                 hist_rows: int | None = DEFAULT_HIST_ROWS):
        named = dict(model.named_modules())
        missing = [m for m in modules if m not in named]
        if missing:
            raise Fp8ExportError(
                f"{len(missing)} modules to calibrate are not in the model, e.g. {missing[:3]}. "
                "Module names must match the checkpoint's tensor names without '.weight'.")
        bad = [m for m in modules if not is_linear_like(named[m])]
        if bad:
            raise Fp8ExportError(
                f"modules {bad[:3]} are {type(named[bad[0]]).__name__}, not linear layers; "
                "only nn.Linear / Conv1D inputs are calibrated.")
        self.model = model
        self.modules = list(dict.fromkeys(modules))
        self._targets = {m: named[m] for m in self.modules}
        self.calibrators: dict[str, Calibrator] = {m: make_calibrator() for m in self.modules}
        for c in self.calibrators.values():
            c.stats.hist_rows = hist_rows
        self._group_of: dict[str, int] = {}
        for gi, g in enumerate(groups):
            for m in g:
                if m in self._targets:
                    self._group_of[m] = gi
        self.shared_calls: dict[str, int] = {m: 0 for m in self.modules}
        self.shared_with: dict[str, str] = {}
        self.unmasked_calls: dict[str, int] = {m: 0 for m in self.modules}
        self._handles: list[Any] = []
        self._mask_shape: tuple[int, int] | None = None
        self._valid_idx_cpu: torch.Tensor | None = None  # None: no padding in this batch
        self._valid_idx: dict[torch.device, torch.Tensor] = {}
        self._last: tuple[int, torch.Tensor, str] | None = None

    # context management ------------------------------------------------------------------
    def attach(self) -> ActivationObserver:
        if self._handles:
            return self
        for name, mod in self._targets.items():
            self._handles.append(
                mod.register_forward_pre_hook(self._make_hook(name), with_kwargs=True))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._last = None
        self._valid_idx.clear()

    def __enter__(self) -> ActivationObserver:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    # per batch ---------------------------------------------------------------------------
    def begin_batch(self, attention_mask: torch.Tensor | None) -> None:
        """Set the mask (``[B, T]``, host tensor preferred) the next forward pass uses."""
        self._last = None
        self._valid_idx.clear()
        if attention_mask is None:
            self._mask_shape = None
            self._valid_idx_cpu = None
            return
        mask = attention_mask.detach()
        if mask.device.type != "cpu":
            mask = mask.cpu()  # once per batch; data loaders give host masks anyway
        self._mask_shape = (int(mask.shape[0]), int(mask.shape[1]))
        flat = mask.reshape(-1) != 0
        # Decided on the host, so a batch without padding costs no indexing on the device.
        self._valid_idx_cpu = None if bool(flat.all()) else torch.nonzero(flat).reshape(-1)

    @property
    def valid_rows(self) -> torch.Tensor | None:
        """Host indices of the current batch's non-padding positions (None: no padding)."""
        return self._valid_idx_cpu

    def end_batch(self) -> None:
        self._last = None  # drop the reference to the last group's input

    def _valid_idx_on(self, device: torch.device) -> torch.Tensor:
        idx = self._valid_idx.get(device)
        if idx is None:
            idx = self._valid_idx_cpu.to(device, non_blocking=True)
            self._valid_idx[device] = idx
        return idx

    def _make_hook(self, name: str):
        calibrator = self.calibrators[name]
        gid = self._group_of.get(name)

        def hook(module, args, kwargs):
            x = _first_tensor(args, kwargs)
            if x is None or not x.is_floating_point():
                return None
            if gid is not None:
                last = self._last
                if last is not None and last[0] == gid and last[1] is x:
                    # Same tensor object as the group-mate just observed: identical values.
                    self.shared_calls[name] += 1
                    self.shared_with[name] = last[2]
                    return None
                self._last = (gid, x, name)
            else:
                self._last = None
            rows = None
            if self._mask_shape is not None:
                b, t = self._mask_shape
                h = x.shape[-1] if x.dim() else 1
                lead = x.numel() // h if h else 0
                if lead == b * t:
                    if self._valid_idx_cpu is not None:
                        rows = self._valid_idx_on(x.device)
                else:
                    # e.g. a decoder of another length, or MoE experts fed a token subset:
                    # the mask does not apply, so every position counts (reported).
                    self.unmasked_calls[name] += 1
            calibrator.collect(x, rows=rows)
            return None

        return hook

    # results -------------------------------------------------------------------------------
    def finalize(self) -> dict[str, FinalStats]:
        """Host snapshots per module; modules that never saw input are absent."""
        out: dict[str, FinalStats] = {}
        own = {m: c.stats for m, c in self.calibrators.items()}
        for m in self.modules:
            stats = own[m]
            leader = self.shared_with.get(m)
            if leader is not None and self.shared_calls[m]:
                if stats.calls == 0:
                    stats = own[leader]  # every input was the leader's: identical statistics
                else:
                    # Mixed (never seen in practice): fold both; an upper bound for max.
                    merged = type(stats)(histogram=stats.histogram, hist_rows=stats.hist_rows)
                    merged.merge(stats)
                    merged.merge(own[leader])
                    stats = merged
            final = stats.finalize()
            if final is not None:
                out[m] = final
        return out
