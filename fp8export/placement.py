"""Where a model runs: ``--device`` (:func:`resolve_device`), and one model spread over the GPUs
of one host (accelerate's ``device_map="auto"``; :func:`fp8export.models.load_model_placed`
picks one device or the spread).

A model larger than one GPU is built on the meta device (parameters take no memory), a device
map is planned from its module sizes (``accelerate.infer_auto_device_map`` over balanced
per-device budgets, as ``from_pretrained(device_map="auto")`` plans it; a decoder layer is
never cut in two), every weight is loaded straight onto its device, and
``accelerate.dispatch_model`` adds the hooks that carry activations from one device to the
next. Nothing is a hand-rolled sharder: the layers run one after another (pipeline without
overlap), which is all calibration and verification need, and each layer computes exactly what
it computes on a single device.

Budgets come from ``--max-memory`` (``0=70GiB,1=70GiB,cpu=100GiB``): GPU indices, ``cpu``
(layers kept in host memory and streamed to a GPU each forward) and ``disk`` (streamed from a
temporary folder). Without it a model is spread only when it needs more than
:data:`FIT_FRACTION` of the first GPU's free memory and several GPUs are visible.

This module imports torch and accelerate lazily: the CLI parses ``--max-memory`` without them.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fp8export.config import Device
from fp8export.errors import Fp8ExportError, UsageError

if TYPE_CHECKING:
    import torch

FIT_FRACTION = 0.8
"""A model spreads when its weights exceed this share of the GPU's free memory (the rest is
left for activations, the logits and the allocator's slack)."""

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
MAX_MEMORY_HELP = ("Memory per device, e.g. 0=70GiB,1=70GiB,cpu=100GiB (GPU indices, cpu, "
                   "disk). Several devices: the model is spread over them with accelerate "
                   "(optional package). One device: its cap (with --offload layers or a model "
                   "larger than it, the layer-streaming budget; cpu=SIZE caps host memory). "
                   "Default: the devices' free memory.")
OFFLOAD_HELP = ("How a model larger than the device runs. auto: whole when it fits, spread over "
                "this host's GPUs when they hold it together, else one decoder layer at a time "
                "from the shards (layer streaming). layers: always stream. none: never stream.")
PLAN_HELP = ("Print the plan (mode, memory per device, bytes read, estimated time measured on "
             "the first layer) and stop.")


def parse_max_memory(text: str | None, flag: str = "--max-memory") -> dict[int | str, int]:
    """``"0=70GiB,1=70GiB,cpu=100GiB"`` -> ``{0: 75161927680, 1: ..., "cpu": ...}`` (bytes).

    Keys: GPU indices, ``cpu`` or ``disk``; sizes with B, KB/MB/GB/TB (powers of 1000) or
    KiB/MiB/GiB/TiB (powers of 1024). UsageError names the part that does not parse.
    """
    if text is None or not str(text).strip():
        return {}
    out: dict[int | str, int] = {}
    for part in str(text).split(","):
        key, eq, size = part.partition("=")
        key = key.strip().lower()
        m = _SIZE.match(size)
        if not eq or not key or m is None or m.group(2).lower() not in _UNITS:
            raise UsageError(f"{flag}: cannot read {part.strip()!r}; write DEVICE=SIZE pairs "
                             "separated by commas, e.g. 0=70GiB,1=70GiB,cpu=100GiB.")
        if key.isdigit():
            dev: int | str = int(key)
        elif key in ("cpu", "disk"):
            dev = key
        else:
            raise UsageError(f"{flag}: device {key!r} is unknown; use GPU indices (0, 1, ...), "
                             "cpu or disk.")
        if dev in out:
            raise UsageError(f"{flag}: device {key!r} is given twice.")
        out[dev] = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        if out[dev] <= 0:
            raise UsageError(f"{flag}: {part.strip()!r} gives no memory; give a size above 0.")
    return out


