"""The API of vLLM's KV connector base class (KVConnectorBase_V1), read with ast from vLLM's source, a wheel or an
installed package, without importing vLLM: each method's kind, parameter names and whether it is abstract.

    python hack/vllm_base_api.py vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl > tests/vllm/kv_connector_base_v1-0.33.0.json

(`pip download --no-deps vllm==0.33.0` fetches the wheel.) tests/vllm/test_vllm_base_class.py checks the connector
against the installed vLLM's base class and against this snapshot of 0.33's.
"""
from __future__ import annotations

import ast
import json
import sys
import zipfile

BASE_PATH = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"


def class_api(source: str, class_name: str) -> dict:
    tree = ast.parse(source)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    out = {}
    for fn in cls.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        decorators = {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in fn.decorator_list}
        kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decorators), "method")
        if fn.name in out and kind == "method" and out[fn.name]["kind"] == "property":
            continue  # a property's setter
        args = fn.args
        out[fn.name] = {"kind": kind, "abstract": "abstractmethod" in decorators,
                        "params": [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs],
                        "varkw": args.kwarg is not None}
    return out


def base_source(path: str) -> str:
    if path.endswith(".whl"):
        with zipfile.ZipFile(path) as z:
            return z.read(BASE_PATH).decode()
    with open(path) as f:
        return f.read()


if __name__ == "__main__":
    print(json.dumps(class_api(base_source(sys.argv[1]), "KVConnectorBase_V1"), indent=1, sort_keys=True))
