"""Hit-ratio-driven memory autoscaling of a PromptCache: read the signal, decide (tuning.decide), actuate safely.

Memory here is the sidecar container's memory (what spec.autoscaling.minMemory/maxMemory bound and what the VPA
sets); the cache budget the sidecar is resized to is that minus `overhead()`: `overhead_bytes`
(builders.MEMORY_OVERHEAD) and the disk-tier index.

Actuation order, so that memory is never taken before the cache has released it:
  shrink: Resize every sidecar down first; only when all succeeded, record the new memory in status and lower the
          limit (VPA minAllowed/maxAllowed, or the DaemonSet's resources without a VPA). A failed Resize leaves the
          limit where it was and is retried on the next tick.
  grow:   record the new memory in status and raise the limit first; Resize each sidecar up only once the applied
          limit (read back from the API server) covers it. Sidecars not yet resized are resized on a later tick
          (level-based: every tick converges each sidecar's budget, read from its metrics, to the recorded one).
The recorded memory lives in status.autoscaling (memoryBytes, lastChangeTime, lastDecision); reconcile() reads it
through adjust_children(), so the regular reconcile keeps the tuned limits instead of reverting them. Each change is
a Kubernetes Event on the PromptCache (reason = the decision's reason). See docs/autoscaling.md.
"""
from __future__ import annotations

import datetime as dt
import functools
import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from . import builders, fleet as fleet_, tuning
from .builders import Capabilities, OperatorDefaults, Owner
from . import kube as kube_
from .kube import ApiError, Kube
from .model import GROUP, KIND, VERSION, PromptCacheSpec, SpecError, isolated_identity, quantity_bytes

log = logging.getLogger("promptcache.operator")
UPDATE_MODES = ("InPlaceOrRecreate", "Initial", "Recreate", "Auto")


@dataclass(frozen=True)
class Config:
    interval_s: float = 60.0
    window_s: float = 300.0
    overhead_bytes: int = builders.MEMORY_OVERHEAD
    vpa_update_mode: str = "InPlaceOrRecreate"   # Initial where the cluster has no in-place pod resize
    resize_timeout_s: float = 10.0
    policy: tuning.Policy = field(default_factory=tuning.Policy)
    # The operator's identity towards secured sidecars (Resize is an admin call): a folder with the files token,
    # ca.crt, tls.crt and tls.key, each optional (the chart mounts sidecarCredentials.secretName there).
    credentials_dir: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Config":
        d = cls()
        p = d.policy

        def f(name: str, default: float) -> float:
            return float(env.get(f"PROMPTCACHE_AUTOSCALE_{name}", default))
        mode = env.get("PROMPTCACHE_AUTOSCALE_VPA_UPDATE_MODE", d.vpa_update_mode)
        if mode not in UPDATE_MODES:
            raise ValueError(f"PROMPTCACHE_AUTOSCALE_VPA_UPDATE_MODE must be one of {', '.join(UPDATE_MODES)}")
        return cls(interval_s=f("INTERVAL_SECONDS", d.interval_s), window_s=f("WINDOW_SECONDS", d.window_s),
                   overhead_bytes=int(f("OVERHEAD_BYTES", d.overhead_bytes)), vpa_update_mode=mode,
                   resize_timeout_s=f("RESIZE_TIMEOUT_SECONDS", d.resize_timeout_s),
                   credentials_dir=env.get("PROMPTCACHE_OPERATOR_SIDECAR_CREDENTIALS_DIR") or None,
                   policy=replace(p, grow_cooldown_s=f("GROW_COOLDOWN_SECONDS", p.grow_cooldown_s),
                                  shrink_cooldown_s=f("SHRINK_COOLDOWN_SECONDS", p.shrink_cooldown_s),
                                  grow_factor=f("GROW_FACTOR", p.grow_factor),
                                  shrink_factor=f("SHRINK_FACTOR", p.shrink_factor)).validate())


# --- the tuned state (status.autoscaling) -----------------------------------------------------------------------
def overhead(spec: PromptCacheSpec, config: "Config") -> int:
    """What a sidecar's memory holds beyond its cache budget: the process's own (config.overhead_bytes) and its
    disk-tier index (spec.disk_index_bytes: the --disk-index-bytes the operator gives it)."""
    return config.overhead_bytes + spec.disk_index_bytes()


def initial_memory(spec: PromptCacheSpec, overhead: int) -> int:
    return quantity_bytes(spec.memory.host) + overhead


