"""How a run places its model(s), decided before any weight is read, and shown (``--plan``).

:func:`decide` picks the mode from ``--offload`` and the sizes (checkpoint headers only):

* ``whole``: every model of the run on the device (``auto`` when their weights fit
  :data:`~fp8export.placement.FIT_FRACTION` of the device budget);
* ``spread``: one model over a host's GPUs with accelerate (``--max-memory`` naming several
  devices or ``disk``, or ``auto`` with several visible GPUs that hold it together; never under
  torchrun, where each rank has one GPU);
* ``layers``: layer streaming (``--offload layers``, or ``auto`` when nothing above fits).

The device budget is ``--max-memory``'s entry for the device (the GPU's index, or ``cpu`` on a
CPU run; under torchrun its one GPU entry applies to each rank's GPU), else the device's free
memory times :data:`~fp8export.placement.FIT_FRACTION`. :func:`layout` then sizes a streaming
run: where the hidden states wait (the device when they fit beside a layer and one batch's
activations, else host memory: ``--max-memory cpu=SIZE``, else the available memory times the
same fraction; else a spill file), and layers per block (one; with a spill file as many as the
budget holds, so the file is visited fewer times).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fp8export.config import Offload
from fp8export.distributed import Comm
from fp8export.errors import Fp8ExportError, UsageError
from fp8export.placement import FIT_FRACTION, format_bytes

ACTIVATION_FACTOR = 6
"""Live ``[tokens, width]`` tensors of one batch inside a layer, beside its input and output."""


def host_available() -> int:
    """Host memory available to this process now (``MemAvailable``), in bytes."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else 0
    return int(pages) * int(os.sysconf("SC_PAGE_SIZE")) if pages else 8 << 30


@dataclass
class Decision:
    """The mode of a run and its budgets (bytes)."""

    mode: str  # whole | spread | layers
    reason: str
    device: str  # cpu | cuda
    device_budget: int
    host_budget: int
    weights: int  # every model of the run, whole, on the device
    max_memory: dict[int | str, int] = field(default_factory=dict)
    capped: bool = False  # the device budget came from --max-memory

    def spread_budgets(self) -> dict[int | str, int] | None:
        """The budgets accelerate spreads over (mode ``spread``), else None."""
        if self.mode != "spread":
            return None
        if self.max_memory:
            return dict(self.max_memory)
        import torch

        return {i: torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())}


def _device_budget(device: str, max_memory: dict[int | str, int], comm: Comm
                   ) -> tuple[int, bool]:
    if device == "cpu":
        if "cpu" in max_memory:
            return max_memory["cpu"], True
        return int(host_available() * FIT_FRACTION), False
    import torch

    gpus = [k for k in max_memory if isinstance(k, int)]
    index = torch.cuda.current_device()
    if comm.distributed and gpus:
        if len(gpus) > 1:
            raise UsageError("under torchrun each rank runs on one GPU: give --max-memory one "
                             "GPU budget (e.g. 0=40GiB); it applies to every rank's GPU.")
        return max_memory[gpus[0]], True
    if index in max_memory:
        return max_memory[index], True
    free, _total = torch.cuda.mem_get_info(index)
    return int(free * FIT_FRACTION), False


def decide(weights: int, device: str, max_memory: dict[int | str, int] | None,
           offload: Offload | str, comm: Comm) -> Decision:
    """The mode for a run whose models take ``weights`` bytes on the device together."""
    offload = Offload.parse(offload, "--offload")
    mm = dict(max_memory or {})
    host = mm["cpu"] if "cpu" in mm and device != "cpu" else int(host_available() * FIT_FRACTION)
    # several GPUs, or disk: accelerate's spread as asked (one GPU and cpu: a cap and the host
    # memory of layer streaming)
    explicit_spread = len([k for k in mm if isinstance(k, int)]) > 1 or "disk" in mm
    if comm.distributed and explicit_spread and device != "cpu":
        explicit_spread = False  # checked by _device_budget: one GPU per rank
    budget, capped = _device_budget(device, mm, comm)
    fits = weights <= FIT_FRACTION * budget if capped else weights <= budget

    def made(mode: str, reason: str) -> Decision:
        # every rank takes the same steps: if one must stream, all do
        if comm.distributed and comm.agree_max(int(mode == "layers"), "the mode"):
            mode, reason = "layers", reason if mode == "layers" else "another rank streams"
        return Decision(mode, reason, device, budget, host, weights, mm, capped)

    if offload is Offload.LAYERS:
        if explicit_spread and not comm.distributed:
            raise UsageError("--offload layers streams on one device: give --max-memory one "
                             "budget for it (and cpu=SIZE for the host), not several devices.")
        return made("layers", "--offload layers")
    if not comm.distributed and (explicit_spread or offload is Offload.NONE and mm):
        return made("spread", "--max-memory names several devices" if explicit_spread else
                    "--offload none with --max-memory: accelerate's device map")
    if fits:
        return made("whole", f"{format_bytes(weights)} fit the {device} budget "
                             f"{format_bytes(budget)}")
    if device == "cuda" and not comm.distributed and not capped:
        import torch

        count = torch.cuda.device_count()
        total = sum(torch.cuda.mem_get_info(i)[0] for i in range(count))
        if count > 1 and (weights <= FIT_FRACTION * total or offload is Offload.NONE):
            return made("spread", f"{format_bytes(weights)} fit {count} GPUs together")
    if offload is Offload.NONE:
        return made("whole", "--offload none")
    return made("layers", f"{format_bytes(weights)} do not fit the {device} budget "
                          f"{format_bytes(budget)}")


