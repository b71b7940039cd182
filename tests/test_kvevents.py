"""KV events in vLLM's format: the encoding is byte-identical to what vLLM's own classes (msgspec) produce, and
what a running sidecar sends decodes with vLLM's own KVEventBatch in the vLLM environment, when it is built
(~/.cache/promptcache-vllm, by the vLLM connector's tests). Isolated tenants' chunks are never announced."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import time

import pytest
import zmq

from support import CHUNK, SMALL, make_kv
from promptcache.client import PromptCacheClient
from promptcache.sidecar.kvevents import all_blocks_cleared, block_removed, block_stored, encode_batch, wire_hash
from test_auth import write_secret_dir

# msgspec.msgpack.encode(vllm.distributed.kv_events.KVEventBatch(ts=1700000000.25, events=[AllBlocksCleared(),
#   BlockStored([H1], None, [1, 2, 3, 4], 4, None, "CPU", None), BlockStored([H2], H1, [5, 6, 70000, 8], 4, None,
#   "CPU", None), BlockRemoved([H1, H2], "CPU")])) with vLLM 0.32.0, H1 = bytes(range(32)), H2 = bytes(range(32, 64)).
VLLM_BATCH = bytes.fromhex(
    "93cb41d954fc401000009481a474797065b0416c6c426c6f636b73436c656172656488a474797065ab426c6f636b53746f726564ac"
    "626c6f636b5f68617368657391c420000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1fb170617265"
    "6e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d"
    "656469756da3435055a96c6f72615f6e616d65c088a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391"
    "c420202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3fb1706172656e745f626c6f636b5f68617368"
    "c420000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1fa9746f6b656e5f696473940506ce00011170"
    "08aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3435055a96c6f72615f6e616d65c083a474797065ac42"
    "6c6f636b52656d6f766564ac626c6f636b5f68617368657392c420000102030405060708090a0b0c0d0e0f101112131415161718"
    "191a1b1c1d1e1fc420202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3fa66d656469756da3435055c0")

# The same batch with the hashes as vLLM sends them by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1), what a
# sidecar sends: maybe_convert_block_hash(H) = int.from_bytes(H, "big") & (2**64 - 1), vLLM 0.32.0 likewise.
VLLM_BATCH_INT_HASHES = bytes.fromhex(
    "93cb41d954fc401000009481a474797065b0416c6c426c6f636b73436c656172656488a474797065ab426c6f636b53746f726564"
    "ac626c6f636b5f68617368657391cf18191a1b1c1d1e1fb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473"
    "9401020304aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3435055a96c6f72615f6e616d65c088a47479"
    "7065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cf38393a3b3c3d3e3fb1706172656e745f626c6f636b5f68"
    "617368cf18191a1b1c1d1e1fa9746f6b656e5f696473940506ce0001117008aa626c6f636b5f73697a6504a76c6f72615f6964c0"
    "a66d656469756da3435055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368"
    "657392cf18191a1b1c1d1e1fcf38393a3b3c3d3e3fa66d656469756da3435055c0")

DECODE = """
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
out = []
for topic, seq, payload in json.load(sys.stdin):
    batch = decoder.decode(bytes.fromhex(payload))
    events = []
    for e in batch.events:
        d = {"type": type(e).__name__}
        for f in e.__struct_fields__:
            v = getattr(e, f)
            d[f] = v.hex() if isinstance(v, bytes) else [x.hex() if isinstance(x, bytes) else x for x in v] \\
                if isinstance(v, list) else v
        events.append(d)
    out.append({"topic": topic, "seq": int.from_bytes(bytes.fromhex(seq), "big"), "events": events})
