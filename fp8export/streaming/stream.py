"""One model's samples streamed through its decoder layers: every batch through layer (block)
``i`` before layer ``i + 1`` is loaded (llm-compressor's sequential pipeline, on our modules).

1. **Capture**: the skeleton runs its own ``forward`` on each batch with every decoder layer
   replaced by a catcher that records the arguments the model gives that layer (attention mask,
   position embeddings: whatever the architecture passes, per layer, since some give different
   layers different masks) and passes the hidden states on unchanged; the last raises to stop.
   Only the modules before the layers read their tensors (the embedding). The first layer's
   input of each batch goes to the :class:`~fp8export.streaming.store.HiddenStore`.
2. **Layers**: block by block (one layer, or as many as the plan fits), read from the shards
   (the next block's tensors in a background thread while this one runs), each batch's hidden
   states through the block with the recorded arguments, the output back into the store.
3. **Tail**: the skeleton's ``forward`` again per batch, on zeros instead of the embedding,
   with replay layers that return the stored final hidden states: the final norm, the head and
   whatever the architecture does after its layers (soft-capping, scaling) run as transformers
   wrote them, one batch at a time.

Every operation on a batch is the one the whole model runs on it, in the same order, on the same
device: the numbers are bit-identical to the whole-model pass (tests check it).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fp8export.errors import Fp8ExportError
from fp8export.streaming.parts import Parts, move_buffers, pin_tensors, pinned_reads
from fp8export.streaming.store import HiddenStore

IN_FLIGHT = 2
"""Batches of a layer the host may queue ahead of the one the GPU has finished (host tier on a
GPU): enough to hide the host's time per batch, few enough that their hidden states on the
device stay small beside one batch's activations."""


class _Stop(Exception):
    """Raised by the last catcher: the capture has what it needs."""


class _Catcher(nn.Module):
    def __init__(self, index: int, last: bool, record: Callable):
        super().__init__()
        self.index, self.last, self.record = index, last, record

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        self.record(self.index, hidden, args[1:], kwargs)
        if self.last:
            raise _Stop
        return hidden


class _Replay(nn.Module):
    def __init__(self, hidden: torch.Tensor, as_tuple: bool):
        super().__init__()
        self.hidden, self.as_tuple = hidden, as_tuple

    def forward(self, *args, **kwargs):
        return (self.hidden,) if self.as_tuple else self.hidden


@contextlib.contextmanager
def _layers_replaced(parts: Parts, make: Callable[[int], nn.Module]) -> Iterator[None]:
    original = list(parts.layers)
    for i in range(parts.count):
        parts.layers[i] = make(i)
    try:
        yield
    finally:
        for i, m in enumerate(original):
            parts.layers[i] = m


