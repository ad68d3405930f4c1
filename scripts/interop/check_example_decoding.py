"""Issue-34 probe: decode one schema-shaped KVEventBatch (encoded exactly as
vLLM 0.32's ZmqEventPublisher encodes it) with
  (a) the upstream example's own types (vllm_kv_events_subscriber.py, as is),
  (b) the same types with `array_like=True` removed from KVCacheEvent only,
  (c) vllm.distributed.kv_events.KVEventBatch (0.32's real types),
and test the example's replay frame handling against the real ROUTER replay.

Run: /work/main/.venv/bin/python scripts/interop/check_example_decoding.py
"""

import importlib.util
import os
import time

import msgspec
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

HERE = os.path.dirname(os.path.abspath(__file__))

spec = importlib.util.spec_from_file_location(
    "example", os.path.join(HERE, "vllm_kv_events_subscriber.py"))
ex = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ex)

stored = BlockStored(
    block_hashes=[0x1234_5678_9ABC_DEF0], parent_block_hash=None,
    token_ids=list(range(64)), block_size=64, lora_id=None, medium="cpu",
    lora_name=None, group_idx=1, kv_cache_spec_kind="mamba", locality="LOCAL",
    ownership="hybrid-offload")
removed = BlockRemoved(block_hashes=[0x1234_5678_9ABC_DEF0], medium="disk",
                       group_idx=1, locality="REMOTE", ownership="hybrid-offload")
batch = KVEventBatch(ts=time.time(), events=[stored, removed], data_parallel_rank=0)
payload = msgspec.msgpack.Encoder().encode(batch)
print("wire (msgpack->python):", msgspec.msgpack.decode(payload))

print("\n(a) example types as is:")
try:
    print("   ", msgspec.msgpack.Decoder(type=ex.KVEventBatch).decode(payload))
except Exception as e:
    print("    ERROR:", type(e).__name__, e)


# (b) only array_like removed from the event base (batch stays array_like)
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BS(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BR(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class ABC(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class Batch(ex.EventBatch):
    events: list[BS | BR | ABC]


print("\n(b) example types, array_like removed from events:")
try:
    d = msgspec.msgpack.Decoder(type=Batch).decode(payload)
    print("   ", d)
    print("    -> fields silently dropped: group_idx, kv_cache_spec_kind, locality,"
          " ownership, lora_name, extra_keys, data_parallel_rank")
except Exception as e:
    print("    ERROR:", type(e).__name__, e)

print("\n(c) vllm.distributed.kv_events.KVEventBatch:")
print("   ", msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload))

# Replay: what the example's REQ socket receives from the real ROUTER replay.
print("\nreplay frames seen by the example's REQ socket:")
pub = ZmqEventPublisher(0, endpoint="tcp://*:5567", replay_endpoint="tcp://*:5568",
                        topic="kv-events")
pub.publish(batch)
pub.publish(batch)
time.sleep(0.5)
ctx = zmq.Context()
req = ctx.socket(zmq.REQ)
req.connect("tcp://127.0.0.1:5568")
req.send((0).to_bytes(8, "big"))
frames = req.recv_multipart()
print("    first reply:", len(frames), "frames:", [f[:12] for f in frames])
try:
    seq_bytes, replay_payload = frames  # the example's line
    print("    example unpack OK")
except ValueError as e:
    print("    example's `seq_bytes, replay_payload = replay.recv_multipart()` ->",
          type(e).__name__, e)
# A REQ socket gets exactly one reply per request: the rest of the stream
# (seq 1 and the END marker) is dropped by libzmq's REQ state machine.
req.send((0).to_bytes(8, "big"))
print("    second request on REQ after 1 reply: sent ok; reply:",
      [f[:12] for f in req.recv_multipart()])
req.close(0)
pub.shutdown()
