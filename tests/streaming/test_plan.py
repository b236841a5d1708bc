"""The plan: whole, spread or layer streaming, and the size of a streaming run
(fp8export/streaming/plan.py)."""

from __future__ import annotations

import pytest

from fp8export.distributed import Comm
from fp8export.errors import Fp8ExportError, UsageError
from fp8export.streaming.plan import decide, layout

MiB = 1 << 20


@pytest.mark.parametrize("offload,max_memory,mode", [
    ("auto", {"cpu": 100 * MiB}, "whole"),  # fits the cap
    ("auto", {"cpu": 10 * MiB}, "layers"),  # does not: streamed
    ("layers", {"cpu": 100 * MiB}, "layers"),  # forced
    ("none", {"cpu": 10 * MiB}, "spread"),  # accelerate's device map, as before
    ("auto", {"cpu": 10 * MiB, "disk": 100 * MiB}, "spread"),  # several devices: spread
])
def test_the_mode_follows_offload_and_the_budget(offload, max_memory, mode):
    d = decide(40 * MiB, "cpu", max_memory, offload, Comm())
    assert d.mode == mode and d.device_budget == max_memory["cpu"]


def test_forced_streaming_takes_one_device():
    with pytest.raises(UsageError, match="one budget"):
        decide(MiB, "cpu", {"cpu": MiB, "disk": MiB}, "layers", Comm())


def _plan(budget, host=1 << 40, hidden=10 * MiB):
    from fp8export.streaming.plan import Decision

    d = Decision("layers", "test", "cuda", budget, host, 1 << 40)
    return layout(d, [4 * MiB] * 10, 2 * MiB, hidden, 512, 256, 2)


def test_hidden_states_stay_on_the_device_when_they_fit_beside_a_layer():
    p = _plan(40 * MiB)
    assert p.tier == "device" and p.per_block == 1
    assert p.device_peak == 4 * MiB + 10 * MiB + p.activation_bytes <= 40 * MiB


def test_hidden_states_go_to_the_host_then_to_a_spill_file_visited_per_block():
    host = _plan(12 * MiB)
    assert host.tier == "host" and host.per_block == 1
    assert host.device_peak == 4 * MiB + host.activation_bytes  # one layer and one batch
    spill = _plan(12 * MiB, host=5 * MiB)
    assert spill.tier == "spill" and spill.per_block == (12 * MiB - spill.activation_bytes) // \
        (4 * MiB) > 1


def test_a_layer_larger_than_the_budget_is_refused_with_the_numbers():
    with pytest.raises(Fp8ExportError, match="one decoder layer needs 4.0 MiB"):
        _plan(3 * MiB)