def _move(obj: Any, device: torch.device, memo: dict[int, Any], pin: bool = False) -> Any:
    """``obj`` (tensors in tuples, lists, dicts) with every tensor on ``device``; a tensor met
    twice (one mask shared by every layer) is moved once. A copy from page-locked memory does
    not wait for the device (a blocking copy would stall the host until the GPU's queue
    drains); ``pin``: tensors moved to the host are page-locked for that."""
    if isinstance(obj, torch.Tensor):
        got = memo.get(id(obj))
        if got is None:
            got = obj.to(device, non_blocking=obj.device.type == "cpu" and obj.is_pinned())
            if pin and got.device.type == "cpu" and not got.is_pinned():
                got = got.pin_memory()
            memo[id(obj)] = got
        return got
    if isinstance(obj, tuple):
        moved = [_move(o, device, memo, pin) for o in obj]
        # a NamedTuple (the FP8 attention's MaskInfo) keeps its type
        return type(obj)(*moved) if hasattr(obj, "_fields") else tuple(moved)
    if isinstance(obj, list):
        return [_move(o, device, memo, pin) for o in obj]
    if isinstance(obj, dict):
        return {k: _move(v, device, memo, pin) for k, v in obj.items()}
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def first_tensor(out: Any) -> torch.Tensor:
    """A layer's hidden-state output (transformers 5 returns the tensor; older layers a tuple)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise Fp8ExportError(f"internal: a decoder layer returned {type(out).__name__}, not its "
                         "hidden states.")


@dataclass
class Stream:
    """One model (``parts``) streamed over ``batches`` on ``device`` (see the module doc).

    ``tier``: where hidden states wait (:data:`~fp8export.streaming.store.TIERS`);
    ``spill_dir``: the spill file's parent.
    """

    parts: Parts
    batches: Sequence[Any]  # inputs.samples.Batch
    device: torch.device
    tier: str = "device"
    spill_dir: Path | None = None
    name: str = "model"
    store: HiddenStore | None = None
    args: list[list[tuple[tuple, dict]]] = field(default_factory=list)  # [batch][layer]
    as_tuple: bool = False
    _side: Any = None  # the copy stream of the host tier on a GPU

    def __post_init__(self):
        self.device = torch.device(self.device)

    def forward_kwargs(self) -> dict[str, Any]:
        cfg = getattr(self.parts.skeleton, "config", None)
        if getattr(cfg, "is_encoder_decoder", False):
            raise Fp8ExportError("encoder-decoder models are not streamed; run them whole "
                                 "(--offload none).")
        return {"use_cache": False} if getattr(cfg, "use_cache", None) is not None else {}

    # -- 1. capture ------------------------------------------------------------------------------
    def capture(self) -> None:
        """Run the modules before the layers on every batch; record each layer's arguments
        and keep the first layer's input."""
        parts, dev = self.parts, self.device
        move_buffers(parts.skeleton, dev)
        kw = self.forward_kwargs()
        keep_dev = self.tier == "device"
        pin = dev.type == "cuda"
        self.store = HiddenStore(self.tier, dev, self.spill_dir, self.name)
        self.args = []
        now: dict[str, Any] = {}

        def record(i, hidden, args, kwargs):
            if i == 0:
                now["hidden"] = hidden
            now.setdefault("layers", []).append((args, kwargs))

        with parts.rest_on(dev), torch.inference_mode(), \
                _layers_replaced(parts, lambda i: _Catcher(i, i == parts.count - 1, record)):
            for b, batch in enumerate(self.batches):
                now.clear()
                try:
                    parts.skeleton(input_ids=batch.input_ids.to(dev),
                                   attention_mask=batch.attention_mask.to(dev), **kw)
                except _Stop:
                    pass
                else:
                    raise Fp8ExportError("internal: the model never reached its last layer.")
                memo: dict[int, Any] = {}
                target = dev if keep_dev else torch.device("cpu")
                self.args.append([_move(a, target, memo, pin) for a in now["layers"]])
                h = now["hidden"]
                if b == 0:  # the hidden size and dtype: room for every batch
                    self.store.reserve([tuple(x.input_ids.shape) + tuple(h.shape[2:])
                                        for x in self.batches], h.dtype)
                self.store.put(b, h)

    # -- 2. layers -------------------------------------------------------------------------------
    def run(self, block: Sequence[tuple[int, nn.Module]], *,
            before: Callable[[int], None] | None = None,
            after: Callable[[int, torch.Tensor], None] | None = None,
            write: bool = True) -> None:
        """Every batch through the layers of ``block`` (``(index, module)`` in order).

        ``before(b)`` runs before batch ``b`` enters the block, ``after(b, out)`` with its
        output; ``write=False`` leaves the stored inputs as they are (a pass that only
        observes, before the layer changes).
        """
        store = self.store
        if store.tier == "host" and self.device.type == "cuda" and len(self.batches):
            self._run_overlapped(block, before, after, write)
            return
        for b in range(len(self.batches)):
            if before is not None:
                before(b)
            memo: dict[int, Any] = {}
            h = store.get(b)
            h = self._layers(block, b, h, memo)
            if after is not None:
                after(b, h)
            if write:
                store.put(b, h)

    def _layers(self, block, b: int, h: torch.Tensor, memo: dict[int, Any]) -> torch.Tensor:
        with torch.inference_mode():
            for i, layer in block:
                args, kwargs = _move(self.args[b][i], self.device, memo)
                out = layer(h, *args, **kwargs)
                self.as_tuple = not isinstance(out, torch.Tensor)
                h = first_tensor(out)
        return h

    def _run_overlapped(self, block, before, after, write: bool) -> None:
        """Host tier on a GPU: the next batch's hidden states (and arguments) are copied in,
        and each output copied out, on a side stream while the batches compute, so the copies
        cost no time as long as the layer takes longer than they do. Nothing here waits for
        the GPU but the bound on the batches in flight (:data:`IN_FLIGHT`): the host queues
        the next batches (and the next layer) while the GPU computes, and the device holds
        at most that many batches' inputs and outputs beside the one computing. Every later
        use of the host buffers is ordered after the copies (the side stream's own order, and
        the main stream waits for it at the end)."""
        store, dev = self.store, self.device
        if self._side is None:
            self._side = torch.cuda.Stream(dev)
        side = self._side
        main = torch.cuda.current_stream(dev)
        side.wait_stream(main)  # the host buffers as the main stream last left them

        def fetch(b):
            with torch.cuda.stream(side):
                memo: dict[int, Any] = {}
                h = store.items[b].to(dev, non_blocking=True)
                args = [_move(self.args[b][i], dev, memo) for i, _ in block]
                ready = torch.cuda.Event()
                ready.record(side)
            return h, args, ready

        pending = fetch(0)
        flight: list[torch.cuda.Event] = []
        for b in range(len(self.batches)):
            h, args, ready = pending
            main.wait_event(ready)
            for t in [h, *_tensors(args)]:  # made on the side stream, used on this one
                t.record_stream(main)
            if b + 1 < len(self.batches):
                pending = fetch(b + 1)
            if before is not None:
                before(b)
            with torch.inference_mode():
                for (i, layer), (a, kw) in zip(block, args, strict=True):
                    out = layer(h, *a, **kw)
                    self.as_tuple = not isinstance(out, torch.Tensor)
                    h = first_tensor(out)
            if after is not None:
                after(b, h)
            finished = torch.cuda.Event()
            if write:
                computed = torch.cuda.Event()
                computed.record(main)
                with torch.cuda.stream(side), torch.inference_mode(False):
                    side.wait_event(computed)
                    store.items[b].copy_(h, non_blocking=True)
                    h.record_stream(side)
                    finished.record(side)
            else:
                finished.record(main)
            del h, args
            flight.append(finished)
            if len(flight) > IN_FLIGHT:
                flight.pop(0).synchronize()
        main.wait_stream(side)

    # -- 3. tail ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def tail(self) -> Iterator[Callable[[int], Any]]:
        """A function of the batch index giving the model's output (logits) for that batch,
        computed by the skeleton's own forward on the stored final hidden states."""
        parts, dev = self.parts, self.device
        kw = self.forward_kwargs()
        final: dict[str, torch.Tensor] = {}
        with parts.rest_on(dev), _layers_replaced(
                parts, lambda i: _Replay(torch.empty(0), self.as_tuple)):
            def logits(b: int):
                h = self.store.get(b)
                for layer in parts.layers:
                    layer.hidden = h
                batch = self.batches[b]
                final["zeros"] = torch.zeros_like(h)
                with torch.inference_mode():
                    return parts.skeleton(inputs_embeds=final["zeros"],
                                          attention_mask=batch.attention_mask.to(dev), **kw)
            yield logits

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        self.args = []


