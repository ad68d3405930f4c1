"""Per request: how much of its prefix earlier traffic could have served, and why it did not.

Pure data, computed by the scheduler side at the request's last lookup before vLLM admits it.
All positions are chunk boundaries; tokens vLLM already held (its own prefix cache) are not
counted. ``reusable`` is what this engine can tell from the backends' pages and the chunks it
saw: the longest prefix that earlier requests' prompts and outputs shared with this one, as far
as any attention page or sighting reaches. Lost tokens (``reusable - served``) are attributed:

* ``backend_down``: a backend could not be asked (down, timing out, backing off);
* ``evicted``: chunks this engine saw and stored earlier are not in any backend any more
  (evicted, deleted, or their store was dropped);
* ``not_stored``: chunks this engine saw were never sent to a backend: a request running
  alongside is computing them now, or they are below ``store_threshold``;
* ``no_state``: attention pages reach further than any stored state: earlier traffic never
  stopped there (a branch point; this request stores a state there for the next one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybrid_offload.core.metrics import LOSS_REASONS

__all__ = ["LOSS_REASONS", "Coverage", "coverage"]


@dataclass(frozen=True)
class Coverage:
    """One admitted request: tokens vLLM held (``local``), loaded from the cache (``served``),
    the reusable estimate beyond ``local`` and the lost tokens per reason."""

    local: int
    served: int
    reusable: int
    lost: dict[str, int] = field(default_factory=dict)

    def with_served(self, served: int) -> Coverage:
        """The same lookup with ``served`` tokens actually loaded (the gap to the first reason)."""
        reusable = max(self.reusable, served)
        reason = next(iter(self.lost), "no_state")
        lost = {reason: reusable - served} if reusable > served else {}
        return Coverage(self.local, served, reusable, lost)

    def as_dict(self) -> dict[str, object]:
        return {"local_tokens": self.local, "served_tokens": self.served,
                "reusable_tokens": self.reusable, "lost_tokens": dict(self.lost)}


def coverage(
    local: int, served_end: int, attention_end: int, seen_end: int, backend_down: bool,
    gap_stored: bool = True,
) -> Coverage:
    """Attribute ``max(served_end, attention_end, seen_end) - served_end`` (all token positions,
    ``>= local``) to the reasons above; ``gap_stored``: whether the first chunk no backend holds
    was stored before (``evicted``) or never (``not_stored``)."""
    served_end = max(served_end, local)
    reach = max(attention_end, served_end)
    reusable_end = max(reach, seen_end)
    lost = reusable_end - served_end
    reasons: dict[str, int] = {}
    if lost > 0:
        if backend_down:
            reasons["backend_down"] = lost
        else:
            if seen_end > reach:
                reasons["evicted" if gap_stored else "not_stored"] = seen_end - reach
            if reach > served_end:
                reasons["no_state"] = reach - served_end
    return Coverage(local, served_end - local, reusable_end - local, reasons)
