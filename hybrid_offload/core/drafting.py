"""Speculative decoding as the store planner needs to know it (engine-free, frozen).

With drafting a decode step feeds the last sampled token plus ``num_tokens`` draft tokens;
vLLM then rejects some drafts and rewinds, so KV and states computed in a step are only known
right where the step's input tokens are accepted. What follows from it is written once here:

* a position's KV is final once the token *after* it is known: when a step is planned,
  every position below ``request.num_tokens`` (the prompt and the accepted output) holds KV of
  accepted tokens by the time the step's forward is done (:meth:`Drafting.verified_end`);
* a recurrent state after ``B`` tokens exists, in the request's running state slot, right
  after a step whose *first* input is position ``B - 1`` (that token is sampled, never a
  draft). :func:`next_decode_stop` ends a decode step before a chunk boundary so that the next
  step starts there. It needs a scheduler that knows where each step starts (no async
  scheduling: there the next step is planned before the previous one's drafts are verified).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Drafting:
    """The engine's ``speculative_config`` (``method``, ``num_speculative_tokens``) and whether
    its scheduler plans a step before the previous step's drafts are verified (async)."""

    method: str
    num_tokens: int
    async_scheduling: bool

    def verified_end(self, end: int, known_tokens: int) -> int:
        """The end of the positions of a step ending at ``end`` whose KV is final after its
        forward, when ``known_tokens`` are known as it is planned."""
        return min(end, known_tokens)

    @property
    def exact_steps(self) -> bool:
        """Whether a planned step starts where the scheduler says (false under async
        scheduling, where the previous step's rejected drafts move it back)."""
        return not self.async_scheduling


def next_decode_stop(start: int, end: int, chunk: int) -> int:
    """Where a decode step over ``[start, end)`` must end so that no chunk boundary's last
    position ``B - 1`` is fed as a draft: the first such position strictly inside, else
    ``end``. The step then ends before it and the next one starts on it."""
    stop = (start // chunk + 1) * chunk - 1
    if stop == start:
        stop += chunk
    return stop if stop < end else end
