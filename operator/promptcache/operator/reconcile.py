"""One level-based reconcile of a PromptCache: apply desired children, prune unwanted optional ones, write status.

Idempotent: running it twice, or in two processes, or after a crash half-way, ends in the same state, because
every child is written by server-side apply with the same field manager and fully computed desired state.
"""
from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field
from typing import Any

from . import autoscale, builders
from .builders import OPTIONAL_CRDS, Capabilities, OperatorDefaults, Owner
from .fleet import Fleet
from .kube import ApiError, Kube, NameConflict, apply_controlled, delete_controlled
from .model import PromptCacheSpec, SpecError

log = logging.getLogger("promptcache.operator")


@dataclass
class Outcome:
    applied: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)  # children whose name another object holds (untouched)
    status: dict[str, Any] = field(default_factory=dict)
    invalid_spec: bool = False  # retrying cannot help until the spec changes


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def condition(type_: str, ok: bool | None, reason: str, message: str, generation: int) -> dict[str, Any]:
    return {"type": type_, "status": "Unknown" if ok is None else ("True" if ok else "False"),
            "reason": reason, "message": message, "observedGeneration": generation}


def merge_conditions(old: list[dict[str, Any]], new: list[dict[str, Any]], stamp: str) -> list[dict[str, Any]]:
    """Keep lastTransitionTime when a condition's status did not change."""
    before = {c.get("type"): c for c in old or []}
    out = []
    for c in new:
        prev = before.get(c["type"])
        t = prev.get("lastTransitionTime") if prev and prev.get("status") == c["status"] else None
        out.append({**c, "lastTransitionTime": t or stamp})
    return out


def _refused(ds: dict[str, Any] | None, events: list[dict[str, Any]], words: str) -> str | None:
    """Pure: the latest FailedCreate event of the DaemonSet whose message has `words`, as "N/M sidecar pods not
    created: <the API server's message>", or None. Only while pods are missing (currentNumberScheduled <
    desiredNumberScheduled): an old refusal after the cause was fixed says nothing."""
    st = (ds or {}).get("status") or {}
    desired, current = int(st.get("desiredNumberScheduled") or 0), int(st.get("currentNumberScheduled") or 0)
    if current >= desired:
        return None
    refused = [e for e in events if e.get("reason") == "FailedCreate" and words in (e.get("message") or "")]
    if not refused:
        return None
    latest = max(refused, key=lambda e: e.get("lastTimestamp") or e.get("eventTime")
                 or (e.get("metadata") or {}).get("creationTimestamp") or "")
    msg = latest["message"].removeprefix("Error creating: ")
    return f"{desired - current}/{desired} sidecar pods not created: {msg}"


def quota_exceeded(ds: dict[str, Any] | None, events: list[dict[str, Any]]) -> str | None:
    """Pure: why sidecar pods are missing because a ResourceQuota refused them, or None. `events` are the
    DaemonSet's FailedCreate events (the DaemonSet controller records the API server's refusal there; the DaemonSet
    status has no condition for it). Only while pods are missing (currentNumberScheduled < desiredNumberScheduled):
    an old refusal after the quota was raised says nothing."""
    return _refused(ds, events, "exceeded quota")


def pod_security_refused(spec: PromptCacheSpec, ds: dict[str, Any] | None,
                         events: list[dict[str, Any]]) -> str | None:
    """Pure: why sidecar pods are missing because the namespace's Pod Security level refused them (as
    quota_exceeded), or None. With spec.zeroCopy the message says which level its hostPath needs."""
    msg = _refused(ds, events, "violates PodSecurity")
    if msg and spec.zeroCopy.hostPath:
        msg += (" (spec.zeroCopy.hostPath mounts a hostPath and runs a root init container: the namespace needs "
                "the privileged Pod Security level, docs/operator.md)")
    return msg


