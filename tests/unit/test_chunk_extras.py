"""Images and prompt embeddings in page keys (issue 44): what names an image or an embedded
prompt, which chunks it keys, and what a router sees of it. Built on vLLM's own multimodal
classes (``MultiModalFeatureSpec``, ``PlaceholderRange``, ``MultiModalKwargsItem``) and its
``Request`` as its scheduler holds them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.multimodal.inputs import (
    MultiModalBatchedField,
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    PlaceholderRange,
)
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

from hybrid_offload.connector.config import ConfigError, parse_offload_config
from hybrid_offload.connector.facade import multimodal_keys
from hybrid_offload.connector.scheduler.events import HIDDEN_EMBEDS, HIDDEN_MM, event_extra_keys
from hybrid_offload.connector.scheduler.extras import chunk_extras
from hybrid_offload.connector.scheduler.scope import ScopeError
from hybrid_offload.core.planner import chain_chunk_hashes
from hybrid_offload.engine.multimodal import item_digest

CHUNK = 16


def pixels(seed: int, patches: int = 16) -> MultiModalKwargsItem:
    """A processed image as Qwen-VL's processor gives it: pixel patches and their grid."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(patches, 24, generator=gen).bfloat16()
    return MultiModalKwargsItem({
        "pixel_values": MultiModalFieldElem(values, MultiModalBatchedField()),
        "image_grid_thw": MultiModalFieldElem(torch.tensor([1, 4, patches // 4]), MultiModalBatchedField()),
    })  # fmt: skip


def image(seed: int, offset: int, length: int, identifier: str | None = None, data: Any = "pixels") -> Any:
    return MultiModalFeatureSpec(
        data=pixels(seed) if data == "pixels" else data,
        modality="image",
        identifier=identifier or f"hash-of-{seed}",
        mm_position=PlaceholderRange(offset=offset, length=length),
    )


def request(*features: Any, salt: str | None = None) -> Any:
    return SimpleNamespace(mm_features=list(features), cache_salt=salt, lora_request=None, prompt_embeds=None)


def test_an_image_keys_every_chunk_its_run_overlaps_at_its_offset_there() -> None:
    extras = chunk_extras(request(image(1, offset=10, length=30), image(2, offset=50, length=4)), CHUNK)
    assert sorted(extras) == [0, 1, 2, 3]  # [10, 40) spans chunks 0..2; [50, 54) is in chunk 3
    assert b'"image"' in extras[0] and b",10,30]" in extras[0]
    assert b",-6,30]" in extras[1] and b",-22,30]" in extras[2]  # the run began before the chunk
    assert b",2,4]" in extras[3]
    assert chunk_extras(request(), CHUNK) == {}


def test_content_names_an_image_not_its_identifier() -> None:
    one = chunk_extras(request(image(1, 10, 30)), CHUNK)
    assert chunk_extras(request(image(1, 10, 30, identifier="other-name")), CHUNK) == one
    assert chunk_extras(request(image(2, 10, 30, identifier="hash-of-1")), CHUNK) != one  # a client's uuid
    assert chunk_extras(request(image(1, 11, 30)), CHUNK) != one  # another place
    assert item_digest(pixels(1)) == item_digest(pixels(1)) != item_digest(pixels(2))
    item = pixels(3)
    assert item_digest(item) is item_digest(item)  # taken once per item object


def test_identifier_mode_trusts_vllm_names_and_off_skips() -> None:
    named = chunk_extras(request(image(1, 10, 30, identifier="a")), CHUNK, "identifier")
    assert chunk_extras(request(image(2, 10, 30, identifier="a")), CHUNK, "identifier") == named
    assert chunk_extras(request(image(1, 10, 30, identifier="b")), CHUNK, "identifier") != named
    with pytest.raises(ScopeError, match="multimodal_keys: off"):
        chunk_extras(request(image(1, 10, 30)), CHUNK, "off")
    assert chunk_extras(request(), CHUNK, "off") == {}


def test_every_tensor_shape_is_digested_and_nothing_unreadable_fails_a_request() -> None:
    """LFM2-VL keeps ``num_patches`` as a 0-dim int64 tensor per image (its first request once
    killed the engine core here); a field holding something not a tensor names no item."""
    def item(patches: int, extra: Any) -> MultiModalKwargsItem:
        return MultiModalKwargsItem({
            "pixel_values": MultiModalFieldElem(torch.ones(4, 6), MultiModalBatchedField()),
            "num_patches": MultiModalFieldElem(torch.tensor(patches), MultiModalBatchedField()),
            "more": MultiModalFieldElem(extra, MultiModalBatchedField()),
        })  # fmt: skip

    empty = torch.empty(0, 3)
    assert item_digest(item(4, [torch.ones(2), (torch.zeros(()), empty)])) is not None
    digests = {item_digest(item(n, [torch.ones(2), empty])) for n in (4, 9)}
    assert len(digests) == 2 and None not in digests
    assert item_digest(item(4, object())) is None
    assert item_digest(item(4, [torch.ones(2), "text"])) is None


@pytest.mark.parametrize("data", [None, MultiModalKwargsItem({"address": MultiModalFieldElem(1, None)})])
def test_an_image_the_scheduler_holds_no_pixels_of_skips_the_cache(data: Any) -> None:
    with pytest.raises(ScopeError, match="holds no data for multimodal item 0"):
        chunk_extras(request(image(1, 10, 30, data=data)), CHUNK)


def test_extras_change_their_chunk_and_every_later_one_and_chain_from_the_middle() -> None:
    tokens = list(range(5 * CHUNK))
    plain = chain_chunk_hashes(b"seed", tokens, CHUNK)
    extras = {2: b"\x01image"}
    keyed = chain_chunk_hashes(b"seed", tokens, CHUNK, extras=extras)
    assert keyed[:2] == plain[:2] and all(a != b for a, b in zip(keyed[2:], plain[2:], strict=True))
    head = chain_chunk_hashes(b"seed", tokens[: 2 * CHUNK], CHUNK, extras=extras)
    tail = chain_chunk_hashes(head[-1], tokens[2 * CHUNK :], CHUNK, extras=extras, first=2)
    assert head + tail == keyed


def test_events_carry_vllm_extra_keys_and_hide_identifiers_without_token_ids() -> None:
    req = request(image(1, 10, 30, identifier="img-a"), salt="tenant")
    got = event_extra_keys(req, 16, 32)
    want, _ = generate_block_hash_extra_keys(req, 16, 32, 0)  # vLLM's own BlockStored extra keys
    assert got == to_event_extra_keys([want]) == [(("img-a", -6),)]
    first = event_extra_keys(req, 0, 16, salt=False)
    assert first is not None and HIDDEN_MM in str(first)
    assert "img-a" not in str(first) and "tenant" not in str(first)
    assert req.mm_features[0].identifier == "img-a"  # the request is left alone


def test_identifier_mode_refused_where_vllm_numbers_images_per_process() -> None:
    config = parse_offload_config({"backends": [{"type": "cpu"}], "multimodal_keys": "identifier"})

    def vllm(prefix_caching: bool, processor_cache_gb: float) -> Any:
        return SimpleNamespace(
            cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
            model_config=SimpleNamespace(multimodal_config=SimpleNamespace(mm_processor_cache_gb=processor_cache_gb)),
        )

    assert multimodal_keys(config, vllm(True, 0)) == "identifier"
    assert multimodal_keys(config, vllm(False, 4)) == "identifier"
    with pytest.raises(ConfigError, match="multimodal_keys: identifier needs"):
        multimodal_keys(config, vllm(False, 0))
    content = parse_offload_config({"backends": [{"type": "cpu"}]})
    assert multimodal_keys(content, vllm(False, 0)) == "content"
    with pytest.raises(ConfigError, match=r"multimodal_keys: expected one of \['content', 'identifier'"):
        parse_offload_config({"backends": [{"type": "cpu"}], "multimodal_keys": "pixels"})


def embedded(embeds: torch.Tensor, is_token: list[bool] | None = None) -> Any:
    """vLLM's scheduler-side request for a prompt given as embeddings (or mixing token ids in)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    ids = None if is_token is None else [7 if t else 0 for t in is_token]
    params = SamplingParams(max_tokens=1)
    return Request("r", ids, params, None, prompt_embeds=embeds, prompt_is_token_ids=is_token)


def test_prompt_embeddings_key_every_chunk_by_its_own_rows() -> None:
    rows = 3 * CHUNK + 5  # a partial last chunk
    embeds = torch.randn(rows, 8, generator=torch.Generator().manual_seed(0)).bfloat16()
    req = embedded(embeds)
    assert list(req.all_token_ids) == [0] * rows  # what vLLM holds for those positions: no ids to key by
    extras = chunk_extras(req, CHUNK)
    assert sorted(extras) == [0, 1, 2, 3] and len(set(extras.values())) == 4
    assert b'"prompt_embeds"' in extras[0]
    other = embeds.clone()
    other[CHUNK + 3, 5] += 1  # one value in chunk 1
    changed = chunk_extras(embedded(other), CHUNK)
    assert [changed[c] == extras[c] for c in range(4)] == [True, False, True, True]
    assert chunk_extras(embedded(embeds.float()), CHUNK)[0] != extras[0]  # the dtype the model reads
    tokens = [0] * rows  # through the chain: from the changed chunk on, every key differs
    a = chain_chunk_hashes(b"seed", tokens, CHUNK, extras=extras)
    b = chain_chunk_hashes(b"seed", tokens, CHUNK, extras=changed)
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]


def test_a_prompt_mixing_ids_and_embeddings_keys_which_positions_are_which() -> None:
    embeds = torch.zeros(CHUNK, 8)
    one = chunk_extras(embedded(embeds, [True] * 4 + [False] * (CHUNK - 4)), CHUNK)
    two = chunk_extras(embedded(embeds, [True] * 5 + [False] * (CHUNK - 5)), CHUNK)
    assert one[0] != two[0]


def test_events_carry_vllm_prompt_embeds_keys_and_hide_them_without_token_ids() -> None:
    req = embedded(torch.randn(2 * CHUNK, 8, generator=torch.Generator().manual_seed(1)))
    want, _ = generate_block_hash_extra_keys(req, CHUNK, 2 * CHUNK, 0)
    assert event_extra_keys(req, CHUNK, 2 * CHUNK) == to_event_extra_keys([want])
    hidden = event_extra_keys(req, CHUNK, 2 * CHUNK, salt=False)
    assert hidden is not None and HIDDEN_EMBEDS in str(hidden) and str(want[0][1]) not in str(hidden)