def bounds(spec: PromptCacheSpec, overhead: int) -> tuple[int, int]:
    start = initial_memory(spec, overhead)
    a = spec.autoscaling
    lo = quantity_bytes(a.minMemory) if a.minMemory else min(start, quantity_bytes(a.maxMemory or str(start)))
    hi = quantity_bytes(a.maxMemory) if a.maxMemory else max(start, lo)
    return lo, hi


def tuned_memory(status: dict[str, Any] | None) -> int | None:
    v = ((status or {}).get("autoscaling") or {}).get("memoryBytes")
    return int(v) if v else None


def _parse_time(text: str | None) -> float | None:
    if not text:
        return None
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _stamp(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


# --- desired children with the tuned memory ---------------------------------------------------------------------
def adjust_children(children: list[dict[str, Any]], spec: PromptCacheSpec, status: dict[str, Any] | None,
                    config: Config = Config()) -> list[dict[str, Any]]:
    """Apply the tuned memory (status.autoscaling.memoryBytes) to the desired children; unchanged when autoscaling
    is off or nothing was tuned yet. Pure.

    VPA present: minAllowed = maxAllowed = memory, updateMode as configured; the DaemonSet is left alone (the VPA
    sets the pods' resources). No VPA: the DaemonSet's memory request and limit (a rolling restart). In both cases
    the ConfigMap's budget follows, for pods that start later, but the DaemonSet's config-hash annotation keeps the
    untuned value, so a budget change alone restarts nothing (running sidecars were Resized)."""
    memory = tuned_memory(status)
    if not spec.autoscaling.enabled or memory is None:
        return children
    has_vpa = any(c["kind"] == builders.VPA[1] for c in children)
    budget = max(1, memory - overhead(spec, config))
    out = []
    for c in children:
        c = _copy(c)
        if c["kind"] == "ConfigMap" and "PROMPTCACHE_MEMORY_BYTES" in c.get("data", {}):
            c["data"]["PROMPTCACHE_MEMORY_BYTES"] = str(budget)
        elif c["kind"] == builders.VPA[1]:
            pol = c["spec"]["resourcePolicy"]["containerPolicies"][0]
            pol["minAllowed"] = {"memory": builders.format_bytes(memory)}
            pol["maxAllowed"] = {"memory": builders.format_bytes(memory)}
            c["spec"]["updatePolicy"]["updateMode"] = config.vpa_update_mode
        elif c["kind"] == "DaemonSet" and not has_vpa:
            for ct in c["spec"]["template"]["spec"]["containers"]:
                if ct["name"] == builders.CONTAINER:
                    ct["resources"]["requests"]["memory"] = builders.format_bytes(memory)
                    ct["resources"]["limits"]["memory"] = builders.format_bytes(memory)
        out.append(c)
    return out


def _copy(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v) for v in obj]
    return obj