def format_bytes(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def need_accelerate(what: str) -> None:
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        raise Fp8ExportError(f"{what}: spreading a model over several devices needs the optional "
                             "'accelerate' package (pip install 'fp8export[multi-gpu]'). Or drop "
                             "--max-memory and use one device.")


def budgets(device: str, weight_bytes: int, max_memory: dict[int | str, int] | None
            ) -> dict[int | str, int] | None:
    """The per-device budgets to spread a model of ``weight_bytes`` over, or None for one device.

    ``max_memory`` given: those budgets (checked against the visible GPUs). Else, on ``cuda``
    with several GPUs and a model above :data:`FIT_FRACTION` of GPU 0's free memory: every GPU
    (accelerate's defaults: the free memory of each). Otherwise one device.
    """
    import torch

    if max_memory:
        gpus = [k for k in max_memory if isinstance(k, int)]
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus and device == "cpu":
            raise Fp8ExportError(f"--max-memory names GPU {gpus[0]} but --device is cpu; use "
                                 "--device cuda (or auto), or give only cpu/disk budgets.")
        bad = [g for g in gpus if g >= count]
        if bad:
            raise Fp8ExportError(f"--max-memory names GPU {bad[0]} but {count} GPU(s) are visible "
                                 "to PyTorch; use indices 0.." + str(max(count - 1, 0)) + ".")
        return dict(max_memory)
    if device != "cuda" or torch.cuda.device_count() < 2:
        return None
    free, _total = torch.cuda.mem_get_info(torch.cuda.current_device())
    if weight_bytes <= FIT_FRACTION * free:
        return None
    return {i: torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())}


@dataclass
class Placement:
    """Where a dispatched model's modules went; :meth:`close` removes a disk-offload folder."""

    device_map: dict[str, int | str]
    main_device: str  # where inputs go (the first GPU of the map, else cpu)
    bytes_per_device: dict[str, int] = field(default_factory=dict)
    offload_dir: str | None = None

    def close(self) -> None:
        if self.offload_dir is not None:
            shutil.rmtree(self.offload_dir, ignore_errors=True)
            self.offload_dir = None

    @property
    def devices(self) -> list[str]:
        return list(self.bytes_per_device)

    def describe(self) -> dict[str, Any]:
        """JSON facts: devices in order, modules and weight bytes on each."""
        per = {d: 0 for d in self.devices}
        for dev in self.device_map.values():
            per[_name(dev)] = per.get(_name(dev), 0) + 1
        return {"device_map": "accelerate", "main_device": self.main_device,
                "devices": {d: {"modules": per.get(d, 0), "weights": format_bytes(b)}
                            for d, b in self.bytes_per_device.items()}}

    def remaining(self, budgets: dict[int | str, int]) -> dict[int | str, int]:
        """``budgets`` less what this model's weights take on each device (a second model
        shares them; a device it filled keeps a budget of 0)."""
        return {dev: max(cap - self.bytes_per_device.get(_name(dev), 0), 0)
                for dev, cap in budgets.items()}

    def note(self) -> str:
        parts = ", ".join(f"{d} {format_bytes(b)}" for d, b in self.bytes_per_device.items())
        return f"model spread over {len(self.bytes_per_device)} devices with accelerate: {parts}"


def _name(dev: int | str) -> str:
    return f"cuda:{dev}" if isinstance(dev, int) else str(dev)


def empty_weights():
    """Parameters on the meta device, buffers (rotary tables) real: accelerate's context."""
    from accelerate import init_empty_weights

    return init_empty_weights(include_buffers=False)


def plan(model: torch.nn.Module, max_memory: dict[int | str, int], dtype: torch.dtype
         ) -> dict[str, int | str]:
    """accelerate's device map for ``model`` (meta or real) within ``max_memory``, balanced over
    the GPUs as ``device_map="auto"`` balances them; decoder layers stay whole."""
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    no_split = list(getattr(model, "_no_split_modules", None) or [])
    balanced = get_balanced_memory(model, max_memory=dict(max_memory),
                                   no_split_module_classes=no_split, dtype=dtype)
    return infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split,
                                 dtype=dtype)


def device_for(name: str, device_map: dict[str, int | str]) -> int | str:
    """The map's device of tensor ``name`` (its longest module prefix in the map)."""
    parts = name.split(".")
    for i in range(len(parts), -1, -1):
        key = ".".join(parts[:i])
        if key in device_map:
            return device_map[key]
    raise Fp8ExportError(f"internal: tensor {name} has no device in the plan.")


def _home(dev: int | str) -> str:
    """Where a tensor of a module mapped to ``dev`` is loaded before dispatch (cpu/disk: host)."""
    return "cpu" if dev in ("cpu", "disk") else f"cuda:{dev}"


def fill(model: torch.nn.Module, device_map: dict[str, int | str],
         tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
         ) -> set[str]:
    """Load ``(name, tensor)`` pairs into ``model`` on each name's mapped device; floating
    tensors cast to ``dtype``. Returns the names loaded (one tensor in host memory at a time)."""
    from accelerate.utils import set_module_tensor_to_device

    done = set()
    for name, t in tensors:
        dev = _home(device_for(name, device_map))
        value = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        set_module_tensor_to_device(model, name, dev, value=value)
        done.add(name)
    return done


