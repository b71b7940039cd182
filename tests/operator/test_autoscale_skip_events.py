"""A cache whose Resizes credentials_policy skips gets one ResizeSkipped Warning per reason, not one per autoscaler
tick (an event storm for on-call): what was reported is kept in status.autoscaling.resizeSkipped, which the next
tick reads, and goes once Resizes are sent again. The status round-trips through a merge patch and the CRD's
structural schema (the API server prunes fields the schema does not declare)."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from promptcache.operator import autoscale
from promptcache.operator.builders import OperatorDefaults
from test_autoscale_tick import CFG, IDLE, LOW, FakeKube, FixedSource, Gi, Mi, body, unscraped

ROOT = Path(__file__).resolve().parents[2]
TLS_TOKENS = {"tls": {"secretName": "tls"}, "tokens": {"secretName": "tokens"}}
TENANT_IMAGE = {"repository": "registry.example/x"}


def _status_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / "promptcache.io_promptcaches.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]


def prune(value: Any, schema: dict[str, Any]) -> Any:
    """What the API server keeps of `value` under a structural schema (unknown fields dropped)."""
    if isinstance(value, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
        props = schema.get("properties") or {}
        return {k: prune(v, props[k]) for k, v in value.items() if k in props}
    if isinstance(value, list) and "items" in schema:
        return [prune(v, schema["items"]) for v in value]
    return value


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


class ApiServerLike(FakeKube):
    """Status merge-patched and pruned by the CRD's schema, as the API server stores it."""

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        self.status = prune(merge_patch(self.status, status), _status_schema())
        return {"status": self.status}


def tick(kube: ApiServerLike, spec_patch: dict[str, Any], signal=IDLE, budget: int = 8 * Gi):
    b = body()
    b["spec"].update(spec_patch)
    b["status"] = copy.deepcopy(kube.status)   # what the API server holds: the next tick reads what was written
    return autoscale.tick(kube, b, unscraped(), CFG, OperatorDefaults(), None, source=FixedSource(signal, budget))


def reasons(kube: FakeKube) -> list[str]:
    return [e["reason"] for e in kube.events]


@pytest.mark.parametrize("signal,budget", [(IDLE, 8 * Gi), (LOW, 4 * Gi - 512 * Mi)])
def test_one_resize_skipped_event_per_reason_not_per_tick(signal, budget):
    kube = ApiServerLike(vpa=True)
    for _ in range(6):
        out = tick(kube, {"security": TLS_TOKENS, "image": TENANT_IMAGE}, signal, budget)
        assert out.errors and all("not sent" in e or "Resize" in e for e in out.errors)
    assert reasons(kube).count("ResizeSkipped") == 1
    assert reasons(kube).count("ResizeFailed") <= 1      # the postponed shrink is said once too
    assert "registry.example/x" in kube.status["autoscaling"]["resizeSkipped"]
    # Another reason: reported once more.
    kube.events.clear()
    for _ in range(4):
        tick(kube, {"security": {"tokens": {"secretName": "tokens"}}}, signal, budget)
    assert reasons(kube).count("ResizeSkipped") == 1
    assert "without TLS" in kube.status["autoscaling"]["resizeSkipped"]


def test_the_skip_is_cleared_once_resizes_are_sent_and_reported_again_when_it_returns(monkeypatch):
    sent: list[tuple[str, int]] = []

    def fake_grpc_resize(target, budget, timeout, **kw):
        sent.append((target, budget))
        return {"evicted_chunks": 0}
    monkeypatch.setattr(autoscale, "grpc_resize", fake_grpc_resize)
    kube = ApiServerLike(vpa=True)
    tick(kube, {"security": TLS_TOKENS, "image": TENANT_IMAGE})
    tick(kube, {"security": TLS_TOKENS, "image": TENANT_IMAGE})
    assert reasons(kube).count("ResizeSkipped") == 1 and "resizeSkipped" in kube.status["autoscaling"]
    assert not sent

    tick(kube, {"security": TLS_TOKENS})            # the operator's own image: Resizes go out again
    assert sent and "resizeSkipped" not in kube.status["autoscaling"]
    assert kube.status["autoscaling"]["memoryBytes"]   # the rest of the autoscaling status stays

    kube.events.clear()
    tick(kube, {"security": TLS_TOKENS, "image": TENANT_IMAGE})
    tick(kube, {"security": TLS_TOKENS, "image": TENANT_IMAGE})
    assert reasons(kube).count("ResizeSkipped") == 1   # a new episode is reported again, once


def test_every_autoscaling_status_field_is_in_the_crd_schema():
    """The API server drops status fields the CRD does not declare: what tick() records must survive that."""
    kube = ApiServerLike(vpa=True)
    def unpruned(ns, name, st):
        kube.status = merge_patch(kube.status, st)
    kube.patch_status = unpruned
    tick(kube, {"security": TLS_TOKENS, "image": TENANT_IMAGE})
    tick(kube, {"security": TLS_TOKENS, "image": TENANT_IMAGE}, LOW, 4 * Gi - 512 * Mi)   # a grow: all fields
    written = copy.deepcopy(kube.status)
    assert "resizeSkipped" in written["autoscaling"] and "lastDecision" in written["autoscaling"]
    assert prune(written, _status_schema()) == written