def applied_limit(kube: Kube, owner: Owner, caps: Capabilities) -> int | None:
    """The memory limit the API server holds now: the VPA's maxAllowed, else the DaemonSet container's limit."""
    if caps.vpa:
        vpa = kube.get(builders.VPA[0], builders.VPA[1], owner.namespace, owner.name) or {}
        for p in ((vpa.get("spec") or {}).get("resourcePolicy") or {}).get("containerPolicies") or []:
            if p.get("containerName") == builders.CONTAINER and (p.get("maxAllowed") or {}).get("memory"):
                return quantity_bytes(p["maxAllowed"]["memory"])
        return None
    ds = kube.get("apps/v1", "DaemonSet", owner.namespace, owner.name) or {}
    for ct in (((ds.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers") or []:
        if ct.get("name") == builders.CONTAINER:
            lim = ((ct.get("resources") or {}).get("limits") or {}).get("memory")
            return quantity_bytes(lim) if lim else None
    return None


def effective_limits(kube: Kube, owner: Owner, caps: Capabilities,
                     eps: list[fleet_.Sidecar]) -> dict[str, int | None]:
    """Per sidecar, the limit a Resize up must fit under: its pod's own limit as the API server holds it now (read
    again here: a VPA raise is asynchronous, the VPA object says more before the pod has it), else what the API
    server holds for all of them (the VPA's maxAllowed or the DaemonSet's limit)."""
    pods = {s.pod: s.memory_limit for s in fleet_.discover(kube, owner) or [] if s.memory_limit is not None}
    shared = applied_limit(kube, owner, caps)
    return {e.pod: pods.get(e.pod, shared) for e in eps}


# --- Resize over gRPC, with the generated promptcache.v1 messages (protobuf only: no torch, no sidecar code) ------
RESIZE_METHOD = "/promptcache.v1.KVCache/Resize"


class ResizeError(Exception):
    pass


def _credential(directory: str | None, name: str) -> bytes | None:
    """One file of the credentials folder, read on every call (a rotated Secret applies at once), or None."""
    if not directory:
        return None
    try:
        with open(os.path.join(directory, name), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ResizeError(f"reading {name} of the sidecar credentials ({directory}): {exc.strerror}") from None


def credentials_policy(spec: PromptCacheSpec, defaults: OperatorDefaults) -> tuple[bool, str | None]:
    """Pure: (whether a Resize to this cache's sidecars carries the operator's credentials, why this cache's
    Resizes are skipped or None). The credentials (chart sidecarCredentials: a token and client certificate that
    are an admin tenant of every cache that authenticates) go only where the sidecars authenticate callers
    (model.isolated_identity: a tokens Secret or mTLS), over TLS, and only to pods running the operator's own
    sidecar image: a PromptCache's spec.image is its creator's choice, and whatever listens on the pod's port
    would receive them. A cache whose sidecars do not authenticate gets its Resize without them (it needs none);
    one that authenticates otherwise is skipped (docs/autoscaling.md, docs/security.md)."""
    sec = spec.security
    if not isolated_identity(sec):
        return False, None
    if sec.tls is None:
        return False, ("the sidecars authenticate callers (spec.security.tokens) but serve without TLS "
                       "(spec.security.tls): the operator does not send its credentials in plaintext")
    repo = spec.image.repository or defaults.image_repository
    if repo != defaults.image_repository:
        return False, (f"the sidecars run spec.image.repository {repo}, not the operator's sidecar image "
                       f"{defaults.image_repository}: the operator sends its credentials only to its own image")
    return True, None


def grpc_resize(target: str, budget_bytes: int, timeout: float, *, tls: bool = False,
                server_name: str | None = None, credentials_dir: str | None = None,
                send_credentials: bool = True) -> dict[str, int]:
    """promptcache.v1.KVCache/Resize(memory_bytes) -> {previous_bytes, memory_bytes, evicted_chunks, bytes_used}.

    With `tls`, the sidecar's certificate is verified against ca.crt of `credentials_dir` (the system roots without
    it) for `server_name` (the cache's Service name: pods are dialled by IP), and tls.crt/tls.key are presented
    for mTLS; a token file becomes the bearer token, sent only over TLS (never in plaintext). With
    `send_credentials` False (credentials_policy) neither token nor client certificate is sent; ca.crt still
    verifies the sidecar. The operator's tenant must be in the sidecars' --admin-tenants (the operator sets it on
    every cache that authenticates)."""
    try:  # the operator's only gRPC use; imported here so the rest runs without grpcio or protobuf
        import grpc
        from promptcache.v1 import kvcache_pb2 as pb
    except ImportError as exc:
        raise ResizeError(f"cannot call Resize: {exc} (the operator image needs grpcio, protobuf and the "
                          "promptcache.v1 stubs)") from None

    try:
        request = pb.ResizeRequest(memory_bytes=budget_bytes)
    except (TypeError, ValueError) as exc:   # not an int64
        raise ResizeError(f"{target}: budget {budget_bytes!r}: {exc}") from None
    token = _credential(credentials_dir, "token") if tls and send_credentials else None
    metadata = [("authorization", "Bearer " + token.decode().strip())] if token else None
    if tls:
        own = send_credentials
        creds = grpc.ssl_channel_credentials(root_certificates=_credential(credentials_dir, "ca.crt"),
                                             private_key=_credential(credentials_dir, "tls.key") if own else None,
                                             certificate_chain=_credential(credentials_dir, "tls.crt") if own
                                             else None)
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        channel = grpc.secure_channel(target, creds, options=options)
    else:
        channel = grpc.insecure_channel(target)
    with channel as ch:
        call = ch.unary_unary(RESIZE_METHOD, request_serializer=pb.ResizeRequest.SerializeToString,
                              response_deserializer=pb.ResizeResponse.FromString)
        try:
            r = call(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as exc:
            raise ResizeError(f"{target}: {exc.code().name}: {exc.details()}") from None
    return {"previous_bytes": r.previous_bytes, "memory_bytes": r.memory_bytes, "evicted_chunks": r.evicted_chunks,
            "bytes_used": r.bytes_used}


# --- one tick ---------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    decision: tuning.Decision | None = None
    signal: tuning.Signal | None = None
    memory_bytes: int | None = None          # recorded memory after this tick
    steps: list[str] = field(default_factory=list)   # what was done, in order (tests check the ordering)
    errors: list[str] = field(default_factory=list)


Resizer = Callable[[str, int, float], dict[str, int]]


def tick(kube: Kube, body: dict[str, Any], fleet: fleet_.Fleet, config: Config = Config(),
         defaults: OperatorDefaults = OperatorDefaults(), resizer: Resizer | None = None, source: Any = None,
         now: Callable[[], float] = time.time) -> Outcome:
    """One autoscaling step for one PromptCache (body: the object as read from the API server). The sidecars and
    their budgets come from the fleet's observation (the one the status reads); the signal from `source`
    (`signal(observation) -> (Signal | None, {pod: Counters})`): the fleet itself unless a Prometheus source."""
    source = fleet if source is None else source
    out = Outcome()
    md = body["metadata"]
    owner = Owner(md["name"], md["namespace"], md["uid"])
    try:
        spec = PromptCacheSpec.from_dict(body.get("spec") or {})
    except SpecError:
        return out
    if not spec.autoscaling.enabled:
        return out
    status = body.get("status") or {}
    state = dict(status.get("autoscaling") or {})
    # Why this cache's Resizes are not sent, as last reported (a ResizeSkipped event) and kept in
    # status.autoscaling.resizeSkipped: the event is posted when the reason first appears or changes, not on
    # every tick, and the field goes once Resizes are sent again.
    reported = state.get("resizeSkipped")
    skip: str | None = None
    if resizer is None:  # TLS and credentials as this cache's sidecars expect them, where credentials_policy allows
        send, skip = credentials_policy(spec, defaults)
        if skip:
            tried = False

            def resizer(target: str, budget: int, timeout: float) -> dict[str, int]:
                nonlocal tried
                if not tried and state.get("resizeSkipped") != skip:
                    tried = True
                    _event(kube, owner, "Warning", "ResizeSkipped", f"Resize not sent: {skip}", out)
                    if "event ResizeSkipped" in out.steps:   # posted: recorded, so the next tick does not repeat it
                        state["resizeSkipped"] = skip
                        _patch_status(kube, owner, state, out)
                raise ResizeError(f"{target}: not sent: {skip}")
        else:
            resizer = functools.partial(grpc_resize, tls=spec.security.tls is not None,
                                        server_name=f"{owner.name}.{owner.namespace}.svc",
                                        credentials_dir=config.credentials_dir, send_credentials=send)
    if skip is None and reported is not None:   # Resizes are sent again: the skip is over
        state["resizeSkipped"] = None   # (null removes it: the status is merge-patched)
        _patch_status(kube, owner, state, out)
        if "status" in out.steps:
            del state["resizeSkipped"]
    # Every Resize of this tick is skipped for the reason already reported: a failed shrink says nothing new.
    skip_known = skip is not None and skip == reported
    lo, hi = bounds(spec, overhead(spec, config))
    current = tuned_memory(status) or initial_memory(spec, overhead(spec, config))
    out.memory_bytes = current
    caps = kube.capabilities()

    obs = fleet.observe(kube, owner)
    eps = obs.ready
    signal, latest = source.signal(obs)
    out.signal = signal

    # Level-based: bring every sidecar's budget to the recorded memory (a grow whose Resize was pending, a pod
    # that started with an older ConfigMap). Down at once; up only under a limit that already covers it.
    want_budget = max(1, current - overhead(spec, config))
    limits: dict[str, int | None] | None = None
    # One pod's figures (a budget that is not finite: treated as unknown, like a pod that did not answer) or
    # failure never stops the others'.
    for e in eps:
        c = latest.get(e.pod)
        if c is None or not e.grpc_target or not math.isfinite(c.budget_bytes) or int(c.budget_bytes) == want_budget:
            continue
        try:
            if c.budget_bytes < want_budget:
                limits = effective_limits(kube, owner, caps, eps) if limits is None else limits
                if (limits.get(e.pod) or 0) < current:
                    out.steps.append(f"wait-limit {e.pod}")
                    continue
            _resize(e, want_budget, config, resizer, out)
        except ApiError:   # the API server's, not the pod's: as before, the tick's caller handles it
            raise
        except Exception as exc:   # noqa: BLE001 - the next pod still gets its budget
            out.errors.append(f"budget {e.pod}: {exc!r}")
            log.warning("bringing %s to its budget: %r", e.pod, exc)

    if signal is None:
        return out
    signal = tuning.sanitize(signal)   # every figure finite: decide() reads it so, and the status takes no Infinity
    out.signal = signal
    policy = tuning.policy_for(spec.autoscaling.targetHitRatio, config.policy)
    t = now()
    d = tuning.decide(signal, current, lo, hi, policy, _parse_time(state.get("lastChangeTime")), t,
                      overhead=overhead(spec, config))
    out.decision = d
    record = {"action": d.action, "reason": d.reason, "message": d.message, "time": _stamp(t),
              "fromBytes": current, "toBytes": d.memory_bytes,
              "hitRatio": None if signal.hit_ratio is None else round(signal.hit_ratio, 4),
              "capacityEvictionsPerSecond": round(signal.capacity_evictions_per_s, 4)}

    if d.action == tuning.HOLD:
        prev = state.get("lastDecision") or {}
        if (prev.get("action"), prev.get("reason")) != (d.action, d.reason) or "memoryBytes" not in state:
            state.update({"memoryBytes": current, "lastDecision": record})
            _patch_status(kube, owner, state, out)
        return out

    new_budget = max(1, d.memory_bytes - overhead(spec, config))
    if d.action == tuning.SHRINK:
        ok = all(_resize(e, new_budget, config, resizer, out) for e in eps if e.grpc_target)
        if not ok:
            if not skip_known:
                _event(kube, owner, "Warning", "ResizeFailed", f"shrink to {d.memory_bytes} postponed: "
                       + "; ".join(out.errors), out)
            return out
        state.update({"memoryBytes": d.memory_bytes, "budgetBytes": new_budget, "lastChangeTime": _stamp(t),
                      "lastDecision": record})
        _patch_status(kube, owner, state, out)
        _apply_limits(kube, owner, spec, caps, defaults, {**status, "autoscaling": state}, config, out)
    else:  # grow
        state.update({"memoryBytes": d.memory_bytes, "budgetBytes": new_budget, "lastChangeTime": _stamp(t),
                      "lastDecision": record})
        _patch_status(kube, owner, state, out)
        _apply_limits(kube, owner, spec, caps, defaults, {**status, "autoscaling": state}, config, out)
        limits = effective_limits(kube, owner, caps, eps)
        for e in eps:
            if not e.grpc_target:
                continue
            if (limits.get(e.pod) or 0) >= d.memory_bytes:
                _resize(e, new_budget, config, resizer, out)
            else:
                out.steps.append(f"wait-limit {e.pod}")
    out.memory_bytes = d.memory_bytes
    _event(kube, owner, "Normal", d.reason, d.message, out)
    return out


def _resize(e: fleet_.Sidecar, budget: int, config: Config, resizer: Resizer, out: Outcome) -> bool:
    try:
        r = resizer(e.grpc_target, budget, config.resize_timeout_s)
        out.steps.append(f"resize {e.pod} {budget}")
        log.info("resized %s to %d (evicted %d chunks)", e.pod, budget, r.get("evicted_chunks", 0))
        return True
    except (ResizeError, OSError) as exc:
        out.errors.append(f"Resize {e.pod}: {exc}")
        log.warning("Resize %s to %d: %s", e.pod, budget, exc)
        return False


def _apply_limits(kube: Kube, owner: Owner, spec: PromptCacheSpec, caps: Capabilities, defaults: OperatorDefaults,
                  status: dict[str, Any], config: Config, out: Outcome) -> None:
    children = adjust_children(builders.desired_children(spec, owner, caps, defaults), spec, status, config)
    kinds = {"ConfigMap", builders.VPA[1] if caps.vpa else "DaemonSet"}
    for c in children:
        if c["kind"] in kinds:
            try:
                kube_.apply_controlled(kube, c, owner.uid)
                out.steps.append(f"apply {c['kind']}")
            except ApiError as exc:
                out.errors.append(f"apply {c['kind']}: {exc.message}")
            except kube_.NameConflict as exc:   # reported by reconcile (Degraded NameConflict)
                out.errors.append(exc.message)


def _patch_status(kube: Kube, owner: Owner, state: dict[str, Any], out: Outcome) -> None:
    try:
        kube.patch_status(owner.namespace, owner.name, {"autoscaling": state})
        out.steps.append("status")
    except ApiError as exc:
        out.errors.append(f"status: {exc.message}")


def _event(kube: Kube, owner: Owner, type_: str, reason: str, message: str, out: Outcome) -> None:
    t = _stamp(time.time())
    ev = {"apiVersion": "v1", "kind": "Event",
          "metadata": {"generateName": f"{owner.name}.autoscaling-", "namespace": owner.namespace},
          "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": owner.name,
                             "namespace": owner.namespace, "uid": owner.uid},
          "reason": reason, "message": message[:1024], "type": type_, "source": {"component": "promptcache-autoscaler"},
          "firstTimestamp": t, "lastTimestamp": t, "count": 1}
    try:
        kube.request("POST", f"/api/v1/namespaces/{owner.namespace}/events", body=ev)
        out.steps.append(f"event {reason}")
    except ApiError as exc:
        out.errors.append(f"event: {exc.message}")
