"""The cluster tier's trust model, audited (docs/cluster.md, docs/security.md "The cluster tier"): a record read
from the cluster is served only for the key it was published under (a record copied or misfiled under another key
is refused, reason "key"), and a header changed after publishing (times, key, fingerprint, parent, index) fails
the header's own checksum. Records of the previous version (PCC2, no key) are still read during a rolling upgrade.
What is not defended (a writer that forges a whole record) is documented, not tested: nothing is authenticated."""
from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from promptcache.sidecar.cluster import (_HEADER, MAGIC, ClusterMetrics, ClusterTier, decode_record, encode_record,
                                         store_key, verify)
from promptcache.sidecar.store import checksum
from promptcache.sidecar.tiers import Record
from promptcache.sidecar.tiers.base import ChunkLayout
from test_cluster import master  # noqa: F401 - the fixture: a real Mooncake master

FP = b"f" * 32
KEY_A, KEY_B = b"a" * 32, b"b" * 32
LAYOUT = ChunkLayout(1, (2, 2, 2, 4, 1), 128, "float32")


def _record(key: bytes = KEY_A, seed: int = 0, index: int = 0, parent: bytes = bytes(32)) -> Record:
    payload = (np.arange(32, dtype=np.float32) + seed).view(np.uint8)
    return Record(key, FP, parent, index, 1, (2, 2, 2, 4, 1), checksum(payload), payload, ttl=100.0, age=0.0)


class DictStore:
    """A ClusterStore in a dict: what any process that reaches the store can read and write."""

    def __init__(self):
        self.d: dict[str, bytes] = {}

    def put(self, key, value):
        self.d.setdefault(key, bytes(value))

    def upsert(self, key, value):
        self.d[key] = bytes(value)

    def get(self, key):
        return self.d.get(key)

    def close(self):
        pass


@pytest.fixture
def tier():
    registry = CollectorRegistry()
    store = DictStore()
    t = ClusterTier(lambda: store, ClusterMetrics(registry), timeout_seconds=5, retry_seconds=30, queue_chunks=4,
                    max_record_bytes=1 << 20, clock=lambda: 950.0).start()
    assert t.wait_joined(5)
    yield t, store, registry.get_sample_value
    t.close()


def test_a_record_copied_under_another_key_is_not_served_for_it(tier):
    t, store, sample = tier
    store.put(store_key(KEY_A), encode_record(_record(KEY_A), now=900.0))
    assert t.fetch(KEY_A, FP, layout=LAYOUT) is not None  # control: served under its own key
    store.put(store_key(KEY_B), store.get(store_key(KEY_A)))  # the same bytes under another prefix's key
    assert t.fetch(KEY_B, FP, layout=LAYOUT) is None
    assert t.fetch(KEY_B, FP) is None  # (warm-up: no layout) neither
    assert sample("promptcache_cluster_rejected_total", {"reason": "key"}) == 2
    assert verify(decode_record(store.get(store_key(KEY_B)), KEY_B, 950.0), FP, LAYOUT, KEY_B) == "key"


def test_a_header_changed_after_publishing_is_refused():
    raw = encode_record(_record(KEY_A, index=3, parent=b"p" * 32), now=900.0)
    assert verify(decode_record(raw, KEY_A, 950.0), FP, LAYOUT, KEY_A) == ""
    # every header field the payload's checksum does not cover: expires, born, key, fingerprint, parent, index
    for offset in (4, 12, 20, 52, 84, 116):
        forged = bytearray(raw)
        forged[offset] ^= 1
        assert decode_record(bytes(forged), KEY_A, 950.0) is None, offset
        assert verify(decode_record(bytes(forged), KEY_A, 950.0), FP, LAYOUT, KEY_A) == "malformed", offset


def test_a_header_announcing_too_many_dims_is_refused_unread():
    v2 = _HEADER.pack(MAGIC, 1000.0, 900.0, FP, bytes(32), 0, 1, 255, 0) + b"\0" * (4 * 255)
    assert decode_record(v2, KEY_A, 950.0) is None


def test_version_2_records_are_still_read_during_a_rolling_upgrade():
    rec = _record(KEY_A, seed=1)
    v2 = (_HEADER.pack(MAGIC, 1000.0, 900.0, FP, rec.parent, 0, 1, 5, rec.checksum)
          + struct.pack("<5I", *rec.shape) + rec.payload.tobytes())
    got = decode_record(v2, KEY_A, 950.0)
    assert verify(got, FP, LAYOUT, KEY_A) == "" and got.key == KEY_A
    assert bytes(got.payload) == rec.payload.tobytes()


def test_a_published_record_round_trips_with_its_key():
    rec = dataclasses.replace(_record(KEY_A, seed=2, index=1, parent=b"p" * 32))
    got = decode_record(encode_record(rec, now=900.0), KEY_A, 950.0)
    assert (got.key, got.parent, got.index, got.shape) == (KEY_A, b"p" * 32, 1, rec.shape)
    assert (got.ttl, got.age) == (50.0, 50.0) and bytes(got.payload) == rec.payload.tobytes()


