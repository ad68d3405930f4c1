"""Workloads and the async streaming client of ``hybrid-offload bench load``.

Workloads are lists of prompts as token ids (the tiny models' tokenizer ids, drawn from
``[FIRST_ID, vocab)``), a pure function of their arguments and seed:

* :func:`shared_prefix_workload`: documents with questions (``doc``: one of a few long
  documents, then a short distinct question) and multi-turn chats (``chat``: a shared system
  prompt, then the chat's history so far, each turn appending to the previous request's prompt).
  Repeated long prefixes are what an external KV cache can serve.
* :func:`distinct_workload`: prompts of the same lengths with nothing in common (0 % hits):
  what the connector costs when it can never help.

:func:`run_load` sends the requests to ``POST /v1/completions`` (``stream: true``, greedy,
``ignore_eos`` with a fixed ``max_tokens``) with at most ``concurrency`` in flight, in list
order, and returns one :class:`RequestResult` per request: TTFT (send to first streamed token),
TPOT (mean time per output token after the first), output tokens (from the streamed usage) and
an error string for failed requests (HTTP status, exception, or a short reply). It never raises
for a failed request. :func:`stream_completion` is one such request (``bench route`` sends its
own, with ``return_token_ids``: the reply's ids and the cached prompt tokens come back too).
:func:`summarize` turns results into the report's numbers.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from hybrid_offload.tools.bench.common import percentile

FIRST_ID = 3  # below are the tiny tokenizer's special tokens


@dataclass(frozen=True)
class WorkloadShape:
    """Token counts of a workload (defaults fit a 2048-token context)."""

    vocab: int = 2048
    doc_tokens: int = 900
    docs: int = 4
    question_tokens: int = 24
    system_tokens: int = 400
    turn_tokens: int = 96
    max_turns: int = 6
    chats: int = 4


@dataclass
class RequestResult:
    """One request's outcome; ``error`` is None on success."""

    kind: str
    prompt_tokens: int
    ttft_s: float = float("nan")
    tpot_s: float = float("nan")
    latency_s: float = float("nan")
    output_tokens: int = 0
    error: str | None = None
    #: the reply's token ids (only when the request asked for ``return_token_ids``)
    output_ids: list[int] = field(default_factory=list)
    #: ``usage.prompt_tokens_details.cached_tokens`` (servers run with
    #: ``--enable-prompt-tokens-details``), else None
    cached_tokens: int | None = None


@dataclass
class _Chat:
    history: list[int]
    turns: int = 0
    rng: random.Random = field(default_factory=random.Random)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


Workload = list[tuple[str, list[int]]]


def shared_prefix_workload(n: int, seed: int, shape: WorkloadShape = WorkloadShape()) -> Workload:
    """``n`` (kind, prompt) pairs, half document questions and half chat turns, interleaved.

    A chat that reached ``max_turns`` is replaced by a new one with the same system prompt.
    """
    rng = random.Random(seed)
    docs = [_tokens(rng, shape.doc_tokens, shape.vocab) for _ in range(shape.docs)]
    system = _tokens(rng, shape.system_tokens, shape.vocab)
    chats = [_Chat(list(system)) for _ in range(shape.chats)]
    out: Workload = []
    for i in range(n):
        if i % 2 == 0:
            doc = docs[rng.randrange(len(docs))]
            out.append(("doc", doc + _tokens(rng, shape.question_tokens, shape.vocab)))
            continue
        slot = rng.randrange(len(chats))
        chat = chats[slot]
        if chat.turns >= shape.max_turns:
            chat = chats[slot] = _Chat(list(system))
        chat.history += _tokens(rng, shape.turn_tokens, shape.vocab)
        chat.turns += 1
        out.append(("chat", list(chat.history)))
    return out


def distinct_workload(n: int, seed: int, shape: WorkloadShape = WorkloadShape()) -> Workload:
    """``n`` prompts with the lengths of :func:`shared_prefix_workload` and no common prefix."""
    rng = random.Random(seed + 1_000_003)
    lengths = [len(p) for _, p in shared_prefix_workload(n, seed, shape)]
    return [("distinct", _tokens(rng, length, shape.vocab)) for length in lengths]


async def stream_completion(
    session: Any, url: str, model: str, kind: str, prompt: list[int], max_tokens: int, timeout: float,
    extra_body: dict[str, Any] | None = None,
) -> RequestResult:  # fmt: skip
    """One streamed ``POST url`` (``/v1/completions``), greedy with ``ignore_eos``; never raises
    for a failed request. ``extra_body`` adds request fields (e.g. ``return_token_ids``)."""
    import aiohttp

    result = RequestResult(kind=kind, prompt_tokens=len(prompt))
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        **(extra_body or {}),
    }  # fmt: skip
    began = time.perf_counter()
    first = last = 0.0
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as reply:
            if reply.status != 200:
                result.error = f"HTTP {reply.status}: {(await reply.text())[:200]}"
                return result
            async for raw in reply.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    last = time.perf_counter()
                    first = first or last
                    result.output_ids += chunk["choices"][0].get("token_ids") or []
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        result.cached_tokens = int(details["cached_tokens"])
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    result.latency_s = time.perf_counter() - began
    if not first or result.output_tokens != max_tokens:
        result.error = f"short reply: {result.output_tokens} of {max_tokens} tokens"
        return result
    result.ttft_s = first - began
    result.tpot_s = (last - first) / (result.output_tokens - 1) if result.output_tokens > 1 else 0.0
    return result


async def _run_load(
    base_url: str, model: str, workload: Workload, concurrency: int, max_tokens: int,
    timeout: float,
) -> list[RequestResult]:  # fmt: skip
    import aiohttp

    url = base_url + "/v1/completions"
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(workload)):
        queue.put_nowait(i)
    results: list[RequestResult | None] = [None] * len(workload)
    connector = aiohttp.TCPConnector(limit=concurrency)

    async def client(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            kind, prompt = workload[i]
            results[i] = await stream_completion(session, url, model, kind, prompt, max_tokens, timeout)

    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return [r for r in results if r is not None]


def run_load(
    base_url: str,
    model: str,
    workload: Workload,
    concurrency: int,
    max_tokens: int,
    timeout: float = 300.0,
) -> tuple[list[RequestResult], float]:
    """Send ``workload`` with ``concurrency`` clients; return (results in order, wall seconds)."""
    began = time.perf_counter()
    results = asyncio.run(_run_load(base_url, model, workload, concurrency, max_tokens, timeout))
    return results, time.perf_counter() - began


def summarize(results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    """req/s and output tok/s (successful requests over wall time), TTFT p50/p99 and TPOT p50
    in milliseconds (successful requests), error count and the first error message."""
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    ms = 1000.0
    return {
        "requests": len(results),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": round(wall_s, 3),
        "req_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "out_tok_per_s": sum(r.output_tokens for r in ok) / wall_s if wall_s > 0 else 0.0,
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "ttft_p50_ms": percentile((r.ttft_s for r in ok), 50) * ms,
        "ttft_p99_ms": percentile((r.ttft_s for r in ok), 99) * ms,
        "tpot_p50_ms": percentile((r.tpot_s for r in ok), 50) * ms,
        "latency_p50_ms": percentile((r.latency_s for r in ok), 50) * ms,
    }
