"""KV events for prefix-aware routers: what this node's memory tier holds, announced in vLLM's own KV event format
(vllm/distributed/kv_events.py), so a router that consumes vLLM's events (llm-d's precise prefix-cache scorer,
Dynamo's indexer) can consume ours (docs/cluster.md).

Wire format, as vLLM's ZmqEventPublisher: a ZMQ PUB socket; each message is multipart
`[topic, 8-byte big-endian sequence number, msgpack EventBatch]`, topic `kv@<id>@<model>`, one sequence per topic
from 0. EventBatch is msgspec's array_like encoding `[ts, [event, ...], data_parallel_rank (nil)]`; each event a
msgspec tagged struct, i.e. a map `{"type": "BlockStored", field: value, ...}` with its required fields always
present and defaulted ones omitted. A block is one chunk: block_hashes are our chunk keys as vLLM sends its own by
default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): the key's low 64 bits, big-endian, as an unsigned int (Dynamo's
indexer rejects 32-byte hashes); block_size is --chunk-tokens, token_ids the chunk's tokens; medium "CPU" (host
memory) or "GPU" (a CUDA memory tier).

What is announced: chunks entering the memory tier (Put, or a promotion from disk or the cluster) in the shared
namespace (no tenancy) or a sharing group open to every tenant (GROUP=*); a chunk leaving the memory tier
(evicted, deleted, purged, demoted to disk) is announced removed. An isolated tenant's chunks (and a restricted
group's) are never announced: their token ids are that tenant's prompt. The first event on a topic is
AllBlocksCleared, so a subscriber forgets what an earlier run of this sidecar announced.

Routers score pods, not nodes. Every event goes out under the node's id (`--kv-events-id`, topic kv@NODE@MODEL)
and under the id of every inference pod that has used that model on this sidecar: a client names its pod in the
gRPC metadata `x-promptcache-pod` (the vLLM connector and the HF client send POD_NAME). A pod first seen for a
model gets, on its own topic, AllBlocksCleared and then BlockStored for every chunk of that model the memory tier
holds, so its view starts complete; from then on it gets the live events. A pod name is bound to the first caller
that names it (its tenant when authenticated, its host otherwise) until restart: another caller naming it is refused
(`seen`). At most MAX_PODS pods per model (the fan-out: each is one more copy of every event),
MAX_POD_TOPICS pod topics in all and MAX_PODS_PER_CLIENT names per caller; docs/cluster.md, "Trusting a topic".
A pod name must be a host or Kubernetes object name (POD_NAME: letters, digits, '.', '_' and '-', at most 253):
'@' separates the topic's parts, so a pod named `victim@MODEL` would have topic kv@victim@MODEL@..., which a
subscriber to kv@victim@MODEL receives too (ZMQ matches topics by prefix) and which parsers that split on '@' take
for pod `victim`: the pod-name binding would protect nothing. For the same reason a model whose name holds '@' or
a control character is not announced (counted as model_refused, logged once): kv@NODE@llama@x would reach the
subscribers of model `llama`, its first message an AllBlocksCleared.

Per-model state is bounded: a model is registered for events only when a chunk of it enters the memory tier (a
Lookup naming a model registers nothing; a pod naming a model with no chunk here binds its name and joins on a
later call), and at most MAX_MODELS models are registered. A model whose chunks have all left stays registered
(its topics and their sequences go on) until a new model needs its place; then it is forgotten with its pod
topics and their sequence numbers, once the events queued before are sent. A forgotten topic used again starts
over as a new one: sequence 0, AllBlocksCleared first (the subscriber had been told every chunk of it was
removed, so clearing loses nothing; a vLLM subscriber takes a sequence that goes back as a new start, one that
skips as lost messages). With every place taken by a model holding chunks, a new model is not announced
(counted as model_refused, logged once per name).

Events are queued (bounded, never blocking the caller, which may hold the memory tier's lock) and sent in
batches by one thread, the only one touching the socket. What the socket may hold for a subscriber that does not
read is bounded in bytes: messages of at most MAX_BATCH_BYTES of events (one larger event goes alone), at most
SNDHWM of them per subscriber. The socket is an XPUB, which a SUB subscribes to like a PUB, with XPUB_NODROP:
a send that would go past a subscriber's SNDHWM fails instead of being dropped silently, is counted
(subscriber_full) and sent again lossy, so the subscriber that is behind loses it (it sees the gap in the topic's
sequence) and the others get it. libzmq then sets that subscriber aside and drops what follows for it without a
word until it has read some of its queue: the count is of times a subscriber's queue filled, not of messages lost.
"""
from __future__ import annotations

