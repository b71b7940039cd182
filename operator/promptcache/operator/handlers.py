"""kopf layer: create/update/resume handlers and a resync timer, all calling the same level-based reconcile; the
autoscaling timer; the watch on the children (drift).

`Operator` holds the configuration (built once in `main`), the API client and the fleet of observed sidecars;
`Operator.registry()` registers its handlers in a fresh kopf registry that `kopf.run(registry=...)` runs. Importing
this module registers nothing.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import kopf

from . import autoscale, telemetry
from .builders import CACHE_LABEL, MANAGED_BY
from .config import OperatorConfig
from .fleet import Fleet, PrometheusSource
from .kube import Kube
from .model import GROUP, KIND, PLURAL, VERSION
from .reconcile import reconcile

log = logging.getLogger("promptcache.operator")

ANNOTATION_PREFIX = f"operator.{GROUP}"

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


def _plain(body: kopf.Body) -> dict[str, Any]:
    """kopf's objects are read-only views; reconcile and tick want plain dicts."""
    return {"metadata": dict(body.metadata), "spec": dict(body.spec), "status": dict(body.status)}


def _controller(body: kopf.Body) -> str | None:
    for ref in body.metadata.get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == KIND and ref.get("apiVersion") == f"{GROUP}/{VERSION}":
            return ref.get("name")
    return None


class Operator:
    def __init__(self, config: OperatorConfig, kube: Kube):
        self.config = config
        self.kube = kube
        # One observation of a cache's sidecars serves status and autoscaler; the scrape history gives the rates.
        self.fleet = Fleet(window_s=config.autoscale.window_s, max_age_s=config.observation_max_age_s)
        self.source = (PrometheusSource(config.prometheus_url, config.autoscale.window_s) if config.prometheus_url
                       else self.fleet)
        self.drift = Coalescer(self.repair, DRIFT_MIN_INTERVAL_SECONDS)

    def registry(self) -> kopf.OperatorRegistry:
        """The handlers, bound to this operator, in a registry of their own (ids as the handlers always had)."""
        reg = kopf.OperatorRegistry()
        resync, interval = self.config.resync_seconds, self.config.autoscale.interval_s
        # kopf's default registry logs in through the kubernetes client when it is installed; a registry of our own
        # says so itself (the same credentials Kube uses: in-cluster, else kubeconfig).
        kopf.on.login(registry=reg, id="login_via_client")(kopf.login_via_client)
        kopf.on.startup(registry=reg, id="configure")(self.configure)
        kopf.on.event(GROUP, VERSION, PLURAL, registry=reg, id="on_event")(self.on_event)
        kopf.on.resume(GROUP, VERSION, PLURAL, registry=reg, id="on_resume")(self.on_resume)
        kopf.on.create(GROUP, VERSION, PLURAL, registry=reg, id="on_create")(self.on_create)
        kopf.on.update(GROUP, VERSION, PLURAL, registry=reg, id="on_update")(self.on_update)
        kopf.timer(GROUP, VERSION, PLURAL, registry=reg, id="resync", interval=resync, initial_delay=resync / 2,
                   sharp=False)(self.resync)
        kopf.timer(GROUP, VERSION, PLURAL, registry=reg, id="autoscale_timer", interval=interval,
                   initial_delay=interval / 2, sharp=False, when=_autoscaling_enabled)(self.autoscale_timer)
        for group, version, plural in WATCHED_CHILDREN:
            kopf.on.event(group, version, plural, labels=CHILD_LABELS, registry=reg,
                          id=f"_child_event/{plural}")(self.child_event)
        return reg

    def configure(self, settings: kopf.OperatorSettings, **_: Any) -> None:
        # Keep kopf's bookkeeping under our own prefix, in annotations (status is schema-pruned).
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
        settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/finalizer"  # unused: no delete handlers
        settings.posting.level = logging.WARNING
        settings.execution.max_workers = self.config.workers
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        settings.networking.request_timeout = 60
        settings.batching.idle_timeout = 5.0
        settings.batching.batch_window = 0.05

    def _reconcile(self, body: kopf.Body, logger: logging.Logger, reason: str) -> None:
        obj = _plain(body)
        out = reconcile(self.kube, obj, self.config.defaults, self.fleet, self.config.autoscale)
        md = obj["metadata"]
        telemetry.record_outcome(md["namespace"], md["name"], out)
        if out.invalid_spec:
            raise kopf.PermanentError("; ".join(out.errors))  # status says InvalidSpec; wait for a spec change
        if out.errors:
            logger.warning("%s: reconciled with errors: %s", reason, "; ".join(out.errors))
            raise kopf.TemporaryError("; ".join(out.errors), delay=5)
        logger.debug("%s: applied %s, deleted %s", reason, out.applied, out.deleted)

    def on_event(self, event: dict[str, Any], body: kopf.Body, **_: Any) -> None:
        if event.get("type") == "DELETED":  # an event handler adds no finalizer, so deletion is never held up
            telemetry.forget(body.metadata.namespace, body.metadata.name)
            self.fleet.forget(body.metadata.namespace, body.metadata.name)

    def on_resume(self, body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
        self._reconcile(body, logger, "resume")

    def on_create(self, body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
        self._reconcile(body, logger, "create")

    def on_update(self, body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
        self._reconcile(body, logger, "update")

    def resync(self, body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
        """Level-based safety net: re-apply (repairs drift, picks up CRDs installed later) and refresh status."""
        try:
            self._reconcile(body, logger, "resync")
        except (kopf.TemporaryError, kopf.PermanentError) as exc:
            logger.warning("resync: %s", exc)

    def autoscale_timer(self, body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
        """Hit-ratio-driven memory tuning (docs/autoscaling.md); decisions become Events and status.autoscaling."""
        out = autoscale.tick(self.kube, _plain(body), self.fleet, self.config.autoscale, self.config.defaults,
                             source=self.source)
        if out.decision and out.decision.action != "hold":
            logger.info("autoscaling: %s", out.decision.message)
        for err in out.errors:
            logger.warning("autoscaling: %s", err)

    def repair(self, key: tuple[str, str]) -> None:
        namespace, name = key
        body = self.kube.get(f"{GROUP}/{VERSION}", KIND, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return  # the PromptCache is gone or going: its children go with it (garbage collection)
        obj = {"metadata": body["metadata"], "spec": body.get("spec") or {}, "status": body.get("status") or {}}
        out = reconcile(self.kube, obj, self.config.defaults, self.fleet, self.config.autoscale)
        telemetry.record_outcome(namespace, name, out)
        if out.errors:
            log.warning("repairing the children of %s/%s: %s", namespace, name, "; ".join(out.errors))

    def child_event(self, event: dict[str, Any], body: kopf.Body, **_: Any) -> None:
        """A child was modified or deleted: reconcile its PromptCache (level-based; a no-op when nothing drifted,
        since server-side apply of an unchanged object changes nothing and so raises no further event)."""
        if event.get("type") not in ("MODIFIED", "DELETED"):
            return  # ADDED: the operator's own create, or the initial listing
        owner = _controller(body)
        if owner is not None:
            self.drift.request((body.metadata.namespace, owner))


def _autoscaling_enabled(spec: kopf.Spec, **_: Any) -> bool:
    return bool((spec.get("autoscaling") or {}).get("enabled"))
