"""Issue-34 interop probe: publish KV events shaped per
shared/notes/issue34-events-schema.md through vLLM 0.32's *real* ZmqEventPublisher.

Run with the project venv (needs vllm):
    /work/main/.venv/bin/python scripts/interop/publish_schema_events.py \
        --endpoint tcp://*:5557 --replay tcp://*:5558 --topic kv-events

Each phase is published when a line arrives on stdin (or after --auto-delay
seconds per phase if --auto is given). What was published, and what the schema
says is restorable per medium after each phase, is written to --report (JSON).

Layout: one full_attention group and one mamba group (indices set by
--attn-group/--mamba-group), two media (--media, default cpu:LOCAL,disk:REMOTE),
plus optional vLLM-style GPU events (medium "GPU", group_idx, no kind) as vLLM's
block pool emits them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils as kcu

PROMPT_LEN = 256


def prompt_tokens(n: int = PROMPT_LEN) -> list[int]:
    # Deterministic; the Dynamo probe regenerates the same list.
    return [100 + (i * 7919) % 30000 for i in range(n)]


def vllm_block_hashes(tokens: list[int], hash_block: int) -> list[int]:
    """vLLM's chained block hashes at hash_block granularity, published form."""
    kcu.init_none_hash(sha256)
    out, parent = [], None
    for s in range(0, len(tokens) - hash_block + 1, hash_block):
        h = kcu.hash_block_tokens(sha256, parent, tokens[s : s + hash_block], None)
        out.append(kcu.maybe_convert_block_hash(h))
        parent = h
    return out


