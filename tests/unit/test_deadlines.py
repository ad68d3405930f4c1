"""The test kit's one ``wait_until`` (hybrid_offload/testing/deadlines.py), on an injected clock:
it returns what the condition returned, counts ignored errors as "not yet", runs ``between``
instead of sleeping, and fails naming what it waited for."""

from __future__ import annotations

import pytest

from hybrid_offload.testing.deadlines import wait_until


def test_returns_the_first_truthy_result_running_between_in_between() -> None:
    answers = iter([None, 0, [], "ready"])
    pumped: list[int] = []
    assert wait_until(lambda: next(answers), "ready", between=lambda: pumped.append(1)) == "ready"
    assert pumped == [1, 1, 1]


def test_ignored_errors_are_not_yet_others_give_up_at_once() -> None:
    calls = iter([KeyError("a"), KeyError("b"), 7])

    def condition() -> int:
        got = next(calls)
        if isinstance(got, Exception):
            raise got
        return got

    assert wait_until(condition, "seven", ignore=(KeyError,), between=lambda: None) == 7

    def died() -> bool:
        raise ValueError("process died")

    with pytest.raises(ValueError, match="process died"):
        wait_until(died, "never", ignore=(KeyError,), between=lambda: None)


def test_times_out_on_the_clock_naming_what_was_awaited() -> None:
    now = [0.0]
    seen = []

    def tick() -> None:
        now[0] += 1.0

    def condition() -> bool:
        seen.append(now[0])
        return False

    with pytest.raises(AssertionError, match=r"^pages stored \(4 checks\): not within 3 s$"):
        wait_until(condition, lambda: f"pages stored ({len(seen)} checks)", timeout_s=3.0, between=tick,
                   clock=lambda: now[0])  # fmt: skip
    assert seen == [0.0, 1.0, 2.0, 3.0]
