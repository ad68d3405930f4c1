"""vLLM's real ``Scheduler`` and ``AsyncScheduler`` with a speculative config and our connector,
driven step by step against a model emulator, checking every copy the connector plans.

Run as ``python drafting_scheduler.py MODEL_DIR OUT.json`` (its own process: it builds an
in-process engine only to take vLLM's config, KV cache config and structured-output manager,
then makes new schedulers from them, the way ``EngineCore`` does).

The emulator knows the true tokens ``T`` (what a greedy target model samples) and runs each
scheduled step as a worker would: a step's inputs start at the request's *actual* position
(after the previous step's rejected drafts are rolled back, also under async scheduling, where
vLLM plans the step before it knows that), the first input is a true token, the drafts are
true at chosen positions and wrong elsewhere. KV at a position (and the state after it) is
right when every input up to it was. After the step's forward, every page the step's
connector metadata copies must be right: an attention chunk only when all its positions are,
a Mamba state only from the slot that holds the state at its chunk boundary. Output: per
scheduler, the copies checked, the drafts accepted and rejected, and the problems found.
"""

from __future__ import annotations

import json
import os
import random
import sys
from typing import Any

CHUNK = 128
DRAFTS = 4


class Emulator:
    """One request's truth: tokens, the actual next input position, the right KV prefix."""

    def __init__(self, prompt: list[int], total: int, seed: int) -> None:
        rng = random.Random(seed)
        self.rng = rng
        self.truth = prompt + [rng.randrange(10, 1000) for _ in range(total - len(prompt))]
        self.prompt_len = len(prompt)
        self.start = 0  # the next step's first input position, as the worker runs it
        self.right = 0  # positions [0, right) hold KV of the true tokens
        self.slots: list[int] = []  # state slot i: the boundary it holds the state of (0: wrong)

    def drafts(self, known: int) -> list[int]:
        """Drafts for positions known.. (after the last sampled token): right ones, then one
        wrong at a random place (or none)."""
        wrong = self.rng.randrange(DRAFTS + 2)
        return [self.truth[known + i] if i != wrong else 1 for i in range(DRAFTS)]

    def run(self, n: int, spec: list[int]) -> list[int]:
        """Run a step of ``n`` inputs (its drafts ``spec``); the tokens it samples."""
        a = self.start
        inputs = self.truth[a : a + n - len(spec)] + list(spec)
        good = 0
        while good < n and inputs[good] == self.truth[a + good]:
            good += 1
        if a <= self.right:  # what follows the first wrong input is wrong now
            self.right = a + good
        # state slot i: after input i with drafts; a prefill or plain step: slot 0, after all
        self.slots = [a + i + 1 if i < good else 0 for i in range(n)] if spec else [a + n if good == n else 0]
        end = a + n
        if end < self.prompt_len:  # a prefill chunk samples nothing
            self.start = end
            return []
        sampled = self.truth[a + n - len(spec) : a + good + 1] if spec else [self.truth[end]]
        self.start = a + len(sampled) + (n - len(spec)) - 1
        return sampled


def check_copies(meta: Any, rid: str, emu: Emulator, tables: list[list[int]], kinds: list[str],
                 problems: list[str], seen: dict[str, int]) -> None:
    """Every page of ``rid`` that ``meta`` copies after the step's forward holds what its chunk
    needs."""
    for job in (j for j in meta.stores if j.req_id == rid):
        page, c = job.page, job.page.chunk_index
        if kinds[page.group] == "mamba":
            table = tables[page.group]
            slot = table.index(page.block_ids[0]) if page.block_ids[0] in table else -1
            holds = emu.slots[slot] if 0 <= slot < len(emu.slots) else 0
            if holds != (c + 1) * CHUNK:
                problems.append(f"{rid}: state of chunk {c} copied from slot {slot} holding {holds}")
            seen["states"] += 1
        else:
            if (c + 1) * CHUNK > emu.right:
                problems.append(f"{rid}: attention chunk {c} copied with KV right only below {emu.right}")
            seen["chunks"] += 1