def compute_conditions(spec: PromptCacheSpec, generation: int, caps: Capabilities, ds: dict[str, Any] | None,
                       errors: list[str], priority_class_ok: bool,
                       quota: str | None = None, pod_security: str | None = None,
                       conflicts: list[str] | tuple[str, ...] = (),
                       defaults: OperatorDefaults = OperatorDefaults()
                       ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Pure: what the conditions and node counts say, given what the API server returned. `quota`: what
    quota_exceeded() found (a ResourceQuota refusing sidecar pods), or None; `pod_security`: what
    pod_security_refused() found; `conflicts`: NameConflict messages (children not applied because an object
    this PromptCache does not control holds the name); `defaults`: the operator's (its default PriorityClass)."""
    ds_status = (ds or {}).get("status") or {}
    ds_gen = ((ds or {}).get("metadata") or {}).get("generation")
    observed = ds_status.get("observedGeneration")
    desired = int(ds_status.get("desiredNumberScheduled") or 0)
    ready = int(ds_status.get("numberReady") or 0)
    updated = int(ds_status.get("updatedNumberScheduled") or 0)
    conds = []

    if ds is None:
        prog = condition("Progressing", True, "Applying", "the DaemonSet has not been created yet", generation)
    elif observed is None or (ds_gen is not None and observed < ds_gen):
        prog = condition("Progressing", True, "WaitingForDaemonSetController",
                         f"DaemonSet generation {ds_gen} not yet observed by the DaemonSet controller", generation)
    elif updated < desired or ready < desired:
        prog = condition("Progressing", True, "RollingOut",
                         f"{updated}/{desired} sidecars updated, {ready}/{desired} ready", generation)
    else:
        prog = condition("Progressing", False, "RolloutComplete", f"{ready}/{desired} sidecars ready", generation)
    progressing = prog["status"] == "True"

    degraded_reasons = []
    if errors:
        degraded_reasons.append(("ApplyFailed", "; ".join(errors)))
    if conflicts:
        degraded_reasons.append(("NameConflict", "; ".join(conflicts)))
    if not priority_class_ok:
        pc = builders.priority_class_name(spec, defaults)
        whose = ("" if spec.placement.priorityClassName else
                 " (the operator's default, chart value priorityClass.name: spec.placement.priorityClassName is "
                 "unset)")
        degraded_reasons.append(("PriorityClassNotFound",
                                 f"PriorityClass {pc}{whose} does not exist; the API server rejects the cache pods "
                                 "until it does (the chart installs it)"))
    if quota:
        degraded_reasons.append(("QuotaExceeded", quota))
    if pod_security:
        degraded_reasons.append(("PodSecurityViolation", pod_security))
    if spec.autoscaling.enabled and not caps.vpa:
        degraded_reasons.append(("OptionalCRDMissing",
                                 f"spec.autoscaling.enabled is true but {OPTIONAL_CRDS['VerticalPodAutoscaler']} "
                                 "is not installed"))
    if degraded_reasons:
        deg = condition("Degraded", True, degraded_reasons[0][0], "; ".join(m for _, m in degraded_reasons),
                        generation)
    else:
        deg = condition("Degraded", False, "AsExpected", "all children applied", generation)

    if degraded_reasons and degraded_reasons[0][0] in ("ApplyFailed", "NameConflict", "PriorityClassNotFound",
                                                        "QuotaExceeded", "PodSecurityViolation"):
        rdy = condition("Ready", False, degraded_reasons[0][0], deg["message"], generation)
    elif progressing:
        rdy = condition("Ready", False, prog["reason"], prog["message"], generation)
    elif desired == 0:
        rdy = condition("Ready", False, "NoMatchingNodes",
                        f"no node matches the node selector {spec.placement.nodeSelector}", generation)
    else:
        rdy = condition("Ready", True, "AllSidecarsReady", f"{ready}/{desired} sidecars ready", generation)
    conds += [rdy, prog, deg]

    crd = OPTIONAL_CRDS["VerticalPodAutoscaler"]
    if caps.vpa:
        mode = "Recreate" if spec.autoscaling.enabled else "Off (recommendations only)"
        conds.append(condition("Autoscaling", True, "VerticalPodAutoscalerApplied", f"updateMode {mode}",
                               generation))
    else:
        conds.append(condition("Autoscaling", False, "CRDNotInstalled",
                               f"{crd} is not installed: no VerticalPodAutoscaler created", generation))
    missing = [OPTIONAL_CRDS[k] for k, ok in (("ServiceMonitor", caps.service_monitor),
                                              ("PrometheusRule", caps.prometheus_rule)) if not ok]
    if missing:
        conds.append(condition("Monitoring", False, "CRDNotInstalled",
                               f"{', '.join(missing)} not installed: no "
                               f"{' or '.join(m.split('.')[0] for m in missing)} created", generation))
    else:
        conds.append(condition("Monitoring", True, "Applied",
                               "ServiceMonitor applied" + (", PrometheusRule applied" if spec.alerts.enabled
                                                           else ", alerts disabled"), generation))
    return conds, {"desiredNodes": desired, "readyNodes": ready}


def reconcile(kube: Kube, body: dict[str, Any], defaults: OperatorDefaults = OperatorDefaults(),
              fleet: Fleet | None = None, autoscaling: autoscale.Config = autoscale.Config()) -> Outcome:
    """`fleet`: where the status reads the sidecars from (shared with the autoscaler; a fresh one when None)."""
    md = body["metadata"]
    owner = Owner(name=md["name"], namespace=md["namespace"], uid=md["uid"])
    generation = int(md.get("generation") or 1)
    old_status = body.get("status") or {}
    out = Outcome()
    stamp = now()

    try:
        spec = PromptCacheSpec.from_dict(body.get("spec") or {})
        builders.check_operator_policy(spec, defaults)
    except SpecError as exc:
        conds = [condition("Ready", False, "InvalidSpec", str(exc), generation),
                 condition("Progressing", False, "InvalidSpec", str(exc), generation),
                 condition("Degraded", True, "InvalidSpec", str(exc), generation)]
        out.errors.append(str(exc))
        out.invalid_spec = True
        out.status = {"observedGeneration": generation,
                      "conditions": merge_conditions(old_status.get("conditions"), conds, stamp)}
        _write_status(kube, owner, old_status, out.status)
        return out

    caps = kube.capabilities()
    children = builders.desired_children(spec, owner, caps, defaults)
    # Memory tuned by the autoscaler (status.autoscaling) replaces the spec-derived limits and budget.
    children = autoscale.adjust_children(children, spec, old_status, autoscaling)
    ds = master = None
    for child in children:
        key = builders.child_key(child)
        try:
            res = apply_controlled(kube, child, owner.uid)
            out.applied.append(key)
            if child["kind"] == "DaemonSet":
                ds = res
            elif key == f"Deployment/{builders.master_name(owner)}":
                master = res
        except ApiError as exc:
            if exc.status == 404 and child["apiVersion"] in (builders.VPA[0], builders.SERVICE_MONITOR[0]):
                kube.capabilities(refresh=True)  # the CRD went away since we looked
            out.errors.append(f"{key}: {exc.message}")
            log.warning("apply %s/%s %s failed: %s", owner.namespace, owner.name, key, exc)
        except NameConflict as exc:
            out.conflicts.append(exc.message)
            log.warning("%s/%s: %s", owner.namespace, owner.name, exc.message)

    # Prune optional children that are no longer wanted (e.g. alerts disabled): those we know by name, and only
    # if this PromptCache controls them (an object of that name someone else made is not ours to delete).
    wanted = {builders.child_key(c) for c in children}
    for (api_version, kind), present in ((builders.PROMETHEUS_RULE, caps.prometheus_rule),
                                         (builders.SERVICE_MONITOR, caps.service_monitor),
                                         (builders.VPA, caps.vpa)):
        key = f"{kind}/{owner.name}"
        if present and key not in wanted:
            try:
                if delete_controlled(kube, api_version, kind, owner.namespace, owner.name, owner.uid):
                    out.deleted.append(key)
            except ApiError as exc:
                out.errors.append(f"delete {key}: {exc.message}")
    # The cluster tier's master (spec.cluster) and its NetworkPolicies go when the tier is turned off.
    master_name = builders.master_name(owner)
    for api_version, kind, name in (("apps/v1", "Deployment", master_name), ("v1", "Service", master_name),
                                    (*builders.NETWORK_POLICY, master_name), (*builders.NETWORK_POLICY, owner.name)):
        key = f"{kind}/{name}"
        if key not in wanted and key in (old_status.get("children") or ()):
            try:
                if delete_controlled(kube, api_version, kind, owner.namespace, name, owner.uid):
                    out.deleted.append(key)
            except ApiError as exc:
                out.errors.append(f"delete {key}: {exc.message}")

    ds_status = (ds or {}).get("status") or {}
    # Unknown (no ready sidecar answered): null removes stale values from the status.
    usage: dict[str, Any] = {"hitRatio": None, "anyTierHitRatio": None, "memoryBytes": None}
    nodes: list[dict[str, Any]] = []
    if ds_status.get("desiredNumberScheduled") or ds_status.get("currentNumberScheduled"):
        obs = (fleet or Fleet()).observe(kube, owner)
        nodes = obs.nodes()
        usage.update(obs.usage())
    # (no pod scheduled anywhere: nothing to list or scrape)
    priority_class = builders.priority_class_name(spec, defaults)
    pc_ok = kube.priority_class_exists(priority_class)
    quota = pod_security = None
    if int(ds_status.get("currentNumberScheduled") or 0) < int(ds_status.get("desiredNumberScheduled") or 0):
        failed = kube.failed_creates(owner.namespace, "DaemonSet", owner.name)
        quota = quota_exceeded(ds, failed)
        pod_security = pod_security_refused(spec, ds, failed)
    conds, counts = compute_conditions(spec, generation, caps, ds, out.errors, pc_ok, quota, pod_security,
                                       out.conflicts, defaults)
    out.status = {
        "observedGeneration": generation,
        **counts,
        "nodes": nodes,
        **usage,
        "children": sorted(out.applied),
        # The PriorityClass the cache pods run with (spec.placement.priorityClassName or the operator's default).
        "priorityClassName": priority_class,
        # The cluster tier's master: whether its Deployment has a ready replica (null: the tier is off).
        "clusterMasterReady": (bool(((master or {}).get("status") or {}).get("readyReplicas"))
                               if spec.cluster.enabled else None),
        "conditions": merge_conditions(old_status.get("conditions"), conds, stamp),
    }
    _write_status(kube, owner, old_status, out.status)
    log.info("reconciled %s/%s generation %d: %d applied, %d deleted, %d errors, %d name conflicts",
             owner.namespace, owner.name, generation, len(out.applied), len(out.deleted), len(out.errors),
             len(out.conflicts))
    return out


def _write_status(kube: Kube, owner: Owner, old: dict[str, Any], new: dict[str, Any]) -> None:
    """Patch status only when something besides timestamps changed (no churn on every timer tick)."""
    def strip(s: dict[str, Any]) -> dict[str, Any]:
        s = {k: v for k, v in s.items() if k in new and v is not None}
        s["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                           for c in s.get("conditions") or []]
        return s
    if strip(old) == strip(new):
        return
    try:
        kube.patch_status(owner.namespace, owner.name, new)
    except ApiError as exc:
        if exc.status != 404:  # deleted meanwhile: nothing to report to
            raise
