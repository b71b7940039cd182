"""The CRD schema, the operator's typed spec model, the chart (copy of the CRD, values.yaml, values.schema.json)
and the examples agree with each other. No API server needed."""
from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import jsonschema
import pytest
import yaml

from promptcache.operator import model
from promptcache.operator.builders import OperatorDefaults
from promptcache.operator.model import PromptCacheSpec, json_name

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "promptcache.io_promptcaches.yaml"
CHART = ROOT / "charts" / "promptcache-operator"


def crd_doc() -> dict:
    return yaml.safe_load(CRD.read_text())


def spec_schema() -> dict:
    return crd_doc()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_chart_crd_is_identical_to_source_of_truth():
    copy = CHART / "crds" / CRD.name
    assert copy.read_bytes() == CRD.read_bytes(), "run hack/sync-crds.sh"


def test_crd_names_and_shape():
    doc = crd_doc()
    assert doc["metadata"]["name"] == f"{model.PLURAL}.{model.GROUP}"
    assert doc["spec"]["group"] == model.GROUP
    assert doc["spec"]["names"]["kind"] == model.KIND
    assert doc["spec"]["names"]["shortNames"] == ["pc", "pcache"]
    (v,) = doc["spec"]["versions"]
    assert v["name"] == model.VERSION and v["subresources"] == {"status": {}}
    cols = {c["name"] for c in v["additionalPrinterColumns"]}
    assert {"Ready", "Hit-Ratio", "Memory", "Age"} <= cols


