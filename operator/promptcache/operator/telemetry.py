"""The operator's own /metrics: each PromptCache's status conditions and reconcile outcomes, so alerts on a cache's
state (PromptCacheDegraded) need nothing but the operator's ServiceMonitor (no kube-state-metrics configuration).

Only the active replica reconciles, so only it reports a cache; alert on `max by (namespace, name)`.
"""
from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

REGISTRY = CollectorRegistry()
CONDITION = Gauge("promptcache_operator_cache_condition",
                  "1 when the PromptCache's status condition is True, else 0 (condition: Ready, Progressing, "
                  "Degraded, Autoscaling, Monitoring)", ["namespace", "name", "condition"], registry=REGISTRY)
RECONCILES = Counter("promptcache_operator_reconciles_total",
                     "reconciles of a PromptCache by outcome (ok, error, invalid_spec)", ["namespace", "name", "result"],
                     registry=REGISTRY)
_lock = threading.Lock()
_series: dict[tuple[str, str], set[tuple[Any, tuple[str, ...]]]] = {}  # cache -> (metric, labels) it reported


def record(namespace: str, name: str, conditions: list[dict[str, Any]], result: str) -> None:
    with _lock:
        seen = _series.setdefault((namespace, name), set())
        RECONCILES.labels(namespace, name, result).inc()
        seen.add((RECONCILES, (namespace, name, result)))
        for c in conditions:
            CONDITION.labels(namespace, name, c["type"]).set(1.0 if c.get("status") == "True" else 0.0)
            seen.add((CONDITION, (namespace, name, c["type"])))


def record_outcome(namespace: str, name: str, out) -> None:
    """record() from a reconcile.Outcome."""
    record(namespace, name, out.status.get("conditions") or [],
           "invalid_spec" if out.invalid_spec else "error" if out.errors else "ok")


def forget(namespace: str, name: str) -> None:
    """Drop a deleted PromptCache's series (a removed cache must not stay Degraded on a dashboard)."""
    with _lock:
        for metric, labels in _series.pop((namespace, name), ()):
            metric.remove(*labels)


def serve(port: int, host: str = "0.0.0.0") -> int:
    """/metrics on a bounded server (promptcache.sidecar.metricsserver: idle connections cannot pile up threads in
    the operator; the image copies that one module)."""
    from promptcache.sidecar import metricsserver

    server, _ = metricsserver.serve(port, host, REGISTRY)
    return server.server_port