class Schema:
    def __init__(self, tokens, hash_block, chunk):
        assert chunk % hash_block == 0
        self.tokens, self.hb, self.chunk = tokens, hash_block, chunk
        self.hashes = vllm_block_hashes(tokens, hash_block)

    def h_at(self, p: int):
        return self.hashes[p // self.hb - 1]

    def stored(self, c, medium, locality, group, kind):
        p = (c + 1) * self.chunk
        return BlockStored(
            block_hashes=[self.h_at(p)],
            parent_block_hash=self.h_at(p - self.chunk) if c > 0 else None,
            token_ids=self.tokens[p - self.chunk : p],
            block_size=self.chunk,
            lora_id=None,
            medium=medium,
            lora_name=None,
            group_idx=group,
            kv_cache_spec_kind=kind,
            locality=locality,
            ownership=getattr(self, "ownership", "hybrid-offload"),
        )

    def removed(self, c, medium, locality, group):
        p = (c + 1) * self.chunk
        return BlockRemoved(
            block_hashes=[self.h_at(p)],
            medium=medium,
            group_idx=group,
            locality=locality,
            ownership=getattr(self, "ownership", "hybrid-offload"),
        )

    def gpu_stored(self, c, group):
        # As vLLM's BlockPool emits it: medium "GPU", group_idx, no kind.
        p = (c + 1) * self.chunk
        return BlockStored(
            block_hashes=[self.h_at(p)],
            parent_block_hash=self.h_at(p - self.chunk) if c > 0 else None,
            token_ids=self.tokens[p - self.chunk : p],
            block_size=self.chunk,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            group_idx=group,
        )


def restorable(holdings: dict, chunk: int, plen: int) -> int:
    """Schema rule: largest p with attention blocks at chunk, 2chunk, .., p and a
    mamba state at p. holdings = {"attn": set(p), "mamba": set(p)}."""
    best = 0
    for p in range(chunk, plen + 1, chunk):
        if all(q in holdings["attn"] for q in range(chunk, p + 1, chunk)):
            if p in holdings["mamba"]:
                best = p
        else:
            break
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", default="tcp://*:5557")
    ap.add_argument("--replay", default="tcp://*:5558")
    ap.add_argument("--topic", default="kv-events")
    ap.add_argument("--hash-block", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--attn-group", type=int, default=0)
    ap.add_argument("--mamba-group", type=int, default=1)
    ap.add_argument("--media", default="cpu:LOCAL,disk:REMOTE")
    ap.add_argument("--gpu-events", action="store_true")
    ap.add_argument("--omit-ownership", action="store_true",
                    help="probe only: leave ownership unset (Dynamo 1.6.1 drops events that set it)")
    ap.add_argument("--drop-seq", type=int, default=-1,
                    help="do not send this seq on PUB (still kept for replay)")
    ap.add_argument("--report", default="")
    ap.add_argument("--auto", action="store_true")
    ap.add_argument("--auto-delay", type=float, default=1.0)
    ap.add_argument("--hold", type=float, default=2.0,
                    help="seconds to stay up after the last phase (replay)")
    args = ap.parse_args()

    media = [tuple(m.split(":")) for m in args.media.split(",")]
    (m1, l1), (m2, l2) = media[0], media[1]
    s = Schema(prompt_tokens(), args.hash_block, args.chunk)
    s.ownership = None if args.omit_ownership else "hybrid-offload"
    chunk, attn_g, mamba_g = args.chunk, args.attn_group, args.mamba_group
    hold = {m: {"attn": set(), "mamba": set()} for m, _ in media}

    # Phases: list of (description, [events], holdings mutation)
    phases = []
    ev = []
    if args.gpu_events:
        # GPU cache holds attention chunks 0..1 and the mamba state at 128
        ev += [s.gpu_stored(0, attn_g), s.gpu_stored(1, attn_g), s.gpu_stored(1, mamba_g)]
    for c in range(4):
        ev.append(s.stored(c, m1, l1, attn_g, "full_attention"))
    ev.append(s.stored(1, m1, l1, mamba_g, "mamba"))  # state at p=128 on m1
    for c in range(2):
        ev.append(s.stored(c, m2, l2, attn_g, "full_attention"))
    ev.append(s.stored(0, m2, l2, mamba_g, "mamba"))  # state at p=64 on m2
    ev.append(s.stored(1, m2, l2, mamba_g, "mamba"))  # state at p=128 on m2

    def p1(h):
        h[m1]["attn"] |= {64, 128, 192, 256}
        h[m1]["mamba"] |= {128}
        h[m2]["attn"] |= {64, 128}
        h[m2]["mamba"] |= {64, 128}

    phases.append(("store", ev, p1))

    # Phase 2: the mamba tier on m2 loses its state at 128 (BlockRemoved, mamba group)
    def p2(h):
        h[m2]["mamba"].discard(128)

    phases.append(("remove mamba@128 on " + m2, [s.removed(1, m2, l2, mamba_g)], p2))

    # Phase 3: m1 loses attention chunk 1 (p=128) (BlockRemoved, attention group)
    def p3(h):
        h[m1]["attn"].discard(128)

    phases.append(("remove attn@128 on " + m1, [s.removed(1, m1, l1, attn_g)], p3))

    pub = ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=args.endpoint,
        replay_endpoint=args.replay or None,
        topic=args.topic,
    )
    if args.drop_seq >= 0:
        real_send = pub._pub.send_multipart

        def lossy_send(frames, *a, **k):
            if int.from_bytes(frames[1], "big") == args.drop_seq:
                print(f"[pub] dropping seq {args.drop_seq} on PUB (kept for replay)",
                      flush=True)
                return None
            return real_send(frames, *a, **k)

        pub._pub.send_multipart = lossy_send

    report = {
        "prompt_len": PROMPT_LEN,
        "hash_block": args.hash_block,
        "chunk": chunk,
        "groups": {"full_attention": attn_g, "mamba": mamba_g},
        "media": dict(media),
        "vllm_hashes_at_chunk_ends": [s.h_at(p) for p in range(chunk, PROMPT_LEN + 1, chunk)],
        "phases": [],
    }
    print(f"[pub] ready endpoint={args.endpoint} replay={args.replay} "
          f"topic={args.topic!r}", flush=True)
    seq = 0
    for name, events, mutate in phases:
        if args.auto:
            time.sleep(args.auto_delay)
        else:
            line = sys.stdin.readline()
            if not line:
                break
        # one event per batch so seq numbers are easy to reason about
        first = seq
        for e in events:
            pub.publish(KVEventBatch(ts=time.time(), events=[e]))
            seq += 1
        mutate(hold)
        rest = {m: restorable(hold[m], chunk, PROMPT_LEN) for m, _ in media}
        report["phases"].append(
            {"phase": name, "seqs": [first, seq - 1], "n_events": len(events),
             "schema_restorable_tokens": rest,
             "holdings": {m: {k: sorted(v) for k, v in hold[m].items()} for m in hold}}
        )
        print(f"[pub] phase {name!r}: seqs {first}..{seq - 1}; schema restorable "
              f"{rest}", flush=True)
        if args.report:
            with open(args.report, "w") as f:
                json.dump(report, f, indent=1)
    time.sleep(args.hold)
    pub.shutdown()
    print("[pub] done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