def _unwrap(tp: Any) -> Any:
    if get_origin(tp) in (typing.Union, __import__("types").UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _compare(cls: type, schema: dict, path: str) -> list[str]:
    """Dataclass fields vs schema properties: names, required, defaults, enums, types."""
    problems = []
    hints = typing.get_type_hints(cls)
    fields = {json_name(f): f for f in dataclasses.fields(cls)}
    props = schema.get("properties", {})
    if set(fields) != set(props):
        problems.append(f"{path}: model {sorted(fields)} != CRD {sorted(props)}")
    required_model = {k for k, f in fields.items()
                      if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    if required_model != set(schema.get("required", [])):
        problems.append(f"{path}: required model {sorted(required_model)} != CRD {schema.get('required', [])}")
    for key, f in fields.items():
        if key not in props:
            continue
        p = props[key]
        tp = _unwrap(hints[f.name])
        if dataclasses.is_dataclass(tp):
            problems += _compare(tp, p, f"{path}.{key}")
            if "default" in p:  # object default {} -> the model's defaults equal the CRD's nested defaults
                if p["default"] != {}:
                    problems.append(f"{path}.{key}: object default must be {{}}")
            continue
        if get_origin(tp) is Literal and sorted(map(str, get_args(tp))) != sorted(map(str, p.get("enum", []))):
            problems.append(f"{path}.{key}: enum model {get_args(tp)} != CRD {p.get('enum')}")
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        if default in ({}, ()):
            default = None  # empty collections: "nothing", the CRD has no default
        if default is not None:
            as_json = model.to_dict(default)
            if p.get("default") != as_json:
                problems.append(f"{path}.{key}: default model {as_json!r} != CRD {p.get('default')!r}")
        elif "default" in p:
            problems.append(f"{path}.{key}: CRD default {p['default']!r} but the model has none")
        expect = {str: "string", int: "integer", float: "number", bool: "boolean"}.get(tp)
        if get_origin(tp) is Literal:
            expect = "string"
        if get_origin(tp) is tuple:
            expect = "array"
        if get_origin(tp) is dict:
            expect = "object"
        if expect and p.get("type") != expect:
            problems.append(f"{path}.{key}: type model {expect} != CRD {p.get('type')}")
    return problems


def test_crd_schema_matches_spec_model():
    assert _compare(PromptCacheSpec, spec_schema(), "spec") == []


def test_crd_chunk_tokens_rule_matches_model():
    rule = spec_schema()["properties"]["cachePolicy"]["properties"]["chunkTokens"]["x-kubernetes-validations"][0]
    allowed = [int(x) for x in re.search(r"\[(.*)\]", rule["rule"]).group(1).split(",")]
    assert tuple(allowed) == model.CHUNK_TOKENS_ALLOWED
    assert all(n & (n - 1) == 0 for n in allowed)


def test_crd_model_string_bounds_match_model():
    props = spec_schema()["properties"]["model"]["properties"]
    assert (props["name"]["minLength"], props["name"]["maxLength"]) == (1, model.MODEL_NAME_MAX)
    assert (props["revision"]["minLength"], props["revision"]["maxLength"]) == (1, model.MODEL_REVISION_MAX)


def test_crd_byte_quantities_are_bounded_as_the_model_bounds_them():
    """Every quantity rule of the CRD (all of them byte sizes) refuses 8Ei and more, as the model does (the sidecar's
    flags and a Kubernetes resource value hold at most 2^63 - 1)."""
    rules = re.findall(r"rule: (isQuantity\(self\).*)", CRD.read_text())
    assert len(rules) >= 7
    assert all("quantity(self).isLessThan(quantity('8Ei'))" in r for r in rules), rules
    assert model.quantity.MAX_INT64 == 8 * 2**60 - 1


def test_sidecar_enums_match_the_sidecar():
    """The CRD's eviction policies and quantization modes include every one the sidecar implements."""
    policies = pytest.importorskip("promptcache.sidecar.policies")
    keys = pytest.importorskip("promptcache.contract.keys")
    assert set(policies.POLICIES) <= set(model.EVICTION_POLICIES)
    assert set(keys.QUANT_MODES) <= set(model.QUANTIZATION_MODES)


def test_values_yaml_validates_against_values_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(values, schema)


def test_values_schema_agrees_with_crd_and_operator():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    crd_image = spec_schema()["properties"]["image"]["properties"]
    side = schema["properties"]["sidecarImage"]["properties"]
    assert side["pullPolicy"]["enum"] == crd_image["pullPolicy"]["enum"] == list(model.PULL_POLICIES)
    assert set(side) <= set(crd_image)
    # The chart's default sidecar image is the operator's built-in default.
    d = OperatorDefaults()
    assert values["sidecarImage"]["repository"] == d.image_repository
    assert values["sidecarImage"]["pullPolicy"] == d.image_pull_policy
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (values["sidecarImage"]["tag"] or chart["appVersion"]) == d.image_tag
    # The chart's PriorityClass is the one PromptCaches run with by default: the operator's default (which the
    # chart sets from priorityClass.name, PROMPTCACHE_OPERATOR_DEFAULT_PRIORITY_CLASS), not a CRD default (which
    # the API server would store in every PromptCache, whatever the chart's name).
    pc = spec_schema()["properties"]["placement"]["properties"]["priorityClassName"]
    assert "default" not in pc and "minLength" not in pc  # unset or "": the operator's default
    assert values["priorityClass"]["name"] == d.priority_class == model.DEFAULT_PRIORITY_CLASS
    assert PromptCacheSpec.from_dict(_minimal_spec()).placement.priorityClassName is None
    pc_values = schema["properties"]["priorityClass"]["properties"]["name"]
    assert pc["maxLength"] == pc_values["maxLength"] == 253
    assert re.compile(pc_values["pattern"]).pattern.strip("^$") == model._SECRET_NAME.pattern.strip("^$")
    deployment = (CHART / "templates" / "deployment.yaml").read_text()
    assert re.search(r"- name: PROMPTCACHE_OPERATOR_DEFAULT_PRIORITY_CLASS\n\s+value: "
                     r"\{\{ \.Values\.priorityClass\.name \| quote \}\}", deployment)


def _minimal_spec() -> dict:
    return yaml.safe_load((ROOT / "examples" / "promptcache-minimal.yaml").read_text())["spec"]


def _leaves(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict) and v and k not in ("resources", "labels"):  # free-form maps: one value
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def test_every_value_is_documented():
    text = (CHART / "values.yaml").read_text().splitlines()
    values = yaml.safe_load("\n".join(text))
    schema = json.loads((CHART / "values.schema.json").read_text())
    for leaf in _leaves(values):
        # documented in values.yaml: a "# --" comment directly above the key
        key = leaf.split(".")[-1]
        idx = [i for i, line in enumerate(text) if re.match(rf"^\s*{re.escape(key)}:", line)]
        assert idx, leaf
        assert any(text[i - 1].lstrip().startswith("# ") for i in idx), f"{leaf} has no comment in values.yaml"
        # and in values.schema.json: a description
        node = schema
        for part in leaf.split("."):
            node = node["properties"][part]
        assert node.get("description"), f"{leaf} has no description in values.schema.json"


@pytest.mark.parametrize("name", ["minimal", "full"])
def test_examples_parse_with_the_model(name):
    doc = yaml.safe_load((ROOT / "examples" / f"promptcache-{name}.yaml").read_text())
    assert doc["apiVersion"] == f"{model.GROUP}/{model.VERSION}" and doc["kind"] == model.KIND
    PromptCacheSpec.from_dict(doc["spec"])


def test_full_example_sets_every_field():
    doc = yaml.safe_load((ROOT / "examples" / "promptcache-full.yaml").read_text())

    def missing(cls, data, path):
        out = []
        for f in dataclasses.fields(cls):
            k = json_name(f)
            tp = _unwrap(typing.get_type_hints(cls)[f.name])
            if k not in data:
                if not (cls is model.Model and k == "revision") and not (cls is model.Image and k == "digest"):
                    out.append(f"{path}.{k}")
            elif dataclasses.is_dataclass(tp):
                out += missing(tp, data[k], f"{path}.{k}")
        return out
    assert missing(PromptCacheSpec, doc["spec"], "spec") == []


def test_chart_readme_is_current():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, str(ROOT / "hack" / "gen-chart-readme.py"), "--check"])
    assert r.returncode == 0, "charts/promptcache-operator/README.md is stale: run hack/gen-chart-readme.py"


