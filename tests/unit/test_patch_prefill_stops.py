"""The prefill-stop patch: shortens a split to the connector's checkpoint, nothing
else (version gating and idempotence: ``test_patches.py``).

vLLM's own split is replaced by a stub returning what vLLM would schedule, so the wrapper's
rule is tested alone; that real engines stop there is checked end to end (an in-process engine,
whose own split would not stop at 128-token positions, loads the tail of a repeated prompt:
``tests/e2e/test_connector_e2e.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from hybrid_offload.engine import patches
from hybrid_offload.engine.patches import prefill_stops


@pytest.fixture
def vllm_split(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Any, ...]]]:
    """Scheduler._mamba_block_aligned_split replaced by a stub that schedules everything asked
    (restored after the test); the calls it got."""
    calls: list[tuple[Any, ...]] = []

    def split(self: Any, request: Any, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
              num_external_computed_tokens: int = 0) -> int:
        calls.append((request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens))
        return num_new_tokens

    monkeypatch.setattr(Scheduler, "_mamba_block_aligned_split", split)
    yield calls


class Connector:
    def __init__(self, stops: list[int]) -> None:
        self.stops = stops
        self.aligns: list[int] = []

    def prefill_stop(self, request: Any, start: int, end: int, align: int) -> int:
        self.aligns.append(align)
        return next((s for s in self.stops if start < s < end), end)


def scheduler_with(connector: Any, **kw: Any) -> SimpleNamespace:
    """What the split reads of vLLM's scheduler (its block size: 544 tokens)."""
    return SimpleNamespace(connector=connector, cache_config=SimpleNamespace(block_size=544), **kw)


def test_a_step_stops_at_the_first_checkpoint_inside_it(vllm_split) -> None:
    prefill_stops.register()
    split = Scheduler._mamba_block_aligned_split
    assert patches.is_patched(split)
    scheduler = scheduler_with(Connector([1024, 2944]))
    request = SimpleNamespace(num_computed_tokens=0)
    assert split(scheduler, request, 3000) == 1024
    assert scheduler.connector.aligns == [544]  # vLLM's own steps end on its blocks
    request.num_computed_tokens = 1024
    assert split(scheduler, request, 1976) == 2944 - 1024
    # local and external hits move the start
    request.num_computed_tokens = 0
    assert split(scheduler, request, 2000, 512, 512) == 2944 - 1024
    assert split(scheduler, request, 100, 0, 2944) == 100  # past the last checkpoint
    assert split(scheduler, request, 0) == 0
    assert len(vllm_split) == 5


def test_other_connectors_and_no_connector_are_left_alone(vllm_split) -> None:
    prefill_stops.register()
    split = Scheduler._mamba_block_aligned_split
    request = SimpleNamespace(num_computed_tokens=0)
    assert split(scheduler_with(None), request, 3000) == 3000
    assert split(scheduler_with(object()), request, 3000) == 3000


def test_never_longer_and_at_least_one_token(vllm_split) -> None:
    prefill_stops.register()
    split = Scheduler._mamba_block_aligned_split
    request = SimpleNamespace(num_computed_tokens=10)

    class Wild:
        def prefill_stop(self, request: Any, start: int, end: int, align: int) -> int:
            return {0: 5000, 1: start}[self.calls.pop(0)]

        calls = [0, 1]

    scheduler = scheduler_with(Wild())
    assert split(scheduler, request, 100) == 100  # a stop beyond vLLM's end is ignored
    assert split(scheduler, request, 100) == 1  # a stop at the start still schedules one token


def test_a_split_with_other_arguments_is_not_patched(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    def split(self: Any, request: Any, num_new_tokens: int) -> int:
        return num_new_tokens

    monkeypatch.setattr(Scheduler, "_mamba_block_aligned_split", split)
    with caplog.at_level(logging.WARNING, logger=patches.logger.name):
        prefill_stops.register()
    assert Scheduler._mamba_block_aligned_split is split
    assert "the split takes ['self', 'request', 'num_new_tokens']" in caplog.text


def test_outside_align_mode_the_split_runs_for_the_connectors_stops_only(vllm_split) -> None:
    """Mamba cache mode "none" (prefix caching off): vLLM never calls its split, so the patched
    ``__init__`` turns it on where the connector names stops, and vLLM's alignment is skipped."""
    prefill_stops.register()
    assert patches.is_patched(Scheduler.__init__)

    def built(connector: Any, mamba: bool = True, align: bool = False) -> Any:
        """A scheduler as vLLM's ``__init__`` left it, then the wrapper's part."""
        scheduler = scheduler_with(connector, has_mamba_layers=mamba, need_mamba_block_aligned_split=align)
        prefill_stops.split_in_every_mode(lambda self: None)(scheduler)
        return scheduler

    ours = built(Connector([1024]))
    assert ours.need_mamba_block_aligned_split
    request = SimpleNamespace(num_computed_tokens=0)
    assert Scheduler._mamba_block_aligned_split(ours, request, 3000) == 1024
    assert vllm_split == []  # vLLM's own split (align-mode rules) is not asked
    assert ours.connector.aligns == [1]  # its steps end anywhere
    assert not built(object()).need_mamba_block_aligned_split  # another connector
    assert not built(Connector([1024]), mamba=False).need_mamba_block_aligned_split
    aligned = built(Connector([1024]), align=True)  # align mode: vLLM's split, then our stops
    assert Scheduler._mamba_block_aligned_split(aligned, request, 3000) == 1024
    assert len(vllm_split) == 1 and aligned.connector.aligns == [544]
