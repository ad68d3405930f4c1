"""Probe (issue 44): run the tiny LFM2-VL through ``run_vision_subprocess``.

    python scripts/probes/lfm2_vl/run_probe.py MODEL_DIR [--float32] [--connector] [--out F]

The torchvision stand-in this probe once installed through a ``sitecustomize`` is now the
product's patch ``hybrid_offload_lfm2_vl_without_torchvision``, applied in every vLLM process.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from hybrid_offload.testing.vision_session import run_vision_subprocess

TURNS = [
    {
        "text": "hello data model memory cache block " * 25,
        "images": [[101, 96]],
        "after": "token state layer " * 30,
    },
    {
        "text": "the of and to in is was for " * 30,
        "images": [[102, 160]],
        "after": "value page store " * 30,
    },
]


def _shared(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--float32", action="store_true")
    ap.add_argument("--connector", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--logprobs", type=int, default=None, help="record the first token's top-k logprobs"
    )
    ap.add_argument(
        "--other",
        action="store_true",
        help="add turn 1 with another image (does the image matter?)",
    )
    a = ap.parse_args()
    spec = {
        "model": a.model,
        "max_tokens": 8,
        "max_model_len": 4096,
        "conversations": [{"name": "chat", "turns": TURNS}],
    }
    if a.logprobs:
        spec["logprobs"] = a.logprobs
    if a.other:
        spec["conversations"].append(
            {"name": "other", "turns": [{**TURNS[0], "images": [[999, 96]]}]}
        )
    if a.float32:
        spec["llm_kwargs"] = {"dtype": "float32"}
    if a.connector:
        spec["connector"] = {
            "backends": [{"type": "cpu", "name": "cpu", "capacity_bytes": "256MiB"}]
        }
    t0 = time.monotonic()
    try:
        result = run_vision_subprocess(spec, timeout=900)
    except RuntimeError as exc:
        print(f"FAILED after {time.monotonic() - t0:.1f}s")
        text = str(exc)
        if a.out:
            a.out.write_text(text)
        print(text[-6000:])
        return 1
    wall = time.monotonic() - t0
    rows = result["conversations"]["chat"]
    image_token = json.loads((Path(a.model) / "config.json").read_text())["image_token_id"]
    summary = {
        "wall_s": round(wall, 1),
        "turns": [
            {
                "prompt_len": len(r["prompt"]),
                "image_tokens": r["prompt"].count(image_token),
                "output": r["output"],
                "cached": r["cached"],
                "report": r["report"],
                "repeats_previous": _shared(r["prompt"], prev["prompt"] + prev["output"])
                if prev
                else 0,
            }
            for r, prev in zip(rows, [None, *rows[:-1]], strict=True)
        ],
    }
    summary["chunk_tokens"] = sorted(set(re.findall(r"chunk_tokens=(\d+)", result.get("log", ""))))
    if "other" in result["conversations"]:
        o, first = result["conversations"]["other"][0], rows[0]
        summary["other_image"] = {
            "output": o["output"],
            "same_output_as_turn1": o["output"] == first["output"],
            "first_logprobs": o.get("first_logprobs"),
        }
    if a.logprobs:
        summary["first_logprobs"] = [r.get("first_logprobs") for r in rows]
    if a.out:
        a.out.write_text(json.dumps({"summary": summary, "result": result}, default=str))
    print(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