def test_zero_copy_host_paths_agree_across_chart_crd_and_operator():
    """The chart's default zeroCopy.allowedHostPaths is the operator's built-in default, and the chart's, the
    CRD's and the model's host path rule are one pattern."""
    from promptcache.operator import builders

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert tuple(values["zeroCopy"]["allowedHostPaths"]) == OperatorDefaults().zero_copy_host_paths \
        == builders.DEFAULT_ZERO_COPY_HOST_PATHS
    crd = spec_schema()["properties"]["zeroCopy"]["properties"]["hostPath"]
    chart = json.loads((CHART / "values.schema.json").read_text())["properties"]["zeroCopy"]["properties"]
    assert crd["pattern"] == chart["allowedHostPaths"]["items"]["pattern"] == model._HOST_PATH.pattern
    assert crd["maxLength"] == chart["allowedHostPaths"]["items"]["maxLength"] == model.HOST_PATH_MAX


@pytest.mark.parametrize("path,regex", [
    ("image.tag", model._IMAGE_TAG),
    ("image.repository", model._IMAGE_REPOSITORY),
    ("alerts.for", model._PROM_DURATION),
    ("model.weightsDigest", re.compile(r"sha256:[a-f0-9]{64}")),
    ("image.digest", re.compile(r"sha256:[a-f0-9]{64}")),
    ("zeroCopy.hostPath", model._HOST_PATH),
])
def test_crd_patterns_are_the_models(path, regex):
    """A string field the model checks with a pattern carries the same pattern in the CRD (anchored), so the API
    server refuses what the operator would (spec.image.tag had none)."""
    node = spec_schema()
    for part in path.split("."):
        node = node["properties"][part]
    assert node["pattern"] == "^" + regex.pattern.strip("^$") + "$", path


def test_chart_patterns_agree_with_the_crd():
    """The chart's sidecarImage (the operator's default spec.image) and cacheAlerts.for take what the CRD takes."""
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]
    crd = spec_schema()["properties"]
    side = schema["sidecarImage"]["properties"]
    assert side["repository"]["pattern"] == crd["image"]["properties"]["repository"]["pattern"]
    assert side["tag"]["pattern"] == "^(" + model._IMAGE_TAG.pattern + ")?$"  # empty: the chart's appVersion
    assert schema["cacheAlerts"]["properties"]["for"]["pattern"] == crd["alerts"]["properties"]["for"]["pattern"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert model._IMAGE_REPOSITORY.fullmatch(values["sidecarImage"]["repository"])


def test_crd_refuses_the_pod_annotations_the_model_refuses():
    """The CRD's rule on spec.pod.annotations matches keys with the model's pattern (CEL string: '\\' doubled)."""
    rules = [v["rule"] for v in spec_schema()["properties"]["pod"]["properties"]["annotations"]
             ["x-kubernetes-validations"]]
    cel = model.RESERVED_POD_ANNOTATION_PATTERN.replace("\\", "\\\\")
    assert f"!self.exists(k, k.matches('{cel}'))" in rules