def test_forged_hot_lists_in_every_slot_make_a_warming_node_fetch_a_bounded_number_of_chunks():
    """16 full slots were 262,144 entries, each a cluster call at warm-up (28 s of calls on a real master here,
    most after readiness): the merge a warming node follows is bounded by one list's size."""
    from promptcache.sidecar import hotlist

    lists = [[hotlist.HotEntry(bytes([s]) + i.to_bytes(31, "big"), FP, "", 8) for i in range(hotlist.MAX_ENTRIES)]
             for s in range(hotlist.HOT_SLOTS)]
    merged = hotlist.merge(lists)
    assert len(merged) == hotlist.MAX_MERGED == hotlist.MAX_ENTRIES
    assert merged[:hotlist.HOT_SLOTS] == [x[0] for x in lists]  # still rank by rank: every slot's hottest first
    assert len(hotlist.merge(lists, limit=3)) == 3


@pytest.mark.slow  # a sidecar process and a Mooncake master: about 10 s here
def test_a_sidecar_does_not_serve_a_record_copied_from_another_prompts_key(tmp_path, master):
    """The defect as a real sidecar showed it: prompt A's published record, copied verbatim under prompt B's key,
    was served for B (A's K/V); now it is refused, counted, and B is a miss."""
    import signal

    from promptcache.client import PromptCacheClient
    from promptcache.contract import keys as keyspec
    from promptcache.sidecar.cluster import MooncakeStore
    from promptcache_devtools.procs import wait_until
    from support import CHUNK, SMALL, make_kv, metric
    from test_cluster import _plain_node, _tokens

    address = master[1]
    b = _plain_node(tmp_path, "b", address)
    writer = MooncakeStore(address, "127.0.0.1", "tcp", 16 << 20, 8 << 20)
    client = PromptCacheClient(b.address, retries=0, timeout=30)
    try:
        wait_until(lambda: metric(b, "promptcache_cluster_up") == 1, "B joining the cluster", 30)
        fp = keyspec.fingerprint(SMALL)
        prompt_a, prompt_b = _tokens(201, 1), _tokens(202, 1)
        assert client.put(SMALL, prompt_a, make_kv(SMALL, CHUNK, seed=1)).stored_chunks == 1
        wait_until(lambda: metric(b, "promptcache_cluster_published_chunks_total") == 1, "B publishing", 30)
        key_a, key_b = (keyspec.chunk_keys(fp, t, CHUNK)[0] for t in (prompt_a, prompt_b))
        writer.put(store_key(key_b), writer.get(store_key(key_a)))
        assert client.lookup(SMALL, prompt_b).cached_tokens == 0
        cached, got = client.get(SMALL, prompt_b)
        assert cached == 0 and not got
        assert metric(b, 'promptcache_cluster_rejected_total{reason="key"}') >= 1
        assert client.get(SMALL, prompt_a)[0] == CHUNK  # control
    finally:
        client.close()
        writer.close()
        if b.proc.poll() is None:
            b.proc.send_signal(signal.SIGKILL)
            b.proc.wait()


@pytest.mark.slow  # a sidecar process and a master: about 10 s here
def test_warm_up_stops_asking_the_cluster_after_a_long_run_of_hot_listed_chunks_it_does_not_hold(tmp_path, master):
    """A hot list (forged, or of chunks long gone) naming 1,100 chunks the cluster does not hold, then one it does:
    warm-up gives up after 1,024 misses in a row (warmup.MAX_CLUSTER_MISSES_IN_A_ROW) instead of asking for every
    entry of every list, so the good chunk after them is not warmed either."""
    import signal
    import time

    import numpy as np

    from promptcache.contract import keys as keyspec
    from promptcache.contract.layout import chunk_nbytes, chunk_shape
    from promptcache.sidecar import hotlist
    from promptcache.sidecar.cluster import MooncakeStore
    from promptcache.sidecar.warmup import MAX_CLUSTER_MISSES_IN_A_ROW
    from support import CHUNK, SMALL, metric
    from test_cluster import _plain_node, _tokens, _write_forged

    writer = MooncakeStore(master[1], "127.0.0.1", "tcp", 16 << 20, 8 << 20)
    c = None
    try:
        fp, shape, n = keyspec.fingerprint(SMALL), chunk_shape(SMALL, CHUNK), chunk_nbytes(SMALL, CHUNK)
        item = np.dtype(SMALL.kv_dtype)
        good = np.random.default_rng(1).standard_normal(n // item.itemsize).astype(item).tobytes()
        good_key = keyspec.chunk_keys(fp, _tokens(300, 1), CHUNK)[0]
        _write_forged(writer, fp, good_key, good, 2 if SMALL.kv_dtype == "float16" else 1, shape, time.time() + 3600)
        missing = [hotlist.HotEntry(keyspec.chunk_keys(fp, _tokens(400 + i, 1), CHUNK)[0], fp, "", 8)
                   for i in range(MAX_CLUSTER_MISSES_IN_A_ROW + 76)]
        writer.upsert(hotlist.slot_key(5), hotlist.encode([*missing, hotlist.HotEntry(good_key, fp, "", 8)],
                                                          time.time()))
        c = _plain_node(tmp_path, "c", master[1], "--warmup-seconds", "60")
        assert metric(c, 'promptcache_warmup_chunks_total{source="cluster"}') == 0
        assert metric(c, 'promptcache_entries{tier="device"}') == 0
    finally:
        writer.close()
        if c is not None and c.proc.poll() is None:
            c.proc.send_signal(signal.SIGKILL)
            c.proc.wait()
