"""Our worker side driven in the call order of vLLM's model runners, with the KV of a fake model.

vLLM calls a connector's worker hooks in a different order per model runner; Model Runner V2 is
the CUDA default. This replay drives an
:class:`~hybrid_offload.connector.worker.offload_worker.OffloadWorker` (a
:class:`~hybrid_offload.testing.datapath.KVWorld`, torch only, so it runs on a GPU machine
without vLLM) through random steps in one of these orders, hook for hook as
:class:`~hybrid_offload.connector.HybridOffloadConnector` maps them to the worker:

* ``v1`` (``vllm/v1/worker/kv_connector_model_runner_mixin.py``, ``_get_kv_connector_output``
  around the forward in ``gpu_model_runner.execute_model``): handle_preemptions, bind,
  **start_load_kv before the forward**, forward, wait_for_save, get_transfer_results, clear.
* ``v2`` (``vllm/v1/worker/gpu/kv_connector.py``: ``ActiveKVConnector.pre_forward`` (70-91),
  ``post_forward`` (131-151), called from ``gpu/model_runner.py`` after sampling and drafting):
  handle_preemptions, bind, forward, finish_forward, then **start_load_kv after the forward**,
  wait_for_save, get_transfer_results, clear.

The fake model writes, in its forward (on the compute stream, after a delay kernel on CUDA so
the device lags behind the host), K/V and states that are a function of the tokens (per chunk,
bytes seeded by the chunk's hash: the same prefix gives the same bytes, as a deterministic
model would). Prompts have any length (a partial last chunk is computed, never stored). A
request either prefills cold (and stores its whole chunks in that step's wait_for_save) or
loads the whole chunks an earlier request stored into fresh blocks, then computes the rest.
Blocks are reused at once (last freed, first taken) after requests finish, abort or are
preempted; some loads are made to fail (a page deleted first), and their requests
recompute into the same blocks right after the failure is reported. Every finished load is
checked byte for byte against what recomputing would write, and every request's blocks again
before they are freed (a late write of a failed or aborted load would show there).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hybrid_offload.backends import BackendConfig
from hybrid_offload.connector.metadata import LoadJob, LoadSegment, OffloadMetadata, PageJob, StoreJob
from hybrid_offload.testing.datapath import HybridShape, KVWorld

__all__ = ["ORDERS", "ReplayResult", "replay"]

ORDERS = ("v1", "v2")


@dataclass
class _Request:
    """``blocks``: the attention group's block table; ``states``: per Mamba/GDN group, the block
    of its running state (each group its own, as vLLM's block tables give them)."""

    req_id: str
    tokens: list[int]
    blocks: list[int]
    states: dict[int, int]
    loaded: int = 0  # whole chunks loaded (0: computed cold)
    loading: bool = False


@dataclass
class ReplayResult:
    """What a replay did and found; ``mismatches`` lists every byte range that differed."""

    steps: int = 0
    loads: int = 0
    failed_loads: int = 0
    checked_bytes: int = 0
    mismatches: list[str] = field(default_factory=list)


#: per attention layer: its bytes view, the (kernel block, slot) index of some tokens, their bytes
_KvSpot = tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]


