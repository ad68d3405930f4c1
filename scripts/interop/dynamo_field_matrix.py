"""Issue-34 probe: which BlockStored/BlockRemoved field combinations does Dynamo's
standalone KV indexer (ai-dynamo-runtime) ingest from vLLM 0.32's real
ZmqEventPublisher?  One publisher (= one Dynamo worker) per variant; each
publishes the same 4-block attention chain (block 64, vLLM sha256 hashes at 16),
then removes block 1 with the same field shape.

Orchestrator (dynamo venv):  /work/dynamo-venv/bin/python scripts/interop/dynamo_field_matrix.py
(it starts the publisher half with VLLM_PY, default /work/main/.venv/bin/python)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VLLM_PY = os.environ.get("VLLM_PY", "/work/main/.venv/bin/python")
BASE = int(os.environ.get("PORT_BASE", "18300"))

# name: BlockStored extras (beyond hashes/parent/tokens/block_size/lora_id)
VARIANTS = [
    ("gpu_plain", dict(medium="GPU")),
    ("gpu_g0", dict(medium="GPU", group_idx=0)),
    ("gpu_g1", dict(medium="GPU", group_idx=1)),
    ("gpu_g0_fa", dict(medium="GPU", group_idx=0, kv_cache_spec_kind="full_attention")),
    ("gpu_g1_fa", dict(medium="GPU", group_idx=1, kv_cache_spec_kind="full_attention")),
    ("gpu_g0_mamba", dict(medium="GPU", group_idx=0, kv_cache_spec_kind="mamba")),
    ("gpu_g0_sw", dict(medium="GPU", group_idx=0, kv_cache_spec_kind="sliding_window",
                       kv_cache_spec_sliding_window=128)),
    ("gpu_loc_own", dict(medium="GPU", locality="LOCAL", ownership="hybrid-offload")),
    ("gpu_locLOCAL", dict(medium="GPU", locality="LOCAL")),
    ("gpu_locREMOTE", dict(medium="GPU", locality="REMOTE")),
    ("gpu_own", dict(medium="GPU", ownership="hybrid-offload")),
    ("gpu_session", dict(medium="GPU", session_id="s1")),
    ("CPU_locLOCAL", dict(medium="CPU", locality="LOCAL")),
    ("DISK_locREMOTE", dict(medium="DISK", locality="REMOTE")),
    ("none_medium", dict(medium=None)),
    ("cpu_lower", dict(medium="cpu")),
    ("CPU", dict(medium="CPU")),
    ("CPU_PINNED", dict(medium="CPU_PINNED")),
    ("DISK", dict(medium="DISK")),
    ("ours_cpu_g0_fa", dict(medium="cpu", group_idx=0, kv_cache_spec_kind="full_attention",
                            locality="LOCAL", ownership="hybrid-offload")),
]
REMOVE_KEYS = ("medium", "group_idx", "locality", "ownership")


def publisher() -> None:
    sys.path.insert(0, HERE)
    from publish_schema_events import Schema, prompt_tokens
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher
    s = Schema(prompt_tokens(), 16, 64)
    pubs = []
    for i in range(len(VARIANTS)):
        pubs.append(ZmqEventPublisher(0, endpoint=f"tcp://*:{BASE + 1 + i}", topic=""))
    print("ready", flush=True)
    sys.stdin.readline()
    for (_name, extra), pub in zip(VARIANTS, pubs, strict=True):
        for c in range(4):
            p = (c + 1) * 64
            pub.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
                block_hashes=[s.h_at(p)],
                parent_block_hash=s.h_at(p - 64) if c else None,
                token_ids=s.tokens[p - 64:p], block_size=64, lora_id=None,
                lora_name=None, **{"medium": None, **extra})]))
    print("stored", flush=True)
    sys.stdin.readline()
    for (_name, extra), pub in zip(VARIANTS, pubs, strict=True):
        rk = {k: v for k, v in extra.items() if k in REMOVE_KEYS}
        pub.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved(
            block_hashes=[s.h_at(128)], **{"medium": None, **rk})]))
    print("removed", flush=True)
    sys.stdin.readline()
    time.sleep(0.5)
    for pub in pubs:
        pub.shutdown()


def orchestrate() -> None:
    import urllib.request

    def http(method, url, body=None):
        req = urllib.request.Request(url, method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read() or b"null")

    sys.path.insert(0, HERE)
    from dynamo_probe import prompt_tokens  # same token list as the publisher
    idx = subprocess.Popen([sys.executable, "-m", "dynamo.indexer", "--port", str(BASE),
                            "--threads", "1"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    pub = subprocess.Popen([VLLM_PY, "-u", __file__, "--publish"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    url = f"http://127.0.0.1:{BASE}"
    try:
        while pub.stdout.readline().strip() != "ready":
            pass
        for i in range(len(VARIANTS)):
            http("POST", url + "/register", {"instance_id": 100 + i, "model_name": "m",
                                             "endpoint": f"tcp://127.0.0.1:{BASE + 1 + i}",
                                             "block_size": 64})
        time.sleep(2)
        rows = {}
        for step in ("stored", "removed"):
            pub.stdin.write("go\n")
            pub.stdin.flush()
            while pub.stdout.readline().strip() != step:
                pass
            time.sleep(1.5)
            q = http("POST", url + "/query", {"token_ids": prompt_tokens(), "model_name": "m"})
            for i, (name, _) in enumerate(VARIANTS):
                inst = q["instances"].get(str(100 + i))
                rows.setdefault(name, {})[step] = inst
        dump = http("GET", url + "/dump")
        pub.stdin.write("go\n")
        pub.stdin.flush()
        pub.wait(timeout=20)
    finally:
        if pub.poll() is None:
            pub.kill()
        idx.terminate()
        idx.wait(timeout=10)
    print(f"{'variant':16} {'stored fields':95} after store -> after remove(block 1)")
    for name, extra in VARIANTS:
        r = rows[name]
        print(f"{name:16} {json.dumps(extra):95} {json.dumps(r['stored'])} -> "
              f"{json.dumps(r['removed'])}")
    tiers = {}
    for v in dump.values():
        for e in v.get("events", []):
            tiers.setdefault((e["worker_id"], e["storage_tier"]), 0)
            tiers[(e["worker_id"], e["storage_tier"])] += len(e["event"]["data"]["stored"]["blocks"])
    print("dump (worker, tier): blocks =",
          {f"{VARIANTS[w - 100][0]}/{t}": n for (w, t), n in sorted(tiers.items())})


if __name__ == "__main__":
    publisher() if "--publish" in sys.argv else orchestrate()
