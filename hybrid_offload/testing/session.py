"""Run one offline vLLM engine through several passes over the same prompts, and report.

Used by ``hybrid-offload demo``, the end-to-end tests and benchmarks. A session runs in its
own Python process (:func:`run_session_subprocess`): one process is one engine lifetime, so
starting a second session on the same disk directory is a restart. Specs and results travel
as JSON files, never pickles.

Spec (JSON)::

    {"model": DIR, "prompts": [[token ids], ...], "pass_prompts": [[[token ids], ...], ...] | null,
     "max_tokens": 8, "logprobs": null,
     "connector": {... kv_connector_extra_config ...} | null,
     "passes": 2, "reset_prefix_cache": "pass" | "request" | "never",
     "warmup": true, "llm_kwargs": {...}, "pass_barrier": DIR | null}

``pass_prompts`` (optional) gives each pass its own prompts instead of ``prompts``; ``batch``
submits a pass's prompts together instead of one at a time. A prompt ``{"embeds_of": [token
ids], "nudge_rows": [i, ...]}`` is given to vLLM as embeddings (``prompt_embeds``; the engine
needs ``enable_prompt_embeds``): the model's own embedding rows of those ids, rows ``i`` shifted
by 0.05, so that they name no token.
``reset_prefix_cache`` empties vLLM's own prefix cache after every pass (default) or before
every request, so that hits can only come from the connector; a list gives one mode per pass
(e.g. ``["never", "pass", "never"]``: the second pass hits vLLM's cache, the third cannot).

``pass_barrier`` lets a test act between passes (kill a server, restart it): after pass ``i``
(its stores flushed) the session writes pass ``i``'s result to ``DIR/pass-<i>.done`` (JSON) and
waits until ``DIR/pass-<i>.go`` exists (at most ``barrier_timeout_s``, default 300) before the next
pass. A ``DIR/pass-<i>.prompts.json`` written before ``.go`` gives the next pass its prompts (a
chat's next turns, built from the replies).

Result: per pass, per prompt: output token ids, time to first token, cached tokens (with
``logprobs: k``, also the top-``k`` logprobs of every generated position); and per
pass the connector's scheduler counters (tokens loaded per backend, aligned prompt tokens).
``groups`` lists the top-level connector's KV cache groups with their page sizes (``page_len``:
bytes of one stored page set, all shards and headers included) and ``chunk_tokens``; empty
without a connector.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the connector imports vLLM: not at import time
    from hybrid_offload.connector import HybridMultiConnector, HybridOffloadConnector

#: in-process engine, small KV cache, offline; the same compute cores with and without a
#: connector (see ``hybrid_offload.tools.bench.workload_run.ENGINE_ENV``)
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
CONNECTOR_NAME = "HybridOffloadConnector"
#: the connector that composes foreign ``connectors`` with our backends
COMPOSITE_NAME = "HybridMultiConnector"
CONNECTOR_MODULE = "hybrid_offload.connector"


def kv_transfer_config(extra: dict[str, Any]) -> dict[str, Any]:
    """The ``kv_transfer_config`` that loads our connector with ``extra`` as its config:
    ``HybridMultiConnector`` when ``extra`` lists foreign ``connectors``, else
    ``HybridOffloadConnector``."""
    return {
        "kv_connector": COMPOSITE_NAME if extra.get("connectors") else CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def _top_level_connectors(role: str) -> list[HybridOffloadConnector | HybridMultiConnector]:
    """Live connectors of ``role`` (``"SCHEDULER"`` / ``"WORKER"``) that no other live
    connector holds (as a composition's own side or as a child)."""
    from hybrid_offload.connector import ACTIVE_CONNECTORS, HybridMultiConnector, HybridOffloadConnector

    ours = (HybridOffloadConnector, HybridMultiConnector)
    live = [conn for conn in ACTIVE_CONNECTORS if isinstance(conn, ours)]  # every one is
    nested = {id(inner) for conn in live for inner in conn.nested_connectors()}
    return [conn for conn in live if id(conn) not in nested and conn.role.name == role]


def _scheduler_counters() -> dict[str, Any]:
    """The top-level connector's scheduler counters; child connectors' loads under "children"."""
    for conn in _top_level_connectors("SCHEDULER"):
        return conn.counters()
    return {}


def _flush_workers() -> dict[str, Any]:
    """Wait for every facade's stores (children included); the top-level worker's counters."""
    from hybrid_offload.connector import ACTIVE_CONNECTORS, HybridOffloadConnector

    for conn in list(ACTIVE_CONNECTORS):
        if isinstance(conn, HybridOffloadConnector) and conn.worker is not None:
            conn.worker.flush(timeout=60)
    for conn in _top_level_connectors("WORKER"):
        return conn.counters()
    return {}


def _group_pages() -> dict[str, Any]:
    """The top-level worker's chunk size and, per KV cache group, its kind, layers and page size."""
    from hybrid_offload.connector import HybridMultiConnector

    for top in _top_level_connectors("WORKER"):
        conn = top.native if isinstance(top, HybridMultiConnector) else top
        if conn.worker is not None:
            groups = [
                {
                    "index": codec.group.index,
                    "kind": codec.group.kind.value,
                    "attention": codec.group.is_attention,
                    "layers": len(codec.group.layer_names),
                    "shards": codec.group.shards,
                    "page_len": sum(codec.page_lens[p] for p in codec.read),
                    "spec": dataclasses.asdict(codec.group),
                }
                for codec in conn.worker.codecs.values()
            ]
            return {"chunk_tokens": conn.planner.chunk_tokens, "groups": groups,
                    "fingerprint": conn.planner.spec.fingerprint}
    return {"chunk_tokens": 0, "groups": []}


def _diff(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in after.items():
        if isinstance(value, dict):
            out[key] = _diff(value, before.get(key, {}))
        elif isinstance(value, int | float):
            out[key] = value - before.get(key, 0)
    return out


def _wait_at_barrier(
    directory: Path, index: int, timeout: float, result: dict[str, Any]
) -> list[list[int]] | None:
    """Publish pass ``index``'s result, wait for the go; the next pass's prompts if given."""
    done = Path(directory, f"pass-{index}.done")
    done.with_suffix(".tmp").write_text(json.dumps(result))
    done.with_suffix(".tmp").rename(done)
    go = Path(directory, f"pass-{index}.go")
    deadline = time.monotonic() + timeout
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {go} within {timeout}s")
        time.sleep(0.05)
    prompts = Path(directory, f"pass-{index}.prompts.json")
    return json.loads(prompts.read_text()) if prompts.exists() else None


def _embedding_table(model_dir: str) -> Any:
    """The model's input embedding matrix, read from its safetensors (``*embed_tokens.weight``)."""
    from safetensors import safe_open

    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                if name.endswith("embed_tokens.weight"):
                    return f.get_tensor(name)
    raise ValueError(f"{model_dir}: no *embed_tokens.weight tensor to embed prompts with")


def _engine_input(prompt: Any, table: Callable[[], Any]) -> dict[str, Any]:
    """vLLM's input for one spec prompt: token ids, or embeddings (see the module docstring)."""
    if not isinstance(prompt, dict):
        return {"prompt_token_ids": prompt}
    embeds = table()[prompt["embeds_of"]].clone()
    for row in prompt.get("nudge_rows", []):
        embeds[row] += 0.05
    return {"prompt_embeds": embeds}


def _prompt_len(prompt: Any) -> int:
    return len(prompt["embeds_of"] if isinstance(prompt, dict) else prompt)


def _generate(
    llm: Any, prompts: list[Any], params: Any, reset: bool, batch: bool, table: Callable[[], Any]
) -> list[dict]:
    """One row per prompt: one request at a time, or all at once (``batch``: vLLM schedules them
    together, so a small KV cache makes it preempt)."""
    groups = [prompts] if batch else [[p] for p in prompts]
    rows = []
    for group in groups:
        if reset:
            llm.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate([_engine_input(p, table) for p in group], params, use_tqdm=False)
        wall = time.perf_counter() - start
        for prompt, out in zip(group, outs, strict=True):
            metrics = out.metrics
            ttft = getattr(metrics, "first_token_latency", 0.0) if metrics is not None else 0.0
            rows.append(
                {
                    "tokens": list(out.outputs[0].token_ids),
                    "ttft_s": ttft or wall,
                    "wall_s": wall,
                    "cached_tokens": out.num_cached_tokens or 0,
                    "prompt_tokens": _prompt_len(prompt),
                    **({"logprobs": _logprobs(out)} if params.logprobs else {}),
                }
            )
    return rows


def _logprobs(out: Any) -> list[dict[str, float]]:
    """Per generated position, the logprobs vLLM returned (token id as a JSON key -> logprob)."""
    return [{str(t): float(lp.logprob) for t, lp in pos.items()} for pos in out.outputs[0].logprobs or []]


def run_session(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the spec in this process (vLLM in-process) and return the result dict."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {
        "max_model_len": 4096,
        "dtype": "bfloat16",
        "disable_log_stats": False,
        "enforce_eager": True,
        **spec.get("llm_kwargs", {}),
    }
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config(spec["connector"])
    llm = LLM(model=spec["model"], **kwargs)
    params = SamplingParams(
        max_tokens=spec.get("max_tokens", 8), temperature=0.0, ignore_eos=True, logprobs=spec.get("logprobs")
    )
    if spec.get("warmup", True):  # one-time engine costs must not count as a cold request
        llm.generate([TokensPrompt(prompt_token_ids=[3 + i % 97 for i in range(64)])], params, use_tqdm=False)
        llm.reset_prefix_cache()
    resets = spec.get("reset_prefix_cache", "pass")
    table = functools.cache(lambda: _embedding_table(spec["model"]))
    passes = []
    given: list[list[int]] | None = None
    for index in range(spec.get("passes", 1)):
        reset = resets[index] if isinstance(resets, list) else resets
        before = _scheduler_counters()
        prompts = given or (spec.get("pass_prompts") or [spec["prompts"]] * (index + 1))[index]
        rows = _generate(llm, prompts, params, reset == "request", spec.get("batch", False), table)
        worker = _flush_workers()
        passes.append(
            {"requests": rows, "scheduler": _diff(_scheduler_counters(), before), "worker_total": worker}
        )
        if reset != "never":
            llm.reset_prefix_cache()
        if spec.get("pass_barrier") and len(passes) < spec.get("passes", 1):
            given = _wait_at_barrier(
                Path(spec["pass_barrier"]), len(passes) - 1, spec.get("barrier_timeout_s", 300), passes[-1]
            )
    result = {"passes": passes, **_group_pages()}
    del llm
    return result


#: how :func:`run_module_subprocess` runs ``python ARGS``: ``launch(args, env, timeout)`` -> (exit
#: code, output), raising ``subprocess.TimeoutExpired`` past ``timeout`` seconds
Launch = Callable[[list[str], dict[str, str], float], tuple[int, str]]


def fresh_interpreter(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """A new Python interpreter (:data:`launch`'s default)."""
    proc = subprocess.run([sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout, check=False)  # fmt: skip
    return proc.returncode, proc.stdout


#: the :data:`Launch` in use; a test suite may swap in one that forks an interpreter with vLLM
#: already imported (the repository's tests/warm_start.py)
launch: Launch = fresh_interpreter


def run_module_subprocess(
    module: str, spec: dict[str, Any], *, timeout: float, env: dict[str, str], what: str
) -> dict[str, Any]:
    """Run ``python -m module spec.json out.json`` in a fresh process (:data:`launch`) with ``env``
    over this one's; its JSON result plus ``log`` (its output). RuntimeError with the log's tail
    naming ``what`` when it fails or writes nothing."""
    with tempfile.TemporaryDirectory(prefix="hybrid-offload-run-") as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        code, output = launch(["-m", module, str(spec_path), str(out_path)], {**os.environ, **env}, timeout)
        if code != 0 or not out_path.exists():
            raise RuntimeError(f"{what} failed (exit {code}):\n{output[-6000:]}")
        result = json.loads(out_path.read_text())
        result["log"] = output
        return result


def run_session_subprocess(
    spec: dict[str, Any], timeout: float = 900.0, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run a session in a fresh Python process; raise RuntimeError with its log on failure."""
    return run_module_subprocess(
        "hybrid_offload.testing.session", spec, timeout=timeout, env={**ENGINE_ENV, **(env or {})},
        what="session",
    )


def json_main(run: Callable[[dict[str, Any]], dict[str, Any]], argv: list[str] | None = None) -> int:
    """The entry of a module :func:`run_module_subprocess` starts: ``run`` the spec in file
    ``argv[0]`` (JSON), write its result to ``argv[1]`` (JSON)."""
    args = sys.argv[1:] if argv is None else argv
    result = run(json.loads(Path(args[0]).read_text()))
    Path(args[1]).write_text(json.dumps(result))
    return 0


def exit_now(code: int) -> None:
    """Leave the process at once, output flushed: vLLM may leave non-daemon threads behind, and
    the result is written."""
    sys.stdout.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    return json_main(run_session, argv)


if __name__ == "__main__":
    exit_now(main())
