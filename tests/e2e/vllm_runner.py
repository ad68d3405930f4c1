"""Run one offline vLLM engine in a fresh Python subprocess and return its greedy token ids.

Each call starts a new interpreter (no engine state leaks between tests) with
VLLM_ENABLE_V1_MULTIPROCESSING=0 (engine in-process) and VLLM_CPU_KVCACHE_SPACE=1 (GiB).
The request goes in and the result comes back as JSON files; nothing is pickled.

Run as a script (`python vllm_runner.py SPEC.json OUT.json`) it is the child side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Prompt = str | list[int]

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
DEFAULT_LLM_KWARGS: dict[str, Any] = {"max_model_len": 4096, "dtype": "bfloat16"}


@dataclass(frozen=True)
class RunResult:
    """Per prompt (prompt order): generated token ids and prefix-cache hit tokens; the
    child's combined stdout+stderr log and its wall time."""

    token_ids: list[list[int]]
    cached_tokens: list[int]
    log: str
    seconds: float


def run_engine(
    model_dir: str | Path,
    prompts: list[Prompt],
    max_tokens: int = 8,
    *,
    sequential: bool = False,
    timeout: float = 600.0,
    **llm_kwargs: Any,
) -> RunResult:
    """Generate greedily (temperature 0, ignore_eos) for `prompts` in a fresh engine.

    A prompt is text or a list of token ids. `sequential=True` submits prompts one
    `generate` call at a time, so later prompts can hit the prefix cache of earlier ones.
    `llm_kwargs` go to `vllm.LLM` on top of `DEFAULT_LLM_KWARGS`. Raises RuntimeError with
    the tail of the child's log if the child fails.
    """
    spec = {
        "model": str(model_dir),
        "prompts": prompts,
        "max_tokens": max_tokens,
        "sequential": sequential,
        "llm_kwargs": {**DEFAULT_LLM_KWARGS, **llm_kwargs},
    }
    with tempfile.TemporaryDirectory(prefix="vllm-runner-") as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), str(spec_path), str(out_path)],
            env={**os.environ, **ENGINE_ENV},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
        )
        seconds = time.monotonic() - start
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(
                f"vLLM child failed (rc={proc.returncode}); log tail:\n{proc.stdout[-6000:]}"
            )
        result = json.loads(out_path.read_text())
    return RunResult(
        token_ids=result["token_ids"],
        cached_tokens=result["cached_tokens"],
        log=proc.stdout,
        seconds=seconds,
    )


def run_generate(
    model_dir: str | Path, prompts: list[Prompt], max_tokens: int = 8, **llm_kwargs: Any
) -> list[list[int]]:
    """Token ids generated for each prompt; see `run_engine` for the arguments."""
    return run_engine(model_dir, prompts, max_tokens, **llm_kwargs).token_ids


def _child(spec_path: str, out_path: str) -> None:
    """Child side: build the engine, generate, write the result JSON to out_path."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(model=spec["model"], **spec["llm_kwargs"])
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    prompts = [
        TokensPrompt(prompt_token_ids=p) if isinstance(p, list) else p for p in spec["prompts"]
    ]
    if spec["sequential"]:
        outputs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    result = {
        "token_ids": [list(out.outputs[0].token_ids) for out in outputs],
        "cached_tokens": [out.num_cached_tokens or 0 for out in outputs],
    }
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
