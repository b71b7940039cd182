"""The fleet: one discovery of a cache's sidecars (its pods) and one scrape of each per tick, read by the status and
the autoscaler alike. The sidecar here is the real server (gRPC and /metrics on loopback, memory and disk tiers);
the API server is a stand-in that serves the pod and records what the operator writes (the real one is covered by
test_operator_apiserver.py and test_closed_loop.py)."""
from __future__ import annotations

import time
import urllib.request
from typing import Any

from promptcache.client import PromptCacheClient
from promptcache.contract.layout import chunk_nbytes
from promptcache.operator import autoscale, builders, fleet, tuning
from promptcache.operator.builders import Capabilities, OperatorDefaults, Owner
from promptcache.operator.reconcile import reconcile
from support import CHUNK, SMALL, make_kv

Mi = 1 << 20
CHUNK_BYTES = chunk_nbytes(SMALL, CHUNK)
OWNER = Owner("c", "ns", "uid-1")


def pod(name: str, node: str | None = "node-1", ip: str | None = "127.0.0.1", ready: bool = True,
        ports: dict[str, int] | None = None, limit: str | None = None, kubelet_limit: str | None = None) -> dict:
    container: dict[str, Any] = {"name": builders.CONTAINER, "image": "sidecar:test",
                                 "ports": [{"name": k, "containerPort": v} for k, v in (ports or {}).items()]}
    if limit:
        container["resources"] = {"limits": {"memory": limit}}
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    if kubelet_limit:
        status["containerStatuses"] = [{"name": builders.CONTAINER, "resources": {"limits": {"memory": kubelet_limit}}}]
    return {"metadata": {"name": name, "labels": builders.labels(OWNER)},
            "spec": {**({"nodeName": node} if node else {}), "containers": [container]}, "status": status}


class StandInApiServer:
    """The calls reconcile() and autoscale.tick() make, answered from memory; status patches are merged into the
    PromptCache's status as the API server would."""

    def __init__(self, pods: list[dict]):
        self.pods = pods
        self.status: dict[str, Any] = {}
        self.objects: dict[str, dict] = {}
        self.pod_lists = 0

    def capabilities(self, refresh: bool = False) -> Capabilities:
        return Capabilities()

    def apply(self, obj: dict) -> dict:
        self.objects[obj["kind"]] = obj
        if obj["kind"] == "DaemonSet":   # as the DaemonSet controller reports one node, rolled out
            return {**obj, "metadata": {**obj["metadata"], "generation": 1},
                    "status": {"observedGeneration": 1, "desiredNumberScheduled": 1, "currentNumberScheduled": 1,
                               "numberReady": 1, "updatedNumberScheduled": 1}}
        return obj

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        return self.objects.get(kind)

    def delete(self, *_: Any) -> bool:
        return False

    def priority_class_exists(self, name: str) -> bool:
        return True

    def patch_status(self, namespace: str, name: str, status: dict) -> dict:
        for k, v in status.items():
            if v is None:
                self.status.pop(k, None)
            else:
                self.status[k] = v
        return {}

    def request(self, method: str, path: str, body: Any = None, query: Any = None, **_: Any) -> Any:
        if method == "GET" and path == f"/api/v1/namespaces/{OWNER.namespace}/pods":
            assert dict(query)["labelSelector"] == ",".join(f"{k}={v}" for k, v in builders.selector(OWNER).items())
            self.pod_lists += 1
            return {"items": self.pods}
        if method == "POST" and path.endswith("/events"):
            return body
        raise AssertionError(f"unexpected {method} {path}")

    def body(self, spec: dict) -> dict:
        return {"metadata": {"name": OWNER.name, "namespace": OWNER.namespace, "uid": OWNER.uid, "generation": 1},
                "spec": spec, "status": dict(self.status)}


def disk_entries(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('promptcache_entries{tier="disk"}'))