@dataclass
class StreamPlan:
    """What a streaming run will hold and read (see the module docstring)."""

    decision: Decision
    layers: int
    per_block: int
    tier: str  # where hidden states wait: device | host | spill
    layer_bytes: int  # the largest layer (of the largest model streamed)
    block_bytes: int
    rest_bytes: int
    hidden_bytes: int  # every stream's hidden states and layer arguments
    activation_bytes: int  # one batch inside a layer (estimate)
    read_bytes: int  # read from disk per pass over the layers
    passes: int
    batches: int
    ranks: int = 1
    seconds: float | None = None  # estimated, from a measured probe (None: not probed)
    probe: dict[str, float] = field(default_factory=dict)

    @property
    def device_peak(self) -> int:
        on_device = self.hidden_bytes if self.tier == "device" else 0
        return max(self.block_bytes, self.rest_bytes) + on_device + self.activation_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["device_peak"] = self.device_peak
        return d

    def lines(self) -> list[str]:
        d = self.decision
        where = {"device": f"on the {d.device}", "host": "in host memory",
                 "spill": "in a spill file beside the output"}[self.tier]
        out = [f"mode: layer streaming ({d.reason}), {self.layers} layers in "
               f"{math.ceil(self.layers / self.per_block)} block(s) of up to {self.per_block}"
               + (f", {self.ranks} ranks" if self.ranks > 1 else ""),
               f"{d.device} per device: at most {format_bytes(self.device_peak)} of the "
               f"budget {format_bytes(d.device_budget)} (a block {format_bytes(self.block_bytes)}"
               f", one batch's activations ~{format_bytes(self.activation_bytes)}"
               + (f", hidden states {format_bytes(self.hidden_bytes)}"
                  if self.tier == "device" else "") + ")",
               f"hidden states: {format_bytes(self.hidden_bytes)} {where}"
               + (f" (host budget {format_bytes(d.host_budget)})" if self.tier != "device"
                  else ""),
               f"reads {format_bytes(self.read_bytes * self.passes)} from disk "
               f"({self.passes} pass(es) over {self.batches} batch(es) per rank)"]
        if self.seconds is not None:
            out.append(f"estimated time: {_duration(self.seconds)} (measured on layer 0: "
                       f"read {self.probe.get('read_s', 0):.2f} s, "
                       f"{self.probe.get('batch_s', 0) * 1000:.1f} ms per batch)")
        return out


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def whole_lines(d: Decision) -> list[str]:
    """``--plan`` for a run that does not stream."""
    what = {"whole": f"the whole model on the {d.device}",
            "spread": "one model spread over the devices of one host (accelerate)"}[d.mode]
    return [f"mode: {what} ({d.reason})",
            f"weights: {format_bytes(d.weights)} on the device(s); budget "
            f"{format_bytes(d.device_budget)} per device",
            f"reads {format_bytes(d.weights)} from disk once"]


