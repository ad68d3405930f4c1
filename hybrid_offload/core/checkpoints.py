"""Where a prefill stores its recurrent state: the positions a request's prefill must stop at,
and the states between them taken where steps end anyway.

Pure functions of token positions (no vLLM): the scheduler's store plan calls them per request
and step, and ``bench trace`` replays traffic through the same functions.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["interval_stop", "prefill_checkpoints", "state_due"]


def prefill_checkpoints(prefill_end: int, chunk: int, junction: int = 0, named: int = 0) -> list[int]:
    """Positions (ascending, each a multiple of ``chunk``, below ``prefill_end``) where a prefill
    must stop so that its recurrent state can be stored.

    * the tail: the last chunk boundary before ``prefill_end`` (a repeated prompt, or one that
      extends this one, resumes there; vLLM recomputes at least one token);
    * ``junction`` (0: none): a boundary up to which earlier traffic shares this prefix
      without a stored state there (the next request sharing it resumes there);
    * the last multiple of ``named`` (a multiple of ``chunk``; 0: none) before ``prefill_end``:
      the last state KV events can name for a router.

    States between them (every ``checkpoint_interval_tokens``) are taken where steps end anyway
    (:func:`interval_stop`): a stop there would cost a step each.
    """
    tail = (prefill_end - 1) // chunk * chunk if prefill_end > 0 else 0
    stops = {tail} if tail > 0 else set()
    if named > 0 and prefill_end > named:
        stops.add((prefill_end - 1) // named * named)
    if 0 < junction < prefill_end and junction % chunk == 0:
        stops.add(junction)
    return sorted(stops)


def interval_stop(start: int, end: int, last_state: int, interval: int, align: int) -> int:
    """Where a prefill step over ``[start, end)`` ends so that a state between the fixed
    checkpoints can be stored at its end: ``end`` itself unless a state is due (``interval``
    tokens or more past ``last_state``, the last state stored or loaded) and ``end`` is not a
    multiple of ``align`` (the chunk, times whatever vLLM's own steps end on); then the last
    multiple of ``align`` inside the step, where one is due. Never adds a step where vLLM ends
    its steps on multiples of ``align`` (its block-aligned prefill), and moves the others'
    ends back by less than ``align`` tokens.
    """
    if interval <= 0 or end - last_state < interval or end % align == 0:
        return end
    trimmed = end // align * align
    return trimmed if trimmed > start and trimmed - last_state >= interval else end


def state_due(end: int, checkpoints: Sequence[int], last_state: int | None, interval: int) -> bool:
    """Whether the prefill state at ``end`` (a chunk boundary) is stored: one of the request's
    ``checkpoints``, or ``interval`` (> 0) or more tokens past ``last_state`` (the last state
    stored or loaded; None: none yet)."""
    if end in checkpoints:
        return True
    return interval > 0 and end - (last_state or 0) >= interval
