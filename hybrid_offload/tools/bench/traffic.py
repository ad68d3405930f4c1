"""Seeded traffic for ``hybrid-offload bench workloads`` and the coverage e2e tests.

Pure: no vLLM. A workload is a generator of *waves*: each wave is a list of requests sent to
the engine together; the generator receives the wave's outputs (generated token ids per request)
and yields the next wave, so conversations carry the replies the model actually generated.
Token ids are random (``VOCAB_LOW`` to ``VOCAB_HIGH``); lengths are drawn from ranges, never
chosen to line up with any block or chunk size.

* ``chat``: several conversations in parallel; every turn is the previous prompt, the reply and
  a new user message.
* ``agent``: agents share one long system prompt; every step appends the reply and a tool
  output.
* ``system_prompt``: one shared system prompt, then varied questions one after another.
* ``rag``: a few long documents, each asked several questions, in shuffled order.
* ``random``: prompts of random lengths, then all of them again in another order.
* ``trace``: a production trace's requests in order (``bench trace --engine``).

:func:`reusable_tokens` defines what a perfect cache could serve a request: the longest prefix
it shares with the prompts and outputs of earlier waves, floored to the checkpoint granularity,
below its length (vLLM recomputes at least one token).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

VOCAB_LOW, VOCAB_HIGH = 3, 2000


@dataclass(frozen=True)
class Request:
    """One request of a wave: a label (conversation, step, ...), its prompt and reply length."""

    label: str
    prompt: tuple[int, ...]
    max_tokens: int
    #: the application's session hint sent with it (``kv_transfer_params``), None: none
    session: str | None = None


Wave = list[Request]
#: a workload: yields waves, is sent each wave's outputs (token ids per request, in order)
WorkloadGen = Generator[Wave, list[list[int]], None]


@dataclass(frozen=True)
class WorkloadSpec:
    """Which workload, its seed and its size knobs (see :data:`SIZES`)."""

    name: str
    seed: int = 0
    size: dict[str, int | str | tuple[int, int]] = field(default_factory=dict)


def _tokens(rng: random.Random, lo_hi: int | tuple[int, int]) -> list[int]:
    n = lo_hi if isinstance(lo_hi, int) else rng.randint(*lo_hi)
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def chat(rng: random.Random, conversations: int, turns: int, first: tuple[int, int],
         message: tuple[int, int], reply: int) -> WorkloadGen:
    prompts = [_tokens(rng, first) for _ in range(conversations)]
    for turn in range(turns):
        outputs = yield [Request(f"c{i}.t{turn}", tuple(p), reply) for i, p in enumerate(prompts)]
        prompts = [p + out + _tokens(rng, message) for p, out in zip(prompts, outputs, strict=True)]


def agent(rng: random.Random, agents: int, steps: int, system: tuple[int, int], task: tuple[int, int],
          tool: tuple[int, int], reply: int) -> WorkloadGen:
    shared = _tokens(rng, system)
    prompts = [shared + _tokens(rng, task) for _ in range(agents)]
    for step in range(steps):
        outputs = yield [Request(f"a{i}.s{step}", tuple(p), reply) for i, p in enumerate(prompts)]
        prompts = [p + out + _tokens(rng, tool) for p, out in zip(prompts, outputs, strict=True)]


def system_prompt(rng: random.Random, questions: int, system: tuple[int, int],
                  question: tuple[int, int], reply: int) -> WorkloadGen:
    shared = _tokens(rng, system)
    for q in range(questions):
        yield [Request(f"q{q}", tuple(shared + _tokens(rng, question)), reply)]


def rag(rng: random.Random, docs: int, questions: int, doc: tuple[int, int], question: tuple[int, int],
        reply: int) -> WorkloadGen:
    texts = [_tokens(rng, doc) for _ in range(docs)]
    order = [(d, q) for d in range(docs) for q in range(questions)]
    rng.shuffle(order)
    for d, q in order:
        yield [Request(f"d{d}.q{q}", tuple(texts[d] + _tokens(rng, question)), reply)]


def random_prompts(rng: random.Random, prompts: int, length: tuple[int, int], reply: int) -> WorkloadGen:
    texts = [_tokens(rng, length) for _ in range(prompts)]
    for i, text in enumerate(texts):
        yield [Request(f"p{i}.first", tuple(text), reply)]
    order = list(range(prompts))
    rng.shuffle(order)
    for i in order:
        yield [Request(f"p{i}.again", tuple(texts[i]), reply)]


def trace(
    rng: random.Random, path: str, requests: int, block: int, reply: int, sessions: int = 0
) -> WorkloadGen:
    """The first ``requests`` of a Mooncake-format trace at ``path``, one a wave, in order, at
    ``block`` tokens a hash id (:mod:`.trace_file`; the ids name the tokens, ``rng`` is unused).
    ``sessions``: each request says whether its session continues (``"ends"`` where no later
    request extends it: what the application would know)."""
    from hybrid_offload.tools.bench.trace_file import load_trace, prompt_tokens, scaled, session_ends

    trace_requests = scaled(load_trace(Path(path), limit=requests), block)
    ends = session_ends(trace_requests, block) if sessions else [False] * len(trace_requests)
    for i, r in enumerate(trace_requests):
        session = ("ends" if ends[i] else "continues") if sessions else None
        yield [Request(f"t{i}", tuple(prompt_tokens(r, block, VOCAB_LOW, VOCAB_HIGH)), reply, session)]


WORKLOADS: dict[str, Callable[..., WorkloadGen]] = {
    "chat": chat,
    "agent": agent,
    "system_prompt": system_prompt,
    "rag": rag,
    "random": random_prompts,
    "trace": trace,
}
#: sizes: "full" for the benchmark, "small" for the e2e tests
SIZES: dict[str, dict[str, dict[str, int | tuple[int, int]]]] = {
    "full": {
        "chat": {"conversations": 3, "turns": 5, "first": (200, 1200), "message": (60, 300), "reply": 120},
        "agent": {"agents": 2, "steps": 5, "system": (1500, 2500), "task": (60, 300), "tool": (200, 600),
                  "reply": 100},
        "system_prompt": {"questions": 12, "system": (1000, 2500), "question": (20, 300), "reply": 24},
        "rag": {"docs": 3, "questions": 8, "doc": (1500, 5000), "question": (20, 200), "reply": 24},
        "random": {"prompts": 6, "length": (1000, 16000), "reply": 16},
    },
    "small": {
        "chat": {"conversations": 2, "turns": 4, "first": (150, 700), "message": (60, 300), "reply": 100},
        "agent": {"agents": 2, "steps": 3, "system": (800, 1500), "task": (60, 200), "tool": (200, 600),
                  "reply": 100},
        "system_prompt": {"questions": 5, "system": (600, 1500), "question": (20, 200), "reply": 16},
        "rag": {"docs": 2, "questions": 3, "doc": (900, 2500), "question": (20, 200), "reply": 16},
        "random": {"prompts": 3, "length": (1000, 6000), "reply": 16},
    },
}


def make_workload(spec: WorkloadSpec) -> WorkloadGen:
    """The workload generator named by ``spec`` (its sizes merged over the full defaults)."""
    try:
        factory = WORKLOADS[spec.name]
    except KeyError:
        raise ValueError(f"unknown workload {spec.name!r} (known: {', '.join(WORKLOADS)})") from None
    size = {**SIZES["full"].get(spec.name, {}), **spec.size}
    seed = xxhash.xxh64_intdigest(f"{spec.name}:{spec.seed}")
    return factory(random.Random(seed), **size)


def run_workload(spec: WorkloadSpec, serve: Callable[[Wave], list[list[int]]]) -> None:
    """Drive ``spec`` to its end: ``serve(wave)`` runs a wave and returns each request's output."""
    gen = make_workload(spec)
    try:
        wave = next(gen)
        while True:
            wave = gen.send(serve(wave))
    except StopIteration:
        return