import array
import collections
import logging
import queue
import re
import threading
import time

import msgpack

log = logging.getLogger("promptcache.sidecar.kvevents")

BATCH_SECONDS = 0.02
MAX_BATCH = 1024  # queued items taken per round
MAX_BATCH_BYTES = 64 * 1024  # events (encoded) in one message: one larger event goes alone
SNDHWM = 32  # messages the socket queues for one subscriber: 2 MiB with MAX_BATCH_BYTES (docs/cluster.md)
MAX_MODELS = 64  # models registered for events (a node serves a few; each has a topic and pod topics)
MAX_POD_TOPICS = 256  # pod topics in all models (each one more copy of every event of its model)
MAX_PODS = 32  # per model: a node runs a few inference pods; each is one more copy of every event (fan-out)
MAX_PODS_PER_CLIENT = 4  # pod names one caller (tenant, or peer host without auth) may bind
# Pod names bound at once, of all callers (about 500 B each with a 253-byte name: 2 MiB). Callers are not bounded
# (hosts without auth: the addresses of an IPv6 /64), so without it 50,000 hosts naming 4 pods each held 91 MiB.
# When full, the least recently used name that has no topic (not a model's pod, not joining) is forgotten;
# a name with a topic is never displaced (at most MAX_POD_TOPICS of them), and a pod that calls stays recent.
MAX_BOUND_PODS = 4096
# A pod name (x-promptcache-pod): a Kubernetes object or host name; no '@' (the topic's separator), blank or control
POD_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9])?")
# What a model name announced may not hold: the topic's separator, or a character that ends or garbles a line
_MODEL_UNSAFE = re.compile("[@\x00-\x1f\x7f-\x9f\u2028\u2029]")
HELD_OVERHEAD_BYTES = 256  # per chunk held, besides 4 bytes a token (measured 173-205: dict slot, tuple, array)


def held_bytes_per_chunk(chunk_tokens: int) -> int:
    """What KVEvents keeps per chunk of the memory tier (its token ids as uint32, the key and parent): counted
    in the memory budget with each chunk (MemoryTier entry_overhead) while events are on."""
    return HELD_OVERHEAD_BYTES + 4 * chunk_tokens


def binder_of(caller) -> str:
    """Who a pod name is bound to: the authenticated tenant, else the caller's host (its peer address without
    the port: a new connection from the same host is the same caller)."""
    if caller is None:
        return ""
    if not caller.identity.anonymous:
        return f"tenant:{caller.identity.tenant}"
    peer = caller.peer or ""
    if peer.startswith(("ipv4:", "ipv6:")):
        peer = peer.rsplit(":", 1)[0]
    return f"peer:{peer}"


def wire_hash(key: bytes) -> int:
    """vllm.v1.core.kv_cache_utils.maybe_convert_block_hash with int block hashes (vLLM's default)."""
    return int.from_bytes(key, "big") & ((1 << 64) - 1)


def block_stored(block_hashes: list[bytes | int], parent: bytes | int | None, token_ids: list[int], block_size: int,
                 medium: str) -> dict:
    return {"type": "BlockStored", "block_hashes": block_hashes, "parent_block_hash": parent,
            "token_ids": token_ids, "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": None}


def block_removed(block_hashes: list[bytes | int], medium: str) -> dict:
    return {"type": "BlockRemoved", "block_hashes": block_hashes, "medium": medium}


def all_blocks_cleared() -> dict:
    return {"type": "AllBlocksCleared"}


def _stored(key: bytes, parent: bytes | None, token_ids: list[int], block_size: int, medium: str) -> dict:
    return block_stored([wire_hash(key)], None if parent is None else wire_hash(parent), token_ids, block_size, medium)


def _as_list(value):
    if isinstance(value, array.array):
        return value.tolist()
    raise TypeError(f"cannot encode {type(value).__name__} in a KV event")


def _pack(event: dict) -> bytes:
    """msgpack.packb(event), a held array of token ids written as the list of ints it holds (the same bytes)."""
    return msgpack.packb(event, use_bin_type=True, default=_as_list)


def encode_batch(ts: float, events: list[dict]) -> bytes:
    """msgspec's encoding of vllm.distributed.kv_events.KVEventBatch(ts, events): data_parallel_rank is written
    (nil) even though it is a default, as msgspec does for array_like structs."""
    return encode_packed(ts, [msgpack.packb(e, use_bin_type=True) for e in events])


