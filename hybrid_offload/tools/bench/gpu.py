"""`hybrid-offload bench gpu`: the data path against the hardware, without vLLM.

On a Qwen3-Next-80B-A3B-shaped cache (12 attention layers of 2 KV heads x 256, 36 GDN layers;
bf16) in vLLM 0.32's GPU layouts, per request length:

* the ceilings: one large pinned host-to-device and device-to-host copy;
* stores (GPU blocks -> cpu tier) and loads (cpu tier -> GPU blocks) through the worker as the
  connector drives it, with the load's phases (read and verify on the load thread; the device
  part: one copy to the device and the scatters, from enqueue to completion);
* the model-runner thread's CPU time per load (the enqueue);
* the slowdown of a matmul loop on the default stream (one step: matmuls, then the connector's
  step work, then a sync, as vLLM's steps end) while loads and stores run.

Runs on ``cpu`` too (``--device cpu``: no ceilings, no streams), for a smoke run. Torch alone:
``scripts/gpu_check.sh`` runs it on the GPU machine, which has no vLLM. The measurements are
:mod:`.gpu_cases`, imported by :func:`run` only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hybrid_offload.tools.bench.common import bar_plot, format_table, write_results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda",
                   help="cuda (default), cpu (a smoke run), cpu+gpu-path (the GPU code on a CPU)")
    p.add_argument("--tokens", default="4096,16384,65536", help="request lengths, comma-separated")
    p.add_argument("--layouts", default="LBNHC,BLHNC",
                   help="vLLM KV cache layouts (the first is vLLM's default)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="timed loads per case (the median is reported)")


def run(args: argparse.Namespace) -> int:
    import torch

    from hybrid_offload.testing.datapath import QWEN3_NEXT_80B, HybridShape
    from hybrid_offload.tools.bench.gpu_cases import (
        ceilings,
        churn,
        enqueue_probe,
        interference,
        transfer_case,
    )

    device = torch.device(str(args.device).partition("+")[0])
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench gpu: no CUDA device here (use --device cpu for a smoke run)")
        return 2
    tokens = [int(t) for t in str(args.tokens).split(",")]
    layouts = str(args.layouts).split(",")
    shape = QWEN3_NEXT_80B
    if args.quick:
        tokens, shape = [1024], HybridShape(**{**QWEN3_NEXT_80B.__dict__, "attn_layers": 1, "gdn_layers": 3,
                                               "group_layers": 1})  # fmt: skip
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"bench gpu on {name}")
    ceil = ceilings(device)
    print("ceilings:", {k: round(v, 1) for k, v in ceil.items()})
    probe = enqueue_probe(device)
    print("enqueue probe:", {k: round(v, 3) for k, v in probe.items()})
    rows = []
    for layout in layouts:
        for n in tokens:
            row = transfer_case(shape, layout, n, args.device, 1 if args.quick else args.repeats)
            if ceil:
                row["load_device_vs_h2d"] = row["load_device_gbps"] / ceil["h2d_gbps"]
                row["store_device_vs_d2h"] = row["store_device_gbps"] / ceil["d2h_gbps"]
                row["whole_load_vs_h2d"] = row["load_gbps"] / ceil["h2d_gbps"]
                row["whole_store_vs_d2h"] = row["store_gbps"] / ceil["d2h_gbps"]
            rows.append(row)
            print(format_table([row], ["layout", "tokens", "load_gbps", "whole_load_vs_h2d", "load_s",
                                       "load_read_s", "load_verify_s", "load_device_s", "load_copy_s",
                                       "load_runner_cpu_ms", "store_gbps",
                                       "whole_store_vs_d2h", "store_runner_cpu_ms",
                                       "store_step_runner_cpu_ms", "identical"]))  # fmt: skip
    slow = [] if args.quick else [interference(shape, layouts[0], min(max(tokens), 16384), args.device)]
    slow = [s for s in slow if s]
    for s in slow:
        print("interference:", {k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()})
    churned = churn(shape, layouts[0], min(max(tokens), 16384), args.device, 4 if args.quick else 40)
    print("churn:", {k: v for k, v in churned.items() if k != "pages"})
    for page in churned["pages"]:
        print("  bad page:", page)
    out = Path(args.out)
    payload = {"device": name, "shape": shape.__dict__, "ceilings": ceil, "enqueue": probe, "rows": rows,
               "interference": slow, "churn": churned,
               "args": {"tokens": tokens, "layouts": layouts}}  # fmt: skip
    path = write_results("gpu", payload, out, args.quick)
    labels = [f"{r['layout']} {r['tokens'] // 1024}k" for r in rows]
    series = {"load (tier->GPU)": [r["load_gbps"] for r in rows],
              "load device part": [r["load_device_gbps"] for r in rows],
              "store (GPU->tier)": [r["store_gbps"] for r in rows],
              "store device part": [r["store_device_gbps"] for r in rows]}  # fmt: skip
    if ceil:
        series["H2D ceiling"] = [ceil["h2d_gbps"]] * len(rows)
        series["D2H ceiling"] = [ceil["d2h_gbps"]] * len(rows)
    bar_plot(path.with_suffix(".png"), f"data path on {name}", labels, series, "GB/s")
    print(f"wrote {path}")
    return 0 if all(r["identical"] for r in rows) and not churned["bad_pages"] else 1


def main() -> int:
    """``python -m hybrid_offload.tools.bench.gpu`` (no CLI, so no vLLM import)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
