"""kv_layout against vLLM's real CPU cache-write op: canonical order whatever the kernel layout."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from worker_world import first_page_len

from hybrid_offload.core.spec import GroupKind, GroupSpec
from hybrid_offload.engine import kv_layout

HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 2, 64, 128, 6


def attention_group(block_size: int = BLOCK) -> GroupSpec:
    return GroupSpec(
        index=0,
        kind=GroupKind.FULL_ATTENTION,
        block_size=block_size,
        layer_names=("l0", "l1"),
        page_bytes=0,
        num_kv_heads=HEADS,
        head_size=HEAD_DIM,
        head_size_v=HEAD_DIM,
    )


def write_tokens(
    cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, isa: str
) -> None:
    from vllm import _custom_ops as ops

    nb, heads, block, _ = cache.shape
    key_cache, value_cache = cache.view(nb, heads, block * 2, HEAD_DIM).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)


@pytest.fixture(params=["amx", "vec"])
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    import vllm.v1.attention.backends.cpu_attn as cpu_attn

    if request.param == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("no AMX on this CPU")
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *a, **k: request.param)
    return request.param


def test_gather_returns_tokens_in_canonical_order(isa: str) -> None:
    torch.manual_seed(0)
    caches = {
        n: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16) for n in ("l0", "l1")
    }
    table = [4, 1, 5]  # a request's block table
    tokens = 3 * BLOCK
    slots = torch.tensor([table[t // BLOCK] * BLOCK + t % BLOCK for t in range(tokens)])
    keys = {n: torch.randn(tokens, HEADS, HEAD_DIM).to(torch.bfloat16) for n in caches}
    values = {n: torch.randn(tokens, HEADS, HEAD_DIM).to(torch.bfloat16) for n in caches}
    for n, cache in caches.items():
        write_tokens(cache, keys[n], values[n], slots, isa)

    layout = kv_layout.build_layouts((attention_group(),), caches, NUM_BLOCKS)[0]
    assert isinstance(layout, kv_layout.AttentionGroupLayout)
    first, count = 100, 200  # crosses a block boundary, starts mid-block
    index = layout.token_index(table, first, count)
    out = [torch.empty(2, count, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in caches]
    layout.gather(index, out)
    for n, got in zip(caches, out, strict=True):
        assert torch.equal(got[0], keys[n][first : first + count])
        assert torch.equal(got[1], values[n][first : first + count])


def test_scatter_then_gather_round_trips_and_touches_nothing_else(isa: str) -> None:
    torch.manual_seed(1)
    caches = {n: torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM).to(torch.bfloat16) for n in ("l0", "l1")}
    before = {n: c.clone() for n, c in caches.items()}
    layout = kv_layout.build_layouts((attention_group(),), caches, NUM_BLOCKS)[0]
    table = [2, 3]
    index = layout.token_index(table, 0, 2 * BLOCK)
    data = [torch.randn(2, 2 * BLOCK, HEADS, HEAD_DIM).to(torch.bfloat16) for _ in caches]
    layout.scatter(index, data)
    out = [torch.empty_like(d) for d in data]
    layout.gather(index, out)
    for d, o in zip(data, out, strict=True):
        assert torch.equal(d, o)
    for n, cache in caches.items():
        untouched = [b for b in range(NUM_BLOCKS) if b not in table]
        assert torch.equal(cache[untouched], before[n][untouched])


def test_pages_identical_across_kernel_layouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same K/V written by two kernels with different block layouts gathers identically."""
    import vllm.v1.attention.backends.cpu_attn as cpu_attn

    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("no AMX on this CPU: only one layout to compare")
    torch.manual_seed(2)
    key = torch.randn(BLOCK, HEADS, HEAD_DIM).to(torch.bfloat16)
    value = torch.randn(BLOCK, HEADS, HEAD_DIM).to(torch.bfloat16)
    gathered, raw = [], []
    for isa in ("amx", "vec"):
        monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *a, _isa=isa, **k: _isa)
        cache = torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16)
        write_tokens(cache, key, value, torch.arange(BLOCK) + 3 * BLOCK, isa)
        group = GroupSpec(
            0,
            GroupKind.FULL_ATTENTION,
            BLOCK,
            ("l0",),
            0,
            num_kv_heads=HEADS,
            head_size=HEAD_DIM,
            head_size_v=HEAD_DIM,
        )
        layout = kv_layout.build_layouts((group,), {"l0": cache}, NUM_BLOCKS)[0]
        out = torch.empty(2, BLOCK, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        layout.gather(layout.token_index([3], 0, BLOCK), [out])
        gathered.append(out)
        raw.append(cache[3].clone())
    assert not torch.equal(raw[0], raw[1]), "kernels should lay the block out differently"
    assert torch.equal(gathered[0], gathered[1])


def test_tiled_layouts_are_written_with_vllms_op_exactly_as_element_by_element(isa: str) -> None:
    """Where the kernel layout is not strided (AMX tiles), scatters go through vLLM's own
    cache-write op: byte for byte what the element-by-element copy writes, for a subset of the
    heads, tokens starting mid-block, (pages, tokens) indices and payloads that are not
    contiguous; nothing else in the cache changes."""
    torch.manual_seed(4)
    table, first, count = [4, 1, 5], 70, 2 * BLOCK + 9
    shape = (2 * NUM_BLOCKS, HEADS, BLOCK // 2, 2 * HEAD_DIM)  # 2 kernel blocks per block
    base = {n: torch.randn(shape).to(torch.bfloat16) for n in ("l0", "l1")}
    payload = torch.randn(2, count, HEADS + 1, HEAD_DIM).to(torch.bfloat16)
    rows = torch.randn(2, 2, BLOCK // 2, HEADS, HEAD_DIM).to(torch.bfloat16)
    written = {}
    for by_op in (True, False):
        caches = {n: c.clone() for n, c in base.items()}
        layout = kv_layout.build_layouts((attention_group(),), caches, NUM_BLOCKS)[0]
        assert isinstance(layout, kv_layout.AttentionGroupLayout)
        if layout.views is not None:
            pytest.skip(f"{isa}: a strided layout, copied by token")
        assert layout.writes is not None
        if not by_op:
            layout = dataclasses.replace(layout, writes=None)
        layout.scatter(layout.token_index(table, first, count, slice(1, 2)), [payload[:, :, 1:2]] * 2)
        at = layout.token_rows([([2], 0), ([3], BLOCK // 2)], BLOCK // 2)
        layout.scatter(at, [rows.transpose(1, 2).contiguous().transpose(1, 2)] * 2)
        written[by_op] = caches
    for n in base:
        assert torch.equal(written[True][n], written[False][n])
        assert not torch.equal(written[True][n], base[n])


def test_manager_block_spanning_several_kernel_blocks() -> None:
    """A 256-token manager block over 128-token kernel blocks (kernel block ids 2b, 2b+1)."""
    caches = {
        n: torch.zeros(2 * NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16) for n in ("l0", "l1")
    }
    layout = kv_layout.build_layouts((attention_group(2 * BLOCK),), caches, NUM_BLOCKS)[0]
    assert isinstance(layout, kv_layout.AttentionGroupLayout)
    assert layout.kernel_blocks_per_block == 2
    data = [torch.randn(2, 2 * BLOCK, HEADS, HEAD_DIM).to(torch.bfloat16) for _ in caches]
    layout.scatter(layout.token_index([1], 0, 2 * BLOCK), data)
    assert caches["l0"][[2, 3]].abs().sum() > 0
    assert caches["l0"][[0, 1, 4, 5]].abs().sum() == 0


def test_mamba_views_address_unpadded_state_in_place() -> None:
    group = GroupSpec(
        1,
        GroupKind.MAMBA,
        BLOCK,
        ("m0",),
        4096,
        state_shapes=((3, 8), (4, 4)),
        state_dtypes=("bfloat16", "float32"),
        mamba_cache_mode="align",
    )
    storage = torch.zeros(NUM_BLOCKS * 4096, dtype=torch.int8)
    page_view = storage.as_strided((NUM_BLOCKS, 1, 1, group.state_bytes), (4096, 1, 1, 1))
    layout = kv_layout.build_layouts((group,), {"m0": page_view}, NUM_BLOCKS)[1]
    assert isinstance(layout, kv_layout.MambaGroupLayout)
    state = torch.arange(group.state_bytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    (view,) = layout.layers
    assert view.shape == (NUM_BLOCKS, group.state_bytes)
    view[2].copy_(state)  # writes through to vLLM's storage, padding untouched
    assert torch.equal(storage.view(torch.uint8)[2 * 4096 : 2 * 4096 + group.state_bytes], state)
    assert storage.view(torch.uint8)[2 * 4096 + group.state_bytes : 3 * 4096].sum() == 0
    storage.view(torch.uint8)[5 * 4096 : 5 * 4096 + group.state_bytes] = state
    assert torch.equal(view[5], state)


def test_unknown_attention_shape_is_refused() -> None:
    bad = {"l0": torch.zeros(NUM_BLOCKS, 3, BLOCK, HEAD_DIM, dtype=torch.bfloat16), "l1": torch.zeros(1)}
    with pytest.raises(kv_layout.LayoutError, match="not a known layout"):
        kv_layout.build_layouts((attention_group(),), bad, NUM_BLOCKS)


def test_strided_layouts_copy_by_token_others_by_element(monkeypatch: pytest.MonkeyPatch) -> None:
    """NHD is strided (copies index tokens only); a layout that scatters a head vector's
    elements (one not seen yet) is still copied right, element by element."""
    flat = kv_layout._flat_layout(HEADS, BLOCK, HEAD_DIM)
    per_kv, token = BLOCK * HEADS * HEAD_DIM, HEADS * HEAD_DIM
    assert kv_layout._strides(flat) == [(0, token, HEAD_DIM, 1), (per_kv, token, HEAD_DIM, 1)]

    scrambled = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(3)).view(flat.shape)
    assert kv_layout._strides(scrambled) is None
    monkeypatch.setattr(kv_layout, "_probe_cpu_attn", lambda *args: scrambled)
    shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)
    caches = {n: torch.zeros(shape, dtype=torch.bfloat16) for n in ("l0", "l1")}
    layout = kv_layout.build_layouts((attention_group(),), caches, NUM_BLOCKS)[0]
    assert isinstance(layout, kv_layout.AttentionGroupLayout) and layout.views is None
    # vLLM's cache-write op would write the kernel's real layout, not this made-up one
    layout = dataclasses.replace(layout, writes=None)
    assert not layout.scatters_by_token
    data = [torch.randn(2, BLOCK, HEADS, HEAD_DIM).to(torch.bfloat16) for _ in caches]
    layout.scatter(layout.token_index([2], 0, BLOCK), data)
    assert torch.equal(caches["l0"][2].reshape(-1)[scrambled.reshape(-1)], data[0].reshape(-1))
    assert caches["l0"][[0, 1, 3, 4, 5]].abs().sum() == 0
    out = [torch.empty_like(d) for d in data]
    layout.gather(layout.token_index([2], 0, BLOCK), out)
    assert all(torch.equal(o, d) for o, d in zip(out, data, strict=True))


def test_ds_conv_states_make_the_pages_of_sd_and_load_back_transposed() -> None:
    """A DS engine keeps each conv state (dim, state_len); its pages hold SD (state_len, dim),
    byte for byte those of an SD engine with the same state, and load back as DS."""
    import dataclasses

    from hybrid_offload.connector.metadata import PageJob
    from hybrid_offload.connector.worker.page_codec import PageCodec
    from hybrid_offload.core.spec import ModelSpec

    sd = GroupSpec(0, GroupKind.MAMBA, BLOCK, ("m0", "m1"), 4096, state_shapes=((3, 40), (4, 4)),
                   state_dtypes=("float32", "float32"), conv_layout="SD")  # fmt: skip
    ds = dataclasses.replace(sd, conv_layout="DS")
    rng = torch.Generator().manual_seed(7)
    conv = torch.randn(2, 3, 40, generator=rng)  # per layer, SD
    ssm = torch.randn(2, 4, 4, generator=rng)
    blocks = {}
    for group, conv_bytes in ((sd, conv), (ds, conv.transpose(1, 2).contiguous())):
        storage = torch.zeros(NUM_BLOCKS, 2, 4096, dtype=torch.uint8)
        for layer in range(2):
            state = torch.cat([conv_bytes[layer].reshape(-1), ssm[layer].reshape(-1)]).view(torch.uint8)
            storage[3, layer, : state.numel()] = state
        blocks[group.conv_layout] = storage
    pages = {}
    for group in (sd, ds):
        spec = ModelSpec((group,), "ab" * 16)
        codec = PageCodec(spec, group, 16)
        storage = blocks[group.conv_layout]
        layout = kv_layout.MambaGroupLayout(group, [storage[:, layer] for layer in range(2)])
        payload = torch.zeros(first_page_len(codec) - codec.header_lens[codec.written[0]], dtype=torch.uint8)
        codec.gather(layout, PageJob("k", 0, 0, bytes(32), (3,)), codec.written[0], payload)
        pages[group.conv_layout] = payload
        target = torch.zeros_like(blocks[group.conv_layout])
        into = kv_layout.MambaGroupLayout(group, [target[:, layer] for layer in range(2)])
        codec.scatter(into, PageJob("k", 0, 0, bytes(32), (1, 5)), codec.read[0], pages["SD"])
        for block in (1, 5):
            assert torch.equal(target[block], blocks[group.conv_layout][3])
    assert torch.equal(pages["DS"], pages["SD"])
    assert not torch.equal(blocks["DS"], blocks["SD"])  # the engines' bytes differ
