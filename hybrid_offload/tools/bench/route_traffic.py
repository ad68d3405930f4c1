"""Users and routing modes of ``bench route`` (:mod:`.route`): who sends what, and where it goes."""

from __future__ import annotations

import random
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hybrid_offload.tools.bench.traffic import VOCAB_HIGH, VOCAB_LOW, Request, WorkloadGen, chat

MODES = ("round_robin", "index", "sticky")

@dataclass(frozen=True)
class TrafficShape:
    """Users and token counts (ranges are drawn per message)."""

    chat_users: int = 4
    agent_users: int = 4
    turns: int = 8
    #: a chat's first message, its later messages
    first: tuple[int, int] = (200, 1200)
    message: tuple[int, int] = (60, 300)
    #: the agents' shared system prompt, an agent's task, its tool outputs
    system: tuple[int, int] = (1500, 2500)
    task: tuple[int, int] = (60, 300)
    tool: tuple[int, int] = (200, 600)
    #: tokens generated per turn
    reply: int = 48

    def max_prompt(self) -> int:
        """An upper bound of any prompt's length (for ``--max-model-len``)."""
        chat_len = self.first[1] + (self.turns - 1) * (self.reply + self.message[1])
        agent_len = self.system[1] + self.task[1] + (self.turns - 1) * (self.reply + self.tool[1])
        return max(chat_len if self.chat_users else 0, agent_len if self.agent_users else 0)


QUICK_SHAPE = TrafficShape(
    chat_users=2, agent_users=2, turns=3, first=(150, 500), message=(40, 150), system=(500, 900),
    task=(40, 150), tool=(100, 300), reply=16,
)  # fmt: skip


@dataclass
class User:
    """One user's session: ``gen`` yields one request per turn and is sent the reply's ids."""

    name: str
    kind: str
    gen: WorkloadGen


def with_prefix(prefix: Sequence[int], gen: WorkloadGen) -> WorkloadGen:
    """``gen`` with ``prefix`` put before every request's prompt (an agent = a chat whose prompts
    all start with the shared system prompt)."""
    head = tuple(prefix)
    try:
        wave = next(gen)
        while True:
            outputs = yield [Request(r.label, head + r.prompt, r.max_tokens) for r in wave]
            wave = gen.send(outputs)
    except StopIteration:
        return


def make_users(shape: TrafficShape, seed: int) -> list[User]:
    """The users of one run, chat and agent interleaved; a pure function of its arguments."""
    rng = random.Random(f"route:{seed}:system")
    system = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(*shape.system))]
    chats = [
        User(f"chat{i}", "chat", chat(random.Random(f"route:{seed}:chat{i}"), 1, shape.turns,
                                      shape.first, shape.message, shape.reply))
        for i in range(shape.chat_users)
    ]  # fmt: skip
    agents = [
        User(f"agent{i}", "agent", with_prefix(system, chat(random.Random(f"route:{seed}:agent{i}"), 1,
                                                            shape.turns, shape.task, shape.tool,
                                                            shape.reply)))
        for i in range(shape.agent_users)
    ]  # fmt: skip
    users: list[User] = []
    for i in range(max(len(chats), len(agents))):
        users += chats[i : i + 1] + agents[i : i + 1]
    return users


def sticky_engine(user: str, engines: Sequence[str]) -> str:
    """The engine of ``user`` under ``sticky`` routing: crc32 of the user id, modulo."""
    return engines[zlib.crc32(user.encode()) % len(engines)]


class Picker:
    """Chooses the engine of each request for one routing mode; counts requests in flight.

    ``index`` mode calls ``index.route(tokens, engines, load=in_flight)``: the most (weighted)
    restorable tokens win, ties go to the engine with the fewest requests in flight, then to the
    first in order; the seconds each call took (hashing included) are kept in ``route_s``.
    """

    def __init__(
        self, mode: str, engines: Sequence[str], index: Any = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:  # fmt: skip
        if mode not in MODES:
            raise ValueError(f"unknown routing mode {mode!r} (known: {', '.join(MODES)})")
        if mode == "index" and index is None:
            raise ValueError("index routing needs an index")
        self.mode = mode
        self.engines = list(engines)
        self.index = index
        self.clock = clock
        self.inflight = dict.fromkeys(self.engines, 0)
        self.route_s: list[float] = []
        self._next = 0

    def pick(self, user: str, tokens: Sequence[int]) -> str:
        if self.mode == "round_robin":
            engine = self.engines[self._next % len(self.engines)]
            self._next += 1
            return engine
        if self.mode == "sticky":
            return sticky_engine(user, self.engines)
        load = dict(self.inflight)
        began = self.clock()
        engine = self.index.route(tokens, self.engines, load=load)
        self.route_s.append(self.clock() - began)
        return str(engine)

    def started(self, engine: str) -> None:
        self.inflight[engine] += 1

    def finished(self, engine: str) -> None:
        self.inflight[engine] -= 1
