"""The thin Kubernetes I/O layer: server-side apply, delete, status patch, CRD discovery."""
from __future__ import annotations

import json
import logging
import threading
import time
import urllib.parse
import weakref
from typing import Any

import urllib3

from kubernetes import client, config

from .builders import OPTIONAL_CRDS, Capabilities
from .model import GROUP, PLURAL, VERSION

FIELD_MANAGER = "promptcache-operator"
log = logging.getLogger("promptcache.operator")

PLURALS = {
    "ConfigMap": "configmaps",
    "DaemonSet": "daemonsets",
    "Deployment": "deployments",
    "Service": "services",
    "ResourceQuota": "resourcequotas",
    "NetworkPolicy": "networkpolicies",
    "VerticalPodAutoscaler": "verticalpodautoscalers",
    "ServiceMonitor": "servicemonitors",
    "PrometheusRule": "prometheusrules",
    "PromptCache": PLURAL,
}


def controller_uid(obj: dict[str, Any] | None) -> str | None:
    """The uid of `obj`'s controller ownerReference, or None."""
    for ref in ((obj or {}).get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


class NameConflict(Exception):
    """A child's name is taken by an object this PromptCache does not control: it is left untouched."""

    def __init__(self, key: str, existing: dict[str, Any]):
        self.key = key
        ref = next((r for r in (existing.get("metadata") or {}).get("ownerReferences") or [] if r.get("controller")),
                   None)
        held = f"controlled by {ref.get('kind')} {ref.get('name')}" if ref else "not created by this PromptCache"
        self.message = (f"{key} already exists and is {held}: left untouched (rename the PromptCache, or delete "
                        "or rename that object)")
        super().__init__(self.message)


# What this process last wrote of each child and found controlled by its PromptCache: (uid, resourceVersion), by
# (owner uid, apiVersion, kind, namespace, name), per Kube client. The next apply of that child carries both as
# preconditions instead of reading the object first (see apply_controlled).
_WRITTEN: "weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], tuple[str, str]]]" = weakref.WeakKeyDictionary()
_WRITTEN_LOCK = threading.Lock()
_WRITTEN_MAX = 8192   # children remembered per client (those of deleted PromptCaches are forgotten at this size)
APPLY_ATTEMPTS = 3    # reads and applies of one child when it keeps changing in between


def _written(kube: Any) -> dict[tuple[Any, ...], tuple[str, str]]:
    with _WRITTEN_LOCK:
        try:
            return _WRITTEN.setdefault(kube, {})
        except TypeError:   # a client that takes no weak reference: nothing remembered, every apply reads first
            return {}


def _pinned(obj: dict[str, Any], uid: str, resource_version: str) -> dict[str, Any]:
    """`obj` (not modified) with metadata.uid and metadata.resourceVersion: the API server applies it only to that
    very object in that very version (409 Conflict otherwise; an absent object is not created)."""
    return {**obj, "metadata": {**obj["metadata"], "uid": uid, "resourceVersion": resource_version}}


def apply_controlled(kube: Any, obj: dict[str, Any], owner_uid: str) -> dict[str, Any]:
    """Server-side apply (forced) of a child of the PromptCache `owner_uid`, only where no object of that name
    exists or the existing one's controller ownerReference is that PromptCache: never over an object someone else
    made (an admin's ResourceQuota, Service or ConfigMap whose name a tenant chose to collide with), which the
    forced apply would rewrite and hand to the garbage collector. Raises NameConflict otherwise.

    One call per child in the steady state, without weakening that: the apply carries the uid and resourceVersion
    of the object as this process last wrote it and saw it controlled by `owner_uid` (preconditions the API server
    checks atomically with the write), so it succeeds only where nobody changed the object since, its
    ownerReferences included. Anything else (no such record, the object changed, deleted or replaced: 409) reads
    the object, checks its controller, and applies with the uid and resourceVersion just read, so a change between
    the read and the write is refused too and read again (at most APPLY_ATTEMPTS times). Only where no object of
    that name exists is the apply a plain create-or-update."""
    md = obj["metadata"]
    key = (owner_uid, obj["apiVersion"], obj["kind"], md.get("namespace"), md["name"])
    written = _written(kube)
    with _WRITTEN_LOCK:
        pin = written.pop(key, None)
    for attempt in range(APPLY_ATTEMPTS):
        if pin is None:
            existing = kube.get(obj["apiVersion"], obj["kind"], md.get("namespace"), md["name"])
            if existing is not None and controller_uid(existing) != owner_uid:
                raise NameConflict(f"{obj['kind']}/{md['name']}", existing)
            emd = (existing or {}).get("metadata") or {}
            if emd.get("uid") and emd.get("resourceVersion"):
                pin = (emd["uid"], emd["resourceVersion"])
        # The last attempt, after conflicts on every pinned one (a child another controller writes all the time,
        # as a DaemonSet's status during a rollout), applies as before the pins: just read and checked.
        last = attempt + 1 == APPLY_ATTEMPTS
        try:
            got = kube.apply(obj if pin is None or last else _pinned(obj, *pin))
        except ApiError as exc:
            if exc.status == 409 and pin is not None and not last:
                pin = None   # changed, replaced or deleted since: read it again
                continue
            raise
        gmd = (got.get("metadata") or {}) if isinstance(got, dict) else {}
        if gmd.get("uid") and gmd.get("resourceVersion") and controller_uid(got) == owner_uid:
            with _WRITTEN_LOCK:
                if len(written) >= _WRITTEN_MAX:
                    written.clear()
                written[key] = (gmd["uid"], gmd["resourceVersion"])
        return got
    raise AssertionError("unreachable")  # pragma: no cover


def delete_controlled(kube: Any, api_version: str, kind: str, namespace: str, name: str, owner_uid: str) -> bool:
    """Delete the object only if its controller ownerReference is the PromptCache `owner_uid` (and only that very
    object: a uid precondition); False when it is absent or someone else's."""
    written = _written(kube)
    with _WRITTEN_LOCK:
        written.pop((owner_uid, api_version, kind, namespace, name), None)
    existing = kube.get(api_version, kind, namespace, name)
    if existing is None or controller_uid(existing) != owner_uid:
        return False
    try:
        return kube.delete(api_version, kind, namespace, name, uid=(existing.get("metadata") or {}).get("uid"))
    except ApiError as exc:
        if exc.status == 409:  # replaced meanwhile by another object of that name: not ours to delete
            return False
        raise


class ApiError(Exception):
    def __init__(self, status: int, body: str, headers: dict[str, str] | None = None):
        self.status = status
        self.body = body
        self.headers = headers or {}
        try:
            self.message = json.loads(body).get("message", body)
        except (ValueError, AttributeError):
            self.message = body
        super().__init__(f"HTTP {status}: {self.message}")


def configuration_from_environment(kubeconfig: str | None = None) -> client.Configuration:
    """In-cluster config if there is one, else kubeconfig ($KUBECONFIG / ~/.kube/config)."""
    cfg = client.Configuration()
    if kubeconfig is None:
        try:
            config.load_incluster_config(client_configuration=cfg)
            return cfg
        except config.ConfigException:
            pass
    config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    return cfg


def object_path(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{PLURALS[kind]}" if namespace else f"{base}/{PLURALS[kind]}"
    return f"{path}/{name}" if name else path


class Kube:
    def __init__(self, cfg: client.Configuration | None = None, crd_cache_seconds: float = 10.0):
        self.cfg = cfg or configuration_from_environment()
        self.pool = urllib3.PoolManager(
            num_pools=4, maxsize=16,
            cert_reqs="CERT_REQUIRED" if self.cfg.verify_ssl else "CERT_NONE",
            ca_certs=self.cfg.ssl_ca_cert, cert_file=self.cfg.cert_file, key_file=self.cfg.key_file)
        self.crd_cache_seconds = crd_cache_seconds
        self._caps: tuple[float, Capabilities] | None = None
        self._pcs: dict[str, tuple[float, bool]] = {}
        self._lock = threading.Lock()

    def authorization(self) -> str | None:
        """The Authorization header (kubernetes-client versions keep the token under different keys)."""
        cfg = self.cfg
        token = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
        if token and not token.lower().startswith("bearer "):
            token = f"Bearer {token}"
        return token

    # -- raw calls -------------------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, query: list[tuple[str, str]] | None = None,
                content_type: str = "application/json", with_headers: bool = False) -> Any:
        cfg = self.cfg
        headers = {"Accept": "application/json", "User-Agent": FIELD_MANAGER}
        token = self.authorization()
        if token:
            headers["Authorization"] = token
        if body is not None:
            headers["Content-Type"] = content_type
            if not isinstance(body, str | bytes):
                body = json.dumps(body)
        url = cfg.host.rstrip("/") + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        resp = self.pool.request(method, url, body=body, headers=headers, timeout=30.0, retries=False)
        data = resp.data
        if resp.status >= 400:
            raise ApiError(resp.status, data.decode(errors="replace"), dict(resp.headers))
        obj = json.loads(data) if data else None
        return (obj, dict(resp.headers), resp.headers.getlist("Warning")) if with_headers else obj

    # -- objects ---------------------------------------------------------------------------------------------
    def apply(self, obj: dict[str, Any], with_headers: bool = False) -> Any:
        """Server-side apply with this operator's field manager; conflicts are forced (we own these fields).
        Warnings the API server returns (Pod Security, deprecations) are logged. Only for objects the caller
        controls or that do not exist yet: a PromptCache's children go through apply_controlled()."""
        md = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], md.get("namespace"), md["name"])
        got, headers, warnings = self.request("PATCH", path, body=obj, content_type="application/apply-patch+yaml",
                                              query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
                                              with_headers=True)
        for w in warnings:
            log.warning("API server warning on %s %s/%s: %s", obj["kind"], md.get("namespace"), md["name"], w)
        return (got, headers, warnings) if with_headers else got

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", object_path(api_version, kind, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str,
               uid: str | None = None) -> bool:
        """`uid`: delete only that very object (a precondition: 409 when the name now holds another one)."""
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self.request("DELETE", object_path(api_version, kind, namespace, name), body=body)
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        path = object_path(f"{GROUP}/{VERSION}", "PromptCache", namespace, name) + "/status"
        return self.request("PATCH", path, body={"status": status}, content_type="application/merge-patch+json")

    def failed_creates(self, namespace: str, kind: str, name: str) -> list[dict[str, Any]]:
        """The FailedCreate events of one object (core/v1 events, as the DaemonSet controller records them);
        [] where the operator may not list events (an older chart's RBAC)."""
        sel = f"involvedObject.kind={kind},involvedObject.name={name},reason=FailedCreate"
        try:
            return (self.request("GET", f"/api/v1/namespaces/{namespace}/events",
                                 query=[("fieldSelector", sel)]) or {}).get("items") or []
        except ApiError as exc:
            if exc.status == 403:
                return []
            raise

    def priority_class_exists(self, name: str) -> bool:
        """Cached like the CRD lookups (crd_cache_seconds)."""
        with self._lock:
            hit = self._pcs.get(name)
            if hit and time.monotonic() - hit[0] < self.crd_cache_seconds:
                return hit[1]
        ok = self._priority_class_exists(name)
        with self._lock:
            self._pcs[name] = (time.monotonic(), ok)
        return ok

    def _priority_class_exists(self, name: str) -> bool:
        try:
            self.request("GET", f"/apis/scheduling.k8s.io/v1/priorityclasses/{name}")
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            if exc.status == 403:  # not allowed to look: assume present rather than report a false problem
                return True
            raise

    def peering_problem(self, name: str, namespaces: list[str], namespaced: bool | None = None) -> str | None:
        """Why kopf would idle with peering `name` (its CRD or object missing), or None. kopf itself waits
        silently for a peering object that never comes. `namespaces`: those named literally (a kopf pattern's
        namespaces are found as they come); `namespaced`: whether kopf peers per namespace (default: any named)."""
        namespaced = bool(namespaces) if namespaced is None else namespaced
        plural, kind = ("kopfpeerings", "KopfPeering") if namespaced else ("clusterkopfpeerings", "ClusterKopfPeering")
        if not self.crd_established(f"{plural}.kopf.dev"):
            return (f"the peering CRD {plural}.kopf.dev is not installed: install the chart's CRDs "
                    "(charts/promptcache-operator/crds/) or run a single replica with --standalone")
        for ns in namespaces if namespaced else [None]:
            path = f"/apis/kopf.dev/v1/namespaces/{ns}/{plural}/{name}" if ns else f"/apis/kopf.dev/v1/{plural}/{name}"
            try:
                self.request("GET", path)
            except ApiError as exc:
                if exc.status != 404:
                    raise
                where = f" in namespace {ns}" if ns else ""
                return (f"the {kind} {name!r}{where} does not exist: create it (the chart does), pass the right "
                        "--peering, or run a single replica with --standalone")
        return None

    # -- optional CRDs ---------------------------------------------------------------------------------------
    def crd_established(self, name: str) -> bool:
        try:
            crd = self.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return any(c.get("type") == "Established" and c.get("status") == "True"
                   for c in (crd.get("status") or {}).get("conditions") or [])

    def capabilities(self, refresh: bool = False) -> Capabilities:
        with self._lock:
            now = time.monotonic()
            if not refresh and self._caps and now - self._caps[0] < self.crd_cache_seconds:
                return self._caps[1]
            caps = Capabilities(
                vpa=self.crd_established(OPTIONAL_CRDS["VerticalPodAutoscaler"]),
                service_monitor=self.crd_established(OPTIONAL_CRDS["ServiceMonitor"]),
                prometheus_rule=self.crd_established(OPTIONAL_CRDS["PrometheusRule"]),
            )
            self._caps = (now, caps)
            return caps
