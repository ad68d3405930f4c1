"""Store planning under speculative decoding (fake vLLM requests and steps, as vLLM 0.32 runs
them: a decode step feeds the last sampled token plus drafts, then vLLM rejects some drafts,
rewinds ``num_computed_tokens`` and samples other tokens there).

Chunk = block = 8 tokens; a 13-token prompt; drafts of 4 tokens. Nothing computed from a
draft may be stored: not a chunk whose copy included rejected drafts, not a state after them.
"""

from __future__ import annotations

from scheduler_world import MAMBA, FakeRequest, make_spec, new_req, prompt, step

from hybrid_offload.connector.metadata import OffloadMetadata
from hybrid_offload.core.drafting import Drafting, next_decode_stop

SYNC = Drafting("ngram", 4, async_scheduling=False)
ASYNC = Drafting("qwen3_next_mtp", 4, async_scheduling=True)
TABLES = ([10, 11, 12, 13], [20, 21, 22, 23])


def prefill(w, req: FakeRequest) -> list[OffloadMetadata]:  # type: ignore[no-untyped-def]
    """The 13-token prompt in steps as vLLM's patched split ends them, then its first token."""
    w.sched.get_num_new_matched_tokens(req, 0)
    w.sched.update_state_after_alloc(req, TABLES, 0)
    stop = w.sched.prefill_stop(req.request_id, 0, 13)
    assert stop == 8  # the prompt's tail checkpoint
    metas = [w.sched.build_connector_meta(step(new=[new_req(req.request_id, TABLES, 0)],
                                                scheduled={req.request_id: 8}))]
    metas.append(w.sched.build_connector_meta(step(cached=[(req.request_id, None, 8)],
                                                   scheduled={req.request_id: 5})))
    req.output_token_ids = [500]
    return metas


def decode(w, req: FakeRequest, computed: int, scheduled: int) -> OffloadMetadata:  # type: ignore[no-untyped-def]
    return w.sched.build_connector_meta(step(cached=[(req.request_id, None, computed)],
                                             scheduled={req.request_id: scheduled}))


def copies(metas: list[OffloadMetadata]) -> list[tuple[int, int, bool]]:
    """(group, chunk, held) of every copy out of the KV cache."""
    return [(s.page.group, s.page.chunk_index, s.hold) for m in metas for s in m.stores]


def commits(metas: list[OffloadMetadata]) -> list[tuple[int, int, str]]:
    return [(c.page.group, c.page.chunk_index, c.page.key) for m in metas for c in m.commits]


def test_drafts_rejected_inside_a_chunk_are_never_stored(worlds) -> None:  # type: ignore[no-untyped-def]
    """The audit's case: a step's drafts complete chunk 1 (positions 8..15), some are rejected,
    other tokens are sampled there. The chunk is copied only once its tokens are accepted (a
    step later, from KV vLLM computed for them), under those tokens' key."""
    w = worlds(make_spec(8, 8), 8, drafting=SYNC)
    tokens = prompt(13)
    req = FakeRequest("r1", tokens)
    metas = prefill(w, req)
    # step A: [13, 18) = token 500 at 13 and drafts 601 602 603 604 at 14..17 (chunk 1 ends at 16)
    metas.append(a := decode(w, req, 13, 5))
    assert (0, 1, True) not in copies([a]) and (0, 1, False) not in copies([a])
    # vLLM accepts 601, rejects 602: position 15 gets 999; computed rewinds to 15
    req.output_token_ids = [500, 601, 999]
    metas.append(b := decode(w, req, 15, 5))
    out = tokens + req.output_token_ids
    key = w.planner.group_keys(w.planner.chunk_hashes(out))[0][1]
    attention = [(s.page.chunk_index, s.page.key, s.hold) for s in b.stores if s.page.group == 0]
    assert attention == [(1, key, False)]
    # nothing from step A is ever committed, also when the request ends
    req.output_token_ids = [500, 601, 999, 7, 8]
    w.sched.request_finished(req)
    metas.append(w.sched.build_connector_meta(step()))
    assert all(not held for group, _, held in copies(metas) if group == 0)
    assert not [c for c in commits(metas) if c[0] == 0]


def test_a_decode_state_past_a_rejected_draft_is_never_stored(worlds) -> None:  # type: ignore[no-untyped-def]
    """Mamba cache mode "align" (vLLM keeps draft states in shared slots): a step whose drafts
    end on boundary 16 is not taken for the state at 16, accepted or not; the request's end
    commits no decoding state."""
    w = worlds(make_spec(8, 8), 8, drafting=SYNC)
    req = FakeRequest("r1", prompt(13))
    metas = prefill(w, req)
    metas.append(decode(w, req, 13, 3))  # 500 at 13, drafts at 14, 15: the step ends on 16
    req.output_token_ids = [500, 601, 999]  # the draft at 15 was rejected
    metas.append(decode(w, req, 15, 5))
    req.output_token_ids = [500, 601, 999, 7, 8, 9, 10]
    w.sched.request_finished(req)
    metas.append(w.sched.build_connector_meta(step()))
    assert [c for c in copies(metas) if c[0] == MAMBA] == [(MAMBA, 0, False)]  # the prefill's, at 8
    assert not [c for c in commits(metas) if c[0] == MAMBA]


