"""The worker-side unit tests' world: ``World``, an OffloadWorker over a ``KVCache`` of real torch
KV tensors (vLLM's CPU attention layout, Mamba int8 page views), its PageJob builders, and
``stored_world`` (a world holding the stored pages of 3 chunks), and ``unavailable`` (a cpu pool
in the test kit's ``FaultyBackend``, whose medium a test switches off: ``World.faulty``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import wait
from typing import Any

import torch
from scheduler_world import as_tiers

from hybrid_offload.backends import BackendConfig
from hybrid_offload.backends.wrappers import unwrap
from hybrid_offload.compat import cpu_attention_isa, cpu_attention_reshape_and_cache
from hybrid_offload.connector.config import Tier
from hybrid_offload.connector.metadata import LoadJob, LoadSegment, PageJob, StoreJob
from hybrid_offload.connector.worker.offload_worker import OffloadWorker
from hybrid_offload.connector.worker.page_codec import PageCodec
from hybrid_offload.core.planner import HybridOffloadPlanner
from hybrid_offload.core.spec import GroupKind, GroupSpec, ModelSpec, make_model_spec
from hybrid_offload.testing.faulty import FaultyBackend, faulty_config, faulty_in

ATTN, MAMBA = 0, 1
HEADS, DIM, BS, NUM_BLOCKS = 2, 32, 8, 16
ATTN_LAYERS = ("model.layers.0.attn", "model.layers.2.attn")
MAMBA_LAYERS = ("model.layers.1.mixer", "model.layers.3.mixer")
STATE_SHAPES, STATE_DTYPES = ((3, 8), (4, 4)), ("bfloat16", "float32")
MAMBA_PAGE = 128  # padded page: 112 state bytes + 16 padding


def make_spec() -> ModelSpec:
    attn = GroupSpec(
        ATTN,
        GroupKind.FULL_ATTENTION,
        BS,
        ATTN_LAYERS,
        page_bytes=BS * HEADS * 2 * DIM * 2,
        num_kv_heads=HEADS,
        head_size=DIM,
        head_size_v=DIM,
    )
    mamba = GroupSpec(
        MAMBA,
        GroupKind.MAMBA,
        BS,
        MAMBA_LAYERS,
        page_bytes=MAMBA_PAGE,
        state_shapes=STATE_SHAPES,
        state_dtypes=STATE_DTYPES,
        mamba_cache_mode="align",
        mamba_type="mamba2",
    )
    return make_model_spec((attn, mamba), {"name": "fake-hybrid"}, max_model_len=1024, num_blocks=NUM_BLOCKS)


class KVCache:
    """The tensors vLLM would register, plus ways to write and read them independently."""

    def __init__(self, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.attn = {
            n: torch.zeros(NUM_BLOCKS, HEADS, BS, 2 * DIM, dtype=torch.bfloat16) for n in ATTN_LAYERS
        }
        self.storage = {n: torch.zeros(NUM_BLOCKS * MAMBA_PAGE, dtype=torch.int8) for n in MAMBA_LAYERS}
        self.state_bytes = make_spec().groups[MAMBA].state_bytes
        views = {
            n: s.as_strided((NUM_BLOCKS, 1, 1, self.state_bytes), (MAMBA_PAGE, 1, 1, 1))
            for n, s in self.storage.items()
        }
        self.tensors: dict[str, torch.Tensor] = {**self.attn, **views}

    def write_tokens(
        self, table: list[int], first: int, count: int
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Write random K/V for tokens [first, first + count) of a request with block table
        ``table`` through vLLM's cache-write op; return them per layer as (T, H, D)."""
        isa = cpu_attention_isa(torch.bfloat16, BS, DIM)
        reshape_and_cache = cpu_attention_reshape_and_cache()
        slots = torch.tensor([table[t // BS] * BS + t % BS for t in range(first, first + count)])
        written = {}
        for name, cache in self.attn.items():
            k = torch.randn(count, HEADS, DIM, generator=self.gen).to(torch.bfloat16)
            v = torch.randn(count, HEADS, DIM, generator=self.gen).to(torch.bfloat16)
            key_cache, value_cache = cache.view(NUM_BLOCKS, HEADS, BS * 2, DIM).chunk(2, dim=2)
            reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
            written[name] = (k, v)
        return written

    def block_bytes(self, layer: str, block: int) -> torch.Tensor:
        """The whole padded Mamba page of ``block`` (a view)."""
        return self.storage[layer].view(torch.uint8)[block * MAMBA_PAGE : (block + 1) * MAMBA_PAGE]

    def fill_states(self, blocks: list[int]) -> None:
        """Random bytes in the whole padded page (padding included) of every Mamba layer."""
        for layer in MAMBA_LAYERS:
            for b in blocks:
                self.block_bytes(layer, b).copy_(torch.randint(0, 256, (MAMBA_PAGE,), generator=self.gen))

    def state(self, layer: str, block: int) -> bytes:
        return self.block_bytes(layer, block)[: self.state_bytes].numpy().tobytes()

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in {**self.attn, **self.storage}.items()}


class World:
    """A worker over a KVCache, and PageJobs for one prompt built the way the scheduler does."""

    def __init__(
        self, backends: Sequence[BackendConfig | Tier], chunk: int = BS, max_pending: int = 1 << 30,
        seed: int = 0, clock: Callable[[], float] = time.monotonic,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.spec = make_spec()
        self.planner = HybridOffloadPlanner(self.spec, chunk)
        self.chunk = chunk
        self.worker = OffloadWorker(
            self.spec, self.planner, as_tiers(backends), max_pending, clock=clock, timer=timer
        )
        self.cache = KVCache(seed)
        self.worker.register_kv_caches(self.cache.tensors)
        self.tokens = [7 + 3 * i for i in range(64)]
        self.hashes = self.planner.chunk_hashes(self.tokens)

    def attn_page(self, c: int, table: list[int], skip: int = 0) -> PageJob:
        first, last = c * self.chunk, (c + 1) * self.chunk - 1
        key = self.planner.page_key(self.hashes[c], ATTN)
        return PageJob(
            key, ATTN, c, self.hashes[c], tuple(table[first // BS : last // BS + 1]), first % BS, skip
        )

    def mamba_page(self, c: int, blocks: tuple[int, ...]) -> PageJob:
        return PageJob(self.planner.page_key(self.hashes[c], MAMBA), MAMBA, c, self.hashes[c], blocks)

    def backend(self, name: str) -> Any:
        """The storage backend ``name`` under the tier's wrappers (tests break it there), asked
        by page-set keys (see :class:`SetKeyed`)."""
        return SetKeyed(unwrap(self.worker.backends[name]), self.piece_key)

    def faulty(self, name: str) -> FaultyBackend:
        """The fault-injecting wrapper of tier ``name`` (configured by :func:`unavailable`)."""
        return faulty_in(self.worker.backends[name])

    def piece_key(self, key: str) -> str:
        """The backend key of the one piece of page set ``key`` (this world's groups have one
        shard and one layer part); other keys as they are."""
        for group in (ATTN, MAMBA):
            if key in {self.planner.page_key(h, group) for h in self.hashes}:
                (piece,) = self.planner.piece_keys(key, group)
                return piece
        return key


    def wait_loaded(self, req_id: str, timeout: float = 60.0) -> None:
        """Block until the load thread is done with ``req_id``'s load (``timeout`` only fires
        on a hang)."""
        future = self.worker.loads.in_flight(req_id)
        assert future is not None, f"no load of {req_id} in flight"
        wait([future], timeout)
        assert future.done(), f"load of {req_id} did not finish"

    def finish(self, req_id: str, timeout: float = 60.0) -> tuple[set[str], set[str]]:
        """Wait for ``req_id``'s load, then report finished loads once; return everything
        reported (``req_id`` among them)."""
        self.wait_loaded(req_id, timeout)
        recving, failed = self.worker.write_finished_loads()
        assert req_id in recving
        return recving, failed

    def counters(self) -> dict[str, Any]:
        return self.worker.stats.snapshot()


def cpu(name: str = "cpu", capacity: int = 1 << 30) -> BackendConfig:
    return BackendConfig("cpu", name, capacity)


class SetKeyed:
    """A backend whose key arguments may be page-set keys, each standing for its one piece;
    everything else reaches the backend itself (its state too)."""

    def __init__(self, backend: Any, piece_key: Callable[[str], str]) -> None:
        self.__dict__.update(_backend=backend, _piece=piece_key)

    @property
    def raw(self) -> Any:
        return self._backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._backend, name, value)

    def get_batch(self, keys: Sequence[str]) -> Any:
        return self._backend.get_batch([self._piece(k) for k in keys])

    def contains_batch(self, keys: Sequence[str]) -> Any:
        return self._backend.contains_batch([self._piece(k) for k in keys])

    def delete_batch(self, keys: Sequence[str]) -> Any:
        return self._backend.delete_batch([self._piece(k) for k in keys])

    def put_batch(self, items: Sequence[tuple[str, Any]]) -> Any:
        return self._backend.put_batch([(self._piece(k), v) for k, v in items])


def attn_page_len() -> int:
    spec = make_spec()
    return first_page_len(PageCodec(spec, spec.groups[ATTN], BS))


def load_job(pages: tuple[PageJob, ...], backend: str = "cpu", req_id: str = "req") -> LoadJob:
    return LoadJob(req_id, (LoadSegment(backend, tuple(pages)),))


def stored_world(
    world, *backends: BackendConfig, **kwargs: Any
) -> tuple[World, list[PageJob], dict[str, torch.Tensor]]:
    """Pages of 3 chunks stored from blocks [3, 7, 5] (+ state of block 2); a snapshot."""
    w = world(*backends, **kwargs)
    w.cache.write_tokens([3, 7, 5], 0, 24)
    w.cache.fill_states([2])
    names = tuple(b.name for b in backends) or ("cpu",)
    pages = [w.attn_page(c, [3, 7, 5]) for c in range(3)] + [w.mamba_page(2, (2,))]
    w.worker.copy_out([StoreJob(p, names) for p in pages])
    w.worker.flush(10)
    return w, pages, w.cache.snapshot()


def unavailable(name: str = "flaky", capacity: int = 1 << 30) -> BackendConfig:
    """A cpu pool whose medium a test can switch off (``World.faulty(name).fail(...)``). It lends
    nothing in place (loads read it into staging rows, as from a disk or a server)."""
    return faulty_config(cpu(name, capacity), in_place=False)


def first_page_len(codec: PageCodec) -> int:
    """The page length of the first piece ``codec`` writes (one-part, one-shard groups: the set's)."""
    return codec.page_lens[codec.written[0]]