class PrefixIndex:
    """Chunk-chain hashes of every sequence seen so far (prompt + output of earlier requests)."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self._seen: set[bytes] = set()

    def _chain(self, tokens: Sequence[int]) -> list[bytes]:
        data = np.asarray(tokens, dtype="<i8").tobytes()
        step = 8 * self.chunk
        out, prev = [], b""
        for c in range(len(tokens) // self.chunk):
            prev = xxhash.xxh3_128_digest(prev + data[c * step : (c + 1) * step])
            out.append(prev)
        return out

    def add(self, tokens: Sequence[int]) -> None:
        self._seen.update(self._chain(tokens))

    def reusable(self, prompt: Sequence[int]) -> int:
        """Tokens of ``prompt`` a perfect cache could serve (see the module docstring)."""
        limit = (len(prompt) - 1) // self.chunk if prompt else 0
        n = 0
        for h in self._chain(prompt)[:limit]:
            if h not in self._seen:
                break
            n += 1
        return n * self.chunk


def reusable_tokens(waves: Sequence[Sequence[tuple[Sequence[int], Sequence[int]]]], chunk: int,
                    earlier: Sequence[Sequence[int]] = ()) -> list[list[int]]:
    """Per wave, per request ``(prompt, output)``: its reusable tokens given the earlier waves
    (and ``earlier`` sequences, e.g. a run before a restart)."""
    index = PrefixIndex(chunk)
    for seq in earlier:
        index.add(seq)
    out = []
    for wave in waves:
        out.append([index.reusable(prompt) for prompt, _ in wave])
        for prompt, output in wave:
            index.add(list(prompt) + list(output))
    return out
