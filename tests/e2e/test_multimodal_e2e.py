"""End to end (issue 44, images): hybrid vision-language models' conversations with a picture in
every turn are served from the cache, and no image ever gets another image's KV.

Each of two tiny models (:data:`ARCHS`) runs in vLLM's default multi-process engine: a
``Qwen3_5ForConditionalGeneration`` (GDN + gated attention under a vision tower, bf16: the CPU
GDN kernel runs nothing else) and an ``Lfm2VlForConditionalGeneration`` (short-convolution state
+ attention under a SigLIP2 tower, float32; on this CPU build only with our torchvision
stand-in, ``hybrid_offload_lfm2_vl_without_torchvision``). Every
request is a chat (``LLM.chat``) whose turns carry the earlier replies, with prompts of
arbitrary lengths and images of several sizes after each turn's text. vLLM's own prefix cache
is emptied before every call. Three engine lifetimes, each serving several scenarios:

* **recompute**: no connector; the reference tokens, and the replies the others carry.
* **cache** (cpu + disk tiers), each scenario after the one before:
  - the conversation: each turn resumes after the previous turn's last image (served >= 90 %
    of what it repeats of the previous turn in whole chunks, and reaching past that image: the
    text after each image is longer than a chunk, so the chunk the image ends in is whole),
    tokens as recomputed;
  - the first turn's text with another image: nothing is served from the image's chunk on,
    not even reported as reusable;
  - two more conversations side by side (each turn of both submitted at once, so vLLM
    schedules them together): each turn resumes after its own conversation's last image, tokens
    as recomputed (the recompute engine ran them side by side too);
* **restart** (the disk tier alone, a new process, vLLM's processor cache off):
  - first, the first turn's text with another image that the client names with the first
    image's ``uuid``: vLLM's identifier is that name, so keys made of identifiers would serve
    the first image's KV; ours are made of what the model reads: nothing from the image's chunk
    on is served or reusable. (With vLLM's processor cache on, the name also fetches the first
    image's pixels from that cache, in vLLM, and the model reads the first image.)
  - the conversation again, every turn served from disk past its last image, tokens as
    recomputed.

The three engines run once per model (the module fixture :func:`runs`) for all six tests, which
share an ``xdist_group`` so that under ``pytest -n`` one worker runs them (split across workers,
each worker would start all three engines again).
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from hybrid_offload.testing.models import _WORDS
from hybrid_offload.testing.vision_models import build_vl_model
from hybrid_offload.testing.vision_session import run_vision_subprocess

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("multimodal")]  # one run of the engines

TURNS = 3
REPLY_TOKENS = 16
#: each model's engine arguments: LFM2-VL in float32, where tokens compare without bf16's ties
ARCHS: dict[str, dict[str, Any]] = {"qwen3_5_vl": {}, "lfm2_vl": {"dtype": "float32"}}


def conversation(seed: int, images: int = 100, name: str = "picture") -> list[dict[str, Any]]:
    """Turns of arbitrary lengths, each with one image of its own (image ``images + k``, a client
    ``uuid`` ``name-k`` names it) between two texts."""
    rng = random.Random(seed)

    def words(low: int, high: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high)))

    return [
        {"text": words(300, 900), "images": [[images + k, rng.choice([64, 96, 160, 256]), f"{name}-{k}"]],
         "after": words(150, 400)}
        for k in range(TURNS)
    ]  # fmt: skip


def image_span(prompt: list[int], image_token: int) -> tuple[int, int]:
    """First and one past the last position of the image placeholders in ``prompt``."""
    at = [i for i, t in enumerate(prompt) if t == image_token]
    assert at, "no image placeholder in the prompt"
    return at[0], at[-1] + 1


@pytest.fixture(scope="module", params=list(ARCHS))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    arch, engine = request.param, ARCHS[request.param]
    root = tmp_path_factory.mktemp(f"multimodal-{arch}")
    model = build_vl_model(root / "model", arch=arch)
    image_token = json.loads((model / "config.json").read_text())["image_token_id"]
    turns = conversation(7)
    other = [{**turns[0], "images": [[999, turns[0]["images"][0][1]]]}]
    renamed = [{**turns[0], "images": [[998, turns[0]["images"][0][1], "picture-0"]]}]
    base = {"model": str(model), "max_tokens": REPLY_TOKENS, "llm_kwargs": engine}
    pair = {name: conversation(seed, images, name) for name, seed, images in (("a", 8, 200), ("b", 9, 300))}
    recompute = run_vision_subprocess({
        **base, "conversations": [
            {"name": "chat", "turns": turns}, {"name": "other", "turns": other},
            *({"name": name, "turns": t, "together": "pair"} for name, t in pair.items()),
        ],
    })["conversations"]  # fmt: skip
    replies = [row["reply"] for row in recompute["chat"]]
    chat = {"name": "chat", "turns": turns, "replies": replies}
    together = [{"name": n, "turns": t, "together": "pair", "replies": [r["reply"] for r in recompute[n]]}
                for n, t in pair.items()]  # fmt: skip
    disk = {"type": "disk", "name": "disk", "path": str(root / "disk"), "capacity_bytes": "2GiB"}
    cache = run_vision_subprocess({
        **base, "conversations": [chat, {"name": "other", "turns": other}, *together],
        "connector": {"backends": [{"type": "cpu", "name": "cpu", "capacity_bytes": "256MiB"}, disk]},
    })  # fmt: skip
    restart = run_vision_subprocess({
        **base, "conversations": [{"name": "renamed", "turns": renamed}, chat],
        "connector": {"backends": [disk]}, "llm_kwargs": {**engine, "mm_processor_cache_gb": 0},
    })  # fmt: skip
    chunk = int(re.findall(r"chunk_tokens=(\d+)", restart["log"])[0])
    return {
        "recompute": recompute, "cache": cache["conversations"], "restart": restart["conversations"],
        "image_token": image_token, "chunk": chunk,
    }  # fmt: skip


def served(row: dict[str, Any]) -> int:
    return int((row["report"] or {}).get("served_tokens", 0))


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_each_turn_resumes_after_the_last_image(runs: dict[str, Any]) -> None:
    rows, chunk = runs["cache"]["chat"], runs["chunk"]
    assert served(rows[0]) == 0  # a cold cache
    for k in range(1, TURNS):
        report = rows[k]["report"]
        assert report is not None, f"turn {k} skipped the cache"
        before = rows[k - 1]
        _, image_end = image_span(before["prompt"], runs["image_token"])
        # what the previous turn computed and this one repeats, in whole chunks
        whole = shared_prefix(rows[k]["prompt"], before["prompt"] + before["output"]) // chunk * chunk
        assert whole >= image_end, f"setup: turn {k - 1}'s text after its image is shorter than a chunk"
        assert served(rows[k]) >= 0.9 * whole, f"turn {k}: {report}, {whole} tokens repeated"
        assert served(rows[k]) >= image_end, f"turn {k} resumed before turn {k - 1}'s image: {report}"
        assert rows[k]["cached"] >= served(rows[k])


def test_concurrent_conversations_each_resume_after_their_own_images(runs: dict[str, Any]) -> None:
    """Two conversations whose turns vLLM schedules together: each turn is served past the
    previous turn's image of its own conversation, with the tokens of the recompute engine (which
    ran them together too)."""
    chunk = runs["chunk"]
    for name in ("a", "b"):
        rows = runs["cache"][name]
        assert served(rows[0]) == 0, name  # nothing of the other conversation: its text differs
        for k in range(1, TURNS):
            before = rows[k - 1]
            _, image_end = image_span(before["prompt"], runs["image_token"])
            whole = shared_prefix(rows[k]["prompt"], before["prompt"] + before["output"]) // chunk * chunk
            assert served(rows[k]) >= max(image_end, 0.9 * whole), (name, k, rows[k]["report"], whole)
        assert [r["output"] for r in rows] == [r["output"] for r in runs["recompute"][name]], name


def test_tokens_equal_recompute(runs: dict[str, Any]) -> None:
    want = [row["output"] for row in runs["recompute"]["chat"]]
    assert [row["output"] for row in runs["cache"]["chat"]] == want
    assert [row["output"] for row in runs["restart"]["chat"]] == want
    assert runs["cache"]["other"][0]["output"] == runs["recompute"]["other"][0]["output"]


def assert_missed_from_the_image_on(row: dict[str, Any], first: dict[str, Any], image_token: int) -> None:
    start, _ = image_span(row["prompt"], image_token)
    assert row["prompt"][:start] == first["prompt"][:start]  # the same text before the image
    report = row["report"]
    assert report is not None, "the request skipped the cache"
    assert served(row) <= start and report["reusable_tokens"] <= start, report


def test_another_image_gets_none_of_its_kv(runs: dict[str, Any]) -> None:
    assert_missed_from_the_image_on(runs["cache"]["other"][0], runs["cache"]["chat"][0], runs["image_token"])


def test_another_image_under_the_same_name_gets_none_of_its_kv(runs: dict[str, Any]) -> None:
    row = runs["restart"]["renamed"][0]
    assert_missed_from_the_image_on(row, runs["cache"]["chat"][0], runs["image_token"])


def test_after_a_restart_every_turn_is_served_from_disk(runs: dict[str, Any]) -> None:
    """Every turn's prompt was computed before the restart: all of it in whole chunks loads."""
    chunk = runs["chunk"]
    for k, row in enumerate(runs["restart"]["chat"]):
        whole = (len(row["prompt"]) - 1) // chunk * chunk
        image_start, _ = image_span(row["prompt"], runs["image_token"])
        assert served(row) >= 0.9 * whole, f"turn {k}: {row['report']}, {whole} tokens in whole chunks"
        assert served(row) > image_start, f"turn {k}: its image not served: {row['report']}"
