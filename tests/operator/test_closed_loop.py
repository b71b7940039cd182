"""Closed loop: a real sidecar process under a synthetic workload whose working set (24 MiB) is larger than its
starting budget (8 MiB); the autoscaler (promptcache.operator.autoscale.tick, authenticated as the chart's
ServiceAccount against the real API server, with reconcile() in between as the operator's timer runs it) scrapes
the sidecar's real /metrics, raises the memory until the hit ratio reaches the target, holds, and shrinks back to
the minimum when the load stops. The sidecar never restarts and never holds more than its budget.

No kubelet or DaemonSet controller runs here, so no cache pod would ever exist: the test creates the cache's Pod BY
HAND, as a kubelet would report it (bound to a node, IP 127.0.0.1, Ready), its sidecar container declaring the local
sidecar's gRPC and metrics ports. Everything else is the operator's code path: discovery through the API server,
scraping (fleet.Fleet), tuning.decide, Resize over gRPC, status, Events and the DaemonSet's limits (no VPA CRD here:
the DaemonSet fallback). Cooldowns and windows are seconds instead of minutes (autoscale.Config).

The sidecar runs the miss-ratio curve (--mrc-sample-rate 1: 48 prefixes are too few chain roots to sample from), so
a grow jumps to the size the curve predicts reaches the target: fewer resizes than the x1.5 steps without it (three
grows, 8 -> 12 -> 18 -> 27 MiB).
"""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from promptcache.client import PromptCacheClient
from promptcache.contract.keys import ModelSpec
from promptcache.contract.layout import chunk_nbytes
from promptcache.operator import autoscale, builders, fleet, tuning
from promptcache.operator.builders import OperatorDefaults, Owner
from promptcache.operator.kube import Kube, configuration_from_environment, object_path
from promptcache.operator.model import quantity_bytes
from promptcache.operator.reconcile import reconcile
from support import SidecarProcess

pytestmark = pytest.mark.apiserver

Mi = 1 << 20
CHUNK_TOKENS = 16
SPEC = ModelSpec("test/closed-loop", "rev-1", "float16", num_layers=4, num_kv_heads=8, head_dim=64)  # 128 KiB/chunk
PREFIXES, CHUNKS_PER_PREFIX = 48, 4            # working set 48 x 4 x 128 KiB = 24 MiB
MIN, MAX, TARGET = 8 * Mi, 64 * Mi, 0.8
HOLD_TICKS = 8   # > 2 grow cooldowns
MRC_RATE = "1"
PC_API = "promptcache.io/v1alpha1"
POD = "sidecar-on-this-machine"


