"""Issue-34 probe: does Dynamo's standalone KV indexer (ai-dynamo-runtime, run as
`python -m dynamo.indexer`, no etcd / NATS) ingest hybrid-offload's KV events from
vLLM 0.32's real ZmqEventPublisher, and what overlap does it report vs what the
schema (shared/notes/issue34-events-schema.md) says is restorable?

Run in a separate venv that has ai-dynamo-runtime (NOT the project venv):
    /work/dynamo-venv/bin/python scripts/interop/dynamo_probe.py [--scenario NAME ...]

The events are published by scripts/interop/publish_schema_events.py in a child
process using the project venv's python (it needs vllm). The indexer subscribes to
that publisher's PUB socket (and its replay ROUTER socket) like it would a vLLM
engine. Also exercises the in-process `dynamo.llm.RadixTree` API.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
VLLM_PY = os.environ.get("VLLM_PY", "/work/main/.venv/bin/python")
PUBLISHER = os.path.join(HERE, "publish_schema_events.py")
PROMPT_LEN = 256

COMPAT = ["--media", "CPU:LOCAL,DISK:LOCAL", "--omit-ownership"]
SCENARIOS = {
    # name: (publisher args, indexer block size, description)
    "ours": (["--gpu-events"], 64,
             "our schema exactly: attn=g0, mamba=g1, media cpu(LOCAL)/disk(REMOTE), "
             "ownership set; + vLLM-style GPU events"),
    "compat": ([*COMPAT, "--gpu-events"], 64,
               "Dynamo-compatible spelling: media CPU/DISK, both LOCAL, no ownership; "
               "attn=g0, mamba=g1; + GPU events"),
    "compat_mamba_first": ([*COMPAT, "--attn-group", "1", "--mamba-group", "0", "--gpu-events"], 64,
                           "as compat, attn=g1, mamba=g0 (granite/nemotron-like order)"),
    "compat_gap": ([*COMPAT, "--drop-seq", "2"], 64,
                   "as compat without GPU events; seq 2 (attn chunk 2 on CPU) lost on PUB, "
                   "replay endpoint registered"),
    "compat_bs16": (COMPAT, 16,
                    "as compat without GPU events; indexer block size 16 (= vLLM hash block)"),
}


def prompt_tokens(n: int = PROMPT_LEN) -> list[int]:
    return [100 + (i * 7919) % 30000 for i in range(n)]


def http(method: str, url: str, body=None, timeout=5.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_http(url: str, deadline: float):
    while time.time() < deadline:
        try:
            return http("GET", url)
        except Exception:
            time.sleep(0.2)
    raise RuntimeError(f"{url} not up")


def read_until(proc, needle: str, deadline: float, sink: list):
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise RuntimeError("publisher exited: " + "".join(sink[-20:]))
            continue
        sink.append(line)
        if needle in line:
            return line
    raise RuntimeError(f"timeout waiting for {needle!r}")


def run_scenario(name: str, port_base: int, workdir: str) -> dict:
    pub_args, block_size, desc = SCENARIOS[name]
    http_port, pub_port, rep_port = port_base, port_base + 1, port_base + 2
    log_path = os.path.join(workdir, f"indexer-{name}.log")
    report_path = os.path.join(workdir, f"published-{name}.json")
    env = dict(os.environ, DYN_LOG=os.environ.get("DYN_LOG", "info"))
    # the child keeps its own copy of the log fd; ours can close right away
    with open(log_path, "w") as log_f:
        idx = subprocess.Popen(
            [sys.executable, "-m", "dynamo.indexer", "--port", str(http_port),
             "--threads", "1"],
            stdout=log_f, stderr=subprocess.STDOUT, env=env)
    pub = None
    out = {"scenario": name, "description": desc, "indexer_block_size": block_size,
           "phases": []}
    pub_lines: list[str] = []
    try:
        base = f"http://127.0.0.1:{http_port}"
        wait_http(base + "/workers", time.time() + 20)
        pub = subprocess.Popen(
            [VLLM_PY, "-u", PUBLISHER, "--endpoint", f"tcp://*:{pub_port}",
             "--replay", f"tcp://*:{rep_port}", "--topic", "", "--report",
             report_path, "--hold", "3", *pub_args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)
        read_until(pub, "[pub] ready", time.time() + 120, pub_lines)
        st, body = http("POST", base + "/register", {
            "instance_id": 1, "endpoint": f"tcp://127.0.0.1:{pub_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{rep_port}",
            "model_name": "m", "block_size": block_size})
        out["register"] = [st, body]
        time.sleep(2.0)  # SUB handshake (slow joiner)
        tokens = prompt_tokens()
        for _ in range(3):
            pub.stdin.write("go\n")
            pub.stdin.flush()
            line = read_until(pub, "[pub] phase", time.time() + 30, pub_lines)
            time.sleep(1.5)
            st, q = http("POST", base + "/query", {"token_ids": tokens, "model_name": "m"})
            qs = {}
            for plen in (64, 128, 192):
                _, r = http("POST", base + "/query",
                            {"token_ids": tokens[:plen], "model_name": "m"})
                qs[plen] = r
            _, dump = http("GET", base + "/dump")
            out["phases"].append({"publisher": line.strip(), "query_status": st,
                                  "query_full_prompt": q, "query_prefixes": qs,
                                  "dump": dump})
        pub.stdin.close()
        pub.wait(timeout=30)
    finally:
        if pub and pub.poll() is None:
            pub.kill()
        idx.terminate()
        try:
            idx.wait(timeout=10)
        except subprocess.TimeoutExpired:
            idx.kill()
    with open(report_path) as f:
        out["published"] = json.load(f)
    with open(log_path) as f:
        log = f.read()
    keys = ("Gap detected", "Replay", "replay", "Block not published", "ignored",
            "Ignored", "Failed", "parent", "WARN", "ERROR", "block size", "Block size")
    out["indexer_log_lines"] = [ln for ln in log.splitlines() if any(k in ln for k in keys)][:40]
    return out


def summarize(res: dict) -> None:
    print(f"\n=== scenario {res['scenario']}: {res['description']}")
    print(f"    indexer block_size={res['indexer_block_size']} register={res.get('register')}")
    pubd = res["published"]
    for i, ph in enumerate(res["phases"]):
        schema = pubd["phases"][i]["schema_restorable_tokens"] if i < len(pubd["phases"]) else "?"
        q = ph["query_full_prompt"]
        print(f"  phase {i}: {ph['publisher']}")
        print(f"    schema restorable (tokens): {schema}")
        if isinstance(q, dict):
            print(f"    dynamo /query scores (tokens, device tier): {q.get('scores')}")
            print(f"    dynamo /query instances (per tier): {json.dumps(q.get('instances'))}")
        else:
            print(f"    dynamo /query -> {q}")
        pref = {k: (v.get("instances") if isinstance(v, dict) else v)
                for k, v in ph["query_prefixes"].items()}
        print(f"    prefixes 64/128/192 instances: {json.dumps(pref)}")
        dump = ph["dump"]
        if isinstance(dump, dict):
            for k, v in dump.items():
                n = len(v) if isinstance(v, list) else v
                print(f"    /dump[{k}]: {n if not isinstance(n, int) else str(n) + ' events'}")
    for ln in res["indexer_log_lines"]:
        print("    log:", ln[:220])


def radix_tree_probe() -> None:
    from dynamo.llm import RadixTree, compute_block_hash_for_seq
    print("\n=== in-process dynamo.llm.RadixTree / compute_block_hash_for_seq")
    toks = prompt_tokens()
    local = compute_block_hash_for_seq(toks, 64)
    print(f"  compute_block_hash_for_seq(prompt, 64) -> {len(local)} local hashes: {local}")
    print(f"  same tokens, block 16 -> first 4: {compute_block_hash_for_seq(toks, 16)[:4]}")
    t = RadixTree()
    # 1) vLLM-style msgpack is not what apply_event takes:
    for label, raw in [("vLLM KVEventBatch msgpack-like bytes", b"\x93\xcb"),
                       ("JSON of a vLLM BlockStored map", json.dumps(
                           {"type": "BlockStored", "block_hashes": [1],
                            "parent_block_hash": None, "token_ids": toks[:64],
                            "block_size": 64}).encode())]:
        try:
            t.apply_event(1, raw)
            print(f"  apply_event({label}): accepted")
        except Exception as e:
            print(f"  apply_event({label}): {type(e).__name__}: {str(e)[:160]}")
    # 2) Dynamo-native RouterEvent JSON (a router-side adapter would translate ours)
    ext = [1000 + i for i in range(4)]  # stand-ins for vLLM hashes at 64,128,192,256
    ok = 0
    for i in range(4):
        ev = {"event_id": i + 1, "data": {"stored": {
            "parent_hash": ext[i - 1] if i else None,
            "blocks": [{"block_hash": ext[i], "tokens_hash": local[i]}]}},
            "dp_rank": 0}
        try:
            t.apply_event(7, json.dumps(ev).encode())
            ok += 1
        except Exception as e:
            print(f"  native stored event {i}: {type(e).__name__}: {str(e)[:200]}")
            break
    if ok:
        time.sleep(0.2)
        m = t.find_matches(local)
        print(f"  {ok} native stored events applied; find_matches(prompt) scores="
              f"{m.scores} (blocks)")
        ev = {"event_id": 9, "data": {"removed": {"block_hashes": [ext[1]]}}, "dp_rank": 0}
        try:
            t.apply_event(7, json.dumps(ev).encode())
            time.sleep(0.2)
            print(f"  after native removed(block 1): scores={t.find_matches(local).scores}")
        except Exception as e:
            print(f"  native removed: {type(e).__name__}: {str(e)[:200]}")
        print(f"  dump_tree_as_events()[0] = {t.dump_tree_as_events()[:1]}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", action="append", choices=list(SCENARIOS))
    ap.add_argument("--port-base", type=int, default=18090)
    ap.add_argument("--out", default="")
    ap.add_argument("--skip-radix", action="store_true")
    args = ap.parse_args()
    import importlib.metadata as md
    print("ai-dynamo-runtime", md.version("ai-dynamo-runtime"), "python", sys.version.split()[0])
    workdir = tempfile.mkdtemp(prefix="dynprobe-")
    results = []
    for i, name in enumerate(args.scenario or list(SCENARIOS)):
        res = run_scenario(name, args.port_base + 10 * i, workdir)
        summarize(res)
        results.append(res)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if not args.skip_radix:
        radix_tree_probe()
    print(f"\n(workdir {workdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