def test_status_and_autoscaler_read_the_same_figures_from_one_scrape(sidecar_factory, tmp_path):
    """A sidecar with memory and disk hits: status.hitRatio and the autoscaler's hit ratio (recorded in
    status.autoscaling.lastDecision) are the same number, memory_hit_ratio, from one scrape; anyTierHitRatio counts
    the disk hits too. (Before the fleet, the status counted disk hits as hits and the autoscaler as misses.)"""
    sidecar = sidecar_factory(memory_bytes=2 * CHUNK_BYTES, disk_bytes=64 << 20, data_dir=str(tmp_path / "data"))
    api = StandInApiServer([pod("c-abcde", ports={"metrics": sidecar.metrics_port,
                                                  "grpc": int(sidecar.address.rsplit(":", 1)[1])})])
    now = [0.0]
    scrapes: list[str] = []

    def scrape(url: str, timeout: float) -> fleet.Counters | None:
        scrapes.append(url)
        return fleet.scrape(url, timeout)
    fl = fleet.Fleet(window_s=1.0, max_age_s=5.0, clock=lambda: now[0], scrape=scrape)
    spec = {"model": {"name": SMALL.model_id, "revision": "rev-1"}, "memory": {"host": str(2 * CHUNK_BYTES)},
            "autoscaling": {"enabled": True, "minMemory": str(2 * CHUNK_BYTES), "maxMemory": str(2 * CHUNK_BYTES)}}
    config = autoscale.Config(overhead_bytes=0, policy=tuning.Policy(grow_cooldown_s=0, shrink_cooldown_s=0))

    tokens = list(range(5 * CHUNK))
    with PromptCacheClient(sidecar.address, timeout=10) as c:
        assert c.put(SMALL, tokens, make_kv(SMALL, len(tokens), seed=3)).stored_chunks == 5
        deadline = time.monotonic() + 10   # 3 of the 5 chunks go to disk (memory holds 2)
        while disk_entries(sidecar.metrics_port) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        # The window's start: nothing looked up yet, so the autoscaler's window covers all the sidecar has counted.
        first = fl.observe(api, OWNER)
        assert first.counters["c-abcde"].tokens == fleet.Tokens()
        tiers = [ch.tier for ch in c.lookup(SMALL, tokens).chunks]
        assert sorted(tiers) == ["device"] * 2 + ["disk"] * 3
        assert c.lookup(SMALL, [10**6 + t for t in range(3 * CHUNK)]).cached_tokens == 0
    memory_hits, any_tier_hits, lookups = 2 * CHUNK, 5 * CHUNK, 8 * CHUNK

    now[0] = 10.0
    out = reconcile(api, api.body(spec), OperatorDefaults(), fl, config)    # observes: a new scrape
    assert not out.errors
    tick = autoscale.tick(api, api.body(spec), fl, config, OperatorDefaults(), resizer=lambda *a: {})
    assert len(scrapes) == 2, scrapes   # the window's start, then one scrape read by both
    assert api.pod_lists == 2

    st = api.status
    assert st["hitRatio"] == round(memory_hits / lookups, 4) == 0.25
    assert st["anyTierHitRatio"] == round(any_tier_hits / lookups, 4) == 0.625
    assert tick.signal.hit_ratio == memory_hits / lookups
    assert st["autoscaling"]["lastDecision"]["hitRatio"] == st["hitRatio"]
    assert st["nodes"] == [{"nodeName": "node-1", "ready": True, "endpoint": sidecar.address}]
    assert st["memoryBytes"] > 0


def test_discovery_from_the_pods():
    pods = [pod("a", ports={"metrics": 9500, "grpc": 50061}, kubelet_limit="2Gi", limit="1Gi"),
            pod("b", node="node-0", ip="fd00::5", limit="1Gi"),           # declared no ports: the defaults
            pod("c", node="node-2", ready=False),                         # not ready: listed, not scraped
            pod("d", node=None),                                          # not bound to a node yet: not listed
            pod("e", node="node-3", ip=None)]                             # no IP yet
    api = StandInApiServer(pods)
    got = fleet.discover(api, OWNER)
    assert [s.pod for s in got] == ["b", "a", "c", "e"]                  # by node
    b, a, c, e = got
    assert a.metrics_url == "http://127.0.0.1:9500/metrics" and a.grpc_target == "127.0.0.1:50061"
    assert a.memory_limit == 2 << 30                                     # the kubelet's report wins
    assert b.metrics_url == f"http://[fd00::5]:{builders.METRICS_PORT}/metrics" and b.memory_limit == 1 << 30
    assert c.metrics_url is None and c.grpc_target is None and c.status_entry() == {
        "nodeName": "node-2", "ready": False, "endpoint": f"127.0.0.1:{builders.GRPC_PORT}"}
    assert e.status_entry() == {"nodeName": "node-3", "ready": True} and e.metrics_url is None


def test_an_observation_serves_until_it_is_max_age_old():
    now = [0.0]
    calls: list[str] = []

    def scrape(url: str, timeout: float) -> fleet.Counters:
        calls.append(url)
        return fleet.Counters(tokens=fleet.Tokens(1, 2, 4 * len(calls)))
    fl = fleet.Fleet(window_s=10, max_age_s=5, clock=lambda: now[0], scrape=scrape)
    api = StandInApiServer([pod("a"), pod("b", node="node-2", ready=False)])
    first = fl.observe(api, OWNER)
    now[0] = 4.9
    assert fl.observe(api, OWNER) is first and len(calls) == 1 and api.pod_lists == 1
    now[0] = 5.0
    second = fl.observe(api, OWNER)
    assert second is not first and len(calls) == 2 and fl.latest("ns", "c") is second
    assert second.usage() == {"memoryBytes": 0, "hitRatio": 0.125, "anyTierHitRatio": 0.25}
    sig, latest = fl.signal(second)
    assert sig.lookup_tokens_per_s == 4 / 5 and set(latest) == {"a"}
    fl.forget("ns", "c")
    assert fl.latest("ns", "c") is None


def test_a_refused_pod_listing_is_no_sidecars():
    from promptcache.operator.kube import ApiError

    class Refusing(StandInApiServer):
        def request(self, *a: Any, **k: Any) -> Any:
            raise ApiError(403, '{"message": "pods is forbidden"}')
    now = [0.0]
    fl = fleet.Fleet(window_s=10, max_age_s=0, clock=lambda: now[0],
                     scrape=lambda url, timeout: fleet.Counters(tokens=fleet.Tokens(0, 0, 10 * now[0])))
    api = StandInApiServer([pod("a")])
    fl.observe(api, OWNER)
    now[0] = 1.0
    obs = fl.observe(Refusing([]), OWNER)
    assert obs.sidecars == () and obs.usage() == {} and obs.nodes() == []
    assert fl.latest("ns", "c") is not obs            # the last answer stands
    now[0] = 10.0
    sig, _ = fl.signal(fl.observe(api, OWNER))
    assert sig.lookup_tokens_per_s == 10.0            # the rate's history survived the refusal
