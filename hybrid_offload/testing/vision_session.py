"""Run image conversations through one vLLM engine (vLLM's default multi-process engine) and
record every turn. One engine lifetime is one Python process (:func:`run_vision_subprocess`).

Spec (JSON)::

    {"model": DIR, "connector": {... kv_connector_extra_config ...} | null, "max_tokens": 8,
     "max_model_len": 8192, "logprobs": k | null, "llm_kwargs": {...},
     "conversations": [{"name": "a", "turns": [{"text": "...", "images": [[seed, size, uuid?], ...],
                                           "after": "..."}, ...],
                        "replies": ["...", ...] | null, "together": "group" | null}, ...]}

Turn ``k`` of a conversation is one chat request: the earlier turns, each followed by its reply
(``replies[k]`` where given, else the text this engine generated), then turn ``k``'s text, its
images (drawn by :func:`~hybrid_offload.testing.vision_models.draw_image`) and the text after
them (``after``, optional). Conversations naming the same ``together`` group run side by side:
turn ``k`` of each is submitted in one call, so vLLM schedules them concurrently; the others
run one request at a time. vLLM's own prefix cache is emptied before every call, so every cached
token came from the connector.

Result: ``{"conversations": {name: [{"prompt": ids, "output": ids, "reply": text, "cached": n,
"report": kv_transfer_params["hybrid_offload"] | null, "first_logprobs": {id: logprob}}]}}``
(``first_logprobs`` with ``logprobs``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybrid_offload.testing.vision_models import draw_image

if TYPE_CHECKING:
    from vllm.renderers.chat_utils import ChatCompletionMessageParam


def run_vision(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the engine, run every conversation of ``spec`` through it, return the records."""
    from vllm import LLM, SamplingParams

    from hybrid_offload.testing.session import kv_transfer_config

    most_images = max(
        (sum(len(t["images"]) for t in c["turns"]) for c in spec["conversations"]), default=1
    )
    kwargs: dict[str, Any] = {
        "max_model_len": spec.get("max_model_len", 8192),
        "dtype": "bfloat16",  # the CPU GDN kernel runs in bf16 only
        "enforce_eager": True,
        "limit_mm_per_prompt": {"image": max(1, most_images), "video": 0},
        **spec.get("llm_kwargs", {}),
    }
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config(spec["connector"])
    llm = LLM(model=spec["model"], **kwargs)
    params = SamplingParams(
        max_tokens=spec.get("max_tokens", 8), temperature=0.0, ignore_eos=True, logprobs=spec.get("logprobs")
    )
    tokenizer = llm.get_tokenizer()
    out: dict[str, Any] = {"conversations": {}}
    for unit in _units(spec["conversations"]):
        messages: dict[str, list[ChatCompletionMessageParam]] = {c["name"]: [] for c in unit}
        rows: dict[str, list[dict[str, Any]]] = {c["name"]: [] for c in unit}
        for k in range(max(len(c["turns"]) for c in unit)):
            active = [c for c in unit if k < len(c["turns"])]
            for conversation in active:
                turn = conversation["turns"][k]
                content: list[dict[str, Any]] = [{"type": "text", "text": turn["text"]}]
                content += [_image_part(*image) for image in turn["images"]]
                if turn.get("after"):
                    content.append({"type": "text", "text": turn["after"]})
                messages[conversation["name"]].append({"role": "user", "content": content})
            llm.reset_prefix_cache()
            results = llm.chat([messages[c["name"]] for c in active], params, use_tqdm=False)
            for conversation, result in zip(active, results, strict=True):
                given = conversation.get("replies") or []
                reply = given[k] if k < len(given) else tokenizer.decode(result.outputs[0].token_ids)
                messages[conversation["name"]].append({"role": "assistant", "content": reply})
                rows[conversation["name"]].append({
                    "prompt": list(result.prompt_token_ids or []),
                    "output": list(result.outputs[0].token_ids),
                    "reply": reply,
                    "cached": result.num_cached_tokens or 0,
                    "report": (result.kv_transfer_params or {}).get("hybrid_offload"),
                    **({"first_logprobs": _first_logprobs(result)} if params.logprobs else {}),
                })  # fmt: skip
        out["conversations"].update(rows)
    llm.llm_engine.engine_core.shutdown()  # stores flushed, engine processes gone
    return out


def _units(conversations: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The conversations in spec order, those of one ``together`` group as one unit (where the
    group first appears)."""
    units: list[list[dict[str, Any]]] = []
    groups: dict[str, list[dict[str, Any]]] = {}
    for conversation in conversations:
        group = conversation.get("together")
        if group is None:
            units.append([conversation])
        elif group in groups:
            groups[group].append(conversation)
        else:
            groups[group] = [conversation]
            units.append(groups[group])
    return units


def _image_part(seed: int, size: int, uuid: str | None = None) -> dict[str, Any]:
    """A chat content part holding image ``seed`` of ``size`` pixels square, named ``uuid``
    where given (a client's id for it: vLLM then keys its caches by that name)."""
    return {"type": "image_pil", "image_pil": draw_image(seed, size), **({"uuid": uuid} if uuid else {})}


def _first_logprobs(result: Any) -> dict[str, float]:
    """The first generated token's top logprobs (token id as a JSON key -> logprob): it comes
    from the prompt's prefill, so it shows whether loaded pages are what recomputing gives."""
    first = (result.outputs[0].logprobs or [{}])[0]
    return {str(token): float(lp.logprob) for token, lp in first.items()}


def run_vision_subprocess(
    spec: dict[str, Any], timeout: float = 900.0, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """:func:`run_vision` in a fresh Python process; RuntimeError with its log on failure."""
    from hybrid_offload.testing.session import ENGINE_ENV, run_module_subprocess

    multi_process = {k: v for k, v in ENGINE_ENV.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    return run_module_subprocess(
        "hybrid_offload.testing.vision_session", spec, timeout=timeout, env={**multi_process, **(env or {})},
        what="vision session",
    )


if __name__ == "__main__":
    from hybrid_offload.testing.session import exit_now, json_main

    exit_now(json_main(run_vision))