class Workload(threading.Thread):
    """Uniformly random prompts over a fixed set of prefixes: Lookup, then Put of the chunks that missed."""

    def __init__(self, address: str, **client_kwargs):
        super().__init__(daemon=True)
        self.address = address
        self.client_kwargs = client_kwargs
        self.stop = threading.Event()
        self.requests = 0
        self.errors: list[str] = []

    def run(self) -> None:
        # Finite float16 values, as K/V are (the sidecar refuses NaN and Inf in unquantized chunks).
        g = torch.Generator().manual_seed(1)
        blob = torch.randn(chunk_nbytes(SPEC, CHUNK_TOKENS) // 2, generator=g).to(torch.float16).view(torch.uint8)
        rng = random.Random(2)
        with PromptCacheClient(self.address, timeout=5, **self.client_kwargs) as c:
            while not self.stop.is_set():
                p = rng.randrange(PREFIXES)
                tokens = [p * 1000 + j for j in range(CHUNK_TOKENS * CHUNKS_PER_PREFIX)]
                try:
                    got = c.lookup(SPEC, tokens).cached_tokens // CHUNK_TOKENS
                    if got < CHUNKS_PER_PREFIX:
                        c.put_blobs(SPEC, tokens, {i: blob for i in range(got, CHUNKS_PER_PREFIX)})
                    self.requests += 1
                except Exception as exc:  # noqa: BLE001 - recorded and asserted on
                    self.errors.append(repr(exc))
                    time.sleep(0.05)


def sidecar_pod(kube, owner: Owner, sidecar) -> None:
    """The cache's Pod for the local sidecar, as the DaemonSet controller and a kubelet would make and report it."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": POD, "namespace": owner.namespace, "labels": builders.labels(owner)},
           "spec": {"nodeName": "node-1", "containers": [{
               "name": builders.CONTAINER, "image": "sidecar:test",
               "ports": [{"name": "grpc", "containerPort": sidecar.port},
                         {"name": "metrics", "containerPort": sidecar.metrics_port}]}]}}
    kube.request("POST", f"/api/v1/namespaces/{owner.namespace}/pods", body=pod)
    kube.request("PATCH", f"/api/v1/namespaces/{owner.namespace}/pods/{POD}/status",
                 content_type="application/merge-patch+json",
                 body={"status": {"phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
                                  "conditions": [{"type": "Ready", "status": "True"}]}})


def ds_memory_limit(kube, namespace: str, name: str) -> int:
    ds = kube.get("apps/v1", "DaemonSet", namespace, name)
    (ct,) = ds["spec"]["template"]["spec"]["containers"]
    return quantity_bytes(ct["resources"]["limits"]["memory"])


def secure_sidecar(tmp_path, service: str) -> tuple[list[str], dict, str]:
    """(sidecar flags, client kwargs of the workload, the operator's credentials folder) for a sidecar serving
    TLS (a certificate for the cache's Service name) with bearer tokens, the operator an admin tenant."""
    from test_auth import write_secret_dir
    from test_auth_pki import make_pki

    pki = make_pki(tmp_path / "pki")
    cert, key = pki.ca.issue("promptcache-sidecar", server=True, dns_names=(service,))
    (tmp_path / "server.pem").write_bytes(cert)
    (tmp_path / "server.key").write_bytes(key)
    operator = OperatorDefaults().operator_tenant
    write_secret_dir(tmp_path / "tokens", {"workload": "workload-token", operator: "operator-token"})
    creds = tmp_path / "operator-credentials"   # what the chart mounts from sidecarCredentials.secretName
    creds.mkdir()
    (creds / "token").write_text("operator-token\n")
    (creds / "ca.crt").write_bytes(pki.ca.pem)
    flags = ["--tls-cert-file", str(tmp_path / "server.pem"), "--tls-key-file", str(tmp_path / "server.key"),
             "--token-file", str(tmp_path / "tokens"), "--admin-tenants", operator]
    return flags, {"tls_ca": pki.ca_file, "token": "workload-token"}, str(creds)


@pytest.mark.parametrize("secured", [False, True], ids=["plaintext", "tls-and-tokens"])
def test_closed_loop(crd, kube, operator_kubeconfig, namespace, tmp_path, secured, request):
    op_kube = Kube(configuration_from_environment(str(operator_kubeconfig)), crd_cache_seconds=0.5)
    name = "loop"
    flags, client_kwargs, creds = secure_sidecar(tmp_path, f"{name}.{namespace}.svc") if secured else ([], {}, None)
    sidecar = SidecarProcess("--memory-bytes", str(MIN), "--chunk-tokens", str(CHUNK_TOKENS), "--device", "cpu",
                             "--data-dir", str(tmp_path / "data"), "--log-level", "warning",
                             "--ttl-seconds", "3600", "--mrc-sample-rate", MRC_RATE, *flags
                             ).wait_ready(**{k: v for k, v in client_kwargs.items() if k == "tls_ca"})
    pid = sidecar.proc.pid
    workload = Workload(sidecar.address, **client_kwargs)
    try:
        doc = {"apiVersion": PC_API, "kind": "PromptCache", "metadata": {"name": name, "namespace": namespace},
               "spec": {"model": {"name": SPEC.model_id, "revision": "rev-1"}, "memory": {"host": "8Mi"},
                        "cachePolicy": {"chunkTokens": CHUNK_TOKENS},
                        "autoscaling": {"enabled": True, "targetHitRatio": TARGET, "minMemory": "8Mi",
                                        "maxMemory": "64Mi"}}}
        if secured:
            doc["spec"]["security"] = {"tls": {"secretName": f"{name}-tls"}, "tokens": {"secretName": f"{name}-tokens"}}
        pc = kube.request("PATCH", object_path(PC_API, "PromptCache", namespace, name), body=doc,
                          content_type="application/apply-patch+yaml", query=[("fieldManager", "kubectl")])
        owner = Owner(name, namespace, pc["metadata"]["uid"])
        get = lambda: kube.get(PC_API, "PromptCache", namespace, name)  # noqa: E731
        defaults = OperatorDefaults()
        reconcile(op_kube, get(), defaults)
        if secured:  # the flag the hand-started sidecar got is what the operator configures its sidecars with
            cm = kube.get("v1", "ConfigMap", namespace, f"{name}-config")
            assert cm["data"]["PROMPTCACHE_ADMIN_TENANTS"] == defaults.operator_tenant
        sidecar_pod(kube, owner, sidecar)
        eps = fleet.discover(op_kube, owner)
        assert [(e.metrics_url, e.grpc_target) for e in eps] == [
            (f"http://127.0.0.1:{sidecar.metrics_port}/metrics", sidecar.address)]

        config = autoscale.Config(
            interval_s=1, window_s=3, overhead_bytes=0,   # memory == budget here (no container around the sidecar)
            credentials_dir=creds,
            policy=tuning.Policy(grow_cooldown_s=4, shrink_cooldown_s=3, shrink_factor=0.8))
        # As the operator makes it: one observation serves half the (autoscaling) timer period.
        sidecars = fleet.Fleet(window_s=config.window_s, max_age_s=config.interval_s / 2)
        rows: list[tuple] = []
        steps: list[tuple[str, list[str]]] = []
        t0 = time.monotonic()

        def step(i: int) -> autoscale.Outcome:
            out = autoscale.tick(op_kube, get(), sidecars, config, defaults)
            assert not out.errors, out.errors
            if i % 3 == 0:   # the operator's resync timer runs reconcile() in between: it must keep the tuned limit
                assert not reconcile(op_kube, get(), defaults, sidecars, config).errors
            c = sidecars.latest(namespace, name).counters.get(POD)
            assert sidecar.proc.poll() is None and sidecar.proc.pid == pid, "the sidecar restarted"
            if c is not None:
                assert c.committed_bytes <= c.budget_bytes, c
                assert c.stored_bytes <= c.budget_bytes, c
            d = out.decision
            rows.append((time.monotonic() - t0, out.memory_bytes, c.budget_bytes if c else None,
                         out.signal.hit_ratio if out.signal else None, d.action if d else "-", d.reason if d else "-",
                         d.message if d and d.action == tuning.GROW else ""))
            if d and d.action != tuning.HOLD:
                steps.append((d.action, out.steps))
            time.sleep(config.interval_s)
            return out

        # Phase 1: load. Grows until the hit ratio reaches the target, then holds: ends when the last HOLD_TICKS
        # windows all met the target (how many grows that takes depends on how fast this machine warms the cache).
        workload.start()
        i = 0
        deadline = time.monotonic() + 75
        while time.monotonic() < deadline:
            step(i)
            i += 1
            tail = rows[-HOLD_TICKS:]
            if len(tail) == HOLD_TICKS and all(r[3] is not None and r[3] >= TARGET for r in tail):
                break
        tail = rows[-HOLD_TICKS:]
        assert all(r[3] is not None and r[3] >= TARGET for r in tail), "target not reached\n" + _table(rows)
        peak = tail[-1][1]
        assert all(r[1] == peak and r[4] == tuning.HOLD for r in tail), "memory moved on target\n" + _table(rows)
        assert MIN < peak < MAX, _table(rows)
        assert all(r[4] != tuning.SHRINK for r in rows), _table(rows)
        grows = [r for r in rows if r[4] == tuning.GROW]
        assert grows and all(r[3] < TARGET for r in grows), _table(rows)   # grew only below the target
        assert len(grows) < 3, "the curve should beat three x1.5 steps\n" + _table(rows)
        assert ds_memory_limit(kube, namespace, name) == peak   # no VPA here: the DaemonSet carries the limit

        # Phase 2: the load stops. Shrinks back to the minimum, Resize first.
        workload.stop.set()
        workload.join(10)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = step(i)
            i += 1
            if out.memory_bytes == MIN and rows[-1][2] == MIN:
                break
        print("\n" + _table(rows))
        plot = request.config.getoption("--closed-loop-plot")
        if plot and not secured:  # the trajectory as a picture: `make plots` (docs/img/closed-loop.png)
            from promptcache_devtools.bench import plots

            plots.closed_loop(rows, TARGET, plot)
        assert rows[-1][1] == MIN and rows[-1][2] == MIN, _table(rows)
        assert ds_memory_limit(kube, namespace, name) == MIN
        assert not workload.errors[:3], workload.errors[:3]
        assert workload.requests > 100

        # Safe ordering: grow raises the limit (status, DaemonSet) before Resize; shrink Resizes first.
        for action, s in steps:
            resize = min(k for k, x in enumerate(s) if x.startswith("resize"))
            limit = next(k for k, x in enumerate(s) if x == "apply DaemonSet")
            assert (limit < resize) if action == tuning.GROW else (resize < limit), (action, s)
        assert {a for a, _ in steps} == {tuning.GROW, tuning.SHRINK}

        pc = get()
        st = pc["status"]["autoscaling"]
        assert st["memoryBytes"] == MIN and st["lastDecision"]["reason"] in ("Idle", "AtMinimum")
        events = kube.request("GET", f"/api/v1/namespaces/{namespace}/events",
                              query=[("fieldSelector", f"involvedObject.name={name}")])["items"]
        reasons = {e["reason"] for e in events if e["source"].get("component") == "promptcache-autoscaler"}
        assert {"HitRatioBelowTarget", "Idle"} <= reasons, reasons
    finally:
        workload.stop.set()
        sidecar.stop()


def _table(rows: list[tuple]) -> str:
    # memory: recorded after the tick; budget: the sidecar's, as scraped at the start of the tick (before its Resize);
    # hit ratio: over the last window (3 s).
    lines = [f"{'t/s':>6} {'memory':>9} {'budget':>9} {'hit ratio':>9}  decision"]
    for t, mem, budget, ratio, action, reason, message in rows:
        lines.append(f"{t:6.1f} {mem / Mi:7.1f}Mi {(budget or 0) / Mi:7.1f}Mi "
                     f"{'' if ratio is None else f'{ratio:.3f}':>9}  {action} {reason}"
                     + (f"  ({message.rsplit('(', 1)[-1]}" if message else ""))
    return "\n".join(lines)
