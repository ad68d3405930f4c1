"""What the store plan tells the tiers about each page it sends (their eviction policy's input).

Per page set: its resume-point unit (a chunk's attention sets together; a chunk's state sets
together), the unit it extends (the previous chunk's attention; a state: its own chunk's
attention), whether it is a state, the weight the application's session hint gives it
(``kv_transfer_params["hybrid_offload"]["session"]``: ``ends`` releases the request's new
pages first), and what the request stores in all (a one-shot prompt that would fill a tier is
a scan there). See :mod:`hybrid_offload.backends.retention`.
"""

from __future__ import annotations

from hybrid_offload.backends.retention import Retention, session_weight
from hybrid_offload.connector.metadata import PageJob
from hybrid_offload.connector.scheduler.request_state import RequestState
from hybrid_offload.core.budgets import attention_bytes_per_token, state_set_bytes
from hybrid_offload.core.planner import HybridOffloadPlanner
from hybrid_offload.core.spec import GroupKind

__all__ = ["RetentionHints", "request_bytes"]


def request_bytes(computed_tokens: int, states: int, token_bytes: float, state_bytes: int) -> int:
    """What a request stores of its prompt in a tier: the chunks it computes and its
    checkpoints' states."""
    return round(max(computed_tokens, 0) * token_bytes) + states * state_bytes


class RetentionHints:
    """Builds each page set's :class:`Retention` (module docstring)."""

    def __init__(self, planner: HybridOffloadPlanner) -> None:
        self.planner = planner
        kinds = [p.kind for p in planner.plans]
        self._attention = next((i for i, k in enumerate(kinds) if k is not GroupKind.MAMBA), None)
        self._state = next((i for i, k in enumerate(kinds) if k is GroupKind.MAMBA), None)
        groups = planner.spec.groups
        self._token_bytes = attention_bytes_per_token(groups)
        self._state_bytes = state_set_bytes(groups)

    def request_bytes(self, state: RequestState) -> int:
        """What the request stores of its prompt in a tier: every chunk it computes, and its
        checkpoints' states (this rank's pieces)."""
        computed = state.prompt_len - state.load_end
        return request_bytes(computed, len(state.checkpoints), self._token_bytes, self._state_bytes)

    def for_page(self, state: RequestState, page: PageJob) -> Retention:
        """A page the request stores."""
        return self._hint(state, page, self.request_bytes(state))

    def for_loaded_page(self, state: RequestState, page: PageJob) -> Retention:
        """A page the request loads and promotes: the request then puts what it loads, its
        resume point's state and what it computes and stores."""
        loaded = request_bytes(state.load_end - state.load_start, 1, self._token_bytes, self._state_bytes)
        return self._hint(state, page, self.request_bytes(state) + loaded)

    def _hint(self, state: RequestState, page: PageJob, nbytes: int) -> Retention:
        keys, c = state.keys, page.chunk_index
        is_state = self.planner.plans[page.group].kind is GroupKind.MAMBA
        attention = "" if self._attention is None else "a" + keys[self._attention][c]
        if is_state:
            unit, parent = "s" + keys[self._state][c], attention  # type: ignore[index]
        else:
            unit = attention
            parent = "a" + keys[self._attention][c - 1] if c else ""  # type: ignore[index]
        return Retention(unit, parent, is_state, session_weight(state.session), nbytes)
