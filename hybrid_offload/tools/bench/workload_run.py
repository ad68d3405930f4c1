"""Run traffic (:mod:`hybrid_offload.tools.bench.traffic`) through one vLLM engine and record it.

One engine lifetime is one Python process (:func:`run_engine_subprocess`), vLLM's default
multi-process engine unless the environment says otherwise: the scheduler runs in its
EngineCore process, the connector's worker side in a worker process. What the connector did
per request comes back with the request's output (``kv_transfer_params["hybrid_offload"]``),
the way a client of ``vllm serve`` sees it.

Spec (JSON)::

    {"model": DIR, "dtype": "float32", "max_model_len": 20000,
     "connector": {... kv_connector_extra_config ...} | null,
     "reset_prefix_cache": "wave" | "never", "sequential": false, "logprobs": 0, "warmup": true,
     "workloads": [{"name": "chat", "seed": 0, "size": {...}}, ...], "llm_kwargs": {...}}

A wave's requests go to the engine together (vLLM batches them), or one after another with
``sequential``.

Result: per workload, per wave, per request: label, prompt and output token ids, tokens vLLM
reported cached (``num_cached_tokens``: its own prefix cache plus the connector's load), time
to first token, and the connector's report; per run, ``drafts``: draft tokens proposed and
accepted (speculative decoding); with ``logprobs`` (k), the first generated token's
top-k logprobs (``first_logprobs``: token id -> logprob; it comes from the prompt's prefill,
so it shows whether loaded pages are the ones a recomputation gives).
"""

from __future__ import annotations

import functools
import time
from typing import Any

from hybrid_offload.tools.bench.traffic import Wave, WorkloadSpec, run_workload

#: environment of an engine process: small KV cache, offline, no tokenizer threads, and the same
#: compute cores with and without a connector (vLLM CPU reserves a core for its scheduler process
#: plus one more when a kv_transfer_config is set; on 2 cores the connector's engine then computes
#: on both and a plain engine on one: 2x the prefill time, nothing to do with the cache)
ENGINE_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def _session_args(session: str | None) -> dict[str, Any] | None:
    """A request's ``SamplingParams.extra_args`` carrying its session hint (vLLM hands
    ``extra_args["kv_transfer_params"]`` to the connector), None without one."""
    return None if session is None else {"kv_transfer_params": {"hybrid_offload": {"session": session}}}


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the engine, run every workload of ``spec`` through it, return the records."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from hybrid_offload.testing.session import kv_transfer_config

    kwargs: dict[str, Any] = {
        "max_model_len": spec.get("max_model_len", 20_000),
        "dtype": spec.get("dtype", "bfloat16"),
        "enforce_eager": True,
        "disable_log_stats": False,
        **spec.get("llm_kwargs", {}),
    }
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config(spec["connector"])
    llm = LLM(model=spec["model"], **kwargs)
    reset = spec.get("reset_prefix_cache", "wave") == "wave"
    if spec.get("warmup", True):  # off where its pages would take room the traffic is measured in
        warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        prompt = TokensPrompt(prompt_token_ids=[3 + (7 * i) % 97 for i in range(200)])
        llm.generate([prompt], warm, use_tqdm=False)
        llm.reset_prefix_cache()

    groups_of = (lambda wave: [[r] for r in wave]) if spec.get("sequential") else (lambda wave: [wave])
    logprobs = spec.get("logprobs")

    def generate(group: Wave) -> list[tuple[Any, float]]:
        params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs,
                                 extra_args=_session_args(r.session))
                  for r in group]  # fmt: skip
        start = time.perf_counter()
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt)) for r in group]
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        return [(out, wall) for out in outs]

    def serve(wave: Wave, records: list[list[dict[str, Any]]]) -> list[list[int]]:
        if reset:
            llm.reset_prefix_cache()
        results = [done for group in groups_of(wave) for done in generate(group)]
        rows: list[dict[str, Any]] = []
        for req, (out, wall) in zip(wave, results, strict=True):
            metrics = out.metrics
            ttft = getattr(metrics, "first_token_latency", 0.0) if metrics is not None else 0.0
            rows.append({
                "label": req.label,
                "prompt": list(req.prompt),
                "output": list(out.outputs[0].token_ids),
                "cached": out.num_cached_tokens or 0,
                "ttft_s": ttft or wall,
                "report": (out.kv_transfer_params or {}).get("hybrid_offload"),
                **({"first_logprobs": _first_logprobs(out)} if logprobs is not None else {}),
            })
        records.append(rows)
        return [row["output"] for row in rows]

    result: dict[str, Any] = {"workloads": {}}
    for raw in spec["workloads"]:
        records: list[list[dict[str, Any]]] = []
        workload = WorkloadSpec(raw["name"], raw.get("seed", 0), raw.get("size", {}))
        started = time.perf_counter()
        run_workload(workload, functools.partial(serve, records=records))
        result["workloads"][raw["name"]] = {"waves": records, "seconds": time.perf_counter() - started}
    result["drafts"] = _draft_counts(llm)
    llm.llm_engine.engine_core.shutdown()  # stores flushed, engine processes gone
    return result


def _draft_counts(llm: Any) -> dict[str, int]:
    """Draft tokens proposed and accepted over the engine's life (speculative decoding; zeros
    without it), from vLLM's metrics."""
    names = {"vllm:spec_decode_num_draft_tokens": "drafted",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    counts = {"drafted": 0, "accepted": 0}
    for metric in llm.get_metrics():
        if metric.name in names:
            counts[names[metric.name]] += int(getattr(metric, "value", 0))
    return counts


def _first_logprobs(out: Any) -> dict[str, float]:
    """The first generated token's logprobs (token id as a JSON key -> logprob)."""
    first = (out.outputs[0].logprobs or [{}])[0]
    return {str(token): float(lp.logprob) for token, lp in first.items()}


def run_engine_subprocess(spec: dict[str, Any], timeout: float = 1800.0,
                          env: dict[str, str] | None = None) -> dict[str, Any]:
    """:func:`run_engine` in a fresh Python process; RuntimeError with its log on failure."""
    from hybrid_offload.testing.session import run_module_subprocess

    return run_module_subprocess(
        "hybrid_offload.tools.bench.workload_run", spec, timeout=timeout, env={**ENGINE_ENV, **(env or {})},
        what="engine run",
    )


if __name__ == "__main__":
    from hybrid_offload.testing.session import exit_now, json_main

    exit_now(json_main(run_engine))
