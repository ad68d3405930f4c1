"""fold64, the payload checksum: the host version, its row-wise form and the torch twin agree
bit for bit at every length, and every change of one byte changes it."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch
import xxhash

from hybrid_offload.connector.worker.device_checksum import fold64_rows as torch_rows
from hybrid_offload.core.checksum import PHI, fold64, fold64_rows, weights

MASK = (1 << 64) - 1


def reference(data: bytes) -> int:
    """The definition, word by word in Python integers."""
    padded = data + bytes(-len(data) % 8)
    total = 0
    for j in range(len(padded) // 8):
        total += int.from_bytes(padded[8 * j : 8 * j + 8], "little") * (((2 * j + 1) * PHI) & MASK)
    return total & MASK


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 9, 63, 64, 65, 4095, 8 * (1 << 15) + 3, 8 * (1 << 16)])
def test_host_rows_and_torch_twin_agree_with_the_definition(nbytes: int) -> None:
    rng = np.random.default_rng(nbytes)
    rows = rng.integers(0, 256, (3, nbytes), dtype=np.uint8)
    want = [reference(r.tobytes()) for r in rows] if nbytes < 5000 else [fold64(r.tobytes()) for r in rows]
    assert [fold64(r.tobytes()) for r in rows] == want
    assert fold64_rows(rows).tolist() == want
    # the twin reads rows in place: 8-byte aligned starts, padding after each row ignored
    width = -(-nbytes // 64) * 64 + 64
    block = torch.from_numpy(rng.integers(0, 256, (3, width), dtype=np.uint8))
    block[:, :nbytes] = torch.from_numpy(rows)
    assert [v & MASK for v in torch_rows(block[:, :nbytes]).tolist()] == want


def test_long_rows_are_summed_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    import hybrid_offload.connector.worker.device_checksum as dc

    monkeypatch.setattr(dc, "SCRATCH_ELEMENTS", 1000)  # every row longer than the scratch
    rows = torch.randint(0, 256, (2, 8 * 2501), dtype=torch.uint8)[:, : 8 * 2500 + 5]
    assert [v & MASK for v in dc.fold64_rows(rows).tolist()] == [fold64(r.numpy().tobytes()) for r in rows]


def test_every_single_byte_change_is_seen() -> None:
    data = bytearray(random.Random(3).randbytes(4096 + 5))
    clean = fold64(data)
    for pos in range(len(data)):
        for delta in (1, 0x80, 0xFF):
            data[pos] ^= delta
            assert fold64(data) != clean, (pos, delta)
            data[pos] ^= delta


def test_weights_are_odd_and_shared() -> None:
    w = weights(1000)
    assert (w & np.uint64(1)).all() and not w.flags.writeable
    assert weights(10).tolist() == w[:10].tolist()


def _others_ran_during(call: Callable[[], object]) -> bool:
    """Whether a spinning Python thread made progress while ``call`` ran, with a switch interval
    far longer than the call: only a call that releases the GIL lets it run."""
    progress = [0]
    done = threading.Event()

    def spin() -> None:
        while not done.is_set():
            progress[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.05)  # before the spinner waits for the GIL: its waits are this long
    spinner = threading.Thread(target=spin)
    try:
        spinner.start()
        time.sleep(0.01)
        before = progress[0]
        call()
        during = progress[0] - before
    finally:
        sys.setswitchinterval(interval)
        done.set()
        spinner.join()
    return during > 0


def test_host_checksum_does_not_hold_the_gil() -> None:
    """(A busy machine may not run the other thread in time: a few tries; one suffices. 32 MiB:
    four numpy calls of several milliseconds each.)"""
    data = np.random.default_rng(0).integers(0, 256, 32 << 20, dtype=np.uint8).tobytes()
    assert any(_others_ran_during(lambda: fold64(data)) for _ in range(10))
    assert not _others_ran_during(lambda: xxhash.xxh3_64_intdigest(data))  # the check can fail
