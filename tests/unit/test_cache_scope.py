"""What scopes a request's keys besides the model and its tokens (issue 14: L6, M6 LoRA, M5).

Scopes are canonical JSON: no crafted LoRA name or salt makes two scopes alias. A LoRA adapter
is named by its path and files, not by its per-process integer id. A cache reset (weight update)
starts a random epoch, so neither a restart nor another engine reuses pre-update pages, while
callers that name a weights version share pages across engines; requests that straddle the
update store nothing more.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_world import ATTN, FakeRequest, make_spec, new_req, prompt, step

from hybrid_offload.connector.scheduler.scope import AdapterIdentities, request_scope

TOKENS = prompt(20)  # 2 chunks of 8


def lora(name: str, path: str, int_id: int = 1) -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_int_id=int_id, lora_path=path)


def params(version: object) -> dict:
    return {"hybrid_offload": {"weights_version": version}}


def keys(w, req: FakeRequest) -> list[list[str]]:
    state = w.sched._request_state(req)
    return [list(k) for k in state.keys]


_text = st.text(max_size=12)


@settings(max_examples=300, deadline=None)
@given(a=st.tuples(_text, _text, _text, _text), b=st.tuples(_text, _text, _text, _text))
def test_scope_encoding_is_unambiguous(a: tuple[str, ...], b: tuple[str, ...]) -> None:
    """Different (LoRA name, LoRA path, salt, weights version) never encode alike (L6: a LoRA
    name holding the old separator and "salt:" aliased another request's scope)."""
    adapters = AdapterIdentities()

    def scope(name: str, path: str, salt: str, version: str) -> bytes:
        req = FakeRequest("r", [1], lora_request=lora(name, path) if name or path else None,
                          cache_salt=salt or None,
                          kv_transfer_params=params(version) if version else None)
        return request_scope(req, "", adapters, accept_version=True)

    if a != b:
        assert scope(*a) != scope(*b)


def test_crafted_lora_name_does_not_alias_a_salted_scope(worlds) -> None:
    w = worlds(make_spec(8, 8), 8)
    salted = FakeRequest("a", TOKENS, lora_request=lora("x", "/nonexistent/x", 1), cache_salt="y")
    crafted = FakeRequest("b", TOKENS, lora_request=lora("x:1\x1fsalt:y", "/nonexistent/x", 1))
    assert keys(w, salted) != keys(w, crafted)


def _adapter(directory: Path, rank: int, weights: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 16}))
    tensor = {"dtype": "F32", "shape": [len(weights) // 4], "data_offsets": [0, len(weights)]}
    header = json.dumps({"a": tensor})
    (directory / "adapter_model.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header.encode() + weights)
    return directory


def test_lora_is_scoped_by_its_path_and_files_not_its_integer_id(worlds, tmp_path: Path) -> None:
    """M6: same name and id, another adapter (path or files) -> other keys; the same adapter
    under another integer id (ids are per process) -> the same keys."""
    w = worlds(make_spec(8, 8), 8)
    a = _adapter(tmp_path / "a", 8, bytes(64))
    b = _adapter(tmp_path / "b", 8, bytes(64))
    base = keys(w, FakeRequest("1", TOKENS, lora_request=lora("sql", str(a), 1)))
    assert keys(w, FakeRequest("2", TOKENS, lora_request=lora("sql", str(a), 7))) == base
    assert keys(w, FakeRequest("3", TOKENS, lora_request=lora("sql", str(b), 1))) != base
    # the adapter at the same path retrained: its weights rewritten in place (new mtime). vLLM's
    # workers keep what they loaded under an id, so under the ids seen before the cache is
    # skipped (the keys would name files the workers do not use); loaded under a new id, it
    # gets new keys.
    st_ = (a / "adapter_model.safetensors").stat()
    _adapter(a, 8, b"\x01" * 64)
    os.utime(a / "adapter_model.safetensors", ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**6))
    for adapter_id in (1, 7):
        req = FakeRequest("4", TOKENS, lora_request=lora("sql", str(a), adapter_id))
        assert w.sched._request_state(req) is None
    retrained = keys(w, FakeRequest("5", TOKENS, lora_request=lora("sql", str(a), 8)))
    assert retrained != base
    _adapter(a, 16, b"\x01" * 64)  # another rank in adapter_config.json
    assert keys(w, FakeRequest("6", TOKENS, lora_request=lora("sql", str(a), 9))) not in (base, retrained)


def test_an_adapter_rewritten_in_place_keeping_size_and_mtime_skips_the_cache(
    worlds, tmp_path: Path
) -> None:
    """Issue 45 N8: new values written into the adapter's weights file in place (same inode and
    size) with the mtime set back escaped the check by name, size, mtime and inode: vLLM's
    workers, reloading the adapter from its files under the same id, would run the new
    weights under keys of the old. The ctime (which no one can set back) is in the stamp."""
    w = worlds(make_spec(8, 8), 8)
    a = _adapter(tmp_path / "a", 8, bytes(64))
    base = keys(w, FakeRequest("1", TOKENS, lora_request=lora("sql", str(a), 1)))
    weights = a / "adapter_model.safetensors"
    before = weights.stat()
    while True:  # until the kernel's clock has moved on since the file was written (one tick)
        with open(weights, "r+b") as f:
            f.seek(-64, os.SEEK_END)
            f.write(b"\x01" * 64)
        os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
        if weights.stat().st_ctime_ns != before.st_ctime_ns:
            break
    after = weights.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns)
    assert w.sched._request_state(FakeRequest("2", TOKENS, lora_request=lora("sql", str(a), 1))) is None
    assert keys(w, FakeRequest("3", TOKENS, lora_request=lora("sql", str(a), 2))) != base  # a new id


def test_an_unreadable_adapter_skips_the_cache_never_fails_the_lookup(worlds, tmp_path: Path) -> None:
    """A dangling weight file link or an unreadable config: the request misses (review of
    issue 14: this raised out of the scheduler's lookup)."""
    w = worlds(make_spec(8, 8), 8)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{}")
    (broken / "adapter_model.safetensors").symlink_to(tmp_path / "missing")
    req = FakeRequest("x", TOKENS, lora_request=lora("b", str(broken), 3))
    assert w.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert w.sched._request_state(req) is None


def test_reset_epochs_differ_across_engines_and_restarts(worlds) -> None:
    """M5: after one reset each, two engines (or one restarted) must not share keys: their
    weights may differ. The pre-reset keys (the startup weights) are shared."""
    w1, w2 = worlds(make_spec(8, 8), 8), worlds(make_spec(8, 8), 8)
    assert keys(w1, FakeRequest("a", TOKENS)) == keys(w2, FakeRequest("a", TOKENS))
    before = keys(w1, FakeRequest("a", TOKENS))
    w1.sched.reset_cache()
    w2.sched.reset_cache()
    k1, k2 = keys(w1, FakeRequest("b", TOKENS)), keys(w2, FakeRequest("b", TOKENS))
    assert k1 != k2 and before not in (k1, k2)


def test_caller_weights_version_is_shared_across_engines(worlds) -> None:
    """A fleet that applied the same update and says so shares pages; a malformed version makes
    the request skip the cache (when in doubt, miss) instead of failing it."""
    w1 = worlds(make_spec(8, 8), 8, accept_weights_version=True)
    w2 = worlds(make_spec(8, 8), 8, accept_weights_version=True)
    w1.sched.reset_cache()
    w2.sched.reset_cache()

    def versioned(req_id: str, version: object) -> FakeRequest:
        return FakeRequest(req_id, TOKENS, kv_transfer_params=params(version))

    assert keys(w1, versioned("a", "step-42")) == keys(w2, versioned("a", "step-42"))
    assert keys(w1, versioned("b", "step-43")) != keys(w1, versioned("c", "step-42"))
    for bad in (42, "", "x" * 257):
        req = versioned(f"bad{bad!r}"[:20], bad)
        assert w1.sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert w1.sched._request_state(req) is None


def test_a_callers_weights_version_counts_only_where_the_operator_trusts_callers(worlds) -> None:
    """By default a request's weights version is ignored (a client could otherwise name a
    version other than the engine's weights and have its KV served as that version's): two
    engines after a reset keep their own epochs, whatever the request says."""
    w1, w2 = worlds(make_spec(8, 8), 8), worlds(make_spec(8, 8), 8)
    plain = keys(w1, FakeRequest("p", TOKENS))
    claimed = keys(w1, FakeRequest("a", TOKENS, kv_transfer_params=params("step-42")))
    assert claimed == plain  # ignored before any reset: the startup weights' keys
    w1.sched.reset_cache()
    w2.sched.reset_cache()
    k1 = keys(w1, FakeRequest("b", TOKENS, kv_transfer_params=params("step-42")))
    k2 = keys(w2, FakeRequest("b", TOKENS, kv_transfer_params=params("step-42")))
    assert k1 != k2 and plain not in (k1, k2)


def test_requests_straddling_a_reset_store_nothing_more(worlds) -> None:
    """M5: a request computing when the weights change stores no further page (its later KV
    comes from other weights than its keys name) and commits none of its held copies; resumed,
    it is keyed anew."""
    w = worlds(make_spec(8, 8), 8)
    req = FakeRequest("r", prompt(12))
    assert w.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    first = step(new=[new_req("r", ([1, 2, 3], [0, 7, 8]), 0)], scheduled={"r": 12})
    meta = w.sched.build_connector_meta(first)
    assert meta.stores  # it stored before the reset
    old_keys = keys(w, req)
    w.sched.reset_cache()
    req.output_token_ids.extend(range(50, 62))
    meta = w.sched.build_connector_meta(step(cached=[("r", None, 12)], scheduled={"r": 12}))
    assert meta.stores == [] and meta.commits == []
    w.sched.build_connector_meta(step(preempted={"r"}))
    meta = w.sched.build_connector_meta(step())
    assert meta.commits == [] and meta.touches == []
    w.sched.get_num_new_matched_tokens(req, 0)  # resumed: keyed anew
    assert keys(w, req)[ATTN][0] != old_keys[ATTN][0]
    assert w.sched.stats.counters.requests == 1  # one request, keyed twice