def encode_packed(ts: float, packed: list[bytes]) -> bytes:
    """encode_batch of events already encoded one by one (msgpack.packb(event)): the same bytes as
    msgpack.packb([ts, events, None]), each event encoded once however many topics it goes to."""
    return b"".join((b"\x93", msgpack.packb(ts), msgpack.Packer().pack_array_header(len(packed)), *packed, b"\xc0"))


_CLEARED = msgpack.packb(all_blocks_cleared(), use_bin_type=True)
_FORGET = object()  # queued after a model's last events: its topics are forgotten once those are sent


def topic(publisher_id: str, model: str) -> str:
    return f"kv@{publisher_id}@{model}"


class KVEvents:
    def __init__(self, address: str, publisher_id: str, block_size: int, medium: str, counter=None,
                 queue_events: int = 65536):
        import zmq

        self._zmq_again, self._zmq_noblock = zmq.Again, zmq.NOBLOCK  # (the sender loop drains subscriptions)
        self.block_size = block_size
        self.medium = medium
        self.publisher_id = publisher_id
        self.counter = counter  # promptcache_kv_events_total{type}
        self._zmq = zmq.Context()
        self._socket = self._zmq.socket(zmq.XPUB)  # a PUB that says when a subscriber's queue is full
        self._socket.setsockopt(zmq.SNDHWM, SNDHWM)
        self._socket.setsockopt(zmq.XPUB_NODROP, 1)
        self._socket.setsockopt(zmq.LINGER, 0)
        if address.startswith("tcp://["):  # libzmq binds an IPv6 address only with ZMQ_IPV6 set ("No such device")
            self._socket.setsockopt(zmq.IPV6, 1)
        self._socket.bind(address)
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_events)
        # chunk key -> (model, parent, token ids as uint32): what BlockRemoved to send, and what a new pod is told
        self._held: dict[bytes, tuple[str, bytes | None, array.array]] = {}
        # model -> its chunks in _held: the models registered for events (at most MAX_MODELS), least recently
        # stored first; one with none is forgotten when a new model needs its place
        self._models: dict[str, int] = {}
        self._forget_later: set[str] = set()  # models to forget whose marker did not fit in the queue
        self._pods: dict[str, set[str]] = {}  # model -> pods that get its events (registered models only)
        self._joining: set[tuple[str, str]] = set()  # (model, pod) accepted, not yet told what is held
        # pod name -> the caller it is bound to (binder_of), least recently named first (MAX_BOUND_PODS)
        self._bound: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._bound_by: dict[str, set[str]] = {}  # binder -> the pod names it bound
        self._refused_logged: set[str] = set()
        self._lock = threading.Lock()
        self._sequence: dict[str, int] = {}  # topic -> its next sequence number (the topics of _pods' models)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def start(self) -> "KVEvents":
        self._thread.start()
        return self

    # --- called by the store (never blocks) ---------------------------------------------------------------
    def stored(self, key: bytes, parent: bytes | None, model: str, token_ids) -> None:
        held = array.array("I", token_ids)  # 4 bytes a token (a list of ints is 36): counted in the budget
        with self._lock:  # (queued under the lock, so a model's events and its forgetting keep their order)
            if key in self._held:
                return
            count = self._models.pop(model, None)
            if count is None and not self._register(model):
                return
            self._models[model] = (count or 0) + 1  # (last: the most recently stored)
            self._held[key] = (model, parent, held)
            # the held array itself is queued (a list of ints is up to 36 bytes a token, 65,536 queued events of
            # 256 tokens up to 600 MiB): packed as the same list by the sender (_pack)
            self._put(model, _stored(key, parent, held, self.block_size, self.medium))

    def _register(self, model: str) -> bool:
        """Under the lock: a place for a new model, taken from the least recently stored model that holds no
        chunk (forgotten once its queued events are sent); False (counted, logged once) when every place is
        taken by a model that holds chunks, or when its name cannot be a topic's part ('@', a control
        character)."""
        if _MODEL_UNSAFE.search(model):
            if self.counter is not None:
                self.counter.labels("model_refused").inc()
            if model not in self._refused_logged and len(self._refused_logged) < 1024:
                self._refused_logged.add(model)
                log.warning("KV events: model %r is not announced (its name holds '@', the topic's separator, or a "
                            "control character)", model[:128])
            return False
        if len(self._models) >= MAX_MODELS:
            idle = next((m for m, count in self._models.items() if count == 0), None)
            if idle is None:
                if self.counter is not None:
                    self.counter.labels("model_refused").inc()
                if model not in self._refused_logged and len(self._refused_logged) < 1024:
                    self._refused_logged.add(model)
                    log.warning("KV events: model %r is not announced (%d models hold chunks here, the most "
                                "announced at once)", model[:128], MAX_MODELS)
                return False
            del self._models[idle]
            if not self._put(idle, _FORGET):
                self._forget_later.add(idle)
        return True

    def inserted(self, entry) -> None:
        """The memory tier's insert hook: announced by the engine instead, which knows the chunk's tokens."""

    def removed(self, entry, reason: str = "", age: float = 0.0) -> None:
        """The memory tier's remove hook: whatever took the chunk away, routers must stop sending its prefix."""
        with self._lock:
            held = self._held.pop(entry.key, None)
            if held is None:
                return
            model = held[0]
            self._models[model] -= 1  # (0: kept, until a new model needs its place)
            self._put(model, block_removed([wire_hash(entry.key)], self.medium))

    def seen(self, pod: str, model: str, caller=None) -> bool:
        """A call from inference pod `pod` for `model` (by `caller`, a promptcache.sidecar.identity.Caller): from
        now on its topic gets this model's events. Whether it may (False: refused, counted, logged once):

        * the pod name is bound to the first caller that names it (its authenticated tenant, or its peer's host
          without auth) until the sidecar restarts: another caller naming it is refused, so nobody can take
          over a pod's topic once its pod has used it (of MAX_BOUND_PODS names bound at once, the least recently
          named one without a topic is forgotten to bind a new one);
        * one caller binds at most MAX_PODS_PER_CLIENT pod names, a model has at most MAX_PODS pod topics
          (each one more copy of every event) and all models MAX_POD_TOPICS; all checked and taken under the
          lock, so concurrent callers cannot pass them;
        * the name must be a pod's (POD_NAME): no '@', which would make its topic another pod's prefix.

        A model with no chunk announced here (not registered: stored() registers it) gets no topic yet: the
        name is bound, and the pod joins on a call after the model's first chunk is stored."""
        binder = binder_of(caller)
        if not POD_NAME.fullmatch(pod):
            with self._lock:
                return self._refuse(pod, "not a pod name: letters, digits, '.', '_' and '-', at most 253")
        with self._lock:
            pods = self._pods.get(model)
            if (pods is not None and pod in pods) or (model, pod) in self._joining:
                return True
            owner = self._bound.get(pod)
            if owner is None:
                if len(self._bound_by.get(binder, ())) >= MAX_PODS_PER_CLIENT:
                    return self._refuse(pod, f"{binder} already named {MAX_PODS_PER_CLIENT} pods")
                if len(self._bound) >= MAX_BOUND_PODS and not self._unbind_one():
                    return self._refuse(pod, f"{MAX_BOUND_PODS} pod names are bound, each with a topic")
            elif owner != binder:
                return self._refuse(pod, "the name is bound to another caller")
            else:
                self._bound.move_to_end(pod)
            if model in self._models:
                pods = self._pods.setdefault(model, set())
                if len(pods) + sum(1 for m, _ in self._joining if m == model) >= MAX_PODS:
                    return self._refuse(pod, f"model {model[:128]!r} has its maximum of {MAX_PODS} pod topics")
                if sum(map(len, self._pods.values())) + len(self._joining) >= MAX_POD_TOPICS:
                    return self._refuse(pod, f"{MAX_POD_TOPICS} pod topics exist, the most")
            if owner is None:
                self._bound[pod] = binder
                self._bound_by.setdefault(binder, set()).add(pod)
            if model in self._models:
                self._joining.add((model, pod))
                self._put(model, None, pod)  # the sender adds it, after telling it what is held
        return True

    def _unbind_one(self) -> bool:
        """Under the lock: forget the least recently named pod name that has no topic (False: every one has)."""
        with_topic = set().union(*self._pods.values(), (p for _, p in self._joining))
        victim = next((p for p in self._bound if p not in with_topic), None)
        if victim is None:
            return False
        binder = self._bound.pop(victim)
        names = self._bound_by[binder]
        names.discard(victim)
        if not names:
            del self._bound_by[binder]
        return True

    def _refuse(self, pod: str, why: str) -> bool:
        """Under the lock."""
        if self.counter is not None:
            self.counter.labels("pod_refused").inc()
        if pod not in self._refused_logged and len(self._refused_logged) < 1024:
            self._refused_logged.add(pod)
            log.warning("KV events: pod topic %r refused (%s)", pod[:64], why)
        return False

    def _put(self, model: str, event, pod: str = "") -> bool:
        try:
            self._queue.put_nowait((model, event, pod))
            return True
        except queue.Full:
            if self.counter is not None and event is not _FORGET:
                self.counter.labels("dropped").inc()
            return False

    # --- the sending thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_subscriptions()
            try:
                first = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            pending = [first]
            deadline = time.monotonic() + BATCH_SECONDS
            while len(pending) < MAX_BATCH and (left := deadline - time.monotonic()) > 0:
                try:
                    pending.append(self._queue.get(timeout=left))
                except queue.Empty:
                    break
            by_topic: dict[str, list[tuple[str, bytes]]] = {}
            for model, event, pod in pending:
                if event is None:
                    self._join(model, pod, by_topic)
                    continue
                if event is _FORGET:  # after what was queued before it is sent
                    self._flush(by_topic)
                    self._forget(model)
                    continue
                with self._lock:
                    pods = list(self._pods.get(model, ()))
                packed = (event["type"], _pack(event))  # once, for every topic
                for publisher in (self.publisher_id, *pods):
                    by_topic.setdefault(topic(publisher, model), []).append(packed)
            self._flush(by_topic)
            if self._forget_later:
                with self._lock:
                    later, self._forget_later = self._forget_later, set()
                for model in later:
                    self._forget(model)

    def _drain_subscriptions(self) -> None:
        """An XPUB passes (un)subscriptions up to be read: read and ignore them, so none pile up."""
        try:
            while True:
                self._socket.recv(self._zmq_noblock)
        except self._zmq_again:
            pass

    def _flush(self, by_topic: dict[str, list[tuple[str, bytes]]]) -> None:
        for t, events in by_topic.items():
            self._send(t, events)
        by_topic.clear()

    def _forget(self, model: str) -> None:
        """A model that gave up its place (_register): its pod topics and all its topics' sequences go, unless it
        was registered again meanwhile (then its topics simply go on)."""
        with self._lock:
            if model in self._models:
                return
            pods = self._pods.pop(model, set())
        for publisher in (self.publisher_id, *pods):
            self._sequence.pop(topic(publisher, model), None)

    def _join(self, model: str, pod: str, by_topic: dict[str, list[tuple[str, bytes]]]) -> None:
        """Tell a newly seen pod what the memory tier holds of `model`, then add it to the model's pods."""
        with self._lock:
            self._joining.discard((model, pod))
            if model not in self._models:  # forgotten meanwhile: the pod joins on a later call
                return
            held = [(key, parent, tokens) for key, (m, parent, tokens) in self._held.items() if m == model]
            self._pods.setdefault(model, set()).add(pod)
        events = by_topic.setdefault(topic(pod, model), [])
        for key, parent, tokens in held:
            event = _stored(key, parent, tokens, self.block_size, self.medium)
            events.append((event["type"], _pack(event)))

    def _send(self, t: str, events: list[tuple[str, bytes]]) -> None:
        """`events` (type, encoded) on topic `t`, in messages of at most MAX_BATCH_BYTES of events each."""
        seq = self._sequence.get(t)
        if seq is None:  # the first batch on this topic (since start, or since it was forgotten)
            events = [("AllBlocksCleared", _CLEARED), *events]
            seq = 0
        name = t.encode()
        begin = size = 0
        for end, (_, packed) in enumerate(events):
            if size and size + len(packed) > MAX_BATCH_BYTES:
                self._publish(name, seq, events[begin:end])
                seq += 1
                begin, size = end, 0
            size += len(packed)
        if begin < len(events):
            self._publish(name, seq, events[begin:])
            seq += 1
        self._sequence[t] = seq
        if self.counter is not None:
            for kind, _ in events:
                self.counter.labels(kind).inc()

    def _publish(self, name: bytes, seq: int, events: list[tuple[str, bytes]]) -> None:
        import zmq

        frames = (name, seq.to_bytes(8, "big"), encode_packed(time.time(), [packed for _, packed in events]))
        try:
            self._socket.send_multipart(frames, zmq.DONTWAIT)
        except zmq.Again:  # a subscriber has SNDHWM messages queued: it loses this one, the others get it
            if self.counter is not None:
                self.counter.labels("subscriber_full").inc()
            self._socket.setsockopt(zmq.XPUB_NODROP, 0)
            try:
                self._socket.send_multipart(frames, zmq.DONTWAIT)
            finally:
                self._socket.setsockopt(zmq.XPUB_NODROP, 1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._socket.close(0)
        self._zmq.term()
