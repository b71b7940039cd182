"""kopf layer: create/update/resume handlers and a resync timer, all calling the same level-based reconcile.

Importing this module registers the handlers in kopf's default registry.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

import kopf

from . import autoscale, telemetry
from .builders import CACHE_LABEL, MANAGED_BY, OperatorDefaults
from .fleet import Fleet, PrometheusSource
from .kube import Kube
from .model import GROUP, KIND, PLURAL, VERSION
from .reconcile import reconcile

log = logging.getLogger("promptcache.operator")

RESYNC_SECONDS = float(os.environ.get("PROMPTCACHE_OPERATOR_RESYNC_SECONDS", "30"))
ANNOTATION_PREFIX = f"operator.{GROUP}"

_kube: Kube | None = None
AUTOSCALE = autoscale.Config.from_env()
# One observation of a cache's sidecars serves status and autoscaler for half the shorter timer period; the scrape
# history gives the rates over AUTOSCALE.window_s, unless a Prometheus server's API is configured.
_fleet = Fleet(window_s=AUTOSCALE.window_s, max_age_s=min(RESYNC_SECONDS, AUTOSCALE.interval_s) / 2)
_source = (PrometheusSource(os.environ["PROMPTCACHE_OPERATOR_PROMETHEUS_URL"], AUTOSCALE.window_s)
           if os.environ.get("PROMPTCACHE_OPERATOR_PROMETHEUS_URL") else _fleet)


def kube() -> Kube:
    global _kube
    if _kube is None:
        _kube = Kube(crd_cache_seconds=float(os.environ.get("PROMPTCACHE_OPERATOR_CRD_CACHE_SECONDS", "10")))
    return _kube


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Keep kopf's bookkeeping under our own prefix, in annotations (status is schema-pruned).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/finalizer"  # unused: no delete handlers
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = int(os.environ.get("PROMPTCACHE_OPERATOR_WORKERS", "16"))
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 60
    settings.batching.idle_timeout = 5.0
    settings.batching.batch_window = 0.05
    kube()  # fail at startup, not at the first event, if the API server is unreachable


def _reconcile(body: kopf.Body, logger: logging.Logger, reason: str) -> None:
    # Objects of kopf are read-only views; reconcile wants plain dicts.
    obj = {"metadata": dict(body.metadata), "spec": dict(body.spec), "status": dict(body.status)}
    out = reconcile(kube(), obj, OperatorDefaults.from_env(), _fleet, AUTOSCALE)
    md = obj["metadata"]
    telemetry.record_outcome(md["namespace"], md["name"], out)
    if out.invalid_spec:
        raise kopf.PermanentError("; ".join(out.errors))  # status says InvalidSpec; wait for a spec change
    if out.errors:
        logger.warning("%s: reconciled with errors: %s", reason, "; ".join(out.errors))
        raise kopf.TemporaryError("; ".join(out.errors), delay=5)
    logger.debug("%s: applied %s, deleted %s", reason, out.applied, out.deleted)


@kopf.on.event(GROUP, VERSION, PLURAL)
def on_event(event: dict[str, Any], body: kopf.Body, **_: Any) -> None:
    if event.get("type") == "DELETED":  # an event handler adds no finalizer, so deletion is never held up
        telemetry.forget(body.metadata.namespace, body.metadata.name)
        _fleet.forget(body.metadata.namespace, body.metadata.name)


@kopf.on.resume(GROUP, VERSION, PLURAL)
def on_resume(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    _reconcile(body, logger, "resume")


@kopf.on.create(GROUP, VERSION, PLURAL)
def on_create(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    _reconcile(body, logger, "create")


@kopf.on.update(GROUP, VERSION, PLURAL)
def on_update(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    _reconcile(body, logger, "update")


@kopf.timer(GROUP, VERSION, PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS / 2, sharp=False)
def resync(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """Level-based safety net: re-apply (repairs drift, picks up CRDs installed later) and refresh status."""
    try:
        _reconcile(body, logger, "resync")
    except (kopf.TemporaryError, kopf.PermanentError) as exc:
        logger.warning("resync: %s", exc)


def _autoscaling_enabled(spec: kopf.Spec, **_: Any) -> bool:
    return bool((spec.get("autoscaling") or {}).get("enabled"))


@kopf.timer(GROUP, VERSION, PLURAL, interval=AUTOSCALE.interval_s, initial_delay=AUTOSCALE.interval_s / 2,
            sharp=False, when=_autoscaling_enabled)
def autoscale_timer(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """Hit-ratio-driven memory tuning (docs/autoscaling.md); decisions become Events and status.autoscaling."""
    obj = {"metadata": dict(body.metadata), "spec": dict(body.spec), "status": dict(body.status)}
    out = autoscale.tick(kube(), obj, _fleet, AUTOSCALE, OperatorDefaults.from_env(), source=_source)
    if out.decision and out.decision.action != "hold":
        logger.info("autoscaling: %s", out.decision.message)
    for err in out.errors:
        logger.warning("autoscaling: %s", err)


# --- drift: children changed or deleted by hand -------------------------------------------------------------------
# The core children are watched (filtered by the labels the operator puts on them), so drift is repaired within
# about a second instead of at the next resync. The optional ones (VPA, ServiceMonitor, PrometheusRule) are left to
# the resync timer: their CRDs may not exist, and they hold no cached data.
WATCHED_CHILDREN = (("apps", "v1", "daemonsets"), ("", "v1", "services"), ("", "v1", "configmaps"),
                    ("", "v1", "resourcequotas"))
CHILD_LABELS = {CACHE_LABEL: kopf.PRESENT, "app.kubernetes.io/managed-by": MANAGED_BY}
DRIFT_MIN_INTERVAL_SECONDS = 0.5  # one repair per cache per interval, however many child events arrive


class Coalescer:
    """Runs fn(key) in a thread after request(key), at most once per `interval` per key: requests that arrive
    while a run is pending or too recent are folded into one trailing run, so a burst of events (a rollout
    updating a DaemonSet's status) costs one reconcile and the last request is never lost."""

    def __init__(self, fn: Callable[[Any], None], interval: float, clock: Callable[[], float] = time.monotonic):
        self.fn, self.interval, self.clock = fn, interval, clock
        self._lock = threading.Lock()
        self._pending: set[Any] = set()
        self._last: dict[Any, float] = {}

    def request(self, key: Any) -> None:
        with self._lock:
            if key in self._pending:
                return
            self._pending.add(key)
            delay = max(0.0, self._last.get(key, -1e18) + self.interval - self.clock())
        timer = threading.Timer(delay, self._run, args=(key,))
        timer.daemon = True
        timer.start()

    def _run(self, key: Any) -> None:
        with self._lock:
            self._pending.discard(key)
            self._last[key] = self.clock()
        try:
            self.fn(key)
        except Exception:  # noqa: BLE001 - a failed repair is retried by the next event or the resync timer
            log.exception("repairing the children of %s/%s failed", *key)


def _repair(key: tuple[str, str]) -> None:
    namespace, name = key
    body = kube().get(f"{GROUP}/{VERSION}", KIND, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return  # the PromptCache is gone or going: its children go with it (garbage collection)
    obj = {"metadata": body["metadata"], "spec": body.get("spec") or {}, "status": body.get("status") or {}}
    out = reconcile(kube(), obj, OperatorDefaults.from_env(), _fleet, AUTOSCALE)
    telemetry.record_outcome(namespace, name, out)
    if out.errors:
        log.warning("repairing the children of %s/%s: %s", namespace, name, "; ".join(out.errors))


_drift = Coalescer(_repair, DRIFT_MIN_INTERVAL_SECONDS)


def _controller(body: kopf.Body) -> str | None:
    for ref in body.metadata.get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == KIND and ref.get("apiVersion") == f"{GROUP}/{VERSION}":
            return ref.get("name")
    return None


def _child_event(event: dict[str, Any], body: kopf.Body, **_: Any) -> None:
    """A child was modified or deleted: reconcile its PromptCache (level-based; a no-op when nothing drifted,
    since server-side apply of an unchanged object changes nothing and so raises no further event)."""
    if event.get("type") not in ("MODIFIED", "DELETED"):
        return  # ADDED: the operator's own create, or the initial listing
    owner = _controller(body)
    if owner is not None:
        _drift.request((body.metadata.namespace, owner))


for _group, _version, _plural in WATCHED_CHILDREN:
    kopf.on.event(_group, _version, _plural, labels=CHILD_LABELS)(_child_event)