class Prefetcher:
    """Reads the tensors of the next block in a background thread while the current one runs;
    ``pin``: into page-locked memory (for a GPU), so that putting the block on the device is
    one fast copy per tensor that the host does not wait for."""

    def __init__(self, parts: Parts, blocks: list[list[int]], pin: bool = False):
        self.parts, self.blocks, self.pin = parts, blocks, pin
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="fp8export-prefetch")
        self.pending: dict[int, Any] = {}

    def _read(self, k: int):
        if not self.pin:
            return [self.parts.read_layer(i) for i in self.blocks[k]]
        with pinned_reads():
            return [pin_tensors(self.parts.read_layer(i)) for i in self.blocks[k]]

    def get(self, k: int) -> list[dict[str, torch.Tensor]]:
        """Block ``k``'s tensors (waiting for them); block ``k + 1`` starts reading."""
        fut = self.pending.pop(k, None)
        values = fut.result() if fut is not None else self._read(k)
        if k + 1 < len(self.blocks) and k + 1 not in self.pending:
            self.pending[k + 1] = self.pool.submit(self._read, k + 1)
        return values

    def close(self) -> None:
        for fut in self.pending.values():
            fut.cancel()
        self.pool.shutdown(wait=True)
        self.pending = {}


def layer_blocks(count: int, per_block: int) -> list[list[int]]:
    per_block = max(1, int(per_block))
    return [list(range(s, min(s + per_block, count))) for s in range(0, count, per_block)]


class Blocks:
    """The blocks of one model's layers, built on ``device`` in order (the next one read in the
    background); ``comm.check()`` after each, so a failed rank stops every rank at the next
    block."""

    def __init__(self, parts: Parts, per_block: int, device: torch.device, comm=None):
        self.parts, self.device, self.comm = parts, torch.device(device), comm
        self.blocks = layer_blocks(parts.count, per_block)
        self.prefetch = Prefetcher(parts, self.blocks, pin=self.device.type == "cuda")
        self.last: list[weakref.ref] = []  # the modules of the block built last

    def alive(self) -> int:
        """How many modules of the block built last are still alive (kept by a caller)."""
        return sum(r() is not None for r in self.last)

    def __len__(self) -> int:
        return len(self.blocks)

    def build(self, k: int) -> list[tuple[int, nn.Module]]:
        """Block ``k`` on the device; the previous block is gone first (its modules are only
        collected here if a reference cycle, such as a hook, outlived it)."""
        if self.alive():
            import gc

            gc.collect()
        values = self.prefetch.get(k)
        built = [(i, self.parts.build_layer(i, self.device, v))
                 for i, v in zip(self.blocks[k], values, strict=True)]
        self.last = [weakref.ref(m) for _, m in built]
        return built

    def done(self, k: int) -> None:
        if self.comm is not None:
            self.comm.check(f"layer block {k + 1} of {len(self.blocks)}")

    def close(self) -> None:
        self.prefetch.close()

    def __enter__(self) -> Blocks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def each_block(blocks: Blocks, desc: str) -> Iterator[tuple[int, list[tuple[int, nn.Module]]]]:
    """``(k, built block)`` for every block with a progress line. The list is emptied when the
    caller asks for the next one (so two blocks never share the device: keep no other
    reference to its modules), and the ranks are checked."""
    from fp8export._progress import progress

    for k in progress(range(len(blocks)), total=len(blocks), desc=desc, unit="block"):
        block = blocks.build(k)
        yield k, block
        block.clear()
        blocks.done(k)