def materialize(model: torch.nn.Module, device_map: dict[str, int | str],
                make: Callable[[str, torch.Tensor, str], torch.Tensor]) -> None:
    """Replace every meta parameter or buffer of ``model`` by ``make(name, meta, device)``,
    created on its mapped device (random weights for benchmarks, without a checkpoint)."""
    from accelerate.utils import set_module_tensor_to_device

    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.device.type == "meta":
            dev = _home(device_for(name, device_map))
            set_module_tensor_to_device(model, name, dev, value=make(name, t, dev))


def dispatch(model: torch.nn.Module, device_map: dict[str, int | str]) -> Placement:
    """Add accelerate's device hooks to a model whose tensors are loaded (:func:`fill`); moves
    what is still elsewhere and writes ``disk`` modules to a temporary folder."""
    from accelerate import dispatch_model
    from accelerate.utils import compute_module_sizes

    if "" in device_map:  # the whole model on one device: name its children (accelerate's
        # offload selects tensors by "<module>." prefixes, which the root has none of)
        device_map = {n: device_map[""] for n, _ in model.named_children()}
    gpus = [d for d in device_map.values() if isinstance(d, int)]
    main = f"cuda:{gpus[0]}" if gpus else "cpu"
    disk = [m for m, d in device_map.items() if d == "disk"]
    if disk and not any(k.startswith(m + ".") for k in model.state_dict() for m in disk):
        # only rebuilt buffers (rotary tables) landed on disk: nothing to offload
        device_map = {m: ("cpu" if d == "disk" else d) for m, d in device_map.items()}
    offload_dir = None
    if "disk" in device_map.values():
        offload_dir = tempfile.mkdtemp(prefix="fp8export-offload-")
    sizes = compute_module_sizes(model)
    per: dict[str, int] = {}
    for mod, dev in device_map.items():
        per[_name(dev)] = per.get(_name(dev), 0) + sizes.get(mod, 0)
    try:
        dispatch_model(model, device_map, main_device=main,
                       offload_dir=offload_dir, force_hooks=True)
    except BaseException:
        if offload_dir is not None:
            shutil.rmtree(offload_dir, ignore_errors=True)
        raise
    refresh_fast_paths(model)
    follow_current_device(model, device_map, main)
    return Placement(device_map=dict(device_map), main_device=main, bytes_per_device=per,
                     offload_dir=offload_dir)


def follow_current_device(model: torch.nn.Module, device_map: dict[str, int | str],
                          main: str) -> None:
    """Make each placed block's GPU the current CUDA device while it runs: Triton kernels (the
    FP8 runtime's quantize and small-M GEMM) launch on the current device, not on their
    tensors' device. One ``set_device`` per block per forward."""
    import torch

    main_index = int(main.split(":")[1]) if main.startswith("cuda:") else None
    for name, dev in device_map.items():
        index = dev if isinstance(dev, int) else main_index
        if index is not None:
            model.get_submodule(name).register_forward_pre_hook(_set_device(index, torch))


def _set_device(index: int, torch):
    def hook(module, args):
        torch.cuda.set_device(index)
    return hook


def refresh_fast_paths(model: torch.nn.Module) -> None:
    """Modules that cache their tensors for a fast forward re-read them (accelerate swaps
    tensors in ``_buffers`` directly, past ``__setattr__``)."""
    for m in model.modules():
        refresh = getattr(m, "_refresh", None)
        if callable(refresh):
            refresh()


def check_loaded(model: torch.nn.Module, where: str) -> None:
    """Every parameter and buffer is real (not meta) before dispatch."""
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if t.device.type == "meta"]
    if left:
        raise Fp8ExportError(f"{where}: {len(left)} weights the architecture needs were not "
                             f"loaded, e.g. {left[:3]}. The checkpoint does not match its "
                             "config.json.")


def resolve_device(device: Device | str) -> str:
    """``auto`` -> ``cuda`` when available else ``cpu``; ``cuda`` without a GPU is an error."""
    import torch

    d = Device.parse(device, "--device")
    if d is Device.AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if d is Device.CUDA and not torch.cuda.is_available():
        raise Fp8ExportError("--device cuda: no CUDA GPU is visible to PyTorch (torch "
                             f"{torch.__version__}). Use --device cpu or auto.")
    return d.value