print(json.dumps(out))
"""


def vllm_python() -> str | None:
    for python in sorted(glob.glob(os.path.expanduser("~/.cache/promptcache-vllm/*/bin/python"))):
        if glob.glob(os.path.join(os.path.dirname(python), "..", "lib", "python3*", "site-packages", "vllm",
                                  "distributed", "kv_events.py")):
            return python
    return None


def test_the_encoding_is_byte_identical_to_vllms():
    h1, h2 = bytes(range(32)), bytes(range(32, 64))
    ours = encode_batch(1700000000.25, [all_blocks_cleared(), block_stored([h1], None, [1, 2, 3, 4], 4, "CPU"),
                                        block_stored([h2], h1, [5, 6, 70000, 8], 4, "CPU"),
                                        block_removed([h1, h2], "CPU")])
    assert ours == VLLM_BATCH
    w1, w2 = wire_hash(h1), wire_hash(h2)
    ours = encode_batch(1700000000.25, [all_blocks_cleared(), block_stored([w1], None, [1, 2, 3, 4], 4, "CPU"),
                                        block_stored([w2], w1, [5, 6, 70000, 8], 4, "CPU"),
                                        block_removed([w1, w2], "CPU")])
    assert ours == VLLM_BATCH_INT_HASHES


def _subscribe(address: str):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.IPV6, 1)  # (also connects to IPv4 addresses)
    sub.connect(address)
    time.sleep(0.3)  # a PUB socket drops what it sends before the subscription has arrived
    return sub


def _receive(sub, until_events: int, timeout: float = 5.0) -> list[tuple[bytes, bytes, bytes]]:
    frames, count = [], 0
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    deadline = time.monotonic() + timeout
    while count < until_events and time.monotonic() < deadline:
        if poller.poll(100):
            topic, seq, payload = sub.recv_multipart()
            frames.append((topic, seq, payload))
            import msgpack

            count += len(msgpack.unpackb(payload)[1])
    return frames


def _decode_with_vllm(frames) -> list[dict]:
    python = vllm_python()
    if python is None:
        pytest.skip("the vLLM environment (~/.cache/promptcache-vllm) is not built here; "
                    "test_the_encoding_is_byte_identical_to_vllms covers the encoding")
    data = json.dumps([[t.decode(), s.hex(), p.hex()] for t, s, p in frames])
    out = subprocess.run([python, "-c", DECODE], input=data, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # importing vLLM takes about a minute here
def test_a_sidecar_announces_what_it_stores_and_evicts_and_vllm_decodes_it(sidecar_factory):
    sidecar = sidecar_factory(kv_events_address="tcp://127.0.0.1:*", kv_events_id="node-1")
    sub = _subscribe(sidecar.events.address)
    tokens = list(range(1000, 1000 + 2 * CHUNK))
    with PromptCacheClient(sidecar.address, timeout=10) as c:
        assert c.put(SMALL, tokens, make_kv(SMALL, len(tokens))).stored_chunks == 2
        keys = [ch.key for ch in c.lookup(SMALL, tokens).chunks]
        frames = _receive(sub, 3)
        assert c.delete(SMALL, tokens) == 2
        frames += _receive(sub, 2)
    decoded = _decode_with_vllm(frames)
    topic = f"kv@node-1@{SMALL.model_id}"
    assert {b["topic"] for b in decoded} == {topic}
    assert [b["seq"] for b in decoded] == list(range(len(decoded)))
    events = [e for b in decoded for e in b["events"]]
    assert events[0]["type"] == "AllBlocksCleared"
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert [e["block_hashes"] for e in stored] == [[wire_hash(keys[0])], [wire_hash(keys[1])]]
    assert [e["parent_block_hash"] for e in stored] == [None, wire_hash(keys[0])]
    assert [e["token_ids"] for e in stored] == [tokens[:CHUNK], tokens[CHUNK:]]
    assert {(e["block_size"], e["medium"]) for e in stored} == {(CHUNK, "CPU")}
    removed = sorted(h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"])
    assert removed == sorted(wire_hash(k) for k in keys)
    sub.close()


def _ipv6_loopback() -> bool:
    import socket
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_an_ipv6_endpoint_binds_and_publishes(sidecar_factory):
    """libzmq binds an IPv6 address only with ZMQ_IPV6 set: without it `--kv-events-address tcp://[::1]:5557` (or
    [::] on an IPv6-only cluster) stopped the sidecar at start with "No such device"."""
    sidecar = sidecar_factory(kv_events_address="tcp://[::1]:*", kv_events_id="node-6")
    assert sidecar.events.address.startswith("tcp://[::1]:")
    sub = _subscribe(sidecar.events.address)
    tokens = list(range(4000, 4000 + CHUNK))
    with PromptCacheClient(sidecar.address, timeout=10) as c:
        assert c.put(SMALL, tokens, make_kv(SMALL, len(tokens))).stored_chunks == 1
        frames = _receive(sub, 2)
    assert {topic for topic, _, _ in frames} == {f"kv@node-6@{SMALL.model_id}".encode()}
    sub.close()


def test_isolated_tenants_are_not_announced_and_public_groups_are(sidecar_factory, tmp_path):
    tokens_dir = tmp_path / "tokens"
    write_secret_dir(tokens_dir, {"alice": "alice-token"})
    sidecar = sidecar_factory(kv_events_address="tcp://127.0.0.1:*", token_file=str(tokens_dir),
                              sharing_groups="public=*;team=alice")
    sub = _subscribe(sidecar.events.address)
    import dataclasses

    secret_prompt = list(range(5000, 5000 + CHUNK))
    with PromptCacheClient(sidecar.address, token="alice-token", timeout=10) as c:
        assert c.put(SMALL, secret_prompt, make_kv(SMALL, CHUNK)).stored_chunks == 1
        team = dataclasses.replace(SMALL, tenant_salt=b"share:team")
        assert c.put(team, secret_prompt, make_kv(SMALL, CHUNK)).stored_chunks == 1
        public = dataclasses.replace(SMALL, tenant_salt=b"share:public")
        shared_prompt = list(range(9000, 9000 + CHUNK))
        assert c.put(public, shared_prompt, make_kv(SMALL, CHUNK)).stored_chunks == 1
        frames = _receive(sub, 10, timeout=2.0)
    import msgpack

    events = [e for _, _, p in frames for e in msgpack.unpackb(p)[1]]
    assert [e["token_ids"] for e in events if e["type"] == "BlockStored"] == [shared_prompt]
    sub.close()


def test_each_pod_using_a_model_gets_its_holdings_under_its_own_id(sidecar_factory):
    """Routers score pods: a pod naming itself (x-promptcache-pod) gets, on kv@POD@MODEL, what the node already
    holds of the model, then the live events."""
    import grpc
    import msgpack

    from promptcache.v1 import kvcache_pb2 as pb
    from promptcache.v1 import kvcache_pb2_grpc as pb_grpc
    from promptcache.contract.wire import model_to_proto

    sidecar = sidecar_factory(kv_events_address="tcp://127.0.0.1:*", kv_events_id="node-1")
    sub = _subscribe(sidecar.events.address)
    first, second = list(range(100, 100 + 2 * CHUNK)), list(range(700, 700 + CHUNK))
    with PromptCacheClient(sidecar.address, timeout=10) as c, grpc.insecure_channel(sidecar.address) as channel:
        assert c.put(SMALL, first, make_kv(SMALL, len(first))).stored_chunks == 2
        frames = _receive(sub, 3)
        pb_grpc.KVCacheStub(channel).Lookup(pb.LookupRequest(model=model_to_proto(SMALL), tokens=first),
                                            metadata=[("x-promptcache-pod", "pod-a")], timeout=10)
        frames += _receive(sub, 3)
        assert c.put(SMALL, second, make_kv(SMALL, CHUNK)).stored_chunks == 1
        frames += _receive(sub, 2)
    by_topic: dict[str, list] = {}
    for t, seq, payload in frames:
        by_topic.setdefault(t.decode(), []).append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)[1]))
    node, pod = f"kv@node-1@{SMALL.model_id}", f"kv@pod-a@{SMALL.model_id}"
    assert set(by_topic) == {node, pod}
    for batches in by_topic.values():
        assert [s for s, _ in batches] == list(range(len(batches)))
    pod_events = [e for _, events in by_topic[pod] for e in events]
    assert [e["type"] for e in pod_events] == ["AllBlocksCleared", "BlockStored", "BlockStored", "BlockStored"]
    assert [e["token_ids"] for e in pod_events[1:]] == [first[:CHUNK], first[CHUNK:], second]
    node_stored = [e["token_ids"] for _, events in by_topic[node] for e in events if e["type"] == "BlockStored"]
    assert node_stored == [first[:CHUNK], first[CHUNK:], second]
    sub.close()


def test_a_prefix_scorer_fed_by_two_nodes_events_picks_the_node_holding_the_prefix(sidecar_factory):
    """What llm-d's precise prefix-cache scorer does with the events (it hashes token ids per block and follows
    the parent chain; its Go library is not reachable here): index each publisher's blocks by their token ids
    chained to their parent, then score a request by the leading blocks a publisher holds."""
    import msgpack

    nodes = {name: sidecar_factory(kv_events_address="tcp://127.0.0.1:*", kv_events_id=name)
             for name in ("node-1", "node-2")}
    subs = {name: _subscribe(s.events.address) for name, s in nodes.items()}
    system_a, system_b = list(range(1, 1 + 3 * CHUNK)), list(range(500, 500 + 3 * CHUNK))
    with PromptCacheClient(nodes["node-1"].address, timeout=10) as c1, \
            PromptCacheClient(nodes["node-2"].address, timeout=10) as c2:
        assert c1.put(SMALL, system_a, make_kv(SMALL, len(system_a))).stored_chunks == 3
        assert c2.put(SMALL, system_b, make_kv(SMALL, len(system_b))).stored_chunks == 3
    held: dict[str, set] = {}
    for name, sub in subs.items():
        by_hash: dict[bytes, tuple] = {}
        for topic, _, payload in _receive(sub, 4):
            publisher = topic.decode().split("@")[1]
            for e in msgpack.unpackb(payload)[1]:
                if e["type"] == "BlockStored":
                    prefix = by_hash.get(e["parent_block_hash"], ()) + tuple(e["token_ids"])
                    by_hash[e["block_hashes"][0]] = prefix
                    held.setdefault(publisher, set()).add(prefix)
        sub.close()

    def score(publisher: str, tokens: list[int]) -> int:
        n = 0
        while (n + 1) * CHUNK <= len(tokens) and tuple(tokens[:(n + 1) * CHUNK]) in held.get(publisher, ()):
            n += 1
        return n

    def pick(tokens):
        return max(held, key=lambda p: score(p, tokens))

    assert pick(system_b + [7] * CHUNK) == "node-2" and score("node-2", system_b + [7] * CHUNK) == 3
    assert pick(system_a + [9] * 5) == "node-1"
    assert score("node-1", system_b) == 0


def _drain(sub, quiet: float = 1.0) -> list[tuple[bytes, bytes, bytes]]:
    """Every frame until none came for `quiet` seconds."""
    frames, poller = [], zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    while poller.poll(int(quiet * 1000)):
        frames.append(tuple(sub.recv_multipart()))
    return frames


def test_pod_topics_are_bound_to_their_caller_capped_under_concurrency_and_fan_out_is_bounded(sidecar_factory,
                                                                                                tmp_path):
    """Issue 27 #3: any client could name any pod (x-promptcache-pod): 300 made-up names made 268 topics (the cap
    of 256 raced), and one new chunk was published 269 times. Now a pod name is bound to the first caller naming
    it (its tenant), a caller binds at most MAX_PODS_PER_CLIENT names, the checks hold under concurrency, and a
    chunk goes out at most 1 + MAX_PODS times."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    import msgpack

    from promptcache.contract.wire import model_to_proto
    from promptcache.sidecar import kvevents
    from promptcache.v1 import kvcache_pb2 as pb
    from promptcache.v1 import kvcache_pb2_grpc as pb_grpc

    tokens_dir = tmp_path / "tokens"
    write_secret_dir(tokens_dir, {"alice": "alice-token", "mallory": "mallory-token"})
    sidecar = sidecar_factory(kv_events_address="tcp://127.0.0.1:*", kv_events_id="node-1",
                              token_file=str(tokens_dir), tenancy="shared")
    sub = _subscribe(sidecar.events.address)
    prompt = list(range(100, 100 + CHUNK))
    request = pb.LookupRequest(model=model_to_proto(SMALL), tokens=prompt)
    with PromptCacheClient(sidecar.address, timeout=10, token="alice-token") as alice:
        assert alice.put(SMALL, prompt, make_kv(SMALL, len(prompt))).stored_chunks == 1
        with grpc.insecure_channel(sidecar.address) as channel:
            stub = pb_grpc.KVCacheStub(channel)

            def lookup(token: str, pod: str):
                stub.Lookup(request, metadata=[("authorization", f"Bearer {token}"), ("x-promptcache-pod", pod)],
                            timeout=10)

            lookup("alice-token", "pod-a")  # the real pod, first
            names = ["pod-a"] + [f"made-up-{i}" for i in range(300)]
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda name: lookup("mallory-token", name), names))
            _drain(sub)
            fresh = list(range(900, 900 + CHUNK))
            assert alice.put(SMALL, fresh, make_kv(SMALL, len(fresh), seed=2)).stored_chunks == 1
            frames = _drain(sub)
    sub.close()
    model_topics = {t for t in (f.decode() for f, _, _ in frames)}
    published = sum(1 for t, _, payload in frames for e in msgpack.unpackb(payload)[1]
                    if e["type"] == "BlockStored" and e["token_ids"] == fresh)
    most = 2 + getattr(kvevents, "MAX_PODS_PER_CLIENT", 4)
    assert published == len(model_topics) <= most, (published, len(model_topics))
    assert f"kv@pod-a@{SMALL.model_id}" in model_topics and f"kv@node-1@{SMALL.model_id}" in model_topics
    held = {p for pods in sidecar.events._pods.values() for p in pods}
    assert len(held) <= 1 + kvevents.MAX_PODS_PER_CLIENT, len(held)
    assert sidecar.events._bound["pod-a"] == "tenant:alice"