def drive(scheduler: Any, make_request: Any, model_steps: int = 400) -> dict[str, Any]:
    """Two requests of 700 and 450 prompt tokens generating 300 tokens each, to the end."""
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    asynchronous = scheduler.vllm_config.scheduler_config.async_scheduling
    emus, problems = {}, []
    seen = {"chunks": 0, "states": 0, "accepted": 0, "rejected": 0, "steps": 0}
    for i, n in enumerate((700, 450)):
        emu = Emulator([random.Random(i).randrange(10, 1000) for _ in range(n)], n + 300 + 2 * DRAFTS, i)
        emus[f"r{i}"] = emu
        scheduler.add_request(make_request(f"r{i}", emu.truth[:n], 300))
    kinds = ["mamba" if type(g.kv_cache_spec).__name__ == "MambaSpec" else "attention"
             for g in scheduler.kv_cache_config.kv_cache_groups]
    in_flight: list[tuple[Any, ModelRunnerOutput]] = []
    for _ in range(model_steps):
        if not scheduler.requests:
            break
        out = scheduler.schedule()
        seen["steps"] += 1
        sampled: dict[str, list[int]] = {}
        for rid, n in out.num_scheduled_tokens.items():
            emu = emus[rid]
            spec = list(out.scheduled_spec_decode_tokens.get(rid, []))
            if asynchronous and spec:  # the worker fills the placeholders with its drafts
                spec = emu.drafts(emu.start + 1)[: len(spec)]
            sampled[rid] = emu.run(n, spec)
            if spec:
                took = len(sampled[rid]) - 1
                seen["accepted"] += took
                seen["rejected"] += len(spec) - took
            tables = [list(ids) for ids in scheduler.kv_cache_manager.get_block_ids(rid)]
            check_copies(out.kv_connector_metadata, rid, emu, tables, kinds, problems, seen)
        ids = list(out.num_scheduled_tokens)
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[sampled[r] for r in ids])
        in_flight.append((out, mro))
        if len(in_flight) > (1 if asynchronous else 0):
            done, result = in_flight.pop(0)
            scheduler.update_from_output(done, result)
            if not asynchronous:
                live = [r for r in result.req_ids if r in scheduler.requests]
                scheduler.update_draft_token_ids(DraftTokenIds(
                    live, [emus[r].drafts(scheduler.requests[r].num_tokens) for r in live]))
    for done, result in in_flight:
        scheduler.update_from_output(done, result)
    return {"problems": problems[:20], "problem_count": len(problems), **seen,
            "unfinished": sorted(scheduler.requests)}


def main(model: str, out_path: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    from hybrid_offload.testing.session import kv_transfer_config

    ngram = {"method": "ngram", "num_speculative_tokens": DRAFTS, "prompt_lookup_min": 1}
    cache = kv_transfer_config({"backends": [{"type": "cpu", "capacity_bytes": "1GiB"}]})
    llm = LLM(model=model, dtype="float32", max_model_len=4096, enforce_eager=True,
              enable_prefix_caching=False, speculative_config=ngram, kv_transfer_config=cache)
    core = llm.llm_engine.engine_core.engine_core
    base = core.scheduler

    def make_request(rid: str, prompt: list[int], tokens: int) -> Request:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        return Request(rid, prompt, params, None)

    results = {}
    for name, cls, asynchronous in (("sync", Scheduler, False), ("async", AsyncScheduler, True)):
        core.vllm_config.scheduler_config.async_scheduling = asynchronous
        scheduler = cls(vllm_config=core.vllm_config, kv_cache_config=base.kv_cache_config,
                        structured_output_manager=core.structured_output_manager, block_size=base.block_size,
                        hash_block_size=getattr(base, "hash_block_size", None), log_stats=False)
        results[name] = drive(scheduler, make_request)
        results[name]["log"] = scheduler.connector.scheduler.stores.decode_states_note()
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    os._exit(0)