def layout(decision: Decision, layer_bytes: list[int], rest_bytes: int,
           hidden_bytes: int, batch_tokens: int, width: int, itemsize: int, *,
           passes: int = 1, batches: int = 1, ranks: int = 1, logits_bytes: int = 0,
           extra_bytes: int = 0) -> StreamPlan:
    """Size a streaming run: ``layer_bytes`` per layer (the largest model's), ``hidden_bytes``
    of every stream, ``batch_tokens`` in the largest batch and ``width`` the widest activation
    (intermediate size) at ``itemsize`` bytes; ``extra_bytes``: what the work on one layer
    holds beside its weights (GPTQ's input matrices and its solve)."""
    largest = (max(layer_bytes) if layer_bytes else 0) + extra_bytes
    act = batch_tokens * width * itemsize * ACTIVATION_FACTOR
    act = max(act, logits_bytes)
    budget = decision.device_budget
    tier = "device"  # on a CPU run the host is the device: it holds them or a file does
    if max(largest, rest_bytes) + act + hidden_bytes > budget:
        tier = "host" if decision.device != "cpu" and hidden_bytes <= decision.host_budget \
            else "spill"
    on_device = hidden_bytes if tier == "device" else 0
    room = budget - on_device - act
    if largest > room or rest_bytes + on_device + act > budget:
        what = (f"one decoder layer needs {format_bytes(largest)}" if largest > room else
                f"the embeddings and head need {format_bytes(rest_bytes)}")
        raise Fp8ExportError(
            f"{what} and one batch's activations ~{format_bytes(act)}"
            + (f" beside the hidden states ({format_bytes(on_device)})" if on_device else "")
            + f", more than the {decision.device} budget {format_bytes(budget)} holds. Give "
            "more memory (--max-memory), or a smaller --batch-size or --seq-len.")
    # One layer at a time: the hidden states are read and written once per layer either way on
    # the device, and on the host the copies overlap the computation (Stream.run); only a spill
    # file, read and written through the page cache, gains from several layers per visit.
    fit = max(1, min(len(layer_bytes), int(room // max(largest, 1))))
    per_block = fit if tier == "spill" else 1
    block = _block_bytes(layer_bytes, per_block) + extra_bytes
    return StreamPlan(decision, len(layer_bytes), per_block, tier, largest, block, rest_bytes,
                      hidden_bytes, act, sum(layer_bytes) + rest_bytes, passes, batches, ranks)


def _block_bytes(layer_bytes: list[int], per_block: int) -> int:
    return max((sum(layer_bytes[s:s + per_block]) for s in range(0, len(layer_bytes),
                                                                 per_block)), default=0)


def spill_parent(output: Path | None) -> Path | None:
    """Where a spill file goes: the output's parent folder (None: the system's temp folder)."""
    if output is None:
        return None
    parent = Path(output).absolute().parent
    return parent if parent.is_dir() else None


def hidden_bytes(batches, width: int, itemsize: int) -> int:
    """One stream's hidden states (``[B, T, width]`` per batch) and the attention masks its
    layers are given (at most ``[B, T, T]`` bytes per batch, shared by the layers)."""
    total = 0
    for b in batches:
        rows, t = (int(x) for x in b.input_ids.shape)
        total += rows * t * width * itemsize + rows * t * t
    return total


def widths(config: dict[str, Any]) -> tuple[int, int]:
    """``(hidden size, widest activation inside a layer)`` from a model's config."""
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    hidden = int(cfg.get("hidden_size") or cfg.get("n_embd") or cfg.get("d_model") or 1)
    inner = [cfg.get(k) for k in ("intermediate_size", "moe_intermediate_size", "n_inner",
                                  "ffn_dim")]
    return hidden, max([hidden, *[int(v) for v in inner if isinstance(v, int)]])


def measure(parts, batches, device, *, tier: str = "device") -> dict[str, float]:
    """Time layer 0 on the first batch: reading its tensors, putting them on the device and
    running the batch through it (what the estimate of :class:`StreamPlan` scales up)."""
    import time

    import torch

    from fp8export.streaming.stream import Stream

    def sync():
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()

    stream = Stream(parts, list(batches[:1]), device, tier=tier, name="probe")
    try:
        stream.capture()
        t0 = time.perf_counter()
        values = parts.read_layer(0)
        t1 = time.perf_counter()
        layer = parts.build_layer(0, device, values)
        sync()
        t2 = time.perf_counter()
        stream.run([(0, layer)], write=False)
        sync()
        t3 = time.perf_counter()
    finally:
        stream.close()
    return {"read_s": t1 - t0, "build_s": t2 - t1, "batch_s": t3 - t2}


def estimate(plan: StreamPlan, probe: dict[str, float], streams: int = 1) -> float:
    """Seconds for ``plan``: per block, its reading (overlapped with the previous block's
    compute) or its compute, whichever is longer, for each pass and stream."""
    per_layer_compute = probe["build_s"] + probe["batch_s"] * plan.batches
    per_block = max(probe["read_s"] * plan.per_block, per_layer_compute * plan.per_block)
    blocks = math.ceil(plan.layers / plan.per_block)
    return per_block * blocks * plan.passes * streams


def load_decided(path, decision: Decision, dtype):
    """The whole model for a run that does not stream: ``(model, config, placement or
    None)`` (placement: accelerate's spread, closed by the caller)."""
    from fp8export.models import load_model, load_model_spread

    budgets = decision.spread_budgets()
    if budgets is not None:
        return load_model_spread(path, budgets, dtype=dtype)
    model, config = load_model(path, dtype=dtype, device=decision.device)
    return model, config, None