def test_the_pod_cap_holds_under_concurrent_callers():
    """MAX_PODS per model holds when many callers name pods at once (the check and the insert are one step)."""
    import threading

    from promptcache.sidecar import kvevents
    from promptcache.sidecar.identity import Caller, Identity

    events = kvevents.KVEvents("tcp://127.0.0.1:*", "node", CHUNK, "CPU").start()
    try:
        events.stored(b"k" * 32, None, "m", range(CHUNK))  # pods get topics of models with chunks here
        barrier = threading.Barrier(32)

        def caller(n: int):
            who = Caller(Identity(f"tenant-{n}", "token"), f"ipv4:10.0.0.{n}:1234")
            barrier.wait()
            for i in range(kvevents.MAX_PODS_PER_CLIENT):
                events.seen(f"pod-{n}-{i}", "m", who)

        threads = [threading.Thread(target=caller, args=(n,)) for n in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        deadline = time.monotonic() + 5
        while events._joining and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(events._pods["m"]) == kvevents.MAX_PODS
        # A name is bound to its first caller: another cannot take it, the same one can use it again.
        # Which callers won the race is up to the scheduler: take any bound name and the tenant that named it.
        bound = sorted(events._bound)[0]
        owner = int(bound.split("-")[1])
        first = Caller(Identity(f"tenant-{owner}", "token"), f"ipv4:10.0.0.{owner}:1")
        other = Caller(Identity(f"tenant-{(owner + 1) % 32}", "token"), f"ipv4:10.0.0.{(owner + 1) % 32}:1")
        assert events._bound[bound] == kvevents.binder_of(first)
        assert events.seen(bound, "m2", first) and not events.seen(bound, "m3", other)
        # Without authentication a caller is its host: a new connection (port) is the same caller.
        anon = [Caller(Identity("", "none"), f"ipv4:10.9.9.9:{port}") for port in range(10)]
        assert len({kvevents.binder_of(c) for c in anon}) == 1
    finally:
        events.close()


def test_token_ids_kept_for_events_are_counted_in_the_memory_budget(sidecar_factory):
    """Issue 27 #5: with KV events on, every chunk's token ids were kept as a list of Python ints outside the
    budget (about 10.5 KB a chunk of 256 tokens, more than an 8 KiB chunk). Now they are kept as uint32 and
    counted with each chunk in --memory-bytes: the tier holds fewer chunks, never more than the budget with
    what events keep; what is counted covers what is measured (tracemalloc)."""
    import tracemalloc

    from promptcache.contract.layout import chunk_nbytes
    from promptcache.sidecar import kvevents

    chunk_bytes = chunk_nbytes(SMALL, CHUNK)
    budget = 64 * chunk_bytes
    plain = sidecar_factory(memory_bytes=budget)
    evented = sidecar_factory(memory_bytes=budget, kv_events_address="tcp://127.0.0.1:*")
    per_chunk = kvevents.held_bytes_per_chunk(CHUNK)
    prompts = [list(range(p * 10_000, p * 10_000 + 4 * CHUNK)) for p in range(40)]  # 160 chunks > 64
    for sidecar in (plain, evented):
        with PromptCacheClient(sidecar.address, timeout=10) as c:
            for p, tokens in enumerate(prompts):
                c.put(SMALL, tokens, make_kv(SMALL, len(tokens), seed=p))
    used_plain, used_evented = plain.tier.usage(), evented.tier.usage()
    assert used_plain["entries"] == 64 and used_plain["used"] == 64 * chunk_bytes
    assert used_evented["used"] == used_evented["entries"] * (chunk_bytes + per_chunk) <= budget
    assert used_evented["entries"] == budget // (chunk_bytes + per_chunk) < 64
    assert len(evented.events._held) == used_evented["entries"]
    # What events keep a chunk is within what is counted for it (256-token chunks as in the issue).
    events = kvevents.KVEvents("tcp://127.0.0.1:*", "node", 256, "CPU", queue_events=1)
    try:
        keys = [bytes([i % 256, i // 256]) * 16 for i in range(5000)]
        tokens = [list(range(i, i + 256)) for i in range(5000)]
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        for i, key in enumerate(keys):
            events.stored(key, keys[i - 1] if i else None, "m", tokens[i])
        grown = sum(d.size_diff for d in tracemalloc.take_snapshot().compare_to(before, "filename"))
        tracemalloc.stop()
    finally:
        events._stop.set()
        events._socket.close(0)
        events._zmq.term()
    assert grown / 5000 <= kvevents.held_bytes_per_chunk(256), grown / 5000


class _Counts:
    """promptcache_kv_events_total as KVEvents uses it (counter.labels(type).inc())."""

    def __init__(self):
        import collections
        import threading

        self.by_type = collections.Counter()
        self._lock = threading.Lock()

    def labels(self, kind):
        counts = self

        class _One:
            def inc(self, n=1):
                with counts._lock:
                    counts.by_type[kind] += n

        return _One()


class _Entry:
    def __init__(self, key: bytes):
        self.key = key


def _wait(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert predicate()


def test_lookups_of_made_up_models_register_nothing_for_events(sidecar_factory):
    """Audit: every Lookup's model was kept (engine._event_models, one per fingerprint, and KVEvents._pods, one
    per model a pod named, even refused), never freed: 40k Lookups of made-up models grew the sidecar by 39 MiB
    with events on (16 without). Now a model is registered for events only when a chunk of it is stored."""
    import grpc

    from promptcache.v1 import kvcache_pb2 as pb
    from promptcache.v1 import kvcache_pb2_grpc as pb_grpc

    sidecar = sidecar_factory(kv_events_address="tcp://127.0.0.1:*", kv_events_id="node-1")
    tokens = list(range(CHUNK))
    with grpc.insecure_channel(sidecar.address) as channel:
        stub = pb_grpc.KVCacheStub(channel)
        for i in range(300):
            model = pb.Model(model_id=f"made-up-{i}", revision="r", kv_dtype=pb.DTYPE_FLOAT32, num_layers=2,
                             num_kv_heads=2, head_dim=8)
            stub.Lookup(pb.LookupRequest(model=model, tokens=tokens), timeout=10,
                        metadata=[("x-promptcache-pod", "pod-x")] if i % 2 else [])
    events = sidecar.events
    assert not getattr(sidecar.engine, "_event_models", {})
    assert not events._pods and not events._models and not events._joining
    assert events._bound == {"pod-x": "peer:ipv4:127.0.0.1"}  # the name is bound all the same
    # Once the model has a chunk here, the pod's next call gives it its topic (with what is held).
    with PromptCacheClient(sidecar.address, timeout=10) as c:
        assert c.put(SMALL, tokens, make_kv(SMALL, CHUNK)).stored_chunks == 1
    from promptcache.contract.wire import model_to_proto

    with grpc.insecure_channel(sidecar.address) as channel:
        pb_grpc.KVCacheStub(channel).Lookup(pb.LookupRequest(model=model_to_proto(SMALL), tokens=tokens),
                                            metadata=[("x-promptcache-pod", "pod-x")], timeout=10)
    _wait(lambda: events._pods.get(SMALL.model_id) == {"pod-x"})
    assert set(events._models) == {SMALL.model_id}


def test_models_and_topics_are_bounded_and_a_forgotten_topic_starts_over(caplog):
    """Audit: a model, its pod topics and their sequence numbers were kept for ever, and one pod name could have a
    topic per model. Now at most MAX_MODELS models are registered (one more is refused, counted and logged while
    every place holds chunks), pod topics are at most MAX_POD_TOPICS in all, and a model whose chunks all left
    gives its place to a new one: its topics and sequences go, and used again a topic starts over (sequence 0,
    AllBlocksCleared) - after every block it had announced was announced removed, so a router loses nothing."""
    import logging

    import msgpack

    from promptcache.sidecar import kvevents
    from promptcache.sidecar.identity import Caller, Identity

    counts = _Counts()
    events = kvevents.KVEvents("tcp://127.0.0.1:*", "node", CHUNK, "CPU", counter=counts).start()
    sub = _subscribe(events.address)
    try:
        key = {m: bytes([m]) * 32 for m in range(kvevents.MAX_MODELS + 1)}
        for m in range(kvevents.MAX_MODELS):
            events.stored(key[m], None, f"m{m}", range(CHUNK))
        pods = [Caller(Identity(f"tenant-{n}", "token"), f"ipv4:10.0.0.{n}:1") for n in range(100)]
        joined = sum(events.seen(f"pod-{n}-{i}", f"m{(n * 4 + i) % kvevents.MAX_MODELS}", who)
                     for n, who in enumerate(pods) for i in range(kvevents.MAX_PODS_PER_CLIENT))
        _wait(lambda: not events._joining)
        assert sum(map(len, events._pods.values())) == joined == kvevents.MAX_POD_TOPICS
        with caplog.at_level(logging.WARNING, logger="promptcache.sidecar.kvevents"):
            events.stored(key[kvevents.MAX_MODELS], None, "one-too-many", range(CHUNK))
        assert "one-too-many" not in events._models and key[kvevents.MAX_MODELS] not in events._held
        assert counts.by_type["model_refused"] == 1 and "'one-too-many' is not announced" in caplog.text
        # m0's chunk leaves: m0 keeps its place (and its topics) until a new model needs it.
        m0_pods = set(events._pods["m0"])
        assert m0_pods
        events.removed(_Entry(key[0]))
        events.stored(key[kvevents.MAX_MODELS], None, "newcomer", range(CHUNK))
        assert "newcomer" in events._models and "m0" not in events._models
        _wait(lambda: "m0" not in events._pods)
        topics = {kvevents.topic(p, "m0") for p in ("node", *m0_pods)}
        _wait(lambda: not topics & set(events._sequence))
        assert len(events._sequence) <= kvevents.MAX_MODELS + kvevents.MAX_POD_TOPICS
        assert len(events._models) == kvevents.MAX_MODELS
        # m0 back (m1 gives its place): its node topic starts over.
        events.removed(_Entry(key[1]))
        events.stored(key[0], None, "m0", range(CHUNK))
        frames = _drain(sub)
    finally:
        sub.close()
        events.close()
    m0 = [(int.from_bytes(seq, "big"), [e["type"] for e in msgpack.unpackb(payload)[1]])
          for t, seq, payload in frames if t == b"kv@node@m0"]
    assert m0[0] == (0, ["AllBlocksCleared", "BlockStored"]), m0  # the first time
    assert m0[1] == (1, ["BlockRemoved"]), m0
    assert m0[-1] == (0, ["AllBlocksCleared", "BlockStored"]), m0  # forgotten, used again: a new topic
    for model_topic in {t for t, _, _ in frames}:
        seqs = [int.from_bytes(s, "big") for t, s, _ in frames if t == model_topic]
        assert all(b in (a + 1, 0) for a, b in zip(seqs, seqs[1:])), (model_topic, seqs)


def test_a_subscriber_that_never_reads_holds_a_bounded_amount():
    """Audit: with SNDHWM 100,000 messages of up to 1024 events each, a subscriber that connects and never reads
    made the sidecar keep every event (+88 MiB for 48k chunks, nothing dropped, outside the memory budget). Now
    messages hold at most MAX_BATCH_BYTES of events and the socket queues SNDHWM of them per subscriber; what
    goes past is counted (subscriber_full) and lost to that subscriber only: one that reads gets everything."""
    import threading

    import msgpack

    from promptcache.sidecar import kvevents

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    assert kvevents.SNDHWM * kvevents.MAX_BATCH_BYTES <= 4 << 20
    counts = _Counts()
    events = kvevents.KVEvents("tcp://127.0.0.1:*", "node", 256, "CPU", counter=counts).start()
    ctx = zmq.Context()
    stalled = ctx.socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.RCVBUF, 4096)
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    stalled.connect(events.address)
    tokens = list(range(256))
    keys = iter(range(10**9))

    def publish(n: int) -> None:
        for _ in range(n):
            key = next(keys).to_bytes(32, "big")
            events.stored(key, None, "m", tokens)
            events.removed(_Entry(key))
        _wait(lambda: events._queue.empty(), 30)

    reader = stop = thread = None
    try:
        time.sleep(0.3)
        publish(2000)  # warm up the allocator and the socket's buffers
        time.sleep(0.5)
        before = rss()
        for _ in range(30):  # 30,000 BlockStored of 256 tokens: about 40 MB of events
            publish(1000)
        time.sleep(1.0)
        grown = rss() - before
        assert counts.by_type["dropped"] == 0 and counts.by_type["subscriber_full"] > 0, counts.by_type
        assert grown < 16 << 20, f"the process grew {grown >> 20} MiB for a subscriber that never reads"
        # A subscriber that reads (in this process: what its receive queue holds would count above) loses nothing
        # while the stalled one is still there.
        reader = _subscribe(events.address)
        received = {"stored": 0, "largest": 0}
        stop = threading.Event()

        def read():
            poller = zmq.Poller()
            poller.register(reader, zmq.POLLIN)
            while not stop.is_set():
                if poller.poll(100):
                    _, _, payload = reader.recv_multipart()
                    received["largest"] = max(received["largest"], len(payload))
                    received["stored"] += sum(1 for e in msgpack.unpackb(payload)[1] if e["type"] == "BlockStored")

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        for _ in range(5):
            publish(1000)
        _wait(lambda: received["stored"] == 5000, 10)
        assert 0 < received["largest"] <= kvevents.MAX_BATCH_BYTES + 64
    finally:
        if stop is not None:
            stop.set()
            thread.join(2)
            reader.close(0)
        stalled.close(0)
        ctx.term()
        events.close()
