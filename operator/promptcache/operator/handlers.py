"""kopf layer: create/update/resume handlers and a resync timer, all calling the same level-based reconcile.

Importing this module registers the handlers in kopf's default registry.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import kopf

from . import autoscale, metrics_source
from .builders import OperatorDefaults
from .kube import Kube
from .model import GROUP, PLURAL, VERSION
from .reconcile import reconcile

log = logging.getLogger("promptcache.operator")

RESYNC_SECONDS = float(os.environ.get("PROMPTCACHE_OPERATOR_RESYNC_SECONDS", "30"))
ANNOTATION_PREFIX = f"operator.{GROUP}"

_kube: Kube | None = None
AUTOSCALE = autoscale.Config.from_env()
# Samples kept between ticks (rates over AUTOSCALE.window_s), or a Prometheus server's API when configured.
_source = metrics_source.source_from_env(dict(os.environ), AUTOSCALE.window_s)


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
    out = reconcile(kube(), obj, OperatorDefaults.from_env())
    if out.invalid_spec:
        raise kopf.PermanentError("; ".join(out.errors))  # status says InvalidSpec; wait for a spec change
    if out.errors:
        logger.warning("%s: reconciled with errors: %s", reason, "; ".join(out.errors))
        raise kopf.TemporaryError("; ".join(out.errors), delay=5)
    logger.debug("%s: applied %s, deleted %s", reason, out.applied, out.deleted)


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
    out = autoscale.tick(kube(), obj, _source, AUTOSCALE, OperatorDefaults.from_env())
    if out.decision and out.decision.action != "hold":
        logger.info("autoscaling: %s", out.decision.message)
    for err in out.errors:
        logger.warning("autoscaling: %s", err)
