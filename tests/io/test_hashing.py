"""The ordered sha256: ranges added out of order, from several threads, give the file's
digest; a tight budget makes threads wait instead of parking without bound."""

from __future__ import annotations

import hashlib
import random
import threading

import pytest

from fp8export.io.hashing import HashBudget, OrderedSha256


def _ranges(data: bytes, head: int, rng: random.Random) -> list[tuple[int, bytes]]:
    out, pos = [], head
    while pos < len(data):
        n = rng.randint(1, 5000)
        out.append((pos, data[pos:pos + n]))
        pos += n
    return out


@pytest.mark.parametrize("limit", [1, 1 << 20])
def test_out_of_order_ranges_from_threads_give_the_file_digest(limit):
    rng = random.Random(limit)
    data = rng.randbytes(300_000)
    returned: list[object] = []
    budget = HashBudget(limit, returned.append)
    h = OrderedSha256(data[:100], budget)
    ranges = _ranges(data, 100, rng)
    # Like the writer's workers: ranges start in file order, finish in any order.
    lock = threading.Lock()
    todo = list(enumerate(ranges))
    parked = []

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i, (offset, chunk) = todo.pop(0)
            if rng.random() < 0.5:
                threading.Event().wait(0.0005)
            if not h.add(offset, chunk, owner=i):
                parked.append(i)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert h.hexdigest(len(data)) == hashlib.sha256(data).hexdigest()
    assert sorted(returned) == sorted(parked)  # every parked buffer was handed back
    assert budget.parked == 0


def test_a_gap_left_open_is_an_error_not_a_wrong_digest():
    h = OrderedSha256(b"head", HashBudget(1 << 20))
    assert h.add(10, b"later") is False  # bytes 4..10 never came
    with pytest.raises(RuntimeError, match="parked"):
        h.hexdigest(15)
