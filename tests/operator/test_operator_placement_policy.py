"""spec.placement may not tolerate every taint or put the cache's pods on control-plane nodes unless the operator's
configuration allows it (chart value allowControlPlanePlacement): refused like the other operator policies
(InvalidSpec, naming the field), allowed with the setting; the chart carries the setting to the operator."""
from __future__ import annotations

import re
from typing import Any

import pytest

from promptcache.operator import builders
from promptcache.operator.builders import OperatorDefaults
from promptcache.operator.model import PromptCacheSpec, SpecError
from promptcache.operator.reconcile import reconcile
from test_operator_builders import example

CP = "node-role.kubernetes.io/control-plane"


def _spec(placement: dict[str, Any]) -> PromptCacheSpec:
    base = example("minimal")["spec"]
    return PromptCacheSpec.from_dict({**base, "placement": {**(base.get("placement") or {}), **placement}})


def _required(*exprs: dict[str, Any]) -> dict[str, Any]:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "nvidia.com/gpu.present", "operator": "Exists"}]},
                              {"matchExpressions": list(exprs)}]}}}


REFUSED = [
    ({"tolerations": [{"operator": "Exists"}]}, "spec.placement.tolerations[0] (operator Exists with no key)"),
    ({"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}, {"operator": "Exists", "effect": "NoSchedule"}]},
     "spec.placement.tolerations[1]"),
    ({"tolerations": [{"key": CP, "operator": "Exists", "effect": "NoSchedule"}]}, "spec.placement.tolerations[0]"),
    ({"tolerations": [{"key": "node-role.kubernetes.io/master", "operator": "Exists"}]},
     "spec.placement.tolerations[0]"),
    ({"nodeSelector": {CP: ""}}, f"spec.placement.nodeSelector selects control-plane nodes ({CP})"),
    ({"affinity": _required({"key": CP, "operator": "Exists"})},
     "spec.placement.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[1]"
     ".matchExpressions[0]"),
    ({"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": {"matchExpressions": [{"key": CP, "operator": "In", "values": [""]}]}}]}}},
     "spec.placement.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].preference"),
]

ALLOWED = [
    {},
    {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                     {"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}]},
    {"affinity": _required({"key": CP, "operator": "DoesNotExist"})},          # keeps pods off the control plane
    {"affinity": _required({"key": CP, "operator": "NotIn", "values": [""]})},
    {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": "not a term list"}}},
    {"nodeSelector": {"nvidia.com/gpu.present": "true", "node-role.kubernetes.io/worker": ""}},
]


@pytest.mark.parametrize("placement,field", REFUSED)
def test_control_plane_placement_is_refused_naming_the_field(placement, field):
    with pytest.raises(SpecError, match=re.escape(field) + ".*not allowed by this operator.*"
                                        "allowControlPlanePlacement"):
        builders.check_operator_policy(_spec(placement), OperatorDefaults())
    builders.check_operator_policy(_spec(placement), OperatorDefaults(allow_control_plane_placement=True))


@pytest.mark.parametrize("placement", ALLOWED)
def test_other_placements_are_allowed(placement):
    builders.check_operator_policy(_spec(placement), OperatorDefaults())


def test_the_full_example_is_allowed():
    builders.check_operator_policy(PromptCacheSpec.from_dict(example("full")["spec"]), OperatorDefaults())


def test_reconcile_reports_invalid_spec_and_creates_nothing():
    class Kube:
        def __init__(self):
            self.calls: list[str] = []
            self.status: dict[str, Any] = {}

        def patch_status(self, namespace, name, status):
            self.status = status

        def __getattr__(self, name):
            self.calls.append(name)
            raise AssertionError(f"unexpected {name}")
    kube = Kube()
    body = {"metadata": {"name": "c", "namespace": "ns", "uid": "u", "generation": 1},
            "spec": {**example("minimal")["spec"], "placement": {"tolerations": [{"operator": "Exists"}]}}}
    out = reconcile(kube, body)
    assert out.invalid_spec and not kube.calls
    ready = next(c for c in kube.status["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "InvalidSpec" and "spec.placement.tolerations[0]" in ready["message"]


@pytest.mark.parametrize("raw,want", [(None, False), ("", False), ("false", False), ("true", True), ("1", True),
                                      ("TRUE", True), ("0", False)])
def test_the_setting_from_the_chart_environment(raw, want):
    env = {} if raw is None else {"PROMPTCACHE_OPERATOR_ALLOW_CONTROL_PLANE_PLACEMENT": raw}
    assert OperatorDefaults.from_env(env).allow_control_plane_placement is want


def test_a_bad_setting_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match="PROMPTCACHE_OPERATOR_ALLOW_CONTROL_PLANE_PLACEMENT"):
        OperatorDefaults.from_env({"PROMPTCACHE_OPERATOR_ALLOW_CONTROL_PLANE_PLACEMENT": "maybe"})


@pytest.mark.tools
@pytest.mark.parametrize("value,want", [(None, "false"), ("true", "true")])
def test_the_chart_sets_the_operators_environment(helm_offline, value, want):
    import yaml
    from opharness import CHART
    args = ["--set", f"allowControlPlanePlacement={value}"] if value else []
    docs = list(yaml.safe_load_all(helm_offline("template", "x", str(CHART), *args).stdout))
    dep = next(d for d in docs if d and d.get("kind") == "Deployment")
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PROMPTCACHE_OPERATOR_ALLOW_CONTROL_PLANE_PLACEMENT"] == want