def test_decode_steps_stop_before_a_boundary_and_its_state_is_taken_after_the_sampled_token(
    worlds,  # type: ignore[no-untyped-def]
) -> None:
    """Mamba cache mode "none" (the request's own state slots) with exact step positions: a
    drafting step ends before position 15, the step starting at 15 feeds the sampled token
    there first, and the running slot then holds the state at 16: held, committed at the end."""
    w = worlds(make_spec(8, 8, mamba_cache_mode="none"), 8, drafting=SYNC)
    tokens = prompt(13)
    req = FakeRequest("r1", tokens)
    metas = prefill(w, req)
    assert w.sched.prefill_stop("r1", 13, 18) == 15
    metas.append(decode(w, req, 13, 2))  # 500 at 13, a draft at 14
    req.output_token_ids = [500, 601]  # the draft was rejected: 601 sampled at 14
    assert w.sched.prefill_stop("r1", 14, 19) == 15
    metas.append(decode(w, req, 14, 1))
    assert not [c for c in copies(metas[2:]) if c[0] == MAMBA]
    req.output_token_ids = [500, 601, 602]
    assert w.sched.prefill_stop("r1", 15, 20) == 20  # starts on 15: no stop inside
    metas.append(c := decode(w, req, 15, 5))
    assert copies([c]) == [(0, 1, False), (MAMBA, 1, True)]
    assert c.stores[1].page.block_ids == (20,)  # the running slot: the table's first block
    req.output_token_ids = [500, 601, 602, 1, 2, 3]
    w.sched.request_finished(req)
    end = w.sched.build_connector_meta(step())
    out = tokens + req.output_token_ids
    assert commits([end]) == [(MAMBA, 1, w.planner.group_keys(w.planner.chunk_hashes(out))[MAMBA][1])]


def test_async_scheduling_with_drafts_holds_nothing(worlds) -> None:  # type: ignore[no-untyped-def]
    """Under async scheduling a step is planned before the previous step's drafts are verified:
    no decode stops, no decoding states, attention chunks only below the known tokens."""
    w = worlds(make_spec(8, 8, mamba_cache_mode="none"), 8, drafting=ASYNC)
    req = FakeRequest("r1", prompt(13))
    metas = prefill(w, req)
    assert w.sched.prefill_stop("r1", 13, 18) == 18
    metas.append(decode(w, req, 13, 5))  # 500's successor in flight: positions 14.. unknown
    metas.append(decode(w, req, 18, 5))
    req.output_token_ids = [500, 601, 999]
    metas.append(d := decode(w, req, 23, 5))
    assert copies([d]) == [(0, 1, False)]
    req.output_token_ids = [500, 601, 999, 4]
    w.sched.request_finished(req)
    metas.append(w.sched.build_connector_meta(step()))
    assert all(not held for _, _, held in copies(metas)) and not commits(metas)


def test_the_tail_keyed_when_a_request_ends_is_stored(worlds) -> None:  # type: ignore[no-untyped-def]
    """Without drafting, async scheduling: the last step's chunk is held while its last token is
    sampled; the request ends right after, so the chunk and the state are keyed only then, and
    committed (they used to be dropped: their chunk counted as never seen)."""
    w = worlds(make_spec(8, 8), 8)
    req = FakeRequest("r1", prompt(13))
    prefill(w, req)
    req.output_token_ids = [1, 2]
    assert copies([decode(w, req, 15, 1)]) == [(0, 1, True), (MAMBA, 1, True)]
    req.output_token_ids = [1, 2, 3]
    w.sched.request_finished(req)
    end = w.sched.build_connector_meta(step())
    assert [(g, c) for g, c, _ in commits([end])] == [(0, 1), (MAMBA, 1)]


def test_next_decode_stop() -> None:
    assert next_decode_stop(13, 18, 8) == 15
    assert next_decode_stop(15, 20, 8) == 20  # starts on it
    assert next_decode_stop(15, 24, 8) == 23
    assert next_decode_stop(16, 23, 8) == 23 and next_decode_stop(16, 24, 8) == 23
    assert next_decode_stop(0, 1, 8) == 1


def test_a_prompt_ending_on_a_boundary_holds_its_state_under_drafting(worlds) -> None:  # type: ignore[no-untyped-def]
    """The prefill step that ends the prompt on a chunk boundary fed prompt tokens only: the
    state at the prompt's end is held (the reply's first chunk starts there)."""
    w = worlds(make_spec(8, 8, mamba_cache_mode="none"), 8, drafting=SYNC)
    req = FakeRequest("r1", prompt(16))
    w.sched.get_num_new_matched_tokens(req, 0)
    w.sched.update_state_after_alloc(req, TABLES, 0)
    assert w.sched.prefill_stop("r1", 0, 16) == 8
    w.sched.build_connector_meta(step(new=[new_req("r1", TABLES, 0)], scheduled={"r1": 8}))
    meta = w.sched.build_connector_meta(step(cached=[("r1", None, 8)], scheduled={"r1": 8}))
    assert copies([meta]) == [(0, 1, False), (MAMBA, 1, True)]
    assert meta.stores[1].page.block_ids == (20,)