class _FakeModel:
    """K/V and states as a function of the tokens, written where vLLM's forward writes them."""

    def __init__(self, world: KVWorld) -> None:
        self.world = world
        self.attn = [g for g in world.spec.groups if g.is_attention]
        self.mamba = [g for g in world.spec.groups if not g.is_attention]

    def _bytes(self, chunk_hash: bytes, salt: str, shape: tuple[int, ...]) -> torch.Tensor:
        seed = int.from_bytes(hashlib.sha256(chunk_hash + salt.encode()).digest()[:8], "little")
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).bitwise_and_(0xBF)

    def _kv_index(
        self, kv: torch.Tensor, blocks: Sequence[int], tokens: range
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.world.block_size
        pos = torch.arange(tokens.start, tokens.stop)
        kblock = kv.shape[2]
        kb = torch.as_tensor(list(blocks))[pos // bs] * (bs // kblock) + (pos % bs) // kblock
        return kb.to(kv.device), (pos % kblock).to(kv.device)

    def _chunk_bytes(self, tokens: Sequence[int], c: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Layer ``name``'s bytes of chunk ``c`` (whole or the prompt's partial last one)."""
        chunk = self.world.chunk
        hashes = self.world.planner.chunk_hashes(tokens)
        if c < len(hashes):
            return self._bytes(hashes[c], name, shape)
        tail = tokens[c * chunk :]  # a partial chunk: its tokens after the last whole chunk
        seed = (hashes[-1] if hashes else b"") + b"".join(t.to_bytes(4, "little") for t in tail)
        return self._bytes(seed, name, shape)[: len(tail)]

    def _kv(self, req: _Request, span: range) -> list[_KvSpot]:
        """Per attention layer: its bytes view, where ``span``'s tokens of ``req`` are in it, and
        the bytes recomputing writes there (host)."""
        chunk = self.world.chunk
        out = []
        for g in self.attn:
            for name in g.layer_names:
                kv = self.world.views[name]
                shape = (chunk, kv.shape[1], kv.shape[3] * kv.element_size())
                first, last = span.start // chunk, (span.stop - 1) // chunk
                parts = [self._chunk_bytes(req.tokens, c, name, shape) for c in range(first, last + 1)]
                want = torch.cat(parts)
                want = want[span.start - first * chunk : span.stop - first * chunk]
                out.append((kv.view(torch.uint8), self._kv_index(kv, req.blocks, span), want))
        return out

    def _states(self, req: _Request, c: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per Mamba/GDN layer: its state bytes in ``req``'s block, and the state recomputing
        leaves after whole chunk ``c``."""
        hashes = self.world.planner.chunk_hashes(req.tokens)
        return [(self._state(req, n), self._bytes(hashes[c], n, (g.state_bytes,)))
                for g in self.mamba for n in g.layer_names]  # fmt: skip

    def forward(self, req: _Request, span: range) -> None:
        """Write the K/V of ``req``'s tokens ``span`` into its blocks and, where ``span`` ends at
        or past a whole chunk, the state after the last whole chunk (where we store states)."""
        if not span:
            return
        for raw, at, want in self._kv(req, span):
            raw[at[0], :, at[1], :] = want.to(raw.device, non_blocking=True)
        if span.stop >= self.world.chunk:
            for place, want in self._states(req, span.stop // self.world.chunk - 1):
                place.copy_(want.to(place.device, non_blocking=True))

    def _state(self, req: _Request, name: str) -> torch.Tensor:
        """Layer ``name``'s unpadded state bytes in ``req``'s block of its group."""
        g = next(g for g in self.mamba if name in g.layer_names)
        return self.world.views[name].view(torch.uint8)[req.states[g.index]].view(-1)[: g.state_bytes]

    def pages(self, req: _Request, chunks: int) -> list[PageJob]:
        """The page jobs of ``req``'s first ``chunks`` chunks, each state in its group's block."""
        pages = self.world.pages(req.tokens[: chunks * self.world.chunk], req.blocks, 0)
        return [p if p.group not in req.states else dataclasses.replace(p, block_ids=(req.states[p.group],))
                for p in pages]  # fmt: skip

    def check(self, req: _Request, span: range, result: ReplayResult, what: str) -> None:
        """Compare ``req``'s K/V of ``span`` (and the state after its last whole chunk) with what
        recomputing writes."""
        if not span:
            return
        for raw, at, want in self._kv(req, span):
            got = raw[at[0], :, at[1], :].cpu()
            result.checked_bytes += got.numel()
            if not torch.equal(got, want):
                bad = int((got != want).any(-1).any(-1).nonzero()[0]) + span.start
                result.mismatches.append(f"{what} {req.req_id}: first bad token {bad}")
        if span.stop >= self.world.chunk:
            for place, want in self._states(req, span.stop // self.world.chunk - 1):
                got = place.cpu()
                result.checked_bytes += got.numel()
                if not torch.equal(got, want):
                    result.mismatches.append(f"{what} {req.req_id}: state")


def _lag(device: torch.device) -> None:
    """On CUDA, keep the compute stream busy for a while, so the host runs ahead of it."""
    if device.type == "cuda":
        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU cycles


def replay(
    shape: HybridShape, device: str, tiers: Sequence[BackendConfig], order: str, steps: int, seed: int = 0,
    num_blocks: int = 96,
) -> ReplayResult:  # fmt: skip
    """Run ``steps`` random steps in ``order`` (:data:`ORDERS`) on ``device`` (``cpu``,
    ``cpu+gpu-path``, ``cuda``) storing to and loading from ``tiers`` (the first is used)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    world = KVWorld(shape, num_blocks, "LBNHC", device, tiers)
    try:
        return _Replay(world, tiers[0].name, order, random.Random(seed)).run(steps)
    finally:
        world.close()


class _Replay:
    def __init__(self, world: KVWorld, tier: str, order: str, rng: random.Random) -> None:
        self.world, self.tier, self.order, self.rng = world, tier, order, rng
        self.model = _FakeModel(world)
        self.free = list(range(world.spec.num_blocks - 1, 0, -1))  # block 0: vLLM's null block
        self.running: dict[str, _Request] = {}
        self.stored: list[_Request] = []  # requests whose pages are in the tier
        self.result = ReplayResult()
        self.next_id = 0

    # ---- blocks and requests --------------------------------------------------------------
    def _alloc(self, n: int) -> list[int] | None:
        if len(self.free) < n:
            return None
        return [self.free.pop() for _ in range(n)]

    def _release(self, req: _Request) -> None:
        """Check the request's blocks once more, then free them (last freed, first reused)."""
        self.model.check(req, range(len(req.tokens)), self.result, "before free")
        self.free.extend(reversed([*req.blocks, *req.states.values()]))
        self.running.pop(req.req_id, None)

    def _new(self, length: int, prefix: Sequence[int] = ()) -> _Request | None:
        """A request of ``length`` tokens starting with ``prefix``, the rest random."""
        bs = self.world.block_size
        tokens = [*prefix, *(self.rng.randrange(1, 50_000) for _ in range(length - len(prefix)))]
        groups = [g.index for g in self.model.mamba]
        blocks = self._alloc(-(-len(tokens) // bs) + len(groups))
        if blocks is None:
            return None
        self.next_id += 1
        n = len(blocks) - len(groups)
        req = _Request(f"r{self.next_id}", tokens, blocks[:n], dict(zip(groups, blocks[n:], strict=True)))
        self.running[req.req_id] = req
        return req

    # ---- one step -------------------------------------------------------------------------
    def run(self, steps: int) -> ReplayResult:
        for _ in range(steps):
            self._step()
        for req in list(self.running.values()):
            while req.loading:
                self._step_hooks(OffloadMetadata(idle=True), [], [])
            self._release(req)
        self.world.worker.flush(60)
        return self.result

    def _step(self) -> None:
        meta, prefill, finished = OffloadMetadata(), [], []
        rng, chunk = self.rng, self.world.chunk
        roll = rng.random()
        idle = [r for r in self.running.values() if not r.loading]
        if roll < 0.45 and self.stored:  # a request resuming a stored prefix
            prefix = rng.choice(self.stored)
            n = len(prefix.tokens) // chunk  # its whole chunks are stored: any length after them
            req = self._new(n * chunk + rng.randrange(0, 3 * chunk), prefix.tokens[: n * chunk])
            if req is not None:
                pages = self.model.pages(req, n)
                if rng.random() < 0.15:  # make the load fail: one of its pages is gone
                    victim = rng.choice(pages)
                    keys = [self.world.planner.piece_key(victim.key, victim.group, p)
                            for p in self.world.worker.codecs[victim.group].read]  # fmt: skip
                    self.world.worker.backends[self.tier].delete_batch(keys)
                    self.stored.remove(prefix)
                meta.loads.append(LoadJob(req.req_id, (LoadSegment(self.tier, tuple(pages)),)))
                req.loading, req.loaded = True, n
        elif roll < 0.75:  # a cold request: prefilled and stored in this step
            req = self._new(rng.randrange(1, 6 * chunk))  # any length: a partial last chunk
            if req is not None:
                prefill.append((req, range(len(req.tokens))))
                pages = self.model.pages(req, len(req.tokens) // chunk)
                meta.stores.extend(StoreJob(p, (self.tier,)) for p in pages)
                if pages:  # shorter than a chunk: nothing to store, it runs on
                    finished.append(req)
        else:
            req = None
        if req is None and idle:  # a request ends, is aborted or preempted (also when blocks ran
            req = rng.choice(idle)  # out): its blocks go to the next ones
            if rng.random() < 0.3:
                meta.preempted.append(req.req_id)
            self._release(req)
        elif req is None:  # every block held by loads in flight: the engine waits for them
            meta.idle = True
        self._step_hooks(meta, prefill, finished)

    def _step_hooks(self, meta: OffloadMetadata, prefill: list, finished: list[_Request]) -> None:
        """The worker hooks of one step in this replay's order (see the module docstring)."""
        worker, device = self.world.worker, self.world.device
        worker.handle_preemptions(meta.preempted)
        if self.order == "v1":
            worker.start_loads(meta.loads)
        _lag(device)
        for req, chunks in prefill:
            self.model.forward(req, chunks)
        if self.order == "v2":
            worker.start_loads(meta.loads)
        worker.save(meta)  # wait_for_save: this step's stores are copied out now
        recving, failed = worker.write_finished_loads(0.005 if meta.idle else 0.0)
        self.result.steps += 1
        for req in finished:
            self.stored.append(req)
            self._release(req)
        for req_id in recving:
            req = self.running[req_id]
            req.loading = False
            self.result.loads += 1
            if req_id in failed:  # recompute everything, into the same blocks, at once
                self.result.failed_loads += 1
                _lag(device)
                self.model.forward(req, range(len(req.tokens)))
            else:
                loaded = req.loaded * self.world.chunk
                self.model.check(req, range(loaded), self.result, "loaded")
                self.model.forward(req, range(loaded, len(req.tokens)))
